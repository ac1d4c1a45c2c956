// DSA (DeepSeek Sparse Attention: GLM-5's `glm-dsa`, `deepseek32`) ops of the lightning indexer,
// built into the `ops` module after ops.cu; the CPU engine's are in engine/src/dsa.rs, the host
// side in engine/src/cuda/dsa.rs. The sparse MLA attention over the selected keys is
// `mla_attention_sparse` in attention.cu.
//
// - `layer_norm`: the indexer's key LayerNorm, a block per row; mean and variance in f64 (two
//   passes over the row), the normed value rounded to f32 then · weight + bias in f32 unfused,
//   as the CPU engine.
// - `index_scores`: score[t][s] = Σ_h w[t,h] · relu(q[t,h] · k[s]) for s ≤ pos0 + t, else 0; a
//   block per (token, tile of keys); see the comment above it.
// - `fp8_groups`: each row's groups of 128 values rounded to fp8 e4m3 with the scale amax/448,
//   a warp per group; bit for bit the CPU engine's (IEEE division and products, the e4m3
//   rounding's exponent from the float's bits).

// LayerNorm of row blockIdx.x of x [n, d] into out: ((x − mean) / sqrt(var + eps) as f32) · weight
// + bias. Blocks of a multiple of 32 threads.
extern "C" __global__ void layer_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                      const float* __restrict__ bias, float* __restrict__ out, int d, float eps) {
    __shared__ double red64[32];
    const float* xr = x + (size_t)blockIdx.x * d;
    float* o = out + (size_t)blockIdx.x * d;
    double s = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += (double)xr[i];
    const double mean = block_sum_f64(s, red64) / (double)d;
    double s2 = 0.0;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        double c = (double)xr[i] - mean;
        s2 += c * c;
    }
    const double var = block_sum_f64(s2, red64) / (double)d;
    const double inv = 1.0 / sqrt(var + (double)eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float y = (float)(((double)xr[i] - mean) * inv);
        o[i] = __fadd_rn(__fmul_rn(y, weight[i]), bias[i]);
    }
}

// The indexer's scores out [n, width = pos0 + n] of queries q [n, H·D] (token t at position
// pos0 + t) over the key cache k [≥ width, D] with head weights w [n, H]:
// out[t][s] = Σ_h w[t,h] · relu(q[t,h] · k[s]) for s ≤ pos0 + t, 0 for the later keys.
//
// Block (blockIdx.x, blockIdx.y = t): keys s0 = blockIdx.x · kpb .. + kpb (kpb a multiple of 4;
// 128 for prefill, 32 where the grid would be small) of token t, 256 threads. A tile wholly after
// the token's position writes zeros. Otherwise the block stages the token's q rows in shared
// memory ([H][QS], zero-padded from D to QS: D rounded up to 4, plus 4 when that is an even number
// of float4s, so the 8 lanes of a quarter-warp reading 8 heads' float4s hit distinct banks) and
// its head weights, and each warp takes groups of IX_KG = 4 consecutive keys (warp w: groups w,
// w + 8, ...): lane h holds head h (heads in chunks of 32), its dot products with the 4 keys
// (4 accumulators over D in order, float4 steps where D % 4 == 0; the key rows read as
// broadcasts), then w·relu per head and a warp sum over the chunk's heads, the chunks added in
// order. Keys after the token's position are computed on a valid row and not stored as such
// (0 instead). Dynamic shared memory: (H·QS + H) floats.
#define IX_KG 4
extern "C" __global__ void __launch_bounds__(256) index_scores(const float* __restrict__ q,
                                                               const float* __restrict__ k,
                                                               const float* __restrict__ w, float* __restrict__ out,
                                                               int pos0, int n_heads, int hd, int width, int kpb) {
    extern __shared__ float ix_sm[];
    const int t = blockIdx.y, s0 = blockIdx.x * kpb;
    const int last = pos0 + t;  // the last key token t sees
    const int s_end = min(s0 + kpb, width);
    float* orow = out + (size_t)t * width;
    if (s0 > last) {  // block-uniform: the whole tile is after the token
        for (int s = s0 + threadIdx.x; s < s_end; s += blockDim.x) orow[s] = 0.0f;
        return;
    }
    const int hd4 = (hd + 3) / 4, qs = hd4 * 4 + (hd4 % 2 == 0 ? 4 : 0);
    float* qsm = ix_sm;
    float* wsm = ix_sm + (size_t)n_heads * qs;
    const float* qt = q + (size_t)t * n_heads * hd;
    for (int i = threadIdx.x; i < n_heads * qs; i += blockDim.x) {
        int h = i / qs, d = i % qs;
        qsm[i] = d < hd ? qt[(size_t)h * hd + d] : 0.0f;
    }
    for (int h = threadIdx.x; h < n_heads; h += blockDim.x) wsm[h] = w[(size_t)t * n_heads + h];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const bool vec = hd % 4 == 0;
    const int lim = min(last, s_end - 1);  // the last key of the tile that is computed
    for (int g0 = s0 + warp * IX_KG; g0 < s_end; g0 += n_warps * IX_KG) {
        if (g0 > lim) {  // warp-uniform: the group is after the token (or the tile)
            if (lane < IX_KG && g0 + lane < s_end) orow[g0 + lane] = 0.0f;
            continue;
        }
        const float* kj[IX_KG];
#pragma unroll
        for (int j = 0; j < IX_KG; j++) kj[j] = k + (size_t)min(g0 + j, lim) * hd;
        float tot[IX_KG];
#pragma unroll
        for (int j = 0; j < IX_KG; j++) tot[j] = 0.0f;
        for (int h0 = 0; h0 < n_heads; h0 += 32) {
            const int h = h0 + lane;
            const float* qh = qsm + (size_t)min(h, n_heads - 1) * qs;
            float acc[IX_KG];
#pragma unroll
            for (int j = 0; j < IX_KG; j++) acc[j] = 0.0f;
            if (vec) {
                for (int d4 = 0; d4 < hd4; d4++) {
                    const float4 a = ((const float4*)qh)[d4];
#pragma unroll
                    for (int j = 0; j < IX_KG; j++) {
                        const float4 b = ((const float4*)kj[j])[d4];
                        acc[j] = fmaf(a.x, b.x, acc[j]);
                        acc[j] = fmaf(a.y, b.y, acc[j]);
                        acc[j] = fmaf(a.z, b.z, acc[j]);
                        acc[j] = fmaf(a.w, b.w, acc[j]);
                    }
                }
            } else {
                for (int d = 0; d < hd; d++) {
                    const float a = qh[d];
#pragma unroll
                    for (int j = 0; j < IX_KG; j++) acc[j] = fmaf(a, kj[j][d], acc[j]);
                }
            }
            const float wh = h < n_heads ? wsm[h] : 0.0f;
#pragma unroll
            for (int j = 0; j < IX_KG; j++) tot[j] += warp_sum(h < n_heads ? wh * fmaxf(acc[j], 0.0f) : 0.0f);
        }
#pragma unroll
        for (int j = 0; j < IX_KG; j++) {
            if (lane == j && g0 + j < s_end) orow[g0 + j] = g0 + j <= last ? tot[j] : 0.0f;
        }
    }
}

