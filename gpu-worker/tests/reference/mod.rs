//! The ops written out plainly in f64, from their math alone: the independent reference the
//! op tests hold every backend to. Nothing here calls the engine; each function takes the
//! op test's buffers (same order and meaning as the check that uses it) and fills the
//! outputs the way the kernel's contract says (overwrite or accumulate).

/// `out[r] = wte[tokens[r]] + wpe[r % t]`; `dwte[tokens[r]] += dout[r]`, `dwpe[r % t] += dout[r]`
/// (no position terms when wpe is empty). Buffers: out, wte, wpe, dout, dwte, dwpe.
pub fn encoder(b: &mut [Vec<f64>], tokens: &[u32], t: usize, c: usize) {
    let positions = !b[2].is_empty();
    for (r, &tok) in tokens.iter().enumerate() {
        let (tok, pos) = (tok as usize, r % t);
        for i in 0..c {
            b[0][r * c + i] = b[1][tok * c + i] + if positions { b[2][pos * c + i] } else { 0.0 };
            let d = b[3][r * c + i];
            b[4][tok * c + i] += d;
            if positions {
                b[5][pos * c + i] += d;
            }
        }
    }
}

/// LayerNorm over rows of width `c`, eps 1e-5:
///   forward:  mean = Σx/c, var = Σ(x-mean)²/c, rstd = 1/√(var+eps), x̂ = (x-mean)·rstd,
///             out = x̂·γ + β
///   backward: dβ += dout, dγ += dout·x̂, dx += rstd·(dx̂ - mean(dx̂) - x̂·mean(dx̂·x̂)), dx̂ = dout·γ
/// Buffers: inp, gamma, beta, out, mean, rstd, dout, dinp (+=), dgamma (+=), dbeta (+=).
pub fn layernorm(b: &mut [Vec<f64>], c: usize) {
    let rows = b[0].len() / c;
    for r in 0..rows {
        let x = &b[0][r * c..(r + 1) * c];
        let mean = x.iter().sum::<f64>() / c as f64;
        let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + 1e-5).sqrt();
        let xhat: Vec<f64> = x.iter().map(|v| (v - mean) * rstd).collect();
        let dout: Vec<f64> = b[6][r * c..(r + 1) * c].to_vec();
        let dxhat: Vec<f64> = (0..c).map(|i| dout[i] * b[1][i]).collect();
        let mean_dxhat = dxhat.iter().sum::<f64>() / c as f64;
        let mean_dxhat_xhat = (0..c).map(|i| dxhat[i] * xhat[i]).sum::<f64>() / c as f64;
        for i in 0..c {
            b[3][r * c + i] = xhat[i] * b[1][i] + b[2][i];
            b[7][r * c + i] += rstd * (dxhat[i] - mean_dxhat - xhat[i] * mean_dxhat_xhat);
            b[8][i] += dout[i] * xhat[i];
            b[9][i] += dout[i];
        }
        b[4][r] = mean;
        b[5][r] = rstd;
    }
}

/// out = [residual +] inp·W [+ bias], W is (c_in, c_out);
/// dinp = dout·Wᵀ (overwritten), dW += inpᵀ·dout, dbias += Σ_rows dout.
/// Buffers: inp, weight, bias, residual, out, dout, dinp, dweight (+=), dbias (+=).
pub fn matmul(
    b: &mut [Vec<f64>],
    (with_bias, with_residual, with_dinp): (bool, bool, bool),
    c_in: usize,
    c_out: usize,
) {
    let rows = b[0].len() / c_in;
    for r in 0..rows {
        for o in 0..c_out {
            let mut sum = if with_bias { b[2][o] } else { 0.0 };
            if with_residual {
                sum += b[3][r * c_out + o];
            }
            for i in 0..c_in {
                sum += b[0][r * c_in + i] * b[1][i * c_out + o];
            }
            b[4][r * c_out + o] = sum;
        }
    }
    for r in 0..rows {
        for i in 0..c_in {
            if with_dinp {
                b[6][r * c_in + i] = (0..c_out).map(|o| b[5][r * c_out + o] * b[1][i * c_out + o]).sum();
            }
            for o in 0..c_out {
                b[7][i * c_out + o] += b[0][r * c_in + i] * b[5][r * c_out + o];
            }
        }
        if with_bias {
            for o in 0..c_out {
                b[8][o] += b[5][r * c_out + o];
            }
        }
    }
}

