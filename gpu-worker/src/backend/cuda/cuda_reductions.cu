// ---- memory and reductions -------------------------------------------------------------

extern "C" __global__ void fill(elem* out, long long n, float value) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = store(value);
}

extern "C" __global__ void add(elem* dst, const elem* src, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = store(load(dst[i]) + load(src[i]));
}

// A collective sums a 2-byte buffer as an f32 copy (as the host path does).
extern "C" __global__ void widen(float* out, const elem* in, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = load(in[i]);
}

extern "C" __global__ void narrow(elem* out, const float* in, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = store(in[i]);
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
