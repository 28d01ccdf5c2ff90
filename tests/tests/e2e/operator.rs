//! What an operator sees: `--help` / `--version` that start nothing, exit code 2 with a message
//! naming the setting for every bad setting and every permanent broker error, passwords never
//! printed, control characters never reaching a log raw, a worker that drains on SIGTERM with
//! its stderr closed, `/readyz` 503 while Redis refuses writes.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::CommandFactory;
use deadpool_redis::redis;
use fleet::settings::{SchedulerArgs, WorkerArgs};
use fleet_tests::*;
use tokio::process::Command;

/// A password no test server uses: it must never appear in any output.
const SECRET: &str = "Hunter2-never-printed";

/// Runs a binary with only the given `FLEET_*` variables: (exit code, stdout, stderr).
async fn run(
    bin: &str,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Result<(i32, String, String)> {
    let mut cmd = Command::new(bin_path(bin)?);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLEET_") {
            cmd.env_remove(k);
        }
    }
    cmd.envs(env.iter().copied())
        .args(args)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(timeout, cmd.output())
        .await
        .with_context(|| format!("{bin} {args:?} {env:?} did not exit within {timeout:?}"))??;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// Waits until `http://addr/readyz` answers 200.
async fn wait_ready(client: &reqwest::Client, addr: &str) -> Result<()> {
    let ready = format!("http://{addr}/readyz");
    wait_for(&format!("{addr} ready"), Duration::from_secs(20), || {
        let (c, u) = (client.clone(), ready.clone());
        async move {
            c.get(&u)
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())
                .map(|_| ())
        }
    })
    .await
}

fn free_addr() -> Result<String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.to_string())
}

#[tokio::test]
async fn help_and_version_list_every_setting_and_start_nothing() -> Result<()> {
    let ns = Ns::new().await?;
    for (bin, cmd) in [
        ("fleet-scheduler", SchedulerArgs::command()),
        ("fleet-worker", WorkerArgs::command()),
    ] {
        let addr = free_addr()?;
        let env = [
            ("FLEET_NAMESPACE", ns.name.as_str()),
            ("FLEET_HTTP_ADDR", addr.as_str()),
            ("FLEET_QUEUE_TYPE", "classic"),
        ];
        let (code, out, err) = run(bin, &["--help"], &env, Duration::from_secs(10)).await?;
        assert_eq!(code, 0, "{bin} --help: {err}");
        let mut listed = 0;
        for a in cmd.get_arguments() {
            let (Some(long), Some(var)) = (a.get_long(), a.get_env()) else {
                continue;
            };
            let var = var.to_string_lossy();
            assert!(
                out.contains(&format!("--{long}")),
                "{bin} --help lacks --{long}"
            );
            assert!(
                out.contains(&format!("env: {var}")),
                "{bin} --help lacks {var}"
            );
            for d in a.get_default_values() {
                let d = d.to_string_lossy();
                if !d.is_empty() {
                    assert!(
                        out.contains(&format!("default: {d}")),
                        "{bin} --help lacks the default {d} of {var}"
                    );
                }
            }
            listed += 1;
        }
        assert!(listed >= 20, "{bin}: only {listed} settings");
        let (code, out, _) = run(bin, &["--version"], &env, Duration::from_secs(10)).await?;
        assert_eq!(
            (code, out.trim()),
            (0, format!("{bin} {}", env!("CARGO_PKG_VERSION")).as_str())
        );
        // Nothing listened, nothing was declared in the namespace, nothing registered.
        assert!(
            std::net::TcpStream::connect(&addr).is_err(),
            "{bin} --help bound {addr}"
        );
    }
    for q in [
        ns.names.ingress_queue(fleet::Lane::Normal),
        ns.names.dead_queue(),
        ns.names.delayed_queue(),
    ] {
        assert_eq!(ns.depth_of(&q).await, None, "{q} was declared by --help");
    }
    let keys: Vec<String> = ns
        .store
        .query(redis::cmd("KEYS").arg(ns.names.all_keys_pattern()))
        .await?;
    assert!(keys.is_empty(), "--help wrote Redis keys: {keys:?}");
    ns.cleanup().await
}

