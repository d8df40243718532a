//! The experiment spec: what a person asks the lab to run, and whether it may run it.
//!
//! - `experiment.rs`: the spec's types as JSON (every section defaulted, unknown fields
//!   refused) and what follows from them alone (parameter counts, world size, batch);
//! - `validate.rs`: the one set of rules the browser, the server and the worker apply
//!   ([`Limits`](validate::Limits), [`ValidSpec`](validate::ValidSpec));
//! - `presets.rs`: ready-made experiments for the form and the demos;
//! - `backends.rs`: what each backend (cpu, cuda) can run;
//! - `scale_down.rs`: a planned configuration shrunk to what this lab can run.
//!
//! The spec's types are re-exported here (`crate::spec::ExperimentSpec`) and at the crate
//! root. Imports nothing from the other domains: they all build on it.

pub mod backends;
pub mod experiment;
pub mod field_error;
pub mod presets;
pub mod scale_down;
pub mod validate;

pub use experiment::*;
