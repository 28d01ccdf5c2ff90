//! Scale figures of fleet's Redis side (issue 16, part 5). Two benchmarks that print figures,
//! not timed tests (the machine is shared and noisy: read the Redis-side figures, which do not
//! depend on the client's share of the CPU, before the wall-clock ones).
//!
//! * `scale sim` — 1,000 simulated workers in 50 groups registered through fleet's own `Store`
//!   (`register.lua`), then reservations through `reserve.lua` in batches exactly as the
//!   scheduler's dispatch builds them (`Dedupe::Check`, direct dispatch, the product defaults of
//!   lease, backlog factor, strategy, dedupe window and status TTL), for three selector shapes
//!   (one candidate group, ten, all fifty) and several batch sizes; then heartbeats
//!   (`heartbeat.lua`) paced at the default interval (10 s: 100 beats/s for 1,000 workers),
//!   each renewing the leases of 4 tasks the worker claimed (`start.lua`), and a burst of
//!   heartbeats for the ceiling. Each phase reads `INFO commandstats`, `INFO cpu` and
//!   `INFO stats` before and after: EVALSHA µs per call (the script's time inside Redis), inner
//!   commands per reservation, Redis process CPU (`used_cpu_sys + used_cpu_user`) per
//!   reservation and per heartbeat, bytes in and out. Its own random namespace on the shared
//!   Redis (`REDIS_URL`, default 127.0.0.1:6379), deleted at the end; `--private` starts a
//!   `redis-server` of its own instead, whose counters see no other client.
//! * `scale run [N]` — the per-task Redis cost of a real fleet: a private `redis-server` (so the
//!   counters see nothing else; `SLOWLOG` at threshold 0 names every script call by
//!   its SHA), the shared RabbitMQ, a scheduler at the product defaults and 2 workers (product
//!   heartbeat settings) in this process; an idle window first (the fleet's fixed cost per
//!   second: heartbeats, pressure and stats ticks, probes), then N no-op tasks as a burst and N
//!   offered at a steady rate; per task: commands executed (inside scripts included), script
//!   calls, bytes in and out, Redis CPU, the idle cost over the same time subtracted; then a
//!   third phase with the slow-log poller on (script calls by name, µs per call).
//!
//! Run: `cargo run --release -p fleet-tests --bin scale -- sim` and `… -- run 3000`.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use deadpool_redis::redis;
use fleet::registry::{Beat, BeatReply, Registration, WorkerState};
use fleet::route::Dedupe;
use fleet::route::Reservation;
use fleet::route::{ReserveParams, ReserveRequest};
use fleet::run::{Claim, ClaimRequest};
use fleet::task::Strategy;
use fleet::{Envelope, Labels, Lane, Names, PerLane, Store};
use fleet_tests::servers::PrivateRedis;
use fleet_tests::*;

#[derive(Parser)]
#[command(
    name = "scale",
    about = "fleet's Redis side at scale: a 1,000-worker simulation and the per-task cost of a real run"
)]
struct Cli {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// 1,000 simulated workers: reservations/s through reserve.lua, Redis CPU per heartbeat.
    Sim(SimArgs),
    /// Scheduler + 2 workers on a private Redis: Redis calls, commands, bytes and CPU per task.
    Run(RunArgs),
}

#[derive(Parser, Clone)]
struct SimArgs {
    /// Simulated workers.
    #[arg(long, default_value = "1000")]
    workers: usize,
    /// Groups (label sets) they form.
    #[arg(long, default_value = "50")]
    groups: usize,
    /// Normal-lane capacity of each worker (the product default).
    #[arg(long, default_value = "4")]
    capacity: u32,
    /// Dispatch batch sizes to measure (the scheduler's FLEET_BATCH_MAX is 256).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,512")]
    batches: Vec<usize>,
    /// Concurrent callers (the scheduler's FLEET_INGRESS_CONSUMERS is 4 dispatch loops).
    #[arg(long, default_value = "4")]
    callers: usize,
    /// Reservations per (selector, batch) measurement.
    #[arg(long, default_value = "60000")]
    reservations: usize,
    /// Longest a single measurement runs, seconds (batch 1 stops here).
    #[arg(long, default_value = "6")]
    max_secs: f64,
    /// Heartbeat interval of the simulated workers, ms (the product default).
    #[arg(long, default_value = "10000")]
    heartbeat_interval_ms: u64,
    /// How long heartbeats are paced at that interval, seconds.
    #[arg(long, default_value = "30")]
    beat_secs: u64,
    /// Tasks each worker runs while it heartbeats (their leases are renewed by each beat).
    #[arg(long, default_value = "4")]
    running: usize,
    /// Heartbeats of the burst (as fast as Redis answers).
    #[arg(long, default_value = "10000")]
    burst_beats: usize,
    /// Start a private redis-server instead of using REDIS_URL (no other client in the counters).
    #[arg(long)]
    private: bool,
}

#[derive(Parser, Clone)]
struct RunArgs {
    /// Tasks per phase (burst, then steady).
    #[arg(default_value = "3000")]
    n: usize,
    /// Steady phase: tasks offered per second.
    #[arg(long, default_value = "500")]
    rate: f64,
    /// Slots of each of the two workers.
    #[arg(long, default_value = "64")]
    capacity: u32,
    /// Idle window measured before the load, seconds.
    #[arg(long, default_value = "20")]
    idle_secs: u64,
    /// Queue type (the product default is quorum).
    #[arg(long, default_value = "quorum")]
    queue_type: String,
}

#[tokio::main]
async fn main() -> Result<()> {
    // A benchmark runs as long as it is asked to: the test binaries' watchdog is not for it.
    fleet_tests::no_watchdog();
    fleet::process::telemetry::init("text");
    match Cli::parse().what {
        What::Sim(a) => sim(a).await,
        What::Run(a) => run(a).await,
    }
}

// ------------------------------------------------------------------ Redis counters

/// This benchmark's own connection for reading counters: a response timeout of 30 s, not the
/// `redis` crate's default 500 ms that fleet's pool runs with (a starved Redis on a loaded
/// machine answers `INFO` or `SLOWLOG GET` slower than that).
#[derive(Clone)]
struct Probe {
    conn: redis::aio::MultiplexedConnection,
}

