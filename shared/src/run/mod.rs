//! A task attempt's run, from the worker's side: the claim before it runs (`start.lua`: exactly
//! one run per attempt, [`Store::claim`](crate::Store::claim)) and the outcome after
//! (`finish.lua`, [`Store::finish`](crate::Store::finish)), both beside their Rust in this
//! folder; and the wait-time histograms workers share with the scheduler's console
//! ([`waits`]).
//!
//! `waits` stays a public module: its functions read as `waits::quantile`, `waits::decode`.

mod claim;
pub mod waits;

pub use claim::{Claim, ClaimRequest, Finished};
