// Just enough of CUDA for a C++ compiler to read the kernels' source: the qualifiers as
// nothing, the thread indices as variables, the intrinsics as functions of the right
// types. It lets g++ find syntax and type errors without a GPU (the emulated GPU's
// emulated-gpu/kernels/runtime.h is what runs them on the CPU).
#include <math.h>
#include <string.h>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct Dim3 {
    unsigned int x, y, z;
};
extern Dim3 threadIdx, blockIdx, blockDim, gridDim;
inline void __syncthreads() {}
inline float __shfl_xor_sync(unsigned int, float x, int) { return x; }
// (the bit casts are real: the f16 conversion test runs them)
inline float __int_as_float(int x) { float f; memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned int x) { float f; memcpy(&f, &x, 4); return f; }
inline unsigned int __float_as_uint(float x) { unsigned int u; memcpy(&u, &x, 4); return u; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
