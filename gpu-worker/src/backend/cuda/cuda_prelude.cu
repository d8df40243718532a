// What the CUDA backend's kernels share (every kernel but the GEMMs, which go through
// cuBLAS): the storage format and warp/block sums. NVRTC compiles this prelude, then
// `cuda_reductions.cu` and each op's `.cu` file in `ops/` (`optimizer.cu` among them), as one
// source (`modules.rs`, KERNELS). Compiled when the backend starts, once per storage format: one of ELEM_F32,
// ELEM_BF16, ELEM_F16 is defined. Each kernel loads elements as float, computes in
// float and rounds once on the store, as the CPU kernels do (ops/*.rs holds the math
// of each, beside its .cu file; the comments here only say how the work is split).
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
// By the bits, in plain C (no PTX, so the emulated GPU compiles it too): the exponent
// rebiased from 15 to 127; a subnormal is m x 2^-24, exact in a float.
__device__ __forceinline__ float load(elem x) {
    unsigned int sign = ((unsigned int)x & 0x8000u) << 16, e = (x >> 10) & 0x1fu, m = x & 0x3ffu;
    if (e == 0x1fu) return __uint_as_float(sign | 0x7f800000u | (m << 13));
    if (e != 0u) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
    float f = (float)m * 5.9604644775390625e-8f;
    return sign ? -f : f;
}
// Round to nearest, ties to even (as the `half` crate and cvt.rn.f16.f32 do): from 65520 up
// to infinity, below 2^-14 to a subnormal, below 2^-25 to zero; NaN stays a quiet NaN with
// its top payload bits.
__device__ __forceinline__ elem store(float x) {
    unsigned int u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (elem)(sign | 0x7e00u | ((a & 0x7fffffu) >> 13));
    if (a >= 0x477ff000u) return (elem)(sign | 0x7c00u);
    if (a >= 0x38800000u) {
        unsigned int r = a - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (elem)(sign | (r >> 13));
    }
    if (a < 0x33000000u) return (elem)sign;
    unsigned int shift = 126u - (a >> 23), m = (a & 0x7fffffu) | 0x800000u;
    unsigned int r = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (r & 1u))) r++;
    return (elem)(sign | r);
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
