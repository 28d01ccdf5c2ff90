//! The waits of the harness. A test waits on an event or a counter with [`wait_for`] (poll a
//! condition until it holds, or fail after a timeout), never on a fixed sleep. Where time
//! passing is itself the point, the wait says which kind it is:
//! - [`always_for`]: an invariant checked at every look over a period (the dual of
//!   [`wait_for`]: it fails at the first look that does not hold);
//! - [`quiet_for`]: a quiet period — nothing may happen in it, and the test checks after it
//!   that nothing did (no second fire, no copy started, nothing dead-lettered);
//! - [`scenario_pause`]: a period the scenario is made of — a measurement window, an outage
//!   of a given length, the pace of an offered load, a clock passing a margin.

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

/// Checks `check` every `every` for `period`: an invariant that must hold at every look
/// (`what` names it). Returns the number of looks (at least one).
///
/// # Errors
/// The first look whose check fails, with its error and when it came; a look that gets no
/// answer within `period` (and at least 1 s) fails too.
pub async fn always_for<F, Fut>(
    what: &str,
    period: Duration,
    every: Duration,
    mut check: F,
) -> Result<u32>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<()>>,
{
    let start = Instant::now();
    let mut looks = 0;
    loop {
        let left = period.saturating_sub(start.elapsed());
        match tokio::time::timeout(left.max(CHECK_FLOOR), check()).await {
            Ok(Ok(())) => looks += 1,
            Ok(Err(e)) => {
                return Err(e.context(format!(
                    "{what}: broken {:?} into its {period:?}, at look {}",
                    start.elapsed(),
                    looks + 1
                )))
            }
            Err(_) => bail!("{what}: look {} got no answer", looks + 1),
        }
        if start.elapsed() >= period {
            return Ok(looks);
        }
        tokio::time::sleep(every.min(period.saturating_sub(start.elapsed()))).await;
    }
}

/// Lets `period` pass as a quiet period: `_why` says what must not happen in it, which the
/// test checks right after. Not a wait for an event — use [`wait_for`] for those.
pub async fn quiet_for(period: Duration, _why: &str) {
    tokio::time::sleep(period).await;
}

/// Lets `period` pass because the scenario is made of it: `_why` names the measurement window,
/// outage, pace or clock margin it is. Not a wait for an event — use [`wait_for`] for those.
pub async fn scenario_pause(period: Duration, _why: &str) {
    tokio::time::sleep(period).await;
}

/// The deadline of one test's namespace: `FLEET_TEST_DEADLINE_S` seconds (default 600; the
/// longest test, a cluster test, holds its namespace about 2 minutes); `None` when it is 0
/// (no deadline).
pub fn test_deadline() -> Option<Duration> {
    let secs = std::env::var("FLEET_TEST_DEADLINE_S")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(600);
    (secs > 0).then(|| Duration::from_secs(secs))
}

/// Bounds every test: once a test has held a namespace for [`test_deadline`], the watchdog
/// prints the tests holding one (with their ages), stops the private servers and fleet
/// processes the binary started, and exits with code 101 — so a wait with no bound fails with
/// its test's name instead of holding the suite until CI's limit. The exit ends the whole
/// e2e binary (a stuck test's thread cannot be stopped alone). One watchdog thread per
/// process, started by the first namespace or in-process component; it looks every second.
pub fn watchdog() {
    static STARTED: std::sync::Once = std::sync::Once::new();
    if NO_WATCHDOG.load(std::sync::atomic::Ordering::SeqCst) {
        return;
    }
    let Some(deadline) = test_deadline() else {
        return;
    };
    STARTED.call_once(|| {
        let _ = std::thread::Builder::new()
            .name("fleet-test-watchdog".into())
            .spawn(move || loop {
                std::thread::sleep(Duration::from_secs(1));
                let running = RUNNING.lock().map(|r| r.clone()).unwrap_or_default();
                if !running.iter().any(|r| r.since.elapsed() > deadline) {
                    continue;
                }
                let list = running
                    .iter()
                    .map(|r| format!("{} ({}, {} s)", r.test, r.ns, r.since.elapsed().as_secs()))
                    .collect::<Vec<_>>()
                    .join(", ");
                // Straight to the stderr descriptor: `eprintln!` in a thread a test started
                // goes to that test's captured output, which an exit never shows.
                let message = format!(
                    "\nfleet-tests watchdog: a test has held its namespace for over {} s \
                     (FLEET_TEST_DEADLINE_S): a wait in it has no bound. Tests holding a \
                     namespace: [{list}]. Exiting 101.\n",
                    deadline.as_secs()
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

/// A namespace held by a test, for [`watchdog`].
#[derive(Clone)]
struct Held {
    /// The test's name (libtest names each test's thread after it).
    test: String,
    /// The namespace.
    ns: String,
    since: Instant,
}

/// The namespaces held now, each from [`Ns`](crate::Ns)'s creation to its drop.
static RUNNING: std::sync::Mutex<Vec<Held>> = std::sync::Mutex::new(Vec::new());

/// Counts namespace `ns` as held by the calling test from now on.
pub(crate) fn hold(ns: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("a test thread with no name")
        .to_string();
    if let Ok(mut r) = RUNNING.lock() {
        r.push(Held {
            test,
            ns: ns.to_string(),
            since: Instant::now(),
        });
    }
}

/// Namespace `ns` is no longer held (cleaned up or dropped).
pub(crate) fn release(ns: &str) {
    if let Ok(mut r) = RUNNING.lock() {
        r.retain(|h| h.ns != ns);
    }
}
