//! fleet on a Redis Cluster (`FLEET_REDIS_URL=redis+cluster://…`): three masters of this test
//! alone ([`RedisCluster`]: free loopback ports, `redis-cli --cluster create`; the shared Redis
//! is never touched), a scheduler process and two worker processes (the binaries: `cargo build
//! --bins`) on the shared RabbitMQ run `TASKS` tasks end to end, each exactly once. Then every
//! key on every node is read: the namespace's keys all sit in the one hash slot of its hash tag
//! `{<namespace>}`, on one master, and the fleet wrote nothing anywhere else — the single-slot
//! layout the Lua scripts rely on, and the per-namespace ceiling the README documents.

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use deadpool_redis::redis;
use fleet_tests::servers::RedisCluster;
use fleet_tests::*;

const TASKS: usize = 300;

/// A plain connection to one node (no cluster routing: `KEYS` lists that node's keys only).
async fn node(port: u16) -> Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}"))?;
    Ok(tokio::time::timeout(
        Duration::from_secs(10),
        client.get_multiplexed_async_connection(),
    )
    .await??)
}

/// The port of the master serving `slot`, from `CLUSTER SLOTS` (`[[start, end, [ip, port,
/// id], …], …]`).
async fn slot_owner(cluster: &RedisCluster, slot: i64) -> Result<u16> {
    let mut c = node(cluster.ports[0]).await?;
    let ranges: Vec<(i64, i64, (String, u16))> = {
        let raw: Vec<Vec<redis::Value>> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut c)
            .await?;
        raw.into_iter()
            .filter_map(|r| {
                let start = redis::from_redis_value::<i64>(r.first()?.clone()).ok()?;
                let end = redis::from_redis_value::<i64>(r.get(1)?.clone()).ok()?;
                let (ip, port): (String, u16) = match r.get(2)? {
                    redis::Value::Array(m) => (
                        redis::from_redis_value(m.first()?.clone()).ok()?,
                        redis::from_redis_value(m.get(1)?.clone()).ok()?,
                    ),
                    _ => return None,
                };
                Some((start, end, (ip, port)))
            })
            .collect()
    };
    ranges
        .iter()
        .find(|(s, e, _)| (*s..=*e).contains(&slot))
        .map(|(_, _, (_, p))| *p)
        .with_context(|| format!("no master serves slot {slot}: {ranges:?}"))
}

