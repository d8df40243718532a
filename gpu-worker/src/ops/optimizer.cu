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

// A layer-wise update's first pass (ops/optimizer.rs's TrustPass), read only: block b adds,
// over elements [b*chunk, (b+1)*chunk), w^2 and u^2 in double in a fixed tree (u LAMB's
// direction m_hat / (sqrt(v_hat) + eps) + decay * w from the moments AdamW is about to
// store when `lamb`, else the raw gradient), into out[2b] and out[2b+1]; the host adds
// the blocks' pairs in order.
extern "C" __global__ void trust_squares(const float* weights, const elem* grads, const float* m, const float* v,
                                         long long n, long long chunk, double* out, int lamb, float beta1,
                                         float beta2, float one_minus_beta1, float one_minus_beta2, float eps,
                                         float decay, float m_correction, float v_correction, float grad_scale) {
    __shared__ double w_sums[BLOCK];
    __shared__ double u_sums[BLOCK];
    long long start = (long long)blockIdx.x * chunk;
    long long end = min(start + chunk, n);
    double w_acc = 0.0, u_acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += BLOCK) {
        float w = weights[i];
        float u = load(grads[i]);
        if (lamb) {
            float g = u * grad_scale;
            float mi = beta1 * m[i] + one_minus_beta1 * g;
            float vi = beta2 * v[i] + one_minus_beta2 * g * g;
            u = (mi * m_correction) / (sqrtf(vi * v_correction) + eps) + decay * w;
        }
        w_acc += (double)w * w;
        u_acc += (double)u * u;
    }
    w_sums[threadIdx.x] = w_acc;
    u_sums[threadIdx.x] = u_acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s /= 2) {
        if (threadIdx.x < s) {
            w_sums[threadIdx.x] += w_sums[threadIdx.x + s];
            u_sums[threadIdx.x] += u_sums[threadIdx.x + s];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = w_sums[0];
        out[2 * blockIdx.x + 1] = u_sums[0];
    }
}
