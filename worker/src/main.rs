//! `fleet-worker`: read the settings once, run the worker, drain on SIGTERM/SIGINT; a second
//! signal ends the drain at once, and the process exits within [`HARD_EXIT`] of it whatever
//! state RabbitMQ and Redis are in.
//!
//! Exit codes: 0 after a clean drain (and for `--help` / `--version`, which start nothing);
//! 2 for a bad setting or a permanent broker / Redis error (login refused, unknown vhost, a
//! queue that exists with other arguments); 1 for anything else (a drain cut short).

use std::process::ExitCode;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use fleet::settings::Settings;
use fleet::settings::{Early, WorkerArgs};
use fleet_worker::{Worker, WorkerConfig};

/// After a second signal the process ends within this time even if something is stuck.
const HARD_EXIT: Duration = Duration::from_secs(10);

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
    for warning in fleet::settings::unknown(&settings) {
        tracing::warn!("{warning}");
    }

    // Build → start → drain (linkerd2-proxy's `main.rs`): the first signal asks for the drain
    // (as `POST /drain` or the scheduler's drain request do), the second one forces it.
    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    let signals = tokio::spawn(on_signals(shutdown.clone(), force.clone()));
    let grace = cfg.drain_grace;
    let result = match Worker::builder(cfg)
        .force_shutdown(force)
        .start(shutdown)
        .await
    {
        Ok(Some(running)) => {
            running.draining().await;
            running.drain(grace).await
        }
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    signals.abort();
    fleet::error::finish("fleet-worker", result)
}

/// First signal: drain. Second: stop now — and if the worker has not returned within
/// [`HARD_EXIT`] (a call stuck on a dead server), end the process from a plain thread, which
/// needs nothing from the async runtime.
async fn on_signals(shutdown: CancellationToken, force: CancellationToken) {
    signal().await;
    tracing::info!("signal received: draining (send another to stop at once)");
    shutdown.cancel();
    signal().await;
    tracing::warn!("second signal: stopping now");
    force.cancel();
    std::thread::spawn(|| {
        std::thread::sleep(HARD_EXIT);
        fleet::process::telemetry::flush();
        std::process::exit(1);
    });
}

async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
