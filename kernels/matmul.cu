// Quantized matrix-vector and matrix-matrix products, out[n, rows] = x[n, cols] · Wᵀ, with W in
// ggml blocks dequantized in registers, and the embedding gather over the same decoders.
//
// Work split: one warp per output row; the row is walked in chunks of 256 values (one k-quant
// super-block, or eight 32-value blocks), each lane decoding 8 of them into registers (deq8).
// The matmul form (NT tokens per block.y) reuses each decoded weight for NT tokens, so W is read
// once per NT tokens. Lane partial sums are reduced with warp shuffles (f32).

#define TY_F32 0
#define TY_F16 1
#define TY_BF16 2
#define TY_Q4_0 3
#define TY_Q4_1 4
#define TY_Q5_0 5
#define TY_Q5_1 6
#define TY_Q8_0 7
#define TY_Q4_K 8
#define TY_Q5_K 9
#define TY_Q6_K 10
#define TY_IQ4_NL 11
#define TY_IQ4_XS 12
#define TY_MXFP4 13

// Codebook of a 4-bit index q through a 16-entry signed-byte table held as four little-endian
// words (t0: entries 0-3 .. t3: 12-15), without a memory lookup.
__device__ __forceinline__ int kv16(u32 t0, u32 t1, u32 t2, u32 t3, int q) {
    u32 b = (q & 8) ? __byte_perm(t2, t3, q & 7) : __byte_perm(t0, t1, q & 7);
    return (int)(i8)(b & 0xFF);
}
// IQ4_NL's and IQ4_XS's kvalues_iq4nl {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38,
// 53, 69, 89, 113}, and MXFP4's kvalues_mxfp4 {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6,
// -8, -12} (ggml's; the engine's CPU decoders in engine/src/dequant/scalar.rs hold the same).
#define KV_IQ4NL 0xBFAD9881u, 0xF6EADDCFu, 0x26190D01u, 0x71594535u
#define KV_MXFP4 0x03020100u, 0x0C080604u, 0xFDFEFF00u, 0xF4F8FAFCu

