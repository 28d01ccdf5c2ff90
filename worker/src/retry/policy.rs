//! Whether: a run's result and the attempt count decide a task's fate (the algorithm is
//! described in [`crate::retry`]).

use std::time::Duration;

use serde_json::Value;

use fleet::status::DeadReason;

use crate::executor::TaskError;
use crate::retry::Backoff;

/// What to do with a task after its run.
#[derive(Debug, Clone, PartialEq)]
pub enum Fate {
    Succeeded(Value),
    Retry { error: String, delay: Duration },
    Dead { reason: DeadReason, error: String },
    Expired { detail: String },
}

/// Decides a task's fate from its run's result. Pure, for tests.
pub fn decide(
    result: Result<Value, TaskError>,
    attempt: u32,
    max_attempts: u32,
    time_left: Option<Duration>,
    backoff: &Backoff,
) -> Fate {
    let error = match result {
        Ok(v) => return Fate::Succeeded(v),
        Err(TaskError::Expired) => {
            return Fate::Expired {
                detail: "deadline reached during the run".into(),
            }
        }
        Err(e) => e,
    };
    if time_left == Some(Duration::ZERO) {
        return Fate::Expired {
            detail: format!("deadline reached; last error: {error}"),
        };
    }
    match error {
        TaskError::Permanent(e) => Fate::Dead {
            reason: DeadReason::PermanentError,
            error: e,
        },
        TaskError::Retryable(e) if attempt >= max_attempts => Fate::Dead {
            reason: DeadReason::MaxAttempts,
            error: e,
        },
        TaskError::Retryable(e) => {
            let delay = backoff.delay(attempt);
            match time_left {
                // The next attempt could not start before the deadline: expire now rather than
                // send the task on a trip it cannot finish.
                Some(left) if left <= delay => Fate::Expired {
                    detail: format!("no time left for attempt {}; last error: {e}", attempt + 1),
                },
                _ => Fate::Retry { error: e, delay },
            }
        }
        TaskError::Expired => Fate::Expired {
            detail: "deadline reached during the run".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::retry::Backoff;

    fn b() -> Backoff {
        Backoff::new(Duration::from_millis(100), Duration::from_secs(10))
    }

    #[test]
    fn success_and_typed_errors() {
        assert_eq!(
            decide(Ok(json!(1)), 1, 3, None, &b()),
            Fate::Succeeded(json!(1))
        );
        assert!(matches!(
            decide(Err(TaskError::retryable("x")), 1, 3, None, &b()),
            Fate::Retry { .. }
        ));
        assert!(matches!(
            decide(Err(TaskError::retryable("x")), 2, 3, None, &b()),
            Fate::Retry { .. }
        ));
        assert_eq!(
            decide(Err(TaskError::retryable("x")), 3, 3, None, &b()),
            Fate::Dead {
                reason: DeadReason::MaxAttempts,
                error: "x".into()
            }
        );
        assert_eq!(
            decide(Err(TaskError::permanent("bad input")), 1, 3, None, &b()),
            Fate::Dead {
                reason: DeadReason::PermanentError,
                error: "bad input".into()
            }
        );
        assert!(matches!(
            decide(Err(TaskError::Expired), 1, 3, None, &b()),
            Fate::Expired { .. }
        ));
    }

    #[test]
    fn retry_delay_is_the_backoff() {
        for _ in 0..50 {
            match decide(Err(TaskError::retryable("x")), 3, 5, None, &b()) {
                Fate::Retry { delay, .. } => assert!(delay <= Duration::from_millis(400)),
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn deadline_turns_failures_into_expiry() {
        assert!(matches!(
            decide(
                Err(TaskError::retryable("x")),
                1,
                5,
                Some(Duration::ZERO),
                &b()
            ),
            Fate::Expired { .. }
        ));
        assert!(matches!(
            decide(
                Err(TaskError::permanent("x")),
                1,
                5,
                Some(Duration::ZERO),
                &b()
            ),
            Fate::Expired { .. }
        ));
        // The backoff ceiling of attempt 1 is 100 ms: 1 ms left cannot fit (almost) any retry.
        let mut expired = 0;
        for _ in 0..50 {
            if matches!(
                decide(
                    Err(TaskError::retryable("x")),
                    1,
                    5,
                    Some(Duration::from_micros(1)),
                    &b()
                ),
                Fate::Expired { .. }
            ) {
                expired += 1;
            }
        }
        assert!(expired >= 45, "{expired}");
        assert!(matches!(
            decide(
                Err(TaskError::retryable("x")),
                1,
                5,
                Some(Duration::from_secs(60)),
                &b()
            ),
            Fate::Retry { .. }
        ));
        assert_eq!(
            decide(Ok(json!(null)), 1, 5, Some(Duration::ZERO), &b()),
            Fate::Succeeded(json!(null))
        );
    }
}
