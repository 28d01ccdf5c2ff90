//! Dead letters the broker makes itself (issue 10 §3, "never left silent"): a quorum group
//! queue dead-letters a message delivered more than `x-delivery-limit` times. The group queues'
//! dead-letter routing key leads to `<ns>.dead.broker`, which the scheduler consumes: the task
//! reaches the dead-letter queue with `x-fleet-reason: delivery_limit` (the broker's `x-death`
//! kept) and its status becomes `dead` with that reason, its reservation released. A health
//! probe dead-lettered the same way is dropped, never a user's dead letter.

use std::time::Duration;

use fleet::{broker::amqp, broker::topology, Lane};
use fleet_tests::*;
use lapin::options::{BasicGetOptions, BasicNackOptions};
use serde_json::{json, Value};

/// Takes a message from `queue` and nacks it with requeue until the queue has none left
/// (the broker dead-lettered it); returns how many times it was delivered.
async fn bounce(conn: &lapin::Connection, queue: &str) -> anyhow::Result<usize> {
    let ch = conn.create_channel().await?;
    let mut deliveries = 0;
    for _ in 0..200 {
        let Some(m) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await?
        else {
            break;
        };
        deliveries += 1;
        m.delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
    }
    let _ = ch.close(200, "ok".into()).await;
    Ok(deliveries)
}

