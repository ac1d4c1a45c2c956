// Tensor-core GEMM for prefill (n > 1 tokens), out[n, rows] = x[n, cols] · Wᵀ, for Q4_K, Q8_0,
// Q4_1, Q6_K and F16 weights in the device layouts of kernels/matmul.cu (quants first, then the headers;
// F16 rows as stored), at f32-like precision.
//
// Precision argument. A weight is (block scale) × (small integer) [− (block offset)]; the
// integers (Q4_K: q·sc ≤ 15·63 = 945; Q8_0: −128..127; Q4_1: 0..15; Q6_K: q − 32 in −32..31) are
// exact in f16. Each
// token's x is scaled by a power of two s (max |x·s| in [2^14, 2^15); exact) and split into two
// f16s, x_hi = f16(x·s), x_lo = f16(x·s − x_hi): 22 significant bits, the split error is at most
// 2^-22 of max |x·s| per value. The tensor cores (mma.sync m16n8k16, f16 × f16 → f32) form
// integer × x_hi and integer × x_lo exactly (11 × 11 bits) and accumulate in f32. Per block
// (Q8_0, Q4_1: 32 values; Q4_K: one 256-value super-block; Q6_K: 16 values, whose scale d·sc is
// exact in f32, since (q − 32)·sc can reach 4096 and would not be exact in f16) the f32 partial
// sum is scaled by the block's d on the CUDA cores, the offset terms (Q4_1 m·Σx, Q4_K dmin·Σ m_sub·Σx_sub) are added
// with per-32-value sums of x·s from the pre-pass, and the result is divided by s (exact).
// F16 weights are f16 already (11 significant bits, as the integers above): w × x_hi and w × x_lo
// are exact in f32 too, and the block scale is 1.
//
// v2 (gemm2_*, Q4_K and Q6_K) keeps the argument. For Q6_K it changes nothing (the per-16 scale
// is folded at every k16 as in v1). For Q4_K it changes only where the offset term is formed: per
// super-block, Σ_sub m_sub·(Σx_sub·s/32) is one more f32-accumulated MMA product, with the 6-bit
// integers m exact in f16 and each Σx_sub·s/32 (|·| < 2^15, so no f16 overflow) split into three
// f16s hi + mid + lo that are exact down to f16's smallest subnormal 2^-24 (far below the x_lo
// split error); then acc += d·(Σ q·sc·x) − 32·dmin·(that), in f32.
//
// Kernels (v1):
// - gemm_split_x: the pre-pass, one block per token of n_pad (n rounded up to the N tile; the
//   padding tokens are written as zeros): x_hi, x_lo (f16, [n_pad, cols] each, x_lo right after
//   x_hi), Σ(x·s) per 32 values ([n_pad, cols/32]) and 1/s ([n_pad]).
// - gemm_q4_k, gemm_q8_0, gemm_q4_1, gemm_q6_k, gemm_f16: block tile BM = 128 weight rows × BN = 64 tokens, 8 warps
//   (4 along rows × 2 along tokens, 32 × 32 each: 2 × 4 mma tiles), K step 64; one block per SM
//   (150–200 registers). gemm_<type>_n32: the same with BN = 32 (warps 32 × 16: 2 × 2 mma
//   tiles), under 128 registers, two blocks per SM. Each step the
//   block loads the next step's weight bytes and x tiles into registers while the tensor cores
//   work on the current one from shared memory; weights become f16 integers on the way to
//   shared memory (a nibble or byte placed in the mantissa of 1024.0 and one exact f16 FMA).
//   Rows past `rows` read the last row and are not stored; tokens past n are zeros (n_pad).
//   Grid: x = token tiles (fastest, so the token tiles of one weight tile run together and the
//   weight bytes come from L2 after the first), y = row tiles.
//
// Kernels (v2, Q4_K and Q6_K, the default; see `engine/src/cuda/gemm.rs`):
// - gemm2_split_x: the pre-pass: x_hi, x_lo as above but each group of 4 values a, b, c, d stored
//   as a, c, b, d; per super-block the Σx MMA's B fragments (the three f16 parts of Σx·s/32 for
//   sub-block pairs); 1/s. A block per token, a warp per super-block, 16-byte loads and stores.
// - gemm2_q4_k (BN = 128 tokens, warp tiles 32 rows × 64 tokens) and gemm2_q4_k_n64 (BN = 64,
//   32 × 32): BM = 128, 8 warps (4 along rows × 2 along tokens), K step 64. Each step's raw
//   quant bytes (128 rows × 32) and x tiles go to shared memory by cp.async, five stages, each
//   loaded three steps ahead, one __syncthreads every second step (one a step cost 5–7 % of the
//   GEMM on the H200); the super-block headers become per-row constants
//   (G2Row) in shared memory two steps before use. A thread reads its quants with one 8-byte
//   load per row and turns them into A fragments in registers (no f16 weight tile): of a 32-bit
//   word (bytes β0..β3), (w & 0x000F000F) | 0x6400 6400 is the f16 pair 1024 + (β0 low, β2 low)
//   and the same of w >> 8 is (β1 low, β3 low) (high nibbles: mask 0x00F000F0, read as 1024 +
//   16·q), and one HFMA2 with the sub-block's (sc, −1024·sc) (high: (sc/16, −64·sc)) gives q·sc
//   exactly. These pairs are fragment registers {a0,a1} / {a4,a5}, so the MMA's k order within
//   a row is β0, β2, β1, β3, ...; the pre-pass stores x in that order (a, c, b, d), so one
//   16-byte shared load gives the B fragments of two k16 tiles. Bytes 8t .. 8t+8 of the step
//   (thread t of a quad): low nibbles → k16 tiles 0, 1, high → 2, 3. x rows in shared memory
//   are 256 bytes (x_hi, x_lo) with 16-byte chunks XOR-swizzled by token parity (conflict-free
//   loads). Grid: x = token tiles, y = the row tiles of up to three matrices (Gemm2Parts) that
//   share x; rows past a matrix's end read its last row and are not stored.
// - gemm6_split_x, gemm2_q6_k, gemm2_q6_k_n64: the same pipeline, tiles and grid for Q6_K. A
//   64-value step is 32 ql bytes (low nibbles: one run of 32 values, high: the run 64 further
//   on) and the 32 qh bytes of their half super-block; both go to shared memory by cp.async
//   (128 rows × 32 bytes each, a row's 16-byte halves swapped where (row >> 2) & 1), the scales
//   (16 bytes) and d (an aligned 4-byte pair) with the headers, and become a per-row G6Row of
//   d·sc. The pre-pass orders x so that each k16 tile is one run of 16 values (one scale): in
//   each 32-value run, chunk k holds groups k and k + 4 of 4 values. A thread reads quant words
//   t and t + 4 of a row (tiles w 0 and 1), makes q − 32 in f16 (mask, shift, one HFMA2), and each
//   tile's two MMAs (x_hi, x_lo) start from zero and are folded into acc by the run's d·sc.
//
// mma.m16n8k16 fragments (groupID g = lane/4, t = lane%4): A (16 × 16, row-major) {a0,a1} =
// (row g, k 2t, 2t+1), {a2,a3} = (row g+8, k 2t..), {a4,a5} = (row g, k 2t+8..), {a6,a7} =
// (row g+8, k 2t+8..); B (16 × 8, "col": each token's k contiguous) {b0,b1} = (k 2t, 2t+1,
// token g), {b2,b3} = (k 2t+8.., token g); C {c0,c1} = (row g, tokens 2t, 2t+1), {c2,c3} =
// (row g+8, same tokens). m16n8k8 (the Σx MMA): A {a0,a1} = (row g, k 2t, 2t+1), {a2,a3} = (row
// g+8, ..); B {b0,b1} = (k 2t, 2t+1, token g); C as above.

#define TY_Q8_0 7
#define TY_Q4_K 8
#define TY_Q4_1 4
#define TY_F16 1
#define TY_Q6_K 10

#define GEMM_BM 128
#define GEMM_BK 64
#define GEMM_LDS 36  // shared row stride in 32-bit words (64 halves + 8 of padding)

