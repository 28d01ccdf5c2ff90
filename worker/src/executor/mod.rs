//! Executors: what runs a task.
//!
//! A [`Handler`] turns a [`TaskContext`] into a JSON result or a typed [`TaskError`]; the error
//! type alone decides the task's fate (retry with backoff, dead-letter, expired), never the
//! text of a message. [`Handlers`] maps a task's `kind` to its handler, with an optional
//! fallback for kinds nobody registered:
//!
//! * `builtin` — the demo/benchmark handlers of [`builtin`] and whatever the embedding program
//!   registered.
//! * `http` — every kind `FLEET_KINDS` declares (default `*`, every kind; but `noop`, below)
//!   goes to one endpoint ([`http`]).
//! * `exec` — every kind `FLEET_KINDS` declares (but `noop`) runs one program ([`exec`]).
//!
//! A task of a kind outside these is not run: the worker sends it back to the scheduler
//! unclaimed (`attempt::reroute`), to be routed where its kind is handled. The worker advertises the
//! kinds it handles ([`Handlers::kinds`]) in its registration, and the scheduler routes a task
//! only to a group whose every active worker handles its kind (`fleet::registry::Kinds`).
//!
//! Handlers registered by an embedding program always win over the fallback.
//!
//! `noop` is answered by the worker itself under every executor: the scheduler's black-box
//! health probes are `noop` tasks on the critical lane, and they must measure the worker, not
//! call the operator's endpoint or program (a slow program would fail every probe, and each
//! failed probe would land in the dead-letter queue).

pub mod builtin;
pub mod exec;
pub mod http;

use std::collections::HashMap;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use fleet::registry::Kinds;
use fleet::Envelope;

use crate::config::{ExecutorKind, WorkerConfig};

/// How an attempt failed. The variant decides what happens next.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskError {
    /// Worth another attempt (after a backoff) while attempts remain.
    #[error("{0}")]
    Retryable(String),
    /// Will never succeed: dead-letter at once.
    #[error("{0}")]
    Permanent(String),
    /// The task's deadline passed: dead-letter as expired.
    #[error("deadline passed")]
    Expired,
}

impl TaskError {
    pub fn retryable(msg: impl Into<String>) -> Self {
        TaskError::Retryable(msg.into())
    }
    pub fn permanent(msg: impl Into<String>) -> Self {
        TaskError::Permanent(msg.into())
    }
}

/// What a handler gets for one attempt.
#[derive(Debug, Clone)]
pub struct TaskContext {
    pub envelope: Envelope,
    /// This attempt's number, from 1.
    pub attempt: u32,
    pub worker_id: Arc<str>,
    /// The task's own deadline, if it has one.
    pub deadline: Option<DateTime<Utc>>,
    /// When this run is cut: the earlier of the task's deadline and the worker's
    /// `max_task_ms` cap. Handlers that do their own I/O use it as their timeout.
    pub run_deadline: Instant,
    /// Cancelled when the run is cut (deadline, cap, hard shutdown). Blocking work checks it;
    /// async work is simply dropped.
    pub cancel: CancellationToken,
    /// Cancelled when an operator cancels the task (`POST /v1/tasks/{id}/cancel`). A handler
    /// that [stops gracefully](Handler::stops_gracefully) ends its work within
    /// [`cancel_grace`](Self::cancel_grace) of it; any other handler's future is dropped at
    /// once.
    pub stop: CancellationToken,
    /// How long a graceful stop may take (`FLEET_CANCEL_GRACE_MS`).
    pub cancel_grace: std::time::Duration,
    /// The W3C trace context the handler runs under ([`fleet::trace::for_handler`]): the
    /// worker's `run` span as parent when spans are exported, else the producer's as it came;
    /// `None` when the task has none. The http executor sends it as the `traceparent` /
    /// `tracestate` headers, the exec executor as `TRACEPARENT` / `TRACESTATE`.
    pub trace: Option<fleet::task::TraceContext>,
}

impl TaskContext {
    /// Time left before the run is cut.
    pub fn remaining(&self) -> std::time::Duration {
        self.run_deadline.saturating_duration_since(Instant::now())
    }
}

/// Runs tasks of some kind. Implemented by closures too (see [`handler_fn`]).
pub trait Handler: Send + Sync + 'static {
    fn call(&self, task: TaskContext) -> BoxFuture<'static, Result<serde_json::Value, TaskError>>;

    /// Whether a cancelled run is left to end itself on [`TaskContext::stop`] (within
    /// [`TaskContext::cancel_grace`], then dropped) rather than dropped at once. `false`
    /// unless overridden: the exec executor signals its process group first.
    fn stops_gracefully(&self) -> bool {
        false
    }
}

/// A handler from an async closure.
pub fn handler_fn<F, Fut>(f: F) -> Arc<dyn Handler>
where
    F: Fn(TaskContext) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<serde_json::Value, TaskError>> + Send + 'static,
{
    struct FnHandler<F>(F);
    impl<F, Fut> Handler for FnHandler<F>
    where
        F: Fn(TaskContext) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<serde_json::Value, TaskError>> + Send + 'static,
    {
        fn call(
            &self,
            task: TaskContext,
        ) -> BoxFuture<'static, Result<serde_json::Value, TaskError>> {
            Box::pin((self.0)(task))
        }
    }
    Arc::new(FnHandler(f))
}

/// Handlers by task kind, plus the fallback for the rest.
#[derive(Clone, Default)]
pub struct Handlers {
    by_kind: HashMap<String, Arc<dyn Handler>>,
    fallback: Option<Arc<dyn Handler>>,
    /// The kinds the fallback takes (`FLEET_KINDS` for http and exec; every kind for a
    /// fallback an embedding program set).
    fallback_kinds: Kinds,
}

