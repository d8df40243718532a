// ---- attention (attention.rs): the softmax between the cuBLAS products -----------

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
