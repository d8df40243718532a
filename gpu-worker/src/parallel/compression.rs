//! Gradient compression for DDP (`parallel.grad_compression`), with error feedback.
//!
//! DDP's communication thread hands each gradient bucket to [`Compressor::exchange`]
//! instead of all-reducing it. Every rank compresses its own gradient, the ranks exchange
//! the compressed messages, and every rank ends with the same sum of what they sent:
//!
//! ```text
//!   acc      = g + e                       (e: what compression lost on earlier steps)
//!   sent     = C(acc)                      (top-k / int8 / PowerSGD, per tensor)
//!   e        = acc - what this rank sent   (error feedback: nothing is lost for good)
//!   g        = sum over ranks of sent      (the same on every rank)
//! ```
//!
//! - **top-k**: each tensor's k = ceil(ratio x n) values of largest magnitude and their
//!   indices, all-gathered; every rank adds them up in rank order.
//! - **int8**: each tensor scaled by max|acc| / 127 and rounded to integers in [-127, 127],
//!   sent as bytes with the scale, all-gathered and added up in rank order.
//! - **PowerSGD** (Vogels et al., 2019): a matrix M (rows x cols) is approximated by
//!   P Q^T with rank r. P = M Q is all-reduced (Q: last step's, the warm start), its
//!   columns orthonormalised (the same on every rank), then Q = M^T P is all-reduced:
//!   P Q^T = P P^T (sum of M) is the sum's projection onto P's columns. Each rank's loss is
//!   M - P P^T M. Vectors, and matrices too small to gain, are all-reduced whole with P.
//!
//! What each sends is `distlab_common::compression`'s formula, which the planner counts.

use std::ops::Range;
use std::sync::Arc;

use distlab_common::compression::{int8_floats, powersgd_rank, topk_count, Compressor as Settings};
use distlab_common::GradCompression;

use crate::comm::{CommError, Communicator, ReduceOp};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::ParamLayout;
use crate::rng::Rng;

/// One gradient tensor of a bucket: where it starts in the bucket, seen as rows x cols.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketTensor {
    pub at: usize,
    pub rows: usize,
    pub cols: usize,
}

impl BucketTensor {
    fn range(&self) -> Range<usize> {
        self.at..self.at + self.rows * self.cols
    }

    /// The gradient tensors of `layout` inside `range` of its buffer, placed from the
    /// range's start (a vector is one row).
    pub fn of_range(layout: &ParamLayout, range: &Range<usize>) -> Vec<BucketTensor> {
        let inside = layout.tensors.iter().filter(|t| range.start <= t.range.start && t.range.end <= range.end);
        inside
            .map(|t| {
                let cols = t.shape.last().copied().unwrap_or(1);
                BucketTensor { at: t.range.start - range.start, rows: t.range.len() / cols.max(1), cols }
            })
            .collect()
    }

    /// `tensors` cut into the buckets at `buckets` (ranges of the same buffer; a tensor
    /// lies in one bucket), each placed from its bucket's start.
    pub fn per_bucket(tensors: &[BucketTensor], buckets: &[Range<usize>]) -> Vec<Vec<BucketTensor>> {
        buckets
            .iter()
            .map(|b| {
                let inside = tensors.iter().filter(|t| b.start <= t.at && t.at + t.rows * t.cols <= b.end);
                inside.map(|t| BucketTensor { at: t.at - b.start, ..t.clone() }).collect()
            })
            .collect()
    }
}

/// One rank's compressor for every bucket of its gradient.
pub struct Compressor {
    settings: Settings,
    /// Per bucket: its tensors in buffer order.
    tensors: Vec<Vec<BucketTensor>>,
    /// Per bucket: what compression has not sent yet (error feedback).
    residual: Vec<Vec<f32>>,
    /// Per bucket: PowerSGD's Q of the last step for every matrix it compresses, in order.
    warm_q: Vec<Vec<f32>>,
    memory: Arc<MemoryTracker>,
    _receipts: Vec<Receipt>,
}