#[tokio::test]
async fn every_bad_setting_exits_2_naming_it() -> Result<()> {
    let dir =
        std::env::temp_dir().join(format!("fleet-operator-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    let bad_toml = dir.join("bad.toml");
    std::fs::write(&bad_toml, "capacity = [unclosed\n")?;
    let bad_toml = bad_toml.to_string_lossy().into_owned();
    let missing = dir.join("missing.toml").to_string_lossy().into_owned();
    let leaky_amqp = format!("AMQPX://fleet:{SECRET}@127.0.0.1:5672/%2f");
    let leaky_redis = format!("redis+tls://:{SECRET}@127.0.0.1:6379");
    // (binary, environment, the setting its error names, what the error says)
    type Case<'a> = (&'a str, Vec<(&'a str, &'a str)>, &'a str, &'a str);
    let cases: Vec<Case> = vec![
        (
            "fleet-worker",
            vec![("FLEET_CAPACITY", "-1")],
            "FLEET_CAPACITY",
            "must be a positive integer",
        ),
        (
            "fleet-worker",
            vec![("FLEET_CAPACITY", "70000")],
            "FLEET_CAPACITY",
            "at most 65535",
        ),
        (
            "fleet-worker",
            vec![("FLEET_EXECUTOR", "python")],
            "FLEET_EXECUTOR",
            "python",
        ),
        (
            "fleet-worker",
            vec![("FLEET_EXECUTOR", "http")],
            "FLEET_HTTP_URL",
            "required",
        ),
        (
            "fleet-worker",
            vec![("FLEET_CONFIG", &missing)],
            "FLEET_CONFIG",
            "cannot read",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_CONFIG", &missing)],
            "FLEET_CONFIG",
            "cannot read",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_CONFIG", &bad_toml)],
            "FLEET_CONFIG",
            "invalid TOML",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_PENDING_RED", "2")],
            "FLEET_PENDING_RED",
            "between 0 and 1",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_RATE", "fast")],
            "FLEET_RATE",
            "must be a number",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_AMQP_URL", &leaky_amqp)],
            "FLEET_AMQP_URL",
            "not an amqp",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_REDIS_URL", &leaky_redis)],
            "FLEET_REDIS_URL",
            "not a redis://, rediss://, redis+sentinel:// or redis+cluster:// URL",
        ),
        (
            "fleet-scheduler",
            vec![("FLEET_HTTP_ADDR", "nowhere")],
            "FLEET_HTTP_ADDR",
            "host:port",
        ),
    ];
    for (bin, env, setting, words) in cases {
        let (code, out, err) = run(bin, &[], &env, Duration::from_secs(20)).await?;
        assert_eq!(code, 2, "{bin} {env:?}: {err}");
        assert_eq!(
            err.lines().count(),
            1,
            "{bin} {env:?}: one line expected, got:\n{err}"
        );
        assert!(
            err.contains(setting) && err.contains(words),
            "{bin} {env:?}: {err}"
        );
        assert!(
            !err.contains("panicked") && !err.contains("backtrace"),
            "{err}"
        );
        assert!(
            !out.contains(SECRET) && !err.contains(SECRET),
            "password printed: {err}"
        );
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[tokio::test]
async fn redeclare_with_another_bound_exits_2_with_both_values() -> Result<()> {
    let ns = Ns::new().await?;
    // A scheduler earlier declared the ingress with a bound of 100.
    let ch = ns.conn.create_channel().await?;
    fleet::broker::topology::declare_ingress(&ch, &ns.common(&[("ingress_max_normal", "100")])?)
        .await?;
    let addr = free_addr()?;
    let env = [
        ("FLEET_NAMESPACE", ns.name.as_str()),
        ("FLEET_AMQP_URL", &amqp_url()),
        ("FLEET_REDIS_URL", &redis_url()),
        ("FLEET_QUEUE_TYPE", "classic"),
        ("FLEET_HTTP_ADDR", addr.as_str()),
        ("FLEET_INGRESS_MAX_NORMAL", "200"),
    ];
    let (code, _, err) = run("fleet-scheduler", &[], &env, Duration::from_secs(30)).await?;
    assert_eq!(code, 2, "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("fleet-scheduler: FLEET_INGRESS_MAX_NORMAL"),
        "{err}"
    );
    assert!(
        last.contains("x-max-length") && last.contains("'200'") && last.contains("'100'"),
        "{err}"
    );
    assert!(
        last.contains(&ns.names.ingress_queue(fleet::Lane::Normal)),
        "{err}"
    );
    assert_eq!(
        err.matches("PRECONDITION_FAILED").count(),
        2,
        "reported once (log line + exit message):\n{err}"
    );
    ns.cleanup().await
}

#[tokio::test]
async fn wrong_password_exits_2_once_and_is_never_printed() -> Result<()> {
    let ns = Ns::new().await?;
    let url = amqp_url();
    let Some(rest) = url.split_once('@').map(|(_, r)| r.to_string()) else {
        bail!("AMQP_ADDR {url} has no userinfo")
    };
    let wrong = format!("AMQP://guest:{SECRET}@{rest}");
    for bin in ["fleet-scheduler", "fleet-worker"] {
        let addr = free_addr()?;
        let env = [
            ("FLEET_NAMESPACE", ns.name.as_str()),
            ("FLEET_AMQP_URL", wrong.as_str()),
            ("FLEET_REDIS_URL", &redis_url()),
            ("FLEET_QUEUE_TYPE", "classic"),
            ("FLEET_HTTP_ADDR", addr.as_str()),
        ];
        let (code, out, err) = run(bin, &[], &env, Duration::from_secs(30)).await?;
        assert_eq!(code, 2, "{bin}: {err}");
        assert!(
            !out.contains(SECRET) && !err.contains(SECRET),
            "{bin} printed the password:\n{err}"
        );
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.contains("FLEET_AMQP_URL")
                && last.contains("refused the login")
                && last.contains("AMQP://***@"),
            "{bin}: {err}"
        );
        assert!(!err.contains("Close {"), "{bin}: raw frame dump:\n{err}");
        assert_eq!(
            err.matches("refused the login").count(),
            2,
            "{bin}: reported once (log line + exit message):\n{err}"
        );
    }
    ns.cleanup().await
}

#[tokio::test]
async fn control_characters_never_reach_the_log_raw() -> Result<()> {
    let ns = Ns::new().await?;
    let addr = free_addr()?;
    let log = std::env::temp_dir().join(format!("fleet-{}-scheduler.log", ns.name));
    let file = std::fs::File::create(&log)?;
    let mut child = Command::new(bin_path("fleet-scheduler")?)
        .env("FLEET_NAMESPACE", &ns.name)
        .env("FLEET_AMQP_URL", amqp_url())
        .env("FLEET_REDIS_URL", redis_url())
        .env("FLEET_QUEUE_TYPE", "classic")
        .env("FLEET_HTTP_ADDR", &addr)
        .env("FLEET_PROBE_INTERVAL_MS", "600000")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(file)
        .kill_on_drop(true)
        .spawn()?;
    let client = reqwest::Client::new();
    wait_ready(&client, &addr).await?;
    let forged = "echo\nFAKE LOG LINE level=ERROR\u{1b}[31m";
    // Over HTTP: refused at the door, naming the field.
    let r = client
        .post(format!("http://{addr}/v1/tasks"))
        .json(&serde_json::json!({"kind": forged, "id": "a\u{0}b"}))
        .send()
        .await?;
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["error"], "bad_field", "{body}");
    // Over AMQP: dead-lettered as bad_field.
    let body = serde_json::json!({"kind": forged, "id": "forged-1"}).to_string();
    fleet::broker::amqp::publish_confirmed(
        &ns.publisher,
        &ns.names.submit_exchange(),
        "normal",
        body.as_bytes(),
        fleet::broker::amqp::task_properties("forged-1", None),
    )
    .await?;
    let dead = wait_for("the dead letter", Duration::from_secs(20), || {
        let ns = &ns;
        async move { ns.drain_dead().await.ok().filter(|d| !d.is_empty()) }
    })
    .await?;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.as_deref(), Some("bad_field"), "{dead:?}");
    child.start_kill()?;
    let _ = child.wait().await;
    let text = std::fs::read(&log)?;
    let text = String::from_utf8_lossy(&text);
    assert!(
        !text.chars().any(|c| c.is_control() && c != '\n'),
        "raw control characters in the log:\n{text}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("FAKE")),
        "forged line:\n{text}"
    );
    let _ = std::fs::remove_file(&log);
    ns.cleanup().await
}

