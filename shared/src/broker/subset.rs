//! Deterministic subsetting: which of a sharded group's `S` shard queues each worker consumes.
//!
//! One hot group on one queue is one queue leader, one core on one broker node. A group may
//! therefore split its normal lane into `S` shard queues (`FLEET_SHARDS`), and each worker
//! consumes `k` of them (`FLEET_SHARDS_PER_WORKER`), so no queue has every worker as a consumer
//! and no worker consumes every queue.
//!
//! The choice is the algorithm of the SRE book (*Site Reliability Engineering*, O'Reilly 2016,
//! chapter 20 "Load Balancing in the Datacenter", section "Deterministic subsetting"), with
//! shards in the role of backends and workers in the role of clients:
//!
//! * a worker's *ordinal* `i` is its place in its group: the lowest free ordinal, taken
//!   atomically at registration and freed at deregistration or eviction (`register.lua`), so a
//!   worker that leaves hands its ordinal, and with it its subset, to the next one to join.
//!   Only an `active` worker holds one: a worker that stops consuming (draining, ejected) frees
//!   its ordinal at that moment (`set_state.lua`), so its peers cover its shards while it is
//!   still finishing its running tasks, and an ejected worker back from its cool-down takes
//!   the lowest free ordinal again;
//! * the subset count is `c = S / k` (workers per *round*); the worker's round is `r = i / c`;
//! * the shard list `0..S` is shuffled with a PRNG seeded with `r` — every worker of a round
//!   computes the same permutation, each round a different one, so the shards one round leaves
//!   doubled are not the ones the next round doubles;
//! * the worker's subset is `shuffled[(i mod c)·k .. (i mod c)·k + k]`.
//!
//! Within a round the subsets are disjoint and cover every shard, so after `n` workers each shard
//! has `⌊n / c⌋` or `⌊n / c⌋ + 1` consumers (max − min ≤ 1). The book's example: 12 shards,
//! 10 workers, `k = 3` → `c = 4`, rounds 0 and 1 cover every shard twice, round 2 (two workers)
//! covers six shards a third time: every shard has 2 or 3 consumers.
//!
//! `S` must be a multiple of `k` (else `S mod k` shards of every round would have no consumer in
//! it): [`Subsetting::new`] refuses anything else.
//!
//! **Coverage.** With fewer workers than one round (`n < c`), or with ordinals freed in the
//! middle of the range, some shards would have no consumer and their tasks would wait.
//! [`Subsetting::assign`] closes that gap deterministically: the shards no subset covers are
//! dealt out, in shard order, to the live ordinals in ordinal order, round robin. Every process
//! that reads the same ordinal table computes the same assignment, so as long as a group has one
//! registered worker every shard has a consumer and the scheduler may publish to any shard.
//!
//! The PRNG is ChaCha8 (`rand_chacha`, whose output is stable across versions) and the shuffle is
//! `rand`'s Fisher–Yates; the unit tests pin the exact subsets of the book's example, so a
//! dependency update that changed the permutation would fail them instead of silently giving a
//! rolling upgrade two different assignments.

use std::collections::{BTreeMap, BTreeSet};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Why a shard layout is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubsetError {
    /// No shard (`FLEET_SHARDS` 0).
    #[error("the number of shards must be at least 1")]
    NoShards,
    /// Shards per worker of 0 or more than the shards.
    #[error("the shards per worker must be between 1 and the number of shards ({shards}), got {per_worker}")]
    PerWorker {
        /// The shards (`FLEET_SHARDS`).
        shards: u32,
        /// The shards per worker (`FLEET_SHARDS_PER_WORKER`).
        per_worker: u32,
    },
    /// Shards that are not a multiple of the shards per worker.
    #[error("{shards} shards cannot be split into subsets of {per_worker}: the number of shards must be a multiple of the shards per worker")]
    NotMultiple {
        /// The shards (`FLEET_SHARDS`).
        shards: u32,
        /// The shards per worker (`FLEET_SHARDS_PER_WORKER`).
        per_worker: u32,
    },
}

/// A validated shard layout: `shards` shard queues, `per_worker` (`k`) consumed by each worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Subsetting {
    shards: u32,
    per_worker: u32,
}

impl Default for Subsetting {
    /// One shard, consumed by every worker: an unsharded group.
    fn default() -> Self {
        Subsetting {
            shards: 1,
            per_worker: 1,
        }
    }
}

impl Subsetting {
    /// A layout of `shards` queues with `per_worker` consumed by each worker.
    ///
    /// # Errors
    /// [`SubsetError`] when `shards` is 0, `per_worker` is 0 or above `shards`, or `shards` is
    /// not a multiple of `per_worker`.
    pub fn new(shards: u32, per_worker: u32) -> Result<Self, SubsetError> {
        if shards == 0 {
            return Err(SubsetError::NoShards);
        }
        if per_worker == 0 || per_worker > shards {
            return Err(SubsetError::PerWorker { shards, per_worker });
        }
        if !shards.is_multiple_of(per_worker) {
            return Err(SubsetError::NotMultiple { shards, per_worker });
        }
        Ok(Subsetting { shards, per_worker })
    }