// MXFP4's block scale, ggml's GGML_E8M0_TO_FP32_HALF: 2^(e − 128), subnormal below e = 2.
__device__ __forceinline__ float e8m0_half(u32 e) {
    return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

__device__ __forceinline__ void k4_scale_min(int j, const u8* q, int* d, int* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Decodes lane `lane`'s 8 values of chunk `c` (values c*256 ..) of one row into w: w[0..4] are
// columns p0 .. p0+4 and w[4..8] columns p1 .. p1+4 (runs of 4, so x is read as float4). p0 < 0:
// the lane has nothing in this chunk. Only the f32/f16/bf16 runs can cross `cols` (zeros there).
template <int TY>
__device__ __forceinline__ void deq8(const u8* row, int c, int lane, int cols, float* w, int* p0, int* p1) {
    if constexpr (TY == TY_F32 || TY == TY_F16 || TY == TY_BF16) {
        int base = c * 256 + lane * 8;
        *p0 = base < cols ? base : -1;
        *p1 = base + 4;
#pragma unroll
        for (int k = 0; k < 8; k++) {
            int p = base + k;
            float v = 0.0f;
            if (p < cols) {
                if constexpr (TY == TY_F32) v = ((const float*)row)[p];
                else if constexpr (TY == TY_F16) v = f16_to_f32(((const u16*)row)[p]);
                else v = bf16_to_f32(((const u16*)row)[p]);
            }
            w[k] = v;
        }
    } else if constexpr (TY == TY_Q4_K || TY == TY_Q5_K) {
        // Q4_K rows are repacked on upload (see below): the super-blocks' 128 quant bytes back to
        // back, then their 16-byte headers (d, dmin, 12 scale bytes). Q5_K keeps ggml blocks.
        const u8* b = TY == TY_Q4_K ? row + (size_t)(cols >> 8) * 128 + (size_t)c * 16 : row + (size_t)c * 176;
        float d = f16_to_f32(ld16(b)), dmin = f16_to_f32(ld16(b + 2));
        const u8* sc = b + 4;
        const u8* qs = TY == TY_Q4_K ? row + (size_t)c * 128 : b + 48;
        int j = lane >> 3, i0 = (lane & 7) * 4;
        int s1, m1, s2, m2;
        k4_scale_min(2 * j, sc, &s1, &m1);
        k4_scale_min(2 * j + 1, sc, &s2, &m2);
        float d1 = d * s1, mm1 = dmin * m1, d2 = d * s2, mm2 = dmin * m2;
        u32 q4 = *(const u32*)(qs + 32 * j + i0);  // 4-byte aligned: 16/48 + 32j + 4i
        u32 h4 = 0;
        if constexpr (TY == TY_Q5_K) h4 = *(const u32*)(b + 16 + i0);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int q = (q4 >> (8 * k)) & 0xFF;
            int lo = q & 0xF, hi = q >> 4;
            if constexpr (TY == TY_Q5_K) {
                int h = (h4 >> (8 * k)) & 0xFF;
                lo += ((h >> (2 * j)) & 1) << 4;
                hi += ((h >> (2 * j + 1)) & 1) << 4;
            }
            w[k] = d1 * lo - mm1;
            w[4 + k] = d2 * hi - mm2;
        }
        *p0 = c * 256 + 64 * j + i0;
        *p1 = *p0 + 32;
    } else if constexpr (TY == TY_Q6_K) {
        // Rows repacked on upload (`repack_q6_k` in engine/src/cuda/gemv.rs): every super-block's 128
        // ql bytes, then the 64 qh bytes of each, then 16 scale bytes of each in unit order (unit
        // i = 4n + 2p + is: sc[8n + is + 2p], sc[8n + is + 2p + 4]), then each one's f16 d.
        // Lane: half (128 values), g (q1/q2 from low nibbles, or q3/q4 from high), l0 (4 of 32 l).
        const int nsb = cols >> 8;
        float d = f16_to_f32(ld16(row + (size_t)nsb * 208 + 2 * c));
        int half = lane >> 4, g = (lane >> 3) & 1, l0 = (lane & 7) * 4;
        const u8* ql = row + (size_t)c * 128 + 64 * half;
        const u8* qh = row + (size_t)nsb * 128 + (size_t)c * 64 + 32 * half;
        const i8* sc = (const i8*)(row + (size_t)nsb * 192 + (size_t)c * 16);
        int is = l0 >> 4;
        float da = d * sc[2 * (4 * half + is) + g], db = d * sc[2 * (4 * half + 2 + is) + g];
        // Rows of an odd super-block count are only 2-byte aligned: 16-bit loads.
        u32 a4 = ld32(ql + l0), b4 = ld32(ql + 32 + l0), h4 = ld32(qh + l0);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int a = (a4 >> (8 * k)) & 0xFF, a2 = (b4 >> (8 * k)) & 0xFF, h = (h4 >> (8 * k)) & 0xFF;
            int qa = g ? ((a >> 4) | (((h >> 4) & 3) << 4)) : ((a & 0xF) | ((h & 3) << 4));
            int qb = g ? ((a2 >> 4) | (((h >> 6) & 3) << 4)) : ((a2 & 0xF) | (((h >> 2) & 3) << 4));
            w[k] = da * (qa - 32);
            w[4 + k] = db * (qb - 32);
        }
        *p0 = c * 256 + 128 * half + 64 * g + l0;
        *p1 = *p0 + 32;
    } else {
        // 32-value blocks: lane handles block (c*8 + lane/4), quarter lane%4 (8 contiguous values).
        // IQ4_XS's 32-value blocks are the 8 of super-block c (cols % 256 == 0).
        const int bb = TY == TY_Q4_0 ? 18 : TY == TY_Q4_1 ? 20 : TY == TY_Q5_0 ? 22 : TY == TY_Q5_1 ? 24 : 34;
        int blk = c * 8 + (lane >> 2), sub = lane & 3;
        if (blk * 32 >= cols) {
            *p0 = -1;
            *p1 = -1;
            return;
        }
        if constexpr (TY == TY_IQ4_NL || TY == TY_IQ4_XS || TY == TY_MXFP4) {
            // ggml blocks as stored, Q4_0's nibble order (value j < 16: low nibble of qs[j]; j + 16:
            // high), each value d·kvalues[q] with the scale d formed first, as the CPU decoder does:
            // IQ4_NL: f16 d, 16 qs (18 bytes). MXFP4: e8m0 byte e, 16 qs (17 bytes), d =
            // 2^(e − 128). IQ4_XS: super-blocks of 136 bytes, f16 d, u16 scales_h, 4 bytes
            // scales_l, 128 qs; block ib's d·(ls − 32), ls = (scales_l nibble ib) | (scales_h
            // bits 2ib, 2ib + 1) << 4, its qs at 8 + 16·ib.
            float d;
            const u8* qs;
            if constexpr (TY == TY_IQ4_NL) {
                const u8* b = row + (size_t)blk * 18;
                d = f16_to_f32(ld16(b));
                qs = b + 2;
            } else if constexpr (TY == TY_MXFP4) {
                const u8* b = row + (size_t)blk * 17;
                d = e8m0_half(b[0]);
                qs = b + 1;
            } else {
                const u8* b = row + (size_t)c * 136;
                int ib = lane >> 2;
                u32 sh = ld16(b + 2);
                int ls = ((b[4 + (ib >> 1)] >> (4 * (ib & 1))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
                d = f16_to_f32(ld16(b)) * (float)(ls - 32);
                qs = b + 8 + 16 * ib;
            }
            int j0 = (sub & 1) * 8, high = sub >> 1;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int q = high ? (qs[j0 + k] >> 4) : (qs[j0 + k] & 0xF);
                int kv;
                if constexpr (TY == TY_MXFP4) kv = kv16(KV_MXFP4, q);
                else kv = kv16(KV_IQ4NL, q);
                w[k] = d * (float)kv;
            }
            *p0 = blk * 32 + high * 16 + j0;
        } else if constexpr (TY == TY_Q8_0) {
            // Repacked rows (see the GEMV below): cols quant bytes, then cols/32 f16 scales.
            float d = f16_to_f32(ld16(row + cols + 2 * blk));
            const i8* qs = (const i8*)(row + (size_t)blk * 32);
#pragma unroll
            for (int k = 0; k < 8; k++) w[k] = d * qs[sub * 8 + k];
            *p0 = blk * 32 + sub * 8;
        } else if constexpr (TY == TY_Q4_1) {
            // Repacked rows (see the GEMV below): cols/2 quant bytes (each block's 16 back to
            // back), then each block's f16 d and m.
            const u8* h = row + (cols >> 1) + 4 * blk;
            float d = f16_to_f32(ld16(h)), m = f16_to_f32(ld16(h + 2));
            const u8* qs = row + (size_t)blk * 16;
            int j0 = (sub & 1) * 8, high = sub >> 1;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int q = high ? (qs[j0 + k] >> 4) : (qs[j0 + k] & 0xF);
                w[k] = q * d + m;
            }
            *p0 = blk * 32 + high * 16 + j0;
        } else {
            const u8* b = row + (size_t)blk * bb;
            float d = f16_to_f32(ld16(b));
            float m = 0.0f;
            if constexpr (TY == TY_Q4_1 || TY == TY_Q5_1) m = f16_to_f32(ld16(b + 2));
            const int qs_off = TY == TY_Q4_0 ? 2 : TY == TY_Q4_1 ? 4 : TY == TY_Q5_0 ? 6 : 8;
            const u8* qs = b + qs_off;
            u32 qh = 0;
            if constexpr (TY == TY_Q5_0) qh = ld16(b + 2) | ((u32)ld16(b + 4) << 16);
            if constexpr (TY == TY_Q5_1) qh = ld16(b + 4) | ((u32)ld16(b + 6) << 16);
            int j0 = (sub & 1) * 8, high = sub >> 1;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                int j = j0 + k;
                int q = high ? (qs[j] >> 4) : (qs[j] & 0xF);
                if constexpr (TY == TY_Q5_0 || TY == TY_Q5_1) {
                    int hb = high ? ((qh >> (j + 12)) & 0x10) : (((qh >> j) << 4) & 0x10);
                    q |= hb;
                }
                float v;
                if constexpr (TY == TY_Q4_0) v = (q - 8) * d;
                else if constexpr (TY == TY_Q5_0) v = (q - 16) * d;
                else v = q * d + m;
                w[k] = v;
            }
            *p0 = blk * 32 + high * 16 + j0;
        }
        *p1 = *p0 + 4;
    }
}

