//! A nack says nothing about why (issue 37 item 3): a queue at its bound nacks, and so does a
//! quorum queue with no leader. `fleet::broker::amqp::nack_cause` reads the queue's depth against its
//! bound; here two real nacks on the shared broker — one from a queue at its `x-max-length`,
//! one from a queue far below it (refused by its `x-max-length-bytes`, the one nack a single
//! node gives without a full queue, standing in for a quorum queue mid-election) — are told
//! apart, and only the first is called full.

use fleet::broker::amqp::{self, NackCause};
use fleet_tests::*;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

async fn bounded_queue(
    ns: &Ns,
    name: &str,
    max_len: i64,
    max_bytes: Option<i64>,
) -> anyhow::Result<()> {
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(max_len));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    if let Some(b) = max_bytes {
        args.insert("x-max-length-bytes".into(), AMQPValue::LongLongInt(b));
    }
    ns.publisher
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                auto_delete: false,
                ..Default::default()
            },
            args,
        )
        .await?;
    Ok(())
}

/// Publishes to the default exchange (routing key = queue); the confirm's result.
async fn publish(ns: &Ns, queue: &str, body: &[u8]) -> anyhow::Result<Result<(), fleet::Error>> {
    let c = amqp::publish(
        &ns.publisher,
        "",
        queue,
        body,
        amqp::task_properties("t", None),
    )
    .await?;
    Ok(amqp::confirmed(c).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nack_is_called_full_only_at_the_bound() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let full = format!("{}.nack-full", ns.name);
    let below = format!("{}.nack-below", ns.name);
    bounded_queue(&ns, &full, 2, None).await?;
    bounded_queue(&ns, &below, 100, Some(10)).await?;

    for _ in 0..2 {
        assert!(publish(&ns, &full, b"x").await?.is_ok());
    }
    let nacked = publish(&ns, &full, b"x").await?;
    assert!(
        matches!(&nacked, Err(fleet::Error::Refused(t)) if t == amqp::NACK_TEXT),
        "{nacked:?}"
    );
    let cause = amqp::nack_cause(&ns.probe, &full, 2).await;
    println!("queue at its bound: {cause:?}");
    assert_eq!(cause, NackCause::Full { depth: 2, bound: 2 });

    let nacked = publish(&ns, &below, &[b'y'; 100]).await?;
    assert!(
        matches!(&nacked, Err(fleet::Error::Refused(t)) if t == amqp::NACK_TEXT),
        "{nacked:?}"
    );
    let cause = amqp::nack_cause(&ns.probe, &below, 100).await;
    println!("queue far below its bound: {cause:?}");
    assert_eq!(
        cause,
        NackCause::Unavailable {
            depth: 0,
            bound: 100
        }
    );

    // A queue that does not answer (here: missing) is not full either.
    let missing = format!("{}.nack-missing", ns.name);
    assert_eq!(
        amqp::nack_cause(&ns.probe, &missing, 100).await,
        NackCause::Unknown
    );

    for q in [&full, &below] {
        ns.publisher
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await?;
    }
    ns.cleanup().await
}
