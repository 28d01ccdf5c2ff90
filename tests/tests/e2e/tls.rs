//! TLS end to end with certificates made at test time: a private RabbitMQ node with a TLS-only
//! listener and a private TLS-only `redis-server`, both requiring client certificates; fleet
//! runs tasks over them; a wrong CA fails with the documented error and a missing client
//! certificate is refused; a certificate for another host name is refused by all three
//! clients. The http executor calls an https endpoint (test CA), redirects off unless asked.
//! Bad TLS files stop start-up with exit 2 naming the setting. `fleetctl submit` publishes
//! over the TLS-only broker with the `FLEET_AMQP_TLS_*` files (and fails without them).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::response::Redirect;
use axum::routing::post;
use axum::{Json, Router};
use deadpool_redis::redis;
use fleet::settings::Settings;
use fleet::tls::TlsConfig;
use fleet::{broker::amqp, Names, Store};
use fleet_tests::*;
use serde_json::{json, Value};

const REDIS_ADMIN_PASSWORD: &str = "redis-admin-pw-0123456789";
const REDIS_USER_PASSWORD: &str = "fleet-user-pw-0123456789";

fn tls(pairs: Vec<(String, String)>, prefix: &str) -> Result<TlsConfig> {
    fleet_tests::tls_config(
        &Settings::from_pairs(pairs.iter().map(|(k, v)| (k.as_str(), v.clone()))),
        prefix,
    )
}