// Dot of the lane's 8 weights with row xr: two float4 loads when the runs are whole and x rows
// are 16-byte aligned (cols % 4 == 0), else scalar loads guarded by cols.
__device__ __forceinline__ float dot8(const float* w, const float* xr, int p0, int p1, int cols, bool vec) {
    if (vec) {
        float4 a = *(const float4*)(xr + p0);
        float4 b = *(const float4*)(xr + p1);
        return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w + w[4] * b.x + w[5] * b.y + w[6] * b.z +
               w[7] * b.w;
    }
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (p0 + k < cols) s += w[k] * xr[p0 + k];
        if (p1 + k < cols) s += w[4 + k] * xr[p1 + k];
    }
    return s;
}

template <int TY, int NT>
__device__ __forceinline__ void matmul_body(const u8* __restrict__ W, const float* __restrict__ x,
                                            float* __restrict__ out, int rows, int cols, int row_bytes, int n) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int row = blockIdx.x * (blockDim.x >> 5) + warp;
    if (row >= rows) return;
    int t0 = blockIdx.y * NT;
    const u8* wr = W + (size_t)row * row_bytes;
    float acc[NT];
#pragma unroll
    for (int t = 0; t < NT; t++) acc[t] = 0.0f;
    int n_chunks = (cols + 255) >> 8;
    bool aligned = (cols & 3) == 0;
