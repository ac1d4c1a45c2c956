// Element-wise and row ops: RMSNorm (f64 mean of squares, as the CPU engine), RoPE NORM/NEOX
// (angles in f64), SwiGLU, and the fixed-order all-reduce sum.

// A row of at most one float4 per thread (a decode row: the host sizes the block to it), the
// thread's float4 v of x and w of the weight already in registers (zeros past the row): the same
// sums and products as rms_norm_row's loops, without reloading x and the weight after the sum.
//
// The row may be split over `split` = S blocks, the whole grid (`norm_split` on the host, only
// where d % (128·S) == 0): every block sums the whole row in the same order, so every block has
// the same scale, and block b writes the normed values (and limbs) of its share only, float4s
// [b·d4/S, (b+1)·d4/S) of d4 = d/4, whole warps. So S SMs share the scale, stores and limbs one
// SM did alone. xr (add_rms_norm split over the grid, else null): x's row, which every block has
// read, gets x + a (v) from the block that arrives last at `arrive`: a u32 that atomicInc wraps
// to 0 at S arrivals, so it is 0 between launches, and a block arrives only after all its
// threads have read x (the sum's barriers), so the last block writes x with no block left to
// read it.
__device__ __forceinline__ void rms_norm_one(float4 v, float4 w, float* __restrict__ o, int d, float eps,
                                             u8* __restrict__ xq, int split, float* __restrict__ xr,
                                             u32* __restrict__ arrive) {
    __shared__ double scratch[32];
    __shared__ u32 last;
    const int i = threadIdx.x, share = (d >> 2) / split, lo = split > 1 ? (int)blockIdx.x * share : 0;
    double ss = (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z +
                (double)v.w * (double)v.w;
    ss = block_sum_f64(ss, scratch);
    u32 ticket = 0;
    if (xr && i == 0) {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");  // release: this block's reads of x
        ticket = atomicInc(arrive, split - 1);
    }
    float scale = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    if (i >= lo && i < lo + share) {
        float4 y = v;
        y.x = y.x * scale * w.x;
        y.y = y.y * scale * w.y;
        y.z = y.z * scale * w.z;
        y.w = y.w * scale * w.w;
        ((float4*)o)[i] = y;
        if (xq) x_limbs4(y, i, xq, d, true);
    }
    if (!xr) return;
    if (i == 0) {
        last = ticket == (u32)(split - 1);
        if (last) asm volatile("fence.acq_rel.gpu;" ::: "memory");  // acquire: the others' reads
    }
    __syncthreads();
    if (last && i < (d >> 2)) ((float4*)xr)[i] = v;
}

__device__ __forceinline__ float4 ld4_or_zero(const float* p, int i, bool live) {
    return live ? ((const float4*)p)[i] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
}

// out[row] = x[row] / sqrt(mean(x²) + eps) · weight; one block per row, sized by the host to
// cover the row in float4s (up to 1024 threads), so a one-row decode norm is one load per thread
// rather than a serial walk. The sum of squares is f64 (as the CPU engine), each thread's share
// summed in order, then the block's in a fixed shuffle tree (deterministic, no atomics). vec:
// d % 4 == 0 (rows and weight 16-byte aligned), read and written as float4.
// xq (may be null): also the output row's int8 limbs for the integer GEMV (x_limbs4), which
// needs d % 128 == 0 (so each warp's float4s are all in the row or all past it).
__device__ __forceinline__ void rms_norm_row(const float* __restrict__ xr, const float* __restrict__ weight,
                                             float* __restrict__ o, int d, float eps, u8* __restrict__ xq) {
    __shared__ double scratch[32];
    const bool vec = (d & 3) == 0;
    if (vec && (d >> 2) <= (int)blockDim.x) {
        const bool live = (int)threadIdx.x < (d >> 2);
        rms_norm_one(ld4_or_zero(xr, threadIdx.x, live), ld4_or_zero(weight, threadIdx.x, live), o, d, eps, xq, 1, nullptr,
                     nullptr);
        return;
    }
    double ss = 0.0;
    if (vec) {
        const int d4 = d >> 2;
        const float4* x4 = (const float4*)xr;
#pragma unroll 4
        for (int i = threadIdx.x; i < d4; i += blockDim.x) {
            float4 v = x4[i];
            ss += (double)v.x * (double)v.x + (double)v.y * (double)v.y + (double)v.z * (double)v.z +
                  (double)v.w * (double)v.w;
        }
    } else {
#pragma unroll 4
        for (int i = threadIdx.x; i < d; i += blockDim.x) ss += (double)xr[i] * (double)xr[i];
    }
    ss = block_sum_f64(ss, scratch);
    float scale = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    if (vec) {
        const int d4 = d >> 2;
        const float4* x4 = (const float4*)xr;
        const float4* w4 = (const float4*)weight;
        float4* o4 = (float4*)o;
#pragma unroll 4
        for (int i = threadIdx.x; i < d4; i += blockDim.x) {
            float4 v = x4[i], w = w4[i];
            v.x = v.x * scale * w.x;
            v.y = v.y * scale * w.y;
            v.z = v.z * scale * w.z;
            v.w = v.w * scale * w.w;
            o4[i] = v;
            if (xq) x_limbs4(v, i, xq, d, true);
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) o[i] = xr[i] * scale * weight[i];
    }
}

// xq: null, or (one row) its limbs, see rms_norm_row. split: 1 (a block a row), or the blocks
// one row is split over (rms_norm_one).
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    float* __restrict__ out, int d, float eps, u8* __restrict__ xq, int split) {
    // Launched early (PDL, common.cuh): lets the GEMV after it start, then waits for its input.
    // The weight, which no kernel writes, is loaded before the wait, so its round trip overlaps
    // the kernel before.
    TRACE_BLOCK(TRACE_RMS_NORM);
    griddep_launch();
    const bool one = (d & 3) == 0 && (d >> 2) <= (int)blockDim.x, live = one && (int)threadIdx.x < (d >> 2);
    const float4 w = ld4_or_zero(weight, threadIdx.x, live);
    griddep_wait();
    const size_t row = split > 1 ? 0 : blockIdx.x;
    const float* xr = x + row * d;
    float* o = out + row * d;
    if (one)
        rms_norm_one(ld4_or_zero(xr, threadIdx.x, live), w, o, d, eps, xq, split, nullptr, nullptr);
    else
        rms_norm_row(xr, weight, o, d, eps, xq);
}

