//! A task's `kind` is routing input (issue 29 item 1): a worker advertises the kinds it handles
//! (builtin: its handler names; exec and http: `FLEET_KINDS`, `*` by default), a group handles
//! a kind when every active worker of it does, and a task goes only to a group that handles
//! its kind. A kind nobody handles waits "waiting for a worker" like an unmatched selector:
//! picked up by a worker that joins within the grace, dead-lettered `no_matching_worker` after.

use std::time::Duration;

use fleet::registry::{Kinds, Registration, WorkerState};
use fleet::route::Dedupe;
use fleet::route::{Reservation, ReserveParams, ReserveRequest};
use fleet::task::Strategy;
use fleet::{Labels, Lane, Store};
use fleet_tests::*;
use serde_json::json;

/// The exec workers' program: appends `<task id> <worker id>` to the run log (its one
/// argument), then prints what ran where.
const RUN_LOG_SCRIPT: &str = r#"cat >/dev/null
echo "$FLEET_TASK_ID $FLEET_WORKER_ID" >> "$1"
printf '%s on %s' "$FLEET_TASK_KIND" "$FLEET_WORKER_ID""#;

/// The run log's lines for one task: the workers that ran it, one per run.
fn runs(log: &std::path::Path, id: &str) -> Vec<String> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{id} ")).map(str::to_string))
        .collect()
}

fn exec_settings<'a>(command: &'a str, kinds: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("executor", "exec"),
        ("exec_command", command),
        ("kinds", kinds),
        NO_EJECT,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_goes_to_a_worker_that_handles_its_kind() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    // The grace: long enough for a worker to start under load, short for a test.
    let grace = Duration::from_secs(15);
    let grace_ms = grace.as_millis().to_string();
    let sched = start_scheduler(&ns, &[("no_match_grace_ms", grace_ms.as_str())]).await?;
    let log = std::env::temp_dir().join(format!("fleet-kinds-{}.log", ns.name));
    let log_s = log.to_string_lossy().to_string();
    let command = serde_json::to_string(&["sh", "-c", RUN_LOG_SCRIPT, "sh", log_s.as_str()])?;

    // One builtin worker (echo, sleep, …) and one exec worker declaring `resize`: both match
    // a task without labels or protocol.
    let builtin = start_worker(&ns, "w-builtin", "", 4, &[], &[]).await?;
    let exec = start_worker(
        &ns,
        "w-exec",
        "",
        4,
        &exec_settings(&command, "resize"),
        &[],
    )
    .await?;

    let resize = task("resize", json!({"img": "b.png"}), "");
    let echo = task("echo", json!({"hello": "kinds"}), "");
    let crop = task("crop", json!({}), "");
    let thumb = task("thumbnail", json!({}), "");
    let submitted = std::time::Instant::now();
    assert_eq!(
        ns.submit(&[resize.clone(), echo.clone(), crop.clone(), thumb.clone()])
            .await?,
        (4, 0)
    );

    // `resize` (no protocol) runs on the exec worker, once.
    let st = ns
        .wait_state(&resize.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some("w-exec"),
        "{st:?}"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"), "{st:?}");
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#""resize on w-exec""#)
    );
    assert_eq!(runs(&log, &resize.id), vec!["w-exec"]);
    // A builtin kind runs on the builtin worker (and never reached the program).
    let st = ns
        .wait_state(&echo.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some("w-builtin"),
        "{st:?}"
    );
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#"{"hello":"kinds"}"#)
    );
    assert!(runs(&log, &echo.id).is_empty());

    // `crop` and `thumbnail`: nobody handles them yet — waiting for a worker, visible as such.
    for id in [&crop.id, &thumb.id] {
        ns.wait_state(id, "waiting_for_worker", Duration::from_secs(10))
            .await?;
    }
    // A worker that handles it joins (a group of its own) and picks it up while it waits.
    let cropper = start_worker(
        &ns,
        "w-crop",
        "pool=crop",
        2,
        &exec_settings(&command, "crop"),
        &[],
    )
    .await?;
    let st = ns
        .wait_state(&crop.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some("w-crop"),
        "{st:?}"
    );
    assert_eq!(runs(&log, &crop.id), vec!["w-crop"]);

    // `thumbnail`: nobody ever handles it — still waiting (the new worker took only `crop`),
    // then dead `no_matching_worker` once the grace has passed, never run.
    let st = ns.status(&thumb.id).await?.unwrap_or_default();
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("waiting_for_worker"),
        "{st:?}"
    );
    let st = ns
        .wait_state(&thumb.id, "dead", Duration::from_secs(45))
        .await?;
    let waited = submitted.elapsed();
    assert!(
        waited >= grace - Duration::from_secs(1),
        "dead only after the grace: {waited:?}"
    );
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("no_matching_worker"),
        "{st:?}"
    );
    let dead = wait_dead(&ns, 1, Duration::from_secs(10)).await?;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].env.id, thumb.id);
    assert_eq!(dead[0].header("x-fleet-reason"), Some("no_matching_worker"));
    assert!(
        dead[0]
            .header("x-fleet-detail")
            .is_some_and(|d| d.contains("kind `thumbnail`")),
        "{:?}",
        dead[0].headers
    );
    assert!(runs(&log, &thumb.id).is_empty());

    // What each worker advertises, as `/v1/workers` shows it.
    let mut kinds: Vec<(String, String)> = ns
        .store
        .workers()
        .await?
        .into_iter()
        .map(|w| (w.id, w.kinds))
        .collect();
    kinds.sort();
    assert_eq!(
        kinds,
        vec![
            ("w-builtin".into(), "cpu,echo,fail,noop,sleep".into()),
            ("w-crop".into(), "crop,noop".into()),
            ("w-exec".into(), "noop,resize".into()),
        ]
    );

    cropper.stop().await?;
    exec.stop().await?;
    builtin.stop().await?;
    sched.stop().await?;
    let _ = std::fs::remove_file(&log);
    ns.cleanup().await
}