impl Probe {
    async fn connect(url: &str) -> Result<Self> {
        let client = redis::Client::open(url)?;
        let cfg = redis::AsyncConnectionConfig::new()
            .set_response_timeout(Some(Duration::from_secs(30)))
            .set_connection_timeout(Some(Duration::from_secs(10)));
        Ok(Probe {
            conn: client
                .get_multiplexed_async_connection_with_config(&cfg)
                .await?,
        })
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        let mut c = self.conn.clone();
        Ok(cmd.query_async(&mut c).await?)
    }
}

/// What `INFO cpu stats commandstats` says at one moment.
#[derive(Debug, Clone, Default)]
struct Counters {
    /// Command name → (calls, µs), `INFO` itself left out.
    cmds: BTreeMap<String, (u64, u64)>,
    /// `used_cpu_sys + used_cpu_user`, seconds (the whole redis-server process).
    cpu: f64,
    net_in: u64,
    net_out: u64,
    at: Option<Instant>,
}

impl Counters {
    async fn read(probe: &Probe) -> Result<Self> {
        let info = redis::cmd("INFO")
            .arg("cpu")
            .arg("stats")
            .arg("commandstats")
            .to_owned();
        let text: String = probe.query(&info).await?;
        let mut c = Counters {
            at: Some(Instant::now()),
            ..Default::default()
        };
        for line in text.lines() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("cmdstat_") {
                let Some((name, fields)) = rest.split_once(':') else {
                    continue;
                };
                if name == "info" {
                    continue;
                }
                let field = |k: &str| {
                    fields
                        .split(',')
                        .find_map(|f| f.strip_prefix(k)?.strip_prefix('=')?.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                c.cmds
                    .insert(name.to_string(), (field("calls"), field("usec")));
            } else if let Some((k, v)) = line.split_once(':') {
                match k {
                    "used_cpu_sys" | "used_cpu_user" => c.cpu += v.parse::<f64>().unwrap_or(0.0),
                    "total_net_input_bytes" => c.net_in = v.parse().unwrap_or(0),
                    "total_net_output_bytes" => c.net_out = v.parse().unwrap_or(0),
                    _ => {}
                }
            }
        }
        Ok(c)
    }

    /// `self − before`.
    fn since(&self, before: &Counters) -> Delta {
        let mut cmds = BTreeMap::new();
        for (k, &(calls, usec)) in &self.cmds {
            let (c0, u0) = before.cmds.get(k).copied().unwrap_or((0, 0));
            if calls > c0 {
                cmds.insert(k.clone(), (calls - c0, usec.saturating_sub(u0)));
            }
        }
        let secs = match (self.at, before.at) {
            (Some(a), Some(b)) => a.duration_since(b).as_secs_f64(),
            _ => 0.0,
        };
        Delta {
            cmds,
            cpu: self.cpu - before.cpu,
            net_in: self.net_in.saturating_sub(before.net_in),
            net_out: self.net_out.saturating_sub(before.net_out),
            secs,
        }
    }
}

/// Counters over one phase.
#[derive(Debug, Clone, Default)]
struct Delta {
    cmds: BTreeMap<String, (u64, u64)>,
    cpu: f64,
    net_in: u64,
    net_out: u64,
    secs: f64,
}

impl Delta {
    fn calls(&self, cmd: &str) -> u64 {
        self.cmds.get(cmd).map(|c| c.0).unwrap_or(0)
    }
    fn usec(&self, cmd: &str) -> u64 {
        self.cmds.get(cmd).map(|c| c.1).unwrap_or(0)
    }
    /// Commands that are not scripts (run inside them, or sent on their own).
    fn plain_calls(&self) -> u64 {
        self.cmds
            .iter()
            .filter(|(k, _)| {
                !matches!(
                    k.as_str(),
                    "evalsha"
                        | "eval"
                        | "script|load"
                        | "slowlog|get"
                        | "slowlog|reset"
                        | "config|set"
                )
            })
            .map(|(_, c)| c.0)
            .sum()
    }
}

/// Calls retried after an error (a call timed out while this loaded machine starved Redis).
static RETRIES: AtomicUsize = AtomicUsize::new(0);

/// Runs `f` until it succeeds, at most 10 times: as the scheduler's dispatch does, a failed
/// reservation call is retried with the same batch token (its own dedupe marks are not
/// duplicates), and heartbeats are idempotent.
async fn retrying<T, F, Fut>(mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = fleet::Result<T>>,
{
    let mut attempt = 0;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if attempt < 9 => {
                attempt += 1;
                RETRIES.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, attempt, "call failed; retrying");
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

// ------------------------------------------------------------------ sim

/// Deletes every key of the namespace with `SCAN` + `UNLINK` (never a `KEYS` that blocks a
/// shared server), each call with the store's timeout and retried.
async fn delete_keys(store: &Store) -> Result<()> {
    let pattern = store.names.all_keys_pattern();
    let mut cursor = 0u64;
    loop {
        let scan = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(&pattern)
            .arg("COUNT")
            .arg(1000)
            .to_owned();
        let (next, keys): (u64, Vec<String>) = retrying(|| store.query(&scan)).await?;
        if !keys.is_empty() {
            let unlink = redis::cmd("UNLINK").arg(&keys).to_owned();
            let _: () = retrying(|| store.query(&unlink)).await?;
        }
        if next == 0 {
            return Ok(());
        }
        cursor = next;
    }
}

/// The simulated fleet: worker ids, their groups and instance tokens.
struct Fleet {
    workers: Vec<(String, String, String)>,
    groups: Vec<String>,
}

fn group_labels(g: usize, groups: usize) -> Labels {
    let zones = (groups / 10).max(1);
    Labels::parse(&format!(
        "pool=g{g:02},zone=z{},protocol=builtin",
        g % zones
    ))
    .unwrap_or_default()
}

/// The scheduler's reservation parameters at the product defaults (scheduler/src/dispatch/
/// `Dispatcher::params`, defaults of shared/src/settings/args.rs).
fn default_params() -> ReserveParams {
    ReserveParams {
        token: rand::random(),
        lease_ms: 30_000,
        backlog_factor: 1.0,
        strategy: Strategy::LeastLoaded,
        dedupe_window_ms: 3_600_000,
        status_ttl_ms: 86_400_000,
        direct: true,
        park_flag_ttl_ms: 3_000,
    }
}

async fn sim(a: SimArgs) -> Result<()> {
    let private = if a.private {
        Some(PrivateRedis::start(None, None).await?)
    } else {
        None
    };
    let url = private
        .as_ref()
        .map(|r| r.url(None))
        .unwrap_or_else(redis_url);
    let ns = format!("scale{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let store = Store::new(&url, Names::new(&ns))?;
    let info: String = store.query(redis::cmd("INFO").arg("server")).await?;
    let version = info
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    println!(
        "scale sim: Redis {version} at {url} ({}), namespace {ns}",
        if a.private {
            "private redis-server, no other client"
        } else {
            "SHARED server: other clients' calls land in the same counters"
        }
    );
    println!(
        "settings: {} workers in {} groups (capacity {} normal + 1 critical each), {} concurrent callers, batches {:?}, {} reservations per measurement (at most {} s), reserve params: lease 30000 ms, backlog factor 1.0, least_loaded, dedupe window 3600000 ms (Check), status TTL 86400000 ms, direct dispatch on; heartbeat interval {} ms for {} s, {} running tasks per worker",
        a.workers, a.groups, a.capacity, a.callers, a.batches, a.reservations, a.max_secs, a.heartbeat_interval_ms, a.beat_secs, a.running
    );
    let probe = Probe::connect(&url).await?;
    let r = sim_inner(&a, &store, &probe).await;
    let cleaned = delete_keys(&store).await;
    drop(private);
    r?;
    cleaned.context("delete the namespace")?;
    println!("namespace {ns} deleted");
    Ok(())
}

/// This machine's Redis speed right now, to read the other figures against: Redis CPU per
/// command of a Lua loop of `INCR`s (the cheapest call a script makes) and per plain pipelined
/// `SET`. The scripts' costs divided by these are machine-independent ratios.
async fn calibrate(store: &Store, probe: &Probe) -> Result<(f64, f64)> {
    let key = format!("{}calibrate", store.names.prefix());
    let lua = redis::Script::new(
        "for i = 1, tonumber(ARGV[1]) do redis.call('INCR', KEYS[1]) end return 1",
    );
    let before = Counters::read(probe).await?;
    for _ in 0..100 {
        let mut inv = lua.prepare_invoke();
        inv.key(&key).arg(1000);
        let _: i64 = retrying(|| store.invoke(&inv)).await?;
    }
    let d = Counters::read(probe).await?.since(&before);
    let per_lua_call = d.cpu * 1e6 / 100_000.0;
    let before = Counters::read(probe).await?;
    for _ in 0..100 {
        let mut p = redis::pipe();
        for i in 0..100 {
            p.cmd("SET").arg(format!("{key}:{i}")).arg(i).ignore();
        }
        let _: () = retrying(|| store.pipe(&p)).await?;
    }
    let d = Counters::read(probe).await?.since(&before);
    let per_set = d.cpu * 1e6 / 10_000.0;
    println!("\n## Calibration (this machine now)\nRedis CPU per INCR inside a Lua loop: {per_lua_call:.2} µs; per pipelined SET (100 a pipeline): {per_set:.2} µs");
    Ok((per_lua_call, per_set))
}

async fn sim_inner(a: &SimArgs, store: &Store, probe: &Probe) -> Result<()> {
    let (per_lua_call, _) = calibrate(store, probe).await?;
    let fleet = register_fleet(a, store, probe).await?;
    // Every group has room for everything this benchmark reserves: the steady state of a fleet
    // whose workers keep up (the scheduler writes `room:<lane>` from the completion rate). A
    // group without room would answer `full` (park) for multi-candidate tasks instead.
    let rooms: Vec<(String, Lane, u64)> = fleet
        .groups
        .iter()
        .map(|g| (g.clone(), Lane::Normal, 1_000_000_000))
        .collect();
    store.set_rooms(&rooms).await?;

    println!(
        "\n## Reservations through reserve.lua (EVALSHA), {} callers",
        a.callers
    );
    println!("| selector | candidates | batch | reservations | wall s | reservations/s | call p50 / p99 ms | EVALSHA µs/call | Redis µs/reservation (script) | ceiling reservations/s (1e6 / script µs) | inner commands/reservation | Redis CPU µs/reservation | bytes in / out per reservation | foreign EVALSHA |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let shapes: [(&str, usize); 3] = [
        ("pool=gK (one group)", 1),
        ("zone=zK (ten groups)", 10),
        ("none (all groups)", a.groups),
    ];
    let mut best = 0.0f64;
    for (si, (shape, cands)) in shapes.iter().enumerate() {
        for &batch in &a.batches {
            let want = if batch < 16 {
                a.reservations / 4
            } else {
                a.reservations
            };
            let m = measure_reserve(a, store, probe, &fleet, si, batch, want).await?;
            let script_us = m.delta.usec("evalsha") as f64 / m.done.max(1) as f64;
            best = best.max(m.done as f64 / m.wall);
            println!(
                "| {shape} | {} | {batch} | {} | {:.2} | **{:.0}** | {:.2} / {:.2} | {:.0} | {:.2} | {:.0} | {:.1} | {:.2} | {:.0} / {:.0} | {} |",
                (*cands).min(a.groups),
                m.done,
                m.wall,
                m.done as f64 / m.wall,
                m.p50,
                m.p99,
                m.delta.usec("evalsha") as f64 / m.delta.calls("evalsha").max(1) as f64,
                script_us,
                if script_us > 0.0 { 1e6 / script_us } else { 0.0 },
                m.delta.plain_calls() as f64 / m.done.max(1) as f64,
                m.delta.cpu * 1e6 / m.done.max(1) as f64,
                m.delta.net_in as f64 / m.done.max(1) as f64,
                m.delta.net_out as f64 / m.done.max(1) as f64,
                m.delta.calls("evalsha").saturating_sub(m.calls as u64),
            );
            if si == 0 && batch == 256 {
                let mut inner: Vec<(String, f64)> = m
                    .delta
                    .cmds
                    .iter()
                    .filter(|(k, _)| k.as_str() != "evalsha")
                    .map(|(k, c)| (k.clone(), c.0 as f64 / m.done.max(1) as f64))
                    .collect();
                inner.sort_by(|x, y| y.1.partial_cmp(&x.1).unwrap_or(std::cmp::Ordering::Equal));
                let list: Vec<String> = inner
                    .iter()
                    .filter(|(_, v)| *v >= 0.01)
                    .map(|(k, v)| format!("{k} {v:.2}"))
                    .collect();
                let inner_us: u64 = m
                    .delta
                    .cmds
                    .iter()
                    .filter(|(k, _)| k.as_str() != "evalsha")
                    .map(|(_, c)| c.1)
                    .sum();
                println!(
                    "<!-- one group, batch 256: commands per reservation: {}; the inner commands' own time is {:.0} % of the scripts' time (the rest: Lua, argument and reply conversion) -->",
                    list.join(", "),
                    inner_us as f64 * 100.0 / m.delta.usec("evalsha").max(1) as f64
                );
            }
        }
    }
    println!(
        "\nbest reservations/s: {best:.0} (goal ≥ 50,000); calls retried after an error so far: {}",
        RETRIES.load(Ordering::Relaxed)
    );
    println!("(Redis CPU per reservation ÷ {per_lua_call:.2} µs = its cost in Lua INCR-equivalents, a ratio that holds on any machine)");
    let _ = calibrate(store, probe).await?;

    heartbeats(a, store, probe, &fleet).await
}

async fn register_fleet(a: &SimArgs, store: &Store, probe: &Probe) -> Result<Fleet> {
    let groups: Vec<String> = (0..a.groups)
        .map(|g| group_labels(g, a.groups).group_name())
        .collect();
    let mut workers = Vec::with_capacity(a.workers);
    for i in 0..a.workers {
        let g = i % a.groups;
        workers.push((
            format!("sim-{g:02}-{:04}", i / a.groups),
            groups[g].clone(),
            uuid::Uuid::new_v4().simple().to_string(),
        ));
    }
    let before = Counters::read(probe).await?;
    let start = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let ws = Arc::new(workers);
    let mut joins = Vec::new();
    for _ in 0..a.callers {
        let (store, next, ws, groups_n, cap) = (
            store.clone(),
            next.clone(),
            ws.clone(),
            a.groups,
            a.capacity,
        );
        joins.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((id, _, inst)) = ws.get(i) else {
                    return Ok::<_, anyhow::Error>(());
                };
                let r = Registration {
                    id: id.clone(),
                    instance: inst.clone(),
                    labels: group_labels(i % groups_n, groups_n),
                    capacity: cap,
                    critical_capacity: 1,
                    executor: "builtin".into(),
                    state: WorkerState::Active,
                    kinds: Default::default(),
                };
                retrying(|| store.register(&r, std::time::Duration::from_secs(30))).await?;
            }
        }));
    }
    for j in joins {
        j.await??;
    }
    let wall = start.elapsed().as_secs_f64();
    let d = Counters::read(probe).await?.since(&before);
    let workers = Arc::try_unwrap(ws).map_err(|_| anyhow::anyhow!("workers still shared"))?;
    let views = store.groups().await?;
    let cap: u32 = views.iter().map(|g| g.capacity).sum();
    if views.len() != a.groups || cap != a.workers as u32 * a.capacity {
        bail!(
            "registered {} groups with capacity {cap}; expected {} groups, {}",
            views.len(),
            a.groups,
            a.workers as u32 * a.capacity
        );
    }
    println!(
        "\n## Registration (register.lua)\n{} workers in {} groups registered in {:.2} s ({:.0}/s); EVALSHA {:.0} µs/call; groups {} with total capacity {cap}",
        a.workers,
        a.groups,
        wall,
        a.workers as f64 / wall,
        d.usec("evalsha") as f64 / d.calls("evalsha").max(1) as f64,
        views.len()
    );
    Ok(Fleet { workers, groups })
}

