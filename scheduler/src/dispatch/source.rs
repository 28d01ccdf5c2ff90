//! Where a batch comes from, and every rule of the pipeline that depends on it: each step of
//! [`super::Dispatcher::process`] asks the [`Source`] instead of matching on it.
//!
//! | source      | parsed under         | dedupe     | tokens | reserve             | no room / no match          | acked          |
//! |-------------|----------------------|------------|--------|---------------------|-----------------------------|----------------|
//! | `Ingress`   | the producer's limits| check/mark | yes    | `Route`\*           | park / wait, dead past grace| one `multiple` |
//! | `Delayed`   | the internal guard   | skip       | yes    | `Route`             | park / wait, dead past grace| one `multiple` |
//! | `Park`      | the internal guard   | skip       | yes    | `Release`           | hold / hold                 | each           |
//! | `Unmatched` | the internal guard   | skip       | yes    | `Route`             | park / hold, dead past grace| each           |
//! | `Orphan`    | no size bound, as is | skip       | no     | `Release`, one try  | back of its queue           | each           |
//!
//! \* An expired or delayed submission is asked `DedupeOnly`. Only submissions mark their
//! ids handed on; an orphan writes no status and is published as it came.

use fleet::broker::amqp;
use fleet::route::Dedupe;
use fleet::route::ReserveRequest;
use fleet::task::{Limits, Reject};
use fleet::{status, Envelope, Lane, Names};
use lapin::message::Delivery;

use super::Fate;

/// Where a batch came from; decides gating, dedupe and what "no room" means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A producer's submission (the routing key's lane is authoritative).
    Ingress(Lane),
    /// Back from a delay tier (delayed start or retry backoff).
    Delayed,
    /// Released from a group's park queue: tasks that find no room stay held.
    Park,
    /// Released from the waiting-for-worker queue (no live group matched them yet — their
    /// selector, or their kind: see [`fleet::registry::Kinds`]): held until one does,
    /// dead-lettered `no_matching_worker` once the grace has passed.
    Unmatched,
    /// Taken from the queue of a group with no active capacity (the orphan rescue,
    /// [`super::rescue`]): moved as it is to another group with room, or published again to
    /// the back of its own queue.
    Orphan(Orphan),
}

/// The group queue an orphaned task was taken from ([`Source::Orphan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Orphan {
    /// The group whose queue it is (no active capacity in `lane`).
    pub group: String,
    /// The queue's lane: the task is reserved and moved in it.
    pub lane: Lane,
    /// The routing key of the queue itself (its shard's): a task that cannot move is published
    /// again with it, to the back of the queue.
    pub own_key: String,
}

/// What a reservation request asks of `reserve.lua` — the `from_park` and `dedupe_only`
/// flags of [`ReserveRequest`], of which only these three combinations exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReserveMode {
    /// Dedupe (as the source asks), choose a group and reserve room in it; a group whose
    /// tasks are parked counts as full, so new work queues behind parked work.
    Route,
    /// As `Route`, but a group's parked flag does not stop it: the task waited already (it
    /// is released from a park queue, or an orphan moved on).
    Release,
    /// Dedupe only, no routing: a delayed or expired submission, routed (or dead-lettered)
    /// without a reservation. Answered `Fresh` or `Duplicate`.
    DedupeOnly,
}

impl ReserveMode {
    /// The request for `e` in this mode with `dedupe`.
    pub fn request(self, e: &Envelope, dedupe: Dedupe) -> ReserveRequest {
        ReserveRequest {
            id: e.id.clone(),
            lane: e.lane,
            selector: e.selector(),
            kind: e.kind.clone(),
            strategy: e.strategy,
            dedupe,
            from_park: self == ReserveMode::Release,
            dedupe_only: self == ReserveMode::DedupeOnly,
            key: e.key.clone(),
        }
    }
}

impl Source {
    /// The limits a delivery is parsed under, given the producer's (`FLEET_MAX_*`). The size
    /// limit is the producer's, checked once on the producer's bytes (a submission); fleet's
    /// own copies (delay, park hops) carry fleet's fields too and get the internal guard
    /// ([`Limits::internal`]); an orphan was read once already and is not judged here (the
    /// default limits, no size bound: a worker dead-letters what it cannot run).
    pub fn limits(&self, producer: Limits) -> Limits {
        match self {
            Source::Ingress(_) => producer,
            Source::Orphan(_) => Limits {
                max_bytes: usize::MAX,
                ..Limits::default()
            },
            _ => producer.internal(),
        }
    }

    /// The id a body without one takes: a submission's AMQP `message_id` (how `POST /v1/tasks`
    /// passes the id it answered with while publishing the producer's bytes unchanged).
    pub fn default_id(&self, d: &Delivery) -> Option<String> {
        match self {
            Source::Ingress(_) => d.properties.message_id().as_ref().map(|m| m.to_string()),
            _ => None,
        }
    }

    /// Whether `d` is a dead-letter replay (`x-fleet-replay`, a submission only): it carries
    /// fleet's own fields from its first pass and is measured without them
    /// ([`Envelope::fleet_fields_len`], bounded), so a task that was under the producer's limit
    /// is under it again (`fleet::broker::dead`).
    pub fn is_replay(&self, d: &Delivery) -> bool {
        matches!(self, Source::Ingress(_))
            && amqp::header_text(&d.properties, fleet::task::headers::REPLAY).is_some()
    }

