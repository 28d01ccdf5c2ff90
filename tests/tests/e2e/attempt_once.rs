//! One run per attempt number when the broker's copies of a task multiply or go missing
//! (issue 37 item 1: in a node-loss run the recorder counted two runs of the same attempt of
//! 9 tasks).
//!
//! * A retry (or dead-letter) copy the broker never confirmed — the worker's channel died
//!   mid-publish, or a nack — used to release the attempt as if it had never run, so the
//!   redelivered copy ran the *same* attempt again (and the unconfirmed retry, if it had landed,
//!   ran the next one beside it). Now the attempt is spent: the next copy runs as a new attempt.
//! * A dead-lettered copy the broker publishes twice (at-least-once dead-lettering resends
//!   what its target did not confirm in time) reaches the group queue as two copies of one
//!   attempt: the second waits on the first's run record and is acked as a duplicate, whether
//!   it comes while the first runs or after it failed and published its own retry.

use std::time::Duration;

use fleet::Lane;
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use lapin::options::{ExchangeDeclareOptions, ExchangeDeleteOptions};
use lapin::types::FieldTable;
use serde_json::json;

/// Every retry publish of the namespace is made unroutable (the delay exchange emptied of its
/// tier bindings, the delayed queue unbound from the tasks exchange): the worker's mandatory
/// publish comes back unroutable — an outcome the broker did not take, like a publish whose
/// channel died before its confirm.
async fn make_retries_unroutable(ns: &Ns) -> anyhow::Result<()> {
    let ch = ns.conn.create_channel().await?;
    let delay_x = ns.names.delay_exchange();
    ch.exchange_delete(delay_x.as_str().into(), ExchangeDeleteOptions::default())
        .await?;
    ch.exchange_declare(
        delay_x.as_str().into(),
        lapin::ExchangeKind::Headers,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    ch.queue_unbind(
        ns.names.delayed_queue().as_str().into(),
        ns.names.tasks_exchange().as_str().into(),
        fleet::Names::DELAYED_KEY.into(),
        FieldTable::default(),
    )
    .await?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// A task that fails every attempt while no retry copy can reach the broker: before the fix
/// the redelivered copy ran attempt 1 again and again (a hot loop of one attempt number); now
/// attempts 1, 2 and 3 each run once and the task ends dead (`max_attempts`) with one letter.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unconfirmed_retry_spends_its_attempt() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=unconfirmed-retry";
    let attempts = Attempts::default();
    let a = attempts.clone();
    let failing = handler_fn(move |ctx| {
        let a = a.clone();
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            Err::<serde_json::Value, _>(TaskError::retryable(format!(
                "attempt {} fails",
                ctx.attempt
            )))
        }
    });
    let w = start_worker(
        &ns,
        "w-unconfirmed",
        labels,
        2,
        &[("retry_base_ms", "200"), ("retry_cap_ms", "400")],
        &[("always_fails", failing)],
    )
    .await?;
    make_retries_unroutable(&ns).await?;

    let mut t = task("always_fails", json!({}), labels);
    t.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&t)).await?;

    let r = ns.wait_state(&t.id, "dead", Duration::from_secs(40)).await;
    let seen = attempts.of(&t.id);
    println!("attempt numbers run: {seen:?}");
    let st = r.map_err(|e| e.context(format!("attempts run: {seen:?}")))?;
    ns.wait_settled(Duration::from_secs(20)).await?;
    let seen = attempts.of(&t.id);
    assert_eq!(
        seen,
        vec![1, 2, 3],
        "each attempt number runs once: {seen:?}"
    );
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("max_attempts"),
        "{st:?}"
    );
    let dead = ns.drain_dead().await?;
    let reasons: Vec<_> = dead.iter().map(|(_, r)| r.clone()).collect();
    assert_eq!(
        reasons,
        vec![Some("max_attempts".to_string())],
        "one dead letter"
    );

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Copies of one retry envelope (attempt 1 failed: the copies carry `attempt` 1 and run as
/// attempt 2), as a dead-letter worker that resent it delivers them: one while the first copy
/// runs (held by the gate), one after the first failed and published its own retry, one after
/// the task succeeded on attempt 3. Attempts run: exactly [2, 3].
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_dead_lettered_copies_run_once() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=duplicate-retry";
    let group = group_of(labels, "builtin");
    let attempts = Attempts::default();
    let gate = Gate::default();
    let (a, g) = (attempts.clone(), gate.clone());
    let flaky = handler_fn(move |ctx| {
        let (a, g) = (a.clone(), g.clone());
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            if ctx.attempt == 2 {
                g.pass(&ctx.envelope.id).await;
                return Err(TaskError::retryable("attempt 2 fails"));
            }
            Ok(json!({"attempt": ctx.attempt}))
        }
    });
    let w = start_worker(
        &ns,
        "w-duplicate",
        labels,
        4,
        &[("retry_base_ms", "200"), ("retry_cap_ms", "400")],
        &[("flaky", flaky)],
    )
    .await?;

    let mut t = task("flaky", json!({}), labels);
    t.max_attempts = Some(4);
    t.attempt = 1;
    let body = t.to_bytes();
    ns.publish_to_group(&group, Lane::Normal, &t.id, &body)
        .await?;
    wait_for("attempt 2 running", Duration::from_secs(20), || async {
        (attempts.of(&t.id) == vec![2]).then_some(())
    })
    .await?;
    // A second copy while the first runs: it must wait, not run.
    ns.publish_to_group(&group, Lane::Normal, &t.id, &body)
        .await?;
    gate.open(&t.id);
    // A third copy after attempt 2 failed (its retry is on its way or has run).
    wait_for("attempt 2 failed", Duration::from_secs(20), || async {
        let st = ns.status(&t.id).await.ok()??;
        let att: u32 = st.get("attempt")?.parse().ok()?;
        (att >= 3 || st.get("state").map(String::as_str) == Some("retrying")).then_some(())
    })
    .await?;
    ns.publish_to_group(&group, Lane::Normal, &t.id, &body)
        .await?;
    let st = ns
        .wait_state(&t.id, "succeeded", Duration::from_secs(30))
        .await?;
    assert_eq!(st.get("attempt").map(String::as_str), Some("3"), "{st:?}");
    // A fourth after the success.
    ns.publish_to_group(&group, Lane::Normal, &t.id, &body)
        .await?;
    ns.wait_settled(Duration::from_secs(20)).await?;
    let seen = attempts.of(&t.id);
    println!("attempt numbers run: {seen:?}");
    assert_eq!(seen, vec![2, 3], "each attempt number runs once: {seen:?}");

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
