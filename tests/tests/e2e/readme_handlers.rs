//! README's handlers run verbatim (issue 29 item 2): the Python and shell exec handlers and the
//! Python http handler are taken from README.md by their `<!-- readme-handler: NAME -->`
//! markers (the fenced block right after each), written to files and run through a worker of
//! their executor, so the documented contract and the code cannot drift apart: stdout (or the
//! 2xx body) is the result, exit 65 (or a 4xx) is dead at once, any other non-zero exit is
//! retried, and the `FLEET_TASK_*` variables and `x-fleet-*` headers carry what README says.

use std::path::{Path, PathBuf};
use std::time::Duration;

use fleet_tests::*;
use serde_json::{json, Value};

/// The fenced code block after `<!-- readme-handler: NAME -->` in README.md.
fn readme_handler(name: &str) -> anyhow::Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(&path)?;
    let marker = format!("<!-- readme-handler: {name} -->");
    let at = readme
        .find(&marker)
        .ok_or_else(|| anyhow::anyhow!("README.md has no {marker}"))?;
    let rest = &readme[at + marker.len()..];
    let open = rest
        .find("```")
        .ok_or_else(|| anyhow::anyhow!("no code block after {marker}"))?;
    let body_at = open
        + rest[open..]
            .find('\n')
            .ok_or_else(|| anyhow::anyhow!("unterminated fence after {marker}"))?
        + 1;
    let close = rest[body_at..]
        .find("\n```")
        .ok_or_else(|| anyhow::anyhow!("unterminated code block after {marker}"))?;
    anyhow::ensure!(
        rest[..open].trim().is_empty(),
        "{marker} must be followed directly by its code block"
    );
    Ok(format!("{}\n", &rest[body_at..body_at + close]))
}

/// README's handler `name` written to a file of this test's own.
fn handler_file(ns: &Ns, name: &str, ext: &str) -> anyhow::Result<PathBuf> {
    let path = std::env::temp_dir().join(format!("fleet-{}-{name}.{ext}", ns.name));
    std::fs::write(&path, readme_handler(name)?)?;
    Ok(path)
}

fn status_json(st: &std::collections::BTreeMap<String, String>) -> anyhow::Result<Value> {
    let r = st
        .get("result")
        .ok_or_else(|| anyhow::anyhow!("no result: {st:?}"))?;
    Ok(serde_json::from_str(r)?)
}

/// An exec worker's settings: README's command and kinds, fast retries.
fn exec<'a>(command: &'a str, kinds: &'a str) -> Vec<(&'a str, &'a str)> {
    vec![
        ("executor", "exec"),
        ("exec_command", command),
        ("kinds", kinds),
        ("retry_base_ms", "50"),
        ("retry_cap_ms", "200"),
        NO_EJECT,
    ]
}

