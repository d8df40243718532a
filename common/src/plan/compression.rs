//! Gradient compression's arithmetic (`parallel.grad_compression`): how many values of
//! each gradient tensor a compressor sends, what it keeps between steps, and the bytes a
//! rank puts on the wire per step. The worker's compressors (`parallel/compression.rs`)
//! and the planner both count with these functions.
//!
//! Every tensor is seen as a matrix of `rows x cols` (a vector is one row):
//!
//! - top-k: k = ceil(ratio x n) values and their k indices (2k floats), all-gathered:
//!   every rank sends its message to the W-1 others round the ring, (W-1) x 2k;
//! - int8: n values as bytes, four to a float, plus one fp32 scale: 1 + ceil(n/4)
//!   floats, all-gathered the same way;
//! - PowerSGD: a matrix becomes P (rows x r) and Q (cols x r), each all-reduced round the
//!   ring (2(W-1)/W of each); vectors, and matrices too small to gain, go whole with P.
//!
//! Error feedback keeps what compression lost on each rank, one float per gradient value,
//! and PowerSGD each matrix's Q for the next step's warm start.

use crate::plan::ring::ring_all_reduce_bytes;
use crate::spec::{GradCompression, ModelSpec};

/// Values of an `n`-value tensor top-k sends: ceil(ratio x n), at least one.
pub fn topk_count(n: usize, ratio: f64) -> usize {
    ((n as f64 * ratio).ceil() as usize).clamp(1, n.max(1))
}

/// Floats an `n`-value tensor takes as int8: the scale, then four bytes per float.
pub fn int8_floats(n: usize) -> usize {
    1 + n.div_ceil(4)
}

/// The rank PowerSGD gives a `rows x cols` matrix, None where it goes whole (a vector, or
/// where P and Q would not be smaller than the matrix).
pub fn powersgd_rank(rows: usize, cols: usize, rank: usize) -> Option<usize> {
    let r = rank.min(rows).min(cols);
    (rows > 1 && cols > 1 && (rows + cols) * r < rows * cols).then_some(r)
}

/// How a compressor is set (`parallel.grad_compression` and its knobs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Compressor {
    pub method: GradCompression,
    pub ratio: f64,
    pub rank: usize,
}

/// Floats of one rank's messages for some gradient tensors.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Messages {
    /// All-gathered: this rank's part (top-k, int8).
    pub gathered: usize,
    /// All-reduced first: PowerSGD's P of every matrix, then the tensors sent whole.
    pub reduced_p: usize,
    /// All-reduced second: PowerSGD's Q of every matrix.
    pub reduced_q: usize,
}

impl Compressor {
    /// The messages for `shapes` (rows, cols).
    pub fn messages(&self, shapes: &[(usize, usize)]) -> Messages {
        let mut m = Messages::default();
        for &(rows, cols) in shapes {
            let n = rows * cols;
            match self.method {
                GradCompression::None => m.reduced_p += n,
                GradCompression::Topk => m.gathered += 2 * topk_count(n, self.ratio),
                GradCompression::Int8 => m.gathered += int8_floats(n),
                GradCompression::Powersgd => match powersgd_rank(rows, cols, self.rank) {
                    Some(r) => {
                        m.reduced_p += rows * r;
                        m.reduced_q += cols * r;
                    }
                    None => m.reduced_p += n,
                },
            }
        }
        m
    }

    /// Bytes one rank sends per step to compress `shapes` over `world` ranks.
    pub fn bytes_sent(&self, shapes: &[(usize, usize)], world: usize) -> u64 {
        let m = self.messages(shapes);
        let w = world as u64;
        let gathered = (m.gathered as u64).saturating_mul(w.saturating_sub(1)).saturating_mul(4);
        gathered.saturating_add(ring_all_reduce_bytes(m.reduced_p as u64, w, 4)).saturating_add(ring_all_reduce_bytes(
            m.reduced_q as u64,
            w,
            4,
        ))
    }

    /// Floats each rank keeps between steps: the error-feedback residual (one per gradient
    /// value) and PowerSGD's Q.
    pub fn state_floats(&self, shapes: &[(usize, usize)]) -> usize {
        if self.method == GradCompression::None {
            return 0;
        }
        let values: usize = shapes.iter().map(|&(rows, cols)| rows * cols).sum();
        let q = if self.method == GradCompression::Powersgd { self.messages(shapes).reduced_q } else { 0 };
        values + q
    }
}

