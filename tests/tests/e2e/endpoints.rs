//! Several RabbitMQ nodes in `FLEET_AMQP_URL`: a dead node in the list is skipped, and a
//! malformed list stops start-up (exit 2) with a message that names the setting and hides the
//! password.

use std::process::Stdio;
use std::time::Duration;

use anyhow::Result;
use fleet_tests::*;
use serde_json::json;

/// A loopback port nothing listens on (bound, then released).
fn dead_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_node_in_the_list_is_skipped() -> Result<()> {
    let ns = Ns::new().await?;
    let list = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f,{}",
        dead_port()?,
        amqp_url()
    );
    let with_list = [("amqp_url", list.as_str())];
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    // Each process starts at a random node of the list; several processes make it all but
    // certain that one of them dials the dead node first (and every one must end up connected).
    let sched = start_scheduler(&ns, &with_list).await?;
    let mut workers = Vec::new();
    for i in 0..4 {
        workers.push(start_worker(&ns, &format!("w{i}"), "pool=list", 2, &with_list, &h).await?);
    }
    let envs: Vec<_> = (0..100)
        .map(|i| task("record", json!({"i": i}), "pool=list"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (100, 0));
    wait_for("100 runs", Duration::from_secs(60), || async {
        (rec.count() >= 100).then_some(())
    })
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(rec.per_task().len(), 100);
    assert_eq!(rec.count(), 100, "no task ran twice");
    for w in workers {
        w.stop().await?;
    }
    sched.stop().await?;
    ns.cleanup().await
}

/// A "node" that accepts connections and never says a word (a frozen RabbitMQ node, a proxy
/// without a backend): it holds every socket it accepted, open and silent, until dropped.
async fn silent_node() -> Result<(u16, tokio::task::JoinHandle<()>)> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = l.local_addr()?.port();
    let held = tokio::spawn(async move {
        let mut sockets = Vec::new();
        while let Ok((s, _)) = l.accept().await {
            sockets.push(s);
        }
    });
    Ok((port, held))
}

/// One attempt at a node that accepts the socket but never answers the AMQP handshake ends
/// after `fleet::broker::amqp::CONNECT_TIMEOUT` with an error naming the node (lapin alone waits
/// forever), and a scheduler and a worker given that node beside a live one connect to the
/// live one and run tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_node_in_the_list_is_given_up_on() -> Result<()> {
    let (port, held) = silent_node().await?;
    let silent = format!("amqp://guest:s3cret@127.0.0.1:{port}/%2f");
    let t = std::time::Instant::now();
    let attempt = tokio::time::timeout(
        fleet::broker::amqp::CONNECT_TIMEOUT + Duration::from_secs(10),
        fleet::broker::amqp::connect(&silent, "silent-probe"),
    )
    .await;
    let took = t.elapsed();
    let Ok(attempt) = attempt else {
        panic!("the attempt at a silent node was still waiting after {took:?}")
    };
    let err = attempt.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(
        err.contains(&format!("127.0.0.1:{port}")) && err.contains("no answer"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "the password leaked: {err}");
    assert!(
        took >= fleet::broker::amqp::CONNECT_TIMEOUT
            && took < fleet::broker::amqp::CONNECT_TIMEOUT + Duration::from_secs(5),
        "gave up after {took:?}"
    );

    let ns = Ns::new().await?;
    let list = format!("{silent},{}", amqp_url());
    let with_list = [("amqp_url", list.as_str())];
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    // Each process starts at a random node of the list: with three, one of them dials the
    // silent node first all but surely (7 in 8), and every one must end up connected.
    let sched = start_scheduler(&ns, &with_list).await?;
    let w1 = start_worker(&ns, "w1", "pool=silent", 2, &with_list, &h).await?;
    let w2 = start_worker(&ns, "w2", "pool=silent", 2, &with_list, &h).await?;
    let envs: Vec<_> = (0..20)
        .map(|i| task("record", json!({"i": i}), "pool=silent"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (20, 0));
    wait_for("20 runs", Duration::from_secs(60), || async {
        (rec.count() >= 20).then_some(())
    })
    .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(rec.per_task().len(), 20);
    assert_eq!(rec.count(), 20, "no task ran twice");
    w1.stop().await?;
    w2.stop().await?;
    sched.stop().await?;
    held.abort();
    ns.cleanup().await
}

#[tokio::test]
async fn a_malformed_node_list_stops_start_up_with_exit_2() -> Result<()> {
    let bin = bin_path("fleet-scheduler")?;
    for bad in [
        // A semicolon instead of a comma: once taken as one URL with the rest as its vhost.
        "amqp://guest:s3cret@127.0.0.1:5672/%2f;amqp://guest:s3cret@127.0.0.1:5673/%2f",
        "amqp://guest:s3cret@127.0.0.1:5672/%2f,,amqp://guest:s3cret@127.0.0.1:5673/%2f",
        "amqp://guest:s3cret@127.0.0.1:5672/%2f,redis://guest:s3cret@127.0.0.1:6379",
    ] {
        let child = tokio::process::Command::new(&bin)
            .env("FLEET_AMQP_URL", bad)
            .env("FLEET_HTTP_ADDR", "127.0.0.1:0")
            .env("FLEET_NAMESPACE", "endpoints-refused")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let out = tokio::time::timeout(Duration::from_secs(20), child.wait_with_output()).await??;
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.code(), Some(2), "{bad}: {text}");
        assert!(text.contains("FLEET_AMQP_URL"), "{bad}: {text}");
        assert!(!text.contains("s3cret"), "the password leaked: {text}");
    }
    Ok(())
}

/// A namespace whose quorum queues were declared without `x-queue-leader-locator` (an older
/// fleet) still starts: RabbitMQ would refuse the redeclare with the new argument, so the
/// scheduler and workers find that out first and declare without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queues_older_than_the_leader_locator_are_redeclared_without_it() -> Result<()> {
    let ns = Ns::with_queue_type("quorum").await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let old = [("queue_leader_locator", "none")];
    let sched = start_scheduler(&ns, &old).await?;
    let w = start_worker(&ns, "old", "pool=locator", 2, &old, &h).await?;
    w.stop().await?;
    sched.stop().await?;
    // Today's defaults (balanced) on the same namespace.
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "new", "pool=locator", 2, &[], &h).await?;
    let envs: Vec<_> = (0..20)
        .map(|i| task("record", json!({"i": i}), "pool=locator"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (20, 0));
    wait_for("20 runs", Duration::from_secs(60), || async {
        (rec.count() >= 20).then_some(())
    })
    .await?;
    assert_eq!(rec.per_task().len(), 20);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
