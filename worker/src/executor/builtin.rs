//! Builtin handlers for demos, tests and benchmarks:
//!
//! | kind    | payload                               | does |
//! |---------|---------------------------------------|------|
//! | `noop`  | anything                              | returns `null` |
//! | `echo`  | anything                              | returns the payload |
//! | `sleep` | `{"ms": N}`                           | waits N ms, returns `{"slept_ms": N}` |
//! | `fail`  | `{"times": N, "permanent": bool}`     | fails attempts 1..=N (all when `times` is absent), then returns `{"attempt": n}` |
//! | `cpu`   | `{"iters": N}`                        | N rounds of hashing on the blocking pool, returns the digest |

use serde_json::{json, Value};

use super::{handler_fn, Handlers, TaskContext, TaskError};

/// Registers every builtin handler.
pub fn register(h: &mut Handlers) {
    register_probe(h);
    h.insert(
        "echo",
        handler_fn(|t: TaskContext| traced(t, |t| async move { Ok(t.envelope.payload) })),
    );
    h.insert("sleep", handler_fn(|t| traced(t, sleep)));
    h.insert("fail", handler_fn(|t| traced(t, fail)));
    h.insert("cpu", handler_fn(|t| traced(t, cpu)));
}

/// Runs builtin handler `f` inside a span `builtin <kind>`, a child of the run's span, when
/// spans are exported ([`fleet::trace::child`]); as it is otherwise.
async fn traced<F, Fut>(t: TaskContext, f: F) -> Result<Value, TaskError>
where
    F: FnOnce(TaskContext) -> Fut,
    Fut: std::future::Future<Output = Result<Value, TaskError>>,
{
    use opentelemetry::trace::Span as _;
    let span = t
        .trace
        .as_ref()
        .and_then(|c| fleet::trace::child(format!("builtin {}", t.envelope.kind), c));
    let r = f(t).await;
    if let Some(mut span) = span {
        if let Err(e) = &r {
            span.set_status(opentelemetry::trace::Status::error(e.to_string()));
        }
        span.end();
    }
    r
}

/// Registers only `noop`, which answers the scheduler's health probes under every executor.
pub fn register_probe(h: &mut Handlers) {
    h.insert(
        "noop",
        handler_fn(|_t: TaskContext| async { Ok(Value::Null) }),
    );
}

fn uint(payload: &Value, field: &str) -> Result<Option<u64>, TaskError> {
    match payload.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).ok_or_else(|| {
            TaskError::permanent(format!(
                "payload field `{field}` must be a non-negative integer"
            ))
        }),
    }
}

async fn sleep(t: TaskContext) -> Result<Value, TaskError> {
    let ms = uint(&t.envelope.payload, "ms")?.unwrap_or(0);
    tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    Ok(json!({ "slept_ms": ms }))
}

async fn fail(t: TaskContext) -> Result<Value, TaskError> {
    let times = uint(&t.envelope.payload, "times")?.unwrap_or(u64::MAX);
    let permanent = t
        .envelope
        .payload
        .get("permanent")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if u64::from(t.attempt) <= times {
        let msg = if times == u64::MAX {
            format!("fail: attempt {} (every attempt fails)", t.attempt)
        } else {
            format!("fail: attempt {} of the first {times} that fail", t.attempt)
        };
        return Err(if permanent {
            TaskError::Permanent(msg)
        } else {
            TaskError::Retryable(msg)
        });
    }
    Ok(json!({ "attempt": t.attempt }))
}

async fn cpu(t: TaskContext) -> Result<Value, TaskError> {
    let iters = uint(&t.envelope.payload, "iters")?.unwrap_or(1_000_000);
    let cancel = t.cancel.clone();
    let join = tokio::task::spawn_blocking(move || {
        // FNV-1a over a running counter: cheap, deterministic, not optimised away.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for i in 0..iters {
            if i % 65_536 == 0 && cancel.is_cancelled() {
                return None;
            }
            for b in i.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0100_0000_01b3);
            }
        }
        Some(h)
    });
    match join.await {
        Ok(Some(h)) => Ok(json!({ "iters": iters, "digest": format!("{h:016x}") })),
        Ok(None) => Err(TaskError::retryable("cpu: cancelled")),
        Err(e) => Err(TaskError::retryable(format!("cpu: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::super::test_support::ctx;
    use super::*;

    fn handlers() -> Handlers {
        let mut h = Handlers::default();
        register(&mut h);
        h
    }

    async fn run(kind: &str, payload: Value, attempt: u32) -> Result<Value, TaskError> {
        let h = handlers().get(kind).expect("registered");
        h.call(ctx(kind, payload, attempt, Duration::from_secs(5)))
            .await
    }

    #[tokio::test]
    async fn noop_echo_sleep() {
        assert_eq!(run("noop", json!({"a": 1}), 1).await, Ok(Value::Null));
        assert_eq!(
            run("echo", json!({"a": [1, "x"]}), 1).await,
            Ok(json!({"a": [1, "x"]}))
        );
        assert_eq!(
            run("sleep", json!({"ms": 5}), 1).await,
            Ok(json!({"slept_ms": 5}))
        );
        assert!(matches!(
            run("sleep", json!({"ms": "x"}), 1).await,
            Err(TaskError::Permanent(_))
        ));
    }

    #[tokio::test]
    async fn fail_fails_the_first_n_attempts() {
        assert!(matches!(
            run("fail", json!({"times": 2}), 1).await,
            Err(TaskError::Retryable(_))
        ));
        assert!(matches!(
            run("fail", json!({"times": 2}), 2).await,
            Err(TaskError::Retryable(_))
        ));
        assert_eq!(
            run("fail", json!({"times": 2}), 3).await,
            Ok(json!({"attempt": 3}))
        );
        assert!(matches!(
            run("fail", json!({"times": 1, "permanent": true}), 1).await,
            Err(TaskError::Permanent(_))
        ));
        assert!(matches!(
            run("fail", Value::Null, 99).await,
            Err(TaskError::Retryable(_))
        ));
    }

    #[tokio::test]
    async fn cpu_is_deterministic() {
        let a = run("cpu", json!({"iters": 1000}), 1).await.unwrap();
        let b = run("cpu", json!({"iters": 1000}), 1).await.unwrap();
        assert_eq!(a, b);
        assert_eq!(a["iters"], 1000);
    }

    #[test]
    fn unknown_kind_has_no_handler() {
        assert!(handlers().get("resize").is_none());
    }
}
