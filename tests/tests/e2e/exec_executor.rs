//! The `exec` executor end to end: a worker with `executor=exec` runs one configured program per
//! task (no shell of its own), with the envelope on stdin. Exit 0 → succeeded with stdout; the
//! permanent exit code → dead at once; any other exit → retried; a run past its deadline kills
//! the program and expires; shell metacharacters in a task reach the program as plain bytes.
//!
//! Some tests configure `sh -c SCRIPT` as *the program* to get exit codes: the script is the
//! operator's configuration, never built from a task.

use std::time::{Duration, Instant};

use fleet_tests::*;
use serde_json::{json, Value};

/// A scheduler and one exec worker running `argv`.
async fn exec_fleet(case: &str, argv: &[&str]) -> anyhow::Result<Fleet> {
    let labels = format!("case={case}");
    let command = serde_json::to_string(argv)?;
    let settings = [
        ("executor", "exec"),
        ("exec_command", command.as_str()),
        ("retry_base_ms", "50"),
        ("retry_cap_ms", "200"),
        NO_EJECT,
    ];
    Fleet::start(&format!("w-exec-{case}"), &labels, 4, &settings, &[]).await
}

fn job(kind: &str, max_attempts: u32) -> fleet::Envelope {
    let mut t = task(kind, json!({}), "");
    t.max_attempts = Some(max_attempts);
    t
}

/// Behaves by task kind (from `FLEET_TASK_KIND`); anything else (the scheduler's probes)
/// succeeds quietly.
const SCRIPT: &str = r#"cat >/dev/null
case "$FLEET_TASK_KIND" in
  text) printf 'done on attempt %s' "$FLEET_TASK_ATTEMPT" ;;
  json) echo '{"sum": 3}' ;;
  permanent) echo "bad input" >&2; exit 65 ;;
  flaky) if [ "$FLEET_TASK_ATTEMPT" -lt 3 ]; then echo "not yet" >&2; exit 3; fi; echo "third time lucky" ;;
  broken) echo "always broken" >&2; exit 3 ;;
esac"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exit_zero_succeeds_with_stdout_as_result() -> anyhow::Result<()> {
    own_process!();
    let f = exec_fleet("ok", &["sh", "-c", SCRIPT]).await?;
    let (text, js) = (job("text", 3), job("json", 3));
    f.ns.submit(&[text.clone(), js.clone()]).await?;
    let st =
        f.ns.wait_state(&text.id, "succeeded", Duration::from_secs(20))
            .await?;
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#""done on attempt 1""#),
        "stdout as a string: {st:?}"
    );
    let st = get_json(&f.sched.url(&format!("/v1/tasks/{}", js.id))).await;
    let st = match st {
        Ok(v) if v["state"] == "succeeded" => v,
        _ => {
            f.ns.wait_state(&js.id, "succeeded", Duration::from_secs(20))
                .await?;
            get_json(&f.sched.url(&format!("/v1/tasks/{}", js.id))).await?
        }
    };
    assert_eq!(
        st["result"],
        serde_json::json!({"sum": 3}),
        "stdout that parses as JSON is JSON: {st}"
    );
    assert_eq!(
        completed_at_least(&f.worker_url(), &f.group, "succeeded", 2).await?,
        2
    );
    assert_eq!(completed(&f.worker_url(), &f.group, "retried").await?, 0);
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nonzero_exits_are_retried_and_the_permanent_code_is_dead_at_once() -> anyhow::Result<()> {
    own_process!();
    let f = exec_fleet("codes", &["sh", "-c", SCRIPT]).await?;
    let permanent = job("permanent", 3);
    let flaky = job("flaky", 5);
    let broken = job("broken", 3);
    f.ns.submit(&[permanent.clone(), flaky.clone(), broken.clone()])
        .await?;

    let st =
        f.ns.wait_state(&flaky.id, "succeeded", Duration::from_secs(20))
            .await?;
    assert_eq!(st.get("attempt").map(String::as_str), Some("3"), "{st:?}");
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#""third time lucky\n""#)
    );

    let dead = wait_dead(&f.ns, 2, Duration::from_secs(20)).await?;
    let find = |id: &str| {
        dead.iter()
            .find(|d| d.env.id == id)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{id} not dead"))
    };
    let d = find(&permanent.id)?;
    assert_eq!(
        d.header("x-fleet-reason"),
        Some("permanent_error"),
        "{:?}",
        d.headers
    );
    assert_eq!(
        d.header("x-fleet-attempts"),
        Some("1"),
        "the permanent exit code is not retried"
    );
    assert_eq!(
        d.header("x-fleet-detail"),
        Some("exec: `sh` exited with 65: bad input")
    );
    let d = find(&broken.id)?;
    assert_eq!(
        d.header("x-fleet-reason"),
        Some("max_attempts"),
        "{:?}",
        d.headers
    );
    assert_eq!(d.header("x-fleet-attempts"), Some("3"));
    assert_eq!(
        d.header("x-fleet-detail"),
        Some("exec: `sh` exited with 3: always broken")
    );
    let st =
        f.ns.wait_state(&broken.id, "dead", Duration::from_secs(10))
            .await?;
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("exec: `sh` exited with 3: always broken")
    );

    let m = f.worker_url();
    assert_eq!(
        completed_at_least(&m, &f.group, "retried", 4).await?,
        4,
        "flaky twice, broken twice"
    );
    assert_eq!(completed_at_least(&m, &f.group, "dead", 2).await?, 2);
    assert_eq!(completed_at_least(&m, &f.group, "succeeded", 1).await?, 1);
    f.stop().await
}

