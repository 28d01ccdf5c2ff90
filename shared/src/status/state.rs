//! The words of a status record: a task's [`TaskState`], why it died ([`DeadReason`]) and how
//! one attempt ended ([`AttemptOutcome`]). Each is stored as its `as_str` text in Redis (the
//! `state` and `reason` fields of `t:<id>`, the `outcome` of an attempt log entry), written by
//! the Lua scripts through the tables `S`, `R` and `O` of `names/keys.lua`; a unit test in
//! [`super`] checks those tables, and every such word a script spells out, against these enums.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A text that is not a known value of one of these enums.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} `{text}`")]
pub struct UnknownWord {
    /// Which enum: `task state`, `dead-letter reason` or `attempt outcome`.
    pub what: &'static str,
    /// The text as given.
    pub text: String,
}

/// Declares a fieldless enum stored as a fixed word: `as_str` (const), `ALL`, `Display`,
/// `FromStr` and serde as that word.
macro_rules! words {
    ($(#[$m:meta])* $name:ident, $what:literal { $($(#[$vm:meta])* $v:ident = $s:literal,)+ }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $v,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v,)+];

            /// The stored word.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$v => $s,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = UnknownWord;
            fn from_str(s: &str) -> Result<Self, UnknownWord> {
                match s {
                    $($s => Ok($name::$v),)+
                    _ => Err(UnknownWord { what: $what, text: s.to_string() }),
                }
            }
        }
    };
}

words! {
    /// Where a task is (the `state` of its status record; schema `status.schema.json`).
    /// Terminal: [`Succeeded`](TaskState::Succeeded), [`Dead`](TaskState::Dead),
    /// [`Expired`](TaskState::Expired), [`Cancelled`](TaskState::Cancelled). Readers treat an unknown word as not terminal (the
    /// set may grow).
    TaskState, "task state" {
        /// Waits in a delay tier for its `not_before` (the scheduler).
        Delayed = "delayed",
        /// A batch member that waits for other members (`after`, [`crate::batch::dag`]): held
        /// in the batch's definition in the control stream (no queue, no worker) until every
        /// one of them succeeded; its `after` field names them (the scheduler's `POST
        /// /v1/batches`).
        Waiting = "waiting",
        /// No live group matches its selector yet; it waits in the unmatched park queue (the
        /// scheduler).
        WaitingForWorker = "waiting_for_worker",
        /// Matches a group that has no room; waits in the group's park queue (`reserve.lua`).
        Parked = "parked",
        /// Reserved in a group and in its queue (`reserve.lua`); or back in the broker after an
        /// attempt that ended without an outcome (`finish.lua`, `remove_worker`, `start.lua`).
        Queued = "queued",
        /// Claimed and running on a worker (`start.lua`).
        Running = "running",
        /// Failed; waits out its backoff before the next attempt (`finish.lua`).
        Retrying = "retrying",
        /// Its handler succeeded (`finish.lua`).
        Succeeded = "succeeded",
        /// In the dead-letter queue; its `reason` says why.
        Dead = "dead",
        /// Its deadline passed (in the dead-letter queue with reason `expired`).
        Expired = "expired",
        /// An operator cancelled it (`POST /v1/tasks/{id}/cancel`, `cancel.lua`): it never
        /// runs again, is never retried nor dead-lettered; its run, if one was going, was
        /// stopped on its worker.
        Cancelled = "cancelled",
    }
}

impl TaskState {
    /// The states that end a task.
    pub const TERMINAL: [TaskState; 4] = [
        TaskState::Succeeded,
        TaskState::Dead,
        TaskState::Expired,
        TaskState::Cancelled,
    ];

    /// True for a state that ends the task.
    pub const fn is_terminal(self) -> bool {
        matches!(
            self,
            TaskState::Succeeded | TaskState::Dead | TaskState::Expired | TaskState::Cancelled
        )
    }

    /// True when `state` (as stored) is a terminal state; false for an unknown word.
    pub fn is_terminal_word(state: &str) -> bool {
        state.parse::<TaskState>().is_ok_and(TaskState::is_terminal)
    }
}