// The token pre-passes (gemm_split_x, gemm2_split_x, gemm6_split_x) are built in the module of
// gemm.cu compiled with -DLLMDIFF_GEMM_X (no type), the typed modules hold only their GEMMs.
#ifdef LLMDIFF_GEMM_X
// Token pre-pass: see the file comment. One block of 256 threads per token of n_pad.
extern "C" __global__ void gemm_split_x(const float* __restrict__ x, u16* __restrict__ xh, float* __restrict__ xs,
                                        float* __restrict__ inv, int n, int n_pad, int cols) {
    __shared__ float scratch[32];
    int tok = blockIdx.x;
    const int nb = cols >> 5;
    u16* hi = xh + (size_t)tok * cols;
    u16* lo = xh + (size_t)n_pad * cols + (size_t)tok * cols;
    float* sums = xs + (size_t)tok * nb;
    if (tok >= n) {
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            hi[i] = 0;
            lo[i] = 0;
        }
        for (int b = threadIdx.x; b < nb; b += blockDim.x) sums[b] = 0.0f;
        if (threadIdx.x == 0) inv[tok] = 0.0f;
        return;
    }
    const float* xr = x + (size_t)tok * cols;
    float m = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
    m = block_max(m, scratch);
    // s = 2^shift with max |x·s| in [2^14, 2^15); all-zero tokens keep s = 1.
    int shift = 0;
    if (m > 0.0f) {
        int e = (int)((__float_as_uint(m) >> 23) & 0xFF) - 127;
        shift = min(14 - e, 126);
    }
    float s = __uint_as_float((u32)(127 + shift) << 23);
    if (threadIdx.x == 0) inv[tok] = __uint_as_float((u32)(127 - shift) << 23);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = xr[i] * s;
        u16 h, l;
        asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(v));
        float r = v - f16_to_f32(h);
        asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(l) : "f"(r));
        hi[i] = h;
        lo[i] = l;
    }
    // Σ(x·s) per 32 values: warp w takes blocks w, w + 8, ...; fixed shuffle order.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    for (int b = warp; b < nb; b += n_warps) {
        float v = warp_sum(xr[b * 32 + lane] * s);
        if (lane == 0) sums[b] = v;
    }
}
#endif

__device__ __forceinline__ void mma16816(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Two floats as f16x2: lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// Bytes 0, 1 of w in the low byte of each half (pair 0), or bytes 2, 3 (pair 1).
__device__ __forceinline__ u32 bytes_to_halves(u32 w, int pair) {
    return __byte_perm(w, 0u, pair ? 0x4342u : 0x4140u);
}

// 16 nibble pairs → f16 integers times `mul`: low nibbles to lo[0..8), high nibbles to hi[0..8)
// (each u32 two consecutive values). v = 1024 + q exactly (q in the mantissa), then
// fma(v, mul, −1024·mul) = q·mul exactly (|q·mul| ≤ 945 in every use).
__device__ __forceinline__ void nibbles_to_f16(const u32 (&q)[4], u32 mul, u32 neg_off, u32 (&lo)[8], u32 (&hi)[8]) {
#pragma unroll
    for (int w = 0; w < 4; w++) {
#pragma unroll
        for (int p = 0; p < 2; p++) {
            u32 t = bytes_to_halves(q[w], p);
            lo[2 * w + p] = hfma2((t & 0x000F000Fu) | 0x64006400u, mul, neg_off);
            hi[2 * w + p] = hfma2(((t >> 4) & 0x000F000Fu) | 0x64006400u, mul, neg_off);
        }
    }
}

// Q4_K header words h[0..4) (d|dmin, 12 scale bytes): 6-bit scales and mins of sub-blocks 2j2
// and 2j2+1 (ggml's get_scale_min_k4), bytes 0 and 1 of *sc and *mn.
__device__ __forceinline__ void k4_pair(const u32 (&h)[4], int j2, u32* sc, u32* mn) {
    int sh = (j2 & 1) * 16;
    u32 a = h[1] >> sh, b = h[2] >> sh, c = h[3] >> sh;
    *sc = j2 < 2 ? (a & 0x3F3Fu) : ((c & 0x0F0Fu) | ((a >> 2) & 0x3030u));
    *mn = j2 < 2 ? (b & 0x3F3Fu) : (((c >> 4) & 0x0F0Fu) | ((b >> 2) & 0x3030u));
}

__device__ __forceinline__ u32 ld32g(const u8* p) { return *(const u32*)p; }

// NI: mma tiles of 8 tokens per warp (4: BN = 64 tokens per block; 2: BN = 32). The x tile is
// loaded by XP = 256 / BN threads per token, each XU uint4s (8 halves each) of x_hi and of x_lo.
template <int NI>
struct XTile {
    static constexpr int BN = 16 * NI;
    static constexpr int XP = 256 / BN;
    static constexpr int XU = 64 / XP / 8;
};

template <int TY, int NI>
struct GemmRegs {
    // This thread's weight bytes of the step (F16: 64; Q6_K: 32 of ql, then 32 of qh; Q8_0: 32;
    // else 16).
    u32 q[(TY == TY_F16 || TY == TY_Q6_K) ? 16 : 8];
    u32 h[4];     // header words (Q4_K: the super-block's 16 bytes; Q8_0: d; Q4_1: d|m; Q6_K: 2 scales, d)
    uint4 xh[XTile<NI>::XU];  // halves of x_hi
    uint4 xl[XTile<NI>::XU];  // and of x_lo
    float xs[2];  // Σx of blocks (Q4_K: 8 / XP of the super-block's 8 sub-blocks; Q4_1: 1)
};

template <int TY, int NI>
__device__ __forceinline__ void gemm_load(const u8* __restrict__ wr, const u16* __restrict__ xh_row,
                                          const u16* __restrict__ xl_row, const float* __restrict__ xs_row, int ks,
                                          int cols, int half, int part, bool vec16, GemmRegs<TY, NI>& r) {
    constexpr int XU = XTile<NI>::XU, XP = XTile<NI>::XP;
    const int k0 = ks * GEMM_BK;
    const uint4* ph = (const uint4*)(xh_row + k0 + 8 * XU * part);
    const uint4* pl = (const uint4*)(xl_row + k0 + 8 * XU * part);
#pragma unroll
    for (int i = 0; i < XU; i++) {
        r.xh[i] = ph[i];
        r.xl[i] = pl[i];
    }
    if constexpr (TY == TY_Q4_K) {
        int sb = ks >> 2, j = ks & 3;
        const u8* qp = wr + (size_t)sb * 128 + 32 * j + 16 * half;
        uint4 v = *(const uint4*)qp;
        r.q[0] = v.x;
        r.q[1] = v.y;
        r.q[2] = v.z;
        r.q[3] = v.w;
        if (j == 0) {
            uint4 hv = *(const uint4*)(wr + (size_t)(cols >> 8) * 128 + (size_t)sb * 16);
            r.h[0] = hv.x;
            r.h[1] = hv.y;
            r.h[2] = hv.z;
            r.h[3] = hv.w;
            if constexpr (XP == 4) {
                float2 s2 = *(const float2*)(xs_row + sb * 8 + 2 * part);
                r.xs[0] = s2.x;
                r.xs[1] = s2.y;
            } else {
                r.xs[0] = xs_row[sb * 8 + part];
            }
        }
    } else if constexpr (TY == TY_Q6_K) {
        // Step ks: values 64j .. 64j + 64 of super-block sb (j = ks % 4), in the repacked layout
        // of kernels/matmul.cu (deq8). Half h takes ql bytes 64n + 32h .. + 32 of the super-block
        // (n = j / 2: low nibbles for even j, high for odd), their qh bytes 32n .. 32n + 32 (bits
        // 2h + 4(j % 2), + 1), and the scales of its two runs of 16: ggml's sc[8n + 4(j % 2) +
        // 2h + e], bytes 8n + 4h + 2e + j % 2 of the repacked 16 (e = 0, 1).
        const int nsb = cols >> 8, sb = ks >> 2, j = ks & 3, n = j >> 1;
        const uint4* qp = (const uint4*)(wr + (size_t)sb * 128 + 64 * n + 32 * half);
        const uint4* hp = (const uint4*)(wr + (size_t)nsb * 128 + (size_t)sb * 64 + 32 * n);
        const uint4 v[4] = {qp[0], qp[1], hp[0], hp[1]};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            r.q[4 * i] = v[i].x;
            r.q[4 * i + 1] = v[i].y;
            r.q[4 * i + 2] = v[i].z;
            r.q[4 * i + 3] = v[i].w;
        }
        const u8* sp = wr + (size_t)nsb * 192 + (size_t)sb * 16 + 8 * n + 4 * half + (j & 1);
        r.h[0] = (u32)sp[0] | ((u32)sp[2] << 8);
        r.h[1] = ld16(wr + (size_t)nsb * 208 + 2 * sb);
    } else if constexpr (TY == TY_F16) {
        // Values 32·(2ks + half) .. + 32 of the row: 64 bytes (row_bytes = 2·cols, cols % 64 == 0).
        const uint4* qp = (const uint4*)(wr + (size_t)(2 * ks + half) * 64);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const uint4 v = qp[i];
            r.q[4 * i] = v.x;
            r.q[4 * i + 1] = v.y;
            r.q[4 * i + 2] = v.z;
            r.q[4 * i + 3] = v.w;
        }
    } else if constexpr (TY == TY_Q8_0) {
        int blk = 2 * ks + half;
        const u8* qp = wr + (size_t)blk * 32;
        if (vec16) {
            uint4 a = *(const uint4*)qp, b = *(const uint4*)(qp + 16);
            r.q[0] = a.x;
            r.q[1] = a.y;
            r.q[2] = a.z;
            r.q[3] = a.w;
            r.q[4] = b.x;
            r.q[5] = b.y;
            r.q[6] = b.z;
            r.q[7] = b.w;
        } else {
#pragma unroll
            for (int i = 0; i < 8; i++) r.q[i] = ld32g(qp + 4 * i);
        }
        r.h[0] = ld16(wr + cols + 2 * blk);
    } else {
        int blk = 2 * ks + half;
        const u8* qp = wr + (size_t)blk * 16;
        if (vec16) {
            uint4 a = *(const uint4*)qp;
            r.q[0] = a.x;
            r.q[1] = a.y;
            r.q[2] = a.z;
            r.q[3] = a.w;
        } else {
#pragma unroll
            for (int i = 0; i < 4; i++) r.q[i] = ld32g(qp + 4 * i);
        }
        r.h[0] = ld32g(wr + (cols >> 1) + 4 * blk);
        if (part < 2) r.xs[0] = xs_row[2 * ks + part];
    }
}