/// Processes whose command line contains `marker`.
fn processes_with(marker: &str) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return vec![];
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(marker))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_past_its_deadline_kills_the_program() -> anyhow::Result<()> {
    own_process!();
    // `sleep 30.<random>`: a 30 s sleep whose command line only this test uses.
    let marker = format!("30.{:06}", rand::random::<u32>() % 1_000_000);
    let f = exec_fleet("sleep", &["sleep", &marker]).await?;
    let mut t = job("nap", 3);
    t.timeout_ms = Some(1000);
    let submitted = Instant::now();
    f.ns.submit(std::slice::from_ref(&t)).await?;
    let pids = wait_for("the program to start", Duration::from_secs(5), || async {
        let p = processes_with(&marker);
        (!p.is_empty()).then_some(p)
    })
    .await?;
    assert_eq!(pids.len(), 1, "one program for one task: {pids:?}");

    let st =
        f.ns.wait_state(&t.id, "expired", Duration::from_secs(10))
            .await?;
    let took = submitted.elapsed();
    println!(
        "`sleep {marker}` with a 1 s timeout expired {} ms after submission",
        took.as_millis()
    );
    assert!(took < Duration::from_secs(3), "expired after {took:?}");
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("deadline reached during the run"),
        "{st:?}"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"));
    wait_for(
        "the program to be killed",
        Duration::from_secs(3),
        || async { processes_with(&marker).is_empty().then_some(()) },
    )
    .await?;
    let dead = wait_dead(&f.ns, 1, Duration::from_secs(10)).await?;
    assert_eq!(dead[0].header("x-fleet-reason"), Some("expired"));
    assert_eq!(
        completed_at_least(&f.worker_url(), &f.group, "expired", 1).await?,
        1
    );
    assert_eq!(completed(&f.worker_url(), &f.group, "retried").await?, 0);
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shell_metacharacters_in_a_task_are_inert() -> anyhow::Result<()> {
    let f = exec_fleet("cat", &["cat"]).await?;
    let ns = &f.ns.name;
    let trap = format!("/tmp/pwned-{ns}");
    let cmd = format!("$(touch {trap}); echo pwned");
    let payload = json!({
        "cmd": cmd,
        "more": format!("`touch {trap}-bt`; rm -rf /nonexistent | tee {trap}-tee && \"q\" 'x' \n exit 3"),
    });
    let mut t = task(&format!("$(touch {trap}-kind)"), payload.clone(), "");
    t.id = format!("id-$(touch {trap}-id);x");
    t.max_attempts = Some(1);
    f.ns.submit(std::slice::from_ref(&t)).await?;

    let st =
        f.ns.wait_state(&t.id, "succeeded", Duration::from_secs(20))
            .await?;
    // `cat` echoes the envelope: the task's text came back byte for byte.
    let echoed: Value = serde_json::from_str(st.get("result").map(String::as_str).unwrap_or(""))?;
    assert_eq!(echoed["payload"], payload);
    assert_eq!(echoed["payload"]["cmd"].as_str(), Some(cmd.as_str()));
    assert_eq!(echoed["id"].as_str(), Some(t.id.as_str()));
    assert_eq!(echoed["kind"].as_str(), Some(t.kind.as_str()));
    assert_eq!(echoed["attempt"], 1);
    let pwned: Vec<String> = std::fs::read_dir("/tmp")?
        .flatten()
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|n| n.starts_with(&format!("pwned-{ns}")))
        .collect();
    assert!(pwned.is_empty(), "a shell ran task text: {pwned:?}");
    f.stop().await
}

