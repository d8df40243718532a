//! Token + learned position embedding (GPT-2's "encoder").
//!
//!   forward:  x[b,t,:] = wte[tok[b,t],:] + wpe[t,:]
//!   backward: dwte[tok[b,t],:] += dx[b,t,:]      dwpe[t,:] += sum_b dx[b,t,:]
//!
//! With no position table (an empty `wpe`: Llama, whose positions are rotary, `rope.rs`)
//! the token embedding alone.
//!
//! The CPU backend calls these on chunks: forward over rows, the wpe gradient over
//! position rows, the wte gradient over vocabulary rows (each task scans all tokens
//! and adds those in its range), so every sum runs in a fixed order.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::in_acc;
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

simd_kernel! {
    /// Rows `row0..row0 + out.len()/c` of the embedded batch (rows are b * seq_len + t).
    pub fn encoder_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        tokens: &[u32],
        row0: usize,
        wte: &[S],
        wpe: &[S],
        seq_len: usize,
        c: usize,
    ) {
        for (r, x) in out.chunks_exact_mut(c).enumerate() {
            let row = row0 + r;
            let tok = tokens[row] as usize;
            let t = row % seq_len;
            let te = &wte[tok * c..(tok + 1) * c];
            if wpe.is_empty() {
                x.copy_from_slice(te);
                continue;
            }
            let pe = &wpe[t * c..(t + 1) * c];
            for ((x, &a), &b) in x.iter_mut().zip(te).zip(pe) {
                *x = S::store(a.load() + b.load());
            }
        }
    }
}

simd_kernel! {
    /// Position rows `t0..t0 + dwpe.len()/c`: `dwpe[t] += sum over sequences b of dout[b, t]`.
    pub fn encoder_backward_wpe<F: Float, S: Stored<Acc = F>>(dwpe: &mut [S], t0: usize, dout: &[S], seq_len: usize, c: usize) {
        let sequences = dout.len() / (seq_len * c);
        in_acc(dwpe, |dwpe| {
            for (i, dp) in dwpe.chunks_exact_mut(c).enumerate() {
                let t = t0 + i;
                for b in 0..sequences {
                    let row = b * seq_len + t;
                    for (d, &g) in dp.iter_mut().zip(&dout[row * c..(row + 1) * c]) {
                        *d += g.load();
                    }
                }
            }
        });
    }
}

simd_kernel! {
    /// Vocabulary rows `v0..v0 + dwte.len()/c`: adds every position whose token falls in range.
    pub fn encoder_backward_wte<F: Float, S: Stored<Acc = F>>(dwte: &mut [S], v0: usize, dout: &[S], tokens: &[u32], c: usize) {
        let v1 = v0 + dwte.len() / c;
        in_acc(dwte, |dwte| {
            for (row, &tok) in tokens.iter().enumerate() {
                let tok = tok as usize;
                if tok < v0 || tok >= v1 {
                    continue;
                }
                let dst = &mut dwte[(tok - v0) * c..(tok - v0 + 1) * c];
                for (d, &g) in dst.iter_mut().zip(&dout[row * c..(row + 1) * c]) {
                    *d += g.load();
                }
            }
        });
    }
}

/// The token and position embeddings on a backend's views (the conventions: `backend/mod.rs`).
pub trait EmbeddingKernels: Buffers {
    /// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]` (no `wpe` term when it is empty); tokens
    /// has `rows` ids, `seq_len` per sequence.
    fn encoder_forward(
        &self,
        out: Self::ViewMut<'_>,
        tokens: &[u32],
        wte: Self::View<'_>,
        wpe: Self::View<'_>,
        seq_len: usize,
        c: usize,
    );

    /// `dwte[tokens[b,t],:] += dout[b,t,:]`, `dwpe[t,:] += sum_b dout[b,t,:]` (when `dwpe`
    /// is not empty).
    fn encoder_backward(
        &self,
        dwte: Self::ViewMut<'_>,
        dwpe: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        tokens: &[u32],
        seq_len: usize,
        c: usize,
    );
}

impl<S: Stored> EmbeddingKernels for CpuBackend<S> {
    fn encoder_forward(&self, out: &mut [S], tokens: &[u32], wte: &[S], wpe: &[S], seq_len: usize, c: usize) {
        let rows = tokens.len();
        let k = self.rows_per_task(rows);
        out[..rows * c].par_chunks_mut(k * c).enumerate().for_each(|(i, chunk)| {
            encoder_forward(chunk, tokens, i * k, wte, wpe, seq_len, c);
        });
    }