#[tokio::test]
async fn worker_with_stderr_closed_drains_on_sigterm() -> Result<()> {
    let ns = Ns::new().await?;
    let addr = free_addr()?;
    let mut child = Command::new(bin_path("fleet-worker")?)
        .env("FLEET_NAMESPACE", &ns.name)
        .env("FLEET_AMQP_URL", amqp_url())
        .env("FLEET_REDIS_URL", redis_url())
        .env("FLEET_QUEUE_TYPE", "classic")
        .env("FLEET_HTTP_ADDR", &addr)
        .env("FLEET_WORKER_ID", "closed-stderr")
        .env("FLEET_HEARTBEAT_INTERVAL_MS", "200")
        .env("FLEET_HEARTBEAT_TIMEOUT_MS", "1000")
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // Close the reading end: every log write now fails (EPIPE).
    drop(child.stderr.take());
    let client = reqwest::Client::new();
    wait_ready(&client, &addr).await?;
    assert!(
        worker(&ns.store, "closed-stderr").await.is_some(),
        "registered"
    );
    let pid = child.id().context("worker pid")?;
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    assert!(status.success());
    let exit = tokio::time::timeout(Duration::from_secs(20), child.wait())
        .await
        .context("worker still alive 20 s after SIGTERM")??;
    assert_eq!(exit.code(), Some(0), "a clean drain");
    assert!(
        worker(&ns.store, "closed-stderr").await.is_none(),
        "deregistered"
    );
    ns.cleanup().await
}

