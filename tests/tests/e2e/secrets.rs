//! Secrets never leak: `fleet-scheduler`, `fleet-worker` (exec executor running `env`) and
//! `fleetctl` run as processes with known secrets — API tokens, a Redis password (a private
//! `redis-server --requirepass`), a wrong AMQP password — through the usual scenarios (submit,
//! run, status, lists, metrics, refused calls, failed connections, bad settings, drain); then
//! everything captured (logs, API answers, `/metrics`, fleetctl output, the exec child's
//! environment as the task result) is searched for each secret.

use std::process::{Child, Command};
use std::time::Duration;

use anyhow::Result;
use fleet_tests::*;
use serde_json::json;

const ADMIN: &str = "sekrit-admin-token-7d1f2a90";
const SUBMIT: &str = "sekrit-submit-token-0b44e1";
const REDIS_PW: &str = "sekrit-redis-pw-93b1c5";
const AMQP_PW: &str = "sekrit-amqp-pw-44e0aa";
const SECRETS: [&str; 4] = [ADMIN, SUBMIT, REDIS_PW, AMQP_PW];

struct Proc {
    child: Child,
    log: String,
}

impl Proc {
    fn spawn(dir: &TempDir, name: &str, bin: &str, env: &[(String, String)]) -> Result<Proc> {
        let log = dir.path(&format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let child = fleet_command(bin)?
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .env(
                "RUST_LOG",
                "debug,lapin=info,h2=info,hyper=info,reqwest=info",
            )
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()?;
        Ok(Proc { child, log })
    }

    /// SIGTERM, wait up to 30 s for the exit (then SIGKILL), and the whole log.
    async fn stop(mut self) -> Result<String> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let child = &mut self.child;
        let exited = wait_for("the exit after SIGTERM", Duration::from_secs(30), || {
            std::future::ready(child.try_wait().ok().flatten())
        })
        .await;
        if exited.is_err() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        Ok(std::fs::read_to_string(&self.log)?)
    }
}

