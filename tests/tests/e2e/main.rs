//! fleet's end-to-end tests: one test binary (`cargo test -p fleet-tests --test e2e`), one
//! module per story, against the real RabbitMQ and Redis through the harness
//! (`fleet_tests`, tests/src). A test's name is `<module>::<test>`: run one story with
//! `cargo test -p fleet-tests --test e2e -- smoke::`, one test with
//! `-- --exact smoke::connection_loss_is_survived`.
//!
//! One binary links once instead of once per story; its tests share one process, so what a
//! process holds once is shared too:
//! - the Prometheus registry (`fleet::metrics::install`, every in-process component's
//!   figures summed): a test that reads a `/metrics` page or `/v1/series` starts with
//!   `own_process!()` and runs alone in a child process of this binary (`fleet_tests::isolate`);
//! - the tracing subscriber (`FLEET_TEST_LOG`): installed once by the first component;
//! - the watchdog (`FLEET_TEST_DEADLINE_S`): it bounds each test's namespace, not the binary;
//! - tests that must not overlap take a lock of their module (`reclaim::TURN`,
//!   `orphans::REROUTING`), before `own_process!` when they have both, so the lock is held in
//!   this process while the child runs. A test waiting for a lock holds a test thread idle, so
//!   long scenarios that must not overlap are one test run in turn (the private clusters of
//!   `cluster::`), not several behind a lock.
//!
//! No test sets an environment variable of this process: settings reach in-process
//! components as values (`Ns::settings`) and child processes through their own environment.

mod admission;
mod amqp_batches;
mod api_auth;
mod attempt_once;
mod audit;
mod bad_input;
mod batch_console;
mod batch_control;
mod batches;
mod broker_dead_letters;
mod broker_limits;
mod broker_settings;
mod cancel;
mod clock_skew;
mod cluster;
mod console;
mod consumer_timeout;
mod crash;
mod critical;
mod dags;
mod dead_letters;
mod deadlines;
mod dedupe_window;
mod delay_canary;
mod direct_dispatch;
mod drain;
mod duplicate_id;
mod ejection;
mod endpoints;
mod eviction;
mod exec_executor;
mod handler_panics;
mod http_executor;
mod integrity;
mod keys_api;
mod kinds;
mod log_hygiene;
mod memory_alarm;
mod metrics;
mod nack_cause;
mod operator;
mod orphans;
mod pause;
mod poison;
mod probes;
mod producers;
mod publish_order;
mod publisher_renewal;
mod readme_handlers;
mod reclaim;
mod reconnect;
mod redis_cluster;
mod redis_loss;
mod replay;
mod replica_wait;
mod reservation;
mod retry;
mod routing;
mod scaling;
mod scheduler_crash;
mod schedules;
mod secrets;
mod sentinel;
mod slot_release;
mod smoke;
mod status;
mod subsetting;
mod takeover;
mod tasks;
mod tenants;
mod tls;
mod trace;
mod views;
mod waiting_for_worker;
mod worker_kill;
mod workers_api;