impl Compressor {
    /// A compressor for buckets made of `tensors` (per bucket, in buffer order).
    pub fn new(settings: Settings, tensors: Vec<Vec<BucketTensor>>, memory: &Arc<MemoryTracker>) -> Self {
        let residual: Vec<Vec<f32>> =
            tensors.iter().map(|ts| vec![0.0; ts.iter().map(|t| t.rows * t.cols).sum()]).collect();
        let warm_q: Vec<Vec<f32>> = tensors
            .iter()
            .enumerate()
            .map(|(bucket, ts)| match settings.method {
                GradCompression::Powersgd => first_q(bucket, ts, settings.rank),
                _ => Vec::new(),
            })
            .collect();
        let floats = residual.iter().chain(&warm_q).map(Vec::len).sum();
        let receipts = vec![memory.alloc(Category::CompressionState, floats)];
        Compressor { settings, tensors, residual, warm_q, memory: memory.clone(), _receipts: receipts }
    }

    /// The method's name, for the timeline.
    pub fn name(&self) -> &'static str {
        self.settings.method.as_str()
    }

    /// What bucket `bucket`'s compression has not sent yet.
    pub fn residual(&self, bucket: usize) -> &[f32] {
        &self.residual[bucket]
    }

    /// What a checkpoint keeps of it: every bucket's residual end to end, and PowerSGD's
    /// Qs end to end (empty for the other methods).
    pub fn state(&self) -> (Vec<f32>, Vec<f32>) {
        (self.residual.concat(), self.warm_q.concat())
    }

    /// Puts back [`Self::state`] of the same rank of the same run.
    pub fn load(&mut self, residual: &[f32], q: &[f32]) -> Result<(), String> {
        fn fill(pieces: &mut [Vec<f32>], saved: &[f32], what: &str) -> Result<(), String> {
            let held: usize = pieces.iter().map(Vec::len).sum();
            if held != saved.len() {
                return Err(format!("the checkpoint's {what} holds {} values, the compressor {held}", saved.len()));
            }
            let mut rest = saved;
            for piece in pieces {
                let (mine, after) = rest.split_at(piece.len());
                piece.copy_from_slice(mine);
                rest = after;
            }
            Ok(())
        }
        fill(&mut self.residual, residual, "compression residual")?;
        fill(&mut self.warm_q, q, "PowerSGD Q")
    }

    /// Replaces `grads`, this rank's gradient of bucket `bucket`, with the sum over the
    /// group of what every rank sent of its gradient plus residual; keeps the rest.
    pub fn exchange(&mut self, comm: &mut dyn Communicator, bucket: usize, grads: &mut [f32]) -> Result<(), CommError> {
        let (tensors, residual) = (&self.tensors[bucket], &mut self.residual[bucket]);
        if grads.len() != residual.len() {
            return Err(bad(format!("bucket {bucket} has {} gradients, its residual {}", grads.len(), residual.len())));
        }
        for (g, e) in grads.iter_mut().zip(residual.iter()) {
            *g += *e;
        }
        let memory = &self.memory;
        match self.settings.method {
            // (never built for None; were it, a plain sum)
            GradCompression::None => comm.all_reduce(grads, ReduceOp::Sum),
            GradCompression::Topk => topk_exchange(comm, memory, tensors, self.settings.ratio, grads, residual),
            GradCompression::Int8 => int8_exchange(comm, memory, tensors, grads, residual),
            GradCompression::Powersgd => {
                let q = &mut self.warm_q[bucket];
                powersgd_exchange(comm, memory, tensors, self.settings.rank, q, grads, residual)
            }
        }
    }
}

fn bad(detail: String) -> CommError {
    CommError::BadBuffer { collective: "compressed gradient exchange".into(), detail }
}

/// All-gathers `mine` (as long on every rank) and hands each rank's message to `add`,
/// in rank order, so that every rank adds them up the same way.
fn gather_and_add(
    comm: &mut dyn Communicator,
    memory: &Arc<MemoryTracker>,
    mine: &[f32],
    mut add: impl FnMut(&[f32]) -> Result<(), CommError>,
) -> Result<(), CommError> {
    let _receipt = memory.alloc(Category::Transient, mine.len() * comm.size());
    let mut all = vec![0.0; mine.len() * comm.size()];
    comm.all_gather(mine, &mut all)?;
    all.chunks(mine.len().max(1)).try_for_each(&mut add)
}

