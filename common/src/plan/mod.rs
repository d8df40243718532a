//! What an experiment needs, predicted from its spec alone, and the arithmetic the engine
//! shares with that prediction.
//!
//! - `planner/`: memory by category and bytes by collective for one rank of every pipeline
//!   stage, the bubble and the FLOPs of a step;
//! - `estimate.rs`: the plan on a cluster (GPU memory, FLOP/s, links): fits or not, step
//!   time, MFU; `layout_search.rs`: every layout of a model on a cluster, planned and
//!   estimated; `recipes.rs`: the study chapter's three training recipes as presets;
//! - counted alike by the worker and the planner: `ring.rs` (how a ring cuts a buffer and
//!   what a rank sends), `all_reduce.rs` (each all-reduce algorithm's bytes, rank by rank),
//!   `compression.rs` (gradient compression's sizes), `schedule.rs` (the order a pipeline
//!   stage runs its passes in), `fp8_gather.rs` (FSDP's FP8 all-gather's messages).
//!
//! Pure functions of the spec (the browser runs them compiled to wasm32). Imports only
//! [`crate::spec`].

pub mod all_reduce;
pub mod compression;
pub mod estimate;
pub mod fp8_gather;
pub mod layout_search;
pub mod planner;
pub mod recipes;
pub mod ring;
pub mod schedule;