/// Causal self-attention per (sequence, query head h), head size hs, `kv_heads` key/value
/// heads (query head h reads K/V head g = h / (heads / kv_heads)); a row of qkv is
/// [Q (heads x hs) | K (kv_heads x hs) | V (kv_heads x hs)]:
///   s_ij = q_i·k_j / √hs (j ≤ i), a_i = softmax_j(s_ij), out_i = Σ_j a_ij v_j
///   da_ij = dout_i·v_j, dv_j += a_ij dout_i, ds_ij = a_ij (da_ij - Σ_k a_ik da_ik),
///   dq_i += Σ_j ds_ij k_j / √hs, dk_j += ds_ij q_i / √hs
/// Buffers: qkv, out, att (batch, heads, t, t; zero above the diagonal), dout, dqkv
/// (overwritten), datt (scratch, not compared).
pub fn attention(b: &mut [Vec<f64>], t: usize, heads: usize, kv_heads: usize, hs: usize) {
    let (c, kv) = (heads * hs, kv_heads * hs);
    let width = c + 2 * kv;
    let batch = b[0].len() / (t * width);
    let scale = 1.0 / (hs as f64).sqrt();
    b[4].iter_mut().for_each(|v| *v = 0.0);
    let group = heads / kv_heads;
    for n in 0..batch {
        for h in 0..heads {
            let g = h / group;
            let q = |row: usize, d: usize| row * width + h * hs + d;
            let k = |row: usize, d: usize| row * width + c + g * hs + d;
            let v = |row: usize, d: usize| row * width + c + kv + g * hs + d;
            let at = |i: usize, j: usize| ((n * heads + h) * t + i) * t + j;
            for i in 0..t {
                let qi = n * t + i;
                let scores: Vec<f64> = (0..=i)
                    .map(|j| (0..hs).map(|d| b[0][q(qi, d)] * b[0][k(n * t + j, d)]).sum::<f64>() * scale)
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = exps.iter().sum();
                for j in 0..t {
                    b[2][at(i, j)] = if j <= i { exps[j] / total } else { 0.0 };
                }
                for d in 0..hs {
                    b[1][qi * c + h * hs + d] = (0..=i).map(|j| b[2][at(i, j)] * b[0][v(n * t + j, d)]).sum();
                }
                // backward of row i
                let dout: Vec<f64> = (0..hs).map(|d| b[3][qi * c + h * hs + d]).collect();
                let datt: Vec<f64> = (0..=i).map(|j| (0..hs).map(|d| dout[d] * b[0][v(n * t + j, d)]).sum()).collect();
                let weighted: f64 = (0..=i).map(|j| b[2][at(i, j)] * datt[j]).sum();
                for j in 0..=i {
                    let a = b[2][at(i, j)];
                    let ds = a * (datt[j] - weighted);
                    let kj = n * t + j;
                    for d in 0..hs {
                        b[4][v(kj, d)] += a * dout[d];
                        b[4][q(qi, d)] += ds * b[0][k(kj, d)] * scale;
                        b[4][k(kj, d)] += ds * b[0][q(qi, d)] * scale;
                    }
                }
            }
        }
    }
}

/// RMSNorm over rows of width `c`, eps 1e-5:
///   forward:  rstd = 1/√(Σx²/c + eps), x̂ = x·rstd, out = x̂·γ
///   backward: dγ += dout·x̂, dx += rstd·(dx̂ - x̂·mean(dx̂·x̂)), dx̂ = dout·γ
/// Buffers: inp, gamma, out, rstd, dout, dinp (+=), dgamma (+=).
pub fn rmsnorm(b: &mut [Vec<f64>], c: usize) {
    let rows = b[0].len() / c;
    for r in 0..rows {
        let x = &b[0][r * c..(r + 1) * c];
        let rstd = 1.0 / (x.iter().map(|v| v * v).sum::<f64>() / c as f64 + 1e-5).sqrt();
        let xhat: Vec<f64> = x.iter().map(|v| v * rstd).collect();
        let dout: Vec<f64> = b[4][r * c..(r + 1) * c].to_vec();
        let dxhat: Vec<f64> = (0..c).map(|i| dout[i] * b[1][i]).collect();
        let mean_dxhat_xhat = (0..c).map(|i| dxhat[i] * xhat[i]).sum::<f64>() / c as f64;
        for i in 0..c {
            b[2][r * c + i] = xhat[i] * b[1][i];
            b[5][r * c + i] += rstd * (dxhat[i] - xhat[i] * mean_dxhat_xhat);
            b[6][i] += dout[i] * xhat[i];
        }
        b[3][r] = rstd;
    }
}

