//! Publisher confirms name the right message when several tasks publish on one channel at once.
//! The scheduler's dispatch loops share one publishing channel, and so do a worker's attempts:
//! a confirm that says "refused" (a full park queue's nack, an unroutable return) must be the
//! refused message's, or its source is acked as if it had been handed on — a lost task — while
//! the message that did go through is requeued.
//!
//! lapin takes a publish's delivery tag and queues its frames under two different locks; two
//! publishers on different threads can interleave between them, and the broker then numbers
//! the messages in wire order, not in tag order. `fleet::broker::amqp::Publisher` orders them.

use std::sync::Arc;

use fleet::broker::amqp;
use fleet_tests::amqp_url;
use lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

/// Publishing tasks (half to a queue that refuses everything, half to an open one).
const PUBLISHERS: usize = 8;
/// Rounds per task, each one batch.
const ROUNDS: usize = 150;
/// Messages per batch.
const BATCH: usize = 8;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn confirms_match_their_messages_under_concurrent_publishers() -> anyhow::Result<()> {
    let conn = amqp::connect(&amqp_url(), "fleet-tests-publish-order").await?;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let (refusing, open) = (format!("order.{tag}.refusing"), format!("order.{tag}.open"));
    let setup = conn.create_channel().await?;
    let mut bounded = FieldTable::default();
    bounded.insert("x-max-length".into(), AMQPValue::LongLongInt(0));
    bounded.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    let opts = QueueDeclareOptions {
        auto_delete: true,
        ..Default::default()
    };
    setup
        .queue_declare(refusing.as_str().into(), opts, bounded)
        .await?;
    setup
        .queue_declare(open.as_str().into(), opts, FieldTable::default())
        .await?;

    let publisher = Arc::new(amqp::confirm_channel(&conn).await?);
    let mut tasks = Vec::new();
    for t in 0..PUBLISHERS {
        let refused_here = t % 2 == 0;
        let queue = if refused_here {
            refusing.clone()
        } else {
            open.clone()
        };
        let publisher = publisher.clone();
        tasks.push(tokio::spawn(async move {
            let mut wrong = 0usize;
            for round in 0..ROUNDS {
                // Odd rounds one message at a time, even rounds as a batch: both paths.
                let confirms = if round % 2 == 1 {
                    vec![
                        amqp::publish(
                            &publisher,
                            "",
                            &queue,
                            b"x",
                            amqp::task_properties("x", None),
                        )
                        .await,
                    ]
                } else {
                    let msgs = (0..BATCH).map(|_| amqp::Outgoing {
                        exchange: "",
                        routing_key: &queue,
                        body: b"x",
                        props: amqp::task_properties("x", None),
                    });
                    amqp::publish_batch(&publisher, msgs).await
                };
                for c in confirms {
                    let refused = amqp::confirmed(c?).await.is_err();
                    if refused != refused_here {
                        wrong += 1;
                    }
                }
            }
            anyhow::Ok(wrong)
        }));
    }
    let mut wrong = 0;
    for t in tasks {
        wrong += t.await??;
    }
    let sent = PUBLISHERS * ROUNDS * (BATCH + 1) / 2;
    println!("publish order: {sent} messages from {PUBLISHERS} concurrent publishers on one channel; {wrong} confirms named another message");
    let open_depth = setup
        .queue_declare(
            open.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?
        .message_count();
    let _ = setup
        .queue_delete(refusing.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = setup
        .queue_delete(open.as_str().into(), QueueDeleteOptions::default())
        .await;
    let _ = conn.close(200, "bye".into()).await;
    assert_eq!(
        wrong, 0,
        "a refused message's confirm was taken for another's"
    );
    assert_eq!(
        open_depth as usize,
        sent / 2,
        "every message to the open queue is there"
    );
    Ok(())
}
