//! Black-box probes: every `probe_interval` the scheduler sends a `noop` task straight into
//! each live group's critical queue and waits for its status to turn `succeeded`. The round
//! trip goes to `fleet_probe_seconds{group}`; a probe not back within `probe_timeout` counts in
//! `fleet_probe_failures_total{group}` and marks the group in `GET /v1/groups`. Probes use the
//! critical lane, so they keep flowing (and keep telling the truth) while the normal lane is
//! saturated.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use fleet::process::Ticker;
use fleet::{broker::amqp, metrics as m, Envelope, Lane};
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

use crate::session::Session;
use crate::view::ViewRx;

/// How often a probe's task status is read while it waits for `succeeded`.
const STATUS_POLL: std::time::Duration = std::time::Duration::from_millis(20);

/// The last probe result of a group.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProbeResult {
    pub ok: bool,
    pub seconds: Option<f64>,
    pub at_ms: i64,
    pub consecutive_failures: u32,
}

/// Latest probe results by group, shared with the API.
pub type ProbeBoard = Arc<RwLock<HashMap<String, ProbeResult>>>;

/// The probe loop: one probe per live group (of the latest [fleet view](crate::view)) every
/// `probe_interval`, awaited together.
pub struct Prober {
    pub session: Arc<Session>,
    pub board: ProbeBoard,
    pub view: ViewRx,
}

impl Prober {
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(self.session.cfg.probe_interval);
        let mut last = None;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&mut last, &shutdown).await?,
            }
        }
        Ok(())
    }

    /// One tick on a view newer than the previous tick's (`last`: when that one was sampled).
    /// `Err` only when the view loop is gone (the session is ending).
    async fn tick(
        &mut self,
        last: &mut Option<Instant>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<()> {
        let Some(view) = self.view.after(*last, shutdown).await? else {
            return Ok(());
        };
        *last = Some(view.sampled_at);
        let probes = view
            .groups
            .iter()
            .filter(|g| g.critical_capacity > 0)
            .map(|g| {
                probe_one(
                    self.session.clone(),
                    self.board.clone(),
                    g.group.clone(),
                    shutdown.clone(),
                )
            });
        futures::future::join_all(probes).await;
        Ok(())
    }
}

async fn probe_one(s: Arc<Session>, board: ProbeBoard, group: String, shutdown: CancellationToken) {
    let mut env = Envelope::new("noop", serde_json::json!({"probe": true}));
    env.id = format!("probe-{}", fleet::task::new_id());
    env.lane = Lane::Critical;
    env.submitted_at = Some(chrono::Utc::now());
    env.deadline = Some(
        chrono::Utc::now() + chrono::Duration::from_std(s.cfg.probe_timeout).unwrap_or_default(),
    );
    env.max_attempts = Some(1);
    let started = Instant::now();
    let sent = amqp::publish_confirmed(
        &s.publisher(),
        &s.names.tasks_exchange(),
        &s.names.group_key(&group, Lane::Critical),
        &env.to_bytes(),
        amqp::task_properties(
            &env.id,
            Some(amqp::headers([(
                fleet::task::headers::PROBE,
                "1".to_string(),
            )])),
        ),
    )
    .await;
    let mut ok = false;
    if sent.is_ok() {
        let mut poll = Ticker::new(STATUS_POLL);
        while started.elapsed() < s.cfg.probe_timeout && poll.tick(&shutdown).await {
            if let Ok(Some(st)) = s.store.task_status(&env.id).await {
                if st.get("state").map(String::as_str) == Some("succeeded") {
                    ok = true;
                    break;
                }
            }
        }
    }
    if shutdown.is_cancelled() {
        return;
    }
    let secs = started.elapsed().as_secs_f64();
    let mut b = board.write().await;
    let prev_fail = b.get(&group).map(|p| p.consecutive_failures).unwrap_or(0);
    if ok {
        metrics::histogram!(m::PROBE, "group" => group.clone()).record(secs);
    } else {
        metrics::counter!(m::PROBE_FAILURES, "group" => group.clone()).increment(1);
        tracing::warn!(group = %group, "probe through the critical lane failed");
    }
    b.insert(
        group,
        ProbeResult {
            ok,
            seconds: ok.then_some(secs),
            at_ms: fleet::redis::now_ms(),
            consecutive_failures: if ok { 0 } else { prev_fail + 1 },
        },
    );
}