#pragma unroll 4
    for (int c = 0; c < n_chunks; c++) {
        float w[8];
        int p0, p1;
        deq8<TY>(wr, c, lane, cols, w, &p0, &p1);
        if (p0 < 0) continue;
        bool vec = aligned && p1 + 4 <= cols;
#pragma unroll
        for (int t = 0; t < NT; t++)
            if (t0 + t < n) acc[t] += dot8(w, x + (size_t)(t0 + t) * cols, p0, p1, cols, vec);
    }
#pragma unroll
    for (int t = 0; t < NT; t++) {
        float v = warp_sum(acc[t]);
        if (lane == 0 && t0 + t < n) out[(size_t)(t0 + t) * rows + row] = v;
    }
}

// Embedding gather: out[t, :] = row ids[t] - start of W (n_rows rows) decoded, or zeros when that
// is not a row (a token outside this rank's vocab range). One warp per token. A decode step
// passes its token as read from device memory (a recorded step's, set before each replay) and its
// shard's first token as `start`; a prefill its rows (start 0, -1 for none).
template <int TY>
__device__ __forceinline__ void gather_body(const u8* __restrict__ W, const int* __restrict__ ids,
                                            float* __restrict__ out, int n, int cols, int row_bytes, int start,
                                            int n_rows) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x * (blockDim.x >> 5) + warp;
    if (t >= n) return;
    float* o = out + (size_t)t * cols;
    const int tok = ids[t], id = tok - start;
    if (tok < 0 || id < 0 || id >= n_rows) {
        for (int i = lane; i < cols; i += 32) o[i] = 0.0f;
        return;
    }
    int n_chunks = (cols + 255) >> 8;
    for (int c = 0; c < n_chunks; c++) {
        float w[8];
        int p0, p1;
        deq8<TY>(W + (size_t)id * row_bytes, c, lane, cols, w, &p0, &p1);
        if (p0 < 0) continue;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if (p0 + k < cols) o[p0 + k] = w[k];
            if (p1 + k < cols) o[p1 + k] = w[4 + k];
        }
    }
}

#define MATMUL_ENTRY(NAME, TY)                                                                            \
    FOR_TYPE(TY)(                                                                                         \
    extern "C" __global__ void matvec_##NAME(const u8* W, const float* x, float* out, int rows, int cols, \
                                             int row_bytes, int n) {                                      \
        matmul_body<TY, 1>(W, x, out, rows, cols, row_bytes, n);                                          \
    }                                                                                                     \
    extern "C" __global__ void matmul_##NAME(const u8* W, const float* x, float* out, int rows, int cols, \
                                             int row_bytes, int n) {                                      \
        matmul_body<TY, 8>(W, x, out, rows, cols, row_bytes, n);                                          \
    }                                                                                                     \
    extern "C" __global__ void gather_##NAME(const u8* W, const int* ids, float* out, int n, int cols,    \
                                             int row_bytes, int start, int n_rows) {                      \
        TRACE_BLOCK(TRACE_GATHER);                                                                        \
        gather_body<TY>(W, ids, out, n, cols, row_bytes, start, n_rows);                                  \
    })

#if LLMDIFF_QUANT_PART != 2  // see gemv_rows.cu
MATMUL_ENTRY(f32, TY_F32)
MATMUL_ENTRY(f16, TY_F16)
MATMUL_ENTRY(bf16, TY_BF16)
MATMUL_ENTRY(q4_0, TY_Q4_0)
MATMUL_ENTRY(q4_1, TY_Q4_1)
MATMUL_ENTRY(q5_0, TY_Q5_0)
MATMUL_ENTRY(q5_1, TY_Q5_1)
MATMUL_ENTRY(q8_0, TY_Q8_0)
MATMUL_ENTRY(q4_k, TY_Q4_K)
MATMUL_ENTRY(q5_k, TY_Q5_K)
MATMUL_ENTRY(q6_k, TY_Q6_K)
MATMUL_ENTRY(iq4_nl, TY_IQ4_NL)
MATMUL_ENTRY(iq4_xs, TY_IQ4_XS)
MATMUL_ENTRY(mxfp4, TY_MXFP4)
#endif

