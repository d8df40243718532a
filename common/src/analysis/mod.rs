//! What the lab makes of finished runs' measurements, as pure functions of specs, metrics
//! and traces (the server builds the views, the browser draws them, tests check them
//! without a database):
//!
//! - `compare.rs`: runs side by side (`GET /api/compare`): metrics, the config diff, an
//!   "equivalent?" verdict and seed bands;
//! - `pipeline.rs`: one step's forward and backward boxes per stage, the measured bubble
//!   next to the schedule's formula, and the step replayed as if each stage had a device;
//! - `replicas.rs`: fault-tolerant replicas' losses and rejoins, from their traces.
//!
//! Imports [`crate::spec`], [`crate::plan`] and [`crate::wire`].

pub mod compare;
pub mod pipeline;
pub mod replicas;