struct ReserveRun {
    done: usize,
    calls: usize,
    wall: f64,
    p50: f64,
    p99: f64,
    delta: Delta,
}

/// Selector of task `i` for shape `shape` (0: one group, 1: one zone, 2: none).
fn selector(shape: usize, i: usize, groups: usize) -> Labels {
    let zones = (groups / 10).max(1);
    match shape {
        0 => Labels::parse(&format!("pool=g{:02}", (i * 7919) % groups)).unwrap_or_default(),
        1 => Labels::parse(&format!("zone=z{}", i % zones)).unwrap_or_default(),
        _ => Labels::default(),
    }
}

async fn measure_reserve(
    a: &SimArgs,
    store: &Store,
    probe: &Probe,
    fleet: &Fleet,
    shape: usize,
    batch: usize,
    want: usize,
) -> Result<ReserveRun> {
    let tag = format!("r{shape}b{batch}");
    let next = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    let lat = Arc::new(Mutex::new(Vec::<f64>::new()));
    let limit = Duration::from_secs_f64(a.max_secs);
    let before = Counters::read(probe).await?;
    let start = Instant::now();
    let mut joins = Vec::new();
    for _ in 0..a.callers {
        let (store, next, done, lat, tag, groups) = (
            store.clone(),
            next.clone(),
            done.clone(),
            lat.clone(),
            tag.clone(),
            a.groups,
        );
        joins.push(tokio::spawn(async move {
            let mut calls = 0usize;
            loop {
                let first = next.fetch_add(batch, Ordering::Relaxed);
                if first >= want || start.elapsed() > limit {
                    return Ok::<_, anyhow::Error>(calls);
                }
                let reqs: Vec<ReserveRequest> = (first..(first + batch).min(want))
                    .map(|i| ReserveRequest {
                        id: format!("{tag}-{i}"),
                        lane: Lane::Normal,
                        selector: selector(shape, i, groups),
                        kind: "echo".into(),
                        strategy: None,
                        dedupe: Dedupe::Check,
                        from_park: false,
                        dedupe_only: false,
                        key: None,
                    })
                    .collect();
                let t0 = Instant::now();
                let params = default_params();
                let answers = retrying(|| store.reserve(&reqs, params)).await?;
                if let Ok(mut l) = lat.lock() {
                    l.push(t0.elapsed().as_secs_f64() * 1000.0);
                }
                calls += 1;
                let reserved = answers
                    .iter()
                    .filter(|r| matches!(r, Reservation::Reserved(_)))
                    .count();
                if reserved != reqs.len() {
                    bail!(
                        "{} of {} reservations answered {:?}",
                        reqs.len() - reserved,
                        reqs.len(),
                        answers
                            .iter()
                            .find(|r| !matches!(r, Reservation::Reserved(_)))
                    );
                }
                done.fetch_add(reserved, Ordering::Relaxed);
            }
        }));
    }
    let mut calls = 0;
    for j in joins {
        calls += j.await??;
    }
    let wall = start.elapsed().as_secs_f64();
    let delta = Counters::read(probe).await?.since(&before);
    let n = done.load(Ordering::Relaxed);
    let mut l = lat.lock().map(|v| v.clone()).unwrap_or_default();
    let (p50, p99) = (pct(&mut l, 0.5), pct(&mut l, 0.99));
    // Clean up what this measurement wrote: statuses (their dedupe marks with them),
    // reservations.
    let mut keys: Vec<String> = Vec::with_capacity(n);
    for i in 0..n {
        keys.push(store.names.task(&format!("{tag}-{i}")));
    }
    for g in &fleet.groups {
        keys.push(store.names.reserved(g, Lane::Normal));
    }
    for chunk in keys.chunks(1000) {
        let _: () = store.query(redis::cmd("UNLINK").arg(chunk)).await?;
    }
    Ok(ReserveRun {
        done: n,
        calls,
        wall,
        p50,
        p99,
        delta,
    })
}

