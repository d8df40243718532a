//! What a run leaves on disk, and what the worker, the server and the browser agree about it:
//!
//! - `disk.rs`: the disk a run takes (its checkpoints and model), the per-account quota's
//!   formula;
//! - `elastic.rs`: a new experiment resumed from another one's checkpoint with another
//!   data-parallel degree or sharding, and which checkpoint directory that is;
//! - `export.rs`: the trained model in Hugging Face's GPT-2 format (tensor names, shapes,
//!   `config.json`).
//!
//! Imports [`crate::spec`] and [`crate::plan`] (a checkpoint holds what the planner says a
//! rank holds; a pipeline stage's blocks are the schedule's).

pub mod disk;
pub mod elastic;
pub mod export;