// Shared memory of one block (BN tokens).
template <int BN>
struct GemmSmem {
    u32 a[GEMM_BM][GEMM_LDS];   // weight integers as f16 pairs, [row][k/2]
    u32 bh[BN][GEMM_LDS];     // x_hi, [token][k/2]
    u32 bl[BN][GEMM_LDS];     // x_lo
    float scale[GEMM_BM][4];    // per-row block scale (Q4_K: [0] = d; Q6_K: the step's 4 runs of 16;
                                // else the step's 2 blocks)
    float off[GEMM_BM][8];      // Q4_K: dmin·m per sub-block; Q4_1: m of the step's 2 blocks
    float xs[BN][8];            // Q4_K: Σx per sub-block; Q4_1: Σx of the step's 2 blocks
};

template <int TY, int NI>
__device__ __forceinline__ void gemm_store(GemmSmem<XTile<NI>::BN>& sm, const GemmRegs<TY, NI>& r, int ks, int row_l, int half,
                                           int tok_l, int part) {
    constexpr int XU = XTile<NI>::XU, XP = XTile<NI>::XP;
    uint4* bh = (uint4*)&sm.bh[tok_l][4 * XU * part];
    uint4* bl = (uint4*)&sm.bl[tok_l][4 * XU * part];
#pragma unroll
    for (int i = 0; i < XU; i++) {
        bh[i] = r.xh[i];
        bl[i] = r.xl[i];
    }
    uint4* arow = (uint4*)&sm.a[row_l][0];
    if constexpr (TY == TY_Q4_K) {
        int j = ks & 3;
        u32 sc, mn;
        k4_pair(r.h, j, &sc, &mn);
        // Low nibbles: sub-block 2j (k 0..32 of the step), high: 2j+1 (k 32..64).
        float s0 = (float)(sc & 0xFF), s1 = (float)((sc >> 8) & 0xFF);
        u32 mul0 = pack_f16x2(s0, s0), mul1 = pack_f16x2(s1, s1);
        u32 neg0 = pack_f16x2(-1024.0f * s0, -1024.0f * s0), neg1 = pack_f16x2(-1024.0f * s1, -1024.0f * s1);
        const u32 q[4] = {r.q[0], r.q[1], r.q[2], r.q[3]};
        u32 lo[8], hi[8], lo1[8], hi1[8];
        nibbles_to_f16(q, mul0, neg0, lo, hi1);
        nibbles_to_f16(q, mul1, neg1, lo1, hi);
        // lo: sub 2j values 16·half.. (words 8·half..), hi: sub 2j+1 (words 16 + 8·half..).
        arow[2 * half] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        arow[2 * half + 1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
        arow[4 + 2 * half] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        arow[5 + 2 * half] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
        if (j == 0) {
            float dmin = f16_to_f32((u16)(r.h[0] >> 16));
            if (half == 0) sm.scale[row_l][0] = f16_to_f32((u16)(r.h[0] & 0xFFFF));
#pragma unroll
            for (int p = 0; p < 2; p++) {
                u32 s_, m_;
                k4_pair(r.h, 2 * half + p, &s_, &m_);
                sm.off[row_l][4 * half + 2 * p] = dmin * (float)(m_ & 0xFF);
                sm.off[row_l][4 * half + 2 * p + 1] = dmin * (float)((m_ >> 8) & 0xFF);
            }
            if constexpr (XP == 4) {
                sm.xs[tok_l][2 * part] = r.xs[0];
                sm.xs[tok_l][2 * part + 1] = r.xs[1];
            } else {
                sm.xs[tok_l][part] = r.xs[0];
            }
        }
    } else if constexpr (TY == TY_Q6_K) {
        // q = nibble | 2 bits of qh << 4 per byte; 1024 + q in the mantissa, minus 1056: q − 32.
        const int nib = 4 * (ks & 1), sh = 2 * half + nib;
        const u32 one = 0x3C003C00u, neg = 0xE420E420u;
        u32 v[16];
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 b = ((r.q[w] >> nib) & 0x0F0F0F0Fu) | (((r.q[8 + w] >> sh) & 0x03030303u) << 4);
            v[2 * w] = hfma2(bytes_to_halves(b, 0) | 0x64006400u, one, neg);
            v[2 * w + 1] = hfma2(bytes_to_halves(b, 1) | 0x64006400u, one, neg);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) arow[4 * half + i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        const float d = f16_to_f32((u16)r.h[1]);
        sm.scale[row_l][2 * half] = d * (float)(i8)(r.h[0] & 0xFFu);
        sm.scale[row_l][2 * half + 1] = d * (float)(i8)((r.h[0] >> 8) & 0xFFu);
    } else if constexpr (TY == TY_F16) {
#pragma unroll
        for (int i = 0; i < 4; i++)
            arow[4 * half + i] = make_uint4(r.q[4 * i], r.q[4 * i + 1], r.q[4 * i + 2], r.q[4 * i + 3]);
        sm.scale[row_l][half] = 1.0f;
    } else if constexpr (TY == TY_Q8_0) {
        // Bytes xor 0x80 are q + 128: 1024 + q + 128 in the mantissa, minus 1152.
        const u32 one = 0x3C003C00u, neg = 0xE480E480u;
        u32 v[16];
#pragma unroll
        for (int w = 0; w < 8; w++) {
            u32 b = r.q[w] ^ 0x80808080u;
            v[2 * w] = hfma2(bytes_to_halves(b, 0) | 0x64006400u, one, neg);
            v[2 * w + 1] = hfma2(bytes_to_halves(b, 1) | 0x64006400u, one, neg);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) arow[4 * half + i] = make_uint4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        sm.scale[row_l][half] = f16_to_f32((u16)r.h[0]);
    } else {
        // Block 2ks + half: low nibbles are values 0..16, high nibbles 16..32.
        const u32 one = 0x3C003C00u, neg = 0xE400E400u;
        const u32 q[4] = {r.q[0], r.q[1], r.q[2], r.q[3]};
        u32 lo[8], hi[8];
        nibbles_to_f16(q, one, neg, lo, hi);
        arow[4 * half] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        arow[4 * half + 1] = make_uint4(lo[4], lo[5], lo[6], lo[7]);
        arow[4 * half + 2] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
        arow[4 * half + 3] = make_uint4(hi[4], hi[5], hi[6], hi[7]);
        sm.scale[row_l][half] = f16_to_f32((u16)(r.h[0] & 0xFFFF));
        sm.off[row_l][half] = f16_to_f32((u16)(r.h[0] >> 16));
        if (part < 2) sm.xs[tok_l][part] = r.xs[0];
    }
}

template <int TY, int NI>
__device__ __forceinline__ void gemm_body(const u8* __restrict__ W, const u16* __restrict__ xh,
                                          const float* __restrict__ xs, const float* __restrict__ inv,
                                          float* __restrict__ out, int rows, int cols, int row_bytes, int n, int n_pad) {
    __shared__ __align__(16) GemmSmem<XTile<NI>::BN> sm;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp & 3, wn = warp >> 2;
    constexpr int BN = XTile<NI>::BN, XP = XTile<NI>::XP;
    const int tok0 = blockIdx.x * BN, row0 = blockIdx.y * GEMM_BM;
    // Loader roles: weights (row_l, half), x (tok_l, part).
    const int row_l = tid >> 1, half = tid & 1;
    const int tok_l = tid / XP, part = tid % XP;
    const u8* wr = W + (size_t)min(row0 + row_l, rows - 1) * row_bytes;
    const u16* xh_row = xh + (size_t)(tok0 + tok_l) * cols;
    const u16* xl_row = xh + (size_t)n_pad * cols + (size_t)(tok0 + tok_l) * cols;
    const float* xs_row = xs + (size_t)(tok0 + tok_l) * (cols >> 5);
    const bool vec16 = (row_bytes & 15) == 0;
    const int n_steps = cols / GEMM_BK;

    float acc[2][NI][4], tmp[2][NI][4];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[mi][ni][e] = 0.0f;
                tmp[mi][ni][e] = 0.0f;
            }

    GemmRegs<TY, NI> r;
    gemm_load<TY, NI>(wr, xh_row, xl_row, xs_row, 0, cols, half, part, vec16, r);
    for (int ks = 0; ks < n_steps; ks++) {
        __syncthreads();
        gemm_store<TY, NI>(sm, r, ks, row_l, half, tok_l, part);
        __syncthreads();
        if (ks + 1 < n_steps) gemm_load<TY, NI>(wr, xh_row, xl_row, xs_row, ks + 1, cols, half, part, vec16, r);
        // Fold the partial sums into acc with run scale sm.scale[row][si] (and the offsets of
        // half h of the step).
        auto fold = [&](int si, int h) {
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int e2 = 0; e2 < 2; e2++) {
                    int rl = wm * 32 + mi * 16 + g + 8 * e2;
                    float d = sm.scale[rl][si];
                    const float* o = &sm.off[rl][TY == TY_Q4_1 ? h : 0];
#pragma unroll
                    for (int ni = 0; ni < NI; ni++)
#pragma unroll
                        for (int e1 = 0; e1 < 2; e1++) {
                            int tl = wn * 8 * NI + ni * 8 + 2 * t + e1;
                            int e = 2 * e2 + e1;
                            float a_ = fmaf(d, tmp[mi][ni][e], acc[mi][ni][e]);
                            if constexpr (TY == TY_Q4_K) {
                                float4 u = *(const float4*)&sm.xs[tl][0], v = *(const float4*)&sm.xs[tl][4];
                                float4 p = *(const float4*)&o[0], q = *(const float4*)&o[4];
                                float m = p.x * u.x;
                                m = fmaf(p.y, u.y, m);
                                m = fmaf(p.z, u.z, m);
                                m = fmaf(p.w, u.w, m);
                                m = fmaf(q.x, v.x, m);
                                m = fmaf(q.y, v.y, m);
                                m = fmaf(q.z, v.z, m);
                                m = fmaf(q.w, v.w, m);
                                a_ -= m;
                            } else if constexpr (TY == TY_Q4_1) {
                                a_ = fmaf(o[0], sm.xs[tl][h], a_);
                            }
                            acc[mi][ni][e] = a_;
                            tmp[mi][ni][e] = 0.0f;
                        }
                }
        };
#pragma unroll
        for (int h = 0; h < 2; h++) {
#pragma unroll
            for (int k2 = 0; k2 < 2; k2++) {
                const int kw = 16 * h + 8 * k2;  // step-local k / 2 of this k16
                u32 a[2][4];
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    int rr = wm * 32 + mi * 16 + g;
                    a[mi][0] = sm.a[rr][kw + t];
                    a[mi][1] = sm.a[rr + 8][kw + t];
                    a[mi][2] = sm.a[rr][kw + t + 4];
                    a[mi][3] = sm.a[rr + 8][kw + t + 4];
                }
#pragma unroll
                for (int ni = 0; ni < NI; ni++) {
                    int cc = wn * 8 * NI + ni * 8 + g;
                    u32 h0 = sm.bh[cc][kw + t], h1 = sm.bh[cc][kw + t + 4];
                    u32 l0 = sm.bl[cc][kw + t], l1 = sm.bl[cc][kw + t + 4];
#pragma unroll
                    for (int mi = 0; mi < 2; mi++) {
                        mma16816(tmp[mi][ni], a[mi], h0, h1);
                        mma16816(tmp[mi][ni], a[mi], l0, l1);
                    }
                }
                // Q6_K's runs of 16 end at every k16.
                if constexpr (TY == TY_Q6_K) fold(2 * h + k2, h);
            }
            // Block ends: fold the partial sums in with the block's scale (and offset).
            // F16 has no block scale but is still folded in once a step: left in the tensor cores'
            // f32 accumulator for a whole row, the sums drift (5.3e-5 at the 8B-shaped F16 model's
            // logits after 8 layers, against 1e-6 folded).
            if constexpr (TY != TY_Q6_K) {
                bool flush = TY == TY_Q4_K ? (h == 1 && (ks & 3) == 3) : TY == TY_F16 ? h == 1 : true;
                if (flush) fold(TY == TY_Q4_K ? 0 : h, h);
            }
        }
    }
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int row = row0 + wm * 32 + mi * 16 + g + 8 * (e >> 1);
                int tok = tok0 + wn * 8 * NI + ni * 8 + 2 * t + (e & 1);
                if (row < rows && tok < n) out[(size_t)tok * rows + row] = acc[mi][ni][e] * inv[tok];
            }
}

