//! Counts of this process's writes to each database, one per kind of data a cached read
//! depends on (`read_cache.rs`): every store function that changes what an experiment list
//! shows, or who holds a session, counts its write once it is committed ([`Writing`]).
//!
//! A write this process did not make (another server of a shared PostgreSQL database, a
//! hand-made change) is not counted: the cache's age bound covers it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::store::{ByDatabase, Db};

/// What a cached read depends on.
#[derive(Clone, Copy)]
pub enum Data {
    /// Experiments as a list shows them: name, owner, status, attempt, times, error,
    /// summary, and the steps done (metrics).
    Experiments,
    /// Sessions and the accounts holding them.
    Sessions,
}

/// One database's counts, by [`Data`].
type Counts = [AtomicU64; 2];

/// The counts of database `db` (by its URL: the servers of one process, as the tests
/// start them, each have their own).
fn counts(db: &Db) -> Arc<Counts> {
    static BY_DATABASE: ByDatabase<Counts> = ByDatabase::new();
    BY_DATABASE.of(db)
}

/// Counts a write to `data` when dropped: made before a store function's first statement
/// (before its transaction, so that it is dropped after it), it counts once the write is
/// committed or rolled back, on every path out of the function. A write that changed
/// nothing costs a cached read, never a wrong answer.
#[must_use = "the write is counted when this is dropped"]
pub struct Writing {
    counts: Arc<Counts>,
    data: Data,
    wrote: bool,
}

impl Writing {
    pub fn to(db: &Db, data: Data) -> Self {
        Self { counts: counts(db), data, wrote: true }
    }

    /// This path wrote nothing: not counted.
    pub fn unchanged(mut self) {
        self.wrote = false;
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        if self.wrote {
            self.counts[self.data as usize].fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The count of writes to `data` in `db` so far: read it before reading the data.
pub fn version(db: &Db, data: Data) -> u64 {
    counts(db)[data as usize].load(Ordering::Acquire)
}
