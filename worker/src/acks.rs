//! Coalesced acknowledgements for one consuming channel.
//!
//! AMQP 0-9-1 `basic.ack` with `multiple = true` settles every outstanding delivery of the
//! channel up to and including its tag in one frame — on a quorum queue one settle command in
//! the queue's Raft log instead of one per task, which is most of what a no-op task costs the
//! broker beyond its two hops (RabbitMQ's own clients batch acks the same way).
//!
//! A delivery is *in flight* from its arrival ([`AckWindow::slot`]) until its attempt ends.
//! An attempt that ends with an ack hands its tag here ([`Slot::ack`]); any other end (nacked
//! on its own path, or left to a dead channel) releases the slot when it is dropped. A flush
//! acks every ready tag: those below the lowest tag still in flight with one `multiple` ack of
//! the largest of them (nothing below it is outstanding any more), the others one by one at
//! once — never held behind a longer task, where they would count against the prefetch while
//! the worker sits idle. Ready tags accumulate while a flush is pending: the first attempt to
//! be ready yields once before flushing, so the attempts a ledger batch finishes together
//! (`crate::ledger`) are acked together. Flushes are sent one at a time, in the order they
//! took their tags: a `multiple` ack must name a tag that is still outstanding.
//!
//! Safety of `multiple`: a tag is covered only when every delivery at or below it has been
//! registered and has ended (acked here, or settled on its own path), so a multiple ack never
//! settles a task still running — nor one still waiting in another consumer's buffer: a
//! sharded lane consumes several queues on one channel, whose deliveries (tags 1, 2, 3… per
//! channel) may be taken out of tag order, so only the run of tags registered without a gap
//! counts. Every delivery of the channel must therefore get a slot, even one nacked at once. The ack still comes after the outcome is recorded (see `attempt::settle`); a crash
//! between the two leaves the delivery with the broker, and its copy is a duplicate.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use lapin::message::Delivery;
use lapin::options::BasicAckOptions;
use lapin::Acker;

/// Longest wait for a flush's acks to be written (see [`AckWindow::flush`]).
pub(crate) const ACK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The deliveries of one channel: which are in flight, which are ready to be acked.
#[derive(Clone, Default)]
pub struct AckWindow {
    inner: Arc<Mutex<Window<Acker>>>,
    /// Held from taking what is ready until it is sent: flushes go out in order. (A later
    /// flush's `multiple` ack, sent first, would settle an earlier flush's tag, and the
    /// earlier ack would then name a tag the broker no longer knows: PRECONDITION_FAILED,
    /// which closes the channel.)
    sending: Arc<tokio::sync::Mutex<()>>,
}

/// The bookkeeping of a window, generic over the ack handle (pure, for tests).
struct Window<A> {
    in_flight: BTreeSet<u64>,
    ready: BTreeMap<u64, A>,
    /// Every tag up to this one has been registered (delivery tags start at 1 per channel).
    contiguous: u64,
    /// Registered tags beyond a gap (taken out of order from another consumer).
    early: BTreeSet<u64>,
    /// A flush is pending (an attempt yields before running it).
    flushing: bool,
}

impl<A> Default for Window<A> {
    fn default() -> Self {
        Window {
            in_flight: BTreeSet::new(),
            ready: BTreeMap::new(),
            contiguous: 0,
            early: BTreeSet::new(),
            flushing: false,
        }
    }
}

impl<A> Window<A> {
    fn register(&mut self, tag: u64) {
        self.in_flight.insert(tag);
        if tag == self.contiguous + 1 {
            self.contiguous = tag;
            while self.early.remove(&(self.contiguous + 1)) {
                self.contiguous += 1;
            }
        } else if tag > self.contiguous {
            self.early.insert(tag);
        }
    }

    /// The delivery ended without an ack from here.
    fn end(&mut self, tag: u64) {
        self.in_flight.remove(&tag);
    }

    /// The delivery is to be acked; true if no flush is pending yet (the caller flushes).
    fn ready(&mut self, tag: u64, acker: A) -> bool {
        self.in_flight.remove(&tag);
        self.ready.insert(tag, acker);
        !std::mem::replace(&mut self.flushing, true)
    }

    /// Takes what is ready: the handle of the largest tag a `multiple` ack may cover, and the
    /// handles to ack one by one.
    fn take(&mut self) -> (Option<A>, Vec<A>) {
        self.flushing = false;
        let low = self
            .in_flight
            .first()
            .copied()
            .unwrap_or(u64::MAX)
            .min(self.contiguous + 1);
        let above = self.ready.split_off(&low);
        let below = std::mem::take(&mut self.ready);
        (
            below.into_iter().next_back().map(|(_, a)| a),
            above.into_values().collect(),
        )
    }
}

/// One delivery's place in its channel's window. Dropped without [`Slot::ack`]: the delivery
/// was settled some other way (or its channel is gone).
pub struct Slot {
    window: AckWindow,
    tag: u64,
    acker: Acker,
    done: bool,
}

