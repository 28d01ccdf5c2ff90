//! Batches over AMQP alone (issue 36, [`fleet::batch`] "Over AMQP: the closing message"):
//! members published as ordinary tasks with `batch`, then a closing message (AMQP `type`
//! `fleet.batch.close`) that defines the batch — some members already ended when it arrives.
//! `on_complete` fires exactly once with the exact figures, `on_success` never; a waiting
//! member listed in the close runs after its parents (with its parent's result); a bad close
//! is dead-lettered `bad_batch` with a detail naming the fault; a repeated close and a member
//! published after the close change nothing; a close whose definition the broker does not
//! confirm goes back to its queue and defines the batch when it comes again.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet::broker::amqp;
use fleet::task::headers;
use fleet::{Envelope, Lane};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler, TaskError};
use lapin::options::BasicGetOptions;
use serde_json::{json, Value};

/// Kind of a member that fails for good (dead at its first attempt).
const BOOM: &str = "boom";
/// Kind of the callbacks.
const CALLBACK: &str = "callback";
/// Kind of a DAG step: records its run (start, end), sleeps `payload.ms`, succeeds with
/// `{"out": n + 1}` where `n` is `payload.parent_result.out`, else `payload.n`, else 0.
const STEP: &str = "step";

/// Every run of a handler: (task id, payload, start, end).
type Runs = Arc<Mutex<Vec<(String, Value, Instant, Instant)>>>;

fn runs_of(r: &Runs) -> Vec<(String, Value, Instant, Instant)> {
    r.lock().map(|v| v.clone()).unwrap_or_default()
}

