// Causal attention over a KV cache, one block per (token, query head): scores in shared memory,
// max-subtracted softmax with the sum in f64, then the weighted sum of V. Serves prefill (n > 1)
// and decode (n = 1) alike; row t of the new tokens sees positions 0 ..= pos0 + t.
// Dynamic shared memory: (q width + pos0 + n) floats.

// GQA: q [n, H·hd], k/v [T, KV·hd]; query head h reads kv head h / (H/KV); out [n, H·hd].
extern "C" __global__ void gqa_attention(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out, int pos0, int n_heads,
                                         int n_kv_heads, int hd, float scale) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    __shared__ double red64[32];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int group = n_heads / n_kv_heads, kv_off = (head / group) * hd, kvw = n_kv_heads * hd;
    float* qs = sm;
    float* p = sm + hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[(size_t)slot * hd + i];
    __syncthreads();
    int n_ctx = pos0 + tok + 1;
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        const float* kr = k + (size_t)j * kvw + kv_off;
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s += qs[i] * kr[i];
        s *= scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    double sum = 0.0;
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = block_sum_f64(sum, red64);
    float inv = (float)(1.0 / sum);
    __syncthreads();
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n_ctx; j++) acc += p[j] * inv * v[(size_t)j * kvw + kv_off + i];
        out[(size_t)slot * hd + i] = acc;
    }
}

// MLA over the expanded cache: q [n, H·(nope+rope)] per head [q_nope | q_pe]; k_nope [T, H·nope];
// k_pe [T, rope] shared by all heads; v [T, H·vd]; out [n, H·vd].
extern "C" __global__ void mla_attention(const float* __restrict__ q, const float* __restrict__ k_nope,
                                         const float* __restrict__ k_pe, const float* __restrict__ v,
                                         float* __restrict__ out, int pos0, int n_heads, int nope, int rope, int vd,
                                         float scale) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    __shared__ double red64[32];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int qw = nope + rope, kw = n_heads * nope, vw = n_heads * vd;
    float* qs = sm;
    float* p = sm + qw;
    for (int i = threadIdx.x; i < qw; i += blockDim.x) qs[i] = q[(size_t)slot * qw + i];
    __syncthreads();
    int n_ctx = pos0 + tok + 1;
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        const float* kn = k_nope + (size_t)j * kw + (size_t)head * nope;
        const float* kp = k_pe + (size_t)j * rope;
        float a = 0.0f, b = 0.0f;
        for (int i = 0; i < nope; i++) a += qs[i] * kn[i];
        for (int i = 0; i < rope; i++) b += qs[nope + i] * kp[i];
        float s = (a + b) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    mx = block_max(mx, red);
    double sum = 0.0;
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = block_sum_f64(sum, red64);
    float inv = (float)(1.0 / sum);
    __syncthreads();
    for (int i = threadIdx.x; i < vd; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < n_ctx; j++) acc += p[j] * inv * v[(size_t)j * vw + (size_t)head * vd + i];
        out[(size_t)tok * vw + (size_t)head * vd + i] = acc;
    }
}
