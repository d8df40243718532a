// ---- softmax cross-entropy (loss.rs): one block per row --------------------------

// Logits become probabilities; losses[r] and row_loss[r] (unrounded, for the host's sum)
// get the row's loss. A target outside the vocabulary gives a NaN loss.
extern "C" __global__ void crossentropy_forward(elem* logits, elem* losses, double* row_loss,
                                                const unsigned int* targets, int v) {
    __shared__ float shared[BLOCK / WARP];
    long long row = blockIdx.x;
    elem* z = logits + row * v;
    float m = NEG_INF;
    for (int j = threadIdx.x; j < v; j += BLOCK) m = fmaxf(m, load(z[j]));
    m = block_max(m, shared);
    float s = 0.0f;
    for (int j = threadIdx.x; j < v; j += BLOCK) s += expf(load(z[j]) - m);
    s = block_sum(s, shared);
    unsigned int target = targets[row];
    float z_target = target < (unsigned int)v ? load(z[target]) : QUIET_NAN;
    __syncthreads();
    float inv = 1.0f / s;
    for (int j = threadIdx.x; j < v; j += BLOCK) z[j] = store(expf(load(z[j]) - m) * inv);
    if (threadIdx.x == 0) {
        float loss = logf(s) - (z_target - m);
        losses[row] = store(loss);
        row_loss[row] = (double)loss;
    }
}

extern "C" __global__ void crossentropy_backward(elem* probs, const unsigned int* targets, int v, float dloss) {
    long long row = blockIdx.x;
    elem* p = probs + row * v;
    unsigned int target = targets[row];
    for (int j = threadIdx.x; j < v; j += BLOCK) {
        float pj = load(p[j]);
        p[j] = store((unsigned int)j == target ? pj * dloss - dloss : pj * dloss);
    }
}
