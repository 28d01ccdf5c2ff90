//! fleet's scheduler: decides *whether* to dispatch (backpressure, rate limit) and *where*
//! (label routing, least-loaded / round-robin / weighted choice, atomic reservation).
//!
//! Modules: [`config`], [`session`] (what one AMQP session's loops share: connection,
//! publishing channel, store, names, config), [`view`] (groups and queue depths sampled once
//! per tick for every loop that reads them), [`backpressure`] (Green/Yellow/Red), [`ingress`]
//! (consuming loops), [`dispatch`] (route, park, delay, dead-letter a batch: read, reserve,
//! decide, publish; the orphan rescue), [`tiers`] (the delay tiers held until each hop
//! ends), [`park`] (waiting for room: park queues, release
//! loops, the parked flag, discovery), [`pause`] (pauses in force: groups, lanes, kinds),
//! [`batch`] (batches' callbacks, DAG releases and stall sweeps), [`batch_def`] (a batch's
//! definition, checked and recorded: `POST /v1/batches` and the AMQP closing message),
//! [`batch_close`] (the ingress's closing messages), [`health`] (eviction), [`backstop`] (the broker's own
//! dead letters given a reason and a status), [`reclaim`] (departed groups removed),
//! [`probe`] (critical-lane probes), [`stats`] (gauges for dashboards and autoscalers),
//! [`schedule`] (periodic cron schedules), [`series`] (the console's 15-minute history),
//! [`api`] (HTTP), [`console`] (the web console at `/ui`), [`scheduler`] (the process, its
//! shutdown stages and its loops).
//!
//! Every loop has one shape: a struct with `async fn run(self, shutdown: CancellationToken)`
//! whose `select! { biased; … }` checks shutdown first; periodic ones tick with
//! [`fleet::process::Ticker`].

pub mod api;
pub mod backpressure;
pub mod backstop;
pub mod batch;
pub mod batch_close;
pub mod batch_def;
pub mod canary;
pub mod config;
pub mod console;
pub mod control;
pub mod dispatch;
pub mod health;
pub mod index_trim;
pub mod ingress;
pub mod park;
pub mod pause;
pub mod probe;
pub mod reclaim;
pub mod scaling;
pub mod schedule;
pub mod scheduler;
pub mod series;
pub mod session;
pub mod stats;
pub mod tiers;
pub mod view;

pub use config::SchedulerConfig;
pub use scheduler::run;