#[tokio::test]
async fn readyz_is_503_while_redis_refuses_writes() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let admin = fleet::Store::new(&redis.url(None), fleet::Names::new("admin"))?;
    let s = start_scheduler(&ns, &[]).await?;
    let w = start_worker(
        &ns,
        "ro-worker",
        "",
        1,
        &[
            ("heartbeat_interval_ms", "200"),
            ("heartbeat_timeout_ms", "1000"),
            ("run_lease_ms", "2000"),
        ],
        &[],
    )
    .await?;
    let client = reqwest::Client::new();
    let urls = [s.url("/readyz"), format!("http://{}/readyz", w.addr)];
    let status = |u: String| {
        let c = client.clone();
        async move {
            c.get(&u)
                .send()
                .await
                .map(|r| r.status().as_u16())
                .unwrap_or(0)
        }
    };
    for u in &urls {
        assert_eq!(status(u.clone()).await, 200, "{u}");
    }
    // A replica of a dead primary: answers PING, refuses every write with READONLY.
    let dead_port = free_addr()?.rsplit(':').next().unwrap_or("1").to_string();
    let _: () = admin
        .query(redis::cmd("REPLICAOF").arg("127.0.0.1").arg(&dead_port))
        .await?;
    for u in &urls {
        wait_for(&format!("{u} 503"), Duration::from_secs(10), || {
            let f = status(u.clone());
            async move { (f.await == 503).then_some(()) }
        })
        .await?;
    }
    let _: () = admin
        .query(redis::cmd("REPLICAOF").arg("NO").arg("ONE"))
        .await?;
    for u in &urls {
        wait_for(&format!("{u} 200 again"), Duration::from_secs(10), || {
            let f = status(u.clone());
            async move { (f.await == 200).then_some(()) }
        })
        .await?;
    }
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await
}