/// A task already queued for a group whose worker no longer handles its kind (the worker
/// restarted with fewer `FLEET_KINDS`, or the group's kinds dropped it after the task was
/// routed) is not that worker's failure: it goes back to the scheduler unclaimed and runs, as
/// attempt 1, on a worker that handles it. Made here by publishing a `resize` task straight
/// to the builtin worker's group queue, as a scheduler did before the kinds changed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_queued_for_a_kind_its_worker_does_not_handle_is_routed_again() -> anyhow::Result<()>
{
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let log = std::env::temp_dir().join(format!("fleet-kinds-back-{}.log", ns.name));
    let log_s = log.to_string_lossy().to_string();
    let command = serde_json::to_string(&["sh", "-c", RUN_LOG_SCRIPT, "sh", log_s.as_str()])?;
    let builtin = start_worker(&ns, "w-builtin", "", 2, &[], &[]).await?;
    let exec = start_worker(
        &ns,
        "w-exec",
        "",
        2,
        &exec_settings(&command, "resize"),
        &[],
    )
    .await?;
    let t = task("resize", json!({"img": "c.png"}), "");
    ns.publish_to_group("protocol=builtin", Lane::Normal, &t.id, &t.to_bytes())
        .await?;
    let st = ns
        .wait_state(&t.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some("w-exec"),
        "{st:?}"
    );
    // Sent back unclaimed: the run on the exec worker is the task's first attempt.
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"), "{st:?}");
    assert_eq!(runs(&log, &t.id), vec!["w-exec"]);
    let attempts = ns.store.task_attempts(&t.id).await?;
    assert_eq!(attempts.len(), 1, "one attempt logged: {attempts:?}");
    let rerouted = metric(
        &format!("http://{}/metrics", builtin.addr),
        "fleet_tasks_rerouted_total",
        &[],
    )
    .await?;
    assert_eq!(rerouted, 1.0, "the builtin worker sent it back once");
    let dead = peek_dead(&ns).await?;
    assert!(dead.is_empty(), "nothing dead-lettered: {dead:?}");
    exec.stop().await?;
    builtin.stop().await?;
    sched.stop().await?;
    let _ = std::fs::remove_file(&log);
    ns.cleanup().await
}

