// Just enough of CUDA for a C++ compiler to read the kernels' source: the qualifiers as
// nothing, the thread indices as variables, the intrinsics as functions of the right
// types. Nothing here runs; it lets g++ find syntax and type errors without a GPU.
#include <math.h>
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
inline float __int_as_float(int) { return 0.0f; }
inline float __uint_as_float(unsigned int) { return 0.0f; }
inline unsigned int __float_as_uint(float) { return 0u; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
