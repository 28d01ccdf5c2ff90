//! The one wait of the harness: poll a condition until it holds, or fail after a timeout.
//! Tests wait on an event or a counter reached this way, never on a quiet period.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// The least time one check of a wait is given, however little of the wait is left.
const CHECK_FLOOR: Duration = Duration::from_secs(1);

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_every(what, timeout, Duration::from_millis(20), check).await
}

/// [`wait_for`] polling every `every` (for checks that read many keys at a time).
///
/// The whole wait is bounded, each check included: a check that never answers (a broker or
/// Redis call with no reply) is abandoned at the deadline and the wait fails saying so, so a
/// stuck call fails its test instead of hanging the suite.
pub async fn wait_for_every<T, F, Fut>(
    what: &str,
    timeout: Duration,
    every: Duration,
    mut check: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    let start = Instant::now();
    loop {
        // A check may run up to the deadline, and at least CHECK_FLOOR (the one that starts
        // just after it gets its answer, which decides between the two messages below).
        let limit = deadline.max(tokio::time::Instant::now() + CHECK_FLOOR);
        match tokio::time::timeout_at(limit, check()).await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(_) => bail!(
                "timed out after {timeout:?} waiting for {what}: its last check got no answer"
            ),
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(every).await;
    }
}

/// Bounds the whole test binary: once its first test has used the harness for `FLEET_TEST_DEADLINE_S`
/// seconds (default 600; the longest binary, the cluster tests, takes about 190 s), it prints the
/// tests still running and exits with code 101, so a wait with no bound fails its own binary
/// with a name instead of holding the suite until CI's limit. Started once, by the first
/// namespace or in-process component; 0 turns it off.
pub fn watchdog() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if NO_WATCHDOG.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    STARTED.call_once(|| {
        let secs = std::env::var("FLEET_TEST_DEADLINE_S").ok().and_then(|s| s.parse::<u64>().ok()).unwrap_or(600);
        if secs == 0 {
            return;
        }
        let _ = std::thread::Builder::new().name("fleet-test-watchdog".into()).spawn(move || {
            std::thread::sleep(Duration::from_secs(secs));
            let running = RUNNING.lock().map(|r| r.join(", ")).unwrap_or_default();
            // Straight to the stderr descriptor: `eprintln!` in a thread a test started goes to
            // that test's captured output, which an exit never shows.
            let message = format!(
                "\nfleet-tests watchdog: this test binary has run for {secs} s (FLEET_TEST_DEADLINE_S); \
                 a wait in it has no bound. Tests that made a namespace and did not clean it up: [{running}]. Exiting 101.\n"
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr(), message.as_bytes());
            // An exit runs no `Drop`: stop the private servers and fleet processes here.
            crate::servers::kill_registered_groups();
            std::process::exit(101);
        });
    });
}

static NO_WATCHDOG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns [`watchdog`] off for this process (the benchmarks, which run for as long as asked).
/// Call it before the first namespace.
pub fn no_watchdog() {
    NO_WATCHDOG.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Names of the tests (their threads' names) holding a namespace, for [`watchdog`]'s message.
pub(crate) static RUNNING: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
