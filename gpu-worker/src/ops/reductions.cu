// ---- the ordered sums (reductions.rs) ----------------------------------------------------

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
