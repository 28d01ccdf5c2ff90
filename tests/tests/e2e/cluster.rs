//! fleet past one machine: a three-node RabbitMQ cluster and a Redis master + replica + three
//! Sentinels (`ops/cluster.sh`, private processes on loopback — the shared servers are never
//! touched). A steady stream of tasks goes in through the scheduler's API while the broker node
//! the scheduler is connected to is killed, then the Redis master. Asserts: every task the API
//! confirmed (202) runs (0 lost; their statuses are reported), no attempt runs twice, every worker (and so the
//! scheduler's dispatch) and the API (its 202 answers) are back at work within 10 s of each
//! kill (the end of a stall, see `back_at_work`), no two 202 answers across a kill are more
//! than 10 s apart, every status that was `succeeded` before the Redis failover still is after it, and
//! every quorum queue still has a leader; across the node kill `ingress_full` and
//! `broker_unavailable` are each answered over no more than 2 s (the ingress queue is never near
//! its bound: a nack from a queue without a leader is `broker_unavailable`, issue 37 item 3).
//!
//! Across the Redis failover (the killed master never comes back, so the promoted one has no
//! replica) the fleet runs at least 80 % of its pre-fault rate from 10 s after the failover
//! (issue 37 item 2), measured at 120 tasks offered a second; every worker ends at `running 0`.
//!
//! `a_kill_of_the_delayed_leader_strands_no_delayed_work` (issue 37 item 1): the node leading
//! `<ns>.delayed` killed 1.5 s into a burst of delayed tasks, failing-once tasks and plain ones,
//! then (the killed node started again each time) the node leading the most delay-path queues
//! not hit yet, until every queue of the delay path (`<ns>.delayed` and each tier
//! `<ns>.hold.<ms>`) has had its leader killed; in every round every delayed task and retry
//! runs within 10 s of its due time plus the failover, no attempt runs twice, every worker ends
//! at `running 0`. The delay tiers are held and forwarded by the scheduler's tier loops
//! (`fleet::broker::delay`): with the TTL tiers of before, whose at-least-once dead-lettering RabbitMQ
//! 3.10.8 did in a dead-letter worker per queue, 2 of 3 runs here stranded a tier's messages
//! for minutes (`<ns>.wait.400` kept 46-57, none ready) when its leader or `<ns>.delayed`'s was
//! on the killed node. The test prints which of the delay path's queues each kill hit.
//!
//! `FLEET_CLUSTER_DIR=DIR` reuses a cluster already started with `ops/cluster.sh up DIR`
//! (it is left running, less the last killed node and the Redis master); otherwise the test starts its
//! own and stops it at the end. Skipped (with a message) when rabbitmq-server or redis-server
//! is not installed.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fleet::{Names, Store};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler, TaskError};
use serde_json::json;

/// How soon after a kill every process — each worker and the scheduler's API — must be at
/// work again (the bound).
const BACK_WITHIN: Duration = Duration::from_secs(10);

/// Tasks per second offered to the API.
const RATE: u64 = 40;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A running cluster: its `cluster.env`, and whether this test owns it (then `down` on drop).
struct Cluster {
    dir: PathBuf,
    env: HashMap<String, String>,
    owned: bool,
}

impl Cluster {
    fn script(&self, args: &[&str]) -> Result<String> {
        let out = std::process::Command::new("timeout")
            .args(["120", "bash"])
            .arg(repo_root().join("ops/cluster.sh"))
            .args(args)
            .output()
            .context("run ops/cluster.sh")?;
        if !out.status.success() {
            bail!(
                "ops/cluster.sh {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    async fn start() -> Result<Option<Self>> {
        if let Ok(d) = std::env::var("FLEET_CLUSTER_DIR") {
            let dir = PathBuf::from(d);
            let env = read_env(&dir.join("cluster.env"))?;
            return Ok(Some(Cluster {
                dir,
                env,
                owned: false,
            }));
        }
        if !Path::new("/usr/lib/rabbitmq/bin/rabbitmq-server").exists()
            || which("redis-server").is_none()
        {
            missing_servers("rabbitmq-server or redis-server not installed")?;
            return Ok(None);
        }
        // Three Erlang VMs booting and joining on a loaded 2-core machine: a boot that fails
        // (a CI run saw `rabbit_is_not_running` from a node's join right after its start) is
        // torn down (the Cluster's drop) and tried once more on fresh ports; the scenario
        // itself is never retried.
        let mut attempt = 0;
        let (c, dir) = loop {
            attempt += 1;
            let dir = std::env::temp_dir().join(format!(
                "fleet-cluster-{}",
                &uuid::Uuid::new_v4().simple().to_string()[..8]
            ));
            let c = Cluster {
                dir: dir.clone(),
                env: HashMap::new(),
                owned: true,
            };
            let d = dir.to_string_lossy().into_owned();
            // Up to a few minutes on a loaded 2-core machine (three Erlang VMs booting).
            let up = tokio::task::spawn_blocking(move || {
                std::process::Command::new("timeout")
                    .args(["400", "bash"])
                    .arg(repo_root().join("ops/cluster.sh"))
                    .args(["up", &d])
                    .output()
            })
            .await??;
            if up.status.success() {
                break (c, dir);
            }
            let why = format!(
                "ops/cluster.sh up: {}{}",
                String::from_utf8_lossy(&up.stdout),
                String::from_utf8_lossy(&up.stderr)
            );
            drop(c);
            if attempt >= 2 {
                bail!(why);
            }
            eprintln!("the cluster did not boot ({why}); trying once more");
        };
        let mut c = c;
        c.env = read_env(&dir.join("cluster.env"))?;
        Ok(Some(c))
    }

    fn get(&self, k: &str) -> Result<&str> {
        self.env
            .get(k)
            .map(String::as_str)
            .with_context(|| format!("{k} missing from cluster.env"))
    }

    fn dir(&self) -> String {
        self.dir.to_string_lossy().into_owned()
    }

    /// The queues of namespace `ns` with their type, leader, members, members online, messages
    /// and consumers (`rabbitmqctl list_queues`), or why they could not be listed: what a
    /// failure message shows.
    fn queues(&self, ns: &str) -> String {
        match self.script(&[
            "ctl",
            &self.dir(),
            "list_queues",
            "name",
            "type",
            "leader",
            "members",
            "online",
            "messages",
            "consumers",
        ]) {
            Ok(out) => out
                .lines()
                .filter(|l| l.starts_with(&format!("{ns}.")))
                .collect::<Vec<_>>()
                .join("\n"),
            Err(e) => format!("(cannot list the queues: {e:#})"),
        }
    }

    /// Whether every quorum queue of namespace `ns` has all three members online. A quorum
    /// queue declared a moment before a node dies may not have started its members on the
    /// other nodes yet; the test kills a node of a settled cluster, as a real outage finds it.
    fn quorum_settled(&self, ns: &str) -> bool {
        let Ok(out) = self.script(&[
            "ctl",
            &self.dir(),
            "list_queues",
            "name",
            "type",
            "members",
            "online",
        ]) else {
            return false;
        };
        let count = |list: &str| {
            list.trim_matches(|c| c == '[' || c == ']')
                .split(',')
                .filter(|m| !m.trim().is_empty())
                .count()
        };
        let rows: Vec<Vec<&str>> = out
            .lines()
            .filter(|l| l.starts_with(&format!("{ns}.")))
            .map(|l| l.split('\t').collect())
            .collect();
        !rows.is_empty()
            && rows.iter().all(|c| {
                c.get(1) != Some(&"quorum")
                    || (c.get(2).map(|m| count(m)) == Some(3)
                        && c.get(3).map(|m| count(m)) == Some(3))
            })
    }

    /// The node (1-3) leading each quorum queue now (`list_queues name leader`, one call);
    /// a queue led by none of the cluster's nodes (none now) is left out.
    fn leaders(&self) -> Result<HashMap<String, usize>> {
        let out = self.script(&["ctl", &self.dir(), "list_queues", "name", "leader"])?;
        let mut nodes = Vec::new();
        for i in 1..=3 {
            nodes.push((self.get(&format!("NODE{i}_NAME"))?.to_string(), i));
        }
        Ok(out
            .lines()
            .filter_map(|line| {
                let (queue, leader) = line.split_once('\t')?;
                let n = nodes.iter().find(|(name, _)| name == leader.trim())?.1;
                Some((queue.to_string(), n))
            })
            .collect())
    }

    /// The node (1-3) the named AMQP connection is on, by the server port it connected to.
    fn node_of(&self, connection_name: &str) -> Result<usize> {
        let out = self.script(&[
            "ctl",
            &self.dir(),
            "list_connections",
            "port",
            "client_properties",
        ])?;
        // The exact name (followed by its closing quote in client_properties): a scheduler's
        // prober connection is named "<name> probe".
        let exact = format!("{connection_name}\"");
        for line in out.lines() {
            if line.contains(&exact) {
                let port = line.split_whitespace().next().unwrap_or("");
                for i in 1..=3 {
                    if self.get(&format!("NODE{i}_PORT"))? == port {
                        return Ok(i);
                    }
                }
            }
        }
        bail!("no connection named {connection_name}: {out}")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if self.owned {
            let _ = self.script(&["down", &self.dir()]);
        }
    }
}

fn which(bin: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join(bin))
            .find(|f| f.exists())
    })
}