/// The TLS settings of `prefix` with the CA replaced by `ca`.
fn with_ca(pki: &Pki, prefix: &str, ca: &str, client: bool) -> Result<TlsConfig> {
    let mut s = pki.settings(prefix, client);
    s[0].1 = ca.to_string();
    tls(s, prefix)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fleet_runs_over_mutual_tls_to_rabbitmq_and_redis() -> Result<()> {
    let pki = Pki::new()?;
    let (rabbit, redis) = tokio::try_join!(
        PrivateRabbit::start_tls(&pki, true),
        PrivateRedis::start(Some((&pki, true)), Some(REDIS_ADMIN_PASSWORD))
    )?;
    let client_redis = tls(pki.settings("redis_tls", true), "redis_tls")?;
    let client_amqp = tls(pki.settings("amqp_tls", true), "amqp_tls")?;

    // An ACL user (user + password in the URL) for fleet, made by the default user.
    let admin = Store::with_tls(
        &redis.url(Some(REDIS_ADMIN_PASSWORD)),
        Names::new("admin"),
        &client_redis,
    )?;
    let ok: String = admin
        .query(
            redis::cmd("ACL")
                .arg("SETUSER")
                .arg("fleet")
                .arg("on")
                .arg(format!(">{REDIS_USER_PASSWORD}"))
                .arg("~*")
                .arg("&*")
                .arg("+@all"),
        )
        .await?;
    assert_eq!(ok, "OK");
    let redis_url = format!(
        "rediss://fleet:{REDIS_USER_PASSWORD}@localhost:{}",
        redis.port
    );

    // Wrong CA: the documented error, for both.
    let e = amqp::connect_with(
        &rabbit.url(),
        "wrong-ca",
        &with_ca(&pki, "amqp_tls", &pki.other_ca, true)?,
    )
    .await
    .err()
    .context("wrong CA accepted by amqp")?;
    assert!(
        e.to_string()
            .contains("invalid peer certificate: UnknownIssuer"),
        "{e}"
    );
    let s = Store::with_tls(
        &redis_url,
        Names::new("x"),
        &with_ca(&pki, "redis_tls", &pki.other_ca, true)?,
    )?;
    let e = s
        .query::<String>(&redis::cmd("PING"))
        .await
        .err()
        .context("wrong CA accepted by redis")?;
    assert!(
        e.to_string()
            .contains("invalid peer certificate: UnknownIssuer"),
        "{e}"
    );
    // No client certificate: refused by both servers.
    assert!(
        amqp::connect_with(
            &rabbit.url(),
            "no-cert",
            &with_ca(&pki, "amqp_tls", &pki.ca, false)?
        )
        .await
        .is_err(),
        "amqp without a client certificate"
    );
    let s = Store::with_tls(
        &redis_url,
        Names::new("x"),
        &with_ca(&pki, "redis_tls", &pki.ca, false)?,
    )?;
    assert!(
        s.query::<String>(&redis::cmd("PING")).await.is_err(),
        "redis without a client certificate"
    );
    // Plain AMQP on the TLS port gets nowhere either.
    assert!(
        amqp::connect(&rabbit.url().replace("amqps://", "amqp://"), "plain")
            .await
            .is_err()
    );
    // A wrong password for the ACL user is refused; the right one works.
    let s = Store::with_tls(
        &redis_url.replace(REDIS_USER_PASSWORD, "nope"),
        Names::new("x"),
        &client_redis,
    )?;
    assert!(s.query::<String>(&redis::cmd("PING")).await.is_err());
    let s = Store::with_tls(&redis_url, Names::new("x"), &client_redis)?;
    assert_eq!(s.query::<String>(&redis::cmd("PING")).await?, "PONG");
    let c = amqp::connect_with(&rabbit.url(), "ok", &client_amqp).await?;
    c.close(200, "bye".into()).await?;

    // The fleet over both, mutual TLS everywhere.
    let mut extra = pki.settings("amqp_tls", true);
    extra.extend(pki.settings("redis_tls", true));
    let ns = Ns::on(&rabbit.url(), &redis_url, "classic", &extra).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let worker = start_worker(&ns, "w-tls", "zone=tls", 4, &[], &[]).await?;
    // Through AMQP (the test's own TLS connection) and through the API.
    let envs: Vec<_> = (0..20)
        .map(|i| task("echo", json!({"n": i}), "zone=tls"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (20, 0));
    let r = reqwest::Client::new()
        .post(sched.url("/v1/tasks"))
        .json(&json!({"kind": "noop", "id": "via-api", "labels": {"zone": "tls"}}))
        .send()
        .await?;
    assert_eq!(r.status(), reqwest::StatusCode::ACCEPTED);
    for e in &envs {
        let st = ns
            .wait_state(&e.id, "succeeded", Duration::from_secs(60))
            .await?;
        assert_eq!(st.get("worker").map(String::as_str), Some("w-tls"));
    }
    ns.wait_state("via-api", "succeeded", Duration::from_secs(60))
        .await?;

    // fleetctl submit over the TLS-only broker. Without the FLEET_AMQP_TLS_* files the
    // broker's certificate (private CA) is not trusted: exit 1 with the reason, nothing sent.
    let url = rabbit.url();
    let base = [
        ("FLEET_AMQP_URL", url.as_str()),
        ("FLEET_NAMESPACE", ns.name.as_str()),
    ];
    let submit = [
        "submit",
        "--kind",
        "noop",
        "--labels",
        "zone=tls",
        "--count",
        "3",
        "--id",
        "via-fleetctl",
    ];
    let (code, out, err) = run_bin("fleetctl", &base, &submit).await?;
    assert_eq!(
        code, 1,
        "fleetctl without the TLS files: stdout {out} stderr {err}"
    );
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );
    // With them (CA + client certificate, the broker wants mutual TLS): accepted, and they run.
    let files = [
        ("FLEET_AMQP_TLS_CA_FILE", pki.ca.as_str()),
        ("FLEET_AMQP_TLS_CERT_FILE", pki.client_cert.as_str()),
        ("FLEET_AMQP_TLS_KEY_FILE", pki.client_key.as_str()),
    ];
    let env: Vec<(&str, &str)> = base.iter().chain(files.iter()).copied().collect();
    let (code, out, err) = run_bin("fleetctl", &env, &submit).await?;
    assert_eq!(
        code, 0,
        "fleetctl submit over TLS: stdout {out} stderr {err}"
    );
    assert_eq!(out.trim(), "accepted=3 refused=0", "{err}");
    for i in 1..=3 {
        let st = ns
            .wait_state(
                &format!("via-fleetctl-{i}"),
                "succeeded",
                Duration::from_secs(60),
            )
            .await?;
        assert_eq!(st.get("worker").map(String::as_str), Some("w-tls"));
    }

    worker.stop().await?;
    sched.stop().await?;
    ns.cleanup().await?;
    drop(rabbit);
    drop(redis);
    Ok(())
}

#[tokio::test]
async fn bad_tls_files_stop_start_up_naming_the_setting() -> Result<()> {
    let pki = Pki::new()?;
    let junk = pki.dir.write(
        "junk.pem",
        "-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n",
    )?;
    let empty = pki.dir.write("empty.pem", "just words\n")?;
    for bin in ["fleet-scheduler", "fleet-worker"] {
        for (key, value, says) in [
            (
                "FLEET_AMQP_TLS_CA_FILE",
                "/nonexistent/ca.pem",
                "cannot read",
            ),
            ("FLEET_REDIS_TLS_CA_FILE", junk.as_str(), "invalid PEM"),
            (
                "FLEET_AMQP_TLS_CERT_FILE",
                pki.client_cert.as_str(),
                "FLEET_AMQP_TLS_KEY_FILE",
            ),
            (
                "FLEET_REDIS_TLS_CA_FILE",
                empty.as_str(),
                "no PEM certificate",
            ),
        ] {
            let (code, err) = run_to_exit(bin, &[(key, value)]).await?;
            assert_eq!(code, 2, "{bin} {key}: {err}");
            assert!(
                err.contains(key) || err.contains(says),
                "{bin} {key}: {err}"
            );
            assert!(err.contains(says), "{bin} {key}: {err}");
        }
    }
    let (code, err) = run_to_exit(
        "fleet-worker",
        &[
            ("FLEET_EXECUTOR", "http"),
            ("FLEET_HTTP_URL", "https://localhost:1/x"),
            ("FLEET_HTTP_TLS_CA_FILE", junk.as_str()),
        ],
    )
    .await?;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("FLEET_HTTP_TLS_CA_FILE"), "{err}");
    Ok(())
}