// x + a, rounded through f16 when f16_round (the f16-residual fault), as add_assign.
__device__ __forceinline__ float resid_add(float x, float a, int f16_round) {
    float v = x + a;
    if (f16_round) {
        unsigned short hb;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(v));
        v = f16_to_f32(hb);
    }
    return v;
}

// The residual add and the next block's RMSNorm in one launch: x[row] += a[row] (as add_assign),
// then out[row] = rms_norm(x[row]) (as rms_norm, same block shape): each thread adds exactly the
// elements it then reads, so the result is bit for bit the two kernels'. split as rms_norm's;
// a split launch takes `arrive` (rms_norm_one), else it may be null.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ a,
                                        const float* __restrict__ weight, float* __restrict__ out, int d, float eps,
                                        int f16_round, u8* __restrict__ xq, int split, u32* __restrict__ arrive) {
    TRACE_BLOCK(TRACE_ADD_RMS_NORM);
    griddep_launch();  // as rms_norm, the weight loaded before the wait
    const int i = threadIdx.x;
    const bool one = (d & 3) == 0 && (d >> 2) <= (int)blockDim.x, live = one && i < (d >> 2);
    const float4 w = ld4_or_zero(weight, i, live);
    griddep_wait();
    const size_t row = split > 1 ? 0 : blockIdx.x;
    float* xr = x + row * d;
    const float* ar = a + row * d;
    float* orow = out + row * d;
    if (one) {
        float4 v = ld4_or_zero(xr, i, live);
        const float4 av = ld4_or_zero(ar, i, live);
        v.x = resid_add(v.x, av.x, f16_round);
        v.y = resid_add(v.y, av.y, f16_round);
        v.z = resid_add(v.z, av.z, f16_round);
        v.w = resid_add(v.w, av.w, f16_round);
        if (live && split == 1) ((float4*)xr)[i] = v;
        rms_norm_one(v, w, orow, d, eps, xq, split, split > 1 ? xr : nullptr, arrive);
        return;
    }
    if ((d & 3) == 0) {
        float4* x4 = (float4*)xr;
        const float4* a4 = (const float4*)ar;
        for (int i = threadIdx.x; i < (d >> 2); i += blockDim.x) {
            float4 v = x4[i], w = a4[i];
            v.x = resid_add(v.x, w.x, f16_round);
            v.y = resid_add(v.y, w.y, f16_round);
            v.z = resid_add(v.z, w.z, f16_round);
            v.w = resid_add(v.w, w.w, f16_round);
            x4[i] = v;
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) xr[i] = resid_add(xr[i], ar[i], f16_round);
    }
    rms_norm_row(xr, weight, orow, d, eps, xq);
}