async fn heartbeats(a: &SimArgs, store: &Store, probe: &Probe, fleet: &Fleet) -> Result<()> {
    let run_lease = Duration::from_millis(3 * a.heartbeat_interval_ms);
    let status_ttl = Duration::from_millis(86_400_000);
    // Each worker claims `running` tasks of its group, as a worker starting them would.
    let mut running: Vec<Vec<(Lane, String)>> = Vec::with_capacity(fleet.workers.len());
    for (w, (id, group, inst)) in fleet.workers.iter().enumerate() {
        let ids: Vec<String> = (0..a.running).map(|k| format!("hb{w}-{k}")).collect();
        let sel = Labels::parse(&format!(
            "pool={}",
            group
                .split(',')
                .find_map(|p| p.strip_prefix("pool="))
                .unwrap_or("")
        ))
        .unwrap_or_default();
        let reqs: Vec<ReserveRequest> = ids
            .iter()
            .map(|t| ReserveRequest {
                id: t.clone(),
                lane: Lane::Normal,
                selector: sel.clone(),
                kind: "echo".into(),
                strategy: None,
                dedupe: Dedupe::Check,
                from_park: false,
                dedupe_only: false,
                key: None,
            })
            .collect();
        let params = default_params();
        let got = retrying(|| store.reserve(&reqs, params)).await?;
        if !got
            .iter()
            .all(|r| r == &Reservation::Reserved(group.clone()))
        {
            bail!("reserving {id}'s tasks in {group}: {got:?}");
        }
        let claims: Vec<ClaimRequest> = ids
            .iter()
            .map(|t| ClaimRequest {
                lane: Lane::Normal,
                id: t.clone(),
                base: 1,
                max_attempts: 5,
                isolated: false,
                key: None,
            })
            .collect();
        let (registered, c) =
            retrying(|| store.claim(id, group, inst, run_lease, status_ttl, &claims)).await?;
        if !registered || !c.iter().all(|c| *c == Claim::Run(1)) {
            bail!("claiming {id}'s tasks: registered {registered}, {c:?}");
        }
        running.push(ids.into_iter().map(|t| (Lane::Normal, t)).collect());
    }
    let running = Arc::new(running);
    let workers = Arc::new(fleet.workers.clone());
    let beat_of = |w: usize, running: &[Vec<(Lane, String)>], with: bool| Beat {
        load: PerLane {
            normal: if with { a.running as u32 } else { 0 },
            critical: 0,
        },
        succeeded: 1000 + w as u64,
        failed: 3,
        latency_ewma_ms: 12.5,
        cpu: 0.42,
        health: 0.99,
        running: if with { running[w].clone() } else { vec![] },
        keys: Default::default(),
    };

    // The server's own cost with none of this benchmark's calls, to subtract.
    let idle_secs = 5u64;
    let c0 = Counters::read(probe).await?;
    tokio::time::sleep(Duration::from_secs(idle_secs)).await;
    let idle = Counters::read(probe).await?.since(&c0);
    let idle_cpu_per_s = idle.cpu / idle.secs.max(1e-9);

    // Paced: every worker once per interval, evenly spread (one beat every interval / workers).
    let per_beat = Duration::from_secs_f64(
        a.heartbeat_interval_ms as f64 / 1000.0 / fleet.workers.len() as f64,
    );
    let total = (a.beat_secs as f64 / per_beat.as_secs_f64()) as usize;
    let mut tick = tokio::time::interval(per_beat);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let before = Counters::read(probe).await?;
    let start = Instant::now();
    let mut lat = Vec::with_capacity(total);
    let lease_ms = run_lease;
    for k in 0..total {
        tick.tick().await;
        let w = k % workers.len();
        let (id, _, inst) = &workers[w];
        let t0 = Instant::now();
        let b = beat_of(w, &running, true);
        let reply = retrying(|| store.heartbeat(id, inst, lease_ms, &b)).await?;
        lat.push(t0.elapsed().as_secs_f64() * 1000.0);
        if reply != BeatReply::State(WorkerState::Active) {
            bail!("heartbeat of {id} answered {reply:?}");
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let d = Counters::read(probe).await?.since(&before);
    let cpu_net = d.cpu - idle_cpu_per_s * d.secs;
    println!("\n## Heartbeats (heartbeat.lua), paced at the default interval");
    println!(
        "{total} heartbeats in {wall:.1} s = {:.1}/s ({} workers every {} ms), each renewing {} running tasks; call p50 / p99 {:.2} / {:.2} ms",
        total as f64 / wall,
        fleet.workers.len(),
        a.heartbeat_interval_ms,
        a.running,
        pct(&mut lat.clone(), 0.5),
        pct(&mut lat, 0.99)
    );
    println!(
        "EVALSHA {:.1} µs/call ({} calls, {} foreign); inner commands per heartbeat {:.1}; Redis CPU {:.4} s over {:.1} s = {:.1} µs/heartbeat raw, {:.1} µs/heartbeat after the idle server's {:.4} s/s (measured {idle_secs} s before); Redis CPU share at that rate: {:.2} %; bytes in / out per heartbeat {:.0} / {:.0}",
        d.usec("evalsha") as f64 / d.calls("evalsha").max(1) as f64,
        d.calls("evalsha"),
        d.calls("evalsha").saturating_sub(total as u64),
        d.plain_calls() as f64 / total.max(1) as f64,
        d.cpu,
        d.secs,
        d.cpu * 1e6 / total.max(1) as f64,
        cpu_net * 1e6 / total.max(1) as f64,
        idle_cpu_per_s,
        cpu_net / d.secs.max(1e-9) * 100.0,
        d.net_in as f64 / total.max(1) as f64,
        d.net_out as f64 / total.max(1) as f64,
    );

    // Burst: as fast as Redis answers, with and without running tasks to renew.
    for with in [true, false] {
        let next = Arc::new(AtomicUsize::new(0));
        let before = Counters::read(probe).await?;
        let start = Instant::now();
        let mut joins = Vec::new();
        for _ in 0..a.callers {
            let (store, next, workers, running, n, with, nrun) = (
                store.clone(),
                next.clone(),
                workers.clone(),
                running.clone(),
                a.burst_beats,
                with,
                a.running,
            );
            joins.push(tokio::spawn(async move {
                loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    if k >= n {
                        return Ok::<_, anyhow::Error>(());
                    }
                    let w = k % workers.len();
                    let (id, _, inst) = &workers[w];
                    let b = Beat {
                        load: PerLane {
                            normal: if with { nrun as u32 } else { 0 },
                            critical: 0,
                        },
                        succeeded: 1000 + w as u64,
                        failed: 3,
                        latency_ewma_ms: 12.5,
                        cpu: 0.42,
                        health: 0.99,
                        running: if with { running[w].clone() } else { vec![] },
                        keys: Default::default(),
                    };
                    let reply = retrying(|| store.heartbeat(id, inst, lease_ms, &b)).await?;
                    if reply != BeatReply::State(WorkerState::Active) {
                        bail!("heartbeat of {id} answered {reply:?}");
                    }
                }
            }));
        }
        for j in joins {
            j.await??;
        }
        let wall = start.elapsed().as_secs_f64();
        let d = Counters::read(probe).await?.since(&before);
        let n = a.burst_beats as f64;
        println!(
            "burst, {} running tasks each: {} heartbeats in {wall:.2} s = {:.0}/s; EVALSHA {:.1} µs/call; Redis CPU {:.1} µs/heartbeat; inner commands {:.1}/heartbeat",
            if with { a.running } else { 0 },
            a.burst_beats,
            n / wall,
            d.usec("evalsha") as f64 / d.calls("evalsha").max(1) as f64,
            d.cpu * 1e6 / n,
            d.plain_calls() as f64 / n
        );
    }
    println!(
        "calls retried after an error: {}; machine load average at the end: {}",
        RETRIES.load(Ordering::Relaxed),
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
    );
    Ok(())
}

// ------------------------------------------------------------------ run

/// Names of fleet's scripts by SHA (what `SLOWLOG` shows as EVALSHA's first argument).
fn script_names() -> BTreeMap<String, &'static str> {
    let s = fleet::redis::Scripts::load();
    [
        ("register", &s.register),
        ("heartbeat", &s.heartbeat),
        ("set_state", &s.set_state),
        ("eject", &s.eject),
        ("evict", &s.evict),
        ("deregister", &s.deregister),
        ("reserve", &s.reserve),
        ("start", &s.start),
        ("finish", &s.finish),
        ("ratelimit", &s.ratelimit),
        ("outcomes", &s.outcomes),
        ("broker_dead", &s.broker_dead),
        ("reclaim", &s.reclaim),
        ("rooms", &s.rooms),
    ]
    .into_iter()
    .map(|(n, sc)| (sc.get_hash().to_string(), n))
    .collect()
}