/// `fleetctl delete-namespace --yes` with FLEET_SHARDS=4 leaves no queue of the namespace
/// behind: every shard queue of the group (each holding a task), its park queues, the
/// waiting-for-worker park queue `<ns>.park._unmatched.normal` (holding a task no worker
/// matches), ingress, dead, delayed and the delay tiers are gone, and so are the exchanges.
/// The names are built here from `Names` and checked one by one with passive declares.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_namespace_deletes_every_shard_and_waiting_queue() -> Result<()> {
    use fleet::{broker::amqp, Lane};
    let ns = Ns::new().await?;
    let shards = [("shards", "4")];
    let sched = start_scheduler(&ns, &shards).await?;
    let worker = start_worker(&ns, "w-del", "zone=del", 1, &shards, &[]).await?;
    let groups = ns.store.group_names().await?;
    assert_eq!(groups.len(), 1, "{groups:?}");
    let group = groups[0].clone();
    // A task no worker matches: it waits for a worker in the _unmatched park queue.
    let waiting = fleet_tests::task("noop", serde_json::json!({}), "zone=nowhere");
    assert_eq!(ns.submit(std::slice::from_ref(&waiting)).await?, (1, 0));
    wait_for(
        "the task waiting for a worker",
        Duration::from_secs(30),
        || async {
            ns.status(&waiting.id)
                .await
                .ok()
                .flatten()
                .filter(|s| s.get("state").map(String::as_str) == Some("waiting_for_worker"))
        },
    )
    .await?;
    worker.stop().await?;
    sched.stop().await?;
    // One task in each shard queue (nobody consumes them now).
    let n = &ns.names;
    let shard_queues = n.group_shard_queues(&group, Lane::Normal, 4);
    assert_eq!(shard_queues.len(), 4);
    for s in 0..4 {
        let t = fleet_tests::task("noop", serde_json::json!({}), "zone=del");
        amqp::publish_confirmed(
            &ns.publisher,
            &n.tasks_exchange(),
            &n.group_shard_key(&group, Lane::Normal, s, 4),
            &t.to_bytes(),
            amqp::task_properties(&t.id, None),
        )
        .await?;
    }
    let unmatched = n.park_queue("_unmatched", Lane::Normal);
    // Before the delete each holds its task (the waiting one is back as soon as the stopped
    // scheduler's consumer is gone).
    for q in shard_queues.iter().chain([&unmatched]) {
        wait_for(
            &format!("{q} holding 1 task"),
            Duration::from_secs(10),
            || async { (ns.depth_of(q).await == Some(1)).then_some(()) },
        )
        .await?;
    }

    let url = (amqp_url(), redis_url());
    let env = [
        ("FLEET_AMQP_URL", url.0.as_str()),
        ("FLEET_REDIS_URL", url.1.as_str()),
        ("FLEET_NAMESPACE", ns.name.as_str()),
        ("FLEET_SHARDS", "4"),
    ];
    let (code, out, err) = run(
        "fleetctl",
        &["delete-namespace", "--yes"],
        &env,
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!(code, 0, "stdout {out} stderr {err}");
    assert!(out.contains("deleted the queues of 1 group(s)"), "{out}");

    let mut queues = shard_queues.clone();
    for lane in Lane::ALL {
        queues.push(n.ingress_queue(lane));
        queues.push(n.group_queue(&group, lane));
        queues.push(n.park_queue(&group, lane));
        queues.push(n.park_queue("_unmatched", lane));
    }
    queues.extend([
        n.dead_queue(),
        n.broker_dead_queue(),
        n.delayed_queue(),
        n.schedules_stream(),
    ]);
    queues.extend(fleet::broker::delay::tiers().map(|t| n.delay_queue(t)));
    let mut left = Vec::new();
    for q in &queues {
        if let Some(d) = ns.depth_of(q).await {
            left.push(format!("{q} ({d} messages)"));
        }
    }
    assert!(left.is_empty(), "queues left behind: {left:?}");
    for e in [n.submit_exchange(), n.tasks_exchange(), n.delay_exchange()] {
        let ch = ns.conn.create_channel().await?;
        let passive = lapin::options::ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let r = ch
            .exchange_declare(
                e.as_str().into(),
                lapin::ExchangeKind::Direct,
                passive,
                Default::default(),
            )
            .await;
        assert!(r.is_err(), "exchange {e} left behind");
    }
    assert!(
        ns.store.group_names().await?.is_empty(),
        "the Redis keys are gone"
    );
    ns.cleanup().await
}

