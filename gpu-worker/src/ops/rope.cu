// ---- rotary position embeddings (rope.rs): one thread per rotated pair --------------

// Pair n = ((row * rotated) + head) * half + i: dimensions i and i + half of `head` (one of
// the first `rotated` heads of the row), turned by sign x the angle of (row mod t, i),
// whose cosine and sine the host computed in double (`cos_table`, `sin_table`: (t, half)).
extern "C" __global__ void rope_rotate(elem* qkv, const float* cos_table, const float* sin_table, long long pairs, int t,
                                       int rotated, int hs, int width, float sign) {
    long long n = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= pairs) return;
    int half = hs / 2;
    int i = (int)(n % half);
    long long head = (n / half) % rotated;
    long long row = n / ((long long)half * rotated);
    long long at = (row % t) * half + i;
    float c = cos_table[at], s = sign * sin_table[at];
    elem* p = qkv + row * width + head * hs + i;
    float x = load(p[0]), y = load(p[half]);
    p[0] = store(x * c - y * s);
    p[half] = store(y * c + x * s);
}
