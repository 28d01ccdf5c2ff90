//! Redis behind Sentinel (`redis+sentinel://`): after a failover that demotes the master
//! without killing it, the pool's connections to it answer `READONLY`; the store empties its
//! pool and the next calls go, through Sentinel, to the promoted replica. Private
//! `redis-server`s on free ports (the shared Redis is never touched), stopped by pid.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use fleet::{Names, Store};
use fleet_tests::{free_port, missing_servers, wait_for};

/// Private processes, killed on drop.
struct Procs(Vec<Child>);

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn cli(port: u16, args: &[&str]) -> String {
    Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demoted_master_is_left_for_the_new_one() -> Result<()> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        return missing_servers("redis-server not installed");
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
    wait_for(
        "SENTINEL FAILOVER accepted",
        Duration::from_secs(30),
        || async {
            let r = cli(s, &["sentinel", "failover", "m"]);
            if !r.contains("OK") {
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            r.contains("OK").then_some(())
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
