// ---- ring attention's block (ring_attention.rs): one thread per row ------------------
//
// A query row r = (sequence n, head h, query i), r = (n * heads + h) * tq + i, attends to
// the block's keys at or before its position and merges the result into its output and
// log-sum-exp (a (hi, lo) pair of the storage format); the backward splits in a kernel by
// query row (dQ, added into the Q columns of dq) and one by key row of a K/V head (dK and
// dV, summed over the group's query heads, added into dkv): disjoint writes, fixed order.
// Token i of a run-split block sits at starts[i / part] + i % part. The running values are
// f32 in registers, RING_MAX_HEAD of them (the spec keeps heads within it).

#define RING_MAX_HEAD 256

__device__ __forceinline__ int ring_position(int i, int start0, int start1, int part) {
    return (i / part == 0 ? start0 : start1) + i % part;
}

// (the log-sum-exps go in and out as flash_attention.cu's (hi, lo) pairs: load_pair, store_pair)

// The layout of a block: q rows qkv_w wide (Q at column 0), kv rows kv_stride wide with K at
// column k_col and V kv_w later, out rows heads * hs wide, dkv rows 2 * kv_w wide [K | V];
// the queries' runs start at q0 and q1, q_part tokens each, the keys' at k0 and k1. The
// host uploads these 14 numbers in this order (ring_attention.rs, `layout`).
struct RingLayout {
    int tq, tk, heads, kv_heads, hs, qkv_w, kv_stride, k_col;
    int q0, q1, q_part, k0, k1, k_part;
};

__device__ __forceinline__ RingLayout ring_layout(const int* l) {
    return RingLayout{l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], l[8], l[9], l[10], l[11], l[12], l[13]};
}

extern "C" __global__ void ring_attention_forward(elem* out, elem* lse, const elem* q, const elem* kv, long long rows,
                                                  const int* layout, int first, float scale) {
    RingLayout s = ring_layout(layout);
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int i = (int)(r % s.tq), h = (int)((r / s.tq) % s.heads);
    long long n = r / ((long long)s.tq * s.heads);
    int g = h / (s.heads / s.kv_heads), kv_w = s.kv_heads * s.hs;
    const elem* qi = q + (n * s.tq + i) * s.qkv_w + h * s.hs;
    int pi = ring_position(i, s.q0, s.q1, s.q_part);
    float m = NEG_INF, l = 0.0f, o[RING_MAX_HEAD];
    for (int e = 0; e < s.hs; e++) o[e] = 0.0f;
    for (int j = 0; j < s.tk; j++) {
        if (ring_position(j, s.k0, s.k1, s.k_part) > pi) continue;
        const elem* kj = kv + (n * s.tk + j) * s.kv_stride + s.k_col + g * s.hs;
        float x = 0.0f;
        for (int e = 0; e < s.hs; e++) x += load(qi[e]) * load(kj[e]);
        x *= scale;
        float m2 = fmaxf(m, x), keep = expf(m - m2), p = expf(x - m2);
        l = l * keep + p;
        for (int e = 0; e < s.hs; e++) o[e] = o[e] * keep + p * load(kj[kv_w + e]);
        m = m2;
    }
    if (l == 0.0f) return;  // no key of this block at or before the query
    float block_lse = m + logf(l);
    elem* y = out + (n * s.tq + i) * (long long)s.heads * s.hs + h * s.hs;
    elem* pair = lse + r * 2;
    if (first) {
        for (int e = 0; e < s.hs; e++) y[e] = store(o[e] / l);
        store_pair(pair, block_lse);
        return;
    }
    float before = load_pair(pair), top = fmaxf(before, block_lse);
    float merged = top + logf(expf(before - top) + expf(block_lse - top));
    float keep = expf(before - merged), add = expf(block_lse - merged) / l;
    for (int e = 0; e < s.hs; e++) y[e] = store(load(y[e]) * keep + o[e] * add);
    store_pair(pair, merged);
}

// D_i = rowsum(dO_i * O_i) of query row (n, h, i).
__device__ __forceinline__ float ring_delta(const elem* dout, const elem* out, long long n, int i, int h,
                                            const RingLayout& s) {
    long long at = (n * s.tq + i) * (long long)s.heads * s.hs + h * s.hs;
    float d = 0.0f;
    for (int e = 0; e < s.hs; e++) d += load(dout[at + e]) * load(out[at + e]);
    return d;
}