/// The indices of the `k` values of largest magnitude (ties: the lower index), ascending.
fn largest(values: &[f32], k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    if k < values.len() {
        let bigger_first = |&a: &usize, &b: &usize| values[b].abs().total_cmp(&values[a].abs()).then(a.cmp(&b));
        order.select_nth_unstable_by(k.saturating_sub(1), bigger_first);
        order.truncate(k);
    }
    order.sort_unstable();
    order
}

/// Top-k: per tensor, k indices (their bits as floats) then their k values.
fn topk_exchange(
    comm: &mut dyn Communicator,
    memory: &Arc<MemoryTracker>,
    tensors: &[BucketTensor],
    ratio: f64,
    grads: &mut [f32],
    residual: &mut [f32],
) -> Result<(), CommError> {
    let mut message = Vec::new();
    for t in tensors {
        let acc = &grads[t.range()];
        let chosen = largest(acc, topk_count(acc.len(), ratio));
        message.extend(chosen.iter().map(|&i| f32::from_bits(i as u32)));
        message.extend(chosen.iter().map(|&i| acc[i]));
        // Error feedback: all but what is sent stays here.
        let kept = &mut residual[t.range()];
        kept.copy_from_slice(acc);
        chosen.iter().for_each(|&i| kept[i] = 0.0);
    }
    grads.fill(0.0);
    gather_and_add(comm, memory, &message, |theirs| {
        let mut at = 0;
        for t in tensors {
            let k = topk_count(t.rows * t.cols, ratio);
            let (indices, values) = theirs[at..at + 2 * k].split_at(k);
            let (sum, n) = (&mut grads[t.range()], t.rows * t.cols);
            for (i, v) in indices.iter().zip(values) {
                let i = i.to_bits() as usize;
                *sum.get_mut(i).ok_or_else(|| bad(format!("index {i} is outside a tensor of {n}")))? += v;
            }
            at += 2 * k;
        }
        Ok(())
    })
}

/// int8: per tensor, the scale, then the integers four to a float (little-endian bytes).
fn int8_exchange(
    comm: &mut dyn Communicator,
    memory: &Arc<MemoryTracker>,
    tensors: &[BucketTensor],
    grads: &mut [f32],
    residual: &mut [f32],
) -> Result<(), CommError> {
    let mut message = Vec::new();
    for t in tensors {
        let acc = &grads[t.range()];
        // (a non-finite value makes the scale NaN, so that the sum shows it, not a 0)
        let finite = acc.iter().all(|v| v.is_finite());
        let scale = if finite { acc.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0 } else { f32::NAN };
        let quantized: Vec<i8> =
            acc.iter().map(|&v| if scale > 0.0 { (v / scale).round().clamp(-127.0, 127.0) as i8 } else { 0 }).collect();
        message.push(scale);
        message.extend(quantized.chunks(4).map(|q| {
            let mut bytes = [0u8; 4];
            q.iter().zip(&mut bytes).for_each(|(q, b)| *b = *q as u8);
            f32::from_bits(u32::from_le_bytes(bytes))
        }));
        for ((e, &v), &q) in residual[t.range()].iter_mut().zip(acc).zip(&quantized) {
            *e = v - f32::from(q) * scale;
        }
    }
    grads.fill(0.0);
    gather_and_add(comm, memory, &message, |theirs| {
        let mut at = 0;
        for t in tensors {
            let n = t.rows * t.cols;
            let scale = theirs[at];
            let words = &theirs[at + 1..at + int8_floats(n)];
            for (i, sum) in grads[t.range()].iter_mut().enumerate() {
                let q = words[i / 4].to_bits().to_le_bytes()[i % 4] as i8;
                *sum += f32::from(q) * scale;
            }
            at += int8_floats(n);
        }
        Ok(())
    })
}

/// The random stream PowerSGD's Q is drawn from.
const POWERSGD_STREAM: u64 = 0x504f_5745_5253_4744;

/// PowerSGD's starting Q for a bucket: N(0, 1) values, the same on every rank.
fn first_q(bucket: usize, tensors: &[BucketTensor], rank: usize) -> Vec<f32> {
    let floats = tensors.iter().filter_map(|t| powersgd_rank(t.rows, t.cols, rank).map(|r| t.cols * r)).sum();
    let mut rng = Rng::from_parts(&[POWERSGD_STREAM, bucket as u64]);
    (0..floats).map(|_| rng.normal() as f32).collect()
}

