//! What a frequent read answered, kept for the next identical read: a class polling its
//! experiment list, or every request of a signed-in browser asking who holds its session.
//!
//! An answer is kept with the *version* of the data it was read at (a count of this
//! process's writes to that data, `store::changes`), and served again only while the version
//! is unchanged and for at most [`MAX_AGE`]: a write made here is seen at the next read, a
//! write made elsewhere (another server of a shared PostgreSQL database, a hand-made change
//! to the database) within `MAX_AGE`. The version must be read *before* the data, so
//! that a write landing in between only makes the kept answer look older than it is.

use std::collections::HashMap;
use std::future::Future;
use std::hash::Hash;
use std::io::Write;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::body::Bytes;

/// A JSON answer kept as it is sent: plain, and gzipped for the clients that accept it (a
/// browser always does; compressing a page of the list again at every request would cost
/// ten times what sending it kept does).
#[derive(Clone)]
pub struct KeptJson {
    pub plain: Bytes,
    pub gzip: Bytes,
}

impl KeptJson {
    pub fn new(json: Vec<u8>) -> std::io::Result<Self> {
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(&json)?;
        Ok(Self { gzip: Bytes::from(encoder.finish()?), plain: Bytes::from(json) })
    }
}

/// The longest an answer is served again without reading the data anew.
pub const MAX_AGE: Duration = Duration::from_secs(1);

struct Kept<V> {
    version: u64,
    read_at: Instant,
    value: V,
}

/// At most `capacity` answers, each under its key (the read's parameters).
pub struct ReadCache<K, V> {
    capacity: usize,
    kept: Mutex<HashMap<K, Kept<V>>>,
    /// Held by the one [`Self::get_or_read`] reading the data.
    reading: tokio::sync::Mutex<()>,
}

impl<K: Eq + Hash, V: Clone> ReadCache<K, V> {
    pub fn new(capacity: usize) -> Self {
        Self { capacity, kept: Mutex::new(HashMap::new()), reading: tokio::sync::Mutex::new(()) }
    }

    /// The answer kept for `key` at the data's `version` now, else `read`'s, kept. One
    /// `read` at a time, and whoever waited for another's takes its answer: the requests
    /// that all arrive when an answer goes out of date (a class polling one page) read the
    /// data once between them, not each. (Reads of keys a client makes up, such as far
    /// pages, wait in the same line, in turn: a flood of them delays another's read by as
    /// many reads as the flood has requests open, as the pool's connections would.)
    pub async fn get_or_read<E, Read>(
        &self,
        key: K,
        version: impl Fn() -> u64,
        read: impl FnOnce() -> Read,
    ) -> Result<V, E>
    where
        Read: Future<Output = Result<V, E>>,
    {
        if let Some(value) = self.get(&key, version()) {
            return Ok(value);
        }
        let _reading = self.reading.lock().await;
        let version = version();
        if let Some(value) = self.get(&key, version) {
            return Ok(value);
        }
        let value = read().await?;
        self.put(key, version, value.clone());
        Ok(value)
    }

    /// The answer kept for `key`, if it was read at `version` less than MAX_AGE ago.
    pub fn get(&self, key: &K, version: u64) -> Option<V> {
        let kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        kept.get(key).filter(|k| k.version == version && k.read_at.elapsed() < MAX_AGE).map(|k| k.value.clone())
    }

    /// Keeps `value`, read at `version` (read before the data was). When full, every older
    /// answer is dropped first: the keys a client can make up (pages, tokens) never grow
    /// the cache past `capacity`.
    pub fn put(&self, key: K, version: u64, value: V) {
        let mut kept = self.kept.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if kept.len() >= self.capacity && !kept.contains_key(&key) {
            kept.clear();
        }
        kept.insert(key, Kept { version, read_at: Instant::now(), value });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_is_served_at_its_version_and_never_past_its_age() {
        let cache = ReadCache::new(2);
        cache.put("a", 7, 1);
        assert_eq!(cache.get(&"a", 7), Some(1));
        assert_eq!(cache.get(&"a", 8), None, "a write since");
        assert_eq!(cache.get(&"b", 7), None);
        // Full: a third key drops the others.
        cache.put("b", 7, 2);
        cache.put("c", 7, 3);
        assert_eq!((cache.get(&"a", 7), cache.get(&"b", 7), cache.get(&"c", 7)), (None, None, Some(3)));
        // Replacing a kept key does not.
        cache.put("d", 7, 4);
        cache.put("d", 7, 5);
        assert_eq!((cache.get(&"c", 7), cache.get(&"d", 7)), (Some(3), Some(5)));
        std::thread::sleep(MAX_AGE);
        assert_eq!(cache.get(&"d", 7), None, "too old");
    }

    #[test]
    fn a_kept_answer_unzips_to_its_plain_bytes() {
        use std::io::Read;
        let json = br#"{"experiments": [], "total": 0}"#.repeat(40);
        let kept = KeptJson::new(json.clone()).expect("gzip");
        assert!(kept.gzip.len() < json.len() / 4, "{} of {}", kept.gzip.len(), json.len());
        let mut unzipped = Vec::new();
        flate2::read::GzDecoder::new(&kept.gzip[..]).read_to_end(&mut unzipped).expect("gunzip");
        assert_eq!((unzipped, &kept.plain[..]), (json.clone(), &json[..]));
    }

    /// Requests that arrive together while nothing is kept read the data once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_waiting_for_a_read_take_its_answer() {
        use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
        use std::sync::Arc;
        let cache = Arc::new(ReadCache::<&str, u64>::new(4));
        let (reads, version) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicU64::new(1)));
        let ask = |cache: Arc<ReadCache<&'static str, u64>>, reads: Arc<AtomicUsize>, version: Arc<AtomicU64>| async move {
            let at = version.load(Ordering::Acquire);
            cache
                .get_or_read(
                    "page",
                    || version.load(Ordering::Acquire),
                    || async {
                        reads.fetch_add(1, Ordering::AcqRel);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok::<_, ()>(at * 10)
                    },
                )
                .await
        };
        let together: Vec<_> =
            (0..16).map(|_| tokio::spawn(ask(cache.clone(), reads.clone(), version.clone()))).collect();
        for answer in together {
            assert_eq!(answer.await.expect("a task"), Ok(10));
        }
        assert_eq!(reads.load(Ordering::Acquire), 1, "one read for all sixteen");
        // A write: the next request reads again, and sees it.
        version.fetch_add(1, Ordering::AcqRel);
        assert_eq!(ask(cache.clone(), reads.clone(), version.clone()).await, Ok(20));
        assert_eq!(reads.load(Ordering::Acquire), 2);
    }
}