fn read_env(path: &Path) -> Result<HashMap<String, String>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    Ok(text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| {
            (
                k.trim().to_string(),
                v.trim().trim_matches('\'').to_string(),
            )
        })
        .collect())
}

/// One run as the handler saw it.
#[derive(Clone, Debug)]
struct Run {
    id: String,
    worker: String,
    attempt: u32,
    at: Instant,
}

#[derive(Clone, Default)]
struct Runs(Arc<Mutex<Vec<Run>>>);

impl Runs {
    fn handler(&self) -> Arc<dyn Handler> {
        let runs = self.clone();
        handler_fn(move |ctx| {
            let runs = runs.clone();
            async move {
                let run = Run {
                    id: ctx.envelope.id.clone(),
                    worker: ctx.worker_id.to_string(),
                    attempt: ctx.attempt,
                    at: Instant::now(),
                };
                runs.0
                    .lock()
                    .map_err(|_| TaskError::retryable("poisoned"))?
                    .push(run);
                tokio::time::sleep(Duration::from_millis(30)).await;
                Ok(json!({}))
            }
        })
    }

    fn all(&self) -> Vec<Run> {
        self.0.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// The producer: POSTs `RATE` tasks a second (or the stream's `rate`) to the scheduler's API,
/// a tenth of them every 100 ms; a task whose POST was not
/// answered 202 is offered again (same id) in the next tick, as a producer would. Records the
/// ids the API confirmed and when the API confirmed anything.
#[derive(Clone, Default)]
struct Stream {
    accepted: Arc<Mutex<Vec<String>>>,
    accepted_at: Arc<Mutex<Vec<Instant>>>,
    /// Answers other than 202: (when, status or error, body start, how long the call took).
    others: Arc<Mutex<Vec<(Instant, String, Duration)>>>,
    /// Tasks a second offered now; 0 is [`RATE`].
    rate: Arc<std::sync::atomic::AtomicU64>,
}

async fn produce(url: String, stream: Stream, stop: tokio_util::sync::CancellationToken) {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap_or_default();
    let mut pending: Vec<fleet::Envelope> = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while !stop.is_cancelled() {
        tick.tick().await;
        let rate = match stream.rate.load(std::sync::atomic::Ordering::Relaxed) {
            0 => RATE,
            r => r,
        };
        for _ in 0..rate / 10 {
            pending.push(task("work", json!({}), "pool=cluster"));
        }
        let body: Vec<serde_json::Value> = pending
            .iter()
            .filter_map(|e| serde_json::from_slice(&e.to_bytes()).ok())
            .collect();
        let sent = Instant::now();
        match client.post(&url).json(&body).send().await {
            Ok(r) if r.status().as_u16() != 202 => {
                let status = r.status().as_u16();
                let text: String = r
                    .text()
                    .await
                    .unwrap_or_default()
                    .chars()
                    .take(120)
                    .collect();
                if let Ok(mut o) = stream.others.lock() {
                    o.push((sent, format!("{status} {text}"), sent.elapsed()));
                }
            }
            Err(e) => {
                if let Ok(mut o) = stream.others.lock() {
                    o.push((sent, e.to_string(), sent.elapsed()));
                }
            }
            Ok(_) => {
                if sent.elapsed() > Duration::from_secs(1) {
                    if let Ok(mut o) = stream.others.lock() {
                        o.push((sent, "202 (slow)".to_string(), sent.elapsed()));
                    }
                }
                let ids: Vec<String> = pending.drain(..).map(|e| e.id).collect();
                if let (Ok(mut a), Ok(mut t)) = (stream.accepted.lock(), stream.accepted_at.lock())
                {
                    a.extend(ids);
                    t.push(Instant::now());
                }
            }
        }
        // Not 202 (partly accepted, or not at all): everything is offered again next tick;
        // the dedupe window drops the copies of what was taken.
    }
}

/// Both scenarios, one after the other, each on a private cluster of its own (three RabbitMQ
/// nodes and a Redis set: two at once on a 2-core machine starved each other past their
/// bounds). One test rather than two behind a lock: the second would hold a test thread idle
/// for the whole of the first (77 s measured) while the other tests queue for it. Both run
/// whatever the first's outcome ([`run_alone`]); the test fails naming each that failed. The
/// delayed-leader scenario goes first: it starts again every node it kills, so a cluster
/// reused with `FLEET_CLUSTER_DIR` is whole for the failover scenario, which leaves a node and
/// the Redis master down.
#[test]
fn node_kills_and_a_redis_failover_lose_nothing_and_strand_no_delayed_work() -> Result<()> {
    let failed: Vec<String> = [
        run_alone(
            "a_kill_of_the_delayed_leader_strands_no_delayed_work",
            a_kill_of_the_delayed_leader_strands_no_delayed_work,
        ),
        run_alone(
            "a_node_kill_and_a_redis_failover_lose_nothing",
            a_node_kill_and_a_redis_failover_lose_nothing,
        ),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !failed.is_empty() {
        bail!("{}", failed.join("\n"));
    }
    Ok(())
}

/// Runs one scenario on a tokio runtime of its own (4 worker threads, as `#[tokio::test]`
/// gave each before) and returns why it failed, if it did. A panic (a failed `assert!`) is
/// its failure, not the end of the test; whatever it left running (a fleet it returned
/// before stopping, its producer) ends with its runtime, shut down with a 10 s bound.
fn run_alone<F, Fut>(name: &str, scenario: F) -> Option<String>
where
    F: FnOnce() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return Some(format!("{name}: no runtime: {e}")),
    };
    let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(scenario())));
    rt.shutdown_timeout(Duration::from_secs(10));
    match out {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(format!("{name}: {e:#}")),
        Err(panic) => {
            let why = panic
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| panic.downcast_ref::<&str>().copied())
                .unwrap_or("(no message)");
            Some(format!("{name}: panicked: {why}"))
        }
    }
}