/// PowerSGD: P = M Q for every matrix (then the whole tensors) all-reduced, P's columns
/// orthonormalised, Q = M^T P all-reduced, M replaced by P Q^T.
fn powersgd_exchange(
    comm: &mut dyn Communicator,
    memory: &Arc<MemoryTracker>,
    tensors: &[BucketTensor],
    rank: usize,
    warm_q: &mut [f32],
    grads: &mut [f32],
    residual: &mut [f32],
) -> Result<(), CommError> {
    let matrices: Vec<(&BucketTensor, usize)> =
        tensors.iter().filter_map(|t| powersgd_rank(t.rows, t.cols, rank).map(|r| (t, r))).collect();
    let whole: Vec<&BucketTensor> = tensors.iter().filter(|t| powersgd_rank(t.rows, t.cols, rank).is_none()).collect();
    let p_len: usize = matrices.iter().map(|(t, r)| t.rows * r).sum::<usize>();
    let whole_len: usize = whole.iter().map(|t| t.rows * t.cols).sum();
    let _receipt = memory.alloc(Category::Transient, p_len + whole_len + warm_q.len());

    // P = M Q (rows x r) per matrix, then the tensors that go whole.
    let mut p = Vec::with_capacity(p_len + whole_len);
    let mut q_at = 0;
    for &(t, r) in &matrices {
        let q = &warm_q[q_at..q_at + t.cols * r];
        p.extend(matmul(&grads[t.range()], q, t.rows, t.cols, r));
        q_at += t.cols * r;
    }
    for t in &whole {
        p.extend_from_slice(&grads[t.range()]);
    }
    comm.all_reduce(&mut p, ReduceOp::Sum)?;

    // Q = M^T P with P's columns orthonormal; the rank keeps M - P Q^T.
    let mut q = Vec::with_capacity(warm_q.len());
    let mut p_at = 0;
    for &(t, r) in &matrices {
        let p_t = &mut p[p_at..p_at + t.rows * r];
        orthonormalise_columns(p_t, t.rows, r);
        let m = &grads[t.range()];
        let q_t = matmul_transposed(m, p_t, t.rows, t.cols, r);
        let approx = matmul_by_transpose(p_t, &q_t, t.rows, t.cols, r);
        for ((e, &m), a) in residual[t.range()].iter_mut().zip(m).zip(approx) {
            *e = m - a;
        }
        q.extend(q_t);
        p_at += t.rows * r;
    }
    if !q.is_empty() {
        comm.all_reduce(&mut q, ReduceOp::Sum)?;
    }

    // The sum's approximation P Q^T; Q starts the next step.
    let (mut p_at, mut q_at) = (0, 0);
    for (m, &(t, r)) in matrices.iter().enumerate() {
        let (p_t, q_t) = (&p[p_at..p_at + t.rows * r], &q[q_at..q_at + t.cols * r]);
        grads[t.range()].copy_from_slice(&matmul_by_transpose(p_t, q_t, t.rows, t.cols, r));
        let warm = &mut warm_q[q_at..q_at + t.cols * r];
        warm.copy_from_slice(q_t);
        // A column of Q that is zero (or not finite) would stay so: it starts afresh, from
        // numbers every rank draws alike (every rank has the same Q).
        for j in 0..r {
            if (0..t.cols).all(|i| warm[i * r + j] == 0.0) || (0..t.cols).any(|i| !warm[i * r + j].is_finite()) {
                let mut rng = Rng::from_parts(&[POWERSGD_STREAM, m as u64, j as u64, t.at as u64]);
                (0..t.cols).for_each(|i| warm[i * r + j] = rng.normal() as f32);
            }
        }
        p_at += t.rows * r;
        q_at += t.cols * r;
    }
    for t in &whole {
        grads[t.range()].copy_from_slice(&p[p_at..p_at + t.rows * t.cols]);
        residual[t.range()].fill(0.0);
        p_at += t.rows * t.cols;
    }
    Ok(())
}

