//! The stop signals of a daemon, handled the same way by every `main`: the first SIGTERM or
//! SIGINT (Ctrl-C) asks for a drain — stop taking work, finish what runs, leave cleanly — and
//! a second one forces the end: what still runs is given up, and if the process has not ended
//! within [`HARD_EXIT`] of it (a call stuck on a dead server), a plain thread ends it with
//! exit code 1. That thread needs nothing from the async runtime, so a wedged runtime cannot
//! keep the process alive.

use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// After a second signal the process ends within this time even if something is stuck.
pub const HARD_EXIT: Duration = Duration::from_secs(10);

/// The tokens a daemon's stop signals fire ([`Signals::listen`]).
#[derive(Debug)]
pub struct Signals {
    /// Cancelled at the first signal: drain.
    pub drain: CancellationToken,
    /// Cancelled at the second signal: stop now (the [`HARD_EXIT`] timer starts with it).
    pub force: CancellationToken,
    listener: JoinHandle<()>,
}

impl Signals {
    /// Listens for SIGTERM and SIGINT on a spawned task (call it inside the runtime): the first
    /// cancels [`Signals::drain`], the second [`Signals::force`] and arms the hard exit.
    pub fn listen() -> Self {
        let drain = CancellationToken::new();
        let force = CancellationToken::new();
        let listener = tokio::spawn(on_signals(drain.clone(), force.clone()));
        Signals {
            drain,
            force,
            listener,
        }
    }

    /// Stops listening, once the daemon has ended by itself (a later signal then ends the
    /// process as the runtime's default would, unless it is still handled elsewhere).
    pub fn stop(self) {
        self.listener.abort();
    }
}

async fn on_signals(drain: CancellationToken, force: CancellationToken) {
    signal().await;
    tracing::info!("signal received: draining (send another to stop at once)");
    drain.cancel();
    signal().await;
    tracing::warn!("second signal: stopping now");
    force.cancel();
    std::thread::spawn(|| {
        std::thread::sleep(HARD_EXIT);
        crate::process::telemetry::flush();
        std::process::exit(1);
    });
}

/// The next SIGTERM or SIGINT (SIGINT alone where SIGTERM cannot be listened to).
async fn signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
