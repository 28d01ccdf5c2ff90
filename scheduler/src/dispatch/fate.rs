//! What becomes of one delivery ([`Fate`]), and the decision that turns a reservation answer
//! into one ([`decide`]): a pure function of the answer, the [`Source`] and whether the task
//! has waited out the no-match grace — tested below over every answer × source.

use fleet::route::Reservation;
use fleet::{status, Envelope, Names};

use super::Source;

/// What becomes of one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fate {
    /// Publish to the group queue (reserved there).
    Dispatch(String),
    /// Publish to the group's park queue.
    Park(String),
    /// Publish to a delay tier (ms).
    Delay(u64),
    /// Publish to the dead-letter queue with its reason (the `x-fleet-reason` header and the
    /// status's `reason`) and a detail.
    Dead(status::DeadReason, String),
    /// Duplicate id: ack and drop.
    Duplicate,
    /// Cancelled by an operator: never dispatched, nothing reserved; its message is published
    /// to `<ns>.cancelled` (kept for a bulk retry) and then acked.
    Cancelled,
    /// Stays unacked with the caller (park: no room yet; an orphan that is no readable
    /// envelope).
    Hold,
    /// Published again, as it came, to the back of the queue it was taken from: an orphan
    /// that cannot move (no room elsewhere, no match, its own group back, Redis unreachable).
    /// `reserved` names the group a reservation was taken in (its own group, back), given
    /// back if the publish fails.
    Back {
        /// The group reserved in, if any.
        reserved: Option<String>,
    },
}

impl Fate {
    /// The group whose room this fate holds a reservation of: given back when its publish
    /// fails.
    pub fn reserved(&self) -> Option<&str> {
        match self {
            Fate::Dispatch(g) => Some(g),
            Fate::Back { reserved } => reserved.as_deref(),
            _ => None,
        }
    }
}

