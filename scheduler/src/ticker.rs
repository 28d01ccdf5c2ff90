//! Moved to the library: [`fleet::ticker`]. Kept so `crate::ticker::Ticker` still resolves.
pub use fleet::ticker::Ticker;
