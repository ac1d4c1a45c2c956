// Tensor-core one-token GEMV (decode, n = 1) for Q4_K weights: out[rows] = W · x with W in the
// repacked device layout of kernels/quant.cu (per row: every super-block's 128 quant bytes back
// to back, then the 16-byte headers d, dmin, 12 scale bytes). Host side: `engine/src/cuda_gemv_tc.rs`.
//
// The quants (as u8) meet x's int8 limbs (the integer form of kernels/quant.cu: three limb planes,
// a scale per 32 values, Σx per 8, from the gemv_x_limbs pre-pass or the op that wrote x) in
// mma.sync m16n8k32 (u8 × s8 → s32): 16 mma for 16 rows × 256 values (one super-block), where
// dp4a takes 24 instructions per 32 values a row. The numerics are the integer form's: the same
// exact integer sums, scaled in another order.
//
// Weights reach the tensor cores straight from global memory into registers, as the dp4a
// warp-rows form loads them, with no shared-memory staging (round 14's cp.async ring per warp was
// capped by shared memory: bytes in flight × warps). A tile is 16 rows of one super-block; lane
// (g, t) (g = lane/4, t = lane%4) loads pair t (quant bytes 32t .. 32t+32: byte j holds value j
// of sub-block 2t in its low nibble and value j of sub-block 2t+1 in its high one) of rows g and
// g+8, two 16-byte loads a row, and its words w = 0 .. 7 hold positions 4w .. 4w+3.
//
// Fragments of m16n8k32 with 8-bit types: A a0 = (row g, k 4t .. 4t+3), a1 = (row g+8, same k),
// a2 = (row g, k 16+4t ..), a3 = (row g+8, k 16+4t ..), four bytes each; B b0 = (k 4t ..,
// column g), b1 = (k 16+4t .., column g); C c0, c1 = (row g, columns 2t, 2t+1), c2, c3 = (row
// g+8, same columns). The order of k inside one mma is free when A and B agree, so with words
// w0 = 2m, w1 = 2m+1 (m = 0 .. 3) an mma's k 4t+b is position 4·w0+b of lane t's pair and k
// 16+4t+b position 4·w1+b: its low nibbles (A & 0x0F..) are sub-block 2t's, its high ones (A &
// 0xF0.., u8 16q in place) sub-block 2t+1's. Each k-slot belongs to one pair, so a B column
// that is one pair's x is zero in the other lanes' k-slots, and column g belongs to lane t = g/2
// (the B owner; the other lanes load zeros, from gt_zero). Three accumulators, each over the
// super-block's 4 word pairs:
// - Ca: low nibbles × column n = limb n%2 of sub-block 2(n/2);
// - Cb: high nibbles × column n = limb n%2 of sub-block 2(n/2)+1;
// - Cc: low nibbles × column n = limb 2 of sub-block n (n even, zero for odd n), plus high nibbles
//   × column n = limb 2 of sub-block n (n odd, zero for even n).
// So lane t's c0, c1 are columns 2t, 2t+1, its own pair's: Ca gives D0, D1 of sub-block 2t, Cb
// 16·D0, 16·D1 of sub-block 2t+1, Cc D2 of 2t and 16·D2 of 2t+1, for rows g and g+8, with no
// shuffle. The lane forms D = 128²·D0 + 128·D1 + D2 (the high nibbles': 1024·16D0 + 8·16D1 +
// (16D2 >> 4), exact; |.| < 2^30 as the dp4a form's) and adds (d·sc)·(D·s) − (dmin·m)·Σx of its
// two sub-blocks to each of its rows' sums, the rows' headers (a 16-byte load each) in its
// registers. Four mma a word pair: 16 a super-block for 16 rows × 256 values.
//
// Work split: a block of NW warps computes 16·T rows; warp w takes super-blocks w, w + NW, ...:
// for each, its weight loads (the first before the wait: PDL, weights only), then x's words,
// scales and sums (L1/L2: every warp of every block reads the same x), then the mma. At the end
// a row's four lanes (its four pairs) are added, then the NW warps' sums in shared memory in warp
// order (deterministic); the stores go through GemvRows::store (a q/k/v launch's RoPE and cache
// append, as warp-rows').

