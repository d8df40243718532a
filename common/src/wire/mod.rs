//! What the server, the worker and the browser send each other:
//!
//! - `api.rs`: the HTTP API's request and response bodies (also at the crate root);
//! - `events.rs`: what a run reports while it trains, batched by the worker, stored by the
//!   server and streamed to browsers over SSE (also at the crate root);
//! - `trace.rs`: what the engine records about communication and compute (spans, ring
//!   steps, counters), for the ring replay and the timelines;
//! - `memory.rs`: what a rank's allocation tracker measured, and the memory page's view of
//!   it next to the planner's prediction.
//!
//! Imports [`crate::spec`] and [`crate::plan`]: measured memory uses the planner's breakdown
//! ([`RankMemory`](crate::plan::planner::RankMemory)), and the ring's chunks are the planner's
//! ([`chunk_range`](crate::plan::ring::chunk_range), re-exported by `trace`).

pub mod api;
pub mod events;
pub mod memory;
pub mod trace;