impl AckWindow {
    /// Registers a delivery as in flight. Call for every delivery of the channel, before its
    /// attempt starts.
    pub fn slot(&self, delivery: &Delivery) -> Slot {
        if let Ok(mut w) = self.inner.lock() {
            w.register(delivery.delivery_tag);
        }
        Slot {
            window: self.clone(),
            tag: delivery.delivery_tag,
            acker: delivery.acker.clone(),
            done: false,
        }
    }

    /// Acks what is ready (see the module docs). Errors are logged: the broker redelivers an
    /// unacked task, and its copy is settled by its run record.
    async fn flush(&self) {
        let _in_order = self.sending.lock().await;
        let (multiple, single) = match self.inner.lock() {
            Ok(mut w) => w.take(),
            Err(_) => return,
        };
        // All at once: each ack returns when the connection's I/O loop has written it, so acks
        // awaited one by one would cost a hand-off to that thread each (see
        // `fleet::broker::amqp::publish_batch`). The `multiple` one and the single ones cover disjoint tags.
        let acks = multiple
            .map(|a| (a, true))
            .into_iter()
            .chain(single.into_iter().map(|a| (a, false)));
        // Bounded: an ack on a channel whose connection died mid-write may never be answered,
        // and the attempt waiting here holds its lane slot and `running` count meanwhile.
        let sent =
            futures::future::join_all(acks.map(|(acker, multiple)| async move {
                acker.ack(BasicAckOptions { multiple }).await
            }));
        match tokio::time::timeout(ACK_WAIT, sent).await {
            Ok(results) => results.into_iter().for_each(report),
            Err(_) => tracing::warn!(
                limit_ms = ACK_WAIT.as_millis() as u64,
                "acks not written in time (connection lost?); the broker redelivers the tasks and their copies are settled by their run records"
            ),
        }
    }
}

impl Slot {
    /// Acks the delivery, together with whatever else of its channel is ready by then.
    pub async fn ack(&mut self) {
        if self.done {
            return;
        }
        self.done = true;
        let first = match self.window.inner.lock() {
            Ok(mut w) => w.ready(self.tag, self.acker.clone()),
            Err(_) => return,
        };
        if first {
            // Let the other attempts finished by the same ledger batch add their tags.
            tokio::task::yield_now().await;
            self.window.flush().await;
        }
    }

    /// Whether the delivery's channel can still take an ack.
    pub fn usable(&self) -> bool {
        self.acker.usable()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(mut w) = self.window.inner.lock() {
            w.end(self.tag);
        }
    }
}

fn report(r: lapin::Result<bool>) {
    match r {
        Ok(true) => {}
        Ok(false) => tracing::info!("cannot ack: channel closed; the broker redelivers the task and its copy is settled by its run record"),
        Err(e) => tracing::warn!(error = %e, "cannot ack; the broker redelivers the task"),
    }
}

#[cfg(test)]
mod tests {
    use super::Window;

    fn window(tags: &[u64]) -> Window<u64> {
        let mut w = Window::default();
        for &t in tags {
            w.register(t);
        }
        w
    }

    #[test]
    fn in_order_completions_are_one_multiple_ack() {
        let mut w = window(&[1, 2, 3, 4, 5]);
        assert!(w.ready(1, 1));
        assert!(!w.ready(2, 2), "a flush is already pending");
        assert!(!w.ready(3, 3));
        assert_eq!(
            w.take(),
            (Some(3), vec![]),
            "1..=3 in one ack; 4 and 5 still run"
        );
        assert!(w.ready(5, 5));
        assert_eq!(
            w.take(),
            (None, vec![5]),
            "5 is above 4, which still runs: acked alone, at once"
        );
        assert!(w.ready(4, 4));
        assert_eq!(w.take(), (Some(4), vec![]));
    }

    #[test]
    fn a_multiple_ack_never_covers_a_running_or_unregistered_delivery() {
        // A sharded lane: tag 3 is still in another consumer's buffer when 4 arrives.
        let mut w = window(&[1, 2, 4]);
        w.ready(1, 1);
        w.ready(4, 4);
        w.end(2); // nacked on its own path
        assert_eq!(w.take(), (Some(1), vec![4]), "4 is beyond the gap at 3");
        w.register(3);
        w.ready(3, 3);
        assert_eq!(w.take(), (Some(3), vec![]));
        // A long task at 5 holds nothing behind it.
        let mut w = window(&[5, 6, 7]);
        w.ready(6, 6);
        w.ready(7, 7);
        assert_eq!(
            w.take(),
            (None, vec![6, 7]),
            "tags 1-4 were never registered"
        );
    }

    #[test]
    fn ended_deliveries_open_the_way() {
        let mut w = window(&[1, 2, 3]);
        w.end(1);
        w.ready(3, 3);
        assert_eq!(w.take(), (None, vec![3]), "2 still runs");
        w.ready(2, 2);
        assert_eq!(
            w.take(),
            (Some(2), vec![]),
            "1 was settled on its own path; 3 already acked"
        );
    }
}
