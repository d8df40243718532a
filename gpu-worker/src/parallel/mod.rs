//! Parallel strategies, one per file (as in picotron): `ddp.rs` (data parallel with
//! bucketed gradient all-reduce overlapping backward).

pub mod ddp;