#[test]
fn run_alone_reports_an_error_and_a_panic_and_ends_what_a_scenario_left() {
    assert_eq!(run_alone("ok", || async { Ok(()) }), None);
    assert_eq!(
        run_alone("err", || async { Err(anyhow::anyhow!("no")) }),
        Some("err: no".to_string())
    );
    assert_eq!(
        run_alone("boom", || async { panic!("boom") }),
        Some("boom: panicked: boom".to_string())
    );
    // A task left running forever ends with the scenario's runtime.
    let t = Instant::now();
    let left = run_alone("left", || async {
        tokio::spawn(async {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        Ok(())
    });
    assert_eq!(left, None);
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

async fn a_node_kill_and_a_redis_failover_lose_nothing() -> Result<()> {
    let Some(cluster) = Cluster::start().await? else {
        return Ok(());
    };
    let amqp = cluster.get("FLEET_CLUSTER_AMQP_URL")?.to_string();
    let redis = cluster.get("FLEET_CLUSTER_REDIS_URL")?.to_string();

    let name = format!("c{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let names = Names::new(&name);
    let store = Store::new(&redis, names.clone())?;
    let conn = fleet::broker::connect_any(
        &amqp,
        "fleet-tests cluster",
        &fleet::tls::TlsConfig::default(),
    )
    .await?;
    let publisher = fleet::broker::amqp::confirm_channel(&conn).await?;
    let base = vec![
        ("namespace".to_string(), name.clone()),
        ("amqp_url".to_string(), amqp.clone()),
        ("redis_url".to_string(), redis.clone()),
        ("queue_type".to_string(), "quorum".to_string()),
        ("http_addr".to_string(), "127.0.0.1:0".to_string()),
    ];
    let ns = Ns {
        name: name.clone(),
        names,
        store,
        conn,
        publisher,
        base,
        probe: std::sync::Arc::new(fleet::broker::probe::Prober::new(
            &amqp,
            "fleet-tests cluster",
            &Default::default(),
        )),
    };

    // Heartbeat timeouts of 10 s: a Redis failover (Sentinel's 1 s down-after + election)
    // must not read as every worker gone silent.
    let sched = start_scheduler(
        &ns,
        &[
            ("dedupe_window_ms", "600000"),
            ("heartbeat_timeout_ms", "10000"),
        ],
    )
    .await?;
    let runs = Runs::default();
    let h = [("work", runs.handler())];
    let mut workers = Vec::new();
    for i in 0..3 {
        workers.push(
            start_worker(
                &ns,
                &format!("cw{i}"),
                "pool=cluster",
                4,
                &[("heartbeat_timeout_ms", "10000")],
                &h,
            )
            .await?,
        );
    }
    let worker_ids: HashSet<String> = workers.iter().map(|w| w.id.clone()).collect();

    let stream = Stream::default();
    let stop = tokio_util::sync::CancellationToken::new();
    let producer = tokio::spawn(produce(
        sched.url("/v1/tasks"),
        stream.clone(),
        stop.clone(),
    ));
    wait_for("every worker at work", Duration::from_secs(60), || async {
        let now = runs.all();
        worker_ids
            .iter()
            .all(|w| now.iter().any(|r| &r.worker == w))
            .then_some(())
    })
    .await?;

    wait_for(
        "every quorum queue with its three members online",
        Duration::from_secs(60),
        || async { cluster.quorum_settled(&name).then_some(()) },
    )
    .await?;

    // 1. Kill the broker node the scheduler is connected to.
    let node = cluster.node_of(&format!("fleet-scheduler {name}"))?;
    let killed_at = Instant::now();
    cluster.script(&["kill-node", &node.to_string(), &cluster.dir()])?;
    eprintln!("killed RabbitMQ node {node} (the scheduler's)");
    let back = wait_back(&runs, &stream, &worker_ids, killed_at).await;
    eprintln!("after the node kill: {back:?}");
    if back.is_err() {
        eprintln!("the namespace's queues now:\n{}", cluster.queues(&name));
    }
    if let Ok(b) = &back {
        eprintln!(
            "across the node kill, the longest time between two 202 answers of the API: {:?}",
            b.get(API).map(|d| d.longest_gap)
        );
    }

    // 2. Kill the Redis master; Sentinel promotes the replica. The statuses already
    // `succeeded` now must still be after the failover: a worker's outcomes wait for a
    // replica's acknowledgement (`WAIT 1 500`) before they count as written, and the wait
    // below is longer than that.
    //
    // Throughput across it (issue 37 item 2: with no replica coming back, `WAIT 1 500` on every
    // outcome batch held the fleet at 16 tasks/s): the offered rate goes up to `HIGH` — above
    // what outcome batches each held 500 ms let through — and the tasks run a second (run
    // starts: a worker's slot is held until its outcome is written, so they are its
    // completions) are counted over `WINDOW` before the kill and from 10 s after the failover.
    const HIGH: u64 = 120;
    const WINDOW: Duration = Duration::from_secs(5);
    let rate_in = |from: Instant| {
        let n = runs
            .all()
            .iter()
            .filter(|r| r.at >= from && r.at < from + WINDOW)
            .count();
        n as f64 / WINDOW.as_secs_f64()
    };
    let offered_in = |from: Instant| {
        let n = stream
            .accepted_at
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|t| **t >= from && **t < from + WINDOW)
                    .count()
            })
            .unwrap_or(0);
        // Each 202 answers one tick's batch (a tenth of a second's rate, more after refusals).
        (n as u64 * HIGH / 10) as f64 / WINDOW.as_secs_f64()
    };
    stream
        .rate
        .store(HIGH, std::sync::atomic::Ordering::Relaxed);
    scenario_pause(
        Duration::from_secs(3),
        "the fleet settled at the higher rate before the first window",
    )
    .await;
    let before_from = Instant::now();
    scenario_pause(WINDOW, "the window before the Redis kill").await;
    let rate_before = rate_in(before_from);
    eprintln!(
        "before the Redis kill: {rate_before:.1} tasks run a second over {WINDOW:?} ({:.1} a second offered and confirmed)",
        offered_in(before_from)
    );
    let done_before = succeeded_now(&ns, &stream).await?;
    scenario_pause(
        Duration::from_secs(3),
        "a margin past the outcomes' replication wait (WAIT 1 500) before the master dies",
    )
    .await;
    let sentinel: u16 = cluster.get("SENTINEL1_PORT")?.parse()?;
    let master_port = || {
        redis_cli(
            sentinel,
            &["sentinel", "get-master-addr-by-name", "fleetmaster"],
        )
        .lines()
        .nth(1)
        .and_then(|p| p.trim().parse::<u16>().ok())
    };
    let old_master = master_port().context("Sentinel names no master")?;
    let killed_redis_at = Instant::now();
    eprintln!(
        "{}",
        cluster
            .script(&["kill-redis-master", &cluster.dir()])?
            .trim()
    );
    // The failover: Sentinel names another master (the old one is never started again).
    let failover = wait_for(
        "Sentinel names a new Redis master",
        Duration::from_secs(60),
        || async {
            master_port()
                .filter(|p| *p != old_master)
                .map(|p| (p, killed_redis_at.elapsed()))
        },
    )
    .await;
    let back_redis = wait_back(&runs, &stream, &worker_ids, killed_redis_at).await;
    let (rate_after, replicas) = match &failover {
        Ok((new_master, took)) => {
            eprintln!("Sentinel promoted port {new_master} {took:?} after the kill");
            let after_from = killed_redis_at + *took + Duration::from_secs(10);
            tokio::time::sleep_until((after_from + WINDOW).into()).await;
            let rate_after = rate_in(after_from);
            eprintln!(
                "from 10 s after the failover: {rate_after:.1} tasks run a second over {WINDOW:?} ({:.1} a second offered and confirmed); {:.0} % of the rate before",
                offered_in(after_from),
                100.0 * rate_after / rate_before.max(f64::MIN_POSITIVE)
            );
            let replicas = redis_cli(*new_master, &["info", "replication"])
                .lines()
                .find_map(|l| {
                    l.trim()
                        .strip_prefix("connected_slaves:")?
                        .parse::<u32>()
                        .ok()
                });
            eprintln!(
                "the new master's replicas: {replicas:?}; the old master (port {old_master}) answers PING: {:?}",
                redis_cli(old_master, &["ping"]).trim()
            );
            (rate_after, replicas)
        }
        Err(e) => {
            eprintln!("no failover: {e:#}");
            (0.0, None)
        }
    };
    stream
        .rate
        .store(RATE, std::sync::atomic::Ordering::Relaxed);
    eprintln!("after the Redis master kill: {back_redis:?}");
    if back_redis.is_err() {
        eprintln!("the namespace's queues now:\n{}", cluster.queues(&name));
    }
    if let Ok(b) = &back_redis {
        eprintln!(
            "across the Redis failover, the longest time between two 202 answers of the API: {:?}",
            b.get(API).map(|d| d.longest_gap)
        );
    }
    if let Ok(o) = stream.others.lock() {
        for (at, what, took) in o.iter() {
            let rel = |t0: Instant| {
                if *at >= t0 {
                    format!("+{:?}", *at - t0)
                } else {
                    format!("-{:?}", t0 - *at)
                }
            };
            eprintln!("API answer {} after the node kill / {} after the Redis kill, took {took:?}: {what}", rel(killed_at), rel(killed_redis_at));
        }
    }
    // Refusals the depths do not explain (issue 37 item 3): `ingress_full` means the ingress
    // queue is within 10 % of its bound (10,000 here, never near it at 40 tasks a second); a
    // nack from a queue without a leader is `broker_unavailable`.
    let refusals = |code: &str| -> (usize, Duration) {
        let o = stream.others.lock().map(|o| o.clone()).unwrap_or_default();
        let at: Vec<Instant> = o
            .iter()
            .filter(|(_, what, _)| what.contains(code))
            .map(|(at, ..)| *at)
            .collect();
        let span = match (at.iter().min(), at.iter().max()) {
            (Some(a), Some(b)) => *b - *a,
            _ => Duration::ZERO,
        };
        (at.len(), span)
    };
    let (full_n, full_span) = refusals("ingress_full");
    let (unavail_n, unavail_span) = refusals("broker_unavailable");
    eprintln!("API refusals: ingress_full {full_n} over {full_span:?}; broker_unavailable {unavail_n} over {unavail_span:?}");

    scenario_pause(
        Duration::from_secs(3),
        "the stream goes on 3 s past the failover",
    )
    .await;
    stop.cancel();
    producer.await?;
    let accepted: Vec<String> = stream
        .accepted
        .lock()
        .map(|a| a.clone())
        .unwrap_or_default();
    eprintln!("{} tasks confirmed by the API", accepted.len());
    // Every confirmed task runs (the broker's part: nothing lost).
    wait_for(
        "every confirmed task ran",
        Duration::from_secs(120),
        || async {
            let ran: HashSet<String> = runs.all().into_iter().map(|r| r.id).collect();
            accepted.iter().all(|id| ran.contains(id)).then_some(())
        },
    )
    .await
    .context("confirmed tasks lost, or still queued behind a fleet running below the offered rate (see the rates above)")?;
    // Their statuses (Redis's part): a status written to the old master in the moment before
    // it died and not yet replicated is lost with it (Redis replication is asynchronous).
    let count_states = || async {
        let mut states: BTreeMap<String, usize> = BTreeMap::new();
        for id in &accepted {
            let s = ns
                .status(id)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.get("state").cloned())
                .unwrap_or_else(|| "none".into());
            *states.entry(s).or_default() += 1;
        }
        states
    };
    // Up to 30 s for every status to say `succeeded`; what they say then is reported below
    // either way (a status lost with the old master is allowed).
    let _ = wait_for_every(
        "every confirmed task's status succeeded",
        Duration::from_secs(30),
        Duration::from_secs(1),
        || async { (count_states().await.get("succeeded") == Some(&accepted.len())).then_some(()) },
    )
    .await;
    let states = count_states().await;
    eprintln!("statuses of the confirmed tasks: {states:?}");
    let mut reverted: Vec<(String, String)> = Vec::new();
    for id in &done_before {
        let s = ns
            .status(id)
            .await
            .ok()
            .flatten()
            .and_then(|s| s.get("state").cloned())
            .unwrap_or_else(|| "none".into());
        if s != "succeeded" {
            reverted.push((id.clone(), s));
        }
    }
    eprintln!(
        "{} statuses were succeeded before the Redis failover; {} of them still are",
        done_before.len(),
        done_before.len() - reverted.len()
    );
    let all = runs.all();
    let ran: HashSet<&str> = all.iter().map(|r| r.id.as_str()).collect();
    let never_ran: Vec<&String> = accepted
        .iter()
        .filter(|id| !ran.contains(id.as_str()))
        .collect();
    let mut per_attempt: BTreeMap<(String, u32), usize> = BTreeMap::new();
    for r in &all {
        *per_attempt.entry((r.id.clone(), r.attempt)).or_default() += 1;
    }
    let twice: Vec<_> = per_attempt.iter().filter(|(_, n)| **n > 1).collect();
    // A quorum queue's record names its current leader ({RaName, Node}); one on a node that is
    // not running has no leader.
    let leaderless = cluster.script(&[
        "ctl",
        &cluster.dir(),
        "eval",
        &format!(
            "Running = rabbit_nodes:all_running(), \
         length([Q || Q <- rabbit_amqqueue:list(), amqqueue:get_type(Q) =:= rabbit_quorum_queue, \
         binary:match(element(4, amqqueue:get_name(Q)), <<\"{name}.\">>) =/= nomatch, \
         not lists:member(element(2, amqqueue:get_pid(Q)), Running)])."
        ),
    ])?;

    let addrs: Vec<std::net::SocketAddr> = workers.iter().map(|w| w.addr).collect();
    let running = running_at_the_end(&addrs).await;
    eprintln!("workers' running counts at the end: {running:?}");
    eprintln!("stopping the fleet");
    for w in workers {
        w.stop().await?;
    }
    sched.stop().await?;
    // Bounded: the test's own connection may have been on the killed node.
    let _ = tokio::time::timeout(Duration::from_secs(30), ns.cleanup()).await;

    eprintln!(
        "runs {}, confirmed {}, never ran {}, attempts run twice {}",
        all.len(),
        accepted.len(),
        never_ran.len(),
        twice.len()
    );
    assert!(
        never_ran.is_empty(),
        "confirmed tasks that never ran: {never_ran:?}"
    );
    assert!(twice.is_empty(), "attempts run twice: {twice:?}");
    assert!(
        !done_before.is_empty(),
        "no status was succeeded before the Redis failover"
    );
    assert_eq!(
        reverted.len(),
        0,
        "statuses succeeded before the Redis failover and not after it: {reverted:?}"
    );
    assert_eq!(leaderless.trim(), "0", "quorum queues without a leader");
    assert_eq!(running, vec![0, 0, 0], "every worker back to running 0");
    failover.context("the Redis failover")?;
    // The scenario of issue 37 item 2: the promoted master has no replica (none comes back).
    assert_eq!(replicas, Some(0), "the promoted master's replicas");
    assert!(
        rate_after >= 0.8 * rate_before,
        "from 10 s after the Redis failover {rate_after:.1} tasks a second ran, under 80 % of the {rate_before:.1} before it"
    );
    assert!(
        full_span <= Duration::from_secs(2),
        "ingress_full answered over {full_span:?} ({full_n} times) with the ingress queue far below its bound"
    );
    // A nack from a queue mid-election is not the producer's fault either, and the issue's
    // bound holds for every refusal the depths do not explain.
    assert!(
        unavail_span <= Duration::from_secs(2),
        "broker_unavailable answered over {unavail_span:?} ({unavail_n} times) across the node kill"
    );
    for (what, b) in [("node kill", back), ("Redis master kill", back_redis)] {
        let b = b?;
        for (who, d) in &b {
            // Workers start runs only when the scheduler dispatches again, so their bound is
            // the scheduler's too.
            assert!(
                d.at <= BACK_WITHIN,
                "after the {what}, {who} was back at work only after {:?}: {b:?}",
                d.at
            );
        }
        // The API answered 202 again within the bound: no two answers across the kill are
        // further apart.
        let api = b.get(API).map(|d| d.longest_gap).unwrap_or(Duration::MAX);
        assert!(
            api <= BACK_WITHIN,
            "across the {what}, the API answered no 202 for {api:?}: {b:?}"
        );
    }
    Ok(())
}