__device__ __forceinline__ void tc_imma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}


// Zeros: the B words of a lane that owns no column (and of the limb-2 half it does not own).
__device__ __align__(16) u32 gt_zero[8];

// One super-block of a warp's T tiles in registers: pair t of rows 16i + g (wg) and 16i + g + 8
// (w8) and their headers (hg, h8); the lane's B words (xa: limb g%2 of sub-block 2t, xb: of
// 2t+1, xl / xh: limb 2 of 2t / 2t+1, or zeros), and the scales (sx) and Σx (xs0, xs1) of
// sub-blocks 2t and 2t+1.
template <int T>
struct GtStep {
    uint4 wg[T][2], w8[T][2], hg[T], h8[T];
    uint4 xa[2], xb[2], xl[2], xh[2];
    float2 sx;
    float xs0, xs1;
};

// A warp's sources at super-block 0 (a super-block moves the quants 128 bytes on, the headers 16,
// x's limb words 256 (a B owner's; 0 for zeros), the scales 8 floats, the sums 32). Rows past
// the end repeat the last row (computed, never stored).
template <int T>
struct GtSrc {
    const u8 *qg[T], *q8[T], *hg[T], *h8[T];
    const u8 *xa, *xb, *xl, *xh;
    int sa, sl, sh;  // strides of xa and xb, xl, xh
    const float *xsc, *xs8;
};

template <int T>
__device__ __forceinline__ void gt_load_w(const GtSrc<T>& c, int sb, GtStep<T>& f) {
#pragma unroll
    for (int i = 0; i < T; i++) {
#pragma unroll
        for (int h = 0; h < 2; h++) {
            f.wg[i][h] = ldg16(c.qg[i] + (size_t)sb * 128 + 16 * h);
            f.w8[i][h] = ldg16(c.q8[i] + (size_t)sb * 128 + 16 * h);
        }
        f.hg[i] = ldg16(c.hg[i] + (size_t)sb * 16);
        f.h8[i] = ldg16(c.h8[i] + (size_t)sb * 16);
    }
}

template <int T>
__device__ __forceinline__ void gt_load_x(const GtSrc<T>& c, int sb, GtStep<T>& f) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
        f.xa[h] = ldx16(c.xa + (size_t)sb * c.sa + 16 * h);
        f.xb[h] = ldx16(c.xb + (size_t)sb * c.sa + 16 * h);
        f.xl[h] = ldx16(c.xl + (size_t)sb * c.sl + 16 * h);
        f.xh[h] = ldx16(c.xh + (size_t)sb * c.sh + 16 * h);
    }
    f.sx = ldx8f(c.xsc + (size_t)sb * 8);
    const float4 s0 = ldx16f(c.xs8 + (size_t)sb * 32), s1 = ldx16f(c.xs8 + (size_t)sb * 32 + 4);
    f.xs0 = (s0.x + s0.y) + (s0.z + s0.w), f.xs1 = (s1.x + s1.y) + (s1.z + s1.w);
}

__device__ __forceinline__ u32 gt_word(const uint4 (&v)[2], int w) {
    const uint4 q = v[w >> 2];
    return (w & 3) == 0 ? q.x : (w & 3) == 1 ? q.y : (w & 3) == 2 ? q.z : q.w;
}

// One row's share of a super-block: its two sub-blocks' integer sums (lo: 2t, hi: 2t+1) scaled by
// the row's header h (q4k_sm's bytes of pair t) and x's block scales and sums.
__device__ __forceinline__ float gt_scale(uint4 h, int t, int lo, int hi, float2 sx, float xs0, float xs1, float acc) {
    const u32 sm = q4k_sm(h.y, h.z, h.w, t);
    const float d = f16_to_f32((u16)(h.x & 0xFFFFu)), dmin = f16_to_f32((u16)(h.x >> 16));
    const float sc0 = byte_f<0>(sm, 8388608.0f), sc1 = byte_f<1>(sm, 8388608.0f);
    const float m0 = byte_f<2>(sm, 8388608.0f), m1 = byte_f<3>(sm, 8388608.0f);
    acc = fmaf(d * sc0, (float)lo * sx.x, acc);
    acc = fmaf(d * sc1, (float)hi * sx.y, acc);
    return fmaf(-dmin, m0 * xs0 + m1 * xs1, acc);
}