// RoPE in place on the q and k of the same rows, in one launch: q [n, qh·q_stride] and k
// [n, kh·k_stride] (kh = 0: q alone); row r is at position pos0 + r, and each head rotates rope_dim
// dims from its tensor's offset. style 0 = NORM pairs (2i, 2i+1), 1 = NEOX pairs (i, i + rope_dim/2).
// The angles come from a table, cs[r·half + i] = (cos, sin) of (pos0 + r)·base^(−2i/rope_dim)
// / (divisor·ff[i]) computed in f64 and rounded to f32 (rope_table: once per step and shape, not once
// per head and layer). ff (null: all 1) is Llama 3.1+'s per-pair frequency factors (rope_freqs.weight,
// half long) and divisor the linear scaling factor (1 without); as the CPU's rope_scaled, the divisor
// product is taken in f64 and divides base^(−2i/rope_dim) before the position multiplies, so with
// ff null and divisor 1 the table is the plain one bit for bit. One thread per (row, chunk of
// ROPE_HEADS heads, pair), pairs fastest.
#define ROPE_HEADS 4

__device__ __forceinline__ void rope_table_at(float2* cs, int n, int rope_dim, int pos0, float base,
                                              const float* __restrict__ ff, float divisor) {
    int half = rope_dim / 2;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)n * half) return;
    int i = (int)(idx % half), r = (int)(idx / half);
    double inv_freq = pow((double)base, -2.0 * (double)i / (double)rope_dim);
    double scale = (double)divisor * (ff ? (double)ff[i] : 1.0);
    inv_freq = inv_freq / scale;
    double a = (double)(pos0 + r) * inv_freq;
    cs[idx] = make_float2((float)cos(a), (float)sin(a));
}

extern "C" __global__ void rope_table(float2* cs, int n, int rope_dim, int pos0, float base,
                                      const float* __restrict__ ff, float divisor) {
    rope_table_at(cs, n, rope_dim, pos0, base, ff, divisor);
}

// `rope_table` with pos0 read from device memory (*pos_dev): a captured decode graph replays it at
// every position without a parameter update (ff must outlive the graph: the backend's weight map
// holds it).
extern "C" __global__ void rope_table_dpos(float2* cs, int n, int rope_dim, const int* __restrict__ pos_dev,
                                           float base, const float* __restrict__ ff, float divisor) {
    rope_table_at(cs, n, rope_dim, *pos_dev, base, ff, divisor);
}