/// The confirmed tasks whose status is `succeeded` now (read through Sentinel, bounded).
async fn succeeded_now(ns: &Ns, stream: &Stream) -> Result<Vec<String>> {
    let accepted: Vec<String> = stream
        .accepted
        .lock()
        .map(|a| a.clone())
        .unwrap_or_default();
    let read = async {
        let mut done = Vec::new();
        for id in accepted {
            if ns
                .status(&id)
                .await
                .ok()
                .flatten()
                .and_then(|s| s.get("state").cloned())
                .as_deref()
                == Some("succeeded")
            {
                done.push(id);
            }
        }
        done
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .context("reading the statuses before the Redis kill")
}

/// A gap between two events of one process (run starts, 202 answers) longer than this is a
/// stall; shorter ones are the stream's own jitter (the API answers about ten times a second,
/// each worker starts runs several times a second).
const STALL: Duration = Duration::from_secs(2);

/// How one process came through a kill, from its events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Back {
    /// When it was at work again, measured from the kill: the end of its longest stall (the
    /// time from the kill to its first event counts as one), or its first event after the
    /// kill when nothing stalled it. `Duration::MAX` when it has no event after the kill.
    at: Duration,
    /// The longest time between two consecutive events across the kill: from its last event
    /// before the kill (the kill itself when there is none) to its first event past the
    /// watch window. `Duration::MAX` when it has no event after the kill.
    longest_gap: Duration,
}

