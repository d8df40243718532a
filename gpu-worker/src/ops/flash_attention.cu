// ---- flash attention (flash_attention.rs): one warp per row, no T x T buffer ----------
//
// Row r = (sequence n, head h, position i), r = (n * heads + h) * t + i. A warp holds its
// row's head vectors in registers (lane l: dimensions l, l + 32, ...; head sizes up to
// WARP * ROW_REGS) and walks the other rows of its sequence and head one at a time: each
// score is a warp sum. L and D go in and out as (hi, lo) pairs of the storage format.
// The backward splits in two kernels that write disjoint columns of dqkv (dQ by query
// row, dK and dV by key row), so no atomics: every sum runs in a fixed order.
//
// Grouped-query attention: qkv's rows are [Q | K | V], heads x hs + 2 x kv_heads x hs wide,
// and query head h reads K/V head h / (heads / kv_heads). A key row belongs to a K/V head and
// sums its gradients over the query heads of the group.

__device__ __forceinline__ float load_pair(const elem* p) { return load(p[0]) + load(p[1]); }

__device__ __forceinline__ void store_pair(elem* p, float x) {
    elem hi = store(x);
    p[0] = hi;
    p[1] = store(x - load(hi));
}

// Where row r's sequence, head and position are (rows of `heads` heads per sequence).
struct HeadRow {
    long long seq;
    int head, pos;
};

__device__ __forceinline__ HeadRow head_row(long long row, int t, int heads) {
    HeadRow r;
    r.pos = (int)(row % t);
    r.head = (int)((row / t) % heads);
    r.seq = row / ((long long)t * heads);
    return r;
}

// The widths of a row of qkv and of the output, and where query head h's K and V start.
struct Widths {
    long long qkv, out;
    int kv;
};

__device__ __forceinline__ Widths widths(int heads, int kv_heads, int hs) {
    Widths w;
    w.out = (long long)heads * hs;
    w.kv = kv_heads * hs;
    w.qkv = w.out + 2LL * w.kv;
    return w;
}

__device__ __forceinline__ long long key_col(int h, int heads, int kv_heads, int hs) {
    return (long long)heads * hs + (long long)(h / (heads / kv_heads)) * hs;
}

// Lane `lane`'s dimensions of a head vector at `p` into registers (zeros past hs).
__device__ __forceinline__ void load_head(float* dst, const elem* p, int hs, int lane) {
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) {
        int d = lane + k * WARP;
        dst[k] = d < hs ? load(p[d]) : 0.0f;
    }
}

// The warp's dot product of registers `a` with the head vector at `p`.
__device__ __forceinline__ float dot_head(const float* a, const elem* p, int hs, int lane) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) {
        int d = lane + k * WARP;
        if (d < hs) s += a[k] * load(p[d]);
    }
    return warp_sum(s);
}

__device__ __forceinline__ void store_head(elem* p, const float* src, float factor, int hs, int lane) {
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) {
        int d = lane + k * WARP;
        if (d < hs) p[d] = store(src[k] * factor);
    }
}

// Forward: the online softmax over keys 0..=i, then O / l and L = m + ln l.
extern "C" __global__ void flash_attention_forward(elem* out, elem* lse, const elem* qkv, long long rows, int t,
                                                   int heads, int kv_heads, int hs, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    HeadRow r = head_row(row, t, heads);
    Widths w = widths(heads, kv_heads, hs);
    long long kc = key_col(r.head, heads, kv_heads, hs);
    const elem* seq = qkv + r.seq * t * w.qkv;
    float q[ROW_REGS], o[ROW_REGS];
    load_head(q, seq + r.pos * w.qkv + r.head * hs, hs, lane);
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) o[k] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int j = 0; j <= r.pos; j++) {
        const elem* key = seq + j * w.qkv + kc;
        const elem* value = key + w.kv;
        float s = dot_head(q, key, hs, lane) * scale;
        float m_new = fmaxf(m, s);
        float correction = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int d = lane + k * WARP;
            if (d < hs) o[k] = o[k] * correction + p * load(value[d]);
        }
        m = m_new;
    }
    store_head(out + (r.seq * t + r.pos) * w.out + r.head * hs, o, 1.0f / l, hs, lane);
    if (lane == 0) store_pair(lse + row * 2, m + logf(l));
}