// Entry points gemm_<type> (NI 4: 64-token tiles, one block per SM's worth of registers) and
// gemm_<type>_n32 (NI 2: 32-token tiles, two blocks per SM). W: rows × row_bytes in the device
// layout; xh: the pre-pass's x_hi then x_lo ([n_pad, cols] f16 each); xs: [n_pad, cols/32]; inv:
// [n_pad]; out: [n, rows]. Grid (n_pad / BN, ⌈rows / 128⌉), 256 threads; n_pad a multiple of
// BN. cols % 64 == 0 (Q4_K: % 256), row_bytes % 4 == 0 (F16: 2·cols).
#define GEMM_ENTRY(NAME, TY)                                                                                  \
    FOR_TYPE(TY)(extern "C" __global__ __launch_bounds__(256, 1) void gemm_##NAME(const u8* W, const u16* xh, const float* xs, \
                                                                      const float* inv, float* out, int rows,  \
                                                                      int cols, int row_bytes, int n, int n_pad) { \
        gemm_body<TY, 4>(W, xh, xs, inv, out, rows, cols, row_bytes, n, n_pad);                               \
    }                                                                                                         \
    extern "C" __global__ __launch_bounds__(256, 2) void gemm_##NAME##_n32(                                   \
        const u8* W, const u16* xh, const float* xs, const float* inv, float* out, int rows, int cols,       \
        int row_bytes, int n, int n_pad) {                                                                    \
        gemm_body<TY, 2>(W, xh, xs, inv, out, rows, cols, row_bytes, n, n_pad);                               \
    })

