//! The HTTP API: one file per resource, each with its handlers and their OpenAPI entries
//! (`routes.rs` lists them all). Handlers read and write through the store, publish to the
//! live hub, and answer JSON; `error.rs` is the error shape every answer shares and
//! `extract.rs` the request parsing that keeps to it.

pub mod compare;
pub mod datasets;
pub mod error;
pub mod experiments;
pub mod extract;
pub mod health;
pub mod memory;
pub mod metrics;
pub mod models;
pub mod openapi;
pub mod plan;
pub mod sampling;
pub mod session;
pub mod stream;
pub mod study;
pub mod traces;
pub mod workers;
