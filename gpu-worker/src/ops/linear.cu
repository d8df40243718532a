// ---- linear layers (linear.rs): the bias after the cuBLAS product ----------------

extern "C" __global__ void add_bias(elem* out, const elem* bias, int rows, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * c) return;
    out[i] = store(load(out[i]) + load(bias[i % c]));
}
