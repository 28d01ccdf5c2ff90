//! `fleet-scheduler`: read the config once, serve, run until SIGTERM/SIGINT; a second signal
//! ends the stop at once, and the process exits within [`fleet::process::HARD_EXIT`] of it
//! whatever state RabbitMQ and Redis are in (the signals as the worker's:
//! [`fleet::process::Signals`]).
//!
//! Exit codes: 0 after a clean stop (and for `--help` / `--version`, which start nothing);
//! 2 for a bad setting (including an unreadable `FLEET_CONFIG` file) or a permanent broker
//! error (login refused, unknown vhost, a queue that exists with other arguments); 1 for any
//! other failure.

use std::process::ExitCode;

use fleet::process::Signals;
use fleet::settings::Settings;
use fleet::settings::{Early, SchedulerArgs};

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Early::Print(text) = fleet::settings::early::<SchedulerArgs>(&args) {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    let settings = match Settings::from_env() {
        Ok(s) => s.with_command_line(args),
        Err(e) => return fleet::error::report("fleet-scheduler", &e.into()),
    };
    let cfg = match fleet_scheduler::SchedulerConfig::from_settings(&settings) {
        Ok(c) => c,
        Err(e) => return fleet::error::report("fleet-scheduler", &e.into()),
    };
    fleet::process::telemetry::init(&cfg.common.log_format);
    let spans = match fleet::trace::init(cfg.common.otlp_endpoint.as_deref(), "fleet-scheduler") {
        Ok(s) => s,
        Err(e) => return fleet::error::report("fleet-scheduler", &e.into()),
    };
    for warning in fleet::settings::unknown(&settings) {
        tracing::warn!("{warning}");
    }
    let listener = match fleet::http::bind(&cfg.common.http_addr).await {
        Ok(l) => l,
        Err(e) => return fleet::error::report("fleet-scheduler", &e.into()),
    };
    tracing::info!(addr = %cfg.common.http_addr, namespace = %cfg.common.namespace, "fleet-scheduler starting");
    let signals = Signals::listen();
    let result = tokio::select! {
        r = fleet_scheduler::run(cfg, listener, signals.drain.clone()) => r,
        _ = signals.force.cancelled() => Err(anyhow::anyhow!("stop interrupted by a second signal")),
    };
    if let Some(spans) = spans {
        spans.shutdown().await;
    }
    signals.stop();
    fleet::error::finish("fleet-scheduler", result)
}
