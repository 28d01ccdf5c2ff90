//! The stop signals of a daemon, handled the same way by every `main`: the first SIGTERM or
//! SIGINT (Ctrl-C) asks for a drain — stop taking work, finish what runs, leave cleanly — and
//! a second one forces the end: what still runs is given up, and if the process has not ended
//! within [`HARD_EXIT`] of it (a call stuck on a dead server), a plain thread ends it with
//! exit code 1. That thread needs nothing from the async runtime, so a wedged runtime cannot
//! keep the process alive.

use std::time::Duration;

use tokio::sync::mpsc;
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
    tasks: [JoinHandle<()>; 2],
}

impl Signals {
    /// Listens for SIGTERM and SIGINT on spawned tasks (call it inside the runtime): the first
    /// cancels [`Signals::drain`], the second [`Signals::force`] and arms the hard exit.
    pub fn listen() -> Self {
        let drain = CancellationToken::new();
        let force = CancellationToken::new();
        let (tx, rx) = mpsc::unbounded_channel();
        let forward = tokio::spawn(async move { while signal().await && tx.send(()).is_ok() {} });
        let answer = tokio::spawn(on_signals(rx, drain.clone(), force.clone(), hard_exit));
        Signals {
            drain,
            force,
            tasks: [forward, answer],
        }
    }

    /// Stops listening, once the daemon has ended by itself.
    pub fn stop(self) {
        for t in self.tasks {
            t.abort();
        }
    }
}

/// What the signals arriving on `signals` do: the first cancels `drain`, the second `force`
/// and calls `arm` (the hard exit; a test passes a probe).
async fn on_signals(
    mut signals: mpsc::UnboundedReceiver<()>,
    drain: CancellationToken,
    force: CancellationToken,
    arm: impl FnOnce(),
) {
    if signals.recv().await.is_none() {
        return;
    }
    tracing::info!("signal received: draining (send another to stop at once)");
    drain.cancel();
    if signals.recv().await.is_none() {
        return;
    }
    tracing::warn!("second signal: stopping now");
    force.cancel();
    arm();
}

/// Ends the process [`HARD_EXIT`] from now (exit 1, the log flushed), from a plain thread.
fn hard_exit() {
    std::thread::spawn(|| {
        std::thread::sleep(HARD_EXIT);
        crate::process::telemetry::flush();
        std::process::exit(1);
    });
}

/// The next SIGTERM or SIGINT (SIGINT alone where SIGTERM cannot be listened to); `false` when
/// neither can be listened to.
async fn signal() -> bool {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            return tokio::select! {
                r = term.recv() => r.is_some(),
                r = tokio::signal::ctrl_c() => r.is_ok(),
            };
        }
    }
    tokio::signal::ctrl_c().await.is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_signal_drains_the_second_forces() {
        let (tx, rx) = mpsc::unbounded_channel();
        let (drain, force) = (CancellationToken::new(), CancellationToken::new());
        let armed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = armed.clone();
        let task = tokio::spawn(on_signals(rx, drain.clone(), force.clone(), move || {
            probe.store(true, std::sync::atomic::Ordering::SeqCst)
        }));
        tx.send(()).unwrap();
        drain.cancelled().await;
        tokio::task::yield_now().await;
        assert!(!force.is_cancelled());
        assert!(!armed.load(std::sync::atomic::Ordering::SeqCst));
        tx.send(()).unwrap();
        task.await.unwrap();
        assert!(force.is_cancelled());
        assert!(armed.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[tokio::test]
    async fn no_signal_no_drain() {
        let (tx, rx) = mpsc::unbounded_channel::<()>();
        let (drain, force) = (CancellationToken::new(), CancellationToken::new());
        drop(tx);
        on_signals(rx, drain.clone(), force.clone(), || {}).await;
        assert!(!drain.is_cancelled() && !force.is_cancelled());
    }
}
