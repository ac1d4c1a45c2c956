// Tensor-core one-token GEMV (decode, n = 1) for Q4_K weights: out[rows] = W · x with W in the
// repacked device layout of kernels/quant.cu (per row: every super-block's 128 quant bytes back
// to back, then the 16-byte headers d, dmin, 12 scale bytes). Host side: `engine/src/cuda_gemv_tc.rs`.
// Opt-in (`LLMDIFF_GEMV_KIND=tc`): on the H200 it is no faster than quant.cu's integer warp-rows
// form (tests/gpu/h200-results/round10).
//
// The quants meet x's int8 limbs (the integer form of kernels/quant.cu: three limb planes, a scale
// per 32 values, Σx per 8, from the gemv_x_limbs pre-pass or the op that wrote x) in mma.sync
// m16n8k32 (u8 × s8 → s32), so a warp's 16 rows × 32 values are one instruction where dp4a takes
// 24 per 32 values a row. The numerics are the integer form's: the same exact integer sums,
// scaled in another order.
//
// Fragments of m16n8k32 with 8-bit types (g = lane/4, t = lane%4): A a0 = (row g, k 4t .. 4t+3),
// a1 = (row g+8, same k), a2 = (row g, k 16+4t ..), a3 = (row g+8, k 16+4t ..), four bytes each;
// B b0 = (k 4t .., column g), b1 = (k 16+4t .., column g); C c0, c1 = (row g, columns 2t, 2t+1),
// c2, c3 = (row g+8, same columns). The order of k inside one mma is free when A and B agree.
//
// One pair p of a super-block (quant bytes 32p .. 32p+32: byte j holds value j of sub-block 2p in
// its low nibble and value j of sub-block 2p+1 in its high one) for 16 rows is two mma: lane t
// loads bytes 8t .. 8t+8 of rows g and g+8 as two words, and mma w (w = 0, 1) takes word w's low
// nibbles as a0/a1 (k 4t+b ← position 8t+4w+b of sub-block 2p) and its high nibbles as a2/a3
// (k 16+4t+b ← the same position of sub-block 2p+1). B's columns 0, 1, 2 are limbs 0, 1, 2 of
// sub-block 2p's x at the low k (zero at the high k), columns 4, 5, 6 those of sub-block 2p+1 at
// the high k (zero at the low k), columns 3 and 7 zero: lane g < 3 loads plane g's 8 bytes at
// x position 64p + 8t (b0 of mma 0 and 1), lane 4 ≤ g < 7 plane g−4's at 64p + 32 + 8t (b1).
// Both mma accumulate into one C, which then holds, for 16 rows and both sub-blocks, the three
// limb sums D0, D1, D2 over all 32 values: lane t = 0 (row g: D0, D1 of sub-block 2p; row g+8
// the same), t = 1 (D2 of 2p, zero), t = 2 and 3 likewise for 2p+1. One shuffle gives each lane
// one (row, sub-block): even t row g, odd t row g+8; t < 2 sub-block 2p, else 2p+1. It forms
// 128²·D0 + 128·D1 + D2 (exact in int32, |.| < 2^30, as the dp4a form's), and adds
// (d·sc)·(that·s) − (dmin·m)·Σx of its sub-block to its row's sum: the header is decoded once per
// (row, sub-block), on every lane. At the end lanes t and t^2 (the two sub-blocks of a row) are
// added, then the NW warps' sums in shared memory in warp order (deterministic); the stores go
// through GemvRows::store (a q/k/v launch's RoPE and cache append, as warp-rows').
//
// Work split: a block of NW warps computes 16·T rows; warp w walks super-blocks w, w + NW, ...,
// first issuing all its tiles' quant and header loads, then (after griddep_wait on the first:
// PDL, as warp-rows) x's limb words, scales and sums (shared by the T tiles).

__device__ __forceinline__ void tc_imma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int T, int NW>
__device__ __forceinline__ void gemvt_q4_k_body(const GemvRows& m, const u8* __restrict__ xq, int rows, int cols,
                                                int row_bytes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nsb = cols >> 8, row0 = blockIdx.x * 16 * T;
    const u8* rp[T][2];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) rp[i][r] = m.weight(min(row0 + 16 * i + g + 8 * r, rows - 1), row_bytes);
    // The lane's (row, sub-block) after the shuffle: row g + 8·odd of each tile, sub-block 2p + hs.
    const int odd = t & 1, hs = t >> 1;
    const int mul0 = odd ? 1 : 16384;
    const u32 sel_sc = 0x7440u + hs, sel_m = 0x7442u + hs;
    // B: lane g < 3 holds column g (limb g of the low sub-block), 4 ≤ g < 7 column g (limb g − 4
    // of the high one), the others zeros.
    const bool b_lo = g < 3, b_any = g < 3 || (g >= 4 && g < 7);
    const u8* bp = xq + (size_t)(b_lo ? g : g - 4) * cols + (b_lo ? 0 : 32) + 8 * t;
    const float* xsc = (const float*)(xq + 3 * (size_t)cols);
    const float* xs8 = xsc + cols / 32;
    const size_t hdr0 = (size_t)nsb * 128;
    const u32 M = 0x0F0F0F0Fu;
    float acc[T];