/// Rotary position embeddings, Hugging Face Llama's "rotate half": in each of the first
/// `rotated` heads (hs wide) of a row (`width` wide) at position p = row mod t, dimensions
/// i and i + hs/2 turn by p·θ^(-2i/hs); backward turns the gradient back. Buffers: x
/// (turned in place), dx (turned back in place).
pub fn rope(b: &mut [Vec<f64>], t: usize, rotated: usize, hs: usize, width: usize, theta: f64) {
    let half = hs / 2;
    for (buf, sign) in [(0, 1.0), (1, -1.0)] {
        for row in 0..b[buf].len() / width {
            let p = (row % t) as f64;
            for head in 0..rotated {
                for i in 0..half {
                    let angle = sign * p * theta.powf(-2.0 * i as f64 / hs as f64);
                    let (lo, hi) = (row * width + head * hs + i, row * width + head * hs + i + half);
                    let (x, y) = (b[buf][lo], b[buf][hi]);
                    b[buf][lo] = x * angle.cos() - y * angle.sin();
                    b[buf][hi] = y * angle.cos() + x * angle.sin();
                }
            }
        }
    }
}

/// SwiGLU on rows [g | u] (f each): out = g·σ(g)·u; du = dout·g·σ(g),
/// dg = dout·u·σ(g)(1 + g(1 - σ(g))). Buffers: inp (rows, 2f), out (rows, f), dout, dinp
/// (overwritten).
pub fn swiglu(b: &mut [Vec<f64>], f: usize) {
    for r in 0..b[1].len() / f {
        for j in 0..f {
            let (g, u) = (b[0][r * 2 * f + j], b[0][r * 2 * f + f + j]);
            let sig = 1.0 / (1.0 + (-g).exp());
            let dh = b[2][r * f + j];
            b[1][r * f + j] = g * sig * u;
            b[3][r * 2 * f + j] = dh * u * sig * (1.0 + g * (1.0 - sig));
            b[3][r * 2 * f + f + j] = dh * g * sig;
        }
    }
}

/// GELU, tanh approximation: u = √(2/π)(x + 0.044715x³), gelu = ½x(1 + tanh u),
/// gelu' = ½(1 + tanh u) + ½x(1 - tanh²u)·√(2/π)(1 + 3·0.044715x²).
/// Buffers: inp, out, dinout (multiplied by gelu' in place).
pub fn gelu(b: &mut [Vec<f64>]) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    for i in 0..b[0].len() {
        let x = b[0][i];
        let th = (k * (x + 0.044715 * x * x * x)).tanh();
        b[1][i] = 0.5 * x * (1.0 + th);
        b[2][i] *= 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * x * x);
    }
}

/// Softmax cross-entropy over rows of width `vocab`: probs = softmax(logits), the row's loss
/// -ln probs[target]; returns (probs, losses, sum of losses).
pub fn crossentropy_forward(logits: &[f64], targets: &[u32], vocab: usize) -> (Vec<f64>, Vec<f64>, f64) {
    let mut probs = Vec::with_capacity(logits.len());
    let mut losses = Vec::with_capacity(targets.len());
    for (row, &target) in logits.chunks(vocab).zip(targets) {
        let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let total: f64 = row.iter().map(|z| (z - max).exp()).sum();
        let start = probs.len();
        probs.extend(row.iter().map(|z| (z - max).exp() / total));
        losses.push(-probs[start + target as usize].ln());
    }
    let sum = losses.iter().sum();
    (probs, losses, sum)
}

/// dlogits = dloss · (probs - onehot(target)).
pub fn crossentropy_backward(probs: &[f64], targets: &[u32], vocab: usize, dloss: f64) -> Vec<f64> {
    let mut d: Vec<f64> = probs.iter().map(|p| dloss * p).collect();
    for (r, &target) in targets.iter().enumerate() {
        d[r * vocab + target as usize] -= dloss;
    }
    d
}