impl std::fmt::Debug for Handlers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut kinds: Vec<&String> = self.by_kind.keys().collect();
        kinds.sort();
        f.debug_struct("Handlers")
            .field("kinds", &kinds)
            .field("fallback", &self.fallback.is_some())
            .field("fallback_kinds", &self.fallback_kinds)
            .finish()
    }
}

impl Handlers {
    pub fn insert(&mut self, kind: impl Into<String>, h: Arc<dyn Handler>) {
        self.by_kind.insert(kind.into(), h);
    }

    /// Sets the handler of every kind without its own handler.
    pub fn set_fallback(&mut self, h: Arc<dyn Handler>) {
        self.fallback = Some(h);
        self.fallback_kinds = Kinds::Any;
    }

    /// The handler for a kind, `None` when nothing handles it.
    pub fn get(&self, kind: &str) -> Option<Arc<dyn Handler>> {
        match self.by_kind.get(kind) {
            Some(h) => Some(h.clone()),
            None if self.fallback_kinds.handles(kind) => self.fallback.clone(),
            None => None,
        }
    }

    /// The kinds these handlers take, as the worker advertises them in its registration: the
    /// fallback's kinds (when there is a fallback) and every kind with its own handler.
    pub fn kinds(&self) -> Kinds {
        let own = self.by_kind.keys().cloned();
        match self.fallback {
            Some(_) => self.fallback_kinds.clone().with(own),
            None => Kinds::only(own),
        }
    }

    /// The handlers of the configured executor, under the `custom` ones.
    pub fn for_config(cfg: &WorkerConfig, custom: Handlers) -> Result<Self, String> {
        let mut h = Handlers::default();
        match cfg.executor {
            ExecutorKind::Builtin => builtin::register(&mut h),
            ExecutorKind::Http => {
                let c = cfg.http.clone().ok_or("executor http without settings")?;
                h.set_fallback(Arc::new(http::HttpHandler::new(c)?));
                h.fallback_kinds = cfg.kinds.clone();
                builtin::register_probe(&mut h);
            }
            ExecutorKind::Exec => {
                let c = cfg.exec.clone().ok_or("executor exec without settings")?;
                h.set_fallback(Arc::new(exec::ExecHandler::new(c)));
                h.fallback_kinds = cfg.kinds.clone();
                builtin::register_probe(&mut h);
            }
        }
        h.by_kind.extend(custom.by_kind);
        if custom.fallback.is_some() {
            h.fallback = custom.fallback;
            h.fallback_kinds = custom.fallback_kinds;
        }
        Ok(h)
    }
}

/// Renders a result text: JSON if it parses, else the text as a JSON string.
pub(crate) fn json_or_string(bytes: &[u8]) -> serde_json::Value {
    match serde_json::from_slice(bytes) {
        Ok(v) => v,
        Err(_) => serde_json::Value::String(String::from_utf8_lossy(bytes).into_owned()),
    }
}

#[cfg(test)]
mod tests {
    use fleet::settings::Settings;

    use super::*;

    fn handlers(pairs: &[(&str, &str)]) -> Handlers {
        let cfg = WorkerConfig::from_settings(&Settings::from_pairs(
            pairs.iter().map(|(k, v)| (*k, v.to_string())),
        ))
        .unwrap();
        Handlers::for_config(&cfg, Handlers::default()).unwrap()
    }

    #[test]
    fn advertised_kinds() {
        assert_eq!(
            handlers(&[]).kinds().wire(),
            "cpu,echo,fail,noop,sleep",
            "builtin: its handler names"
        );
        let exec = [("executor", "exec"), ("exec_command", "cat")];
        assert_eq!(handlers(&exec).kinds(), Kinds::Any, "exec: `*` by default");
        let mut pairs = exec.to_vec();
        pairs.push(("kinds", "resize"));
        let h = handlers(&pairs);
        assert_eq!(h.kinds().wire(), "noop,resize");
        assert!(h.get("resize").is_some() && h.get("noop").is_some());
        assert!(
            h.get("thumbnail").is_none(),
            "an undeclared kind is unknown"
        );
    }

    #[tokio::test]
    async fn probes_never_reach_the_endpoint_or_the_program() {
        for pairs in [
            vec![("executor", "exec"), ("exec_command", "false")],
            vec![("executor", "http"), ("http_url", "http://127.0.0.1:9/")],
        ] {
            let h = handlers(&pairs);
            let noop = h.get("noop").unwrap();
            let probe = test_support::ctx(
                "noop",
                serde_json::json!({"probe": true}),
                1,
                std::time::Duration::from_secs(1),
            );
            assert_eq!(
                noop.call(probe).await,
                Ok(serde_json::Value::Null),
                "{pairs:?}"
            );
        }
    }
}

#[cfg(test)]
pub(crate) mod test_support {
    use super::*;

    pub fn ctx(
        kind: &str,
        payload: serde_json::Value,
        attempt: u32,
        run_for: std::time::Duration,
    ) -> TaskContext {
        let mut envelope = Envelope::new(kind, payload);
        envelope.attempt = attempt.saturating_sub(1);
        TaskContext {
            envelope,
            attempt,
            worker_id: Arc::from("test-worker"),
            deadline: None,
            run_deadline: Instant::now() + run_for,
            cancel: CancellationToken::new(),
            stop: CancellationToken::new(),
            cancel_grace: std::time::Duration::from_secs(5),
            trace: None,
        }
    }
}