GEMM_ENTRY(q4_k, TY_Q4_K)
GEMM_ENTRY(q8_0, TY_Q8_0)
GEMM_ENTRY(q4_1, TY_Q4_1)
GEMM_ENTRY(f16, TY_F16)
GEMM_ENTRY(q6_k, TY_Q6_K)

// ---------------------------------------------------------------------------------------------
// v2, Q4_K only: gemm2_split_x (pre-pass) and gemm2_q4_k / gemm2_q4_k_n64 (the GEMM). See the file
// comment for the layout; the pieces below are in the order the main loop uses them.

#define G2_BM 128
#define G2_BK 64

__device__ __forceinline__ u16 f32_to_f16(float v) {
    u16 h;
    asm("{ .reg .b16 t; cvt.rn.f16.f32 t, %1; mov.b16 %0, t; }" : "=h"(h) : "f"(v));
    return h;
}

// A sub-block sum S (|S| < 2^15) as three f16s hi + mid + lo: exact down to f16's smallest
// subnormal, 2^-24 (S - hi and the next remainder are exact in f32).
__device__ __forceinline__ void split3(float v, u16* hi, u16* mid, u16* lo) {
    *hi = f32_to_f16(v);
    float r = v - f16_to_f32(*hi);
    *mid = f32_to_f16(r);
    *lo = f32_to_f16(r - f16_to_f32(*mid));
}

// Pre-pass for v2: one block of 256 threads per token of n_pad; each thread takes 8 consecutive
// values at a time (two float4 loads, one 16-byte store of x_hi and one of x_lo), a warp one
// 256-value super-block. Writes x_hi, x_lo in the GEMM's k order (in each group of 4 values
// a, b, c, d: a, c, b, d), per super-block the B fragments of the Σx MMA (16 words: word 4t + p
// is part p (hi, mid, lo; word 4t + 3 = 0) of sub-blocks 2t, 2t+1's Σ(x·s)/32 as an f16 pair), and
// 1/s. Padding tokens (n ≤ tok < n_pad) are zeros. cols % 256 == 0.
//
// Q6 (gemm6_split_x, for gemm2_q6_k): within each run of 32 values, the 16-byte chunk k (k = 0..3)
// holds groups k and k + 4 of 4 values (values 4k .., 16 + 4k ..), each as a, c, b, d, so a
// thread's chunk of a step is its B fragments of both k16 tiles of a run, and each k16 tile is
// one run of 16 (one Q6_K scale).
template <bool Q6>
__device__ __forceinline__ void split_x_body(const float* __restrict__ x, u16* __restrict__ xh, u32* __restrict__ xsb,
                                             float* __restrict__ inv, int n, int n_pad, int cols) {
    __shared__ float scratch[32];
    const int tok = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_sb = cols >> 8;
    const float* xr = x + (size_t)tok * cols;
    float m = 0.0f;
    if (tok < n) {
        for (int i = threadIdx.x * 4; i < cols; i += 1024) {
            float4 v = *(const float4*)(xr + i);
            m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
        }
    }
    m = block_max(m, scratch);
    // s = 2^shift with max |x·s| in [2^14, 2^15); all-zero (and padding) tokens keep s = 1.
    int shift = 0;
    if (m > 0.0f) {
        int e = (int)((__float_as_uint(m) >> 23) & 0xFF) - 127;
        shift = min(14 - e, 126);
    }
    const float s = __uint_as_float((u32)(127 + shift) << 23);
    if (threadIdx.x == 0) inv[tok] = tok < n ? __uint_as_float((u32)(127 - shift) << 23) : 0.0f;
    u16* hi = xh + (size_t)tok * cols;
    u16* lo = xh + (size_t)n_pad * cols + (size_t)tok * cols;
    for (int sb = warp; sb < n_sb; sb += 8) {
        const int i = sb * 256 + lane * 8;
        float v[8];
        if (tok < n) {
            float4 a = *(const float4*)(xr + i), b = *(const float4*)(xr + i + 4);
            v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v[k] = 0.0f;
        }
        u32 h[4], l[4];
        float sum = 0.0f;
        constexpr int perm[8] = {0, 2, 1, 3, 4, 6, 5, 7};
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            u16 hk[2], lk[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float y = v[perm[k + e]] * s;
                hk[e] = f32_to_f16(y);
                lk[e] = f32_to_f16(y - f16_to_f32(hk[e]));
            }
            h[k / 2] = (u32)hk[0] | ((u32)hk[1] << 16);
            l[k / 2] = (u32)lk[0] | ((u32)lk[1] << 16);
        }
#pragma unroll
        for (int k = 0; k < 8; k++) sum += v[k] * s;
        if constexpr (Q6) {
            // This thread's groups 2c, 2c + 1 of its run (c = lane % 4) go to chunks 2c % 4 and
            // (2c + 1) % 4, in their halves 2c / 4.
            const int run = i & ~31, c = lane & 3, half = 4 * (c >> 1);
            *(uint2*)(hi + run + 8 * (2 * c & 3) + half) = make_uint2(h[0], h[1]);
            *(uint2*)(hi + run + 8 * ((2 * c + 1) & 3) + half) = make_uint2(h[2], h[3]);
            *(uint2*)(lo + run + 8 * (2 * c & 3) + half) = make_uint2(l[0], l[1]);
            *(uint2*)(lo + run + 8 * ((2 * c + 1) & 3) + half) = make_uint2(l[2], l[3]);
        } else {
            *(uint4*)(hi + i) = make_uint4(h[0], h[1], h[2], h[3]);
            *(uint4*)(lo + i) = make_uint4(l[0], l[1], l[2], l[3]);
        }
        // Σ over the 4 lanes of a sub-block (fixed order), then lanes 0..3 write the pairs.
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const float s0 = __shfl_sync(0xffffffffu, sum, 8 * (lane & 3)) * 0.03125f;
        const float s1 = __shfl_sync(0xffffffffu, sum, 8 * (lane & 3) + 4) * 0.03125f;
        if (lane < 4) {
            u16 a0, a1, a2, b0, b1, b2;
            split3(s0, &a0, &a1, &a2);
            split3(s1, &b0, &b1, &b2);
            *(uint4*)(xsb + ((size_t)tok * n_sb + sb) * 16 + 4 * lane) =
                make_uint4((u32)a0 | ((u32)b0 << 16), (u32)a1 | ((u32)b1 << 16), (u32)a2 | ((u32)b2 << 16), 0u);
        }
    }
}

#ifdef LLMDIFF_GEMM_X
extern "C" __global__ void __launch_bounds__(256) gemm2_split_x(const float* __restrict__ x, u16* __restrict__ xh,
                                                                  u32* __restrict__ xsb, float* __restrict__ inv,
                                                                  int n, int n_pad, int cols) {
    split_x_body<false>(x, xh, xsb, inv, n, n_pad, cols);
}
extern "C" __global__ void __launch_bounds__(256) gemm6_split_x(const float* __restrict__ x, u16* __restrict__ xh,
                                                                  u32* __restrict__ xsb, float* __restrict__ inv,
                                                                  int n, int n_pad, int cols) {
    split_x_body<true>(x, xh, xsb, inv, n, n_pad, cols);
}
#endif

