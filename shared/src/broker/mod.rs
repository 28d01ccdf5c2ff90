//! RabbitMQ: connections with retry and backoff and confirmed publishing ([`amqp`]), the node
//! list of `FLEET_AMQP_URL` for cluster failover ([`Endpoints`]), idempotent declaration of
//! exchanges and queues ([`topology`]), the delay tiers behind `not_before` and retry backoff
//! ([`delay`]), dead letters — listing without removing, replaying as new submissions
//! ([`dead`], with its scripts `dead_claim.lua`, `dead_unclaim.lua`, `dead_lock.lua` beside
//! it) — the producer that submits tasks ([`Producer`]) and deterministic subsetting of a
//! sharded group's queues ([`Subsetting`]).
//!
//! `amqp`, `topology`, `delay` and `dead` stay public modules: their free functions are read
//! with the module's name at every call site (`topology::declare_group`, `delay::hop`,
//! `amqp::publish_confirmed`, `dead::replay`); the rest is private behind the names below.

pub mod amqp;
pub mod dead;
pub mod delay;
mod endpoints;
pub mod probe;
mod producer;
mod subset;
pub mod topology;

pub use endpoints::{connect_any, Endpoints};
pub use producer::{
    publish_envelopes, PacedReport, Pacing, Producer, Progress, Submitted, CONFIRM_WINDOW,
};
pub use subset::{SubsetError, Subsetting};