/// The fate of task `e` from `source` whose reservation answered `answer`; `past_grace`: it
/// has waited `FLEET_NO_MATCH_GRACE_MS` since its submission (a task no live group matches
/// is dead-lettered then). `None` for [`Reservation::Fresh`] (a dedupe-only check that found
/// no duplicate): the fate decided before the call stands.
///
/// * Any source: reserved → dispatch there; duplicate → drop; cancelled → drop (an orphan
///   too); the script failed on this task alone → dead-letter `internal_error`.
/// * No room (`Full(g)`): park behind `g` — except a park release, which holds the task.
/// * No match: wait in the waiting-for-worker queue ([`Names::UNMATCHED_GROUP`]), dead-letter
///   `no_matching_worker` once past the grace; a park release holds it, and the
///   waiting-for-worker release holds it until the grace has passed.
/// * A keyed task that must wait (`KeyPark`: no room, or its key over its limit): park in its
///   group's fair park queue ([`Names::fair_group`]) — a park release holds it.
/// * An orphan moves only when reserved in another group; anything else puts it back at the
///   end of its own queue (keeping the reservation of its own group, if that was the answer).
pub fn decide(
    answer: Reservation,
    source: &Source,
    e: &Envelope,
    past_grace: bool,
) -> Option<Fate> {
    if let Some(o) = source.orphan() {
        return Some(match answer {
            Reservation::Cancelled => Fate::Cancelled,
            Reservation::Reserved(g) if g != o.group => Fate::Dispatch(g),
            Reservation::Reserved(g) => Fate::Back { reserved: Some(g) },
            _ => Fate::Back { reserved: None },
        });
    }
    Some(match (answer, source) {
        (Reservation::Fresh, _) => return None,
        (Reservation::Failed(why), _) => Fate::Dead(status::DeadReason::InternalError, why),
        (Reservation::Reserved(g), _) => Fate::Dispatch(g),
        (Reservation::Duplicate, _) => Fate::Duplicate,
        (Reservation::Cancelled, _) => Fate::Cancelled,
        (
            Reservation::Full(_) | Reservation::NoMatch | Reservation::KeyPark { .. },
            Source::Park,
        ) => Fate::Hold,
        // A keyed task waits in its group's fair park queue (its key over its limit, or no
        // room): see `crate::park::fair`.
        (Reservation::KeyPark { group, queue, .. }, _) => Fate::Park(match queue {
            Some(q) => Names::fair_group(&group, q),
            None => group,
        }),
        (Reservation::NoMatch, Source::Unmatched) if !past_grace => Fate::Hold,
        (Reservation::Full(g), _) => Fate::Park(g),
        (Reservation::NoMatch, _) if past_grace => Fate::Dead(
            status::DeadReason::NoMatchingWorker,
            format!(
                "no live worker satisfies {{{}}} and handles kind `{}`",
                e.selector(),
                e.kind
            ),
        ),
        // Waits, counted and bounded, until a matching worker registers.
        (Reservation::NoMatch, _) => Fate::Park(Names::UNMATCHED_GROUP.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Orphan;
    use fleet::Lane;

    /// A short code per fate, so the table below reads as one.
    fn code(f: Option<Fate>) -> String {
        match f {
            None => "stands".into(),
            Some(Fate::Dispatch(g)) => format!("dispatch {g}"),
            Some(Fate::Park(g)) => format!("park {g}"),
            Some(Fate::Delay(ms)) => format!("delay {ms}"),
            Some(Fate::Dead(r, _)) => format!("dead {r}"),
            Some(Fate::Duplicate) => "duplicate".into(),
            Some(Fate::Cancelled) => "cancelled".into(),
            Some(Fate::Hold) => "hold".into(),
            Some(Fate::Back { reserved: None }) => "back".into(),
            Some(Fate::Back { reserved: Some(g) }) => format!("back {g}"),
        }
    }

    /// Every reservation answer the script gives (the match makes a new one fail to compile
    /// here until the table has a row for it). `own` is the orphan's own group.
    fn answers() -> Vec<Reservation> {
        let all = vec![
            Reservation::Reserved("other".into()),
            Reservation::Reserved("own".into()),
            Reservation::Full("other".into()),
            Reservation::NoMatch,
            Reservation::Duplicate,
            Reservation::Fresh,
            Reservation::Failed("boom".into()),
            Reservation::Cancelled,
            Reservation::KeyPark {
                group: "other".into(),
                queue: Some(3),
                blocked: true,
            },
            Reservation::KeyPark {
                group: "other".into(),
                queue: None,
                blocked: false,
            },
        ];
        for a in &all {
            match a {
                Reservation::Reserved(_)
                | Reservation::Full(_)
                | Reservation::NoMatch
                | Reservation::Duplicate
                | Reservation::Fresh
                | Reservation::Failed(_)
                | Reservation::Cancelled
                | Reservation::KeyPark { .. } => {}
            }
        }
        all
    }

    /// Every source (the match makes a new one fail to compile here).
    fn sources() -> Vec<Source> {
        let all = vec![
            Source::Ingress(Lane::Normal),
            Source::Ingress(Lane::Critical),
            Source::Delayed,
            Source::Park,
            Source::Unmatched,
            Source::Orphan(Orphan {
                group: "own".into(),
                lane: Lane::Normal,
                own_key: "own.normal".into(),
            }),
        ];
        for s in &all {
            match s {
                Source::Ingress(_)
                | Source::Delayed
                | Source::Park
                | Source::Unmatched
                | Source::Orphan(_) => {}
            }
        }
        all
    }

    #[test]
    fn every_answer_from_every_source_has_its_fate() {
        const U: &str = "_unmatched";
        assert_eq!(Names::UNMATCHED_GROUP, U);
        // Per (answer, past the no-match grace): the fate from each source, in the order of
        // `sources()`: ingress normal, ingress critical, delayed, park, unmatched, orphan.
        #[rustfmt::skip]
        let table: Vec<(&str, bool, [&str; 6])> = vec![
            ("reserved other", false, ["dispatch other", "dispatch other", "dispatch other", "dispatch other", "dispatch other", "dispatch other"]),
            ("reserved other", true, ["dispatch other", "dispatch other", "dispatch other", "dispatch other", "dispatch other", "dispatch other"]),
            ("reserved own", false, ["dispatch own", "dispatch own", "dispatch own", "dispatch own", "dispatch own", "back own"]),
            ("reserved own", true, ["dispatch own", "dispatch own", "dispatch own", "dispatch own", "dispatch own", "back own"]),
            ("full", false, ["park other", "park other", "park other", "hold", "park other", "back"]),
            ("full", true, ["park other", "park other", "park other", "hold", "park other", "back"]),
            ("no match", false, ["park _unmatched", "park _unmatched", "park _unmatched", "hold", "hold", "back"]),
            ("no match", true, ["dead no_matching_worker", "dead no_matching_worker", "dead no_matching_worker", "hold", "dead no_matching_worker", "back"]),
            ("duplicate", false, ["duplicate", "duplicate", "duplicate", "duplicate", "duplicate", "back"]),
            ("duplicate", true, ["duplicate", "duplicate", "duplicate", "duplicate", "duplicate", "back"]),
            ("fresh", false, ["stands", "stands", "stands", "stands", "stands", "back"]),
            ("fresh", true, ["stands", "stands", "stands", "stands", "stands", "back"]),
            ("failed", false, ["dead internal_error", "dead internal_error", "dead internal_error", "dead internal_error", "dead internal_error", "back"]),
            ("failed", true, ["dead internal_error", "dead internal_error", "dead internal_error", "dead internal_error", "dead internal_error", "back"]),
            ("cancelled", false, ["cancelled", "cancelled", "cancelled", "cancelled", "cancelled", "cancelled"]),
            ("cancelled", true, ["cancelled", "cancelled", "cancelled", "cancelled", "cancelled", "cancelled"]),
            ("key wait", false, ["park other~k3", "park other~k3", "park other~k3", "hold", "park other~k3", "back"]),
            ("key wait", true, ["park other~k3", "park other~k3", "park other~k3", "hold", "park other~k3", "back"]),
            ("key full", false, ["park other", "park other", "park other", "hold", "park other", "back"]),
            ("key full", true, ["park other", "park other", "park other", "hold", "park other", "back"]),
        ];
        let names = [
            "reserved other",
            "reserved own",
            "full",
            "no match",
            "duplicate",
            "fresh",
            "failed",
            "cancelled",
            "key wait",
            "key full",
        ];
        let e = Envelope::new("resize", serde_json::json!({}));
        let mut rows = 0;
        for (answer, name) in answers().into_iter().zip(names) {
            for past_grace in [false, true] {
                let Some((_, _, want)) = table
                    .iter()
                    .find(|(n, g, _)| *n == name && *g == past_grace)
                else {
                    panic!("no row for {name} (past grace: {past_grace})");
                };
                rows += 1;
                for (source, want) in sources().iter().zip(want) {
                    let got = code(decide(answer.clone(), source, &e, past_grace));
                    assert_eq!(
                        &got, want,
                        "{name} from {source:?}, past grace: {past_grace}"
                    );
                }
            }
        }
        assert_eq!(rows, table.len(), "every row of the table is an answer");
    }

    #[test]
    fn a_dead_letter_for_no_match_names_the_selector_and_kind() {
        let mut e = Envelope::new("resize", serde_json::json!({}));
        e.labels = fleet::task::Labels::parse("gpu=true").unwrap();
        let f = decide(Reservation::NoMatch, &Source::Delayed, &e, true);
        assert_eq!(
            f,
            Some(Fate::Dead(
                status::DeadReason::NoMatchingWorker,
                "no live worker satisfies {gpu=true} and handles kind `resize`".into()
            ))
        );
    }

    #[test]
    fn a_fate_holds_the_reservation_it_gives_back() {
        assert_eq!(Fate::Dispatch("g".into()).reserved(), Some("g"));
        assert_eq!(
            Fate::Back {
                reserved: Some("own".into())
            }
            .reserved(),
            Some("own")
        );
        for f in [
            Fate::Back { reserved: None },
            Fate::Park("g".into()),
            Fate::Delay(1000),
            Fate::Duplicate,
            Fate::Cancelled,
            Fate::Hold,
            Fate::Dead(status::DeadReason::Expired, String::new()),
        ] {
            assert_eq!(f.reserved(), None, "{f:?}");
        }
    }
}