/// [`Back`] of the `events` of one process (any order) for a kill at `t`, watched until `end`.
///
/// The end of the longest gap is not taken when no gap is a stall: a process the kill did
/// not stop still has a longest gap — some 100 ms of jitter, anywhere in the window — and its
/// end would read as "back only after" up to the whole window.
fn back_at_work(events: &[Instant], t: Instant, end: Instant) -> Back {
    let mut events = events.to_vec();
    events.sort();
    let mut prev_any = events.iter().rev().find(|e| **e < t).copied().unwrap_or(t);
    let mut prev = t;
    let (mut first, mut stall, mut longest_gap): (
        Option<Duration>,
        Option<(Duration, Duration)>,
        Option<Duration>,
    ) = (None, None, None);
    for e in events.into_iter().filter(|e| *e >= t) {
        first.get_or_insert(e - t);
        let gap = e - prev;
        if gap > STALL && stall.is_none_or(|(longest, _)| gap > longest) {
            stall = Some((gap, e - t));
        }
        longest_gap = Some(longest_gap.unwrap_or_default().max(e - prev_any));
        (prev, prev_any) = (e, e);
        if e > end {
            break;
        }
    }
    Back {
        at: stall.map(|(_, at)| at).or(first).unwrap_or(Duration::MAX),
        longest_gap: longest_gap.unwrap_or(Duration::MAX),
    }
}

