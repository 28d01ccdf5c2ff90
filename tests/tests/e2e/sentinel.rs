//! Redis behind Sentinel (`redis+sentinel://`): after a failover that demotes the master
//! without killing it, the pool's connections to it answer `READONLY`; the store empties its
//! pool and the next calls go, through Sentinel, to the promoted replica. Private
//! `redis-server`s on free ports (the shared Redis is never touched), stopped by pid.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use fleet::{Names, Store};
use fleet_tests::*;
use serde_json::json;

use fleet_tests::servers::{redis_cli as cli, Procs};

/// A private master (A), its replica (B) and one Sentinel (S) watching A as `m`, B in sync
/// and known to S; `None` when redis-server is not installed.
async fn start_set() -> Result<Option<(Procs, std::path::PathBuf, u16, u16, u16)>> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        missing_servers("redis-server not installed")?;
        return Ok(None);
    }
    let dir = std::env::temp_dir().join(format!(
        "fleet-sentinel-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&dir)?;
    let (a, b, s) = (free_port()?, free_port()?, free_port()?);
    let mut procs = Procs(Vec::new());
    for (port, extra) in [
        (a, vec![]),
        (
            b,
            vec!["--replicaof".to_string(), "127.0.0.1".into(), a.to_string()],
        ),
    ] {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(&extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start redis-server")?;
        procs.0.push(child);
    }
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!("port {s}\nbind 127.0.0.1\ndir {}\nsentinel monitor m 127.0.0.1 {a} 1\nsentinel down-after-milliseconds m 1000\nsentinel failover-timeout m 5000\n", dir.display()),
    )?;
    procs.0.push(
        Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?,
    );
    wait_for(
        "replica in sync and known to Sentinel",
        Duration::from_secs(30),
        || async {
            let synced = cli(b, &["info", "replication"]).contains("master_link_status:up");
            let known = cli(s, &["sentinel", "replicas", "m"]).contains(&b.to_string());
            (synced && known).then_some(())
        },
    )
    .await?;

    Ok(Some((procs, dir, a, b, s)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_is_left_for_the_new_one() -> Result<()> {
    let Some((procs, dir, a, b, s)) = start_set().await? else {
        return Ok(());
    };
    let store = Store::new(
        &format!("redis+sentinel://127.0.0.1:{s}/m"),
        Names::new("sentinel-test"),
    )?;
    store
        .write_probe()
        .await
        .context("a write through Sentinel")?;
    let info: Vec<String> = store
        .query(deadpool_redis::redis::cmd("CONFIG").arg("GET").arg("port"))
        .await?;
    assert_eq!(
        info.get(1).map(String::as_str),
        Some(a.to_string().as_str()),
        "first connected to the master"
    );

    // Sentinel moves the master to B and turns A into B's replica; A stays up, so the pool's
    // connections to it are alive and answer READONLY.
    // Sentinel may not judge the replica promotable at once (NOGOODSLAVE): ask until it does.
    wait_for_every(
        "SENTINEL FAILOVER accepted",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            cli(s, &["sentinel", "failover", "m"])
                .contains("OK")
                .then_some(())
        },
    )
    .await?;
    let t = Instant::now();
    wait_for("A demoted", Duration::from_secs(30), || async {
        cli(a, &["role"]).starts_with("slave").then_some(())
    })
    .await?;
    let demoted = t.elapsed();
    let t = Instant::now();
    let back = wait_for("writes accepted again", Duration::from_secs(30), || async {
        store.write_probe().await.ok().map(|()| t.elapsed())
    })
    .await?;
    let info: Vec<String> = store
        .query(deadpool_redis::redis::cmd("CONFIG").arg("GET").arg("port"))
        .await?;
    assert_eq!(
        info.get(1).map(String::as_str),
        Some(b.to_string().as_str()),
        "now on the promoted replica"
    );
    eprintln!(
        "A demoted {demoted:?} after SENTINEL FAILOVER; writes accepted again {back:?} after that"
    );
    assert!(back < Duration::from_secs(10), "{back:?}");
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Asks S for a failover until it accepts (it may not judge the replica promotable at once:
/// NOGOODSLAVE).
async fn failover(s: u16) -> Result<()> {
    wait_for_every(
        "SENTINEL FAILOVER accepted",
        Duration::from_secs(30),
        Duration::from_millis(300),
        || async {
            cli(s, &["sentinel", "failover", "m"])
                .contains("OK")
                .then_some(())
        },
    )
    .await
}

/// A planned failover (`SENTINEL FAILOVER`, the old master alive) in the middle of a stream of
/// tasks: every task ends with its true status (none lost with writes the demoted master took
/// after the promotion), and `/readyz` is 503 for a few seconds at most — the store drops its
/// connections when Sentinel announces `+switch-master`, not when they break.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_planned_failover_keeps_every_status() -> Result<()> {
    let Some((procs, dir, a, _b, s)) = start_set().await? else {
        return Ok(());
    };
    let ns = Ns::on_redis(&format!("redis+sentinel://127.0.0.1:{s}/m")).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let labels = "case=failover";
    let w = start_worker(&ns, "w-failover", labels, 4, WORKER, &h).await?;

    // /readyz every 50 ms: the longest run of answers other than 200.
    let ready_url = sched.url("/readyz");
    let stop = tokio_util::sync::CancellationToken::new();
    let poll = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let (mut longest, mut since, mut not_ready) = (Duration::ZERO, None::<Instant>, 0u32);
            while !stop.is_cancelled() {
                let ok = http()
                    .get(&ready_url)
                    .timeout(Duration::from_secs(2))
                    .send()
                    .await
                    .is_ok_and(|r| r.status().is_success());
                match (ok, since) {
                    (false, None) => since = Some(Instant::now()),
                    (true, Some(t)) => {
                        longest = longest.max(t.elapsed());
                        since = None;
                    }
                    _ => {}
                }
                not_ready += u32::from(!ok);
                scenario_pause(Duration::from_millis(50), "the pace of the readiness probe").await;
            }
            if let Some(t) = since {
                longest = longest.max(t.elapsed());
            }
            (longest, not_ready)
        })
    };

    // A task every 100 ms for 10 s; the failover is asked for after 2 s.
    let mut ids = Vec::new();
    let started = Instant::now();
    let mut asked = None;
    for i in 0..100u32 {
        let t = task(JOB, json!({}), labels);
        ns.submit(std::slice::from_ref(&t)).await?;
        ids.push(t.id);
        if i == 20 {
            failover(s).await?;
            asked = Some(started.elapsed());
        }
        scenario_pause(
            Duration::from_millis(100),
            "the pace of the stream: a task every 100 ms",
        )
        .await;
    }
    // The failover happened: the Sentinel turns A into a replica of the new master.
    let demoted = wait_for(
        "A demoted to a replica",
        Duration::from_secs(30),
        || async { cli(a, &["role"]).starts_with("slave").then_some(()) },
    )
    .await
    .is_ok();
    let settled = wait_for("every task succeeded", Duration::from_secs(60), || async {
        for id in &ids {
            if ns.state_of(id).await.as_deref() != Some("succeeded") {
                return None;
            }
        }
        Some(())
    })
    .await;
    let mut missing = 0;
    let mut other = Vec::new();
    for id in &ids {
        match ns.state_of(id).await {
            None => missing += 1,
            Some(st) if st != "succeeded" => other.push(st),
            Some(_) => {}
        }
    }
    stop.cancel();
    let (longest, not_ready) = poll.await?;
    let runs = rec.per_task();
    let twice = ids
        .iter()
        .filter(|id| runs.get(*id).map_or(0, Vec::len) > 1)
        .count();
    let never = ids.iter().filter(|id| !runs.contains_key(*id)).count();
    println!(
        "planned failover (asked at {asked:?}, A demoted by the end: {demoted}): {} tasks, {missing} without a status, {} in another state {other:?}, {never} never ran, {twice} ran twice; /readyz not ready for at most {longest:?} ({not_ready} answers of 50 ms polls)",
        ids.len(),
        other.len()
    );
    settled?;
    assert!(demoted, "the planned failover never demoted A");
    assert_eq!((missing, other.len()), (0, 0));
    assert_eq!((never, twice), (0, 0), "every task ran exactly once");
    assert!(
        longest < Duration::from_secs(5),
        "/readyz 503 for {longest:?}"
    );

    w.stop().await?;
    sched.stop().await?;
    let _ = ns.cleanup().await;
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