/// Issue 30 item 7: `kill -9` of a worker process ends its exec run at once — the program and
/// what it forked (a grandchild in the background) — so no copy of the task runs on beside the
/// retry on a peer. The program writes both pids; after the kill neither process runs within
/// 2 s (without the run's process group and its watchdog both ran on for 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_workers_program_and_its_grandchild_die_with_it() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[("probe_interval_ms", "600000")]).await?;
    let dir = TempDir::new("exec-kill")?;
    let (child, grandchild) = (dir.path("child.pid"), dir.path("grandchild.pid"));
    // The grandchild's pid is written before the child's; each file appears whole (mv).
    let script = format!(
        r#"cat >/dev/null
[ "$FLEET_TASK_KIND" = hold ] || exit 0
sleep 30 & echo $! > {grandchild}.tmp && mv {grandchild}.tmp {grandchild}
echo $$ > {child}.tmp && mv {child}.tmp {child}
wait"#
    );
    let command = serde_json::to_string(&["sh", "-c", &script])?;
    let mut victim = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-exec-victim",
            labels: "case=exec-kill",
            capacity: 1,
            endpoint: "http://127.0.0.1:9/unused",
            extra: &[("executor", "exec"), ("exec_command", &command)],
        },
    )
    .await?;
    let mut t = task("hold", json!({}), "case=exec-kill");
    t.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&t)).await?;
    let pids = wait_for(
        "the program and its grandchild",
        Duration::from_secs(20),
        || async {
            let c = std::fs::read_to_string(&child).ok()?;
            let g = std::fs::read_to_string(&grandchild).ok()?;
            Some([c.trim().to_string(), g.trim().to_string()])
        },
    )
    .await?;
    for pid in &pids {
        assert!(alive(pid), "{pid} runs before the kill");
    }

    let killed = Instant::now();
    victim.kill9()?;
    let left = wait_for(
        "the run's processes to die",
        Duration::from_secs(2),
        || async { pids.iter().all(|p| !alive(p)).then_some(()) },
    )
    .await;
    let still: Vec<&String> = pids.iter().filter(|p| alive(p)).collect();
    assert!(
        left.is_ok(),
        "{:?} after the worker's kill -9, still running: {still:?} (child, grandchild = {pids:?})",
        killed.elapsed()
    );
    println!(
        "program and grandchild gone {} ms after kill -9 of their worker",
        killed.elapsed().as_millis()
    );
    sched.stop().await?;
    ns.cleanup().await
}

/// Whether process `pid` runs (a zombie has ended: it only waits to be reaped).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z'))
}