// rope_qk (see above). With kc set (GQA: the layer fills its cache in the same launch), the new rows are
// also appended to the caches at row `slot` (*pos_dev when set, for a captured graph), as
// kv_write does: kc [T, kh·k_stride] takes k after RoPE (the rotating thread writes both copies;
// extra threads copy the dims RoPE leaves alone), vc [T, v_width] takes v.
extern "C" __global__ void rope_qk(float* q, int qh, int q_stride, int q_off, float* k, int kh, int k_stride,
                                   int k_off, int n, int rope_dim, const float2* __restrict__ cs, int style,
                                   float* __restrict__ kc, const float* __restrict__ v, float* __restrict__ vc,
                                   int v_width, int slot, const int* __restrict__ pos_dev) {
    int half = rope_dim / 2, heads = qh + kh, chunks = (heads + ROPE_HEADS - 1) / ROPE_HEADS;
    long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long total = (long long)n * chunks * half;
    const int k_width = kh * k_stride;
    const size_t kc_row0 = kc ? (size_t)(pos_dev ? *pos_dev : slot) * k_width : 0;
    if (idx >= total) {
        if (!kc) return;
        long long c = idx - total;
        const long long nk = (long long)n * k_width;
        if (c < nk) {
            const int d = (int)(c % k_width) % k_stride;
            if (d < k_off || d >= k_off + rope_dim) kc[kc_row0 + c] = k[c];
        } else if (c - nk < (long long)n * v_width) {
            const size_t row0 = (size_t)(pos_dev ? *pos_dev : slot) * v_width;
            vc[row0 + (c - nk)] = v[c - nk];
        }
        return;
    }
    int i = (int)(idx % half);
    int ch = (int)((idx / half) % chunks);
    int r = (int)(idx / ((long long)half * chunks));
    float2 a = cs[(size_t)r * half + i];
    float c = a.x, s = a.y;
    int ia = style == 0 ? 2 * i : i;
    int ib = style == 0 ? 2 * i + 1 : i + half;
#pragma unroll
    for (int u = 0; u < ROPE_HEADS; u++) {
        int h = ch * ROPE_HEADS + u;
        if (h >= heads) break;
        const size_t at = h < qh ? ((size_t)r * qh + h) * q_stride + q_off : ((size_t)r * kh + (h - qh)) * k_stride + k_off;
        float* p = (h < qh ? q : k) + at;
        float y0, y1;
        rope_rot(p[ia], p[ib], c, s, y0, y1);
        p[ia] = y0;
        p[ib] = y1;
        if (kc && h >= qh) {
            kc[kc_row0 + at + ia] = y0;
            kc[kc_row0 + at + ib] = y1;
        }
    }
}

// gate = silu(gate) · up.
extern "C" __global__ void swiglu(float* gate, const float* up, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    gate[i] = silu_mul(gate[i], up[i]);
}

// gate = gelu_tanh(gate) · up (gemma's GeGLU; the CPU engine evaluates it in f64).
extern "C" __global__ void geglu(float* gate, const float* up, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    const float x = gate[i];
    const float k = 0.7978845608028654f;  // sqrt(2 / pi)
    gate[i] = 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x))) * up[i];
}

// x = cap · tanh(x / cap) (gemma's final-logit soft-capping).
extern "C" __global__ void softcap_f32(float* x, float cap, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    x[i] = cap * tanhf(x[i] / cap);
}

// x = x · s (gemma's embedding scale).
extern "C" __global__ void scale_f32(float* x, float s, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    x[i] *= s;
}

// y[t, j] += bias[j] for the rows t of y [len / width, width] (q/k/v biases).
extern "C" __global__ void add_bias(float* y, const float* __restrict__ bias, int width, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    y[i] += bias[i % width];
}