/// Declares `group`'s queues and puts one task in its normal lane as the scheduler would hand
/// it over: the status a dispatch writes (reserve.lua: queued there) seeded by hand, then the
/// message published through `<ns>.tasks`. Returns the declaring channel and the task's id.
async fn hand_to_group(
    ns: &Ns,
    group: &str,
    selector: &str,
) -> anyhow::Result<(lapin::Channel, String)> {
    let setup = ns.conn.create_channel().await?;
    topology::declare_group(&setup, &ns.common(&[])?, group).await?;
    let env = task("job", json!({"x": 1}), selector);
    let mut seed = deadpool_redis::redis::cmd("HSET");
    seed.arg(ns.names.task(&env.id))
        .arg("state")
        .arg("queued")
        .arg("group")
        .arg(group)
        .arg("lane")
        .arg("normal")
        .arg("attempt")
        .arg(0);
    ns.store.query::<i64>(&seed).await?;
    amqp::publish_confirmed(
        &ns.publisher,
        &ns.names.tasks_exchange(),
        &ns.names.group_key(group, Lane::Normal),
        &env.to_bytes(),
        amqp::task_properties(&env.id, None),
    )
    .await?;
    Ok((setup, env.id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delivery_limit_dead_letters_get_a_reason_and_a_true_status() -> anyhow::Result<()> {
    let ns = Ns::with_queue_type("quorum").await?;
    let sched = start_scheduler(&ns, &[("probe_interval_ms", "600000")]).await?;
    let group = "pool=bs,protocol=builtin";
    // A task as the scheduler hands it to a group (reserved there, status queued), and a probe.
    let (setup, id) = hand_to_group(&ns, group, "pool=bs").await?;
    let mut probe = fleet::Envelope::new("noop", json!({"probe": true}));
    probe.id = format!("probe-{}", ns.name);
    probe.lane = Lane::Critical;
    let probe_props = amqp::task_properties(
        &probe.id,
        Some(amqp::headers([(amqp::PROBE_HEADER, "1".to_string())])),
    );
    amqp::publish_confirmed(
        &ns.publisher,
        &ns.names.tasks_exchange(),
        &ns.names.group_key(group, Lane::Critical),
        &probe.to_bytes(),
        probe_props,
    )
    .await?;

    // A consumer that never settles them: every nack is a redelivery.
    let task_deliveries = bounce(&ns.conn, &ns.names.group_queue(group, Lane::Normal)).await?;
    let probe_deliveries = bounce(&ns.conn, &ns.names.group_queue(group, Lane::Critical)).await?;

    let st = ns.wait_state(&id, "dead", Duration::from_secs(20)).await?;
    wait_for(
        "the broker's dead-letter queue drained",
        Duration::from_secs(20),
        || async { (ns.depth(&ns.names.broker_dead_queue()).await == 0).then_some(()) },
    )
    .await?;
    let ch = ns.conn.create_channel().await?;
    let mut letters = Vec::new();
    while let Some(m) = ch
        .basic_get(
            ns.names.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        letters.push(m.delivery);
    }
    let ids: Vec<String> = letters
        .iter()
        .map(|d| {
            serde_json::from_slice::<Value>(&d.data)
                .ok()
                .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_default()
        })
        .collect();
    let letter = fleet::broker::dead::describe(&letters[0].properties, &letters[0].data);
    let has_x_death = letters[0]
        .properties
        .headers()
        .as_ref()
        .is_some_and(|h| h.inner().contains_key("x-death"));
    println!(
        "broker dead letters: task delivered {task_deliveries} times, probe {probe_deliveries} times; dead-letter queue {ids:?}; \
         reason {:?}, detail {:?}, x-death kept {has_x_death}; status {:?} reason {:?}",
        letter.reason,
        letter.detail,
        st.get("state"),
        st.get("reason")
    );
    assert_eq!(
        task_deliveries as i64,
        topology::DELIVERY_LIMIT + 1,
        "the broker's limit"
    );
    assert_eq!(ids, vec![id.clone()], "the task, once; the probe never");
    assert_eq!(
        amqp::header_str(&letters[0].properties, amqp::REASON_HEADER).as_deref(),
        Some("delivery_limit")
    );
    assert!(has_x_death, "the broker's x-death history is kept");
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("delivery_limit"),
        "{st:?}"
    );
    assert!(!st.contains_key("worker"), "{st:?}");
    assert_eq!(
        ns.status(&probe.id).await?,
        None,
        "no status for a dropped probe"
    );
    let resv: i64 = ns
        .store
        .query(
            deadpool_redis::redis::cmd("ZCARD")
                .arg(format!("{}resv:{group}:normal", ns.names.prefix())),
        )
        .await?;
    assert_eq!(resv, 0, "no reservation left");

    let _ = setup.close(200, "ok".into()).await;
    sched.stop().await?;
    let groups = [group.to_string()];
    let ch = ns.conn.create_channel().await?;
    topology::delete_all(&ch, &ns.names, &groups).await?;
    ns.cleanup().await
}

/// A broker dead letter while Redis refuses fleet's scripts (ACL, on a Redis of this test):
/// the backstop moves it to `<ns>.dead` but holds it, unacked, until its status can be
/// written — then the status says `dead`. Before, after three quick retries it was acked with
/// its status still `queued`, for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_dead_letter_waits_for_redis_to_get_its_true_status() -> anyhow::Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on(&amqp_url(), &redis.url(None), "quorum", &[]).await?;
    let sched = start_scheduler(&ns, &[("probe_interval_ms", "600000")]).await?;
    let group = "pool=bsr,protocol=builtin";
    let (setup, id) = hand_to_group(&ns, group, "pool=bsr").await?;

    redis.deny_scripts(true).await?;
    let delivered = bounce(&ns.conn, &ns.names.group_queue(group, Lane::Normal)).await?;
    assert_eq!(
        delivered as i64,
        topology::DELIVERY_LIMIT + 1,
        "the broker's limit"
    );
    wait_for(
        "the letter in the dead-letter queue",
        Duration::from_secs(20),
        || async { (ns.depth(&ns.names.dead_queue()).await == 1).then_some(()) },
    )
    .await?;
    // Redis refuses for 3 s more: the status cannot say `dead` yet, and the letter is held.
    quiet_for(
        Duration::from_secs(3),
        "Redis refusing scripts: no `dead` status while the letter is held",
    )
    .await;
    let st = ns.status(&id).await?.unwrap_or_default();
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("queued"),
        "{st:?}"
    );
    redis.deny_scripts(false).await?;
    let st = ns.wait_state(&id, "dead", Duration::from_secs(20)).await?;
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("delivery_limit"),
        "{st:?}"
    );
    assert_eq!(
        ns.depth(&ns.names.dead_queue()).await,
        1,
        "the task in the dead-letter queue once"
    );

    let _ = setup.close(200, "ok".into()).await;
    sched.stop().await?;
    let ch = ns.conn.create_channel().await?;
    topology::delete_all(&ch, &ns.names, &[group.to_string()]).await?;
    ns.cleanup().await
}
