// ---- SwiGLU (swiglu.rs): one thread per hidden unit -------------------------------

// Unit n = row * f + j: gate inp[row * 2f + j], up inp[row * 2f + f + j].
extern "C" __global__ void swiglu_forward(elem* out, const elem* inp, long long n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long at = (i / f) * 2 * f + i % f;
    float g = load(inp[at]), u = load(inp[at + f]);
    out[i] = store(g / (1.0f + expf(-g)) * u);
}

extern "C" __global__ void swiglu_backward(elem* dinp, const elem* dout, const elem* inp, long long n, int f) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    long long at = (i / f) * 2 * f + i % f;
    float g = load(inp[at]), u = load(inp[at + f]), dh = load(dout[i]);
    float sig = 1.0f / (1.0f + expf(-g));
    dinp[at + f] = store(dh * g * sig);
    dinp[at] = store(dh * u * sig * (1.0f + g * (1.0f - sig)));
}