/// A slow log's account: (per command: calls, µs; entries read, entries missed, last id seen).
type SlowLogTally = (BTreeMap<String, (u64, u64)>, usize, i64, i64);

/// Calls by script or command name, (calls, µs), read from the slow log (threshold 0: every
/// call; Redis 7.0 logs the commands scripts run too, so EVALSHA rows are the clients' calls) in small bites: a poller reads the newest 3,000 entries every 100 ms and
/// tallies those it has not seen (by entry id), so no reply grows large; entries that fell out
/// of a bite are counted as missed. Its replies are traffic too: phases that measure bytes run
/// without it.
#[derive(Clone)]
struct SlowLog {
    probe: Probe,
    shas: Arc<BTreeMap<String, &'static str>>,
    acc: Arc<Mutex<SlowLogTally>>,
    /// The poller reads the log only while this is set.
    on: Arc<std::sync::atomic::AtomicBool>,
}

impl SlowLog {
    fn new(probe: Probe) -> Self {
        SlowLog {
            probe,
            shas: Arc::new(script_names()),
            acc: Arc::new(Mutex::new((BTreeMap::new(), 0, 0, -1))),
            on: Arc::default(),
        }
    }

    /// Tallies the entries written since the last poll.
    async fn poll(&self) -> Result<()> {
        type Entry = (i64, i64, i64, Vec<Vec<u8>>, redis::Value, redis::Value);
        let get = redis::cmd("SLOWLOG").arg("GET").arg(3000).to_owned();
        let raw: Vec<Entry> = self.probe.query(&get).await?;
        let mut acc = self
            .acc
            .lock()
            .map_err(|_| anyhow::anyhow!("slow-log tally poisoned"))?;
        let last = acc.3;
        let fresh: Vec<&Entry> = raw.iter().filter(|e| e.0 > last).collect();
        if let (Some(oldest), true) = (fresh.iter().map(|e| e.0).min(), last >= 0) {
            acc.2 += (oldest - last - 1).max(0);
        }
        if let Some(newest) = raw.iter().map(|e| e.0).max() {
            acc.3 = acc.3.max(newest);
        }
        acc.1 += fresh.len();
        for (_, _, us, args, _, _) in fresh {
            let cmd = args
                .first()
                .map(|a| String::from_utf8_lossy(a).to_ascii_lowercase())
                .unwrap_or_default();
            let name = if cmd == "evalsha" {
                let sha = args
                    .get(1)
                    .map(|a| String::from_utf8_lossy(a).to_string())
                    .unwrap_or_default();
                format!("EVALSHA {}", self.shas.get(&sha).copied().unwrap_or("?"))
            } else if matches!(cmd.as_str(), "slowlog" | "info" | "config") {
                continue;
            } else {
                cmd.to_uppercase()
            };
            let e = acc.0.entry(name).or_default();
            e.0 += 1;
            e.1 += *us as u64;
        }
        Ok(())
    }

