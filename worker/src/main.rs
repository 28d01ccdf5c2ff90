//! `fleet-worker`: read the settings once, run the worker, drain on SIGTERM/SIGINT; a second
//! signal ends the drain at once, and the process exits within [`fleet::process::HARD_EXIT`]
//! of it whatever state RabbitMQ and Redis are in (the signals as the scheduler's:
//! [`fleet::process::Signals`]).
//!
//! Exit codes: 0 after a clean drain (and for `--help` / `--version`, which start nothing);
//! 2 for a bad setting or a permanent broker / Redis error (login refused, unknown vhost, a
//! queue that exists with other arguments); 1 for anything else (a drain cut short).

use std::process::ExitCode;

use fleet::process::Signals;
use fleet::settings::Settings;
use fleet::settings::{Early, WorkerArgs};
use fleet_worker::{Worker, WorkerConfig};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Early::Print(text) = fleet::settings::early::<WorkerArgs>(&args) {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    let (settings, cfg) = match Settings::from_env()
        .map(|s| s.with_command_line(args))
        .and_then(|s| WorkerConfig::from_settings(&s).map(|c| (s, c)))
    {
        Ok(v) => v,
        Err(e) => return fleet::error::report("fleet-worker", &e.into()),
    };
    fleet::process::telemetry::init(&cfg.common.log_format);
    let spans = match fleet::trace::init(cfg.common.otlp_endpoint.as_deref(), "fleet-worker") {
        Ok(s) => s,
        Err(e) => return fleet::error::report("fleet-worker", &e.into()),
    };
    for warning in fleet::settings::unknown(&settings) {
        tracing::warn!("{warning}");
    }

    // Build → start → drain (linkerd2-proxy's `main.rs`): the first signal asks for the drain
    // (as `POST /drain` or the scheduler's drain request do), the second one forces it.
    let signals = Signals::listen();
    let grace = cfg.drain_grace;
    let result = match Worker::builder(cfg)
        .force_shutdown(signals.force.clone())
        .start(signals.drain.clone())
        .await
    {
        Ok(Some(running)) => {
            running.draining().await;
            running.drain(grace).await
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Some(spans) = spans {
        spans.shutdown().await;
    }
    signals.stop();
    fleet::error::finish("fleet-worker", result.map_err(edge))
}

/// A worker's error at the binary's edge: a library error stays itself, so its exit code
/// (2 for a bad setting or a permanent refusal) is read from it ([`fleet::error::exit_code`]).
fn edge(e: fleet_worker::Error) -> anyhow::Error {
    match e {
        fleet_worker::Error::Fleet(e) => e.into(),
        e => e.into(),
    }
}