// The same for one row of len values (len % 128 == 0), a thread per 4, and the result's int8
// limbs for the integer GEMV (x_limbs4).
extern "C" __global__ void swiglu_limbs(float* gate, const float* up, int len, u8* __restrict__ xq) {
    TRACE_BLOCK(TRACE_SWIGLU);
    griddep_launch();  // as rms_norm
    griddep_wait();
    const int i4 = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = i4 < len / 4;
    float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    if (live) {
        const float4 g = ((const float4*)gate)[i4], u = ((const float4*)up)[i4];
        v = make_float4(silu_mul(g.x, u.x), silu_mul(g.y, u.y), silu_mul(g.z, u.z), silu_mul(g.w, u.w));
        ((float4*)gate)[i4] = v;
    }
    x_limbs4(v, i4, xq, len, live);
}

// out = parts[0] + parts[1] + ... + parts[n_parts-1], summed left to right (the CPU engine's
// fixed rank order); parts are laid out back to back, `len` each.
extern "C" __global__ void all_reduce_sum(const float* parts, float* out, int n_parts, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    float s = parts[i];
    for (int p = 1; p < n_parts; p++) s += parts[(size_t)p * len + i];
    out[i] = s;
}

// ---------------------------------------------------------------------------------------------
// Data movement for device-resident activations (the CPU engine's slice operations).

// Every value of x[0..len) set to the bit pattern `bits` (the canary NaN, zeros).
extern "C" __global__ void fill_u32(u32* x, u32 bits, long long len) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < len) x[i] = bits;
}

// Every value of x[0..len) rounded to the compute dtype and widened back (the store of a 16-bit
// engine on f32 containers; engine/src/precision.rs says where it is called). dtype 1: bf16, 2:
// f16. Round to nearest, ties to even, overflow to inf; a NaN keeps its sign and the top payload
// bits the dtype holds and is made quiet, so each dtype's canary (bf16 0x7FC1 -> 0x7FC10000, f16
// 0x7E0E -> 0x7FC1C000) is left bit for bit. Bit for bit the host's round_bf16/round_f16.
extern "C" __global__ void round_dtype(u32* x, long long len, int dtype) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    u32 b = x[i];
    bool nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    if (dtype == 1) {
        x[i] = nan ? ((b & 0xFFFF0000u) | 0x00400000u) : ((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
    } else if (nan) {
        x[i] = (b & 0xFFFFE000u) | 0x00400000u;
    } else {
        unsigned short hb;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(__uint_as_float(b)));
        x[i] = __float_as_uint(f16_to_f32(hb));
    }
}

// dst[r, 0..n_cols) = src[r, col0 .. col0 + n_cols) for rows of src_width.
extern "C" __global__ void copy_cols(const float* __restrict__ src, float* __restrict__ dst, int rows, int src_width,
                                     int col0, int n_cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * n_cols) return;
    int r = (int)(i / n_cols), c = (int)(i % n_cols);
    dst[i] = src[(size_t)r * src_width + col0 + c];
}

// x += a; then rounded through f16 (round to nearest even, inf on overflow) when f16_round.
extern "C" __global__ void add_assign(float* x, const float* a, long long len, int f16_round) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    x[i] = resid_add(x[i], a[i], f16_round);
}

// out[i, :] = x[rows[i], :] for rows of `width`.
extern "C" __global__ void gather_rows_f32(const float* __restrict__ x, const int* __restrict__ rows,
                                           float* __restrict__ out, int n, int width) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * width) return;
    int r = (int)(i / width), c = (int)(i % width);
    out[i] = x[(size_t)rows[r] * width + c];
}

// out[rows[i], :] += weights[i] · y[i, :], for i in order (one thread per column walks the rows,
// so a row picked twice adds in order, as on the CPU).
extern "C" __global__ void add_rows_scaled(float* out, const float* __restrict__ y, const int* __restrict__ rows,
                                           const float* __restrict__ weights, int n, int width) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= width) return;
    // __fmul_rn: no fused multiply-add, so the rounding is the CPU's (a product, then a sum).
    for (int i = 0; i < n; i++) {
        float* o = out + (size_t)rows[i] * width + c;
        *o = *o + __fmul_rn(weights[i], y[(size_t)i * width + c]);
    }
}

