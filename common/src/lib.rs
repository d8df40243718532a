//! Types every part of distlab agrees on: the server, the worker and the browser.
//!
//! Compiles for native and wasm32: no I/O, no async runtime, no database.
//!
//! The crate is cut by domain; each folder's `mod.rs` says what it holds. A domain imports
//! only from the domains listed before it (no file imports in a circle: xtask's
//! `no_crate_has_an_import_circle` test checks every crate):
//!
//! - [`spec`]: the experiment spec, its validation, presets and what each backend runs;
//! - [`plan`]: what a spec needs, predicted from it alone (memory, bytes, time, layouts),
//!   and the arithmetic the engine shares with that prediction (ring chunks, schedules);
//! - [`artifacts`]: what a run leaves on disk (checkpoints, the exported model);
//! - [`wire`]: what the server, the worker and the browser send each other;
//! - [`analysis`]: what the lab makes of a finished run's measurements;
//! - [`study`]: flashcards, the claims a run checks, the quiz and the reviews.
//!
//! The modules keep their old paths at the crate root (`distlab_common::planner`,
//! `distlab_common::trace`, ...), and the spec, API and event types stay at the root itself.

pub mod analysis;
pub mod artifacts;
pub mod plan;
pub mod spec;
pub mod study;
pub mod wire;

pub use analysis::{compare, pipeline};
pub use artifacts::{disk, elastic, export};
pub use plan::{all_reduce, compression, estimate, layout_search, planner, recipes, schedule};
pub use spec::{backends, presets, scale_down};
pub use study::{assignments, cards, claims, quiz, review};
pub use wire::{api, events, memory, trace};

pub use spec::experiment::*;
pub use spec::field_error::FieldError;
pub use spec::validate::{Limits, ValidSpec};
pub use wire::api::*;
pub use wire::events::*;

/// Version of the distlab protocol and binaries (the workspace version).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