/// An https endpoint with the test CA's server certificate: `/run` answers `{"ok": true}` and
/// counts calls; `/moved` redirects (307) to `/run`.
async fn https_endpoint(pki: &Pki, runs: Arc<AtomicU32>) -> Result<u16> {
    let acceptor = pki.server_acceptor()?;
    let app = Router::new()
        .route(
            "/run",
            post(move |Json(_): Json<Value>| {
                let runs = runs.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    Json(json!({"ok": true}))
                }
            }),
        )
        .route("/moved", post(|| async { Redirect::temporary("/run") }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, app) = (acceptor.clone(), app.clone());
            tokio::spawn(async move {
                if let Ok(tls) = acceptor.accept(stream).await {
                    let svc = hyper_util::service::TowerToHyperService::new(app);
                    // HTTP/1.1 only: the executor's reqwest client speaks nothing else, and
                    // the test build then needs no HTTP/2 the binaries lack (one build).
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                        .await;
                }
            });
        }
    });
    Ok(port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_executor_calls_https_endpoints_and_follows_no_redirects() -> Result<()> {
    let pki = Pki::new()?;
    let runs = Arc::new(AtomicU32::new(0));
    let port = https_endpoint(&pki, runs.clone()).await?;
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let run = format!("https://localhost:{port}/run");
    let moved = format!("https://localhost:{port}/moved");
    let no_eject = ("eject_error_ratio", "1");
    let mut workers = Vec::new();
    for (case, url, ca, follow) in [
        ("ok", &run, &pki.ca, "false"),
        ("wrongca", &run, &pki.other_ca, "false"),
        ("moved", &moved, &pki.ca, "false"),
        ("follow", &moved, &pki.ca, "true"),
    ] {
        let settings = [
            ("executor", "http"),
            ("http_url", url.as_str()),
            ("http_tls_ca_file", ca.as_str()),
            ("http_follow_redirects", follow),
            no_eject,
        ];
        workers.push(
            start_worker(
                &ns,
                &format!("w-https-{case}"),
                &format!("case={case}"),
                2,
                &settings,
                &[],
            )
            .await?,
        );
    }
    let job = |case: &str| {
        let mut t = task("call", json!({}), &format!("case={case}"));
        t.max_attempts = Some(1);
        t
    };
    let (ok, wrong, moved_t, follow_t) = (job("ok"), job("wrongca"), job("moved"), job("follow"));

    ns.submit(std::slice::from_ref(&ok)).await?;
    ns.wait_state(&ok.id, "succeeded", Duration::from_secs(60))
        .await?;
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    ns.submit(std::slice::from_ref(&wrong)).await?;
    let st = ns
        .wait_state(&wrong.id, "dead", Duration::from_secs(60))
        .await?;
    let err = st.get("error").cloned().unwrap_or_default();
    assert!(
        err.contains("invalid peer certificate: UnknownIssuer"),
        "{err}"
    );

    ns.submit(std::slice::from_ref(&moved_t)).await?;
    let st = ns
        .wait_state(&moved_t.id, "dead", Duration::from_secs(60))
        .await?;
    let err = st.get("error").cloned().unwrap_or_default();
    assert!(err.contains("307"), "{err}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "a redirect was followed with redirects off"
    );

    ns.submit(std::slice::from_ref(&follow_t)).await?;
    ns.wait_state(&follow_t.id, "succeeded", Duration::from_secs(60))
        .await?;
    assert_eq!(runs.load(Ordering::SeqCst), 2);

    for w in workers {
        w.stop().await?;
    }
    sched.stop().await?;
    ns.cleanup().await
}

/// A TLS listener on 127.0.0.1 presenting `pki`'s server certificate: it completes handshakes
/// (when the client accepts the certificate) and closes. Enough to see a client refuse it.
async fn tls_listener(pki: &Pki) -> Result<u16> {
    let acceptor = pki.server_acceptor()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let _ =
                    tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await;
            });
        }
    });
    Ok(port)
}