// KV-cache append with the position in device memory: cache[*pos_dev · width + i] = src[i] for
// i < len (the new rows; a decode graph's replacement for the position-dependent copy).
extern "C" __global__ void kv_append_dpos(float* cache, const float* __restrict__ src, long long len, int width,
                                          const int* __restrict__ pos_dev) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= len) return;
    cache[(size_t)(*pos_dev) * width + i] = src[i];
}

// *p = v (a decode step's position or token run op by op; a recorded step's first node copies
// both from page-locked host memory, StepWords in engine/src/cuda/graph.rs).
extern "C" __global__ void set_i32(int* p, int v) { *p = v; }

// Does nothing: `kernels --bench` times launches of it (the per-launch cost of the host path).
extern "C" __global__ void nop() {}

// ---------------------------------------------------------------------------------------------
// MoE routing (DeepSeek-V3 style), one warp per token, mirroring engine::rank::route: gating
// scores (sigmoid, or softmax: max-subtracted, f64 sum), bias added for the choice only,
// group-limited selection (a group's score is the sum of its top two; the n_groups_used best
// groups are kept, the others masked to -inf), top-k over the choice, weights from the unbiased
// scores, normalized by their f32 sum in selection order when `norm`, times `scale`. Orders are
// Rust's f32::total_cmp, largest first, ties to the lower index. scratch holds [n, 2·n_exp]
// floats (scores, then choice); ids/wts are [n, k] in selection order. k ≤ 64, n_groups ≤ 32 (a
// lane per group).

#define ROUTE_NO_KEY (-2147483647 - 1)  // below every value's key
#define ROUTE_NO_IDX 0x7FFFFFFF          // after every index

// f32::total_cmp as a signed integer key (larger key = larger value).
__device__ __forceinline__ int total_key(float v) {
    int b = __float_as_int(v);
    return b < 0 ? b ^ 0x7FFFFFFF : b;
}

// Is (ka, ia) ahead of (kb, ib): larger key first, then the lower index.
__device__ __forceinline__ bool route_ahead(int ka, int ia, int kb, int ib) {
    return ka > kb || (ka == kb && ia < ib);
}

// The warp's best (key, index) over the lanes' candidates; every lane gets it.
__device__ __forceinline__ void warp_best(int* key, int* idx) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        int k2 = __shfl_xor_sync(0xffffffffu, *key, o), i2 = __shfl_xor_sync(0xffffffffu, *idx, o);
        if (route_ahead(k2, i2, *key, *idx)) {
            *key = k2;
            *idx = i2;
        }
    }
}

