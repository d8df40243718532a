//! The engine's CPU tests, one module per file, in one test binary (see Cargo.toml):
//! `cargo test -p distlab-worker --test engine [FILTER]`, a file's with `FILTER` `ops::`,
//! `gradcheck::`, `memory::`, `train::` or `collectives::`.

mod collectives;
mod gradcheck;
mod memory;
mod ops;
mod train;
