//! `fleet-scheduler`: read the config once, serve, run until SIGTERM/SIGINT.

use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let settings = fleet::config::Settings::from_env()?;
    let cfg = match fleet_scheduler::SchedulerConfig::from_settings(&settings) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("fleet-scheduler: {e}");
            std::process::exit(2);
        }
    };
    fleet::telemetry::init(&cfg.common.log_format);
    let listener = match fleet::http::bind(&cfg.common.http_addr).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("fleet-scheduler: {e}");
            std::process::exit(2);
        }
    };
    tracing::info!(addr = %cfg.common.http_addr, namespace = %cfg.common.namespace, "fleet-scheduler starting");
    let shutdown = CancellationToken::new();
    let sd = shutdown.clone();
    tokio::spawn(async move {
        wait_for_signal().await;
        tracing::info!("signal received; shutting down");
        sd.cancel();
    });
    fleet_scheduler::run(cfg, listener, shutdown).await
}

async fn wait_for_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = ctrl_c.await;
}
