//! Workers whose clocks are 60 s behind and 60 s ahead (issue 10 §9), through libfaketime
//! (`LD_PRELOAD` of Debian's `faketime` package; `ops/services.sh` installs it). fleet uses the
//! Redis server's clock for heartbeats, leases, eviction and deadlines, so each keeps its
//! registration (registered once, never evicted, over many heartbeat intervals), runs 5 tasks
//! with `timeout_ms` 30000 that all succeed, and reports its skew in
//! `fleet_clock_skew_seconds` (≈ -60 and ≈ +60).

use std::time::{Duration, Instant};

use fleet_tests::*;

const LIBFAKETIME: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_60_s_off_keep_registration_and_run_tasks() -> anyhow::Result<()> {
    own_process!();
    let lib = LIBFAKETIME
        .iter()
        .find(|p| std::path::Path::new(p).exists())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "libfaketime not found (apt-get install faketime; ops/services.sh does)"
            )
        })?;
    let ns = Ns::new().await?;
    let ep = Endpoint::start(50).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut workers = Vec::new();
    for (id, offset) in [("w-behind", "-60"), ("w-ahead", "+60")] {
        let port = free_port()?.to_string();
        let labels = format!("clock={}", &id[2..]);
        let addr = format!("127.0.0.1:{port}");
        let extra: &[(&str, &str)] = &[("http_addr", addr.as_str())];
        let spec = ProcessSpec {
            id,
            labels: &labels,
            capacity: 2,
            endpoint: &ep.url,
            extra,
        };
        // Wall clock shifted; the monotonic clock (tokio's timers) left alone.
        let env = [
            ("LD_PRELOAD", *lib),
            ("FAKETIME", offset),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ];
        workers.push((
            WorkerProcess::spawn_with_env(&ns, &spec, &env)?,
            port,
            offset,
        ));
    }
    for (w, _, _) in workers.iter_mut() {
        w.wait_state(&ns.store, "active", Duration::from_secs(30))
            .await?;
    }

    // Watch the registry over 10 heartbeat intervals: both present and fresh at every look.
    let watch = Duration::from_millis(10 * HEARTBEAT_MS);
    let start = Instant::now();
    let worst = std::sync::atomic::AtomicI64::new(0);
    let looks = always_for(
        "both workers in the registry",
        watch,
        Duration::from_millis(50),
        || async {
            let ws = ns.store.workers().await?;
            for (w, _, _) in &workers {
                let v = ws.iter().find(|v| v.id == w.id).ok_or_else(|| {
                    anyhow::anyhow!(
                        "{} missing from the registry after {:?}; log:\n{}",
                        w.id,
                        start.elapsed(),
                        w.log_tail()
                    )
                })?;
                worst.fetch_max(
                    v.last_heartbeat_ms_ago,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
            anyhow::Ok(())
        },
    )
    .await?;
    let worst_age = worst.into_inner();

    // Five tasks for each, 30 s timeout each.
    let mut ids = Vec::new();
    for (w, _, _) in &workers {
        let mut envs = jobs(5, &format!("clock={}", &w.id[2..]), None);
        for e in envs.iter_mut() {
            e.timeout_ms = Some(30_000);
        }
        ids.extend(envs.iter().map(|e| e.id.clone()));
        assert_eq!(ns.submit(&envs).await?, (5, 0));
    }
    wait_succeeded(&ns, &ids, Duration::from_secs(60)).await?;

    let evictions = metric(&sched.url("/metrics"), "fleet_worker_evictions_total", &[]).await?;
    for (w, port, offset) in &workers {
        let skew = metric(
            &format!("http://127.0.0.1:{port}/metrics"),
            "fleet_clock_skew_seconds",
            &[],
        )
        .await?;
        let log = std::fs::read_to_string(&w.log).unwrap_or_default();
        let registered = log.matches(" registered").count();
        let lost = log.matches("registration lost").count();
        let ran = ep.calls_of(&w.id).len();
        println!(
            "clock {offset} s: {} registered {registered}x, registration lost {lost}x over {looks} looks in {:.1} s (worst heartbeat age {worst_age} ms); \
             ran {ran} of 5 (timeout_ms 30000), all succeeded; fleet_clock_skew_seconds {skew:.2}",
            w.id,
            watch.as_secs_f64()
        );
        assert_eq!(
            registered,
            1,
            "{} registered once; log:\n{}",
            w.id,
            w.log_tail()
        );
        assert_eq!(lost, 0, "{} never lost its registration", w.id);
        assert_eq!(ran, 5, "{} ran its 5 tasks once each", w.id);
        let want: f64 = offset.parse()?;
        assert!(
            (skew - want).abs() < 3.0,
            "{}: skew {skew} s, expected about {want} s",
            w.id
        );
    }
    assert_eq!(evictions, 0.0, "no worker evicted");
    assert!(
        worst_age < 1500,
        "heartbeats stayed fresh by Redis time: worst age {worst_age} ms"
    );

    for (w, _, _) in workers.iter_mut() {
        w.signal("TERM")?;
        w.wait_exit(Duration::from_secs(30)).await?;
    }
    sched.stop().await?;
    ns.cleanup().await
}