__device__ __forceinline__ void mma1688(float (&d)[4], u32 a0, u32 a1, u32 b, const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// Up to three Q4_K matrices of the same cols sharing x (q/k/v, gate/up) in one launch: matrix i
// has rows_i rows and output out_i ([n, rows_i]); the grid's row tiles are matrix 0's, then 1's
// (from tile tend0), then 2's (from tend1). Unused pointers are null and never touched.
struct Gemm2Parts {
    const u8 *w0, *w1, *w2;
    float *out0, *out1, *out2;
    int rows0, rows1, rows2;
    int tend0, tend1;
};

// Per weight row and super-block, built from the 16-byte header by one thread: for each 64-value
// step j the HFMA2 constants of its two sub-blocks (low nibbles: (sc, −1024·sc); high nibbles,
// read as 16·q: (sc/16, −64·sc), each f16x2), the m pairs (f16x2 m_2t | m_2t+1) as the Σx MMA's
// A fragment, and (d, 32·dmin).
struct G2Row {
    uint4 mn[4];
    uint4 mp;
    float4 dd;
};

// (a & MASK) | magic in one LOP3 (magic in a register: LOP3 takes one immediate).
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 a, u32 magic) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(magic));
    return d;
}

// Shared memory of a gemm2 variant. Q4_K: per stage 128 rows × 32 quant bytes; headers 16 bytes a
// row; Σx fragments; G2Row constants. Q6_K (mma.sync only): per stage 128 rows × 32 ql bytes,
// then 128 × 32 qh bytes; headers 32 bytes a row (16 scales, then the 4-byte word holding its
// f16 d); no Σx; G6Row constants.
template <int TY, int NI>
struct G2 {
    static_assert(TY == TY_Q4_K || TY == TY_Q6_K, "gemm2: Q4_K or Q6_K");
    static constexpr bool Q6 = TY == TY_Q6_K;
    static constexpr int BN = 16 * NI;       // tokens per block (warps: 4 along rows × 2 along tokens)
    static constexpr int STAGES = 5;
    static constexpr int A_BYTES = G2_BM * (Q6 ? 64 : 32);  // one step's weight bytes
    static constexpr int X_BYTES = BN * 256;    // x_hi (128 bytes) then x_lo per token, swizzled
    static constexpr int STAGE = A_BYTES + X_BYTES;
    static constexpr int HDR_ROW = Q6 ? 32 : 16;
    static constexpr int HDR = STAGES * STAGE;                // 2 × 128 headers
    static constexpr int XSB = HDR + 2 * G2_BM * HDR_ROW;     // 2 × BN × 64 bytes of Σx fragments
    static constexpr int ROWS = XSB + (Q6 ? 0 : 2 * BN * 64);  // 2 × 128 row constants
    static constexpr int SMEM = ROWS + 2 * G2_BM * (Q6 ? 64 : (int)sizeof(G2Row));
};

// Q6_K per weight row and super-block: for each 64-value step j (ql bytes 32j .. 32j + 32: their
// low nibbles are values 128·(j/2) + 32·(j%2) + 0..32, the high ones 64 further on) the f32
// scales d·sc of its four runs of 16 in the order g6_step takes them, k16 tile (p, w) at 2p + w:
// the low nibbles' run (p 0) then the high (p 1), values 0..16 of it (w 0) then 16..32. With the
// repacked scales (unit order, `repack_q6_k`) those are scale bytes 4j + 0, 2, 1, 3.
struct G6Row {
    float4 s[4];
};

__device__ __forceinline__ void g2_row_consts(const uint4 hv, G2Row* out) {
    const u32 h[4] = {hv.x, hv.y, hv.z, hv.w};
    u32 mp[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        u32 sc, mn;
        k4_pair(h, j, &sc, &mn);
        float s0 = (float)(sc & 0xFF), s1 = (float)((sc >> 8) & 0xFF);
        out->mn[j] = make_uint4(pack_f16x2(s0, s0), pack_f16x2(-1024.0f * s0, -1024.0f * s0),
                                pack_f16x2(s1 * 0.0625f, s1 * 0.0625f), pack_f16x2(-64.0f * s1, -64.0f * s1));
        mp[j] = pack_f16x2((float)(mn & 0xFF), (float)((mn >> 8) & 0xFF));
    }
    out->mp = make_uint4(mp[0], mp[1], mp[2], mp[3]);
    out->dd = make_float4(f16_to_f32((u16)(hv.x & 0xFFFF)), 32.0f * f16_to_f32((u16)(hv.x >> 16)), 0.0f, 0.0f);
}

// The tile shape of a gemm2 variant: mma.sync, 8 warps as 4 along rows × 2 along tokens, each
// MI = 2 row tiles of 16 × NT = NI n8 tiles.
template <int NI>
struct G2Warp {
    static constexpr int MI = 2;
    static constexpr int NT = NI;
};

// mma.sync B fragments of token tl of a stage's x tile (256-byte rows, 16-byte chunks swizzled
// by token parity), thread t of its quad: x_hi chunk 4p + t into bh, x_lo's into bl; .x, .y the
// first k16 tile's {b0,b1}, {b2,b3}, .z, .w the second's.
__device__ __forceinline__ void g2_x_frags(const u8* xbase, int tl, int p, int t, uint4& bh, uint4& bl) {
    const int sw = (tl & 1) << 2;
    bh = *(const uint4*)(xbase + tl * 256 + 16 * ((4 * p + t) ^ sw));
    bl = *(const uint4*)(xbase + tl * 256 + 16 * ((8 + 4 * p + t) ^ sw));
}

// Q6_K header of one row and super-block: its 16 scale bytes (unit order) hv, its f16 d in the low
// half of dw → the G6Row (d·sc exact in f32).
__device__ __forceinline__ void g6_row_consts(const uint4 hv, u32 dw, G6Row* out) {
    const float d = f16_to_f32((u16)(dw & 0xFFFFu));
    const u32 h[4] = {hv.x, hv.y, hv.z, hv.w};
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const u32 w = h[j];
        out->s[j] = make_float4(d * (float)(i8)(w & 0xFF), d * (float)(i8)((w >> 16) & 0xFF),
                                d * (float)(i8)((w >> 8) & 0xFF), d * (float)(i8)(w >> 24));
    }
}

// One 64-value step j of gemm2_q6_k for this thread (mma.sync tile: 2 row tiles of 16 × NI token
// tiles of 8). Stage: 128 rows × 32 ql bytes, then 128 × 32 qh bytes, the two 16-byte halves of a
// row swapped where (row >> 2) & 1 (conflict-free 4-byte reads); x in gemm6_split_x's order. k16
// tile (p, w) of the step is its run of 16 values 16·(2p + w): thread t's A registers come from
// quant words t (w 0) and t + 4 (w 1): {a0,a1} = bytes 0, 2 and {a4,a5} = bytes 1, 3, p 0 the low
// nibbles, 1 the high; the 2-bit highs are bits 2·(j & 1) + 4p of the qh byte at the same place.
// 1024 + q is placed in an f16 mantissa and one HFMA2 makes q − 32 (exact); each tile's two
// MMAs (x_hi, x_lo) start from zero and the run's d·sc (exact in f32) folds them into acc.
template <int NI>
__device__ __forceinline__ void g6_step(const u8* abase, const u8* xbase, const G6Row* rt, int j, int wm, int wn, int g,
                                        int t, u32 magic, float (&acc)[2][NI][4]) {
    const u32 one = 0x3C003C00u, m1056 = 0xE420E420u;  // f16 pairs (1, 1), (−1056, −1056)
    const int sw = 16 * ((g >> 2) & 1), hsh = 2 * (j & 1);
#pragma unroll
    for (int p = 0; p < 2; p++) {
        u32 a[2][2][4];
        float2 sc[2][2];  // [mi][e]: the scales of tiles (p, 0), (p, 1) of rows g, g + 8
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int r = wm * 32 + mi * 16 + g + 8 * e;
                sc[mi][e] = *((const float2*)&rt[r].s[j] + p);
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    // ql, qh words t (w 0) and t + 4 (w 1) of row r.
                    const int off = r * 32 + ((16 * w) ^ sw) + 4 * t;
                    const u32 l = *(const u32*)(abase + off) >> (4 * p);
                    const u32 h = (*(const u32*)(abase + G2_BM * 32 + off) >> (hsh + 4 * p)) << 4;
                    a[mi][w][e] = hfma2(and_or<0x00300030u>(h, and_or<0x000F000Fu>(l, magic)), one, m1056);
                    a[mi][w][2 + e] = hfma2(and_or<0x00300030u>(h >> 8, and_or<0x000F000Fu>(l >> 8, magic)), one, m1056);
                }
            }
