//! The `exec` executor: runs one program per task, without a shell.
//!
//! The argv comes from configuration only; the task reaches the program as the envelope JSON
//! on its stdin, with `attempt` set to this attempt's number from 1 (plus `FLEET_TASK_ID`, `FLEET_TASK_KIND`, `FLEET_TASK_ATTEMPT`,
//! `FLEET_WORKER_ID` in its environment), so nothing in a task is ever interpreted by a shell.
//! Stdout is kept up to `exec_max_output` bytes and the rest read and discarded (never
//! buffered: a chatty program cannot exhaust memory, nor block on a full pipe). Exit 0 →
//! success with stdout (JSON if it parses, else a string); exit `exec_permanent_exit` →
//! permanent failure; any other exit or a signal → retryable, with the tail of stderr.
//! The child is killed when the run is cut (deadline, cap, shutdown): `kill_on_drop`.
//!
//! # A run's processes end with the run — and with the worker
//!
//! Each run gets its own process group, led by a *watchdog*: a one-line `/bin/sh` ([`WATCHDOG`])
//! that reads a pipe from this worker until end of file, then SIGKILLs its process group
//! (`kill -9 0`). The program is started into that group (`process_group(watchdog pid)`), so
//! everything it forks without leaving the group (its grandchildren) is in it too. The pipe's
//! write end lives only in the worker (std opens pipes close-on-exec, so no other child
//! inherits it), and the kernel closes it when the worker dies in any way — `kill -9`, a
//! panic, the OOM killer — so the group dies with the worker, at once, with no retry of the
//! same task running beside it on a peer. The worker closes the pipe itself when a run ends
//! (the program exited: anything it left behind is ended with it, and its output pipes reach
//! end of file) or is cut (deadline, cap, shutdown: the program is SIGKILLed at once by
//! `kill_on_drop`, its group by the watchdog).
//!
//! Why a watchdog process and not `PR_SET_PDEATHSIG`: the parent-death signal fires when the
//! *thread* that spawned the child exits (tokio's blocking threads end when idle: a live
//! worker would kill its own runs), it reaches only the direct child (grandchildren run on),
//! and setting it needs `unsafe` `pre_exec` (the workspace forbids unsafe code). Why `/bin/sh`
//! and not a supervisor mode of `fleet-worker` re-executing itself: the exec executor also runs
//! inside other binaries (the in-process test harness, a user's own worker built on this
//! library), where the current executable has no such mode; a POSIX shell is on every image
//! fleet ships (Debian) and needs no input from the task. The watchdog leads the group, so the
//! group id is its own pid and cannot be reused while it runs: it never signals a stranger.
//! The group is also what a cancel signals: SIGTERM to the group, then — after
//! `FLEET_CANCEL_GRACE_MS` — SIGKILL (the pipe closed, the watchdog kills the group). A
//! process that leaves the group on purpose (`setsid`, as daemons do) escapes it.

use std::process::Stdio;

use futures::future::BoxFuture;
use serde_json::Value;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::process::Command;

use super::{json_or_string, Handler, TaskContext, TaskError};
use crate::config::ExecConfig;

/// Bytes of stderr kept for the error text.
const STDERR_TAIL: usize = 2048;

/// The run's watchdog (see the module docs): deaf to the terminal's and a supervisor's
/// signals, it waits for end of file on its stdin, then SIGKILLs its process group.
pub const WATCHDOG: [&str; 3] = [
    "/bin/sh",
    "-c",
    "trap '' HUP INT QUIT TERM; while read -r _; do :; done; kill -9 0",
];

/// A run's process group, led by its watchdog. Ending it (or dropping it) closes the
/// watchdog's pipe, and the watchdog kills every process left in the group.
struct Group {
    watchdog: tokio::process::Child,
    /// The write end of the watchdog's pipe: the group lives while this is open.
    pipe: Option<tokio::process::ChildStdin>,
    /// The group's id (the watchdog's pid).
    id: i32,
}

impl Group {
    /// Starts the watchdog in a new process group of its own.
    fn start() -> Result<Group, TaskError> {
        let (sh, args) = (WATCHDOG[0], &WATCHDOG[1..]);
        let mut watchdog = Command::new(sh)
            .args(args)
            .env_clear()
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Not killed on drop: killed, it could not end the group; the pipe closing ends it.
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| {
                TaskError::retryable(format!("exec: cannot start the run's watchdog `{sh}`: {e}"))
            })?;
        let pipe = watchdog.stdin.take();
        let id = watchdog.id().and_then(|p| i32::try_from(p).ok());
        match (pipe, id) {
            (Some(pipe), Some(id)) => Ok(Group {
                watchdog,
                pipe: Some(pipe),
                id,
            }),
            _ => Err(TaskError::retryable(
                "exec: the run's watchdog exited at once",
            )),
        }
    }

    /// Kills every process left in the group (the watchdog does, on end of file).
    fn end(&mut self) {
        self.pipe = None;
    }

    /// [`Group::end`], then waits until the watchdog has done it (it dies by its own signal).
    async fn ended(mut self) {
        self.end();
        let _ = self.watchdog.wait().await;
    }
}