words! {
    /// Why a task was dead-lettered (or expired): the `x-fleet-reason` header of its dead
    /// letter and the `reason` of its status record. Fleet's own reasons, the refusal codes of
    /// [`crate::task::Reject::code`], and the broker's `x-first-death-reason` values for
    /// letters the broker dead-lettered itself.
    DeadReason, "dead-letter reason" {
        /// A retryable error on the last allowed attempt (worker).
        MaxAttempts = "max_attempts",
        /// The handler reported an error no retry can fix (worker).
        PermanentError = "permanent_error",
        /// Its worker died while running it alone on its last attempt (`start.lua`); also the
        /// reason of a `lost` attempt log entry.
        WorkerLost = "worker_lost",
        /// No live worker matched its selector within the grace (scheduler).
        NoMatchingWorker = "no_matching_worker",
        /// Its deadline passed (scheduler or worker; also the broker's message-TTL reason).
        Expired = "expired",
        /// The routing script gave an answer the scheduler did not understand.
        InternalError = "internal_error",
        /// Broker: a quorum queue's delivery limit (redelivered too often without an outcome).
        DeliveryLimit = "delivery_limit",
        /// Broker: rejected or nacked without requeue.
        Rejected = "rejected",
        /// Broker: a queue's length limit.
        Maxlen = "maxlen",
        /// Broker: a letter without a death reason.
        Unknown = "unknown",
        /// Refusal: the body is not JSON.
        MalformedJson = "malformed_json",
        /// Refusal: the body is not a JSON object.
        NotAnObject = "not_an_object",
        /// Refusal: no `kind`.
        MissingKind = "missing_kind",
        /// Refusal: a field of the wrong type or value.
        BadField = "bad_field",
        /// Refusal: an unknown lane.
        UnknownLane = "unknown_lane",
        /// Refusal: over the envelope size limit.
        Oversized = "oversized",
        /// Refusal: an invalid label selector.
        BadSelector = "bad_selector",
        /// Refusal: an unknown routing strategy.
        UnknownStrategy = "unknown_strategy",
        /// Refusal: `not_before` too far ahead.
        BadNotBefore = "bad_not_before",
        /// A batch member one of whose `after` members ended other than `succeeded` (or whose
        /// `payload_from` result is not known): it never ran ([`crate::batch::dag`]).
        DependencyFailed = "dependency_failed",
        /// Refusal: a dimension over its limit.
        OverLimit = "over_limit",
        /// A batch's closing message (AMQP `type` [`crate::batch::CLOSE_TYPE`]) that defines
        /// no batch: not JSON, no `id`, no tasks, too many, a bad callback or member, a cycle
        /// in its `after` links... (the detail says which).
        BadBatch = "bad_batch",
    }
}

impl From<&crate::task::Reject> for DeadReason {
    fn from(r: &crate::task::Reject) -> Self {
        use crate::task::Reject;
        match r {
            Reject::MalformedJson(_) => DeadReason::MalformedJson,
            Reject::NotAnObject => DeadReason::NotAnObject,
            Reject::MissingKind => DeadReason::MissingKind,
            Reject::BadField(..) => DeadReason::BadField,
            Reject::UnknownLane(_) => DeadReason::UnknownLane,
            Reject::Oversized { .. } => DeadReason::Oversized,
            Reject::BadSelector(_) => DeadReason::BadSelector,
            Reject::UnknownStrategy(_) => DeadReason::UnknownStrategy,
            Reject::TooFarAhead(_) => DeadReason::BadNotBefore,
            Reject::OverLimit { .. } => DeadReason::OverLimit,
        }
    }
}

words! {
    /// How one attempt ended (the `outcome` of an attempt log entry, see `names/keys.lua`
    /// `log_attempt`).
    AttemptOutcome, "attempt outcome" {
        /// The handler succeeded.
        Succeeded = "succeeded",
        /// The handler failed; another attempt follows (the task is `retrying`).
        Failed = "failed",
        /// The attempt ended the task in the dead-letter queue.
        Dead = "dead",
        /// The deadline passed.
        Expired = "expired",
        /// Its worker died or left while running it (reason `worker_lost`).
        Lost = "lost",
        /// An operator cancelled the task while this attempt ran: the run was stopped (the
        /// entry names who cancelled it, `cancelled_by`, and why, `cancel_reason`).
        Cancelled = "cancelled",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_round_trip() {
        for s in TaskState::ALL {
            assert_eq!(s.as_str().parse::<TaskState>(), Ok(*s));
            assert_eq!(
                serde_json::to_value(s).ok(),
                Some(serde_json::Value::String(s.to_string()))
            );
        }
        for r in DeadReason::ALL {
            assert_eq!(r.as_str().parse::<DeadReason>(), Ok(*r));
            assert_eq!(
                serde_json::from_value::<DeadReason>(serde_json::json!(r.as_str())).ok(),
                Some(*r)
            );
        }
        for o in AttemptOutcome::ALL {
            assert_eq!(o.as_str().parse::<AttemptOutcome>(), Ok(*o));
        }
        assert_eq!(
            "nope".parse::<TaskState>().unwrap_err().to_string(),
            "unknown task state `nope`"
        );
    }

    #[test]
    fn terminal_states() {
        let t: Vec<_> = TaskState::ALL
            .iter()
            .copied()
            .filter(|s| s.is_terminal())
            .collect();
        assert_eq!(t, TaskState::TERMINAL);
        assert!(
            TaskState::is_terminal_word("dead")
                && !TaskState::is_terminal_word("running")
                && !TaskState::is_terminal_word("x")
        );
    }

    #[test]
    fn every_refusal_code_is_a_reason() {
        use crate::task::Reject;
        let all = [
            Reject::MalformedJson(String::new()),
            Reject::NotAnObject,
            Reject::MissingKind,
            Reject::BadField("f", String::new()),
            Reject::UnknownLane(String::new()),
            Reject::Oversized { size: 2, limit: 1 },
            Reject::BadSelector(String::new()),
            Reject::UnknownStrategy(String::new()),
            Reject::TooFarAhead(1),
            Reject::OverLimit {
                what: "x",
                got: 2,
                limit: 1,
            },
        ];
        for r in &all {
            assert_eq!(DeadReason::from(r).as_str(), r.code());
        }
    }
}
