//! Types every part of distlab agrees on: the server, the worker and the browser.
//!
//! Compiles for native and wasm32: no I/O, no async runtime, no database.

pub mod all_reduce;
pub mod api;
pub mod backends;
pub mod cards;
pub mod claims;
pub mod compare;
pub mod compression;
pub mod disk;
pub mod elastic;
pub mod estimate;
pub mod events;
pub mod export;
pub mod layout_search;
pub mod memory;
pub mod pipeline;
pub mod planner;
pub mod presets;
pub mod quiz;
pub mod recipes;
pub mod review;
pub mod scale_down;
pub mod schedule;
pub mod spec;
pub mod trace;
pub mod validate;

pub use api::*;
pub use events::*;
pub use spec::*;
pub use validate::{FieldError, Limits, ValidSpec};

/// Version of the distlab protocol and binaries (the workspace version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