fn field<'a>(st: &'a std::collections::BTreeMap<String, String>, k: &str) -> Option<&'a str> {
    st.get(k).map(String::as_str)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_exec_handlers_run_as_documented() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let py = handler_file(&ns, "exec-python", "py")?;
    let sh = handler_file(&ns, "exec-shell", "sh")?;
    let py_cmd = serde_json::to_string(&["python3", py.to_string_lossy().as_ref()])?;
    let sh_cmd = serde_json::to_string(&["sh", sh.to_string_lossy().as_ref()])?;
    // Configured as README says: each worker declares the kind its handler serves.
    let w_py = start_worker(&ns, "w-py", "lang=py", 2, &exec(&py_cmd, "resize"), &[]).await?;
    let w_sh = start_worker(&ns, "w-sh", "lang=sh", 2, &exec(&sh_cmd, "thumbnail"), &[]).await?;

    let ok = task("resize", json!({"img": "b.png"}), "");
    let bad = task("resize", json!({"width": 3}), "");
    let mut flaky = task(
        "resize",
        json!({"img": "c.png", "flaky": true, "width": 64}),
        "",
    );
    flaky.max_attempts = Some(3);
    let thumb = task("thumbnail", json!({"img": "d.png"}), "");
    assert_eq!(
        ns.submit(&[ok.clone(), bad.clone(), flaky.clone(), thumb.clone()])
            .await?,
        (4, 0)
    );

    // stdout is the result (JSON), on the worker that declared the kind.
    let st = ns
        .wait_state(&ok.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        (field(&st, "worker"), field(&st, "attempt")),
        (Some("w-py"), Some("1"))
    );
    assert_eq!(
        status_json(&st)?,
        json!({"img": "b.png", "width": 128, "attempt": 1})
    );
    // Exit 65: dead at once with stderr in the error.
    let st = ns
        .wait_state(&bad.id, "dead", Duration::from_secs(20))
        .await?;
    assert_eq!(
        (field(&st, "reason"), field(&st, "attempt")),
        (Some("permanent_error"), Some("1")),
        "{st:?}"
    );
    assert_eq!(
        field(&st, "error"),
        Some("exec: `python3` exited with 65: payload needs an img")
    );
    // Exit 1: retried; the second attempt succeeds and says so.
    let st = ns
        .wait_state(&flaky.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(field(&st, "attempt"), Some("2"), "{st:?}");
    assert_eq!(
        status_json(&st)?,
        json!({"img": "c.png", "width": 64, "attempt": 2})
    );
    // The shell handler: FLEET_TASK_ID and FLEET_TASK_ATTEMPT from the environment, the
    // envelope on stdin.
    let st = ns
        .wait_state(&thumb.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(field(&st, "worker"), Some("w-sh"), "{st:?}");
    let r = status_json(&st)?;
    assert_eq!((&r["task"], &r["attempt"]), (&json!(thumb.id), &json!(1)));
    let stdin_bytes = r["input_bytes"].as_u64().unwrap_or(0);
    assert!(
        stdin_bytes > thumb.to_bytes().len() as u64 / 2,
        "the envelope was on stdin: {r}"
    );

    w_sh.stop().await?;
    w_py.stop().await?;
    sched.stop().await?;
    for f in [&py, &sh] {
        let _ = std::fs::remove_file(f);
    }
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_http_handler_runs_as_documented() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let server = handler_file(&ns, "http-python", "py")?;
    let port = free_port()?;
    let mut child = tokio::process::Command::new("python3")
        .arg(&server)
        .env("PORT", port.to_string())
        .kill_on_drop(true)
        .spawn()?;
    wait_for(
        "the README's http handler listening",
        Duration::from_secs(20),
        || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        },
    )
    .await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let url = format!("http://127.0.0.1:{port}/");
    let w = start_worker(
        &ns,
        "w-http",
        "lang=http",
        2,
        &[
            ("executor", "http"),
            ("http_url", url.as_str()),
            ("kinds", "greet"),
            NO_EJECT,
        ],
        &[],
    )
    .await?;

    let ok = task("greet", json!({"name": "fleet"}), "");
    let bad = task("greet", json!({}), "");
    assert_eq!(ns.submit(&[ok.clone(), bad.clone()]).await?, (2, 0));
    let st = ns
        .wait_state(&ok.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(field(&st, "worker"), Some("w-http"), "{st:?}");
    assert_eq!(
        status_json(&st)?,
        json!({"greeting": "hello fleet", "attempt": 1}),
        "the 2xx body is the result; x-fleet-attempt carried the attempt"
    );
    let st = ns
        .wait_state(&bad.id, "dead", Duration::from_secs(20))
        .await?;
    assert_eq!(
        (field(&st, "reason"), field(&st, "attempt")),
        (Some("permanent_error"), Some("1")),
        "a 4xx is dead at once: {st:?}"
    );
    assert_eq!(
        field(&st, "error"),
        Some(r#"http: 400 Bad Request: {"error": "want kind greet with a payload name"}"#)
    );

    w.stop().await?;
    sched.stop().await?;
    let _ = child.kill().await;
    let _ = std::fs::remove_file(&server);
    ns.cleanup().await
}

/// The limits README's handler contract states are the code's.
#[test]
fn the_readme_limits_are_the_codes() -> anyhow::Result<()> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    let readme = std::fs::read_to_string(path)?.replace('\n', " ");
    let readme = readme.split_whitespace().collect::<Vec<_>>().join(" ");
    let status_text = format!(
        "keeps the first {} bytes of the result or the error text",
        fleet::status::MAX_STATUS_TEXT
    );
    assert!(readme.contains(&status_text), "README says: {status_text}");
    assert_eq!(fleet_worker::executor::http::MAX_BODY, 1 << 20);
    assert!(readme.contains("at most 1 MiB is read"));
    Ok(())
}