    /// The tally since the last take (after a last poll): (calls by name, entries read, missed).
    async fn take(&self) -> Result<(BTreeMap<String, (u64, u64)>, usize, i64)> {
        self.poll().await?;
        let mut acc = self
            .acc
            .lock()
            .map_err(|_| anyhow::anyhow!("slow-log tally poisoned"))?;
        let out = (std::mem::take(&mut acc.0), acc.1, acc.2);
        acc.1 = 0;
        acc.2 = 0;
        Ok(out)
    }

    /// Polls every 100 ms until `stop`.
    async fn run(self, stop: tokio_util::sync::CancellationToken) -> Result<()> {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return Ok(()),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    if self.on.load(Ordering::Relaxed) {
                        self.poll().await?;
                    }
                }
            }
        }
    }
}

async fn run(a: RunArgs) -> Result<()> {
    let redis_srv = PrivateRedis::start(None, None).await?;
    let url = redis_srv.url(None);
    let ns = Ns::on(&amqp_url(), &url, &a.queue_type, &[]).await?;
    println!(
        "scale run: private redis-server at {url}, RabbitMQ {}, namespace {}, queue type {}",
        fleet::process::redact(&amqp_url()),
        ns.name,
        a.queue_type
    );
    let probe = Probe::connect(&url).await?;
    let r = run_inner(&a, &ns, &probe).await;
    let cleaned = ns.cleanup().await;
    drop(redis_srv);
    r?;
    cleaned
}