/// `fleetctl delete-namespace --yes` finds a group's queues when Redis says nothing about
/// them (a Redis loss, or a worker that declared its queues while Redis was unreachable): a
/// worker declares its group (its normal queue holding a task), stops, and the namespace's
/// Redis keys are deleted. The broker's queue catalog (`<ns>.catalog`) still names the
/// group: the command reports 1 group, known only to the catalog, and every queue of the
/// group — and the catalog — is gone (passive declare 404 each). Before the catalog it said
/// "deleted the queues of 0 group(s)" and left both lane queues.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_namespace_finds_the_queues_redis_forgot() -> Result<()> {
    use fleet::{broker::amqp, Lane};
    let ns = Ns::new().await?;
    let worker = start_worker(&ns, "w-forgot", "zone=forgot", 1, &[], &[]).await?;
    let groups = ns.store.group_names().await?;
    assert_eq!(groups.len(), 1, "{groups:?}");
    let group = groups[0].clone();
    worker.stop().await?;
    let n = &ns.names;
    let t = fleet_tests::task("noop", serde_json::json!({}), "zone=forgot");
    amqp::publish_confirmed(
        &ns.publisher,
        &n.tasks_exchange(),
        &n.group_key(&group, Lane::Normal),
        &t.to_bytes(),
        amqp::task_properties(&t.id, None),
    )
    .await?;
    let lane_queues: Vec<String> = Lane::ALL
        .iter()
        .map(|l| n.group_queue(&group, *l))
        .collect();
    assert_eq!(ns.depth_of(&lane_queues[0]).await, Some(1));
    assert_eq!(ns.depth_of(&lane_queues[1]).await, Some(0));
    // Redis forgets the namespace.
    ns.store.delete_namespace().await?;
    assert!(ns.store.group_names().await?.is_empty());

    let url = (amqp_url(), redis_url());
    let env = [
        ("FLEET_AMQP_URL", url.0.as_str()),
        ("FLEET_REDIS_URL", url.1.as_str()),
        ("FLEET_NAMESPACE", ns.name.as_str()),
    ];
    let (code, out, err) = run(
        "fleetctl",
        &["delete-namespace", "--yes"],
        &env,
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!(code, 0, "stdout {out} stderr {err}");
    assert!(
        out.contains(
            "deleted the queues of 1 group(s) (1 known only to the broker's queue catalog, not to Redis)"
        ),
        "{out}"
    );
    let mut left = Vec::new();
    for q in lane_queues.iter().chain([&n.catalog_queue()]) {
        let ch = ns.conn.create_channel().await?;
        let r = ch
            .queue_declare(
                q.as_str().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                Default::default(),
            )
            .await;
        match r {
            Err(e) if amqp::reply_code(&e) == Some(404) => {}
            Err(e) => bail!("passive declare of {q}: {e}"),
            Ok(d) => left.push(format!("{q} ({} messages)", d.message_count())),
        }
    }
    assert!(left.is_empty(), "queues left behind: {left:?}");
    ns.cleanup().await
}

