//! The best-effort replication wait of task outcomes behind Sentinel (`Store::invoke_replicated`)
//! is not a rate limit (issue 37 item 2): with no replica — the promoted master right after a
//! failover whose old master is gone — an outcome write returns at once instead of running out
//! `WAIT 1 500`, and once a replica is online again the writes wait for it again. Private
//! `redis-server`s (a master, later a replica) and one Sentinel on free ports, killed on drop.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deadpool_redis::redis;
use fleet::{Names, Store};
use fleet_tests::{free_port, missing_servers, wait_for};

use fleet_tests::servers::{redis_cli as cli, Procs};

fn redis_server(port: u16, dir: &std::path::Path, extra: &[String]) -> Result<Child> {
    Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
        .args(["--save", "", "--appendonly", "no"])
        .arg("--dir")
        .arg(dir)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("start redis-server")
}

/// `WAIT` calls the master has served (`INFO commandstats`).
fn waits(port: u16) -> u64 {
    cli(port, &["info", "commandstats"])
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_wait:calls="))
        .and_then(|r| r.split(',').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outcome_writes_do_not_wait_for_a_replica_that_is_not_there() -> Result<()> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        return missing_servers("redis-server not installed");
    }
    let dir = std::env::temp_dir().join(format!(
        "fleet-replica-wait-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&dir)?;
    let (m, r, s) = (free_port()?, free_port()?, free_port()?);
    let mut procs = Procs(vec![redis_server(m, &dir, &[])?]);
    // The master answers before anything is sent to it (a CI run's first write was refused:
    // the Sentinel's answer below comes from its configuration file, not from the master).
    wait_for(
        "the master answers PING",
        Duration::from_secs(30),
        || async { (cli(m, &["ping"]).trim() == "PONG").then_some(()) },
    )
    .await?;
    let conf = dir.join("sentinel.conf");
    std::fs::write(
        &conf,
        format!("port {s}\nbind 127.0.0.1\ndir {}\nsentinel monitor m 127.0.0.1 {m} 1\nsentinel down-after-milliseconds m 1000\n", dir.display()),
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
        "Sentinel knows the master",
        Duration::from_secs(30),
        || async {
            // `flags` says `master` once the Sentinel has reached it (`s_down` while it cannot).
            let master = cli(s, &["sentinel", "master", "m"]);
            (master.contains(&m.to_string()) && master.lines().any(|l| l.trim() == "master"))
                .then_some(())
        },
    )
    .await?;
    let store = Store::new(
        &format!("redis+sentinel://127.0.0.1:{s}/m"),
        Names::new("replica-wait-test"),
    )?;
    let script = redis::Script::new("return redis.call('INCR', KEYS[1])");
    let write = || async {
        let mut inv = script.prepare_invoke();
        inv.key("replica-wait-test:n");
        store.invoke_replicated::<i64>(&inv).await
    };

    // No replica: 20 outcome writes, none waits (before: 20 × 500 ms = 10 s).
    let t = Instant::now();
    for _ in 0..20 {
        write().await?;
    }
    let alone = t.elapsed();
    let waited_alone = waits(m);
    println!(
        "no replica: 20 writes in {} ms, {waited_alone} WAIT calls",
        alone.as_millis()
    );
    assert_eq!(
        waited_alone, 0,
        "WAIT was sent with no replica to answer it"
    );
    assert!(
        alone < Duration::from_secs(2),
        "20 writes took {alone:?} with no replica"
    );

    // A replica comes online: within REPLICA_RECHECK the writes wait for it again (and it
    // answers at once).
    procs.0.push(redis_server(
        r,
        &dir,
        &["--replicaof".into(), "127.0.0.1".into(), m.to_string()],
    )?);
    wait_for("replica online", Duration::from_secs(30), || async {
        cli(m, &["info", "replication"])
            .contains("state=online")
            .then_some(())
    })
    .await?;
    let t = Instant::now();
    wait_for(
        "writes wait for the replica again",
        Duration::from_secs(10),
        || async {
            write().await.ok()?;
            (waits(m) > 0).then_some(())
        },
    )
    .await?;
    let t2 = Instant::now();
    for _ in 0..20 {
        write().await?;
    }
    let with = t2.elapsed();
    println!(
        "replica online: waits resumed after {} ms; 20 writes in {} ms, {} WAIT calls",
        t.elapsed().as_millis() - with.as_millis(),
        with.as_millis(),
        waits(m)
    );
    assert!(
        waits(m) >= 21,
        "every write waits while a replica is online"
    );
    drop(procs);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