/// The error text of a certificate issued for another host name (rustls names the check).
fn is_name_mismatch(text: &str) -> bool {
    text.contains("NotValidForName") || text.contains("not valid for name")
}

/// Server names are verified: a certificate from the trusted CA but issued for
/// `other.example` is refused when fleet connects to `localhost` — by the AMQP client, the
/// Redis client and the http executor alike, each with an error that says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_for_another_host_name_is_refused() -> Result<()> {
    let pki = Pki::for_server_names(&["other.example"])?;
    let port = tls_listener(&pki).await?;
    let amqp_tls = tls(pki.settings("amqp_tls", false), "amqp_tls")?;
    let e = amqp::connect_with(
        &format!("amqps://guest:guest@localhost:{port}/%2f"),
        "mismatch",
        &amqp_tls,
    )
    .await
    .err()
    .context("a certificate for another name accepted by amqp")?;
    assert!(is_name_mismatch(&e.to_string()), "amqp: {e}");
    eprintln!("amqp, certificate for another name: {e}");
    let redis_tls = tls(pki.settings("redis_tls", false), "redis_tls")?;
    let s = Store::with_tls(
        &format!("rediss://localhost:{port}"),
        Names::new("x"),
        &redis_tls,
    )?;
    let e = s
        .query::<String>(&redis::cmd("PING"))
        .await
        .err()
        .context("a certificate for another name accepted by redis")?;
    assert!(is_name_mismatch(&e.to_string()), "redis: {e}");
    eprintln!("redis, certificate for another name: {e}");
    // The same CA's certificate for the right name is accepted (the CA is not the problem).
    let good = Pki::for_server_names(&["localhost"])?;
    let good_port = tls_listener(&good).await?;
    let e = amqp::connect_with(
        &format!("amqps://guest:guest@localhost:{good_port}/%2f"),
        "right-name",
        &tls(good.settings("amqp_tls", false), "amqp_tls")?,
    )
    .await
    .err()
    .context("the listener speaks no AMQP: the connection must fail after the handshake")?;
    assert!(
        !is_name_mismatch(&e.to_string()) && !e.to_string().contains("invalid peer certificate"),
        "right name: {e}"
    );

    // The http executor: the task dies with the reason.
    let runs = Arc::new(AtomicU32::new(0));
    let https_port = https_endpoint(&pki, runs.clone()).await?;
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let url = format!("https://localhost:{https_port}/run");
    let settings = [
        ("executor", "http"),
        ("http_url", url.as_str()),
        ("http_tls_ca_file", pki.ca.as_str()),
        ("eject_error_ratio", "1"),
    ];
    let worker = start_worker(&ns, "w-https-mismatch", "case=mismatch", 1, &settings, &[]).await?;
    let mut t = task("call", json!({}), "case=mismatch");
    t.max_attempts = Some(1);
    ns.submit(std::slice::from_ref(&t)).await?;
    let st = ns
        .wait_state(&t.id, "dead", Duration::from_secs(60))
        .await?;
    let err = st.get("error").cloned().unwrap_or_default();
    assert!(is_name_mismatch(&err), "http executor: {err}");
    eprintln!("http executor, certificate for another name: {err}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the endpoint must never be called"
    );
    worker.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
