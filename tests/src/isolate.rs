//! A test that reads process-wide figures runs in a process of its own.
//!
//! The end-to-end tests are one binary (`tests/tests/e2e/`), so its tests share one process,
//! and with it the one Prometheus registry `fleet::metrics::install` sets up per process:
//! every in-process scheduler's and worker's counters, gauges and histograms, summed over the
//! tests that run at the same time (unlabelled series such as `fleet_tasks_duplicate_total`,
//! gauges such as `fleet_pressure_state`, and the scheduler's `/v1/series`, which takes its
//! submitted / dispatched / refused figures from the registry). A test that asserts on such a
//! figure starts with [`own_process!`](crate::own_process): it runs again, alone, in a child
//! process of the same binary, and passes or fails with it, so the figures it reads are its
//! own — as when every story was a binary of its own, but per test.
//!
//! A lock the test must hold against the other tests of this process (`reclaim::TURN`, ...) is
//! taken before `own_process!()`: the parent holds it while the child runs.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// Set in the child's environment to the name of the one test it runs; that test then runs
/// in the child instead of starting another.
pub const OWN_PROCESS_VAR: &str = "FLEET_E2E_OWN_PROCESS";

/// What [`own_process!`](crate::own_process) does: `None` in the child (the test runs here,
/// go on); otherwise runs the calling test in a child process of this binary
/// (`<exe> <test> --exact --include-ignored --nocapture --test-threads=1`, the environment
/// inherited) and returns its outcome: `Ok` when it passed, with its output printed here.
///
/// The test's name is its thread's: libtest runs each test on a thread named after it, so
/// call this from the test's own body (not from a spawned task).
///
/// # Errors
/// The child failed (its output says why), ran no test of that name, could not be started,
/// or outlived [`test_deadline`](crate::test_deadline) + 2 minutes (then it is killed; its
/// own watchdog normally ends it first).
pub async fn run_in_own_process() -> Option<Result<()>> {
    let Some(test) = std::thread::current().name().map(str::to_owned) else {
        return Some(Err(anyhow::anyhow!(
            "own_process!: this thread has no name; call it from the test's body"
        )));
    };
    if std::env::var(OWN_PROCESS_VAR).is_ok_and(|v| v == test) {
        return None;
    }
    Some(run_child(&test).await)
}

async fn run_child(test: &str) -> Result<()> {
    let exe = std::env::current_exe().context("own_process!: the test binary's path")?;
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args([
        test,
        "--exact",
        "--include-ignored",
        "--nocapture",
        "--test-threads=1",
    ])
    .env(OWN_PROCESS_VAR, test)
    .stdin(Stdio::null())
    .kill_on_drop(true);
    let out = match crate::test_deadline() {
        Some(d) => {
            let bound = d + Duration::from_secs(120);
            tokio::time::timeout(bound, cmd.output())
                .await
                .with_context(|| format!("{test} in its own process ran over {bound:?}"))?
        }
        None => cmd.output().await,
    }
    .with_context(|| format!("starting {test} in its own process"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    print!("{stdout}");
    eprint!("{stderr}");
    if !out.status.success() {
        bail!("{test} failed in its own process ({})", out.status);
    }
    if !stdout.contains("test result: ok. 1 passed") {
        bail!("the child process ran no test named {test}");
    }
    Ok(())
}

/// Runs the calling test in a process of its own (see [`isolate`](crate::isolate)): the first
/// line of a test that asserts on `/metrics` or `/v1/series` of an in-process component.
/// Returns the child's outcome from the test, or goes on when this is the child.
#[macro_export]
macro_rules! own_process {
    () => {
        if let Some(done) = $crate::run_in_own_process().await {
            return done;
        }
    };
}
