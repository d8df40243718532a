//! FSDP's FP8 all-gather of a block (`parallel.fp8_all_gather`): each rank casts its
//! chunk of the block's four linear weights to E4M3 and sends one byte per element; the
//! norms and biases keep the wire format. The message's layout and size are shared with
//! the planner (`distlab_common::plan::fp8_gather`):
//!
//! ```text
//!   | amax f32, saturated u32, flushed u32, per weight | the chunk, element by element |  padding  |
//! ```
//!
//! The elements are cast by the same rule as the model's own casts (`Fp8Format::cast_one`)
//! with the weight's scale, so the gathered values are those the model would have cast
//! from the gathered weights: fp8(w · s) / s, exact in the storage format.

use std::ops::Range;

use distlab_common::plan::fp8_gather::{FP8_WEIGHTS, HEADER_BYTES};
use distlab_common::plan::planner::wire_bytes;
use distlab_common::Precision;
use float8::F8E4M3;

use crate::comm::ring::{pack, unpack};
use crate::model::layout::BlockTensors;
use crate::ops::float::{Float, Stored};
use crate::ops::fp8::{Fp8Cast, Fp8Format};

/// A block's parameters as FP8's gather sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockRuns {
    /// Runs in buffer order: (elements, part of an FP8 weight); the weights' runs are the
    /// four weights in order (qkv, attention projection, the MLP's two).
    pub runs: Vec<(usize, bool)>,
}

impl BlockRuns {
    /// The block `tensors` (ranges in the parameter buffer) of a unit starting at `start`.
    pub fn of(tensors: &BlockTensors<Range<usize>>, start: usize) -> Self {
        let t = tensors;
        let weights = [&t.qkv_w, &t.attn_proj_w, &t.fc_w, &t.fc_proj_w];
        let (mut runs, mut at) = (Vec::new(), start);
        for w in weights {
            if w.start > at {
                runs.push((w.start - at, false));
            }
            runs.push((w.len(), true));
            at = w.end;
        }
        if t.fc_proj_b.end > at {
            runs.push((t.fc_proj_b.end - at, false));
        }
        BlockRuns { runs }
    }

    /// The block's parameters.
    pub fn elements(&self) -> usize {
        self.runs.iter().map(|r| r.0).sum()
    }

    /// Elements of each weight.
    pub fn weight_lens(&self) -> [usize; FP8_WEIGHTS] {
        let mut lens = self.runs.iter().filter(|r| r.1).map(|r| r.0);
        std::array::from_fn(|_| lens.next().unwrap_or(0))
    }

    /// The pieces of `range` (of the block), in order: (their range in the block, the
    /// weight they belong to, if any).
    fn pieces(&self, range: Range<usize>) -> impl Iterator<Item = (Range<usize>, Option<usize>)> + '_ {
        let mut at = 0;
        let mut weight = 0;
        self.runs.iter().filter_map(move |&(len, fp8)| {
            let run = at..at + len;
            let k = fp8.then_some(weight);
            (at, weight) = (at + len, weight + usize::from(fp8));
            let piece = range.start.max(run.start)..range.end.min(run.end);
            (!piece.is_empty()).then_some((piece, k))
        })
    }

    /// The largest magnitude of each weight's elements in `chunk` (`values` its elements).
    pub fn amaxes<S: Stored>(&self, chunk: Range<usize>, values: &[S]) -> [f32; FP8_WEIGHTS] {
        let mut amaxes = [0.0f32; FP8_WEIGHTS];
        for (piece, k) in self.pieces(chunk.clone()) {
            if let Some(k) = k {
                let here = &values[piece.start - chunk.start..piece.end - chunk.start];
                amaxes[k] = here.iter().fold(amaxes[k], |m, x| m.max((x.load().to_f64() as f32).abs()));
            }
        }
        amaxes
    }

    /// This rank's message: `values` (the block's elements `chunk`), each weight's cast to
    /// E4M3 with its scale, the rest in `wire`'s format, after what the casts saw.
    pub fn encode<S: Stored>(
        &self,
        chunk: Range<usize>,
        values: &[S],
        scales: [f32; FP8_WEIGHTS],
        wire: Precision,
        message: &mut [u8],
    ) {
        let mut seen = [Fp8Cast::default(); FP8_WEIGHTS];
        let mut at = HEADER_BYTES;
        for (piece, k) in self.pieces(chunk.clone()) {
            let here = &values[piece.start - chunk.start..piece.end - chunk.start];
            for x in here {
                let v = x.load().to_f64() as f32;
                match k {
                    Some(k) => {
                        let q = Fp8Format::E4M3.cast_one(v, scales[k], &mut seen[k]);
                        message[at] = F8E4M3::from_f32(q).to_bits();
                        at += 1;
                    }
                    None => at += put_wire(v, wire, &mut message[at..]),
                }
            }
        }
        for (k, s) in seen.iter().enumerate() {
            let head = &mut message[12 * k..12 * (k + 1)];
            head[..4].copy_from_slice(&s.amax.to_le_bytes());
            head[4..8].copy_from_slice(&(s.saturated as u32).to_le_bytes());
            head[8..].copy_from_slice(&(s.flushed as u32).to_le_bytes());
        }
    }

    /// The whole block from the `world` ranks' messages (each `message_len` bytes, rank
    /// by rank), into `out`; what the casts saw, over all the ranks.
    pub fn decode<S: Stored>(
        &self,
        messages: &[u8],
        message_len: usize,
        world: usize,
        scales: [f32; FP8_WEIGHTS],
        wire: Precision,
        out: &mut [S],
    ) -> [Fp8Cast; FP8_WEIGHTS] {
        let mut seen = [Fp8Cast::default(); FP8_WEIGHTS];
        let n = self.elements();
        for r in 0..world {
            let message = &messages[r * message_len..(r + 1) * message_len];
            for (k, s) in seen.iter_mut().enumerate() {
                let word = |i: usize| {
                    let at = 12 * k + 4 * i;
                    u32::from_le_bytes(message[at..at + 4].try_into().expect("4 bytes"))
                };
                *s = s.merge(Fp8Cast {
                    amax: f32::from_bits(word(0)),
                    saturated: word(1).into(),
                    flushed: word(2).into(),
                });
            }
            let mut at = HEADER_BYTES;
            for (piece, k) in self.pieces(distlab_common::plan::ring::chunk_range(n, world, r)) {
                for y in &mut out[piece] {
                    let v = match k {
                        Some(k) => {
                            at += 1;
                            F8E4M3::from_bits(message[at - 1]).to_f32() / scales[k]
                        }
                        None => {
                            let (v, used) = get_wire(wire, &message[at..]);
                            at += used;
                            v
                        }
                    };
                    *y = S::store(S::Acc::from_f64(f64::from(v)));
                }
            }
        }
        seen
    }
}