/// (commands processed, CPU seconds used) of one node so far.
async fn master_stats(port: u16) -> Result<(f64, f64)> {
    let mut c = node(port).await?;
    let info: String = redis::cmd("INFO").arg("all").query_async(&mut c).await?;
    let field = |name: &str| {
        info.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .strip_prefix(':')?
                    .trim()
                    .parse::<f64>()
                    .ok()
            })
            .unwrap_or(0.0)
    };
    Ok((
        field("total_commands_processed"),
        field("used_cpu_user") + field("used_cpu_sys"),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_runs_end_to_end_in_one_hash_slot() -> Result<()> {
    if Command::new("redis-server")
        .arg("--version")
        .output()
        .is_err()
    {
        return missing_servers("redis-server not installed");
    }
    let t0 = Instant::now();
    let cluster = RedisCluster::start(3).await?;
    let url = cluster.url();
    eprintln!("Redis Cluster up in {:?}: {url}", t0.elapsed());
    let ns = Ns::on_redis(&url).await?;
    let ep = Endpoint::start(10).await?;
    let mut sched = SchedulerProcess::spawn(&ns, SCHEDULER).await?;
    let mut workers = Vec::new();
    for id in ["rc-1", "rc-2"] {
        let mut w = WorkerProcess::spawn(
            &ns,
            &ProcessSpec {
                id,
                labels: "pool=rc",
                capacity: 4,
                endpoint: &ep.url,
                extra: &[],
            },
        )?;
        w.wait_state(&ns.store, "active", Duration::from_secs(30))
            .await?;
        workers.push(w);
    }

    // What the namespace's master has done so far (start-up, registrations).
    let mut probe = node(cluster.ports[0]).await?;
    let slot: i64 = redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(format!("{{{}}}", ns.name))
        .query_async(&mut probe)
        .await?;
    let owner = slot_owner(&cluster, slot).await?;
    let before = master_stats(owner).await?;

    let tasks = jobs(TASKS, "pool=rc", None);
    let ids: Vec<String> = tasks.iter().map(|e| e.id.clone()).collect();
    let submitted = Instant::now();
    assert_eq!(
        ns.submit(&tasks).await?,
        (TASKS, 0),
        "every task confirmed by the broker"
    );
    // Waits on the endpoint, so the test itself sends the master nothing while the fleet works.
    wait_for(
        "every task answered by the endpoint",
        Duration::from_secs(90),
        || async { (ep.answered_ids().len() >= TASKS).then_some(()) },
    )
    .await?;
    let ran_in = submitted.elapsed();
    let after = master_stats(owner).await?;
    wait_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    let (commands, cpu) = (after.0 - before.0, after.1 - before.1);
    eprintln!(
        "{TASKS} tasks ran in {ran_in:?}; the slot's master meanwhile: {commands} commands, {:.0} ms CPU = {:.1} commands and {:.0} µs CPU per task (heartbeats included)",
        cpu * 1e3,
        commands / TASKS as f64,
        cpu * 1e6 / TASKS as f64
    );

    // Exactly once, by the two workers.
    let per = ep.per_task();
    let want: HashSet<String> = ids.iter().cloned().collect();
    assert_eq!(
        per.keys().cloned().collect::<HashSet<_>>(),
        want,
        "the tasks that ran are the tasks submitted"
    );
    let not_once: Vec<_> = per
        .iter()
        .filter(|(_, c)| c.len() != 1)
        .map(|(id, c)| (id.clone(), c.len()))
        .collect();
    assert!(
        not_once.is_empty(),
        "tasks not run exactly once: {not_once:?}"
    );
    let by_worker: BTreeMap<String, usize> =
        ep.calls().into_iter().fold(BTreeMap::new(), |mut m, c| {
            *m.entry(c.worker).or_default() += 1;
            m
        });
    assert_eq!(
        by_worker.keys().map(String::as_str).collect::<Vec<_>>(),
        ["rc-1", "rc-2"],
        "both workers ran tasks: {by_worker:?}"
    );
    assert_eq!(by_worker.values().sum::<usize>(), TASKS);

    // Every key of every node.
    let mut keys_on: BTreeMap<u16, Vec<String>> = BTreeMap::new();
    for &port in &cluster.ports {
        let mut c = node(port).await?;
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(&mut c).await?;
        keys_on.insert(port, keys);
    }
    let holding: Vec<u16> = keys_on
        .iter()
        .filter(|(_, k)| !k.is_empty())
        .map(|(p, _)| *p)
        .collect();
    assert_eq!(
        holding,
        [owner],
        "the namespace's keys are all on the master of slot {slot}: {:?}",
        keys_on
            .iter()
            .map(|(p, k)| (p, k.len()))
            .collect::<Vec<_>>()
    );
    let keys = &keys_on[&owner];
    let outside: Vec<&String> = keys
        .iter()
        .filter(|k| !k.starts_with(ns.names.prefix()))
        .collect();
    assert!(
        outside.is_empty(),
        "keys outside the namespace prefix {}: {outside:?}",
        ns.names.prefix()
    );
    let mut c = node(owner).await?;
    let mut p = redis::pipe();
    for k in keys {
        p.cmd("CLUSTER").arg("KEYSLOT").arg(k);
    }
    let slots: Vec<i64> = p.query_async(&mut c).await?;
    let elsewhere: Vec<(&String, i64)> =
        keys.iter().zip(slots).filter(|(_, s)| *s != slot).collect();
    assert!(
        elsewhere.is_empty(),
        "keys outside slot {slot}: {elsewhere:?}"
    );
    let in_slot: usize = redis::cmd("CLUSTER")
        .arg("COUNTKEYSINSLOT")
        .arg(slot)
        .query_async(&mut c)
        .await?;
    assert_eq!(
        in_slot,
        keys.len(),
        "slot {slot} holds exactly the namespace's keys"
    );
    let present: HashSet<&str> = keys.iter().map(String::as_str).collect();
    let missing: Vec<&String> = ids
        .iter()
        .filter(|id| !present.contains(ns.names.task(id).as_str()))
        .collect();
    assert!(missing.is_empty(), "status keys missing: {missing:?}");
    eprintln!("every one of the namespace's {} keys ({TASKS} task statuses among them) is in slot {slot} on the master at port {owner}", keys.len());
    for w in &mut workers {
        w.signal("TERM")?;
    }
    for w in &mut workers {
        w.wait_exit(Duration::from_secs(30))
            .await
            .with_context(|| format!("{} did not drain", w.id))?;
    }
    sched.stop(Duration::from_secs(20)).await?;
    tokio::time::timeout(Duration::from_secs(30), ns.cleanup())
        .await
        .context("clean-up timed out")??;
    Ok(())
}