async fn run_inner(a: &RunArgs, ns: &Ns, probe: &Probe) -> Result<()> {
    let _: () = ns
        .store
        .query(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("slowlog-log-slower-than")
                .arg(0),
        )
        .await?;
    let _: () = ns
        .store
        .query(
            redis::cmd("CONFIG")
                .arg("SET")
                .arg("slowlog-max-len")
                .arg(1_000_000),
        )
        .await?;
    let slow = SlowLog::new(probe.clone());
    let stop = tokio_util::sync::CancellationToken::new();
    let poller = tokio::spawn(slow.clone().run(stop.clone()));
    let (done, count) = counting();
    let bound = (2 * a.n).max(10_000).to_string();
    let sched_settings = [("ingress_max_normal", bound.as_str())];
    let sched = start_scheduler_exactly(ns, &sched_settings).await?;
    // Product heartbeat settings (the test harness's defaults are faster).
    let wset = [
        ("heartbeat_interval_ms", "10000"),
        ("heartbeat_timeout_ms", "30000"),
        ("run_lease_ms", "30000"),
    ];
    let h = [("count", count)];
    let mut ws = Vec::new();
    for id in ["scale-w1", "scale-w2"] {
        ws.push(start_worker(ns, id, "pool=a", a.capacity, &wset, &h).await?);
    }
    println!(
        "settings: scheduler at the product defaults but ingress_max_normal = {bound}; 2 workers `pool=a` × {} slots, heartbeat 10000 ms, run lease 30000 ms; no-op tasks with selector pool=a; {} per phase",
        a.capacity, a.n
    );
    let r = run_phases(a, ns, probe, &slow, &done).await;
    stop.cancel();
    let polled = poller.await;
    for w in ws {
        w.stop().await?;
    }
    sched.stop().await?;
    r?;
    polled?
}