/// M (rows x cols) times Q (cols x r): rows x r.
fn matmul(m: &[f32], q: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * r];
    for (m_row, out_row) in m.chunks_exact(cols).zip(out.chunks_exact_mut(r)) {
        for (&x, q_row) in m_row.iter().zip(q.chunks_exact(r)) {
            out_row.iter_mut().zip(q_row).for_each(|(o, &y)| *o += x * y);
        }
    }
    out
}

/// M^T (cols x rows) times P (rows x r): cols x r.
fn matmul_transposed(m: &[f32], p: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; cols * r];
    for (m_row, p_row) in m.chunks_exact(cols).zip(p.chunks_exact(r)).take(rows) {
        for (&x, out_row) in m_row.iter().zip(out.chunks_exact_mut(r)) {
            out_row.iter_mut().zip(p_row).for_each(|(o, &y)| *o += x * y);
        }
    }
    out
}

/// P (rows x r) times Q^T (r x cols): rows x cols.
fn matmul_by_transpose(p: &[f32], q: &[f32], rows: usize, cols: usize, r: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; rows * cols];
    for (p_row, out_row) in p.chunks_exact(r).zip(out.chunks_exact_mut(cols)).take(rows) {
        for (o, q_row) in out_row.iter_mut().zip(q.chunks_exact(r)) {
            *o = p_row.iter().zip(q_row).map(|(&a, &b)| a * b).sum();
        }
    }
    out
}

/// Gram-Schmidt on the `r` columns of `p` (rows x r): each column made orthogonal to the
/// ones before it and of length 1 (a column that vanishes is left zero).
fn orthonormalise_columns(p: &mut [f32], rows: usize, r: usize) {
    for j in 0..r {
        for k in 0..j {
            let dot: f64 = (0..rows).map(|i| p[i * r + j] as f64 * p[i * r + k] as f64).sum();
            (0..rows).for_each(|i| p[i * r + j] -= (dot as f32) * p[i * r + k]);
        }
        let norm = (0..rows).map(|i| (p[i * r + j] as f64).powi(2)).sum::<f64>().sqrt();
        let scale = if norm > 1e-20 { 1.0 / norm as f32 } else { 0.0 };
        (0..rows).for_each(|i| p[i * r + j] *= scale);
    }
}

/// Checkpoint sections of gradient compression's state (see [`GradSync::compression_state`]).
pub const COMPRESSION_RESIDUAL: &str = "compression_residual";
pub const COMPRESSION_Q: &str = "compression_q";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn largest_picks_by_magnitude_lower_index_on_ties() {
        assert_eq!(largest(&[0.1, -3.0, 2.0, 3.0, 0.0], 2), vec![1, 3]);
        assert_eq!(largest(&[1.0, 1.0, 1.0], 2), vec![0, 1]);
        assert_eq!(largest(&[1.0, 2.0], 5), vec![0, 1]);
    }

    #[test]
    fn products_and_gram_schmidt() {
        // M = [[1,2],[3,4],[5,6]], Q = [[1],[1]]: M Q = [3, 7, 11]; M^T P; P Q^T.
        let m = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        assert_eq!(matmul(&m, &[1.0, 1.0], 3, 2, 1), vec![3.0, 7.0, 11.0]);
        assert_eq!(matmul_transposed(&m, &[1.0, 0.0, 1.0], 3, 2, 1), vec![6.0, 8.0]);
        assert_eq!(matmul_by_transpose(&[1.0, 2.0, 3.0], &[1.0, 10.0], 3, 2, 1), vec![1.0, 10.0, 2.0, 20.0, 3.0, 30.0]);
        let mut p = vec![3.0, 1.0, 4.0, 1.0, 0.0, 0.0];
        orthonormalise_columns(&mut p, 3, 2);
        let col = |j: usize| [p[j], p[2 + j], p[4 + j]];
        let dot = |a: [f32; 3], b: [f32; 3]| a.iter().zip(&b).map(|(x, y)| x * y).sum::<f32>();
        assert!((dot(col(0), col(0)) - 1.0).abs() < 1e-6 && (dot(col(1), col(1)) - 1.0).abs() < 1e-6);
        assert!(dot(col(0), col(1)).abs() < 1e-6);
    }
}