/// A handler that records its runs and then answers `answer(payload)`.
fn recording(answer: fn(&Value) -> Result<Value, TaskError>) -> (Runs, Arc<dyn Handler>) {
    let runs: Runs = Arc::default();
    let r = runs.clone();
    let h = handler_fn(move |ctx| {
        let r = r.clone();
        async move {
            let start = Instant::now();
            let p = ctx.envelope.payload.clone();
            if let Some(ms) = p["ms"].as_u64() {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let out = answer(&p);
            if let Ok(mut v) = r.lock() {
                v.push((ctx.envelope.id.clone(), p, start, Instant::now()));
            }
            out
        }
    });
    (runs, h)
}

fn boom(_: &Value) -> Result<Value, TaskError> {
    Err(TaskError::permanent("boom"))
}

fn ok(_: &Value) -> Result<Value, TaskError> {
    Ok(json!({}))
}

fn step(p: &Value) -> Result<Value, TaskError> {
    let n = p["parent_result"]["out"]
        .as_u64()
        .or(p["n"].as_u64())
        .unwrap_or(0);
    Ok(json!({"out": n + 1}))
}

/// A member envelope: `kind`, id `id`, in batch `batch`.
fn member(batch: &str, id: &str, kind: &str, payload: Value) -> Envelope {
    let mut e = Envelope::new(kind, payload);
    e.id = id.to_string();
    e.extra.insert("batch".into(), json!(batch));
    e
}

/// Publishes a closing message (confirmed) to the normal lane.
async fn publish_close(ns: &Ns, body: &[u8]) -> anyhow::Result<()> {
    let props = amqp::task_properties("close", None).with_type(fleet::batch::CLOSE_TYPE.into());
    amqp::publish_confirmed(
        &ns.publisher,
        &ns.names.submit_exchange(),
        Lane::Normal.as_str(),
        body,
        props,
    )
    .await?;
    Ok(())
}

/// Every dead letter, taken out of the queue: (body, reason, detail, AMQP type).
async fn take_dead_letters(
    ns: &Ns,
) -> anyhow::Result<Vec<(Vec<u8>, String, String, Option<String>)>> {
    let ch = ns.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            ns.names.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        let p = &m.delivery.properties;
        out.push((
            m.delivery.data.clone(),
            amqp::header_str(p, headers::REASON).unwrap_or_default(),
            amqp::header_str(p, headers::DETAIL).unwrap_or_default(),
            p.kind().as_ref().map(|k| k.to_string()),
        ));
    }
    let _ = ch.close(200, "taken".into()).await;
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_1000_closed_over_amqp_after_some_members_ended_fires_on_complete_once(
) -> anyhow::Result<()> {
    const TOTAL: usize = 1_000;
    const BATCH: &str = "amqp-import-1";
    let ns = Ns::new().await?;
    let (jobs, job_h) = recording(ok);
    let (booms, boom_h) = recording(boom);
    let (seen, cb_h) = recording(ok);
    let h = [(JOB, job_h), (BOOM, boom_h), (CALLBACK, cb_h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w1 = start_worker(&ns, "w-1", "", 16, WORKER, &h).await?;
    let w2 = start_worker(&ns, "w-2", "", 16, WORKER, &h).await?;
    scheduler_ready(&s).await?;

    let failing = [3usize, 500, 997];
    let ids: Vec<String> = (0..TOTAL).map(|i| format!("m-{i}")).collect();
    let envs: Vec<Envelope> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| {
            if failing.contains(&i) {
                let mut e = member(BATCH, id, BOOM, json!({"i": i}));
                e.max_attempts = Some(1);
                e
            } else {
                member(BATCH, id, JOB, json!({"i": i}))
            }
        })
        .collect();
    assert_eq!(ns.submit(&envs).await?, (TOTAL, 0));
    // Members end before the batch is defined: their end records wait in the fold. The first
    // failing member too (the batch's figures must count an end that came first).
    wait_for(
        "a tenth of the members and m-3 ended before the close",
        Duration::from_secs(60),
        || async {
            let ended = runs_of(&jobs).len() >= TOTAL / 10;
            let m3 = runs_of(&booms).iter().any(|r| r.0 == "m-3");
            (ended && m3).then_some(())
        },
    )
    .await?;
    let before = runs_of(&jobs).len() + runs_of(&booms).len();
    let (code, _) = api_get(s.url(&format!("/v1/batches/{BATCH}"))).await?;
    assert_eq!(code, 404, "no batch before its close");
    let close = json!({
        "id": BATCH,
        "tasks": ids,
        "on_success": {"kind": CALLBACK, "payload": {"which": "success"}},
        "on_complete": {"kind": CALLBACK, "payload": {"which": "complete"}},
    });
    let close = serde_json::to_vec(&close)?;
    publish_close(&ns, &close).await?;
    println!("close published after {before} members ended");

    let fired = wait_for("on_complete fired", Duration::from_secs(120), || async {
        let v = runs_of(&seen);
        (!v.is_empty()).then_some(v)
    })
    .await?;
    // The quiet period is the point: no second callback, and no on_success, arrives.
    quiet_for(Duration::from_secs(3), "a second callback would arrive now").await;
    let all = runs_of(&seen);
    assert_eq!(all.len(), 1, "callbacks run: {all:?}");
    let (id, payload, _, _) = &fired[0];
    assert_eq!(id, &format!("{BATCH}:on_complete"));
    assert_eq!(payload["which"], "complete");
    let b = &payload["batch"];
    assert_eq!(b["id"], BATCH);
    assert_eq!(b["total"], TOTAL);
    assert_eq!(b["succeeded"], TOTAL - 3);
    assert_eq!(b["dead"], 3);
    assert_eq!(b["expired"], 0);
    assert_eq!(b["cancelled"], 0);
    assert_eq!(b["failed"], json!(["m-3", "m-500", "m-997"]));

    // Each member ran exactly once.
    let mut per: BTreeMap<String, usize> = BTreeMap::new();
    for r in runs_of(&jobs).iter().chain(runs_of(&booms).iter()) {
        *per.entry(r.0.clone()).or_default() += 1;
    }
    assert_eq!(per.len(), TOTAL);
    let twice: Vec<_> = per.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "members run other than once: {twice:?}");
    let mut dead_ids: Vec<String> = runs_of(&booms).into_iter().map(|r| r.0).collect();
    dead_ids.sort();
    assert_eq!(dead_ids, ["m-3", "m-500", "m-997"]);

    // The close again (a producer's retry), then a task published with the batch's id but
    // not listed in the close: neither changes the batch. The late member, behind the close in
    // the same queue, running says the close was taken (by this or another ingress loop of
    // the lane: the quiet period after covers the one settling it).
    publish_close(&ns, &close).await?;
    assert_eq!(
        ns.submit(&[member(BATCH, "late-1", JOB, json!({}))])
            .await?,
        (1, 0)
    );
    wait_for("the late member ran", Duration::from_secs(30), || async {
        runs_of(&jobs).iter().any(|r| r.0 == "late-1").then_some(())
    })
    .await?;
    quiet_for(Duration::from_secs(2), "a callback would arrive now").await;
    assert_eq!(runs_of(&seen).len(), 1, "callbacks: {:?}", runs_of(&seen));
    let (code, p) = api_get(s.url(&format!("/v1/batches/{BATCH}"))).await?;
    assert_eq!(code, 200, "{p}");
    assert_eq!(p["total"], TOTAL);
    assert_eq!(p["succeeded"], TOTAL - 3);
    assert_eq!(p["dead"], 3);
    assert_eq!(p["pending"], 0);
    assert_eq!(p["complete"], true);
    assert_eq!(p["fired"], json!(["on_complete"]));
    // The three failing members are the only dead letters: no close was dead-lettered.
    let dead = take_dead_letters(&ns).await?;
    let reasons: Vec<&str> = dead.iter().map(|d| d.1.as_str()).collect();
    assert_eq!(reasons, ["permanent_error"; 3], "{dead:?}");

    // The id reused for other members: that close is a dead letter naming the reuse, and the
    // batch keeps its first definition.
    let reused = json!({"id": BATCH, "tasks": ["other-1", "other-2"]});
    publish_close(&ns, &serde_json::to_vec(&reused)?).await?;
    let dead = wait_for(
        "the reused id's close dead-lettered",
        Duration::from_secs(30),
        || async { take_dead_letters(&ns).await.ok().filter(|d| !d.is_empty()) },
    )
    .await?;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].1, "bad_batch");
    assert!(
        dead[0].2.starts_with("duplicate_batch_id: "),
        "{}",
        dead[0].2
    );
    let (_, p) = api_get(s.url(&format!("/v1/batches/{BATCH}"))).await?;
    assert_eq!(p["total"], TOTAL);

    w1.stop().await?;
    w2.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_member_listed_in_a_close_runs_after_its_parents() -> anyhow::Result<()> {
    const BATCH: &str = "amqp-dag-1";
    let ns = Ns::new().await?;
    let (runs, step_h) = recording(step);
    let (seen, cb_h) = recording(ok);
    let h = [(STEP, step_h), (CALLBACK, cb_h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s).await?;

    // Two parents (a slow one whose result the child takes: it carries `pass_result` itself,
    // published before the close), then the close holding the child.
    let mut p1 = member(BATCH, "p1", STEP, json!({"n": 10, "ms": 1500}));
    p1.extra.insert("pass_result".into(), json!(true));
    let p2 = member(BATCH, "p2", STEP, json!({"n": 0, "ms": 100}));
    assert_eq!(ns.submit(&[p1, p2]).await?, (2, 0));
    let close = json!({
        "id": BATCH,
        "tasks": ["p1", "p2",
            {"id": "child", "kind": STEP, "payload": {}, "after": ["p1", "p2"], "payload_from": "p1"}],
        "on_complete": {"kind": CALLBACK},
    });
    publish_close(&ns, &serde_json::to_vec(&close)?).await?;
    // Defined while p1 still runs: the child waits.
    let p = wait_for("the batch defined", Duration::from_secs(10), || async {
        let (code, p) = api_get(s.url(&format!("/v1/batches/{BATCH}"))).await.ok()?;
        (code == 200).then_some(p)
    })
    .await?;
    assert_eq!(p["total"], 3, "{p}");
    let child_status = ns.state_of("child").await;
    assert!(
        p["waiting"] == json!(["child"]) || runs_of(&runs).len() >= 2,
        "{p} child: {child_status:?}"
    );

    wait_for("on_complete", Duration::from_secs(60), || async {
        (!runs_of(&seen).is_empty()).then_some(())
    })
    .await?;
    quiet_for(Duration::from_secs(1), "a second callback would arrive now").await;
    let cbs = runs_of(&seen);
    assert_eq!(cbs.len(), 1, "{cbs:?}");
    assert_eq!(cbs[0].1["batch"]["succeeded"], 3);
    let all = runs_of(&runs);
    let one = |id: &str| {
        let of: Vec<_> = all.iter().filter(|r| r.0 == id).cloned().collect();
        assert_eq!(of.len(), 1, "{id} ran {} times", of.len());
        of[0].clone()
    };
    let (p1, p2, child) = (one("p1"), one("p2"), one("child"));
    assert!(
        child.2 >= p1.3 && child.2 >= p2.3,
        "the child started before a parent ended"
    );
    assert_eq!(child.1["parent_result"]["out"], 11, "{}", child.1);
    assert_eq!(all.len(), 3);

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_close_is_dead_lettered_with_its_reason_and_defines_nothing() -> anyhow::Result<()> {
    // Asserts on the scheduler's /metrics: alone in its process.
    own_process!();
    let ns = Ns::new().await?;
    let (jobs, job_h) = recording(ok);
    let h = [(JOB, job_h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;

    let too_many: Vec<String> = (0..=fleet::batch::MAX_TASKS)
        .map(|i| i.to_string())
        .collect();
    let bad: Vec<(&str, Vec<u8>)> = vec![
        ("bad_body", b"{not json".to_vec()),
        (
            "bad_batch_id",
            serde_json::to_vec(&json!({"tasks": ["a"]}))?,
        ),
        (
            "no_tasks",
            serde_json::to_vec(&json!({"id": "bad-2", "tasks": []}))?,
        ),
        (
            "too_many_tasks",
            serde_json::to_vec(&json!({"id": "bad-3", "tasks": too_many}))?,
        ),
        (
            "bad_callback",
            serde_json::to_vec(
                &json!({"id": "bad-4", "tasks": ["a"], "on_complete": {"payload": 1}}),
            )?,
        ),
        (
            "cycle",
            serde_json::to_vec(&json!({"id": "bad-5", "tasks": ["a",
                {"id": "x", "kind": JOB, "after": ["y"]},
                {"id": "y", "kind": JOB, "after": ["x"]}]}))?,
        ),
    ];
    for (_, body) in &bad {
        publish_close(&ns, body).await?;
    }
    // A task behind them in the same queue: once it ran, every close was read.
    assert_eq!(ns.submit(&[task(JOB, json!({}), "")]).await?, (1, 0));
    wait_for(
        "the task behind the closes ran",
        Duration::from_secs(30),
        || async { (!runs_of(&jobs).is_empty()).then_some(()) },
    )
    .await?;
    let queue = ns.names.dead_queue();
    wait_for("six dead letters", Duration::from_secs(10), || {
        let queue = queue.clone();
        let ns = &ns;
        async move { (ns.depth(&queue).await >= 6).then_some(()) }
    })
    .await?;
    let dead = take_dead_letters(&ns).await?;
    assert_eq!(dead.len(), 6, "{dead:?}");
    // The normal lane has several ingress loops: the letters come in any order. Each is the
    // close's own bytes and type, with reason `bad_batch` and a detail naming the fault.
    for (code, body) in &bad {
        let of: Vec<_> = dead.iter().filter(|d| &d.0 == body).collect();
        assert_eq!(of.len(), 1, "{code}: {dead:?}");
        let d = of[0];
        assert_eq!(d.1, "bad_batch");
        assert!(
            d.2.starts_with(&format!("{code}: ")),
            "{code}: detail {}",
            d.2
        );
        assert_eq!(d.3.as_deref(), Some(fleet::batch::CLOSE_TYPE));
        if *code == "cycle" {
            assert!(
                d.2.contains("x → y → x") || d.2.contains("y → x → y"),
                "{}",
                d.2
            );
        }
    }
    for b in ["bad-2", "bad-3", "bad-4", "bad-5"] {
        let (code, p) = api_get(s.url(&format!("/v1/batches/{b}"))).await?;
        assert_eq!(code, 404, "{b}: {p}");
    }
    let page = reqwest::get(s.url("/metrics")).await?.text().await?;
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_rejected_total",
            &[("reason", "bad_batch")]
        ) as usize,
        6
    );
    assert_eq!(runs_of(&jobs).len(), 1);

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

/// Takes the next `n` messages of the normal ingress queue (unacked, on `ch`).
async fn get_ingress(
    ns: &Ns,
    ch: &lapin::Channel,
    n: usize,
) -> anyhow::Result<Vec<lapin::message::Delivery>> {
    let queue = ns.names.ingress_queue(Lane::Normal);
    let mut out = Vec::new();
    wait_for(
        &format!("{n} message(s) in the ingress"),
        Duration::from_secs(10),
        || {
            let queue = queue.clone();
            async move { (ns.depth(&queue).await as usize >= n).then_some(()) }
        },
    )
    .await?;
    while out.len() < n {
        match ch
            .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        {
            Some(m) => out.push(m.delivery),
            None => anyhow::bail!("the ingress emptied after {} of {n}", out.len()),
        }
    }
    Ok(out)
}

/// The ingress's close handling on its own (no scheduler running, the namespace declared):
/// while the control stream cannot take the definition (deleted: the append is unroutable)
/// the close is held (not nacked back to its queue), defining nothing, and the task beside it
/// waits; once the stream is back the same close defines the batch and is acked.
///
/// A stream declared a moment ago may not have started yet: RabbitMQ then answers a publish
/// to it by closing the publishing *connection* (506 `Stream not found`, seen under load).
/// `take` reports its publisher closed and drops nothing: the close is still unacked on the
/// consuming channel. The test then does what the scheduler's session restart does — a new
/// connection and publisher, the held messages given back and taken again — and asserts
/// the same end: the batch defined once, the task on its way, the close acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_close_whose_record_is_not_confirmed_is_held_and_defines_the_batch_once_taken(
) -> anyhow::Result<()> {
    use fleet_scheduler::batch_close::Closes;
    use lapin::options::{BasicAckOptions, QueueDeleteOptions};
    const BATCH: &str = "amqp-unconfirmed-1";
    fleet_tests::inproc::test_log();
    let ns = Ns::new().await?;
    ns.declare_ingress(&[]).await?;
    let mut ch = ns.conn.create_channel().await?;
    let stream = ns.names.control_stream();
    ch.queue_delete(stream.as_str().into(), QueueDeleteOptions::default())
        .await?;

    let cfg = Arc::new(fleet_scheduler::SchedulerConfig::from_settings(
        &ns.settings(&[]),
    )?);
    let batches = fleet::batch::Batches::default();
    // A session of its own (what a scheduler's ingress session holds): connection, confirm
    // channel, and the close handler over them.
    let session = |n: u32| {
        let (cfg, store, batches) = (cfg.clone(), ns.store.clone(), batches.clone());
        async move {
            let conn =
                Arc::new(amqp::connect(&amqp_url(), &format!("amqp-batches-test-{n}")).await?);
            let publisher = amqp::confirm_channel(&conn).await?;
            let session = fleet_scheduler::session::Session::new(
                cfg,
                store,
                conn.clone(),
                publisher,
                fleet_scheduler::pause::Pauses::default(),
                Arc::new(fleet::broker::probe::Prober::new(
                    &amqp_url(),
                    &format!("amqp-batches-test-{n}"),
                    &Default::default(),
                )),
            );
            anyhow::Ok((
                conn,
                Arc::new(Closes {
                    session: Arc::new(session),
                    batches,
                }),
            ))
        }
    };
    let stop = tokio_util::sync::CancellationToken::new();

    let close = json!({"id": BATCH, "tasks": ["a", "b"], "on_complete": {"kind": CALLBACK}});
    publish_close(&ns, &serde_json::to_vec(&close)?).await?;
    assert_eq!(
        ns.submit(&[member(BATCH, "a", JOB, json!({}))]).await?,
        (1, 0)
    );
    let got = get_ingress(&ns, &ch, 2).await?;
    let (mut conn, closes) = session(0).await?;
    let (held, stop2) = (closes.clone(), stop.clone());
    let taking = tokio::spawn(async move { held.take(got, &stop2).await });
    // Two tries (0.5 s apart) fail while the stream is gone: the close is held, not nacked back
    // to its queue (a quorum queue's delivery limit would drop it), and nothing is defined.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(!taking.is_finished(), "the close is held and tried again");
    assert!(batches.progress(BATCH).is_none(), "nothing defined");
    assert_eq!(
        ns.depth(&ns.names.ingress_queue(Lane::Normal)).await,
        0,
        "nothing went back to the queue"
    );

    // With the stream declared again a later try defines the batch, and the task goes on.
    fleet::broker::topology::declare_control_stream(&ch, &ns.names).await?;
    let mut outcome = tokio::time::timeout(Duration::from_secs(30), taking).await??;
    let mut restarts = 0;
    while let Err(e) = &outcome {
        // The publishing connection was closed under it (the stream not started yet).
        anyhow::ensure!(
            matches!(e, fleet::Error::ChannelClosed { .. }) && restarts < 5,
            "take failed: {e} (after {restarts} session restart(s))"
        );
        assert!(batches.progress(BATCH).is_none(), "nothing defined");
        restarts += 1;
        println!(
            "amqp_batches: the publishing connection was closed ({e}); session restart {restarts}"
        );
        let _ = conn.close(200, "done".into()).await;
        // The held messages go back to the queue with the consuming channel.
        ch.close(200, "restart".into()).await?;
        ch = ns.conn.create_channel().await?;
        let got = get_ingress(&ns, &ch, 2).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (c, closes) = session(restarts).await?;
        conn = c;
        outcome = tokio::time::timeout(Duration::from_secs(30), closes.take(got, &stop)).await?;
    }
    let rest = outcome?;
    assert_eq!(rest.len(), 1, "the task goes on to dispatch");
    let task: Value = serde_json::from_slice(&rest[0].data)?;
    assert_eq!(task["id"], "a");
    rest[0].acker.ack(BasicAckOptions::default()).await?;
    let p = batches
        .progress(BATCH)
        .ok_or_else(|| anyhow::anyhow!("the batch is not defined"))?;
    assert_eq!((p.total, p.pending), (2, 2));
    assert_eq!(p.callbacks, ["on_complete"]);
    // Acked: closing the channel puts back nothing.
    ch.close(200, "done".into()).await?;
    assert_eq!(ns.depth(&ns.names.ingress_queue(Lane::Normal)).await, 0);
    assert!(take_dead_letters(&ns).await?.is_empty());
    let _ = conn.close(200, "done".into()).await;
    ns.cleanup().await?;
    Ok(())
}

/// A batch's waiting statuses written again (its close redelivered, or read by a replica that
/// has not folded the batch yet) never put a member released since back to `waiting`: a
/// `queued` record stays queued (and is reported left as it was); a member with no record, or
/// still waiting, is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_is_never_written_over_a_released_member() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let mut first = fleet::status::Writes::new();
    for id in ["released", "still"] {
        first.waiting(id, Lane::Normal, &["p".to_string()], "b-again");
    }
    assert!(ns
        .store
        .write_statuses(&first, Duration::from_secs(60))
        .await?
        .is_empty());
    // "released" was released: its record now says queued.
    let mut hset = deadpool_redis::redis::cmd("HSET");
    hset.arg(ns.names.task("released"))
        .arg("state")
        .arg("queued");
    ns.store.query::<i64>(&hset).await?;
    let mut again = fleet::status::Writes::new();
    for id in ["released", "still", "fresh"] {
        again.waiting(id, Lane::Normal, &["p".to_string()], "b-again");
    }
    let left = ns
        .store
        .write_statuses(&again, Duration::from_secs(60))
        .await?;
    assert_eq!(left, [("released".to_string(), "queued".to_string())]);
    let state = |id: &'static str| {
        let ns = &ns;
        async move {
            ns.status(id)
                .await
                .map(|s| s.and_then(|s| s.get("state").cloned()))
        }
    };
    assert_eq!(state("released").await?.as_deref(), Some("queued"));
    assert_eq!(state("still").await?.as_deref(), Some("waiting"));
    assert_eq!(state("fresh").await?.as_deref(), Some("waiting"));
    ns.cleanup().await
}
