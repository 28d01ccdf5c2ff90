//! Settings: every setting declared once — flag, variable, default, range, help — and parsed
//! from the environment and an optional file, errors naming the setting ([`Settings`],
//! [`CommonConfig`], [`parse`]); the API's bearer tokens and roles with the axum guard
//! ([`ApiAuth`]) and the names an open API answers to ([`AllowedHosts`]).
//!
//! The top wing but [`crate::http`]: a parsed configuration holds the values of every other
//! wing (names, endpoints, the Sentinel target, subsetting, limits).

mod args;
mod auth;
mod config;
mod host;

pub use args::{
    early, markdown_table, parse, unknown, CommonArgs, CommonOnly, Early, SchedulerArgs, WorkerArgs,
};
pub use auth::{json_only, ApiAuth, Caller, Role, Tokens};
pub use config::{redis_url, CommonConfig, Origin, Settings};
pub use host::AllowedHosts;
