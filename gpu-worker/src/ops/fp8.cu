// ---- the FP8 cast (fp8.rs): a block per chunk of elements ---------------------------------

// fp8(x): rint(|x| / quantum) · quantum with x's sign, saturated at the largest value; the
// quantum is 2^(e - m) for |x|'s binary exponent e, no lower than the smallest normal's
// (m mantissa bits, `bias`), as `Fp8Format::round` computes it. rintf rounds ties to even.
__device__ __forceinline__ float fp8_round(float x, int e5m2) {
    if (x != x) return x;
    int m = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    float largest = e5m2 ? 57344.0f : 448.0f;
    unsigned int a = __float_as_uint(x) & 0x7fffffffu;
    int e = max((int)(a >> 23) - 127, 1 - bias);
    float quantum = __uint_as_float((unsigned int)(e - m + 127) << 23);
    float r = fminf(rintf(__uint_as_float(a) / quantum) * quantum, largest);
    return __uint_as_float(__float_as_uint(r) | (__float_as_uint(x) & 0x80000000u));
}

// Block b casts elements [b*chunk, (b+1)*chunk) into q (x̂ = fp8(x · scale) / scale), and writes its amax, saturated and
// flushed counts to partial[3b..3b+3] (each thread's, then a fixed tree over the block).
extern "C" __global__ void fp8_cast(elem* q, const elem* x, long long n, long long chunk, float scale, int e5m2,
                                    double* partial) {
    __shared__ float amax[BLOCK];
    __shared__ double saturated[BLOCK], flushed[BLOCK];
    float largest = e5m2 ? 57344.0f : 448.0f;
    long long start = (long long)blockIdx.x * chunk;
    long long end = min(start + chunk, n);
    float my_amax = 0.0f;
    double my_saturated = 0.0, my_flushed = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += BLOCK) {
        float v = load(x[i]);
        float scaled = v * scale;
        float r = fp8_round(scaled, e5m2);
        my_amax = fmaxf(my_amax, fabsf(v));
        if (fabsf(scaled) > largest) my_saturated += 1.0;
        if (r == 0.0f && v != 0.0f) my_flushed += 1.0;
        q[i] = store(r / scale);
    }
    amax[threadIdx.x] = my_amax;
    saturated[threadIdx.x] = my_saturated;
    flushed[threadIdx.x] = my_flushed;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) {
            amax[threadIdx.x] = fmaxf(amax[threadIdx.x], amax[threadIdx.x + s]);
            saturated[threadIdx.x] += saturated[threadIdx.x + s];
            flushed[threadIdx.x] += flushed[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial[3 * blockIdx.x] = amax[0];
        partial[3 * blockIdx.x + 1] = saturated[0];
        partial[3 * blockIdx.x + 2] = flushed[0];
    }
}
