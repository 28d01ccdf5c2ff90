//! API authentication: every endpoint of the scheduler and of the worker × no token / unknown
//! token / wrong role / right role → 401 / 401 / 403 / 2xx; health endpoints open; `/metrics`
//! behind `read` when asked; POST bodies other than JSON → 415; `fleetctl` sends
//! `FLEET_API_TOKEN`; a non-loopback bind without a token refuses to start (exit 2).

use std::time::Duration;

use anyhow::{ensure, Result};
use fleet_tests::*;
use reqwest::{Method, StatusCode};
use serde_json::json;

const ADMIN: &str = "admin-0123456789abcdef";
const READ: &str = "read-0123456789abcdef";
const SUBMIT: &str = "submit-0123456789abcdef";
/// Given through `FLEET_API_TOKENS_FILE`, not the setting.
const FILE_READ: &str = "file-read-0123456789abcdef";

async fn call(
    c: &reqwest::Client,
    method: Method,
    url: &str,
    token: Option<&str>,
    json_body: bool,
) -> Result<StatusCode> {
    let mut rq = c.request(method, url);
    if let Some(t) = token {
        rq = rq.bearer_auth(t);
    }
    if json_body {
        rq = rq.json(
            &json!({"kind": "noop", "id": format!("auth-{}", uuid::Uuid::new_v4().simple())}),
        );
    }
    Ok(rq.send().await?.status())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_endpoint_needs_its_role() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let dir = fleet_tests::servers::TempDir::new("tokens")?;
    let file = dir.write("tokens", &format!("# operators\n{FILE_READ} read\n"))?;
    let tokens = format!("{ADMIN} admin, {READ} read, {SUBMIT} submit");
    let auth: [(&str, &str); 3] = [
        ("api_tokens", &tokens),
        ("api_tokens_file", &file),
        ("metrics_auth", "read"),
    ];
    let sched = start_scheduler(&ns, &auth).await?;
    let worker = start_worker(&ns, "w-auth", "zone=a", 2, &auth, &[]).await?;
    let wurl = |p: &str| format!("http://{}{p}", worker.addr);
    let c = reqwest::Client::new();

    // (method, url, needed role's token, a token of another role, JSON body?)
    let cases: Vec<(Method, String, &str, &str, bool)> = vec![
        (Method::POST, sched.url("/v1/tasks"), SUBMIT, READ, true),
        (
            Method::GET,
            sched.url("/v1/tasks/whatever"),
            READ,
            SUBMIT,
            false,
        ),
        (Method::GET, sched.url("/v1/workers"), READ, SUBMIT, false),
        (Method::GET, sched.url("/v1/groups"), READ, SUBMIT, false),
        (Method::GET, sched.url("/v1/pressure"), READ, SUBMIT, false),
        (Method::GET, sched.url("/metrics"), READ, SUBMIT, false),
        (
            Method::POST,
            sched.url("/v1/workers/no-such-worker/drain"),
            ADMIN,
            READ,
            true,
        ),
        (Method::GET, wurl("/status"), READ, SUBMIT, false),
        (Method::GET, wurl("/metrics"), READ, SUBMIT, false),
        // The console's and the operator's routes (landed beside the first ones).
        (Method::GET, sched.url("/v1/series"), READ, SUBMIT, false),
        (Method::GET, sched.url("/v1/dead"), READ, SUBMIT, false),
        (
            Method::GET,
            sched.url("/v1/dead/no-such-letter"),
            READ,
            SUBMIT,
            false,
        ),
        (
            Method::POST,
            sched.url("/v1/dead/replay"),
            ADMIN,
            READ,
            true,
        ),
        (Method::GET, sched.url("/v1/schedules"), READ, SUBMIT, false),
        // The task list (same path as submit, another method and role) and bulk actions.
        (Method::GET, sched.url("/v1/tasks"), READ, SUBMIT, false),
        (Method::POST, sched.url("/v1/tasks/bulk"), ADMIN, READ, true),
        (
            Method::POST,
            sched.url("/v1/schedules/no-such-schedule/pause"),
            ADMIN,
            READ,
            true,
        ),
    ];
    for (m, url, right, wrong, body) in &cases {
        let what = format!("{m} {url}");
        assert_eq!(
            call(&c, m.clone(), url, None, *body).await?,
            StatusCode::UNAUTHORIZED,
            "{what} without a token"
        );
        if *m == Method::POST {
            // The token is checked before the content type: a body-less POST without one
            // is told to authenticate (401), not what to send (415).
            assert_eq!(
                call(&c, m.clone(), url, None, false).await?,
                StatusCode::UNAUTHORIZED,
                "{what} without a token or a body"
            );
        }
        assert_eq!(
            call(
                &c,
                m.clone(),
                url,
                Some("not-a-configured-token-at-all"),
                *body
            )
            .await?,
            StatusCode::UNAUTHORIZED,
            "{what} unknown token"
        );
        assert_eq!(
            call(&c, m.clone(), url, Some(wrong), *body).await?,
            StatusCode::FORBIDDEN,
            "{what} wrong role"
        );
        let ok = call(&c, m.clone(), url, Some(right), *body).await?;
        // Authorised: the handler answers (an unknown task or worker is its 404, not ours).
        if url.contains("whatever") || url.contains("no-such-") {
            assert_eq!(ok, StatusCode::NOT_FOUND, "{what} right role");
        } else if url.ends_with("/replay") || url.ends_with("/bulk") {
            // A noop envelope is no replay request: the handler's own 400, past the guard.
            assert!(
                ok != StatusCode::UNAUTHORIZED
                    && ok != StatusCode::FORBIDDEN
                    && ok != StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "{what} right role: {ok}"
            );
        } else {
            assert!(ok.is_success(), "{what} right role: {ok}");
        }
        // admin implies read and submit.
        let as_admin = call(&c, m.clone(), url, Some(ADMIN), *body).await?;
        assert_eq!(as_admin, ok, "{what} as admin");
    }
    // The token from the file works like the others.
    assert_eq!(
        call(
            &c,
            Method::GET,
            &sched.url("/v1/workers"),
            Some(FILE_READ),
            false
        )
        .await?,
        StatusCode::OK
    );
    // A submit token cannot read; a read token cannot submit.
    let r = c
        .get(sched.url("/v1/workers"))
        .bearer_auth(SUBMIT)
        .send()
        .await?;
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["error"], "forbidden");
    // A 401 says how to authenticate.
    let r = c.get(sched.url("/v1/workers")).send().await?;
    assert_eq!(
        r.headers()
            .get("www-authenticate")
            .and_then(|v| v.to_str().ok()),
        Some("Bearer")
    );

    // Health is open on both.
    for url in [
        sched.url("/healthz"),
        sched.url("/readyz"),
        wurl("/healthz"),
        wurl("/readyz"),
    ] {
        assert_eq!(c.get(&url).send().await?.status(), StatusCode::OK, "{url}");
    }

    // Only JSON on POST: text/plain (what a cross-site form or no-cors fetch sends) and a
    // missing content type are 415 even with the right token; nothing is submitted.
    let plain = c
        .post(sched.url("/v1/tasks"))
        .bearer_auth(SUBMIT)
        .header("content-type", "text/plain")
        .body(r#"{"kind":"noop","id":"plain-1"}"#)
        .send()
        .await?;
    assert_eq!(plain.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let bare = c
        .post(sched.url("/v1/tasks"))
        .bearer_auth(SUBMIT)
        .body(r#"{"kind":"noop","id":"plain-2"}"#)
        .send()
        .await?;
    assert_eq!(bare.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let form = c
        .post(wurl("/drain"))
        .bearer_auth(ADMIN)
        .header("content-type", "application/x-www-form-urlencoded")
        .body("a=b")
        .send()
        .await?;
    assert_eq!(form.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // The worker's drain, body-less and without a token: 401 before 415.
    let bare = c.post(wurl("/drain")).send().await?;
    assert_eq!(bare.status(), StatusCode::UNAUTHORIZED);
    // A JSON submit goes through and runs; the refused ones never existed.
    let r = c
        .post(sched.url("/v1/tasks"))
        .bearer_auth(SUBMIT)
        .json(&json!({"kind": "noop", "id": "json-1"}))
        .send()
        .await?;
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    wait_for("json-1 succeeded", Duration::from_secs(30), || async {
        ns.status("json-1")
            .await
            .ok()
            .flatten()
            .filter(|s| s.get("state").map(String::as_str) == Some("succeeded"))
    })
    .await?;
    assert!(ns.status("plain-1").await?.is_none() && ns.status("plain-2").await?.is_none());

    // fleetctl: the read token from FLEET_API_TOKEN lists the worker; without it, a 401.
    let api = sched.url("");
    let fleetctl = |token: Option<&'static str>, args: &'static [&'static str]| {
        let (ns, api) = (&ns, api.clone());
        async move {
            let env: Vec<(&str, &str)> =
                token.map(|t| ("FLEET_API_TOKEN", t)).into_iter().collect();
            fleetctl_with(ns, &api, &env, args).await
        }
    };

    let (code, out, err) = fleetctl(Some(READ), &["workers"]).await?;
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("w-auth"), "{out}");
    let (code, _, err) = fleetctl(None, &["workers"]).await?;
    assert_ne!(code, 0);
    assert!(err.contains("401"), "{err}");
    let (code, _, err) = fleetctl(Some(READ), &["drain", "w-auth"]).await?;
    assert_ne!(code, 0);
    assert!(err.contains("403") && !err.contains(READ), "{err}");

    // Drain with admin: through the scheduler (fleetctl), then the worker's own endpoint.
    let (code, out, err) = fleetctl(Some(ADMIN), &["drain", "w-auth"]).await?;
    assert_eq!(code, 0, "stderr: {err}");
    assert!(out.contains("draining"), "{out}");
    assert_eq!(
        call(&c, Method::POST, &wurl("/drain"), None, true).await?,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(
        call(&c, Method::POST, &wurl("/drain"), Some(READ), true).await?,
        StatusCode::FORBIDDEN
    );
    assert_eq!(
        call(&c, Method::POST, &wurl("/drain"), Some(ADMIN), true).await?,
        StatusCode::ACCEPTED
    );

    worker.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test]
async fn open_api_on_a_public_address_refuses_to_start() -> Result<()> {
    for bin in ["fleet-scheduler", "fleet-worker"] {
        let (code, err) = run_to_exit(bin, &[("FLEET_HTTP_ADDR", "0.0.0.0:0")]).await?;
        assert_eq!(code, 2, "{bin}: {err}");
        ensure!(
            err.contains("FLEET_API_TOKENS") && err.contains("FLEET_ALLOW_UNAUTHENTICATED"),
            "{bin}: {err}"
        );
        // A malformed token entry names the setting and never echoes the token.
        let (code, err) = run_to_exit(
            bin,
            &[("FLEET_API_TOKENS", "sekrit-sekrit-sekrit superuser")],
        )
        .await?;
        assert_eq!(code, 2, "{bin}: {err}");
        ensure!(
            err.contains("FLEET_API_TOKENS") && !err.contains("sekrit"),
            "{bin}: {err}"
        );
    }
    Ok(())
}

/// Issue 30 item 10: a DNS-rebinding page. An open API (no tokens, loopback, the default)
/// answered a drain sent with `Host: rebind.example:PORT` and a same-host `Origin` (what the
/// browser sends once the attacker's name points at 127.0.0.1) with 202. Now a `Host` that is
/// not `localhost`, an IP address or a name of `FLEET_API_ALLOWED_HOSTS` gets 421, on the
/// scheduler's API and console and on the worker's `/status` and `/drain`; health endpoints
/// stay open; the named hosts are answered as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_api_answers_only_its_own_host_names() -> Result<()> {
    let ns = Ns::new().await?;
    let allowed = [("api_allowed_hosts", "fleet.test")];
    let sched = start_scheduler(&ns, &allowed).await?;
    let w1 = start_worker(&ns, "w-rebind", "zone=a", 1, &allowed, &[]).await?;
    let c = reqwest::Client::new();
    let sched_port = sched.addr.port();
    let worker_port = w1.addr.port();

    let send = |method: Method, url: String, host: String| {
        let c = c.clone();
        async move {
            let origin = format!("http://{host}");
            let rq = c
                .request(method.clone(), url)
                .header(reqwest::header::HOST, host)
                .header(reqwest::header::ORIGIN, origin);
            let rq = if method == Method::POST {
                rq.json(&json!({}))
            } else {
                rq
            };
            let r = rq.send().await?;
            let status = r.status();
            let body = r.text().await.unwrap_or_default();
            anyhow::Ok((status, body))
        }
    };
    let wurl = |p: &str| format!("http://{}{p}", w1.addr);

    // The rebinding page: refused everywhere that acts or reads.
    for (method, url, port) in [
        (
            Method::POST,
            sched.url("/v1/workers/w-rebind/drain"),
            sched_port,
        ),
        (Method::GET, sched.url("/v1/workers"), sched_port),
        (Method::GET, sched.url("/ui"), sched_port),
        (Method::POST, wurl("/drain"), worker_port),
        (Method::GET, wurl("/status"), worker_port),
    ] {
        for host in [
            format!("rebind.example:{port}"),
            format!("fleet.test.rebind.example:{port}"),
        ] {
            let (status, body) = send(method.clone(), url.clone(), host.clone()).await?;
            assert_eq!(
                status,
                StatusCode::MISDIRECTED_REQUEST,
                "{method} {url} Host {host}: {body}"
            );
            ensure!(
                body.contains("FLEET_API_ALLOWED_HOSTS"),
                "the refusal names the setting: {body}"
            );
        }
    }
    let w = worker(&ns.store, "w-rebind").await;
    assert_eq!(
        w.map(|w| w.state).as_deref(),
        Some("active"),
        "the refused drains drained nothing"
    );
    // Health stays open whatever the Host.
    let (status, _) = send(
        Method::GET,
        wurl("/healthz"),
        format!("rebind.example:{worker_port}"),
    )
    .await?;
    assert_eq!(status, StatusCode::OK);

    // Its own names: localhost, loopback addresses, the configured name.
    for (url, port) in [
        (sched.url("/v1/workers"), sched_port),
        (wurl("/status"), worker_port),
    ] {
        for host in [
            format!("localhost:{port}"),
            format!("127.0.0.1:{port}"),
            format!("[::1]:{port}"),
            format!("fleet.test:{port}"),
            format!("FLEET.TEST:{port}"),
        ] {
            let (status, body) = send(Method::GET, url.clone(), host.clone()).await?;
            assert_eq!(status, StatusCode::OK, "GET {url} Host {host}: {body}");
        }
    }
    let (status, body) = send(
        Method::POST,
        sched.url("/v1/workers/w-rebind/drain"),
        format!("fleet.test:{sched_port}"),
    )
    .await?;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    w1.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