/// The gradient tensors of one tensor-parallel rank of a pipeline stage as (rows, cols), in
/// the engine's buffer order (`model/layout.rs`): the embeddings on the first stage, the
/// stage's blocks, the final LayerNorm and the LM head on the last.
pub fn stage_shapes(m: &ModelSpec, tp: usize, layers: usize, first: bool, last: bool) -> Vec<(usize, usize)> {
    let (v, t, c, n) = (m.vocab, m.seq_len, m.d_model, tp.max(1));
    let (qkv, f) = (usize::try_from(m.qkv_width()).unwrap_or(usize::MAX), m.d_ff());
    let gpt2 = m.family.is_gpt2();
    // A norm: LayerNorm's gain and bias, RMSNorm's gain.
    let norm: &[(usize, usize)] = if gpt2 { &[(1, c), (1, c)] } else { &[(1, c)] };
    let mut shapes = Vec::new();
    if first {
        shapes.push((v, c));
        if gpt2 {
            shapes.push((t, c));
        }
    }
    for _ in 0..layers {
        shapes.extend_from_slice(norm);
        shapes.extend(match gpt2 {
            true => vec![(c, qkv / n), (1, qkv / n), (c / n, c), (1, c)],
            false => vec![(c, qkv / n), (c / n, c)],
        });
        shapes.extend_from_slice(norm);
        // the MLP; with experts (tp = 1) the router and E of them, each tensor seen as
        // (E x its rows, its columns)
        shapes.extend(match (m.experts, gpt2) {
            (0, true) => vec![(c, f / n), (1, f / n), (f / n, c), (1, c)],
            // (Llama's gate and up are one tensor of the engine's, side by side)
            (0, false) => vec![(c, 2 * f / n), (f / n, c)],
            (e, true) => vec![(c, e), (e * c, f), (e, f), (e * f, c), (e, c)],
            (e, false) => vec![(c, e), (e * c, 2 * f), (e * f, c)],
        });
    }
    if last {
        shapes.extend_from_slice(norm);
        // A tied head is the embedding's matrix: a stage of its own keeps a copy.
        if !m.tie_embeddings || !first {
            shapes.push((c, v));
        }
    }
    shapes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_method_sends_its_formula() {
        let shapes = [(64, 192), (1, 64)];
        let c = |method, ratio, rank| Compressor { method, ratio, rank };
        // top-k 1%: ceil(122.88) = 123 of the matrix, 1 of the vector, each with its index.
        let topk = c(GradCompression::Topk, 0.01, 4);
        assert_eq!(topk.messages(&shapes), Messages { gathered: 2 * (123 + 1), ..Default::default() });
        assert_eq!(topk.bytes_sent(&shapes, 4), 3 * 2 * 124 * 4);
        // int8: a scale and a quarter float per value.
        assert_eq!(c(GradCompression::Int8, 0.0, 0).messages(&shapes).gathered, 1 + 3072 + 1 + 16);
        // PowerSGD rank 4: P 64x4 and the vector, then Q 192x4, each all-reduced.
        let power = c(GradCompression::Powersgd, 0.0, 4);
        assert_eq!(power.messages(&shapes), Messages { gathered: 0, reduced_p: 256 + 64, reduced_q: 768 });
        assert_eq!(power.bytes_sent(&shapes, 2), (320 + 768) * 4);
        assert_eq!(power.state_floats(&shapes), 64 * 192 + 64 + 768);
        // Uncompressed: one all-reduce of everything.
        assert_eq!(c(GradCompression::None, 0.0, 0).bytes_sent(&shapes, 4), ring_all_reduce_bytes(12352, 4, 4));
    }

    #[test]
    fn small_matrices_and_vectors_go_whole() {
        assert_eq!(powersgd_rank(64, 64, 4), Some(4));
        assert_eq!(powersgd_rank(4, 4, 4), None, "(4+4)*4 is not below 16");
        assert_eq!(powersgd_rank(1, 64, 4), None);
        assert_eq!(powersgd_rank(64, 3, 8), None, "rank capped at 3: (64+3)*3 > 192");
        assert_eq!(topk_count(10, 0.01), 1);
        assert_eq!(topk_count(10, 1.0), 10);
    }

    #[test]
    fn stage_shapes_add_up_to_the_model() {
        let m = ModelSpec::dense(3, 64, 4, 32, 80);
        let count = |shapes: Vec<(usize, usize)>| shapes.iter().map(|&(r, c)| (r * c) as u64).sum::<u64>();
        assert_eq!(count(stage_shapes(&m, 1, 3, true, true)), m.param_count());
        let split = count(stage_shapes(&m, 1, 1, true, false))
            + count(stage_shapes(&m, 1, 1, false, false))
            + count(stage_shapes(&m, 1, 1, false, true));
        assert_eq!(split, m.param_count());
        // Llama blocks with grouped-query attention and a tied head: one stage holds every
        // parameter once; split, the last stage keeps its own copy of the head.
        let llama = ModelSpec { tie_embeddings: true, ..ModelSpec::llama(3, 64, 4, 2, 176, 32, 80) };
        assert_eq!(count(stage_shapes(&llama, 1, 3, true, true)), llama.param_count());
        let split = count(stage_shapes(&llama, 1, 1, true, false)) + count(stage_shapes(&llama, 1, 2, false, true));
        assert_eq!(split, llama.param_count() + 64 * 80);
        let moe = ModelSpec { experts: 4, ..llama };
        assert_eq!(count(stage_shapes(&moe, 1, 3, true, true)), moe.param_count());
    }
}