#pragma unroll
    for (int i = 0; i < T; i++) acc[i] = 0.0f;
    for (int sb = warp; sb < nsb; sb += NW) {
        // The super-block's quants (rows g and g+8 of each tile) and headers (the epilogue row's).
        uint2 q[T][2][4];
        uint4 hd[T];
#pragma unroll
        for (int i = 0; i < T; i++) {
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int p = 0; p < 4; p++) q[i][r][p] = ldg8(rp[i][r] + (size_t)sb * 128 + 32 * p + 8 * t);
            hd[i] = ldg16((odd ? rp[i][1] : rp[i][0]) + hdr0 + 16 * sb);
        }
        // Launched early (PDL): the first weights are in flight before x's limbs are read.
        if (sb == warp) griddep_wait();
        uint2 b[4];
        float sx[4], xsum[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            b[p] = b_any ? ldx8(bp + (size_t)sb * 256 + 64 * p) : make_uint2(0u, 0u);
            const float4 s8 = ldx16f(xs8 + 4 * (8 * sb + 2 * p + hs));
            xsum[p] = (s8.x + s8.y) + (s8.z + s8.w);
        }
        const float4 s0 = ldx16f(xsc + 8 * sb), s1 = ldx16f(xsc + 8 * sb + 4);
        sx[0] = hs ? s0.y : s0.x, sx[1] = hs ? s0.w : s0.z, sx[2] = hs ? s1.y : s1.x, sx[3] = hs ? s1.w : s1.z;
#pragma unroll
        for (int i = 0; i < T; i++) {
            const float d = f16_to_f32((u16)(hd[i].x & 0xFFFFu)), dmin = f16_to_f32((u16)(hd[i].x >> 16));
#pragma unroll
            for (int p = 0; p < 4; p++) {
                int c[4] = {0, 0, 0, 0};
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    const u32 wg = w ? q[i][0][p].y : q[i][0][p].x, w8 = w ? q[i][1][p].y : q[i][1][p].x;
                    const u32 bw = w ? b[p].y : b[p].x;
                    tc_imma(c, wg & M, w8 & M, (wg >> 4) & M, (w8 >> 4) & M, b_lo ? bw : 0u, b_lo ? 0u : bw);
                }
                // Even lanes: 128²·D0 + 128·D1 of rows g and g+8; odd lanes: D2 (column 3/7 is zero).
                const int vg = c[0] * mul0 + c[1] * 128, v8 = c[2] * mul0 + c[3] * 128;
                const int other = __shfl_xor_sync(0xffffffffu, odd ? vg : v8, 1);
                const int tot = (odd ? v8 : vg) + other;
                const u32 sm = q4k_sm(hd[i].y, hd[i].z, hd[i].w, p);
                const float sc = __int_as_float(__byte_perm(sm, 0x4B000000u, sel_sc)) - 8388608.0f;
                const float mn = __int_as_float(__byte_perm(sm, 0x4B000000u, sel_m)) - 8388608.0f;
                acc[i] = fmaf(d * sc, (float)tot * sx[p], acc[i]);
                acc[i] = fmaf(-(dmin * mn), xsum[p], acc[i]);
            }
        }
    }
    // A row's two sub-block lanes (t, t ^ 2), then the warps in order.
    __shared__ float red[NW][16 * T];
#pragma unroll
    for (int i = 0; i < T; i++) {
        const float v = acc[i] + __shfl_xor_sync(0xffffffffu, acc[i], 2);
        if (t < 2) red[warp][16 * i + g + 8 * t] = v;
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int base = 0; base < 16 * T; base += 32) {
            const int idx = base + lane;
            float s = 0.0f;
            if (idx < 16 * T) {
#pragma unroll
                for (int w = 0; w < NW; w++) s += red[w][idx];
            }
            const float pair = __shfl_xor_sync(0xffffffffu, s, 1);
            const int row = row0 + idx;
            if (idx < 16 * T && row < rows) m.store(row, s, pair);
        }
    }
}

// Entry points gemvt_q4_k_t<T>_w<NW>: 16·T rows per block, NW·32 threads, grid ⌈rows / 16T⌉; the
// arguments of kernels/quant.cu's integer warp-rows entries (GemvRows, x (unused), x's limbs,
// rows, cols, row_bytes), so `launch_gemv_rows` launches both. The list is `GEMVT_VARIANTS` in
// engine/src/cuda_kernels.rs (one line here per entry there).
#define GEMVT_ENTRY(T, NW)                                                                                     \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW(                             \
        GemvRows m, const float* x, const u8* xq, int rows, int cols, int row_bytes) {                         \
        gemvt_q4_k_body<T, NW>(m, xq, rows, cols, row_bytes);                                                  \
    }

GEMVT_ENTRY(1, 4)
GEMVT_ENTRY(1, 8)
GEMVT_ENTRY(1, 16)
GEMVT_ENTRY(2, 4)
GEMVT_ENTRY(2, 8)
GEMVT_ENTRY(2, 16)
