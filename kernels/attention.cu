// Causal attention over a KV cache, one block per (token, query head) of 256 threads, or 1024 when
// there are fewer blocks than SMs (decode; see `attn_threads` in crate::cuda): scores in shared memory,
// max-subtracted softmax with the sum in f64, then the weighted sum of V. Serves prefill (n > 1)
// and decode (n = 1) alike; row t of the new tokens sees positions 0 ..= pos0 + t.
// Dynamic shared memory: (q width + pos0 + n + G·out width) floats, G = max(1, blockDim / out
// width) (see attn_weighted_sum).
//
// Memory-level parallelism matters more than arithmetic here (a decode step reads the whole
// cache once): each thread's score reads its key row as float4 where the rows are 16-byte
// aligned, and the weighted sum splits the positions over G thread groups (each walking its
// positions eight at a time, independent accumulators), then adds the G partial rows in order.

// dot(q, k[0..len)) with four accumulators; float4 loads when `vec`.
__device__ __forceinline__ float attn_dot(const float* qs, const float* kr, int len, bool vec) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int i = 0;
    if (vec) {
        for (; i + 4 <= len; i += 4) {
            float4 kv = *(const float4*)(kr + i);
            s0 = fmaf(qs[i], kv.x, s0);
            s1 = fmaf(qs[i + 1], kv.y, s1);
            s2 = fmaf(qs[i + 2], kv.z, s2);
            s3 = fmaf(qs[i + 3], kv.w, s3);
        }
    }
    for (; i < len; i++) s0 = fmaf(qs[i], kr[i], s0);
    return (s0 + s1) + (s2 + s3);
}

// p[0..n_ctx) = exp(p - max) normalized later: returns 1 / Σ exp (f64 sum), p holds the exps.
__device__ __forceinline__ float attn_softmax(float* p, int n_ctx, float mx_local, float* red, double* red64) {
    float mx = block_max(mx_local, red);
    double sum = 0.0;
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = block_sum_f64(sum, red64);
    __syncthreads();
    return (float)(1.0 / sum);
}

// o[i] = inv · Σ_j p[j] · v[j·stride + i] for i < width; `part` is G·width floats of shared memory.
__device__ __forceinline__ void attn_weighted_sum(const float* p, const float* __restrict__ v, size_t stride,
                                                  int width, int n_ctx, float inv, float* part, float* o) {
    int G = blockDim.x >= width ? blockDim.x / width : 1;
    for (int t = threadIdx.x; t < G * width; t += blockDim.x) {
        int g = t / width, i = t % width;
        float a[8];
#pragma unroll
        for (int u = 0; u < 8; u++) a[u] = 0.0f;
        int j = g;
        for (; j + 7 * G < n_ctx; j += 8 * G) {
#pragma unroll
            for (int u = 0; u < 8; u++) a[u] = fmaf(p[j + u * G], v[(size_t)(j + u * G) * stride + i], a[u]);
        }
        for (; j < n_ctx; j += G) a[0] = fmaf(p[j], v[(size_t)j * stride + i], a[0]);
        part[t] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
    __syncthreads();
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * width + i];
        o[i] = acc * inv;
    }
}

// GQA: q [n, H·hd], k/v [T, KV·hd]; query head h reads kv head h / (H/KV); out [n, H·hd].
__device__ __forceinline__ void gqa_attention_at(const float* __restrict__ q, const float* __restrict__ k,
                                                 const float* __restrict__ v, float* __restrict__ out, int pos0,
                                                 int n_heads, int n_kv_heads, int hd, float scale, float* red,
                                                 double* red64) {
    extern __shared__ float sm[];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int group = n_heads / n_kv_heads, kv_off = (head / group) * hd, kvw = n_kv_heads * hd;
    int n_ctx = pos0 + tok + 1;
    float* qs = sm;
    float* p = sm + hd;
    float* part = p + pos0 + (int)(gridDim.x / n_heads);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[(size_t)slot * hd + i];
    __syncthreads();
    bool vec = (hd % 4 == 0) && (kvw % 4 == 0);
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float s = attn_dot(qs, k + (size_t)j * kvw + kv_off, hd, vec) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, n_ctx, mx, red, red64);
    attn_weighted_sum(p, v + kv_off, kvw, hd, n_ctx, inv, part, out + (size_t)slot * hd);
}

extern "C" __global__ void __launch_bounds__(1024) gqa_attention(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out, int pos0, int n_heads,
                                         int n_kv_heads, int hd, float scale) {
    __shared__ float red[32];
    __shared__ double red64[32];
    gqa_attention_at(q, k, v, out, pos0, n_heads, n_kv_heads, hd, scale, red, red64);
}

// `gqa_attention` with pos0 read from device memory (*pos_dev), for a captured decode graph: its
// dynamic shared memory is sized for the cache's capacity, so any position that fits works.
extern "C" __global__ void __launch_bounds__(1024) gqa_attention_dpos(const float* __restrict__ q, const float* __restrict__ k,
                                              const float* __restrict__ v, float* __restrict__ out,
                                              const int* __restrict__ pos_dev, int n_heads, int n_kv_heads, int hd,
                                              float scale) {
    __shared__ float red[32];
    __shared__ double red64[32];
    gqa_attention_at(q, k, v, out, *pos_dev, n_heads, n_kv_heads, hd, scale, red, red64);
}

// MLA over the expanded cache: q [n, H·(nope+rope)] per head [q_nope | q_pe]; k_nope [T, H·nope];
// k_pe [T, rope] shared by all heads; v [T, H·vd]; out [n, H·vd].
extern "C" __global__ void __launch_bounds__(1024) mla_attention(const float* __restrict__ q, const float* __restrict__ k_nope,
                                         const float* __restrict__ k_pe, const float* __restrict__ v,
                                         float* __restrict__ out, int pos0, int n_heads, int nope, int rope, int vd,
                                         float scale) {
    extern __shared__ float sm[];
    __shared__ float red[32];
    __shared__ double red64[32];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int qw = nope + rope, kw = n_heads * nope, vw = n_heads * vd;
    int n_ctx = pos0 + tok + 1;
    float* qs = sm;
    float* p = sm + qw;
    float* part = p + pos0 + (int)(gridDim.x / n_heads);
    for (int i = threadIdx.x; i < qw; i += blockDim.x) qs[i] = q[(size_t)slot * qw + i];
    __syncthreads();
    bool vec_n = (nope % 4 == 0) && (kw % 4 == 0), vec_r = rope % 4 == 0;
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float a = attn_dot(qs, k_nope + (size_t)j * kw + (size_t)head * nope, nope, vec_n);
        float b = attn_dot(qs + nope, k_pe + (size_t)j * rope, rope, vec_r);
        float s = (a + b) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, n_ctx, mx, red, red64);
    attn_weighted_sum(p, v + (size_t)head * vd, vw, vd, n_ctx, inv, part, out + (size_t)tok * vw + (size_t)head * vd);
}