pub struct ExecHandler {
    cfg: ExecConfig,
}

impl ExecHandler {
    pub fn new(cfg: ExecConfig) -> Self {
        ExecHandler { cfg }
    }
}

impl Handler for ExecHandler {
    fn call(&self, task: TaskContext) -> BoxFuture<'static, Result<Value, TaskError>> {
        let cfg = self.cfg.clone();
        Box::pin(run(cfg, task))
    }

    /// A cancelled run's process group gets SIGTERM, then SIGKILL after the grace.
    fn stops_gracefully(&self) -> bool {
        true
    }
}

/// Sends SIGTERM to process group `pgid` (through `/bin/sh`'s `kill`: the workspace forbids
/// the `unsafe` of a direct `kill(2)`). The watchdog, which leads the group, ignores it and
/// stays to SIGKILL what is left when the run ends.
async fn terminate_group(pgid: i32) {
    let r = Command::new(WATCHDOG[0])
        .args(["-c", &format!("kill -s TERM -- -{pgid}")])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .await;
    if let Err(e) = r {
        tracing::warn!(error = %e, pgid, "exec: cannot signal a cancelled run's process group (it is killed at the end of the grace)");
    }
}

async fn run(cfg: ExecConfig, task: TaskContext) -> Result<Value, TaskError> {
    let (program, args) = cfg
        .argv
        .split_first()
        .ok_or_else(|| TaskError::permanent("exec: empty command"))?;
    let group = Group::start()?;
    let mut cmd = Command::new(program);
    // The worker's own settings (broker and Redis URLs with their credentials) are not the
    // task's business: the child gets the environment minus every FLEET_* variable.
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("FLEET_") {
            cmd.env_remove(key);
        }
    }
    cmd.args(args)
        .env("FLEET_TASK_ID", &task.envelope.id)
        .env("FLEET_TASK_KIND", &task.envelope.kind)
        .env("FLEET_TASK_ATTEMPT", task.attempt.to_string())
        .env("FLEET_WORKER_ID", &*task.worker_id);
    // W3C Trace Context for the program (the OpenTelemetry environment-carrier convention);
    // never inherited from the worker's own environment.
    cmd.env_remove("TRACEPARENT").env_remove("TRACESTATE");
    if let Some(t) = &task.trace {
        cmd.env("TRACEPARENT", t.traceparent());
        if let Some(state) = &t.state {
            cmd.env("TRACESTATE", state);
        }
    }
    let child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(group.id)
        .kill_on_drop(true)
        .spawn()
        // A missing or non-executable program is a configuration fault of this worker, not of
        // the task: retryable, so another worker (or this one, fixed) may run it.
        .map_err(|e| {
            let msg = format!("exec: cannot start `{program}`: {e}");
            // InvalidInput: an argument or variable holds a NUL byte (e.g. from the task's
            // kind) — no retry can start it.
            if e.kind() == std::io::ErrorKind::InvalidInput {
                TaskError::Permanent(msg)
            } else {
                TaskError::Retryable(msg)
            }
        });
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            group.ended().await;
            return Err(e);
        }
    };
    let mut group = group;

    let mut input = task.envelope.to_value();
    if let Value::Object(m) = &mut input {
        m.insert("attempt".into(), task.attempt.into());
    }
    let input = serde_json::to_vec(&input).unwrap_or_default();
    let stdin = child.stdin.take();
    let feed = async move {
        if let Some(mut stdin) = stdin {
            // The program may exit without reading its input (broken pipe): not an error.
            let _ = stdin.write_all(&input).await;
            let _ = stdin.shutdown().await;
        }
    };
    let stdout = read_capped(child.stdout.take(), cfg.max_output);
    let stderr = read_tail(child.stderr.take(), STDERR_TAIL);
    // When the program exits, whatever it left in its group is killed: a background process
    // holding stdout open cannot keep the run (and the readers) waiting.
    let pgid = group.id;
    let ran = {
        let wait = async {
            let status = child.wait().await;
            group.end();
            status
        };
        let work = async { tokio::join!(feed, stdout, stderr, wait) };
        tokio::pin!(work);
        tokio::select! {
            biased;
            r = &mut work => Some(r),
            // Cancelled by an operator: SIGTERM to the whole group (the program and what it
            // started), SIGKILL to whatever is left after the grace (the watchdog, below).
            _ = task.stop.cancelled() => {
                terminate_group(pgid).await;
                tokio::time::timeout(task.cancel_grace, &mut work).await.ok()
            }
        }
    };
    group.ended().await;
    let Some(((), out, err, status)) = ran else {
        return Err(TaskError::retryable(format!(
            "exec: `{program}` cancelled; its process group was killed after the {} ms grace",
            task.cancel_grace.as_millis()
        )));
    };
    let status =
        status.map_err(|e| TaskError::retryable(format!("exec: waiting for `{program}`: {e}")))?;

    match status.code() {
        Some(0) => Ok(json_or_string(&out)),
        Some(code) => {
            let msg = format!(
                "exec: `{program}` exited with {code}: {}",
                String::from_utf8_lossy(&err).trim()
            );
            if code == cfg.permanent_exit {
                Err(TaskError::Permanent(msg))
            } else {
                Err(TaskError::Retryable(msg))
            }
        }
        None => Err(TaskError::retryable(format!(
            "exec: `{program}` killed by a signal ({status}): {}",
            String::from_utf8_lossy(&err).trim()
        ))),
    }
}

