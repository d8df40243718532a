// ---- the optimizer (ops/optimizer.rs) ------------------------------------------------------------

// SGD on fp32 weights (the master copy with mixed precision, rounded into `model`).
extern "C" __global__ void sgd(float* weights, elem* model, const elem* grads, long long n, float lr_g, float decay) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float w = weights[i] * decay - lr_g * load(grads[i]);
    weights[i] = w;
    if (model) model[i] = store(w);
}

// AdamW on fp32 weights and moments; the gradients are in the model's format. With
// mixed precision `weights` is the fp32 master copy and `model` (not null) gets it rounded.
// 1 - beta comes from the host, made in f64 and rounded once, as the CPU's update has it.
extern "C" __global__ void adamw(float* weights, elem* model, const elem* grads, float* m, float* v, long long n,
                                 float lr, float beta1, float beta2, float one_minus_beta1, float one_minus_beta2,
                                 float eps, float decay, float m_correction, float v_correction, float grad_scale) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = load(grads[i]) * grad_scale;
    float mi = beta1 * m[i] + one_minus_beta1 * g;
    float vi = beta2 * v[i] + one_minus_beta2 * g * g;
    m[i] = mi;
    v[i] = vi;
    float w = weights[i] * decay - lr * (mi * m_correction) / (sqrtf(vi * v_correction) + eps);
    weights[i] = w;
    if (model) model[i] = store(w);
}
