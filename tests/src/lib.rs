//! The one test harness of fleet's end-to-end tests (`use fleet_tests::*;`).
//!
//! Every test gets its own random namespace ([`Ns`]) on the real RabbitMQ and Redis (URLs from
//! `AMQP_ADDR` / `REDIS_URL`, defaulting to loopback), runs the scheduler and workers
//! in-process ([`start_scheduler`], [`start_worker`]) or as processes where it kills them
//! ([`WorkerProcess`], [`SchedulerProcess`]), and deletes its namespace at the end. A test
//! that kills, flushes or reconfigures a server starts a private one ([`PrivateRedis`],
//! [`PrivateRabbit`]) and never touches the shared ones.
//!
//! Tests synchronise on events and counters, never on quiet periods: [`wait_for`] (the one
//! poll-until-true, every wait with a timeout), [`Ns::wait_state`], [`Ns::wait_settled`] (no
//! run can start any more), [`Recorder`] / [`Attempts`] / [`Endpoint`] (what ran, where and
//! when), [`Gate`] (a run held until the test lets it go).
//!
//! | module | what |
//! |---|---|
//! | [`ns`] | the namespace fixture: publish, depths, statuses, settled/state waits, clean-up |
//! | [`wait`] | [`wait_for`] |
//! | [`inproc`] | scheduler and workers in this process |
//! | [`isolate`] | [`own_process!`]: a test that reads process-wide metrics runs in a process of its own |
//! | [`handlers`] | recording handlers and the gate |
//! | [`process`] | `fleet-worker`, `fleet-scheduler` and `fleetctl` as child processes |
//! | [`endpoint`] | a recording HTTP task endpoint for the `http` executor |
//! | [`dead`] | the dead-letter queue with every header |
//! | [`registry`] | registry and status reads from Redis |
//! | [`metrics`] | Prometheus pages and JSON documents over HTTP |
//! | [`timing`] | the short heartbeat and health timings of the lifecycle tests |
//! | [`servers`] | private servers and a test PKI |
//! | [`skip`] | a test whose servers are missing fails (opt-out for laptops) |

pub mod api;
pub mod dead;
pub mod endpoint;
pub mod handlers;
pub mod inproc;
pub mod isolate;
pub mod metrics;
pub mod ns;
pub mod process;
pub mod registry;
pub mod servers;
pub mod skip;
pub mod timing;
pub mod wait;

pub use api::*;
pub use dead::*;
pub use endpoint::*;
pub use handlers::*;
pub use inproc::*;
pub use isolate::*;
pub use metrics::*;
pub use ns::*;
pub use process::*;
pub use registry::*;
pub use servers::*;
pub use skip::*;
pub use timing::*;
pub use wait::*;
