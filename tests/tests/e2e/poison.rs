//! A poison task (issue 10 §3): an exec worker process (capacity 4) whose program kills the
//! worker process for one payload, `max_attempts` 2, beside 3 innocent 2 s tasks, the worker
//! restarted (same id) whenever it dies. The poison runs exactly twice and ends `dead` with
//! reason `worker_lost` (status and dead letter); the innocents (`max_attempts` 1) are not charged
//! for it: each succeeds, with at most the one lost attempt of the crash it ran beside.

use std::collections::HashMap;
use std::time::Duration;

use fleet_tests::*;
use serde_json::{json, Value};

const SCRIPT: &str = r#"cat >/dev/null
echo "$FLEET_TASK_ID" >> "$RUNS_FILE"
case "$FLEET_TASK_KIND" in
  poison) kill -9 "$PPID"; sleep 10 ;;
  innocent) sleep 2; echo ok ;;
esac"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_runs_max_attempts_times_and_spares_the_innocent() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs_file = std::env::temp_dir().join(format!("fleet-{}-runs.txt", ns.name));
    let script = SCRIPT.replace("$RUNS_FILE", &runs_file.display().to_string());
    let argv = serde_json::to_string(&["sh", "-c", script.as_str()])?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let extra: &[(&str, &str)] = &[("executor", "exec"), ("exec_command", argv.as_str())];
    let spec = ProcessSpec {
        id: "w-exec",
        labels: "",
        capacity: 4,
        endpoint: "http://127.0.0.1:9/unused",
        extra,
    };
    let w = WorkerProcess::start(&ns, &spec).await?;

    let mut poison = task("poison", json!({}), "");
    poison.max_attempts = Some(2);
    // One attempt each: an innocent charged for the poison's crash would be dead at once.
    let innocents: Vec<fleet::Envelope> = (0..3)
        .map(|i| {
            let mut t = task("innocent", json!({"i": i}), "");
            t.max_attempts = Some(1);
            t
        })
        .collect();
    let innocent_ids: Vec<String> = innocents.iter().map(|e| e.id.clone()).collect();
    let mut all = innocents.clone();
    all.push(poison.clone());
    assert_eq!(ns.submit(&all).await?, (4, 0));

    // Restart the worker (same id) whenever it dies, until every task has its final state.
    let w = std::sync::Mutex::new(w);
    let restarts = std::sync::atomic::AtomicUsize::new(0);
    let settled = wait_for(
        "the poison dead and every innocent succeeded",
        Duration::from_secs(120),
        || async {
            let mut done = ns.state_of(&poison.id).await.as_deref() == Some("dead");
            for id in &innocent_ids {
                done &= ns.state_of(id).await.as_deref() == Some("succeeded");
            }
            if done {
                return Some(());
            }
            let mut w = w.lock().ok()?;
            if w.child.try_wait().ok()?.is_some() {
                restarts.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                *w = WorkerProcess::spawn(&ns, &spec).ok()?;
            }
            None
        },
    )
    .await;
    let mut w = w
        .into_inner()
        .map_err(|_| anyhow::anyhow!("worker lock poisoned"))?;
    let restarts = restarts.into_inner();
    if let Err(e) = settled {
        let p = ns.status(&poison.id).await?.unwrap_or_default();
        return Err(e.context(format!(
            "after {restarts} restarts; poison {p:?}; log:\n{}",
            w.log_tail()
        )));
    }

    let text = std::fs::read_to_string(&runs_file).unwrap_or_default();
    let _ = std::fs::remove_file(&runs_file);
    let mut runs: HashMap<&str, usize> = HashMap::new();
    for l in text.lines() {
        *runs.entry(l.trim()).or_default() += 1;
    }
    let st = ns.status(&poison.id).await?.unwrap_or_default();
    println!(
        "poison: ran {} times, {restarts} worker restarts, status {:?}/{:?}; innocents ran {:?} times",
        runs.get(poison.id.as_str()).copied().unwrap_or(0),
        st.get("state"),
        st.get("reason"),
        innocent_ids.iter().map(|i| runs.get(i.as_str()).copied().unwrap_or(0)).collect::<Vec<_>>()
    );
    assert_eq!(
        runs.get(poison.id.as_str()).copied(),
        Some(2),
        "the poison runs exactly max_attempts times"
    );
    assert_eq!(
        restarts, 2,
        "each run of the poison killed the worker once, nothing else did"
    );
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("worker_lost"),
        "{st:?}"
    );
    // The attempt log names both lost attempts of the poison (once each, whichever of the
    // re-registration and the next claim noticed the loss); an innocent's runs that died beside
    // it are lost attempts too, and its last attempt succeeded.
    let shape = |log: Vec<Value>| {
        log.iter()
            .map(|a| {
                format!(
                    "{}:{}:{}:{}",
                    a["attempt"],
                    a["outcome"].as_str().unwrap_or(""),
                    a["reason"].as_str().unwrap_or(""),
                    a["worker"].as_str().unwrap_or("")
                )
            })
            .collect::<Vec<_>>()
    };
    let log = shape(ns.store.task_attempts(&poison.id).await?);
    assert_eq!(
        log,
        vec!["1:lost:worker_lost:w-exec", "2:lost:worker_lost:w-exec"],
        "poison attempt log"
    );
    // Innocents are not charged for the poison: with max_attempts 1 each one succeeds — never
    // dead — and its attempt log is exactly one of two stories: it ran once and succeeded
    // (the crash came before it was claimed), or it was claimed when the worker died beside
    // the poison (one `lost` entry, the crash counted for every task in flight since it cannot
    // say which one caused it) and then ran once more, alone, and succeeded. Never a second
    // lost entry: a suspect runs isolated, so the poison's second crash is charged to it alone.
    let once = vec!["1:succeeded::w-exec".to_string()];
    let beside = vec![
        "1:lost:worker_lost:w-exec".to_string(),
        "2:succeeded::w-exec".to_string(),
    ];
    for id in &innocent_ids {
        let n = runs.get(id.as_str()).copied().unwrap_or(0);
        let log = shape(ns.store.task_attempts(id).await?);
        let st = ns.status(id).await?.unwrap_or_default();
        assert_eq!(
            st.get("state").map(String::as_str),
            Some("succeeded"),
            "innocent {id}: {st:?}"
        );
        if log == once {
            assert_eq!(n, 1, "innocent {id} ran {n} times; attempt log {log:?}");
        } else {
            assert_eq!(log, beside, "innocent {id} ran {n} times");
            // Its first run may have been claimed and not yet started when the worker died.
            assert!(
                n == 1 || n == 2,
                "innocent {id} ran {n} times; attempt log {log:?}"
            );
        }
    }
    let dead = wait_for(
        "the poison dead-lettered",
        Duration::from_secs(15),
        || async {
            let d = ns.drain_dead().await.ok()?;
            (!d.is_empty()).then_some(d)
        },
    )
    .await?;
    assert_eq!(dead.len(), 1, "only the poison is dead-lettered");
    let id = serde_json::from_slice::<Value>(&dead[0].0)?
        .get("id")
        .and_then(Value::as_str)
        .map(str::to_string);
    assert_eq!(id.as_deref(), Some(poison.id.as_str()));
    assert_eq!(dead[0].1.as_deref(), Some("worker_lost"));

    w.signal("TERM")?;
    w.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}
