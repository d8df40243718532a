// ---- LayerNorm (layernorm.rs): one warp per row ----------------------------------

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