    /// `S`: shard queues per group (normal lane).
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// `k`: shards each worker consumes.
    pub fn per_worker(&self) -> u32 {
        self.per_worker
    }

    /// True when the group has one queue (no sharding).
    pub fn is_single(&self) -> bool {
        self.shards == 1
    }

    /// `c = S / k`: workers per round.
    pub fn subset_count(&self) -> u32 {
        self.shards / self.per_worker
    }

    /// The shard list `0..S` shuffled for `round` (the same for every worker of the round).
    pub fn permutation(&self, round: u32) -> Vec<u32> {
        let mut shards: Vec<u32> = (0..self.shards).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(u64::from(round));
        shards.shuffle(&mut rng);
        shards
    }

    /// The `k` shards of the worker with `ordinal`, in permutation order.
    pub fn subset(&self, ordinal: u32) -> Vec<u32> {
        let c = self.subset_count();
        let start = ((ordinal % c) * self.per_worker) as usize;
        let perm = self.permutation(ordinal / c);
        perm[start..start + self.per_worker as usize].to_vec()
    }

    /// Shards per live ordinal: each ordinal's [`subset`](Self::subset), plus the shards no
    /// subset covers dealt out round robin (see the module docs), each list sorted. Empty when
    /// `ordinals` is empty.
    pub fn assign(&self, ordinals: &[u32]) -> BTreeMap<u32, Vec<u32>> {
        let live: BTreeSet<u32> = ordinals.iter().copied().collect();
        let mut out: BTreeMap<u32, BTreeSet<u32>> = live
            .iter()
            .map(|&i| (i, self.subset(i).into_iter().collect()))
            .collect();
        let covered: BTreeSet<u32> = out.values().flatten().copied().collect();
        let order: Vec<u32> = live.iter().copied().collect();
        if !order.is_empty() {
            let uncovered = (0..self.shards).filter(|s| !covered.contains(s));
            for (j, s) in uncovered.enumerate() {
                if let Some(set) = out.get_mut(&order[j % order.len()]) {
                    set.insert(s);
                }
            }
        }
        out.into_iter()
            .map(|(i, s)| (i, s.into_iter().collect()))
            .collect()
    }

    /// The shards the worker with `ordinal` consumes when `ordinals` are live (its own
    /// included); its plain subset when it is not among them.
    pub fn shards_of(&self, ordinal: u32, ordinals: &[u32]) -> Vec<u32> {
        if !ordinals.contains(&ordinal) {
            let mut s = self.subset(ordinal);
            s.sort_unstable();
            return s;
        }
        self.assign(ordinals).remove(&ordinal).unwrap_or_default()
    }