extern "C" __global__ void ring_attention_backward_query(elem* dq, const elem* dout, const elem* q, const elem* kv,
                                                         const elem* out, const elem* lse, long long rows,
                                                         const int* layout, float scale) {
    RingLayout s = ring_layout(layout);
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int i = (int)(r % s.tq), h = (int)((r / s.tq) % s.heads);
    long long n = r / ((long long)s.tq * s.heads);
    int g = h / (s.heads / s.kv_heads), kv_w = s.kv_heads * s.hs;
    const elem* qi = q + (n * s.tq + i) * s.qkv_w + h * s.hs;
    const elem* dyi = dout + (n * s.tq + i) * (long long)s.heads * s.hs + h * s.hs;
    int pi = ring_position(i, s.q0, s.q1, s.q_part);
    float d = ring_delta(dout, out, n, i, h, s), l = load_pair(lse + r * 2), acc[RING_MAX_HEAD];
    for (int e = 0; e < s.hs; e++) acc[e] = 0.0f;
    for (int j = 0; j < s.tk; j++) {
        if (ring_position(j, s.k0, s.k1, s.k_part) > pi) continue;
        const elem* kj = kv + (n * s.tk + j) * s.kv_stride + s.k_col + g * s.hs;
        float x = 0.0f, dp = 0.0f;
        for (int e = 0; e < s.hs; e++) {
            x += load(qi[e]) * load(kj[e]);
            dp += load(dyi[e]) * load(kj[kv_w + e]);
        }
        float p = expf(x * scale - l), ds = p * (dp - d) * scale;
        for (int e = 0; e < s.hs; e++) acc[e] += ds * load(kj[e]);
    }
    elem* dqi = dq + (n * s.tq + i) * s.qkv_w + h * s.hs;
    for (int e = 0; e < s.hs; e++) dqi[e] = store(load(dqi[e]) + acc[e]);
}

extern "C" __global__ void ring_attention_backward_key(elem* dkv, const elem* dout, const elem* q, const elem* kv,
                                                       const elem* out, const elem* lse, long long rows, const int* layout,
                                                       float scale) {
    RingLayout s = ring_layout(layout);
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    int j = (int)(r % s.tk), g = (int)((r / s.tk) % s.kv_heads);
    long long n = r / ((long long)s.tk * s.kv_heads);
    int group = s.heads / s.kv_heads, kv_w = s.kv_heads * s.hs;
    const elem* kj = kv + (n * s.tk + j) * s.kv_stride + s.k_col + g * s.hs;
    int pj = ring_position(j, s.k0, s.k1, s.k_part);
    float dk[RING_MAX_HEAD], dv[RING_MAX_HEAD];
    for (int e = 0; e < s.hs; e++) dk[e] = dv[e] = 0.0f;
    for (int h = g * group; h < (g + 1) * group; h++) {
        for (int i = 0; i < s.tq; i++) {
            if (ring_position(i, s.q0, s.q1, s.q_part) < pj) continue;
            const elem* qi = q + (n * s.tq + i) * s.qkv_w + h * s.hs;
            const elem* dyi = dout + (n * s.tq + i) * (long long)s.heads * s.hs + h * s.hs;
            float l = load_pair(lse + ((n * s.heads + h) * s.tq + i) * 2);
            float x = 0.0f, dp = 0.0f;
            for (int e = 0; e < s.hs; e++) {
                x += load(qi[e]) * load(kj[e]);
                dp += load(dyi[e]) * load(kj[kv_w + e]);
            }
            float p = expf(x * scale - l), ds = p * (dp - ring_delta(dout, out, n, i, h, s)) * scale;
            for (int e = 0; e < s.hs; e++) {
                dv[e] += p * load(dyi[e]);
                dk[e] += ds * load(qi[e]);
            }
        }
    }
    elem* dkj = dkv + (n * s.tk + j) * 2LL * kv_w + g * s.hs;
    for (int e = 0; e < s.hs; e++) {
        dkj[e] = store(load(dkj[e]) + dk[e]);
        dkj[kv_w + e] = store(load(dkj[kv_w + e]) + dv[e]);
    }
}