/// Reads a pipe to its end, keeping the first `max` bytes.
async fn read_capped(pipe: Option<impl AsyncRead + Unpin>, max: usize) -> Vec<u8> {
    let Some(mut pipe) = pipe else {
        return Vec::new();
    };
    let mut kept = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                let room = max.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    kept
}

/// Reads a pipe to its end, keeping the last `max` bytes.
async fn read_tail(pipe: Option<impl AsyncRead + Unpin>, max: usize) -> Vec<u8> {
    let Some(mut pipe) = pipe else {
        return Vec::new();
    };
    let mut tail = Vec::new();
    let mut buf = vec![0u8; 8 * 1024];
    loop {
        match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                tail.extend_from_slice(&buf[..n]);
                if tail.len() > max {
                    tail.drain(..tail.len() - max);
                }
            }
        }
    }
    tail
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::super::test_support::ctx;
    use super::*;

    fn handler(argv: &[&str]) -> ExecHandler {
        ExecHandler::new(ExecConfig {
            argv: argv.iter().map(|s| s.to_string()).collect(),
            max_output: 1 << 20,
            permanent_exit: 65,
        })
    }

    fn t(payload: Value) -> TaskContext {
        ctx("job", payload, 1, Duration::from_secs(10))
    }

    #[tokio::test]
    async fn cat_returns_the_envelope_verbatim() {
        let nasty = "$(rm -rf /); echo pwned `id` | tee /tmp/x && \"quoted\" 'single' \n; exit 3";
        let out = handler(&["cat"])
            .call(t(json!({"cmd": nasty})))
            .await
            .unwrap();
        assert_eq!(out["payload"]["cmd"], nasty);
        assert_eq!(out["kind"], "job");
        assert_eq!(out["attempt"], 1);
    }

    #[tokio::test]
    async fn exit_codes_decide_the_fate() {
        let e = handler(&["false"]).call(t(Value::Null)).await.unwrap_err();
        assert!(
            matches!(&e, TaskError::Retryable(m) if m.contains("exited with 1")),
            "{e:?}"
        );
        // `sh` here is the program under test, not a shell interpreting the task.
        let e = handler(&["sh", "-c", "echo broken input >&2; exit 65"])
            .call(t(Value::Null))
            .await
            .unwrap_err();
        assert!(
            matches!(&e, TaskError::Permanent(m) if m.contains("broken input")),
            "{e:?}"
        );
        let e = handler(&["/nonexistent/program"])
            .call(t(Value::Null))
            .await
            .unwrap_err();
        assert!(matches!(e, TaskError::Retryable(_)), "{e:?}");
        let out = handler(&["echo", "plain", "text"])
            .call(t(Value::Null))
            .await
            .unwrap();
        assert_eq!(out, json!("plain text\n"));
    }

    #[tokio::test]
    async fn output_is_capped_and_the_rest_discarded() {
        let mut h = handler(&["head", "-c", "5000000", "/dev/zero"]);
        h.cfg.max_output = 1000;
        let out = h.call(t(Value::Null)).await.unwrap();
        let s = out.as_str().unwrap();
        assert_eq!(s.len(), 1000);
    }

    #[tokio::test]
    async fn dropped_run_kills_the_child() {
        let h = handler(&["sleep", "30"]);
        let started = std::time::Instant::now();
        let r = tokio::time::timeout(Duration::from_millis(200), h.call(t(Value::Null))).await;
        assert!(r.is_err());
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    /// Whether process `pid` runs (a zombie does not: it is dead, waiting to be reaped).
    fn alive(pid: &str) -> bool {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
            .is_some_and(|rest| !rest.starts_with('Z'))
    }

    async fn gone_within(pid: &str, limit: Duration) -> bool {
        let start = std::time::Instant::now();
        while alive(pid) {
            if start.elapsed() > limit {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        true
    }

    #[tokio::test]
    async fn a_stopped_run_gets_sigterm_then_sigkill_after_the_grace() {
        let dir = std::env::temp_dir().join(format!("fleet-exec-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        // One program that ends on SIGTERM, one that ignores it (SIGKILLed after the grace);
        // each leaves a grandchild.
        for (deaf, trap) in [(false, ""), (true, "trap '' TERM; ")] {
            let file = dir.join(format!("gc-{deaf}.pid"));
            let script = format!(
                "{trap}sleep 30 & echo $! > {}; while :; do sleep 0.05; done",
                file.display()
            );
            let h = handler(&["sh", "-c", &script]);
            let mut c = t(Value::Null);
            c.cancel_grace = Duration::from_millis(700);
            let stop = c.stop.clone();
            let run = tokio::spawn(h.call(c));
            let mut pid = String::new();
            for _ in 0..250 {
                tokio::time::sleep(Duration::from_millis(20)).await;
                pid = std::fs::read_to_string(&file).unwrap_or_default();
                if pid.ends_with('\n') {
                    break;
                }
            }
            let pid = pid.trim().to_string();
            assert!(alive(&pid), "the grandchild {pid:?} runs");
            let stopped = std::time::Instant::now();
            stop.cancel();
            let r = tokio::time::timeout(Duration::from_secs(5), run)
                .await
                .unwrap()
                .unwrap();
            let took = stopped.elapsed();
            assert!(r.is_err(), "{r:?}");
            assert!(
                gone_within(&pid, Duration::from_millis(500)).await,
                "grandchild {pid} outlived the stopped run"
            );
            if deaf {
                assert!(
                    took >= Duration::from_millis(650),
                    "SIGKILL after the grace: {took:?}"
                );
            } else {
                assert!(
                    took < Duration::from_millis(600),
                    "ended by SIGTERM: {took:?}"
                );
            }
        }
    }

    #[tokio::test]
    async fn a_cut_run_kills_the_grandchildren_too() {
        let dir = std::env::temp_dir().join(format!("fleet-exec-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("grandchild.pid");
        let script = format!("sleep 30 & echo $! > {}; wait", file.display());
        let h = handler(&["sh", "-c", &script]);
        // A boxed future: dropping it below really drops the run.
        let mut run = h.call(t(Value::Null));
        let mut pid = String::new();
        for _ in 0..250 {
            tokio::select! {
                r = &mut run => panic!("the run ended: {r:?}"),
                _ = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
            pid = std::fs::read_to_string(&file).unwrap_or_default();
            if pid.ends_with('\n') {
                break;
            }
        }
        let pid = pid.trim().to_string();
        assert!(alive(&pid), "the grandchild {pid:?} runs");
        drop(run);
        assert!(
            gone_within(&pid, Duration::from_secs(2)).await,
            "grandchild {pid} outlived the cut run"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn what_a_program_leaves_behind_ends_with_its_run() {
        // The background `sleep` holds stdout open: the run still ends when `sh` exits.
        let h = handler(&["sh", "-c", "sleep 30 & echo $!"]);
        let started = std::time::Instant::now();
        let out = tokio::time::timeout(Duration::from_secs(10), h.call(t(Value::Null)))
            .await
            .expect("the run ends when its program exits")
            .unwrap();
        assert!(started.elapsed() < Duration::from_secs(5));
        let pid = out.to_string();
        assert!(
            gone_within(&pid, Duration::from_secs(2)).await,
            "the left-behind {pid} was killed"
        );
    }

    #[tokio::test]
    async fn the_workers_settings_do_not_leak_into_the_child() {
        // 2021 edition: set_var is safe; the name is unique to this test.
        std::env::set_var("FLEET_TEST_SECRET_URL", "amqp://user:secret@host");
        let out = handler(&["env"]).call(t(Value::Null)).await.unwrap();
        let env = out.as_str().unwrap();
        assert!(!env.contains("FLEET_TEST_SECRET_URL"), "{env}");
        assert!(env.contains("FLEET_TASK_ID="), "{env}");
        assert!(env.contains("PATH="), "{env}");
    }
}