    fn encoder_backward(&self, dwte: &mut [S], dwpe: &mut [S], dout: &[S], tokens: &[u32], seq_len: usize, c: usize) {
        let dout = &dout[..tokens.len() * c];
        let vocab = dwte.len() / c;
        let kv = self.rows_per_task(vocab);
        let kt = self.rows_per_task(seq_len);
        let positions = if dwpe.is_empty() { 0 } else { seq_len * c };
        rayon::join(
            || {
                dwte.par_chunks_mut(kv * c).enumerate().for_each(|(i, chunk)| {
                    encoder_backward_wte(chunk, i * kv, dout, tokens, c);
                })
            },
            || {
                dwpe[..positions].par_chunks_mut(kt * c).enumerate().for_each(|(i, chunk)| {
                    encoder_backward_wpe(chunk, i * kt, dout, seq_len, c);
                })
            },
        );
    }
}

/// The launch of the token and position embedding's kernels (`embedding.cu`): one thread per
/// element forward; backward groups the rows by token on the host so that one thread adds
/// every row of a token for one column, in row order.
#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::LaunchConfig;

    use super::EmbeddingKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{
        blocks_for, check_tokens, elementwise, int, launch, DeviceElem, DeviceView, DeviceViewMut, BLOCK, MAX_GRID_Y,
    };

    impl<S: DeviceElem> EmbeddingKernels for CudaBackend<S> {
        fn encoder_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            tokens: &[u32],
            wte: DeviceView<'_, S>,
            wpe: DeviceView<'_, S>,
            seq_len: usize,
            c: usize,
        ) {
            let gpu = &self.launcher;
            let rows = out.len / c;
            check_tokens("encoder_forward", &tokens[..rows], wte.len / c);
            let positions = wpe.len > 0;
            assert!(
                !positions || wpe.len >= seq_len.min(rows) * c,
                "encoder_forward: fewer positions than the sequence"
            );
            let tokens = gpu.upload(&tokens[..rows]);
            launch!(
                gpu,
                "encoder_forward",
                elementwise(rows * c),
                out.ptr,
                gpu.ptr_of(&tokens),
                wte.ptr,
                wpe.ptr,
                int(usize::from(positions)),
                int(rows),
                int(seq_len),
                int(c)
            );
        }

        fn encoder_backward(
            &self,
            dwte: DeviceViewMut<'_, S>,
            dwpe: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            tokens: &[u32],
            seq_len: usize,
            c: usize,
        ) {
            let gpu = &self.launcher;
            let rows = dout.len / c;
            check_tokens("encoder_backward", &tokens[..rows], dwte.len / c);
            // Group the rows by token on the host (the ids are here anyway), so that one
            // thread adds every row of a token for one column, in row order.
            let mut rows_of: Vec<u32> = (0..rows as u32).collect();
            rows_of.sort_by_key(|&r| tokens[r as usize]);
            let mut distinct = Vec::new();
            let mut starts = Vec::new();
            for (k, &r) in rows_of.iter().enumerate() {
                let token = tokens[r as usize];
                if distinct.last() != Some(&token) {
                    distinct.push(token);
                    starts.push(k as u32);
                }
            }
            starts.push(rows as u32);
            if !distinct.is_empty() {
                let (distinct_d, starts_d, rows_d) = (gpu.upload(&distinct), gpu.upload(&starts), gpu.upload(&rows_of));
                // Distinct tokens on x (up to 2^31 blocks), column blocks on y (at most 65535).
                assert!(
                    c.div_ceil(BLOCK as usize) <= MAX_GRID_Y,
                    "encoder_backward_wte: rows of {c} columns are too wide"
                );
                let cfg = LaunchConfig {
                    grid_dim: (u32::try_from(distinct.len()).expect("fewer tokens than 2^32"), blocks_for(c, BLOCK), 1),
                    block_dim: (BLOCK, 1, 1),
                    shared_mem_bytes: 0,
                };
                launch!(
                    gpu,
                    "encoder_backward_wte",
                    cfg,
                    dwte.ptr,
                    dout.ptr,
                    gpu.ptr_of(&distinct_d),
                    gpu.ptr_of(&starts_d),
                    gpu.ptr_of(&rows_d),
                    int(c)
                );
            }
            if dwpe.len == 0 {
                return;
            }
            let sequences = rows / seq_len;
            launch!(
                gpu,
                "encoder_backward_wpe",
                elementwise(seq_len * c),
                dwpe.ptr,
                dout.ptr,
                int(sequences),
                int(seq_len),
                int(c)
            );
        }
    }
}