async fn run_phases(
    a: &RunArgs,
    ns: &Ns,
    probe: &Probe,
    slow: &SlowLog,
    done: &Arc<AtomicUsize>,
) -> Result<()> {
    // Let start-up settle (declarations, first ticks), then measure the idle fleet: counters
    // without the slow-log poller (its replies are traffic), then the calls with it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let c0 = Counters::read(probe).await?;
    tokio::time::sleep(Duration::from_secs(a.idle_secs)).await;
    let idle = Counters::read(probe).await?.since(&c0);
    slow.on.store(true, Ordering::Relaxed);
    slow.take().await?;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(a.idle_secs)).await;
    let (idle_top, _, idle_missed) = slow.take().await?;
    let idle_top_secs = t0.elapsed().as_secs_f64();
    slow.on.store(false, Ordering::Relaxed);
    println!(
        "\n## Idle fleet ({} s): what it costs Redis per second with no task",
        a.idle_secs
    );
    let s = idle.secs.max(1e-9);
    println!(
        "slow-log entries/s {:.1} ({idle_missed} missed), commands executed/s {:.1}, bytes in/s {:.0}, out/s {:.0}, Redis CPU {:.2} %",
        idle_top.values().map(|v| v.0).sum::<u64>() as f64 / idle_top_secs,
        idle.plain_calls() as f64 / s,
        idle.net_in as f64 / s,
        idle.net_out as f64 / s,
        idle.cpu / s * 100.0
    );
    let list: Vec<String> = idle_top
        .iter()
        .map(|(k, v)| format!("{k} {:.2}/s", v.0 as f64 / idle_top_secs))
        .collect();
    println!("by call: {}", list.join(", "));

    for (phase, rate, calls) in [
        ("burst", None, false),
        ("steady", Some(a.rate), false),
        ("burst-calls", None, true),
    ] {
        let base = done.load(Ordering::Relaxed);
        slow.on.store(calls, Ordering::Relaxed);
        slow.take().await?;
        let c0 = Counters::read(probe).await?;
        let start = Instant::now();
        let tag = uuid::Uuid::new_v4().simple().to_string()[..6].to_string();
        let mk = |i: usize| {
            let mut e = task("count", serde_json::json!({}), "pool=a");
            e.id = format!("{phase}-{tag}-{i}");
            e
        };
        match rate {
            None => {
                let mut sent = 0;
                while sent < a.n {
                    let k = (a.n - sent).min(1000);
                    let envs: Vec<Envelope> = (sent..sent + k).map(mk).collect();
                    let (ok, refused) = ns.submit(&envs).await?;
                    if refused > 0 || ok != k {
                        bail!("{refused} of {k} submissions refused");
                    }
                    sent += k;
                }
            }
            Some(r) => {
                let mut tick = tokio::time::interval(Duration::from_millis(10));
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
                let mut sent = 0;
                while sent < a.n {
                    tick.tick().await;
                    let due = ((start.elapsed().as_secs_f64() * r) as usize + 1).min(a.n);
                    if due > sent {
                        let envs: Vec<Envelope> = (sent..due).map(mk).collect();
                        let (ok, refused) = ns.submit(&envs).await?;
                        if refused > 0 || ok != envs.len() {
                            bail!("{refused} of {} submissions refused", envs.len());
                        }
                        sent = due;
                    }
                }
            }
        }
        wait_for(
            &format!("{} tasks of the {phase} phase run", a.n),
            Duration::from_secs(600),
            || {
                let d = done.load(Ordering::Relaxed);
                async move { (d >= base + a.n).then_some(()) }
            },
        )
        .await?;
        let ran = start.elapsed().as_secs_f64();
        // Outcomes are written with the acks, reservations turned into runs and released:
        // wait until nothing is reserved or running any more, and the last task's status.
        ns.wait_groups_idle(Duration::from_secs(120)).await?;
        ns.wait_state(
            &format!("{phase}-{tag}-{}", a.n - 1),
            "succeeded",
            Duration::from_secs(60),
        )
        .await?;
        let d = Counters::read(probe).await?.since(&c0);
        let (top, entries, missed) = slow.take().await?;
        slow.on.store(false, Ordering::Relaxed);
        let ran_total = done.load(Ordering::Relaxed) - base;
        if ran_total != a.n {
            bail!("{phase}: {ran_total} runs for {} tasks", a.n);
        }
        let n = a.n as f64;
        let f = d.secs / idle.secs.max(1e-9);
        println!("\n## {phase}: {} no-op tasks{}, all run in {ran:.2} s ({:.0} tasks/s), counters over {:.2} s", a.n, rate.map(|r| format!(" offered at {r}/s")).unwrap_or_default(), n / ran, d.secs);
        if calls {
            let calls_top: u64 = top.values().map(|v| v.0).sum();
            let idle_top_n: u64 = idle_top.values().map(|v| v.0).sum();
            let fi = d.secs / idle_top_secs.max(1e-9);
            println!(
                "slow-log entries per task: {:.3} after the idle fleet's over the same time ({:.3} raw); entries read {entries}, missed {missed} (Redis 7.0 logs the commands a script runs too, so only the EVALSHA rows are calls from clients)",
                (calls_top as f64 - idle_top_n as f64 * fi) / n,
                calls_top as f64 / n
            );
            println!("| slow-log entry | entries | per task (raw) | idle entries over the same time | µs each (inside Redis) |");
            println!("|---|---|---|---|---|");
            for (k, (c, us)) in &top {
                let idle_c = idle_top.get(k).map(|v| v.0 as f64 * fi).unwrap_or(0.0);
                println!(
                    "| {k} | {c} | {:.3} | {idle_c:.0} | {:.1} |",
                    *c as f64 / n,
                    *us as f64 / (*c).max(1) as f64
                );
            }
            continue;
        }
        println!(
            "per task, the idle fleet's cost over the same time subtracted (raw in brackets):"
        );
        println!(
            "* commands executed (inside scripts and on their own): {:.2} ({:.2}); EVALSHA calls {:.3} ({:.3})\n* bytes into Redis: {:.0} ({:.0}); out of Redis: {:.0} ({:.0})\n* Redis CPU: {:.1} µs ({:.1} µs)",
            (d.plain_calls() as f64 - idle.plain_calls() as f64 * f) / n,
            d.plain_calls() as f64 / n,
            (d.calls("evalsha") as f64 - idle.calls("evalsha") as f64 * f) / n,
            d.calls("evalsha") as f64 / n,
            (d.net_in as f64 - idle.net_in as f64 * f) / n,
            d.net_in as f64 / n,
            (d.net_out as f64 - idle.net_out as f64 * f) / n,
            d.net_out as f64 / n,
            (d.cpu - idle.cpu * f) * 1e6 / n,
            d.cpu * 1e6 / n,
        );
        let mut inner: Vec<(&String, &(u64, u64))> = d
            .cmds
            .iter()
            .filter(|(k, _)| k.as_str() != "evalsha")
            .collect();
        inner.sort_by_key(|x| std::cmp::Reverse(x.1 .0));
        let list: Vec<String> = inner
            .iter()
            .take(20)
            .map(|(k, c)| format!("{k} {:.2}", c.0 as f64 / n))
            .collect();
        println!("commands per task (raw): {}", list.join(", "));
    }
    Ok(())
}
