//! Weighted fair dispatch between fairness keys inside one group ([`FairHold`]).
//!
//! When a group's room is the bottleneck its tasks wait in its park queues, and the group's
//! release loop decides who gets each slot that frees. Tasks with a fairness `key` wait in the
//! group's **fair park queues** (`FLEET_FAIR_QUEUES`, default 8, [`fleet::Names::fair_group`]):
//! `reserve.lua` gives each key that waits in the group a queue of its own, round robin over
//! the queues, so up to that many waiting keys never share one. That is the idea of
//! *stochastic fairness queueing* (P. McKenney, "Stochastic Fairness Queueing", INFOCOM 1990:
//! a fixed set of queues shared by any number of flows) with assignment in place of hashing —
//! no queue per key (quorum queues are Raft groups: thousands would sink the broker). Unkeyed
//! tasks wait in the group's own park queue, as one more flow (the default key).
//!
//! The release loop consumes every one of those queues (each with a prefetch window of
//! `hold_max` tasks) — found through Redis's count of them, and through the broker at the
//! loop's start, when Redis's count falls and every 5 minutes, since that count is lost with
//! Redis while the queues and their tasks are not — so the head of every waiting key is in
//! memory at once, and offers held tasks to the reservation in **start-time fair queueing**
//! order (P. Goyal, H. Vin, H. Cheng,
//! "Start-time Fair Queueing: A Scheduling Algorithm for Integrated Services Packet Switching
//! Networks", SIGCOMM 1996): each key `k` of weight `w_k` keeps a finish tag `F_k`; its next
//! task starts at `S = max(v, F_k)` and moves `F_k` to `S + 1/w_k`; tasks go out in order of
//! their start tags, and the virtual time `v` is the start tag of the last task served. A task
//! not served (no room left, or its key over its limit) gives its `1/w_k` back, so over time
//! each key with work is served in proportion to its weight, and no key builds up credit
//! while it has nothing waiting (work conserving: a key alone takes all the room).
//!
//! Before that order, keys below their `min_running` (running + reserved, cluster-wide, as
//! the last reservation call counted it) go first, up to their share: a guaranteed share
//! while they have work.
//!
//! Extra broker hops per waiting task: one (into the park queue, out with its dispatch) —
//! a key over its limit waits there too, unacked in the release loop's window, never
//! republished. Two keys that share a fair queue (more waiting keys than queues) are
//! interleaved only within the queue's window.

use std::collections::{HashMap, VecDeque};

use fleet::control::{KeyLimits, DEFAULT_KEY};
use lapin::message::Delivery;

/// The envelope's `key`, read without parsing the rest.
#[derive(serde::Deserialize)]
struct KeyOnly {
    #[serde(default)]
    key: Option<String>,
}

/// The fairness key of a held delivery ([`DEFAULT_KEY`] when it has none or is unreadable).
pub fn key_of(d: &Delivery) -> String {
    serde_json::from_slice::<KeyOnly>(&d.data)
        .ok()
        .and_then(|k| k.key)
        .unwrap_or_else(|| DEFAULT_KEY.to_string())
}

/// One key's flow: its held tasks in order and its finish tag.
#[derive(Default)]
struct Flow {
    tasks: VecDeque<Delivery>,
    finish: f64,
}

/// The tasks a release loop holds, by key, and the order it offers them in (see the module
/// docs).
#[derive(Default)]
pub struct FairHold {
    flows: HashMap<String, Flow>,
    /// The virtual time: the start tag of the last task served.
    vnow: f64,
    len: usize,
    /// Per task offered in the last batch (by delivery tag): its key and start tag.
    offered: HashMap<u64, (String, f64)>,
}

impl FairHold {
    /// Tasks held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Holds `d` at the back of its key's flow.
    pub fn push(&mut self, d: Delivery) {
        let key = key_of(&d);
        self.flows.entry(key).or_default().tasks.push_back(d);
        self.len += 1;
    }

