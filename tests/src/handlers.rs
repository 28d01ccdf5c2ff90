//! Handlers that record what ran (`Recorder`, `Attempts`) and a `Gate` that holds a run
//! until the test lets it go: the events tests wait on instead of sleeping.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_worker::executor::{handler_fn, Handler, TaskError};
use tokio::sync::Semaphore;

#[derive(Clone, Default)]
pub struct Recorder {
    inner: Arc<Mutex<RecState>>,
}

#[derive(Default)]
struct RecState {
    runs: Vec<(String, String, u32)>,
    running: HashMap<String, u32>,
    peak: HashMap<String, u32>,
}

impl Recorder {
    /// A handler that records (task id, worker id, attempt), sleeps `payload.ms` (default 0)
    /// and succeeds with the worker id.
    pub fn handler(&self) -> Arc<dyn Handler> {
        let rec = self.clone();
        handler_fn(move |ctx| {
            let rec = rec.clone();
            async move {
                let w = ctx.worker_id.to_string();
                {
                    let mut s = rec
                        .inner
                        .lock()
                        .map_err(|_| TaskError::retryable("poisoned"))?;
                    s.runs
                        .push((ctx.envelope.id.clone(), w.clone(), ctx.attempt));
                    let r = s.running.entry(w.clone()).or_default();
                    *r += 1;
                    let now = *r;
                    let p = s.peak.entry(w.clone()).or_default();
                    *p = (*p).max(now);
                }
                let ms = ctx
                    .envelope
                    .payload
                    .get("ms")
                    .and_then(|v| v.as_u64())
                    .unwrap_or(0);
                if ms > 0 {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                if let Ok(mut s) = rec.inner.lock() {
                    if let Some(r) = s.running.get_mut(&w) {
                        *r -= 1;
                    }
                }
                Ok(serde_json::json!({"worker": w}))
            }
        })
    }

    /// Every run so far: (task id, worker id, attempt).
    pub fn runs(&self) -> Vec<(String, String, u32)> {
        self.inner
            .lock()
            .map(|s| s.runs.clone())
            .unwrap_or_default()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().map(|s| s.runs.len()).unwrap_or(0)
    }

    pub fn peak(&self, worker: &str) -> u32 {
        self.inner
            .lock()
            .ok()
            .and_then(|s| s.peak.get(worker).copied())
            .unwrap_or(0)
    }

    /// Runs per task id.
    pub fn per_task(&self) -> HashMap<String, Vec<String>> {
        let mut m: HashMap<String, Vec<String>> = HashMap::new();
        for (t, w, _) in self.runs() {
            m.entry(t).or_default().push(w);
        }
        m
    }
}

/// Holds gated handler runs until the test opens the gate of their task, one run per opening.
#[derive(Clone, Default)]
pub struct Gate {
    inner: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl Gate {
    fn sem(&self, id: &str) -> Arc<Semaphore> {
        let mut m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_string())
            .or_insert_with(|| Arc::new(Semaphore::new(0)))
            .clone()
    }

    /// Waits until the test lets one run of task `id` through.
    pub async fn pass(&self, id: &str) {
        if let Ok(p) = self.sem(id).acquire().await {
            p.forget();
        }
    }

    /// Lets one run of task `id` through.
    pub fn open(&self, id: &str) {
        self.sem(id).add_permits(1);
    }
}

/// Every non-probe `(task id, attempt)` a handler saw, in order, with when.
#[derive(Clone, Default)]
pub struct Attempts {
    inner: Arc<Mutex<Vec<(String, u32, std::time::Instant)>>>,
}

impl Attempts {
    pub fn record(&self, id: &str, attempt: u32) {
        if let Ok(mut v) = self.inner.lock() {
            v.push((id.to_string(), attempt, std::time::Instant::now()));
        }
    }

    pub fn all(&self) -> Vec<(String, u32, std::time::Instant)> {
        self.inner.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The attempt numbers seen for a task, in order.
    pub fn of(&self, id: &str) -> Vec<u32> {
        self.all()
            .into_iter()
            .filter(|(t, _, _)| t == id)
            .map(|(_, a, _)| a)
            .collect()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().map(|v| v.len()).unwrap_or(0)
    }
}

/// A no-op handler that counts its runs (benchmarks: the cheapest task there is), and the
/// counter it bumps.
pub fn counting() -> (Arc<AtomicUsize>, Arc<dyn Handler>) {
    let done = Arc::new(AtomicUsize::new(0));
    let d2 = done.clone();
    let h = handler_fn(move |_ctx| {
        let d = d2.clone();
        async move {
            d.fetch_add(1, Ordering::Relaxed);
            Ok(serde_json::Value::Null)
        }
    });
    (done, h)
}