fn params() -> ReserveParams {
    ReserveParams {
        lease_ms: 60_000,
        backlog_factor: 0.0,
        strategy: Strategy::LeastLoaded,
        dedupe_window_ms: 60_000,
        status_ttl_ms: 60_000,
        token: rand::random(),
        direct: false,
        park_flag_ttl_ms: 3000,
    }
}

async fn reserve(store: &Store, kind: &str) -> anyhow::Result<Reservation> {
    let req = ReserveRequest {
        id: format!("t-{}", rand::random::<u64>()),
        lane: Lane::Normal,
        selector: Labels::default(),
        kind: kind.into(),
        strategy: None,
        dedupe: Dedupe::Skip,
        from_park: false,
        dedupe_only: false,
        key: None,
    };
    let mut r = store.reserve(&[req], params()).await?;
    anyhow::ensure!(r.len() == 1, "one answer per task: {r:?}");
    Ok(r.remove(0))
}

async fn register(store: &Store, id: &str, kinds: &str) -> anyhow::Result<()> {
    let r = Registration {
        id: id.into(),
        instance: format!("i-{id}"),
        labels: Labels::parse("pool=a,protocol=exec")?,
        capacity: 4,
        critical_capacity: 1,
        executor: "exec".into(),
        state: WorkerState::Active,
        kinds: Kinds::parse(kinds)?,
    };
    store.register(&r, Duration::from_secs(30)).await?;
    Ok(())
}

/// The group's kinds are the intersection over its active workers: a rolling deploy that adds
/// a kind routes it there only once every consumer has it; a draining or gone worker no longer
/// counts; a `*` worker handles every kind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_handles_a_kind_only_when_every_active_worker_does() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let s = &ns.store;
    let g = "pool=a,protocol=exec".to_string();
    let reserved = Reservation::Reserved(g.clone());

    register(s, "old", "noop,resize").await?;
    assert_eq!(reserve(s, "resize").await?, reserved);
    assert_eq!(reserve(s, "crop").await?, Reservation::NoMatch);
    // A new version that also handles `crop` joins: not routed until every worker has it.
    register(s, "new", "crop,noop,resize").await?;
    assert_eq!(reserve(s, "crop").await?, Reservation::NoMatch);
    assert_eq!(reserve(s, "resize").await?, reserved);
    // The old one drains (counts no more), then leaves: `crop` is routed.
    s.set_state("old", WorkerState::Draining).await?;
    assert_eq!(reserve(s, "crop").await?, reserved);
    assert!(s.deregister("old", "i-old").await?);
    assert_eq!(reserve(s, "crop").await?, reserved);
    // A worker for every kind leaves the intersection as it is.
    register(s, "any", "*").await?;
    assert_eq!(reserve(s, "crop").await?, reserved);
    assert_eq!(reserve(s, "thumbnail").await?, Reservation::NoMatch);
    // An ejected worker counts no more either; back to active, it counts again.
    register(s, "narrow", "noop").await?;
    assert_eq!(reserve(s, "crop").await?, Reservation::NoMatch);
    s.set_state("narrow", WorkerState::Ejected).await?;
    assert_eq!(reserve(s, "crop").await?, reserved);
    s.set_state("narrow", WorkerState::Active).await?;
    assert_eq!(reserve(s, "crop").await?, Reservation::NoMatch);
    assert_eq!(reserve(s, "noop").await?, reserved);
    ns.cleanup().await
}