    /// The keys with tasks held.
    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.flows
            .iter()
            .filter(|(_, f)| !f.tasks.is_empty())
            .map(|(k, _)| k.as_str())
    }

    /// Takes up to `max` held tasks in the order they are to be offered: keys below their
    /// `min_running` first (`used`: each key's running + reserved as last counted), then
    /// start-time fair order by the keys' weights in `limits`. A key in `blocked` (it held
    /// its own tasks back last time: paused, at its limit, out of tokens) is offered only a
    /// probe — its head, or as many tasks as its token bucket holds at most (a rate-limited
    /// key must be able to spend what its bucket gathered during one cycle): a batch is not
    /// spent on tasks that cannot go.
    pub fn batch(
        &mut self,
        max: usize,
        limits: &KeyLimits,
        used: &HashMap<String, u32>,
        blocked: &std::collections::HashSet<String>,
    ) -> Vec<Delivery> {
        self.offered.clear();
        let mut probed: HashMap<&str, u32> = HashMap::new();
        let mut out = Vec::with_capacity(max.min(self.len));
        let weight = |k: &str| limits.for_key(k).weight;
        // Guaranteed shares first.
        let mut below: Vec<(String, usize)> = self
            .flows
            .iter()
            .filter(|(k, f)| !f.tasks.is_empty() && !blocked.contains(*k))
            .filter_map(|(k, _)| {
                let min = limits.for_key(k).min_running;
                let have = used.get(k).copied().unwrap_or(0);
                (min > have).then(|| (k.clone(), (min - have) as usize))
            })
            .collect();
        below.sort();
        for (k, want) in below {
            for _ in 0..want {
                if out.len() >= max || !self.take(&k, weight(&k), &mut out) {
                    break;
                }
            }
        }
        // Then start-time fair order.
        while out.len() < max && self.len > 0 {
            let next = self
                .flows
                .iter()
                .filter(|(_, f)| !f.tasks.is_empty())
                .filter(|(k, _)| {
                    probed.get(k.as_str()).is_none_or(|n| {
                        *n < limits.for_key(k).rate.map_or(1, |(_, burst)| burst.max(1))
                    })
                })
                .map(|(k, f)| (self.vnow.max(f.finish), k))
                .min_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1)))
                .map(|(_, k)| k.clone());
            let Some(k) = next else { break };
            let w = weight(&k);
            self.take(&k, w, &mut out);
            if let Some(bk) = blocked.get(&k) {
                *probed.entry(bk.as_str()).or_default() += 1;
            }
        }
        out
    }

    /// Moves the head of `k`'s flow to `out`, advancing its finish tag; `false` when empty.
    fn take(&mut self, k: &str, w: f64, out: &mut Vec<Delivery>) -> bool {
        let vnow = self.vnow;
        let Some(f) = self.flows.get_mut(k) else {
            return false;
        };
        let Some(d) = f.tasks.pop_front() else {
            return false;
        };
        let start = vnow.max(f.finish);
        f.finish = start + 1.0 / w;
        self.offered.insert(d.delivery_tag, (k.to_string(), start));
        out.push(d);
        self.len -= 1;
        true
    }

    /// Takes back what the last batch did not dispatch (`held`, in batch order): each goes
    /// back to the head of its flow, in order, and gives its tag back; the virtual time moves
    /// to the latest start tag served.
    pub fn put_back(&mut self, held: Vec<Delivery>, limits: &KeyLimits) {
        let mut served = std::mem::take(&mut self.offered);
        let mut back: HashMap<String, Vec<Delivery>> = HashMap::new();
        for d in held {
            let key = served
                .remove(&d.delivery_tag)
                .map(|(k, _)| k)
                .unwrap_or_else(|| key_of(&d));
            let w = limits.for_key(&key).weight;
            if let Some(f) = self.flows.get_mut(&key) {
                f.finish -= 1.0 / w;
            }
            back.entry(key).or_default().push(d);
        }
        if let Some(latest) = served.values().map(|(_, s)| *s).max_by(f64::total_cmp) {
            self.vnow = self.vnow.max(latest);
        }
        for (key, ds) in back {
            let f = self.flows.entry(key).or_default();
            self.len += ds.len();
            for d in ds.into_iter().rev() {
                f.tasks.push_front(d);
            }
        }
        // A flow with nothing held keeps no credit: its next task starts at the virtual time.
        self.flows
            .retain(|_, f| !f.tasks.is_empty() || f.finish > self.vnow);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn task(tag: u64, key: &str) -> Delivery {
        let body = if key == DEFAULT_KEY {
            b"{\"kind\":\"noop\"}".to_vec()
        } else {
            format!("{{\"kind\":\"noop\",\"key\":\"{key}\"}}").into_bytes()
        };
        Delivery::mock(tag, "".into(), "".into(), false, body)
    }

    fn limits(weights: &[(&str, f64)], min: &[(&str, u32)]) -> KeyLimits {
        let mut l = KeyLimits::default();
        for (k, w) in weights {
            l.keys.entry(k.to_string()).or_default().weight = Some(*w);
        }
        for (k, m) in min {
            l.keys.entry(k.to_string()).or_default().min_running = Some(*m);
        }
        l
    }

    /// Serves `slots` tasks per round from a backlog of every key, as a full group would,
    /// and counts what each key got.
    fn serve(
        h: &mut FairHold,
        l: &KeyLimits,
        rounds: usize,
        slots: usize,
    ) -> HashMap<String, usize> {
        let mut got: HashMap<String, usize> = HashMap::new();
        for _ in 0..rounds {
            let mut b = h.batch(64, l, &HashMap::new(), &Default::default());
            let rest = b.split_off(slots.min(b.len()));
            for d in &b {
                *got.entry(key_of(d)).or_default() += 1;
            }
            h.put_back(rest, l);
        }
        got
    }

    #[test]
    fn weights_share_the_room_in_proportion() {
        let l = limits(&[("a", 3.0), ("b", 2.0), ("c", 1.0)], &[]);
        let mut h = FairHold::default();
        let mut tag = 0;
        for k in ["a", "b", "c"] {
            for _ in 0..2000 {
                tag += 1;
                h.push(task(tag, k));
            }
        }
        let got = serve(&mut h, &l, 300, 2);
        assert_eq!(got["a"] + got["b"] + got["c"], 600);
        assert_eq!((got["a"], got["b"], got["c"]), (300, 200, 100));
    }

    #[test]
    fn a_late_key_gets_its_share_at_once_and_no_credit_builds_up() {
        let l = KeyLimits::default();
        let mut h = FairHold::default();
        for t in 0..1000 {
            h.push(task(t, "flood"));
        }
        let alone = serve(&mut h, &l, 100, 4);
        assert_eq!(
            alone["flood"], 400,
            "work conserving: alone it takes all the room"
        );
        for t in 1000..1100 {
            h.push(task(t, "late"));
        }
        let got = serve(&mut h, &l, 50, 4);
        assert_eq!((got["flood"], got["late"]), (100, 100));
        // The tasks not served went back in order: the flood's next is the 501st.
        let b = h.batch(1, &l, &HashMap::new(), &Default::default());
        assert_eq!(b.len(), 1);
    }

    #[test]
    fn a_key_below_its_min_running_goes_first() {
        let l = limits(&[], &[("small", 2)]);
        let mut h = FairHold::default();
        for t in 0..10 {
            h.push(task(t, "big"));
        }
        for t in 10..20 {
            h.push(task(t, "small"));
        }
        let used: HashMap<String, u32> = [("small".to_string(), 0)].into();
        let b = h.batch(3, &l, &used, &Default::default());
        let keys: Vec<String> = b.iter().map(key_of).collect();
        assert_eq!(keys[..2], ["small".to_string(), "small".to_string()]);
    }

    #[test]
    fn put_back_keeps_each_flow_in_order() {
        let l = KeyLimits::default();
        let mut h = FairHold::default();
        for t in 0..6 {
            h.push(task(t, if t % 2 == 0 { "a" } else { "b" }));
        }
        let b = h.batch(6, &l, &HashMap::new(), &Default::default());
        h.put_back(b, &l);
        assert_eq!(h.len(), 6);
        let again: Vec<u64> = h
            .batch(6, &l, &HashMap::new(), &Default::default())
            .iter()
            .map(|d| d.delivery_tag)
            .collect();
        let a: Vec<u64> = again.iter().copied().filter(|t| t % 2 == 0).collect();
        assert_eq!(a, vec![0, 2, 4]);
    }
}
