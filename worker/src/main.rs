//! `fleet-worker`: read the settings once, run the worker, drain on SIGTERM/SIGINT; a second
//! signal ends the drain at once.

use std::process::ExitCode;

use tokio_util::sync::CancellationToken;

use fleet::config::Settings;
use fleet_worker::{Worker, WorkerConfig};

#[tokio::main]
async fn main() -> ExitCode {
    let cfg = match Settings::from_env().and_then(|s| WorkerConfig::from_settings(&s)) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("fleet-worker: {e}");
            return ExitCode::from(2);
        }
    };
    fleet::telemetry::init(&cfg.common.log_format);

    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    let signals = tokio::spawn(on_signals(shutdown.clone(), force.clone()));
    let result = Worker::builder(cfg).force_shutdown(force).run(shutdown).await;
    signals.abort();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "fleet-worker stopped with an error");
            eprintln!("fleet-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// First signal: drain. Second: stop now.
async fn on_signals(shutdown: CancellationToken, force: CancellationToken) {
    signal().await;
    tracing::info!("signal received: draining (send another to stop at once)");
    shutdown.cancel();
    signal().await;
    tracing::warn!("second signal: stopping now");
    force.cancel();
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
