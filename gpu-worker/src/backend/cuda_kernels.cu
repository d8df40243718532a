// The CUDA backend's kernels (every one except the GEMMs, which go through cuBLAS).
// Compiled by NVRTC when the backend starts, once per storage format: one of ELEM_F32,
// ELEM_BF16, ELEM_F16 is defined. Each kernel loads elements as float, computes in
// float and rounds once on the store, as the CPU kernels do (model/*.rs holds the math
// of each; the comments here only say how the work is split).
//
// Every kernel is deterministic: no atomics; a sum over rows runs in a fixed order.

#if defined(ELEM_F32)
typedef float elem;
__device__ __forceinline__ float load(elem x) { return x; }
__device__ __forceinline__ elem store(float x) { return x; }
#elif defined(ELEM_BF16)
typedef unsigned short elem;
__device__ __forceinline__ float load(elem x) { return __uint_as_float(((unsigned int)x) << 16); }
// Round to nearest, ties to even (as the `half` crate does); NaN stays a quiet NaN.
__device__ __forceinline__ elem store(float x) {
    unsigned int u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (elem)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (elem)(u >> 16);
}
#elif defined(ELEM_F16)
typedef unsigned short elem;
__device__ __forceinline__ float load(elem x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ elem store(float x) {
    elem h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
#error "define ELEM_F32, ELEM_BF16 or ELEM_F16"
#endif

#define WARP 32
// Values per lane a warp-per-row kernel keeps in registers: rows up to 32 x 32 = 1024 wide
// (every d_model and seq_len the limits allow) are read once; wider rows loop over memory.
#define ROW_REGS 32
// (NVRTC has no math.h: its INFINITY and NAN, by their bits)
#define NEG_INF __int_as_float(0xff800000)
#define QUIET_NAN __int_as_float(0x7fffffff)
#define BLOCK 256

__device__ __forceinline__ float warp_sum(float x) {
    for (int o = WARP / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
    for (int o = WARP / 2; o > 0; o /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// Sum over the BLOCK threads of a block (every thread gets it); `shared` holds BLOCK/WARP floats.
__device__ float block_sum(float x, float* shared) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < BLOCK / WARP; w++) total += shared[w];
    return total;
}

__device__ float block_max(float x, float* shared) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) shared[warp] = x;
    __syncthreads();
    float m = shared[0];
    for (int w = 1; w < BLOCK / WARP; w++) m = fmaxf(m, shared[w]);
    return m;
}

// ---- memory and reductions -------------------------------------------------------------

extern "C" __global__ void fill(elem* out, long long n, float value) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = store(value);
}

// Block b adds elements [b*chunk, (b+1)*chunk) (their squares with `squares`) in double,
// in a fixed tree; the host adds the blocks' sums in order.
extern "C" __global__ void partial_sums(const elem* x, long long n, long long chunk, double* out, int squares) {
    __shared__ double shared[BLOCK];
    long long start = (long long)blockIdx.x * chunk;
    long long end = min(start + chunk, n);
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += BLOCK) {
        double v = (double)load(x[i]);
        acc += squares ? v * v : v;
    }
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = shared[0];
}

// dst[j] += sum over blocks b (in order) of partial[b * c + j]: the second half of a
// column sum whose first half left one row block's sums per row of `partial`.
extern "C" __global__ void add_column_partials(elem* dst, const float* partial, int blocks, int c) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) acc += partial[(long long)b * c + j];
    dst[j] = store(load(dst[j]) + acc);
}

// partial[b * c + j] = sum over rows r of row block b (rows_per_block of them) of x[r, j].
extern "C" __global__ void column_partials(float* partial, const elem* x, int rows, int c, int rows_per_block) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y;
    if (j >= c) return;
    int r1 = min(rows, (b + 1) * rows_per_block);
    float acc = 0.0f;
    for (int r = b * rows_per_block; r < r1; r++) acc += load(x[(long long)r * c + j]);
    partial[(long long)b * c + j] = acc;
}

