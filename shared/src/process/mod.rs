//! What every process is made of, below everything else in the crate: logging set-up
//! ([`telemetry`]), hiding secrets and control characters in printed text ([`redact`],
//! [`escape_controls`]), the stages a process's loops are stopped in, in order ([`Shutdown`],
//! [`Stage`]), the stop signals of a daemon (first drains, second forces: [`Signals`]), and the
//! one shape of every periodic loop ([`Ticker`]).
//!
//! `telemetry` stays a public module: its functions read as `telemetry::init`,
//! `telemetry::flush` at the binaries' edges.

mod redact;
mod shutdown;
mod signals;
pub mod telemetry;
mod ticker;

pub use redact::{escape_controls, redact};
pub use shutdown::{Shutdown, Stage};
pub use signals::{Signals, HARD_EXIT};
pub use ticker::Ticker;
