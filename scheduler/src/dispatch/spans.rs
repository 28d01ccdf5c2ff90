//! The scheduler's spans of a batch ([`fleet::trace`]): `admit` for each submission read from
//! ingress, `reserve` for each task the reservation call decided. Made only when spans are
//! exported (the caller checks [`fleet::trace::enabled`] once per batch and takes no clock
//! reading otherwise).

use std::time::SystemTime;

use super::{Fate, Item, Source};

/// When the batch's steps began and ended: read started, read done (= reservation asked),
/// reservation answered.
pub struct Times {
    /// The batch was taken (before its first read).
    pub read: SystemTime,
    /// Every delivery was read and screened.
    pub admitted: SystemTime,
    /// The reservation call answered and each fate was decided.
    pub reserved: SystemTime,
}

/// The word of a fate as a span's `fleet.outcome`, and the group it names, if any.
fn outcome(f: &Fate) -> (&'static str, Option<&str>) {
    match f {
        Fate::Dispatch(g) => ("dispatch", Some(g)),
        Fate::Park(g) => ("park", Some(g)),
        Fate::Delay(_) => ("delay", None),
        Fate::Dead(..) => ("dead", None),
        Fate::Duplicate => ("duplicate", None),
        Fate::Cancelled => ("cancelled", None),
        Fate::Hold => ("hold", None),
        Fate::Back { reserved } => ("back", reserved.as_deref()),
    }
}

/// Records the spans of `items`, a batch from `source` (see the module docs).
pub fn record(items: &[Item], source: &Source, t: &Times) {
    for item in items {
        let Some(e) = item.envelope.as_ref().filter(|e| e.trace.is_some()) else {
            continue;
        };
        let next = e.attempt.saturating_add(1);
        let (word, group) = item.fate.as_ref().map_or(("none", None), outcome);
        if source.starts_clock() {
            let admitted = if item.ask.is_some() { "admitted" } else { word };
            fleet::trace::record("admit", e, None, next, (t.read, t.admitted), Some(admitted));
        }
        if item.to_route() {
            fleet::trace::record(
                "reserve",
                e,
                group,
                next,
                (t.admitted, t.reserved),
                Some(word),
            );
        }
    }
}