// ---- embeddings (model/embedding.rs) ---------------------------------------------------

extern "C" __global__ void encoder_forward(elem* out, const unsigned int* tokens, const elem* wte, const elem* wpe,
                                           int rows, int seq_len, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * c) return;
    int row = (int)(i / c), j = (int)(i % c);
    int t = row % seq_len;
    out[i] = store(load(wte[(long long)tokens[row] * c + j]) + load(wpe[(long long)t * c + j]));
}

// One thread per (distinct token u, column j): adds dout over the rows holding that token
// (`rows_of` lists them, token by token, in row order; `starts` has distinct + 1 offsets).
extern "C" __global__ void encoder_backward_wte(elem* dwte, const elem* dout, const unsigned int* distinct,
                                                const unsigned int* starts, const unsigned int* rows_of, int c) {
    int u = blockIdx.x;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float acc = 0.0f;
    for (unsigned int k = starts[u]; k < starts[u + 1]; k++) acc += load(dout[(long long)rows_of[k] * c + j]);
    long long at = (long long)distinct[u] * c + j;
    dwte[at] = store(load(dwte[at]) + acc);
}

// One thread per (position t, column j): adds dout over the sequences, in order.
extern "C" __global__ void encoder_backward_wpe(elem* dwpe, const elem* dout, int sequences, int seq_len, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)seq_len * c) return;
    int t = (int)(i / c), j = (int)(i % c);
    float acc = 0.0f;
    for (int b = 0; b < sequences; b++) acc += load(dout[((long long)b * seq_len + t) * c + j]);
    dwpe[i] = store(load(dwpe[i]) + acc);
}

// ---- LayerNorm (model/layernorm.rs): one warp per row ----------------------------------

extern "C" __global__ void layernorm_forward(elem* out, elem* mean, elem* rstd, const elem* inp, const elem* gamma,
                                             const elem* beta, int rows, int c) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const elem* x = inp + (long long)row * c;
    float s = 0.0f;
    for (int j = lane; j < c; j += WARP) s += load(x[j]);
    float mu = warp_sum(s) / c;
    float v = 0.0f;
    for (int j = lane; j < c; j += WARP) {
        float d = load(x[j]) - mu;
        v += d * d;
    }
    float r = 1.0f / sqrtf(warp_sum(v) / c + 1e-5f);
    elem* y = out + (long long)row * c;
    for (int j = lane; j < c; j += WARP) y[j] = store((load(x[j]) - mu) * r * load(gamma[j]) + load(beta[j]));
    if (lane == 0) {
        mean[row] = store(mu);
        rstd[row] = store(r);
    }
}

// ADDS the input gradient into dinp, one warp per row.
extern "C" __global__ void layernorm_backward_input(elem* dinp, const elem* dout, const elem* inp, const elem* gamma,
                                                    const elem* mean, const elem* rstd, int rows, int c) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    long long at = (long long)row * c;
    float mu = load(mean[row]), r = load(rstd[row]);
    float g_sum = 0.0f, gx_sum = 0.0f;
    if (c <= WARP * ROW_REGS) {
        float g[ROW_REGS], xhat[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            g[k] = 0.0f;
            xhat[k] = 0.0f;
            if (j < c) {
                g[k] = load(dout[at + j]) * load(gamma[j]);
                xhat[k] = (load(inp[at + j]) - mu) * r;
                g_sum += g[k];
                gx_sum += g[k] * xhat[k];
            }
        }
        float mean_g = warp_sum(g_sum) / c, mean_gx = warp_sum(gx_sum) / c;
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            if (j < c) dinp[at + j] = store(load(dinp[at + j]) + r * (g[k] - mean_g - xhat[k] * mean_gx));
        }
        return;
    }
    for (int j = lane; j < c; j += WARP) {
        float g = load(dout[at + j]) * load(gamma[j]);
        g_sum += g;
        gx_sum += g * (load(inp[at + j]) - mu) * r;
    }
    float mean_g = warp_sum(g_sum) / c, mean_gx = warp_sum(gx_sum) / c;
    for (int j = lane; j < c; j += WARP) {
        float xhat = (load(inp[at + j]) - mu) * r;
        float g = load(dout[at + j]) * load(gamma[j]);
        dinp[at + j] = store(load(dinp[at + j]) + r * (g - mean_g - xhat * mean_gx));
    }
}