// x rounded to fp8 e4m3 (3 mantissa bits, exponent ≥ −6, saturating at 448): the CPU engine's
// weights::round_fp8_e4m3, with floor(log2 |x|) taken from the float's exponent bits (where the
// host's log2 rounds up to the next integer, just below a power of two, both give that power).
__device__ __forceinline__ float round_fp8_e4m3(float x) {
    if (x == 0.0f || !isfinite(x)) return x;
    const float a = fminf(fabsf(x), 448.0f);
    const int e = max((int)((__float_as_uint(a) >> 23) & 0xffu) - 127, -6);
    const float quantum = __int_as_float((e - 3 + 127) << 23);  // 2^(e − 3), a normal float
    const float r = fminf(__fmul_rn(rintf(__fdiv_rn(a, quantum)), quantum), 448.0f);
    return copysignf(r, x);
}

// x [len] as rows of `width`, each row's groups of 128 (the last of a row, and of a short last
// row, may be shorter): amax = max |v| (NaN ignored, as the CPU's f32::max); a group with amax 0
// or not finite is left as is; else v = round_fp8_e4m3(v / s) · s with s = amax / 448. A warp
// per group (lane: values lane + 32u, u < 4); n_groups groups, blocks of a multiple of 32 threads.
extern "C" __global__ void fp8_groups(float* x, long long len, int width, long long n_groups) {
    const long long g = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (g >= n_groups) return;  // warp-uniform
    const long long gpr = (width + 127) / 128;
    const long long row = g / gpr, row0 = row * width;
    const long long start = row0 + (g % gpr) * 128;
    const long long end = min(min(start + 128, row0 + width), len);
    float v[4];
    float amax = 0.0f;
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const long long i = start + lane + 32 * u;
        v[u] = i < end ? x[i] : 0.0f;
        amax = fmaxf(amax, fabsf(v[u]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if (amax == 0.0f || !isfinite(amax)) return;
    const float s = __fdiv_rn(amax, 448.0f);
#pragma unroll
    for (int u = 0; u < 4; u++) {
        const long long i = start + lane + 32 * u;
        if (i < end) x[i] = __fmul_rn(round_fp8_e4m3(__fdiv_rn(v[u], s)), s);
    }
}