/// How each process came through a kill at `t` ([`Back`]): every worker (its run starts) and
/// the API (its 202 answers), watched for `WATCH`. Waits until every process has an event
/// past `t + WATCH`; one that has none within 60 s more is an error.
async fn wait_back(
    runs: &Runs,
    stream: &Stream,
    workers: &HashSet<String>,
    t: Instant,
) -> Result<BTreeMap<String, Back>> {
    const WATCH: Duration = Duration::from_secs(15);
    let end = t + WATCH;
    let missing = || {
        let all = runs.all();
        let mut out: Vec<&str> = workers
            .iter()
            .filter(|w| !all.iter().any(|r| &r.worker == *w && r.at >= end))
            .map(String::as_str)
            .collect();
        if !stream
            .accepted_at
            .lock()
            .map(|a| a.iter().any(|x| *x >= end))
            .unwrap_or(false)
        {
            out.push(API);
        }
        out.sort();
        out.join(", ")
    };
    wait_for(
        "every process at work past the watch window",
        WATCH + Duration::from_secs(60),
        || async { missing().is_empty().then_some(()) },
    )
    .await
    .with_context(|| format!("not at work: {}", missing()))?;
    let mut out = BTreeMap::new();
    out.insert(
        API.to_string(),
        back_at_work(
            &stream
                .accepted_at
                .lock()
                .map(|a| a.clone())
                .unwrap_or_default(),
            t,
            end,
        ),
    );
    let all = runs.all();
    for w in workers {
        let starts: Vec<Instant> = all
            .iter()
            .filter(|r| &r.worker == w)
            .map(|r| r.at)
            .collect();
        out.insert(w.clone(), back_at_work(&starts, t, end));
    }
    Ok(out)
}

/// The name of the scheduler's API among the processes of [`wait_back`].
const API: &str = "scheduler API";

#[test]
fn back_at_work_is_the_end_of_a_stall_or_the_first_event() {
    let t = Instant::now();
    let end = t + Duration::from_secs(15);
    let ms = |m: u64| t + Duration::from_millis(m);
    // A steady stream with its longest gap (150 ms) late in the window: not stalled, back at
    // its first event; the gap across the kill counts from the last event before it.
    let mut steady: Vec<Instant> = (0..170).map(|i| ms(100 * i + 50)).collect();
    steady.push(ms(14_300));
    steady.retain(|e| *e != ms(14_250));
    let before = t.checked_sub(Duration::from_millis(60)).unwrap_or(t);
    steady.push(before);
    let b = back_at_work(&steady, t, end);
    assert_eq!(b.at, Duration::from_millis(50));
    assert_eq!(b.longest_gap, Duration::from_millis(150));
    // Stalled from the kill to 3.2 s, then 1 s gaps: back at 3.2 s.
    let mut stalled = vec![before, ms(3_200)];
    stalled.extend((1..14).map(|i| ms(3_200 + 1_000 * i)));
    let b = back_at_work(&stalled, t, end);
    assert_eq!(b.at, Duration::from_millis(3_200));
    assert_eq!(b.longest_gap, Duration::from_millis(3_260));
    // A stall in the middle of the window: back at its end.
    let mid: Vec<Instant> = [100, 200, 5_000, 12_000, 12_100, 15_100]
        .into_iter()
        .map(ms)
        .collect();
    let b = back_at_work(&mid, t, end);
    assert_eq!(b.at, Duration::from_millis(12_000));
    assert_eq!(b.longest_gap, Duration::from_millis(7_000));
    // Nothing after the kill: never back.
    assert_eq!(
        back_at_work(&[before], t, end),
        Back {
            at: Duration::MAX,
            longest_gap: Duration::MAX
        }
    );
}

/// The idle count of each worker: 0 when its `/status` says `running 0` within 30 s, else 1
/// (issue 37 item 4: a worker once kept a slot after a node loss).
async fn running_at_the_end(addrs: &[std::net::SocketAddr]) -> Vec<u64> {
    let mut running = Vec::new();
    for addr in addrs {
        let url = format!("http://{addr}/status");
        let n = wait_for("the worker idle", Duration::from_secs(30), || async {
            get_json(&url).await.ok()?["running"]
                .as_u64()
                .filter(|n| *n == 0)
        })
        .await
        .map(|_| 0)
        .unwrap_or(1);
        running.push(n);
    }
    running
}

/// The queues of the delay path: `<ns>.delayed` first, then every delay tier `<ns>.hold.<ms>`.
fn delay_path(names: &Names) -> Vec<String> {
    std::iter::once(names.delayed_queue())
        .chain(fleet::broker::delay::tiers().map(|t| names.delay_queue(t)))
        .collect()
}

/// The node to kill next: the leader of `<ns>.delayed` (`path[0]`) while it has not been hit,
/// else the node leading the most delay-path queues whose leader has not been killed yet.
fn next_victim(
    path: &[String],
    leaders: &HashMap<String, usize>,
    hit: &BTreeSet<String>,
) -> Option<usize> {
    if let Some(n) = path
        .first()
        .filter(|q| !hit.contains(*q))
        .and_then(|q| leaders.get(q))
    {
        return Some(*n);
    }
    let mut count: BTreeMap<usize, usize> = BTreeMap::new();
    for q in path.iter().filter(|q| !hit.contains(*q)) {
        if let Some(n) = leaders.get(q) {
            *count.entry(*n).or_default() += 1;
        }
    }
    count
        .into_iter()
        .max_by_key(|(n, c)| (*c, std::cmp::Reverse(*n)))
        .map(|(n, _)| n)
}

#[test]
fn the_next_victim_covers_the_delay_path() {
    let path: Vec<String> = ["d", "h1", "h2", "h3", "h4"].map(String::from).to_vec();
    let mut leaders: HashMap<String, usize> =
        [("d", 2), ("h1", 1), ("h2", 3), ("h3", 3), ("h4", 2)]
            .into_iter()
            .map(|(q, n)| (q.to_string(), n))
            .collect();
    let mut hit = BTreeSet::new();
    // The delayed queue's leader first.
    assert_eq!(next_victim(&path, &leaders, &hit), Some(2));
    hit.extend(["d", "h4"].map(String::from));
    // Node 2's queues moved to node 1; node 3 leads the most not hit.
    leaders.insert("d".into(), 1);
    leaders.insert("h4".into(), 1);
    assert_eq!(next_victim(&path, &leaders, &hit), Some(3));
    hit.extend(["h2", "h3"].map(String::from));
    assert_eq!(next_victim(&path, &leaders, &hit), Some(1));
    hit.insert("h1".into());
    assert_eq!(next_victim(&path, &leaders, &hit), None);
}

