// ---- embeddings (embedding.rs) ---------------------------------------------------

// `positions` 0: no position table (Llama's positions are rotary), the token embedding alone.
extern "C" __global__ void encoder_forward(elem* out, const unsigned int* tokens, const elem* wte, const elem* wpe,
                                           int positions, int rows, int seq_len, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * c) return;
    int row = (int)(i / c), j = (int)(i % c);
    int t = row % seq_len;
    elem token = wte[(long long)tokens[row] * c + j];
    out[i] = positions ? store(load(token) + load(wpe[(long long)t * c + j])) : token;
}

// One thread per (distinct token u, column j): adds dout over the rows holding that token
// (`rows_of` lists them, token by token, in row order; `starts` has distinct + 1 offsets).
extern "C" __global__ void encoder_backward_wte(elem* dwte, const elem* dout, const unsigned int* distinct,
                                                const unsigned int* starts, const unsigned int* rows_of, int c) {
    int u = blockIdx.x;
    int j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float acc = 0.0f;
    for (unsigned int k = starts[u]; k < starts[u + 1]; k++) acc += load(dout[(long long)rows_of[k] * c + j]);
    long long at = (long long)distinct[u] * c + j;
    dwte[at] = store(load(dwte[at]) + acc);
}

// One thread per (position t, column j): adds dout over the sequences, in order.
extern "C" __global__ void encoder_backward_wpe(elem* dwpe, const elem* dout, int sequences, int seq_len, int c) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)seq_len * c) return;
    int t = (int)(i / c), j = (int)(i % c);
    float acc = 0.0f;
    for (int b = 0; b < sequences; b++) acc += load(dout[((long long)b * seq_len + t) * c + j]);
    dwpe[i] = store(load(dwpe[i]) + acc);
}
