//! A ring collective's arithmetic, shared by the engine's rings, the browser's replay and
//! the planner: how a buffer is cut into one chunk per rank ([`chunk_range`]) and the
//! bytes a rank sends in a ring reduce-scatter, all-gather or all-reduce.
//!
//! ```text
//!   reduce-scatter, all-gather   every chunk but one: (W-1)/W x n
//!   all-reduce                   a reduce-scatter then an all-gather: 2(W-1)/W x n
//! ```

use std::ops::Range;

/// The elements of chunk `index` when `len` elements are split into `parts` chunks:
/// the first `len % parts` chunks hold one element more than the others. The ring
/// collectives cut buffers this way (the worker re-exports this function), so the
/// browser's replay draws the same chunks.
pub fn chunk_range(len: usize, parts: usize, index: usize) -> Range<usize> {
    let parts = parts.max(1);
    let base = len / parts;
    let extra = len % parts;
    let start = index * base + index.min(extra);
    let size = base + usize::from(index < extra);
    start..start + size
}

/// Bytes one rank sends in a ring reduce-scatter (or all-gather) of `n` elements of
/// `bytes` each over `w` ranks: every chunk but one, (w-1)/w * n when w divides n. The
/// buffer is cut like [`chunk_range`] (the smallest chunk has floor(n/w) elements), so
/// this is the largest over the ranks, and exact for the engine. A ring all-reduce is a
/// reduce-scatter followed by an all-gather: twice this, 2(w-1)/w * n.
pub fn ring_reduce_scatter_bytes(n: u64, w: u64, bytes: u64) -> u64 {
    (n - n / w.max(1)).saturating_mul(bytes)
}

/// Ring all-reduce: 2(w-1)/w * n elements sent per rank (see [`ring_reduce_scatter_bytes`]).
pub fn ring_all_reduce_bytes(n: u64, w: u64, bytes: u64) -> u64 {
    ring_reduce_scatter_bytes(n, w, bytes).saturating_mul(2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_order() {
        for len in [0, 1, 2, 7, 16, 17, 1000] {
            for parts in 1..=8 {
                let mut next = 0;
                for i in 0..parts {
                    let r = chunk_range(len, parts, i);
                    assert_eq!(r.start, next);
                    assert!(r.len() == len / parts || r.len() == len / parts + 1);
                    next = r.end;
                }
                assert_eq!(next, len);
            }
        }
        assert_eq!(chunk_range(10, 3, 0), 0..4);
        assert_eq!(chunk_range(10, 3, 2), 7..10);
    }

    #[test]
    fn ring_collectives_send_the_textbook_volumes() {
        // 8 GPUs, 1 GB of gradients: each sends 2 * 7/8 GB = 1.75 GB.
        assert_eq!(ring_all_reduce_bytes(1_000_000_000, 8, 1), 1_750_000_000);
        assert_eq!(ring_reduce_scatter_bytes(1_000_000_000, 8, 1), 875_000_000);
        // Uneven chunks (10 over 3 = 4, 3, 3): the busiest rank sends all but a 3-chunk.
        assert_eq!(ring_reduce_scatter_bytes(10, 3, 4), 7 * 4);
        assert_eq!(ring_all_reduce_bytes(123, 1, 4), 0);
    }
}