/// `v` in `wire`'s format at the start of `out` (the 2-byte formats rounded as the ring's
/// wire rounds them); the bytes it took.
fn put_wire(v: f32, wire: Precision, out: &mut [u8]) -> usize {
    match wire {
        Precision::Fp32 => out[..4].copy_from_slice(&v.to_le_bytes()),
        _ => out[..2].copy_from_slice(&pack(wire, v).to_le_bytes()),
    }
    wire_bytes(wire) as usize
}

/// The value [`put_wire`] wrote at the start of `bytes`, and the bytes it took.
fn get_wire(wire: Precision, bytes: &[u8]) -> (f32, usize) {
    match wire {
        Precision::Fp32 => (f32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")), 4),
        _ => (unpack(wire, u16::from_le_bytes([bytes[0], bytes[1]])), 2),
    }
}

#[cfg(test)]
mod tests {
    use distlab_common::plan::fp8_gather::{block_runs, message_bytes};
    use distlab_common::plan::ring::chunk_range;
    use distlab_common::ModelSpec;

    use super::*;
    use crate::model::ParamLayout;
    use crate::ops::fp8::Fp8Format;

    /// The planner's copy of a block's runs is the layout's.
    #[test]
    fn the_planners_block_runs_are_the_layouts() {
        for m in [ModelSpec::dense(3, 64, 4, 32, 64), ModelSpec::llama(3, 64, 4, 2, 160, 32, 64)] {
            let lay = ParamLayout::new(&m);
            for (l, tensors) in lay.blocks.iter().enumerate() {
                let block = BlockRuns::of(tensors, tensors.ln1_g.start);
                assert_eq!(block.runs, block_runs(&m), "{:?} block {l}", m.family);
            }
        }
    }

    /// Every rank's message decoded gives each weight's elements cast (fp8(w·s)/s, what the
    /// model's cast makes of them) and the rest as they were (an f32 wire), and the casts'
    /// counts over the whole block.
    #[test]
    fn messages_decode_to_the_cast_weights_and_the_rest_unchanged() {
        let m = ModelSpec::dense(1, 32, 4, 16, 64);
        let lay = ParamLayout::new(&m);
        let block = BlockRuns::of(&lay.blocks[0], lay.blocks[0].ln1_g.start);
        let n = block.elements();
        let values: Vec<f32> = (0..n).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-4).collect();
        let world = 3;
        let scales = [2f32.powi(10), 2f32.powi(12), 2f32.powi(-2), 2f32.powi(20)];
        let len = message_bytes(&block.runs, world, 4);
        let mut messages = vec![0u8; world * len];
        for r in 0..world {
            let chunk = chunk_range(n, world, r);
            block.encode(chunk.clone(), &values[chunk], scales, Precision::Fp32, &mut messages[r * len..(r + 1) * len]);
        }
        let mut out = vec![0.0f32; n];
        let seen = block.decode(&messages, len, world, scales, Precision::Fp32, &mut out);
        let mut want_seen = [Fp8Cast::default(); FP8_WEIGHTS];
        for (piece, k) in block.pieces(0..n) {
            for i in piece {
                let want = match k {
                    Some(k) => Fp8Format::E4M3.cast_one(values[i], scales[k], &mut want_seen[k]) / scales[k],
                    None => values[i],
                };
                assert_eq!(out[i].to_bits(), want.to_bits(), "element {i}");
            }
        }
        assert_eq!(seen, want_seen);
        assert!(seen[3].saturated > 0 && seen.iter().map(|s| s.flushed).sum::<u64>() > 0, "{seen:?}");
        // the shards' amaxes are the weights'
        let amaxes = block.amaxes(0..n, &values);
        assert_eq!(amaxes, std::array::from_fn(|k| seen[k].amax));
    }
}