#pragma unroll
        for (int ni = 0; ni < NI; ni++) {
            uint4 bh, bl;
            g2_x_frags(xbase, wn * 8 * NI + ni * 8 + g, p, t, bh, bl);
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    float tm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma16816(tm, a[mi][w], w ? bh.z : bh.x, w ? bh.w : bh.y);
                    mma16816(tm, a[mi][w], w ? bl.z : bl.x, w ? bl.w : bl.y);
                    const float s0 = w ? sc[mi][0].y : sc[mi][0].x, s1 = w ? sc[mi][1].y : sc[mi][1].x;
                    acc[mi][ni][0] = fmaf(s0, tm[0], acc[mi][ni][0]);
                    acc[mi][ni][1] = fmaf(s0, tm[1], acc[mi][ni][1]);
                    acc[mi][ni][2] = fmaf(s1, tm[2], acc[mi][ni][2]);
                    acc[mi][ni][3] = fmaf(s1, tm[3], acc[mi][ni][3]);
                }
        }
    }
}

template <int TY, int NI>
__device__ __forceinline__ void gemm2_body(const Gemm2Parts& P, const u16* __restrict__ xh,
                                           const u32* __restrict__ xsb, const float* __restrict__ inv, int cols,
                                           int n, int n_pad) {
    using C = G2<TY, NI>;
    constexpr bool Q6 = C::Q6;
    constexpr int BN = C::BN, S = C::STAGES;
    constexpr int MI = G2Warp<NI>::MI, NT = G2Warp<NI>::NT;
    extern __shared__ __align__(16) u8 smem[];
    {
    {
        u32 dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < (u32)C::SMEM) __trap();
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp & 3, wn = warp >> 2;
    // The warp's first row and token in the block tile.
    const int wrow = 32 * wm, wtok = wn * 8 * NI;
    // The block's matrix and row tile.
    const int ty = blockIdx.y;
    const int part = ty < P.tend0 ? 0 : ty < P.tend1 ? 1 : 2;
    const u8* W = part == 0 ? P.w0 : part == 1 ? P.w1 : P.w2;
    float* out = part == 0 ? P.out0 : part == 1 ? P.out1 : P.out2;
    const int rows = part == 0 ? P.rows0 : part == 1 ? P.rows1 : P.rows2;
    const int row0 = (ty - (part == 0 ? 0 : part == 1 ? P.tend0 : P.tend1)) * G2_BM;
    const int tok0 = blockIdx.x * BN;
    // Split K (blockIdx.z of gridDim.z): this block's super-blocks [sb0, sb0 + n_sb) of the row's
    // cols / 256; the pointers below start at sb0, strides use the whole row (n_all).
    const int n_all = cols >> 8, splits = gridDim.z;
    const int sb0 = (int)((long)blockIdx.z * n_all / splits);
    const int n_sb = (int)((long)(blockIdx.z + 1) * n_all / splits) - sb0, n_steps = 4 * n_sb;
    const size_t row_bytes = (size_t)n_all * (Q6 ? 210 : 144);
    if (n_sb == 0) return;  // the host splits at most into the row's super-blocks

    // Loader roles. Quants: row tid/2, 16-byte half tid%2 (Q6_K: of ql, and of qh). Headers: row
    // tid (tid < 128). x: chunk c = tid % 16 of tokens tid/16 + 16·r (c < 8: x_hi, else x_lo).
    // Stored at chunk c ^ 4·(token & 1) of its 256-byte token row. Σx fragments:
    // chunk tid % 4 of tokens tid/4 + 64·r.
    const u8* wrow_q = W + (size_t)min(row0 + (tid >> 1), rows - 1) * row_bytes;
    const u8* wq = wrow_q + (size_t)sb0 * 128 + 16 * (tid & 1);
    const u8* wqh = wrow_q + (size_t)n_all * 128 + (size_t)sb0 * 64 + 16 * (tid & 1);  // Q6_K's qh
    const u8* wrow_h = W + (size_t)min(row0 + (tid & 127), rows - 1) * row_bytes;
    const u8* wh = wrow_h + (size_t)n_all * (Q6 ? 192 : 128) + (size_t)sb0 * 16;
    const u8* wd = wrow_h + (size_t)n_all * 208;  // Q6_K's f16 d's, read as aligned pairs
    // Q6_K: a row's two halves swapped where (row >> 2) & 1 (see g6_step).
    const int qdst = Q6 ? 32 * (tid >> 1) + 16 * ((tid & 1) ^ ((tid >> 3) & 1)) : 16 * tid;
    const int xc = tid & 15, xt = tid >> 4;
    // x positions of chunk c of step st (relative to sb0): Q4_K, 64·st + 8·c; Q6_K, the two runs
    // of 32 that step's ql bytes hold (see G6Row).
    const int xcoff = Q6 ? 8 * (xc & 3) + 64 * ((xc >> 2) & 1) : 8 * (xc & 7);
    auto x_step = [](int st) { return Q6 ? 256 * (st >> 2) + 128 * ((st >> 1) & 1) + 32 * (st & 1) : G2_BK * st; };
    const u16* xsrc =
        xh + (xc < 8 ? 0 : (size_t)n_pad * cols) + (size_t)(tok0 + xt) * cols + (size_t)sb0 * 256 + xcoff;
    const int xdst = xt * 256 + 16 * (xc ^ ((xt & 1) << 2));
    constexpr int XR = 16 * 256;  // bytes between the tokens xt + 16·r and xt + 16·(r + 1)
    const u32* ssrc = xsb + ((size_t)(tok0 + (tid >> 2)) * n_all + sb0) * 16 + 4 * (tid & 3);

    auto load_sb = [&](int sb) {  // the Σx fragments of super-block sb
        u8* d = smem + C::XSB + (sb & 1) * BN * 64;
#pragma unroll
        for (int r = 0; r < BN / 64; r++)
            cp_async16(d + (tid + 256 * r) * 16, ssrc + ((size_t)64 * r * n_all + sb) * 16);
    };
    auto load_hdr = [&](int sb) {
        if (tid < G2_BM) {
            u8* d = smem + C::HDR + (sb & 1) * G2_BM * C::HDR_ROW + tid * C::HDR_ROW;
            cp_async16(d, wh + sb * 16);
            if constexpr (Q6) cp_async4(d + 16, wd + 4 * ((sb0 + sb) >> 1));
        }
    };
    // Stage st: its quants and x; with step 4·sb (sb's first) Σx of sb; with step 4·sb + 1 the
    // header of sb + 1 (sb 0's comes with step 0). Always one commit group.
    auto load_stage = [&](int st) {
        if (st < n_steps) {
            u8* base = smem + (st % S) * C::STAGE;
            const int sb = st >> 2, j = st & 3;
            cp_async16(base + qdst, wq + sb * 128 + 32 * j);
            if constexpr (Q6) cp_async16(base + G2_BM * 32 + qdst, wqh + sb * 64 + 32 * (j >> 1));
            u8* xd = base + C::A_BYTES + xdst;
            const u16* xs_ = xsrc + x_step(st);
#pragma unroll
            for (int r = 0; r < BN / 16; r++) cp_async16(xd + r * XR, xs_ + (size_t)16 * r * cols);
            if (!Q6 && j == 0) load_sb(sb);
            if (st == 0) load_hdr(0);
            if (j == 1 && sb + 1 < n_sb) load_hdr(sb + 1);
        }
        cp_async_commit();
    };
    auto build_rows = [&](int sb) {  // header of sb → G2Row / G6Row table (sb & 1)
        if (tid < G2_BM) {
            const u8* h = smem + C::HDR + (sb & 1) * G2_BM * C::HDR_ROW + tid * C::HDR_ROW;
            if constexpr (Q6) {
                g6_row_consts(*(const uint4*)h, *(const u32*)(h + 16) >> (16 * ((sb0 + sb) & 1)),
                              (G6Row*)(smem + C::ROWS) + (sb & 1) * G2_BM + tid);
            } else {
                g2_row_consts(*(const uint4*)h, (G2Row*)(smem + C::ROWS) + (sb & 1) * G2_BM + tid);
            }
        }
    };

    float acc[MI][NT][4], tmp[MI][NT][4];
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NT; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                acc[mi][ni][e] = 0.0f;
                tmp[mi][ni][e] = 0.0f;
            }
    const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    u32 magic;  // 0x6400 6400, the f16 pair (1024, 1024), kept in a register for and_or
    asm volatile("mov.b32 %0, 0x64006400;" : "=r"(magic));

    // Super-block end: acc += d·tmp − 32·dmin·Σ_sub m·(Σx/32), the last by three m16n8k8 MMAs
    // (A: m pairs; B: Σx/32 as hi, mid, lo); then tmp = 0.
    auto fold = [&](int sb) {
        const G2Row* rt = (const G2Row*)(smem + C::ROWS) + (sb & 1) * G2_BM;
        const u8* xsbase = smem + C::XSB + (sb & 1) * BN * 64;
#pragma unroll
        for (int mi = 0; mi < MI; mi++) {
            const G2Row& r0 = rt[wrow + mi * 16 + g];
            const G2Row& r1 = rt[wrow + mi * 16 + g + 8];
            const u32 am0 = (&r0.mp.x)[t], am1 = (&r1.mp.x)[t];
            const float2 dd0 = *(const float2*)&r0.dd, dd1 = *(const float2*)&r1.dd;
#pragma unroll
            for (int ni = 0; ni < NT; ni++) {
                const int tl = wtok + ni * 8 + g;
                const uint4 xb = *(const uint4*)(xsbase + tl * 64 + 16 * t);
                float tm[4];
                mma1688(tm, am0, am1, xb.x, zero4);
                mma1688(tm, am0, am1, xb.y, tm);
                mma1688(tm, am0, am1, xb.z, tm);
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const float2 dd = e < 2 ? dd0 : dd1;
                    float v = fmaf(dd.x, tmp[mi][ni][e], acc[mi][ni][e]);
                    acc[mi][ni][e] = fmaf(-dd.y, tm[e], v);
                    tmp[mi][ni][e] = 0.0f;
                }
            }
        }
    };

    {
    // Five stages, each loaded three steps ahead, and a barrier every second step: at an even
    // step ks the wait leaves only stage ks + 2 in flight, so stages ks and ks + 1 have landed,
    // and the barrier publishes both. Step ks then refills the slot of step ks − 2, which every
    // warp finished before the barrier of step ks or ks − 1. The row constants (built at step
    // 4·sb + 2 from the header that came with step 4·sb + 1) and the Σx fragments follow the
    // same barriers.
    static_assert(S == 5, "the mma.sync loop is written for five stages");
#pragma unroll
    for (int st = 0; st < 3; st++) load_stage(st);
    cp_async_wait<2>();
    __syncthreads();
    build_rows(0);

    for (int ks = 0; ks < n_steps; ks++) {
        if ((ks & 1) == 0) {
            cp_async_wait<1>();
            __syncthreads();
        }
        load_stage(ks + 3);
        const int sb = ks >> 2, j = ks & 3;
        if (j == 2 && sb + 1 < n_sb) build_rows(sb + 1);
        const u8* abase = smem + (ks % S) * C::STAGE;
        const u8* xbase = abase + C::A_BYTES;
        if constexpr (Q6) {
            g6_step<NI>(abase, xbase, (const G6Row*)(smem + C::ROWS) + (sb & 1) * G2_BM, j, wm, wn, g, t, magic, acc);
        } else {
        const G2Row* rt = (const G2Row*)(smem + C::ROWS) + (sb & 1) * G2_BM;
        // This thread's quant words (rows g, g + 8 of each 16-row tile; bytes 8t .. 8t + 8).
        uint2 q[2][2];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int e = 0; e < 2; e++)
                q[mi][e] = *(const uint2*)(abase + (wm * 32 + mi * 16 + g + 8 * e) * 32 + 8 * t);
#pragma unroll
        for (int p = 0; p < 2; p++) {
            // p 0: low nibbles (sub-block 2j, k 0..32 of the step) → k16 tiles 0, 1; p 1: high
            // nibbles (sub-block 2j + 1, k 32..64) → tiles 2, 3. Word 0 of q → the first tile.
            u32 a[2][2][4];
#pragma unroll
            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const uint4 c = rt[wm * 32 + mi * 16 + g + 8 * e].mn[j];
                    const u32 mul = p ? c.z : c.x, neg = p ? c.w : c.y;
#pragma unroll
                    for (int w = 0; w < 2; w++) {
                        const u32 word = w ? q[mi][e].y : q[mi][e].x;
                        a[mi][w][e] = hfma2(p ? and_or<0x00F000F0u>(word, magic) : and_or<0x000F000Fu>(word, magic), mul, neg);
                        a[mi][w][2 + e] =
                            hfma2(p ? and_or<0x00F000F0u>(word >> 8, magic) : and_or<0x000F000Fu>(word >> 8, magic), mul, neg);
                    }
                }
#pragma unroll
            for (int ni = 0; ni < NI; ni++) {
                uint4 bh, bl;
                g2_x_frags(xbase, wn * 8 * NI + ni * 8 + g, p, t, bh, bl);
#pragma unroll
                for (int mi = 0; mi < 2; mi++) {
                    mma16816(tmp[mi][ni], a[mi][0], bh.x, bh.y);
                    mma16816(tmp[mi][ni], a[mi][0], bl.x, bl.y);
                    mma16816(tmp[mi][ni], a[mi][1], bh.z, bh.w);
                    mma16816(tmp[mi][ni], a[mi][1], bl.z, bl.w);
                }
            }
        }
        if (j == 3) fold(sb);
        }
    }
    }
    cp_async_wait<0>();
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < NT; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = row0 + wrow + mi * 16 + g + 8 * (e >> 1);
                const int tok = tok0 + wtok + ni * 8 + 2 * t + (e & 1);
                if (row < rows && tok < n) {
                    // Split K (two at most): the host zeroed out, and 0 + a + b is the same
                    // float whichever split adds first (IEEE addition commutes).
                    if (splits > 1) atomicAdd(out + (size_t)tok * rows + row, acc[mi][ni][e] * inv[tok]);
                    else out[(size_t)tok * rows + row] = acc[mi][ni][e] * inv[tok];
                }
            }
    }
}