    /// How a worker's prefetch (its lane capacity) is split over the shards it consumes: one
    /// prefetch per shard, summing to `capacity`, each at least 1 (a prefetch of 0 means
    /// "unlimited" in AMQP), so the sum exceeds `capacity` only when it is below `shards`.
    pub fn split_prefetch(capacity: u32, shards: usize) -> Vec<u16> {
        let n = shards.max(1) as u32;
        (0..n)
            .map(|j| {
                let share = capacity / n + u32::from(j < capacity % n);
                u16::try_from(share.max(1)).unwrap_or(u16::MAX)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Consumers per shard given each ordinal's shards.
    fn per_shard(s: &Subsetting, assigned: impl Iterator<Item = Vec<u32>>) -> Vec<u32> {
        let mut count = vec![0u32; s.shards() as usize];
        for shards in assigned {
            for sh in shards {
                count[sh as usize] += 1;
            }
        }
        count
    }

    #[test]
    fn the_books_example_twelve_shards_ten_workers_three_each() {
        let s = Subsetting::new(12, 3).unwrap();
        assert_eq!(s.subset_count(), 4);
        let subsets: Vec<Vec<u32>> = (0..10).map(|i| s.subset(i)).collect();
        for (i, sub) in subsets.iter().enumerate() {
            println!("worker {i}: {sub:?}");
        }
        // Pinned: every process (and every release) must compute exactly these.
        let want: Vec<Vec<u32>> = vec![
            // round 0
            vec![2, 8, 6],
            vec![1, 9, 5],
            vec![7, 11, 0],
            vec![10, 3, 4],
            // round 1
            vec![3, 8, 5],
            vec![2, 7, 9],
            vec![11, 0, 4],
            vec![1, 6, 10],
            // round 2
            vec![3, 0, 11],
            vec![10, 5, 9],
        ];
        assert_eq!(subsets, want);
        let count = per_shard(&s, subsets.into_iter());
        assert!(count.iter().all(|&c| c == 2 || c == 3), "{count:?}");
        assert_eq!(
            count.iter().filter(|&&c| c == 3).count(),
            6,
            "round 2 doubles six shards: {count:?}"
        );
        assert_eq!(count.iter().sum::<u32>(), 30);
        // Nothing is left uncovered, so the assignment adds nothing.
        let ords: Vec<u32> = (0..10).collect();
        let a = s.assign(&ords);
        for i in 0..10 {
            let mut sub = s.subset(i);
            sub.sort_unstable();
            assert_eq!(a[&i], sub, "ordinal {i}");
        }
    }

    #[test]
    fn every_layout_up_to_40_workers_40_shards_5_per_worker_is_balanced() {
        for shards in 1..=40u32 {
            for k in 1..=5u32.min(shards) {
                let Ok(s) = Subsetting::new(shards, k) else {
                    assert_ne!(shards % k, 0);
                    continue;
                };
                let c = s.subset_count();
                // A round's subsets are disjoint and cover every shard.
                for round in 0..3 {
                    let mut seen: Vec<u32> = (round * c..(round + 1) * c)
                        .flat_map(|i| s.subset(i))
                        .collect();
                    seen.sort_unstable();
                    assert_eq!(
                        seen,
                        (0..shards).collect::<Vec<_>>(),
                        "S={shards} k={k} round {round}"
                    );
                }
                for n in 1..=40u32 {
                    let ords: Vec<u32> = (0..n).collect();
                    let plain = per_shard(&s, ords.iter().map(|&i| s.subset(i)));
                    let (min, max) = (plain.iter().min().unwrap(), plain.iter().max().unwrap());
                    assert!(max - min <= 1, "S={shards} k={k} n={n}: {plain:?}");
                    if n % c == 0 {
                        assert!(
                            plain.iter().all(|&x| x == n / c),
                            "full rounds: S={shards} k={k} n={n}: {plain:?}"
                        );
                    }
                    // With coverage: every shard has a consumer, still balanced.
                    let a = s.assign(&ords);
                    assert_eq!(a.len(), n as usize);
                    let cov = per_shard(&s, a.into_values());
                    let (min, max) = (cov.iter().min().unwrap(), cov.iter().max().unwrap());
                    assert!(
                        *min >= 1,
                        "uncovered shard: S={shards} k={k} n={n}: {cov:?}"
                    );
                    assert!(max - min <= 1, "S={shards} k={k} n={n}: {cov:?}");
                }
            }
        }
    }

    #[test]
    fn gaps_in_the_ordinals_leave_no_shard_without_a_consumer() {
        let s = Subsetting::new(12, 3).unwrap();
        // Workers 1 and 2 left; 0 and 3 remain: their subsets cover six shards, the other six
        // are dealt out three each.
        let a = s.assign(&[0, 3]);
        assert_eq!(a[&0].len() + a[&3].len(), 12);
        let cov = per_shard(&s, a.into_values());
        assert!(cov.iter().all(|&c| c == 1), "{cov:?}");
        // A lone worker consumes everything.
        assert_eq!(s.shards_of(7, &[7]), (0..12).collect::<Vec<_>>());
        // A worker not (yet) in the table gets its plain subset.
        let mut own = s.subset(5);
        own.sort_unstable();
        assert_eq!(s.shards_of(5, &[0]), own);
        assert!(s.assign(&[]).is_empty());
    }

    #[test]
    fn an_ordinal_reused_gets_the_same_subset() {
        let s = Subsetting::new(12, 3).unwrap();
        assert_eq!(s.subset(6), s.subset(6));
        assert_eq!(s.permutation(1), s.permutation(1));
        assert_ne!(s.permutation(0), s.permutation(1));
    }

    #[test]
    fn bad_layouts_are_refused() {
        assert_eq!(Subsetting::new(0, 1), Err(SubsetError::NoShards));
        assert_eq!(
            Subsetting::new(4, 0),
            Err(SubsetError::PerWorker {
                shards: 4,
                per_worker: 0
            })
        );
        assert_eq!(
            Subsetting::new(4, 5),
            Err(SubsetError::PerWorker {
                shards: 4,
                per_worker: 5
            })
        );
        assert_eq!(
            Subsetting::new(12, 5),
            Err(SubsetError::NotMultiple {
                shards: 12,
                per_worker: 5
            })
        );
        let one = Subsetting::default();
        assert!(one.is_single());
        assert_eq!(one.subset(41), vec![0]);
    }

    #[test]
    fn prefetch_is_the_capacity_split_over_the_shards() {
        assert_eq!(Subsetting::split_prefetch(8, 3), vec![3, 3, 2]);
        assert_eq!(Subsetting::split_prefetch(9, 3), vec![3, 3, 3]);
        assert_eq!(Subsetting::split_prefetch(2, 3), vec![1, 1, 1]);
        assert_eq!(Subsetting::split_prefetch(5, 1), vec![5]);
        assert_eq!(Subsetting::split_prefetch(5, 0), vec![5]);
    }
}
