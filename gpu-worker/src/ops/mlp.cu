// ---- GELU, tanh approximation (mlp.rs) -------------------------------------------

#define GELU_S 0.7978845608028654f
#define GELU_K 0.044715f

extern "C" __global__ void gelu_forward(elem* out, const elem* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]);
    out[i] = store(0.5f * x * (1.0f + tanhf(GELU_S * (x + GELU_K * x * x * x))));
}

extern "C" __global__ void gelu_backward(elem* dinout, const elem* inp, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float x = load(inp[i]);
    float th = tanhf(GELU_S * (x + GELU_K * x * x * x));
    float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_S * (1.0f + 3.0f * GELU_K * x * x);
    dinout[i] = store(load(dinout[i]) * grad);
}