// First half of dgamma, dbeta: per row block b, partial[b*c + j] = sum dy*xhat and
// partial[(blocks + b)*c + j] = sum dy (add_column_partials finishes each).
extern "C" __global__ void layernorm_param_partials(float* partial, const elem* dout, const elem* inp,
                                                    const elem* mean, const elem* rstd, int rows, int c,
                                                    int rows_per_block) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y, blocks = gridDim.y;
    if (j >= c) return;
    int r1 = min(rows, (b + 1) * rows_per_block);
    float dg = 0.0f, db = 0.0f;
    for (int r = b * rows_per_block; r < r1; r++) {
        float dy = load(dout[(long long)r * c + j]);
        dg += dy * (load(inp[(long long)r * c + j]) - load(mean[r])) * load(rstd[r]);
        db += dy;
    }
    partial[(long long)b * c + j] = dg;
    partial[(long long)(blocks + b) * c + j] = db;
}

// ---- linear layers (model/linear.rs): the bias after the cuBLAS product ----------------

extern "C" __global__ void add_bias(elem* out, const elem* bias, int rows, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * c) return;
    out[i] = store(load(out[i]) + load(bias[i % c]));
}

// ---- GELU, tanh approximation (model/mlp.rs) -------------------------------------------

#define GELU_S 0.7978845608028654f
#define GELU_K 0.044715f

extern "C" __global__ void gelu_forward(elem* out, const elem* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]);
    out[i] = store(0.5f * x * (1.0f + tanhf(GELU_S * (x + GELU_K * x * x * x))));
}

extern "C" __global__ void gelu_backward(elem* dinout, const elem* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]);
    float th = tanhf(GELU_S * (x + GELU_K * x * x * x));
    float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_S * (1.0f + 3.0f * GELU_K * x * x);
    dinout[i] = store(load(dinout[i]) * grad);
}

// ---- attention (model/attention.rs): the softmax between the cuBLAS products -----------

// Row i (of each T x T block) of the scaled scores becomes softmax over columns 0..=i,
// zeros after. One warp per row.
extern "C" __global__ void causal_softmax_forward(elem* att, long long rows, int t) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int i = (int)(row % t);
    elem* p = att + row * t;
    float m = NEG_INF, s = 0.0f;
    if (t <= WARP * ROW_REGS) {
        float e[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            e[k] = j <= i ? load(p[j]) : NEG_INF;
            m = fmaxf(m, e[k]);
        }
        m = warp_max(m);
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            e[k] = j <= i ? expf(e[k] - m) : 0.0f;
            s += e[k];
        }
        float inv = 1.0f / warp_sum(s);
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            if (j < t) p[j] = store(e[k] * inv);
        }
        return;
    }
    for (int j = lane; j <= i; j += WARP) m = fmaxf(m, load(p[j]));
    m = warp_max(m);
    for (int j = lane; j <= i; j += WARP) s += expf(load(p[j]) - m);
    float inv = 1.0f / warp_sum(s);
    for (int j = lane; j < t; j += WARP) p[j] = store(j <= i ? expf(load(p[j]) - m) * inv : 0.0f);
}