extern "C" __global__ void moe_route(const float* __restrict__ logits, const float* __restrict__ bias,
                                     float* __restrict__ scratch, int* __restrict__ ids, float* __restrict__ wts,
                                     int n_exp, int k, int gating, int n_groups, int n_groups_used, int norm,
                                     float scale) {
    __shared__ int sel[64];
    __shared__ int kept[32];
    const int tok = blockIdx.x, lane = threadIdx.x;
    const float* lg = logits + (size_t)tok * n_exp;
    float* sc = scratch + (size_t)tok * 2 * n_exp;
    float* ch = sc + n_exp;
    if (gating == 0) {
        for (int e = lane; e < n_exp; e += 32) sc[e] = 1.0f / (1.0f + expf(-lg[e]));
    } else {
        float mx = -__int_as_float(0x7f800000);
        for (int e = lane; e < n_exp; e += 32) mx = fmaxf(mx, lg[e]);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        if (mx == -__int_as_float(0x7f800000)) {
            for (int e = lane; e < n_exp; e += 32) sc[e] = lg[e];
        } else {
            double sum = 0.0;
            for (int e = lane; e < n_exp; e += 32) {
                float v = expf(lg[e] - mx);
                sc[e] = v;
                sum += v;
            }
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            float inv = (float)(1.0 / sum);
            __syncwarp();
            for (int e = lane; e < n_exp; e += 32) sc[e] *= inv;
        }
    }
    __syncwarp();
    for (int e = lane; e < n_exp; e += 32) ch[e] = bias ? sc[e] + bias[e] : sc[e];
    __syncwarp();
    if (n_groups > 1 && n_groups_used < n_groups) {
        int gs = n_exp / n_groups;
        float gscore = 0.0f;
        if (lane < n_groups) {
            // The group's two largest (total order), summed as the host's f32 Sum does: -0 + first + second.
            int k1 = ROUTE_NO_KEY, i1 = -1, k2 = ROUTE_NO_KEY, i2 = -1;
            for (int e = lane * gs; e < (lane + 1) * gs; e++) {
                int ke = total_key(ch[e]);
                if (i1 < 0 || route_ahead(ke, e, k1, i1)) {
                    k2 = k1;
                    i2 = i1;
                    k1 = ke;
                    i1 = e;
                } else if (i2 < 0 || route_ahead(ke, e, k2, i2)) {
                    k2 = ke;
                    i2 = e;
                }
            }
            gscore = -0.0f + ch[i1];
            if (i2 >= 0) gscore = gscore + ch[i2];
        }
        int gkey = lane < n_groups ? total_key(gscore) : ROUTE_NO_KEY;
        for (int j = 0; j < n_groups_used; j++) {
            int key = gkey, idx = lane < n_groups ? lane : ROUTE_NO_IDX;
            for (int s = 0; s < j; s++)
                if (kept[s] == lane) key = ROUTE_NO_KEY, idx = ROUTE_NO_IDX;
            warp_best(&key, &idx);
            if (lane == 0) kept[j] = idx;
            __syncwarp();
        }
        for (int e = lane; e < n_exp; e += 32) {
            int g = e / gs;
            bool keep = false;
            for (int s = 0; s < n_groups_used; s++) keep |= kept[s] == g;
            if (!keep) ch[e] = -__int_as_float(0x7f800000);
        }
        __syncwarp();
    }
    for (int j = 0; j < k; j++) {
        int key = ROUTE_NO_KEY, idx = ROUTE_NO_IDX;
        for (int e = lane; e < n_exp; e += 32) {
            bool taken = false;
            for (int s = 0; s < j; s++) taken |= sel[s] == e;
            int ke = total_key(ch[e]);
            if (!taken && (idx == ROUTE_NO_IDX || route_ahead(ke, e, key, idx))) {
                key = ke;
                idx = e;
            }
        }
        warp_best(&key, &idx);
        if (lane == 0) sel[j] = idx;
        __syncwarp();
    }
    if (lane == 0) {
        float sum = -0.0f;
        for (int j = 0; j < k; j++) sum += sc[sel[j]];
        for (int j = 0; j < k; j++) {
            float w = sc[sel[j]];
            if (norm && sum > 0.0f) w /= sum;
            ids[(size_t)tok * k + j] = sel[j];
            wts[(size_t)tok * k + j] = w * scale;
        }
    }
}

// The integer GEMV's x pre-pass (kernels/gemv.cu, "the integer form"): x as int8 limbs for the
// quantized GEMVs of every type. A thread per 4 values (x_limbs4 in common.cuh); blocks of 256 threads.
extern "C" __global__ void gemv_x_limbs(const float* __restrict__ x, u8* __restrict__ xq, int cols) {
    TRACE_BLOCK(TRACE_X_LIMBS);
    griddep_launch();  // the GEMV after it may start early (PDL, common.cuh)
    const int i4 = blockIdx.x * blockDim.x + threadIdx.x;
    const bool live = i4 < cols / 4;
    const float4 v = live ? ((const float4*)x)[i4] : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    x_limbs4(v, i4, xq, cols, live);
}

