//! Token + learned position embedding (GPT-2's "encoder").
//!
//!   forward:  x[b,t,:] = wte[tok[b,t],:] + wpe[t,:]
//!   backward: dwte[tok[b,t],:] += dx[b,t,:]      dwpe[t,:] += sum_b dx[b,t,:]
//!
//! The CPU backend calls these on chunks: forward over rows, the wpe gradient over
//! position rows, the wte gradient over vocabulary rows (each task scans all tokens
//! and adds those in its range), so every sum runs in a fixed order.

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