// In place: dP becomes dS = P (dP - <P, dP>) * scale over columns 0..=i, zeros after.
extern "C" __global__ void causal_softmax_backward(elem* datt, const elem* att, long long rows, int t, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    int i = (int)(row % t);
    elem* dp = datt + row * t;
    const elem* p = att + row * t;
    float dot = 0.0f;
    if (t <= WARP * ROW_REGS) {
        float pv[ROW_REGS], dv[ROW_REGS];
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            pv[k] = j <= i ? load(p[j]) : 0.0f;
            dv[k] = j <= i ? load(dp[j]) : 0.0f;
            dot += pv[k] * dv[k];
        }
        dot = warp_sum(dot);
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int j = lane + k * WARP;
            if (j < t) dp[j] = store(j <= i ? pv[k] * (dv[k] - dot) * scale : 0.0f);
        }
        return;
    }
    for (int j = lane; j <= i; j += WARP) dot += load(p[j]) * load(dp[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < t; j += WARP) dp[j] = store(j <= i ? load(p[j]) * (load(dp[j]) - dot) * scale : 0.0f);
}

// SGD on fp32 weights (the master copy with mixed precision, rounded into `model`).
extern "C" __global__ void sgd(float* weights, elem* model, const elem* grads, long long n, float lr_g, float decay) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float w = weights[i] * decay - lr_g * load(grads[i]);
    weights[i] = w;
    if (model) model[i] = store(w);
}

// The matrix pointers of a batched attention product, i = sequence * heads + head: A's
// in out[0, count), B's in out[count, 2 count), C's in out[2 count, 3 count). Strides in bytes.
extern "C" __global__ void head_pointers(unsigned long long* out, unsigned long long a, unsigned long long b,
                                         unsigned long long c, long long a_seq, long long a_head, long long b_seq,
                                         long long b_head, long long c_seq, long long c_head, int heads, int count) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= count) return;
    long long s = i / heads, h = i % heads;
    out[i] = a + s * a_seq + h * a_head;
    out[count + i] = b + s * b_seq + h * b_head;
    out[2 * count + i] = c + s * c_seq + h * c_head;
}

// ---- softmax cross-entropy (model/loss.rs): one block per row --------------------------

// Logits become probabilities; losses[r] and row_loss[r] (unrounded, for the host's sum)
// get the row's loss. A target outside the vocabulary gives a NaN loss.
extern "C" __global__ void crossentropy_forward(elem* logits, elem* losses, double* row_loss,
                                                const unsigned int* targets, int v) {
    __shared__ float shared[BLOCK / WARP];
    long long row = blockIdx.x;
    elem* z = logits + row * v;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < v; j += BLOCK) m = fmaxf(m, load(z[j]));
    m = block_max(m, shared);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += BLOCK) s += expf(load(z[j]) - m);
    s = block_sum(s, shared);
    unsigned int target = targets[row];
    float z_target = target < (unsigned int)v ? load(z[target]) : QUIET_NAN;
    __syncthreads();
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < v; j += BLOCK) z[j] = store(expf(load(z[j]) - m) * inv);
    if (threadIdx.x == 0) {
        float loss = logf(s) - (z_target - m);
        losses[row] = store(loss);
        row_loss[row] = (double)loss;
    }
}

extern "C" __global__ void crossentropy_backward(elem* probs, const unsigned int* targets, int v, float dloss) {
    long long row = blockIdx.x;
    elem* p = probs + row * v;
    unsigned int target = targets[row];
    for (int j = threadIdx.x; j < v; j += BLOCK) {
        float pj = load(p[j]);
        p[j] = store((unsigned int)j == target ? pj * dloss - dloss : pj * dloss);
    }
}

// ---- the optimizer (optim.rs) ------------------------------------------------------------

// AdamW on fp32 weights and moments; the gradients are in the model's format. With
// mixed precision `weights` is the fp32 master copy and `model` (not null) gets it rounded.
extern "C" __global__ void adamw(float* weights, elem* model, const elem* grads, float* m, float* v, long long n,
                                 float lr, float beta1, float beta2, float eps, float decay, float m_correction,
                                 float v_correction, float grad_scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = load(grads[i]) * grad_scale;
    float mi = beta1 * m[i] + (1.0f - beta1) * g;
    float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    float w = weights[i] * decay - lr * (mi * m_correction) / (sqrtf(vi * v_correction) + eps);
    weights[i] = w;
    if (model) model[i] = store(w);
}