/// Runs `fleetctl` with only the variables `env`; its exit code and output as one text.
async fn fleetctl(env: &[(&str, &str)], args: &[&str]) -> Result<String> {
    let (code, out, err) = run_bin("fleetctl", env, args).await?;
    Ok(format!("$ fleetctl {args:?} → exit {code}\n{out}{err}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_secret_in_any_output() -> Result<()> {
    own_process!();
    let redis = PrivateRedis::start(None, Some(REDIS_PW)).await?;
    let redis_url = redis.url(Some(REDIS_PW));
    let ns = Ns::on(&amqp_url(), &redis_url, "classic", &[]).await?;
    let dir = TempDir::new("secrets")?;
    let (sp, wp) = (free_port()?, free_port()?);
    let tokens = format!("{ADMIN} admin, {SUBMIT} submit");
    let common = |addr: u16| -> Vec<(String, String)> {
        [
            ("FLEET_NAMESPACE", ns.name.clone()),
            ("FLEET_AMQP_URL", amqp_url()),
            ("FLEET_REDIS_URL", redis_url.clone()),
            ("FLEET_QUEUE_TYPE", "classic".into()),
            ("FLEET_API_TOKENS", tokens.clone()),
            ("FLEET_HTTP_ADDR", format!("127.0.0.1:{addr}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    };
    let sched = Proc::spawn(&dir, "scheduler", "fleet-scheduler", &common(sp))?;
    let mut wenv = common(wp);
    wenv.extend(
        [
            ("FLEET_WORKER_ID", "w-secret"),
            ("FLEET_EXECUTOR", "exec"),
            ("FLEET_EXEC_COMMAND", "env"),
            ("FLEET_HEARTBEAT_INTERVAL_MS", "500"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let worker = Proc::spawn(&dir, "worker", "fleet-worker", &wenv)?;
    // A worker with a wrong AMQP password: it retries and logs why.
    let mut benv = common(free_port()?);
    benv.retain(|(k, _)| k != "FLEET_AMQP_URL");
    benv.push((
        "FLEET_AMQP_URL".into(),
        format!("amqp://guest:{AMQP_PW}@127.0.0.1:5672/%2f"),
    ));
    benv.push(("FLEET_WORKER_ID".into(), "w-badpw".into()));
    let bad = Proc::spawn(&dir, "worker-badpw", "fleet-worker", &benv)?;

    let c = reqwest::Client::new();
    let mut captured = String::new();
    for port in [sp, wp] {
        let url = format!("http://127.0.0.1:{port}/readyz");
        wait_for("ready", Duration::from_secs(60), || async {
            c.get(&url)
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())
        })
        .await?;
    }
    // Submit through the API; the exec executor runs `env`: its output is the task's result.
    let r = c
        .post(format!("http://127.0.0.1:{sp}/v1/tasks"))
        .bearer_auth(SUBMIT)
        .json(&json!({"kind": "env", "id": "env-1"}))
        .send()
        .await?;
    captured += &format!("submit: {} {}\n", r.status(), r.text().await?);
    wait_for("env-1 succeeded", Duration::from_secs(60), || async {
        ns.status("env-1")
            .await
            .ok()
            .flatten()
            .filter(|s| s.get("state").map(String::as_str) == Some("succeeded"))
    })
    .await?;
    let mut task_answer = String::new();
    for (path, token) in [
        ("/v1/tasks/env-1", Some(ADMIN)),
        ("/v1/workers", Some(ADMIN)),
        ("/v1/groups", Some(ADMIN)),
        ("/v1/pressure", Some(ADMIN)),
        ("/v1/workers", Some(SUBMIT)),
        ("/v1/workers", Some("sekrit-admin-token-7d1f2a9")),
        ("/v1/workers", None),
        ("/metrics", None),
    ] {
        let mut rq = c.get(format!("http://127.0.0.1:{sp}{path}"));
        if let Some(t) = token {
            rq = rq.bearer_auth(t);
        }
        let r = rq.send().await?;
        let head = format!("GET {path}: {} {:?}", r.status(), r.headers());
        let text = format!("{head} {}\n", r.text().await?);
        if path == "/v1/tasks/env-1" {
            task_answer = text.clone();
        }
        captured += &text;
    }
    for path in ["/status", "/metrics"] {
        let r = c
            .get(format!("http://127.0.0.1:{wp}{path}"))
            .bearer_auth(ADMIN)
            .send()
            .await?;
        captured += &format!("worker GET {path}: {} {}\n", r.status(), r.text().await?);
    }
    // The exec child's environment really is in the answer, without the worker's settings.
    assert!(task_answer.contains("FLEET_TASK_ID=env-1"), "{task_answer}");
    assert!(
        !task_answer.contains("FLEET_API_TOKENS") && !task_answer.contains("FLEET_REDIS_URL"),
        "{task_answer}"
    );

    // fleetctl with the token and the Redis password, and with a wrong AMQP password.
    let api = format!("http://127.0.0.1:{sp}");
    let ctl: Vec<(&str, &str)> = vec![
        ("FLEET_API_URL", &api),
        ("FLEET_API_TOKEN", ADMIN),
        ("FLEET_NAMESPACE", &ns.name),
        ("FLEET_REDIS_URL", &redis_url),
    ];
    for args in [
        &["status", "env-1"][..],
        &["workers"],
        &["groups"],
        &["dead", "list"],
    ] {
        captured += &fleetctl(&ctl, args).await?;
    }
    let bad_amqp = format!("amqp://guest:{AMQP_PW}@127.0.0.1:5672/%2f");
    let mut ctl_bad = ctl.clone();
    ctl_bad.push(("FLEET_AMQP_URL", &bad_amqp));
    let out = fleetctl(&ctl_bad, &["submit", "--kind", "x"]).await?;
    assert!(out.contains("amqp://***@127.0.0.1"), "{out}");
    captured += &out;
    let mut ctl_wrong = ctl.clone();
    ctl_wrong.retain(|(k, _)| *k != "FLEET_API_TOKEN");
    ctl_wrong.push(("FLEET_API_TOKEN", SUBMIT));
    captured += &fleetctl(&ctl_wrong, &["workers"]).await?;
    captured += &fleetctl(&ctl, &["drain", "w-secret"]).await?;

    // Bad settings holding secrets: the refusal names the setting, not the secret.
    for (k, v) in [
        ("FLEET_REDIS_URL", format!("http://default:{REDIS_PW}@h")),
        ("FLEET_AMQP_URL", format!("mqtt://guest:{AMQP_PW}@h")),
        ("FLEET_API_TOKENS", format!("{ADMIN} root")),
    ] {
        let (code, err) = run_to_exit("fleet-scheduler", &[(k, v.as_str())]).await?;
        assert_eq!(code, 2, "{k}: {err}");
        assert!(err.contains(k), "{err}");
        captured += &err;
    }

    // A refused login is permanent: the bad worker reports it once and exits (status 2).
    // Wait for that report, then stop everything and take the logs.
    let bad_log = &bad.log.clone();
    wait_for(
        "the bad worker's refused login logged",
        Duration::from_secs(60),
        || async {
            std::fs::read_to_string(bad_log)
                .ok()
                .filter(|l| l.contains("refused the login"))
        },
    )
    .await?;
    let logs = [
        ("worker-badpw", bad.stop().await?),
        ("worker", worker.stop().await?),
        ("scheduler", sched.stop().await?),
    ];
    for (name, log) in &logs {
        // A capture that holds something (the refused worker logs just its start and its
        // one error line now that lapin's own ERROR lines of the same failure are off).
        assert!(
            log.lines().count() >= 2,
            "{name} logged almost nothing:\n{log}"
        );
        captured += &format!("==== {name}\n{log}");
    }
    assert!(
        logs[0].1.contains("ACCESS_REFUSED")
            || logs[0].1.contains("access")
            || logs[0].1.contains("auth"),
        "{}",
        logs[0].1
    );

    for secret in SECRETS {
        let hits: Vec<&str> = captured.lines().filter(|l| l.contains(secret)).collect();
        assert!(
            hits.is_empty(),
            "secret {secret} found in output:\n{}",
            hits.join("\n")
        );
    }
    ns.cleanup().await?;
    drop(redis);
    Ok(())
}

/// Issue 30 item 11: at `RUST_LOG=trace` the AMQP client dumps every frame it sends, and the
/// `connection.start-ok` frame holds the PLAIN login as a byte list (`\0user\0password`) that
/// no URL redaction recognises. Both daemons, started with `RUST_LOG=trace` and with
/// directives naming lapin's modules, log at TRACE (fleet's own lines are there) and show the
/// password in no form: plain, as the frame's byte list, or as hex.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_amqp_login_frame_is_never_logged_at_trace() -> Result<()> {
    const PW: &str = "Trace-Login-Pw-5c81e07d";
    let ns = Ns::new().await?;
    let url = format!("amqp://guest:{PW}@127.0.0.1:5672/%2f");
    let bytes = PW
        .bytes()
        .map(|b| b.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let hex: String = PW.bytes().map(|b| format!("{b:02x}")).collect();
    for bin in ["fleet-worker", "fleet-scheduler"] {
        for filter in [
            "trace",
            "info,lapin=trace,lapin::io_loop=trace,lapin::frames=trace",
        ] {
            let port = free_port()?.to_string();
            let env = [
                ("FLEET_NAMESPACE", ns.name.as_str()),
                ("FLEET_AMQP_URL", url.as_str()),
                ("FLEET_HTTP_ADDR", &format!("127.0.0.1:{port}")),
                ("FLEET_QUEUE_TYPE", "classic"),
                ("RUST_LOG", filter),
            ];
            let (code, out, err) = run_bin(bin, &env, &[]).await?;
            let all = format!("{out}{err}");
            // The login is refused (a wrong password on purpose: the frame is sent all the
            // same), which the daemon reports once, and exits with 2.
            assert_eq!(code, 2, "{bin} {filter}: {all}");
            assert!(all.contains("refused the login"), "{bin} {filter}: {all}");
            if filter == "trace" {
                assert!(all.contains("TRACE"), "{bin}: nothing at TRACE:\n{all}");
            }
            for form in [PW, bytes.as_str(), hex.as_str()] {
                let hits: Vec<&str> = all.lines().filter(|l| l.contains(form)).collect();
                assert!(
                    hits.is_empty(),
                    "{bin} with RUST_LOG={filter}: the password as `{form}` in:\n{}",
                    hits.join("\n")
                );
            }
        }
    }
    ns.cleanup().await
}