template <int T>
__device__ __forceinline__ void gt_mma(const GtStep<T>& f, int t, float (&acc)[T][2]) {
    const u32 M = 0x0F0F0F0Fu;
#pragma unroll
    for (int i = 0; i < T; i++) {
        int ca[4] = {0, 0, 0, 0}, cb[4] = {0, 0, 0, 0}, cc[4] = {0, 0, 0, 0};
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const u32 g0 = gt_word(f.wg[i], 2 * m), g1 = gt_word(f.wg[i], 2 * m + 1);
            const u32 e0 = gt_word(f.w8[i], 2 * m), e1 = gt_word(f.w8[i], 2 * m + 1);
            const u32 l0 = g0 & M, l1 = e0 & M, l2 = g1 & M, l3 = e1 & M;
            const u32 h0 = g0 & ~M, h1 = e0 & ~M, h2 = g1 & ~M, h3 = e1 & ~M;
            tc_imma(ca, l0, l1, l2, l3, gt_word(f.xa, 2 * m), gt_word(f.xa, 2 * m + 1));
            tc_imma(cb, h0, h1, h2, h3, gt_word(f.xb, 2 * m), gt_word(f.xb, 2 * m + 1));
            tc_imma(cc, l0, l1, l2, l3, gt_word(f.xl, 2 * m), gt_word(f.xl, 2 * m + 1));
            tc_imma(cc, h0, h1, h2, h3, gt_word(f.xh, 2 * m), gt_word(f.xh, 2 * m + 1));
        }
        // Rows g (c0, c1) and g + 8 (c2, c3).
        const int lo_g = ca[0] * 16384 + ca[1] * 128 + cc[0], lo_8 = ca[2] * 16384 + ca[3] * 128 + cc[2];
        const int hi_g = cb[0] * 1024 + cb[1] * 8 + (cc[1] >> 4), hi_8 = cb[2] * 1024 + cb[3] * 8 + (cc[3] >> 4);
        acc[i][0] = gt_scale(f.hg[i], t, lo_g, hi_g, f.sx, f.xs0, f.xs1, acc[i][0]);
        acc[i][1] = gt_scale(f.h8[i], t, lo_8, hi_8, f.sx, f.xs0, f.xs1, acc[i][1]);
    }
}