/// `fleetctl submit` into a namespace no scheduler has declared says so once, with the fix
/// (the broker's 404 for `<ns>.submit` was printed three times on one line, with no hint), and
/// exits non-zero; a namespace with a scheduler's topology takes the task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_into_an_undeclared_namespace_names_the_fix_once() -> Result<()> {
    let ns = Ns::new().await?;
    let url = amqp_url();
    let env = [
        ("FLEET_AMQP_URL", url.as_str()),
        ("FLEET_NAMESPACE", ns.name.as_str()),
    ];
    let (code, out, err) = run(
        "fleetctl",
        &["submit", "--kind", "noop"],
        &env,
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!(code, 1, "stdout {out} stderr {err}");
    let want = format!(
        "no scheduler has declared namespace {0} (no exchange {0}.submit): start fleet-scheduler with FLEET_NAMESPACE={0}",
        ns.name
    );
    assert_eq!(err.matches(&want).count(), 1, "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(!err.contains("NOT_FOUND"), "{err}");
    // Declared (as a scheduler does at start-up): accepted.
    ns.declare_ingress(&[]).await?;
    let (code, out, err) = run(
        "fleetctl",
        &["submit", "--kind", "noop"],
        &env,
        Duration::from_secs(60),
    )
    .await?;
    assert_eq!((code, out.trim()), (0, "accepted=1 refused=0"), "{err}");
    ns.cleanup().await
}

/// fleetctl's help, run as a process for every subcommand with FLEET_NAMESPACE set empty and a
/// password in FLEET_AMQP_URL: every option has a description; a subcommand's own options come
/// before the global ones, which sit under their own heading; `--lane` lists its values; the
/// API token's variable is named; no `[env: NAME=value]` (which printed `FLEET_NAMESPACE=` for
/// an empty variable, and would print a password); a usage line never shows a global option as
/// if it were required; an unreachable API names FLEET_API_URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleetctl_help_documents_every_option_and_separates_the_global_ones() -> Result<()> {
    let amqp = format!("amqp://guest:{SECRET}@127.0.0.1:5672/%2f");
    let env = [
        ("FLEET_NAMESPACE", ""),
        ("FLEET_AMQP_URL", amqp.as_str()),
        ("FLEET_API_URL", "http://127.0.0.1:1"),
    ];
    let subcommands: &[&[&str]] = &[
        &[],
        &["submit"],
        &["status"],
        &["workers"],
        &["groups"],
        &["drain"],
        &["dead", "list"],
        &["dead", "replay"],
        &["delete-namespace"],
        &["schedule", "add"],
        &["schedule", "list"],
        &["schedule", "pause"],
        &["schedule", "fire-now"],
    ];
    for sub in subcommands {
        let mut args = sub.to_vec();
        args.push("--help");
        let (code, out, err) = run("fleetctl", &args, &env, Duration::from_secs(30)).await?;
        assert_eq!(code, 0, "{args:?}: {err}");
        assert!(!out.contains(SECRET), "{args:?} printed the password");
        assert!(
            !out.contains("=]"),
            "{args:?}: an env value is shown:\n{out}"
        );
        let lines: Vec<&str> = out.lines().collect();
        let mut undocumented = Vec::new();
        for (i, l) in lines.iter().enumerate() {
            let t = l.trim_start();
            if l.starts_with("  ")
                && (t.starts_with("--") || t.starts_with("-h,") || t.starts_with("-V,"))
            {
                // Short form: `--x <X>  text`; long form: the text on the next line.
                let inline = t.split_once("  ").map(|(_, d)| d.trim()).unwrap_or("");
                let next = lines.get(i + 1).map(|n| n.trim()).unwrap_or("");
                let text = if inline.is_empty() { next } else { inline };
                if text.is_empty() || text.starts_with('[') || text.starts_with("--") {
                    undocumented.push(t.to_string());
                }
            }
        }
        assert!(
            undocumented.is_empty(),
            "{args:?}: undocumented {undocumented:?}"
        );
        let global = out
            .find("Global options")
            .with_context(|| format!("{args:?}: no global heading:\n{out}"))?;
        for g in [
            "--amqp-url",
            "--namespace",
            "--api ",
            "--redis-url",
            "--shards",
        ] {
            let at = out.find(g).with_context(|| format!("{args:?}: no {g}"))?;
            assert!(at > global, "{args:?}: {g} above the global heading");
        }
        if !sub.is_empty() {
            // A subcommand's own options come first.
            if let Some(own) = out.find("\nOptions:") {
                assert!(own < global, "{args:?}");
            }
        }
    }
    let (_, top, _) = run("fleetctl", &["--help"], &env, Duration::from_secs(30)).await?;
    assert!(top.contains("FLEET_API_TOKEN"), "{top}");
    let (_, submit, _) = run(
        "fleetctl",
        &["submit", "--help"],
        &env,
        Duration::from_secs(30),
    )
    .await?;
    for want in ["--kind", "--max-attempts", "normal", "critical"] {
        assert!(submit.contains(want), "{want}: {submit}");
    }
    let own = &submit[..submit.find("Global options").unwrap_or(0)];
    for o in ["--kind", "--count", "--lane", "--max-attempts", "--paced"] {
        assert!(own.contains(o), "{o} not among submit's own options");
    }
    // Usage lines with the variables set: no global option shown as required.
    for args in [
        &["status"][..],
        &["drain"],
        &["schedule", "rm"],
        &["submit"],
    ] {
        let (code, _, err) = run("fleetctl", args, &env, Duration::from_secs(30)).await?;
        assert_eq!(code, 2, "{args:?}: {err}");
        let usage = err
            .lines()
            .find(|l| l.starts_with("Usage:"))
            .with_context(|| format!("{args:?}: no usage: {err}"))?;
        assert!(
            !usage.contains("--namespace")
                && !usage.contains("--api")
                && !usage.contains("--amqp-url"),
            "{args:?}: {usage}"
        );
    }
    // An unreachable API names the setting.
    let (code, _, err) = run("fleetctl", &["workers"], &env, Duration::from_secs(30)).await?;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("cannot reach the scheduler's API") && err.contains("FLEET_API_URL"),
        "{err}"
    );
    Ok(())
}
