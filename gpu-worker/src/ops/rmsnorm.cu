// ---- RMSNorm (rmsnorm.rs): one warp per row ----------------------------------------

extern "C" __global__ void rmsnorm_forward(elem* out, elem* rstd, const elem* inp, const elem* gamma, int rows, int c) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    const elem* x = inp + (long long)row * c;
    float s = 0.0f;
    for (int j = lane; j < c; j += WARP) {
        float v = load(x[j]);
        s += v * v;
    }
    float r = 1.0f / sqrtf(warp_sum(s) / c + 1e-5f);
    elem* y = out + (long long)row * c;
    for (int j = lane; j < c; j += WARP) y[j] = store(load(x[j]) * r * load(gamma[j]));
    if (lane == 0) rstd[row] = store(r);
}

// ADDS the input gradient into dinp, one warp per row.
extern "C" __global__ void rmsnorm_backward_input(elem* dinp, const elem* dout, const elem* inp, const elem* gamma,
                                                  const elem* rstd, int rows, int c) {
    int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    long long at = (long long)row * c;
    float r = load(rstd[row]);
    float gx_sum = 0.0f;
    for (int j = lane; j < c; j += WARP) gx_sum += load(dout[at + j]) * load(gamma[j]) * load(inp[at + j]) * r;
    float mean_gx = warp_sum(gx_sum) / c;
    for (int j = lane; j < c; j += WARP) {
        float xhat = load(inp[at + j]) * r;
        float g = load(dout[at + j]) * load(gamma[j]);
        dinp[at + j] = store(load(dinp[at + j]) + r * (g - xhat * mean_gx));
    }
}

// First half of dgamma: per row block b, partial[b*c + j] = sum dy*xhat (add_column_partials
// finishes it).
extern "C" __global__ void rmsnorm_param_partials(float* partial, const elem* dout, const elem* inp, const elem* rstd,
                                                  int rows, int c, int rows_per_block) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    int b = blockIdx.y;
    if (j >= c) return;
    int r1 = min(rows, (b + 1) * rows_per_block);
    float dg = 0.0f;
    for (int r = b * rows_per_block; r < r1; r++) {
        dg += load(dout[(long long)r * c + j]) * load(inp[(long long)r * c + j]) * load(rstd[r]);
    }
    partial[(long long)b * c + j] = dg;
}
