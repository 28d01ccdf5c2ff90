//! Prometheus pages and JSON documents of a scheduler or worker, read over HTTP.

use std::time::Duration;

use anyhow::Result;

use crate::wait_for;

/// Sum of a counter/gauge in a Prometheus text page over the series whose labels contain
/// every `k="v"` given.
pub fn metric_sum(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.starts_with(name)
                && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The harness's one HTTP client (connection pool and TLS roots loaded once): `reqwest::get`
/// builds a client per call, which reads every system root certificate each time — enough
/// CPU, at a poll every 100 ms, to show in the benchmark's figures.
pub fn http() -> &'static reqwest::Client {
    static CLIENT: std::sync::OnceLock<reqwest::Client> = std::sync::OnceLock::new();
    // Every request bounded (30 s): a component that stops answering fails the test that asked.
    CLIENT.get_or_init(|| {
        reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()
            .unwrap_or_default()
    })
}

/// GETs a JSON document.
pub async fn get_json(url: &str) -> Result<serde_json::Value> {
    Ok(http()
        .get(url)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

/// The Prometheus page of a scheduler or worker (`http://addr`).
pub async fn metrics_page(base: &str) -> Result<String> {
    Ok(http()
        .get(format!("{base}/metrics"))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?)
}

/// `fleet_tasks_completed_total` of one group's normal lane and outcome, in this process.
pub async fn completed(base: &str, group: &str, outcome: &str) -> Result<u64> {
    let page = metrics_page(base).await?;
    Ok(metric_sum(
        &page,
        "fleet_tasks_completed_total",
        &[("group", group), ("lane", "normal"), ("outcome", outcome)],
    ) as u64)
}

/// Waits until `completed(base, group, outcome)` reaches `n` (counters are bumped just after
/// the status is written), then returns its value, so callers can assert it is exactly `n`.
pub async fn completed_at_least(base: &str, group: &str, outcome: &str, n: u64) -> Result<u64> {
    let _ = wait_for(
        &format!("{n} {outcome} in {group}"),
        Duration::from_secs(10),
        || async move {
            completed(base, group, outcome)
                .await
                .ok()
                .filter(|v| *v >= n)
        },
    )
    .await;
    completed(base, group, outcome).await
}

/// A counter or gauge from a `/metrics` page.
pub async fn metric(url: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
    let page = http().get(url).send().await?.text().await?;
    Ok(metric_sum(&page, name, labels))
}
