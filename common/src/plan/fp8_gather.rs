//! FSDP's FP8 all-gather (`parallel.fp8_all_gather`), counted alike by the worker and the
//! planner: what one rank sends to gather a block whose four linear weights travel as FP8.
//!
//! Each rank casts its shard of the weights to E4M3 before sending (with the weight's
//! scale: delayed, from its amax history; current, from the largest of the ranks' shard
//! amaxes, all-gathered first), so a weight element crosses the wire in one byte instead of
//! the wire format's two or four; the block's other parameters (norms, biases) keep the
//! wire format. A rank's message:
//!
//! ```text
//!   | amax f32, saturated u32, flushed u32, for each weight (48 bytes) | its chunk of the block, |  padding  |
//!   |  (what its casts saw, for the step's FP8 metrics)                | 1 byte or `wire` bytes  |           |
//! ```
//!
//! The chunks are the ring's ([`chunk_range`] of the block), but an element's bytes depend
//! on whether it is a weight's, so the chunks' bytes differ: every message is padded to the
//! longest, in whole 4-byte words, and the ring all-gathers W of them.

use std::ops::Range;

use super::ring::chunk_range;
use crate::spec::{ModelFamily, ModelSpec};

/// The block's linear layers whose weights travel as FP8: qkv, the attention projection,
/// the MLP's two.
pub const FP8_WEIGHTS: usize = 4;

/// A message's header: amax, saturated and flushed of each weight's shard, 4 bytes each.
pub const HEADER_BYTES: usize = FP8_WEIGHTS * 12;

/// One block's parameters as runs in buffer order: (elements, part of an FP8 weight). The
/// planner's copy of the worker's layout (`model/layout.rs`, one tensor-parallel rank, no
/// experts: what FP8 runs with), which the worker checks against its own.
pub fn block_runs(m: &ModelSpec) -> Vec<(usize, bool)> {
    let (c, qkv, mlp_in, ff) = (m.d_model, m.qkv_width() as usize, m.mlp_input_width() as usize, m.d_ff());
    let bias = usize::from(m.family == ModelFamily::Gpt2);
    let norm = c + c * bias;
    let runs = [
        (norm, false),
        (c * qkv, true),
        (qkv * bias, false),
        (c * c, true),
        (c * bias + norm, false),
        (c * mlp_in, true),
        (ff * bias, false),
        (ff * c, true),
        (c * bias, false),
    ];
    runs.into_iter().filter(|&(n, _)| n > 0).collect()
}

/// Bytes of `range` of a block made of `runs` on the wire: a weight's elements 1 byte,
/// the others `wire_bytes`.
pub fn range_bytes(runs: &[(usize, bool)], range: Range<usize>, wire_bytes: usize) -> usize {
    let mut at = 0;
    let mut bytes = 0;
    for &(len, fp8) in runs {
        let overlap = range.end.min(at + len).saturating_sub(range.start.max(at));
        bytes += overlap * if fp8 { 1 } else { wire_bytes };
        at += len;
    }
    bytes
}

/// Bytes of every rank's message for a block of `runs` gathered by `world` ranks: the
/// header and the longest chunk, in whole words.
pub fn message_bytes(runs: &[(usize, bool)], world: usize, wire_bytes: usize) -> usize {
    let n = runs.iter().map(|&(len, _)| len).sum();
    let longest = (0..world.max(1)).map(|r| range_bytes(runs, chunk_range(n, world, r), wire_bytes)).max();
    (HEADER_BYTES + longest.unwrap_or(0)).next_multiple_of(4)
}

/// Bytes one rank sends to gather one block: W - 1 messages round the ring, and with
/// current scaling first its four shard amaxes to each of the others (f32).
pub fn sent_per_gather(runs: &[(usize, bool)], world: usize, wire_bytes: usize, current: bool) -> u64 {
    let others = world.saturating_sub(1) as u64;
    let amaxes = if current { (FP8_WEIGHTS * 4) as u64 } else { 0 };
    others * (message_bytes(runs, world, wire_bytes) as u64 + amaxes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blocks_runs_hold_its_parameters_and_weights_cross_in_a_byte() {
        for m in [ModelSpec::dense(2, 64, 4, 32, 64), ModelSpec::llama(2, 64, 4, 2, 160, 32, 64)] {
            let runs = block_runs(&m);
            assert_eq!(runs.iter().map(|r| r.0 as u64).sum::<u64>(), m.block_params(), "{:?}", m.family);
            let weights: usize = runs.iter().filter(|r| r.1).map(|r| r.0).sum();
            let n = m.block_params() as usize;
            // one rank's bytes: weights in 1, the rest in 4 (fp32) or 2
            assert_eq!(range_bytes(&runs, 0..n, 4), weights + 4 * (n - weights));
            assert_eq!(range_bytes(&runs, 0..n, 2), weights + 2 * (n - weights));
            // the chunks' bytes add up to the block's; the message covers the longest
            let chunks: usize = (0..3).map(|r| range_bytes(&runs, chunk_range(n, 3, r), 2)).sum();
            assert_eq!(chunks, range_bytes(&runs, 0..n, 2));
            let message = message_bytes(&runs, 3, 2);
            assert!(message % 4 == 0 && 3 * (message - HEADER_BYTES) >= chunks && message < HEADER_BYTES + chunks);
            assert_eq!(sent_per_gather(&runs, 3, 2, true), 2 * (message as u64 + 16));
            assert_eq!(sent_per_gather(&runs, 1, 2, true), 0);
        }
    }
}