/// What one round of [`a_kill_of_the_delayed_leader_strands_no_delayed_work`] measured.
#[derive(Debug)]
struct Round {
    node: usize,
    hit: Vec<String>,
    failover: Duration,
    delayed_run: usize,
    delayed_late: Duration,
    retries_run: usize,
    retry_late: Duration,
    done: bool,
}

/// The nodes leading the delay path's queues ([`delay_path`]) are killed in turn, each
/// mid-burst, until every one of its queues (`<ns>.delayed` and the 14 tiers) has had its
/// leader killed at least once (issue 37 item 1: "repeated until it has hit each queue's
/// leader"); the first kill is of `<ns>.delayed`'s leader, each next one of the node leading
/// the most queues not hit yet, and a killed node is started again (it rejoins, its members
/// catch up) before the next round. Each round: 100 tasks with `not_before` 5 s ahead and 50
/// that fail their first attempt (retried after at most 1 s) among 100 plain ones, the kill
/// 1.5 s in. In every round every delayed task and every retry runs within 10 s of its due time
/// plus the failover (the time until every queue of the path the killed node led has a leader
/// again); no attempt runs twice across the rounds, and every worker is back to `running 0`.
/// With the TTL tiers of before (the broker's dead-letter worker forwarding them) the due work
/// waited ~3 minutes, or stayed stranded.
async fn a_kill_of_the_delayed_leader_strands_no_delayed_work() -> Result<()> {
    const DELAYED: usize = 100;
    const FAILING: usize = 50;
    const PLAIN: usize = 100;
    /// Three kills cover any layout (each kill covers what its node leads, and a restarted
    /// node leads nothing); two more are slack for leaders moving between rounds.
    const MAX_ROUNDS: usize = 5;
    let Some(cluster) = Cluster::start().await? else {
        return Ok(());
    };
    let amqp = cluster.get("FLEET_CLUSTER_AMQP_URL")?.to_string();
    let redis = cluster.get("FLEET_CLUSTER_REDIS_URL")?.to_string();
    let name = format!("c{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let names = Names::new(&name);
    let store = Store::new(&redis, names.clone())?;
    let tls = fleet::tls::TlsConfig::default();
    let conn = fleet::broker::connect_any(&amqp, "fleet-tests cluster-delayed", &tls).await?;
    let publisher = fleet::broker::amqp::confirm_channel(&conn).await?;
    let base = vec![
        ("namespace".to_string(), name.clone()),
        ("amqp_url".to_string(), amqp.clone()),
        ("redis_url".to_string(), redis.clone()),
        ("queue_type".to_string(), "quorum".to_string()),
        ("http_addr".to_string(), "127.0.0.1:0".to_string()),
    ];
    let mut ns = Ns {
        name: name.clone(),
        names,
        store,
        conn,
        publisher,
        base,
        probe: std::sync::Arc::new(fleet::broker::probe::Prober::new(
            &amqp,
            "fleet-tests cluster-delayed",
            &tls,
        )),
    };
    let sched = start_scheduler(&ns, &[("heartbeat_timeout_ms", "10000")]).await?;
    // Runs by (id, attempt) with when; `fail_once` tasks fail attempt 1.
    let runs: Arc<Mutex<Vec<(String, u32, Instant)>>> = Arc::default();
    let r = runs.clone();
    let handler = handler_fn(move |ctx| {
        let r = r.clone();
        async move {
            r.lock()
                .map_err(|_| TaskError::retryable("poisoned"))?
                .push((ctx.envelope.id.clone(), ctx.attempt, Instant::now()));
            tokio::time::sleep(Duration::from_millis(20)).await;
            if ctx.envelope.payload["fail_once"] == true && ctx.attempt == 1 {
                return Err(TaskError::retryable("fails once"));
            }
            Ok(json!({}))
        }
    });
    let mut workers = Vec::new();
    for i in 0..3 {
        workers.push(
            start_worker(
                &ns,
                &format!("dw{i}"),
                "pool=delayed",
                8,
                &[
                    ("heartbeat_timeout_ms", "10000"),
                    ("retry_base_ms", "1000"),
                    ("retry_cap_ms", "1000"),
                ],
                &[("work", handler.clone())],
            )
            .await?,
        );
    }
    let path = delay_path(&ns.names);
    let mut hit: BTreeSet<String> = BTreeSet::new();
    let mut rounds: Vec<Round> = Vec::new();
    let started = Instant::now();
    while hit.len() < path.len() && rounds.len() < MAX_ROUNDS {
        let k = rounds.len() + 1;
        wait_for(
            "every quorum queue with its three members online",
            Duration::from_secs(180),
            || async { cluster.quorum_settled(&name).then_some(()) },
        )
        .await?;
        let leaders = cluster.leaders()?;
        let Some(victim) = next_victim(&path, &leaders, &hit) else {
            bail!("no node leads the delay-path queues not hit yet: {leaders:?}");
        };
        let led: Vec<String> = path
            .iter()
            .filter(|q| leaders.get(*q) == Some(&victim))
            .cloned()
            .collect();
        // The test's own connection may have been on a node killed in an earlier round.
        if !ns.publisher.status().connected() {
            ns.conn =
                fleet::broker::connect_any(&amqp, "fleet-tests cluster-delayed", &tls).await?;
            ns.publisher = fleet::broker::amqp::confirm_channel(&ns.conn).await?;
        }
        let due = chrono::Utc::now() + chrono::Duration::seconds(5);
        let due_at = Instant::now() + Duration::from_secs(5);
        let mut envs = Vec::new();
        for _ in 0..DELAYED {
            let mut t = task("work", json!({}), "pool=delayed");
            t.not_before = Some(due);
            envs.push(t);
        }
        for _ in 0..FAILING {
            let mut t = task("work", json!({"fail_once": true}), "pool=delayed");
            t.max_attempts = Some(3);
            envs.push(t);
        }
        for _ in 0..PLAIN {
            envs.push(task("work", json!({}), "pool=delayed"));
        }
        let (ok, refused) = ns.submit(&envs).await?;
        assert_eq!((ok, refused), (envs.len(), 0));
        scenario_pause(
            Duration::from_millis(1500),
            "the burst in flight (delayed tasks waiting, retries in their tier) when the leader dies",
        )
        .await;
        let killed_at = Instant::now();
        cluster.script(&["kill-node", &victim.to_string(), &cluster.dir()])?;
        let new_hits: Vec<&String> = led.iter().filter(|q| !hit.contains(*q)).collect();
        eprintln!(
            "round {k}: killed RabbitMQ node {victim}, the leader of {} delay-path queues {led:?} ({} not hit before)",
            led.len(),
            new_hits.len()
        );
        let failover = wait_for(
            "a new leader for every delay-path queue the killed node led",
            Duration::from_secs(60),
            || async {
                let now = cluster.leaders().ok()?;
                led.iter()
                    .all(|q| now.get(q).is_some_and(|n| *n != victim))
                    .then(|| killed_at.elapsed())
            },
        )
        .await?;
        eprintln!("round {k}: the queues it led were led again after {failover:?}");
        hit.extend(led.iter().cloned());

        let delayed_ids: Vec<String> = envs[..DELAYED].iter().map(|e| e.id.clone()).collect();
        let failing_ids: Vec<String> = envs[DELAYED..DELAYED + FAILING]
            .iter()
            .map(|e| e.id.clone())
            .collect();
        let all_ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
        let done = wait_for(
            "every task's last attempt ran",
            Duration::from_secs(90),
            || async {
                let r = runs.lock().ok()?.clone();
                let ran: HashSet<&str> = r.iter().map(|(id, ..)| id.as_str()).collect();
                let retried: HashSet<&str> = r
                    .iter()
                    .filter(|(_, a, _)| *a >= 2)
                    .map(|(id, ..)| id.as_str())
                    .collect();
                (all_ids.iter().all(|id| ran.contains(id.as_str()))
                    && failing_ids.iter().all(|id| retried.contains(id.as_str())))
                .then_some(())
            },
        )
        .await
        .is_ok();
        let r = runs.lock().map(|r| r.clone()).unwrap_or_default();
        let first = |id: &str, attempt: u32| {
            r.iter()
                .filter(|(i, a, _)| i == id && *a == attempt)
                .map(|(.., at)| *at)
                .min()
        };
        // Lateness past due + failover: delayed tasks against their not_before; retries
        // against their first run + the 1 s backoff cap.
        let late =
            |at: Instant, due: Instant| at.saturating_duration_since(due.max(killed_at + failover));
        let delayed_late: Vec<Duration> = delayed_ids
            .iter()
            .filter_map(|id| first(id, 1).map(|at| late(at, due_at)))
            .collect();
        let retry_late: Vec<Duration> = failing_ids
            .iter()
            .filter_map(|id| {
                let one = first(id, 1)?;
                first(id, 2).map(|at| late(at, one + Duration::from_secs(1)))
            })
            .collect();
        let max = |v: &[Duration]| v.iter().max().copied().unwrap_or_default();
        let round = Round {
            node: victim,
            hit: led,
            failover,
            delayed_run: delayed_late.len(),
            delayed_late: max(&delayed_late),
            retries_run: retry_late.len(),
            retry_late: max(&retry_late),
            done,
        };
        eprintln!(
            "round {k}: delayed tasks run {}/{DELAYED}, latest {:?} past due + failover; retries run {}/{FAILING}, latest {:?} past due + failover; delay-path queues hit so far {}/{}",
            round.delayed_run,
            round.delayed_late,
            round.retries_run,
            round.retry_late,
            hit.len(),
            path.len()
        );
        if !done {
            eprintln!("the namespace's queues now:\n{}", cluster.queues(&name));
        }
        rounds.push(round);
        if !done {
            break;
        }
        if hit.len() < path.len() {
            let out = tokio::task::block_in_place(|| {
                cluster.script(&["start-node", &victim.to_string(), &cluster.dir()])
            })?;
            eprintln!("round {k}: {}", out.trim());
        }
    }
    eprintln!(
        "{} rounds in {:?}; delay-path queues whose leader was killed: {}/{}",
        rounds.len(),
        started.elapsed(),
        hit.len(),
        path.len()
    );
    for (k, r) in rounds.iter().enumerate() {
        eprintln!(
            "round {}: node {} killed, leader of {} delay-path queues {:?}, led again after {:?}; delayed latest {:?}, retries latest {:?} past due + failover",
            k + 1,
            r.node,
            r.hit.len(),
            r.hit,
            r.failover,
            r.delayed_late,
            r.retry_late
        );
    }
    let r = runs.lock().map(|r| r.clone()).unwrap_or_default();
    let mut per_attempt: BTreeMap<(String, u32), usize> = BTreeMap::new();
    for (id, a, _) in &r {
        *per_attempt.entry((id.clone(), *a)).or_default() += 1;
    }
    let twice: Vec<_> = per_attempt.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!("runs {}, attempts run twice {}", r.len(), twice.len());
    let addrs: Vec<std::net::SocketAddr> = workers.iter().map(|w| w.addr).collect();
    let running = running_at_the_end(&addrs).await;
    eprintln!("workers' running counts at the end: {running:?}");
    // What the delay canaries say (`fleet_delay_canary_age_seconds{tier}`, the oldest age of
    // any tier's canary): a tier that stopped moving must be visible.
    let canary_age = metrics_page(&sched.url(""))
        .await
        .map(|page| {
            page.lines()
                .filter(|l| l.starts_with("fleet_delay_canary_age_seconds{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .fold(0.0_f64, f64::max)
        })
        .unwrap_or(0.0);
    eprintln!("oldest delay canary: {canary_age:.1} s");
    for w in workers {
        w.stop().await?;
    }
    sched.stop().await?;
    let _ = tokio::time::timeout(Duration::from_secs(30), ns.cleanup()).await;
    // Held whatever the broker does: no attempt twice, every slot released.
    assert!(twice.is_empty(), "attempts run twice: {twice:?}");
    assert_eq!(running, vec![0, 0, 0], "every worker back to running 0");
    // The tier loops hold and forward the tiers themselves (no broker dead-lettering on the
    // delay path): nothing may stay stranded, whichever queues the killed node led.
    for (k, r) in rounds.iter().enumerate() {
        let k = k + 1;
        assert!(
            r.done,
            "round {k}: delayed work stranded after the kill: {r:?}"
        );
        assert_eq!(r.delayed_run, DELAYED, "round {k}");
        assert_eq!(r.retries_run, FAILING, "round {k}");
        assert!(
            r.delayed_late <= BACK_WITHIN,
            "round {k}: a delayed task ran {:?} past due + failover",
            r.delayed_late
        );
        assert!(
            r.retry_late <= BACK_WITHIN,
            "round {k}: a retry ran {:?} past due + failover",
            r.retry_late
        );
    }
    let missed: Vec<&String> = path.iter().filter(|q| !hit.contains(*q)).collect();
    assert!(
        missed.is_empty(),
        "delay-path queues whose leader no round killed: {missed:?}"
    );
    Ok(())
}