// U = 1: a warp loads a super-block, waits for it and computes it; U = 2: double-buffered, the
// next super-block's loads issued before the current one's mma.
template <int T, int NW, int U>
__device__ __forceinline__ void gemvt_q4_k_body(const GemvRows& m, const u8* __restrict__ xq, int rows, int cols,
                                                int row_bytes) {
    constexpr int RT = 16 * T;
    __shared__ float red[NW][RT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nsb = cols >> 8, row0 = blockIdx.x * RT;
    TRACE_BLOCK(TRACE_GEMVT);
    griddep_launch();  // the norm, SwiGLU or attention after it may be launched early (PDL)
    GtSrc<T> c;
#pragma unroll
    for (int i = 0; i < T; i++) {
        const u8* rg = m.weight(min(row0 + 16 * i + g, rows - 1), row_bytes);
        const u8* r8 = m.weight(min(row0 + 16 * i + g + 8, rows - 1), row_bytes);
        c.qg[i] = rg + 32 * t, c.q8[i] = r8 + 32 * t;
        c.hg[i] = rg + (size_t)nsb * 128, c.h8[i] = r8 + (size_t)nsb * 128;
    }
    // B owner of column g: lane t = g/2 (limbs g%2 of its pair's sub-blocks; limb 2 of sub-block
    // 2t for even g, of 2t+1 for odd g).
    const bool own = t == (g >> 1), odd = g & 1;
    const u8* zero = (const u8*)gt_zero;
    const u8* xp = xq + (size_t)(g & 1) * cols + 64 * t;
    const u8* x2 = xq + 2 * (size_t)cols + 64 * t;
    c.xa = own ? xp : zero, c.xb = own ? xp + 32 : zero, c.sa = own ? 256 : 0;
    c.xl = own && !odd ? x2 : zero, c.sl = own && !odd ? 256 : 0;
    c.xh = own && odd ? x2 + 32 : zero, c.sh = own && odd ? 256 : 0;
    c.xsc = (const float*)(xq + 3 * (size_t)cols) + 2 * t;
    c.xs8 = (const float*)(xq + 3 * (size_t)cols) + cols / 32 + 8 * t;
    float acc[T][2];
#pragma unroll
    for (int i = 0; i < T; i++) acc[i][0] = acc[i][1] = 0.0f;
    // Launched early (PDL): the first weights are in flight before x (the previous kernel's
    // output) is read. A warp with no super-block reads no global memory.
    GtStep<T> fa;
    if (warp < nsb) gt_load_w(c, warp, fa);
    griddep_wait();
    if constexpr (U == 1) {
        for (int sb = warp; sb < nsb; sb += NW) {
            if (sb != warp) gt_load_w(c, sb, fa);
            gt_load_x(c, sb, fa);
            gt_mma(fa, t, acc);
        }
    } else {
        GtStep<T> fb;
        if (warp < nsb) gt_load_x(c, warp, fa);
        for (int sb = warp; sb < nsb; sb += 2 * NW) {
            const bool nb = sb + NW < nsb, na = sb + 2 * NW < nsb;
            if (nb) gt_load_w(c, sb + NW, fb), gt_load_x(c, sb + NW, fb);
            gt_mma(fa, t, acc);
            if (!nb) break;
            if (na) gt_load_w(c, sb + 2 * NW, fa), gt_load_x(c, sb + 2 * NW, fa);
            gt_mma(fb, t, acc);
        }
    }
    // A row's four lanes (its pairs), then the warps in order.
#pragma unroll
    for (int i = 0; i < T; i++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float v = acc[i][r];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            v += __shfl_xor_sync(0xffffffffu, v, 2);
            if (t == 0) red[warp][16 * i + g + 8 * r] = v;
        }
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int base = 0; base < RT; base += 32) {
            const int idx = base + lane;
            float s = 0.0f;
            if (idx < RT) {
#pragma unroll
                for (int w = 0; w < NW; w++) s += red[w][idx];
            }
            const float pair = __shfl_xor_sync(0xffffffffu, s, 1);
            const int row = row0 + idx;
            if (idx < RT && row < rows) m.store(row, s, pair);
        }
    }
}

// Entry points gemvt_q4_k_t<T>_w<NW>_u<U>: 16·T rows per block, NW·32 threads, grid ⌈rows / 16T⌉,
// no dynamic shared memory; the arguments of kernels/quant.cu's integer warp-rows entries
// (GemvRows, x (unused), x's limbs, rows, cols, row_bytes), so `launch_gemv_rows` launches both.
// The list is `GEMVT_VARIANTS` in engine/src/cuda_kernels.rs (one line here per entry there).
#define GEMVT_ENTRY(T, NW, U)                                                                                  \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW##_u##U(                      \
        GemvRows m, const float* x, const u8* xq, int rows, int cols, int row_bytes) {                         \
        gemvt_q4_k_body<T, NW, U>(m, xq, rows, cols, row_bytes);                                               \
    }

GEMVT_ENTRY(1, 4, 1)
GEMVT_ENTRY(1, 4, 2)
GEMVT_ENTRY(1, 8, 1)
GEMVT_ENTRY(1, 8, 2)
GEMVT_ENTRY(2, 4, 1)
GEMVT_ENTRY(2, 4, 2)
GEMVT_ENTRY(2, 8, 1)
GEMVT_ENTRY(1, 16, 1)