// D = rowsum(dO ∘ O) for every row, as pairs.
extern "C" __global__ void flash_attention_delta(elem* delta, const elem* dout, const elem* out, long long rows, int t,
                                                 int heads, int hs) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    HeadRow r = head_row(row, t, heads);
    long long at = (r.seq * t + r.pos) * heads * hs + r.head * hs;
    float dy[ROW_REGS];
    load_head(dy, dout + at, hs, lane);
    float d = dot_head(dy, out + at, hs, lane);
    if (lane == 0) store_pair(delta + row * 2, d);
}

// dQ_i = sum over keys j <= i of dS_ij K_j, dS_ij = P_ij (dO_i·V_j - D_i) * scale.
extern "C" __global__ void flash_attention_backward_query(elem* dqkv, const elem* dout, const elem* qkv,
                                                          const elem* lse, const elem* delta, long long rows, int t,
                                                          int heads, int kv_heads, int hs, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    HeadRow r = head_row(row, t, heads);
    Widths w = widths(heads, kv_heads, hs);
    long long kc = key_col(r.head, heads, kv_heads, hs);
    const elem* seq = qkv + r.seq * t * w.qkv;
    float q[ROW_REGS], dy[ROW_REGS], dq[ROW_REGS];
    load_head(q, seq + r.pos * w.qkv + r.head * hs, hs, lane);
    load_head(dy, dout + (r.seq * t + r.pos) * w.out + r.head * hs, hs, lane);
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) dq[k] = 0.0f;
    float lse_i = load_pair(lse + row * 2), d_i = load_pair(delta + row * 2);
    for (int j = 0; j <= r.pos; j++) {
        const elem* key = seq + j * w.qkv + kc;
        const elem* value = key + w.kv;
        float p = expf(dot_head(q, key, hs, lane) * scale - lse_i);
        float ds = p * (dot_head(dy, value, hs, lane) - d_i) * scale;
#pragma unroll
        for (int k = 0; k < ROW_REGS; k++) {
            int d = lane + k * WARP;
            if (d < hs) dq[k] += ds * load(key[d]);
        }
    }
    store_head(dqkv + (r.seq * t + r.pos) * w.qkv + r.head * hs, dq, 1.0f, hs, lane);
}

// For key row j of K/V head g: dV_j = sum over the group's query heads h and queries
// i >= j of P_ij dO_i, dK_j = sum of dS_ij Q_i (rows are (sequence, K/V head, position)).
extern "C" __global__ void flash_attention_backward_key(elem* dqkv, const elem* dout, const elem* qkv, const elem* lse,
                                                        const elem* delta, long long rows, int t, int heads,
                                                        int kv_heads, int hs, float scale) {
    long long row = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (row >= rows) return;
    HeadRow r = head_row(row, t, kv_heads);  // r.head is the K/V head
    Widths w = widths(heads, kv_heads, hs);
    int group = heads / kv_heads;
    const elem* seq = qkv + r.seq * t * w.qkv;
    long long kc = w.out + (long long)r.head * hs;
    float key[ROW_REGS], value[ROW_REGS], dk[ROW_REGS], dv[ROW_REGS];
    load_head(key, seq + r.pos * w.qkv + kc, hs, lane);
    load_head(value, seq + r.pos * w.qkv + kc + w.kv, hs, lane);
#pragma unroll
    for (int k = 0; k < ROW_REGS; k++) {
        dk[k] = 0.0f;
        dv[k] = 0.0f;
    }
    for (int h = r.head * group; h < (r.head + 1) * group; h++) {
        long long first_row = (r.seq * heads + h) * t;  // lse/delta row of this head's position 0
        for (int i = r.pos; i < t; i++) {
            const elem* query = seq + i * w.qkv + h * hs;
            const elem* dy = dout + (r.seq * t + i) * w.out + h * hs;
            float p = expf(dot_head(key, query, hs, lane) * scale - load_pair(lse + (first_row + i) * 2));
            float ds = p * (dot_head(value, dy, hs, lane) - load_pair(delta + (first_row + i) * 2)) * scale;
#pragma unroll
            for (int k = 0; k < ROW_REGS; k++) {
                int d = lane + k * WARP;
                if (d < hs) {
                    dv[k] += p * load(dy[d]);
                    dk[k] += ds * load(query[d]);
                }
            }
        }
    }
    elem* grads = dqkv + (r.seq * t + r.pos) * w.qkv + kc;
    store_head(grads, dk, 1.0f, hs, lane);
    store_head(grads + w.kv, dv, 1.0f, hs, lane);
}