// gemm2_q4_k: 128 rows × 128 tokens per block (warp tiles 32 × 64), 5 stages; gemm2_q4_k_n64:
// 128 × 64 (warp tiles 32 × 32), 5 stages; gemm2_q6_k,
// gemm2_q6_k_n64: the 128 × 128 and 128 × 64 tiles on Q6_K (rows of a multiple of 8 super-blocks).
// Arguments: the parts (all of the kernel's type); xh, xsb, inv from gemm2_split_x (Q6_K:
// gemm6_split_x); cols (% 256 == 0); n; n_pad (a multiple of the token tile). Grid (n_pad / BN,
// row tiles of all parts, K splits: 1, or 2 with the outputs zeroed and at least two
// super-blocks a row), 256 threads, dynamic shared memory G2<TY, NI>::SMEM bytes (checked).
#define GEMM2_ENTRY(NAME, TY, NI)                                                                     \
    FOR_TYPE(TY)(extern "C" __global__ __launch_bounds__(256, 1) void NAME(Gemm2Parts P, const u16* xh, const u32* xsb, \
                                                               const float* inv, int cols, int n, int n_pad) { \
        gemm2_body<TY, NI>(P, xh, xsb, inv, cols, n, n_pad);                                      \
    })

GEMM2_ENTRY(gemm2_q4_k, TY_Q4_K, 8)
GEMM2_ENTRY(gemm2_q4_k_n64, TY_Q4_K, 4)
GEMM2_ENTRY(gemm2_q6_k, TY_Q6_K, 8)
GEMM2_ENTRY(gemm2_q6_k_n64, TY_Q6_K, 4)