    /// The lane a task from here is in whatever its body says: a submission's routing key's
    /// lane, an orphan's queue's lane. `None`: the body's.
    pub fn lane(&self) -> Option<Lane> {
        match self {
            Source::Ingress(lane) => Some(*lane),
            Source::Orphan(o) => Some(o.lane),
            _ => None,
        }
    }

    /// Whether a task from here starts its clock here (a submission): without a
    /// `submitted_at`, it takes the API's header, the AMQP timestamp or now.
    pub fn starts_clock(&self) -> bool {
        matches!(self, Source::Ingress(_))
    }

    /// Whether tasks from here are screened before routing — normalised (defaults, the
    /// `not_before` bound), dead-lettered when expired, sent to a delay tier when not yet due.
    /// Every source but the orphan rescue, which moves tasks already screened as they are.
    pub fn screens(&self) -> bool {
        !matches!(self, Source::Orphan(_))
    }

    /// What becomes of a delivery that is no readable envelope: dead-lettered with the
    /// refusal's reason; an orphan's is held (the rescue puts it back for a worker, which
    /// dead-letters it — not the rescue's to judge).
    pub fn refused(&self, r: &Reject) -> Fate {
        match self {
            Source::Orphan(_) => Fate::Hold,
            _ => Fate::Dead(status::DeadReason::from(r), r.to_string()),
        }
    }

    /// Whether a task read from here counts as submitted (`fleet_tasks_submitted_total`).
    pub fn counts_submitted(&self) -> bool {
        matches!(self, Source::Ingress(_))
    }

    /// Whether an expired or delayed task from here is still checked against the dedupe
    /// marks ([`ReserveMode::DedupeOnly`]): a submission's is — a copy of a task already
    /// handed on (a redelivery, a resubmitted id) must not turn its true state into
    /// `expired`, and a delayed one is routed without a check when due.
    pub fn dedupes_unrouted(&self) -> bool {
        matches!(self, Source::Ingress(_))
    }

    /// Whether tasks to route from here take rate-limit tokens first (all but orphans, which
    /// took theirs when first dispatched).
    pub fn rate_limited(&self) -> bool {
        !matches!(self, Source::Orphan(_))
    }

    /// The dedupe a task from here asks for: a submission is checked, or — redelivered, so it
    /// may be handed on already — marked; fleet's own copies skip it.
    pub fn dedupe(&self, redelivered: bool) -> Dedupe {
        match self {
            Source::Ingress(_) if redelivered => Dedupe::Mark,
            Source::Ingress(_) => Dedupe::Check,
            _ => Dedupe::Skip,
        }
    }

    /// The reservation mode of a task to route from here: [`ReserveMode::Release`] for a task
    /// that waited already (park release, orphan moves), [`ReserveMode::Route`] otherwise —
    /// the waiting-for-worker queue's tasks wait for a match, not behind a group's parked
    /// work.
    pub fn mode(&self) -> ReserveMode {
        match self {
            Source::Park | Source::Orphan(_) => ReserveMode::Release,
            _ => ReserveMode::Route,
        }
    }

    /// Whether the reservation call also writes what each task is (kind, submitted_at) into
    /// its status record: all but orphans, whose records have it already.
    pub fn describes(&self) -> bool {
        !matches!(self, Source::Orphan(_))
    }

    /// Whether the reservation call is retried while Redis is unreachable (until shutdown).
    /// The orphan rescue tries once: on failure its task goes back to its queue and the rescue
    /// pass ends, to try again on the next tick.
    pub fn retries_reserve(&self) -> bool {
        !matches!(self, Source::Orphan(_))
    }

    /// Whether a task from here is published as it came (body and properties): an orphan's
    /// move keeps its message id and headers (a health probe stays one). Others are published
    /// as the normalised envelope with fleet's properties.
    pub fn verbatim(&self) -> bool {
        matches!(self, Source::Orphan(_))
    }

    /// The orphan's queue, for a [`Source::Orphan`].
    pub fn orphan(&self) -> Option<&Orphan> {
        match self {
            Source::Orphan(o) => Some(o),
            _ => None,
        }
    }

    /// Whether the ids acked from here are marked handed on (a submission's: a redelivery of
    /// one already handed on is then a duplicate).
    pub fn marks_handed_on(&self) -> bool {
        matches!(self, Source::Ingress(_))
    }

    /// Whether a batch from here is the run of delivery tags since its previous batch — a
    /// consuming loop that holds nothing back (ingress, delayed) — so that when every one is
    /// acked, one `multiple` ack of the last tag does it.
    pub fn acks_runs(&self) -> bool {
        matches!(self, Source::Ingress(_) | Source::Delayed)
    }

    /// Whether `fate`, decided for a task from here, is written to its status record by the
    /// dispatcher (the states decided here; `reserve.lua` writes queued and parked): dead or
    /// expired at the scheduler; waiting for a worker, when it starts waiting (not on every
    /// offer of the waiting-for-worker queue); delayed, a submission's; parked behind a paused
    /// kind's or batch's hold queue ([`crate::pause`]).
    pub fn writes_status(&self, fate: &Fate) -> bool {
        match fate {
            Fate::Dead(..) => true,
            Fate::Park(g) if crate::pause::hold_target(g).is_some() => true,
            Fate::Park(g) => g == Names::UNMATCHED_GROUP && *self != Source::Unmatched,
            Fate::Delay(_) => matches!(self, Source::Ingress(_)),
            _ => false,
        }
    }
}
