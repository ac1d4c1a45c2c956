// Tensor-core one-token GEMV (decode, n = 1) for Q4_K weights: out[rows] = W · x with W in the
// repacked device layout of kernels/quant.cu (per row: every super-block's 128 quant bytes back
// to back, then the 16-byte headers d, dmin, 12 scale bytes). Host side: `engine/src/cuda_gemv_tc.rs`.
//
// The quants (as u8) meet x's int8 limbs (the integer form of kernels/quant.cu: three limb planes,
// a scale per 32 values, Σx per 8, from the gemv_x_limbs pre-pass or the op that wrote x) in
// mma.sync m16n8k32 (u8 × s8 → s32), so a warp's 16 rows × 32 values are one instruction where
// dp4a takes 24 per 32 values a row. The numerics are the integer form's: the same exact integer
// sums, scaled in another order.
//
// Weights reach the tensor cores through shared memory. Round 10's form loaded each lane's
// fragment bytes straight from global memory, 8 bytes from 8 rows an instruction, and stalled on
// those loads (L1 59–65 % busy, long-scoreboard waits). Here a warp copies whole rows by cp.async
// (16 bytes a lane, 4 rows × 128 contiguous bytes an instruction, as the warp-rows form reads)
// into its own ring of S stages, and ldmatrix turns them into fragments.
//
// Fragments of m16n8k32 with 8-bit types (g = lane/4, t = lane%4): A a0 = (row g, k 4t .. 4t+3),
// a1 = (row g+8, same k), a2 = (row g, k 16+4t ..), a3 = (row g+8, k 16+4t ..), four bytes each;
// B b0 = (k 4t .., column g), b1 = (k 16+4t .., column g); C c0, c1 = (row g, columns 2t, 2t+1),
// c2, c3 = (row g+8, same columns). The order of k inside one mma is free when A and B agree.
//
// A stage is one super-block of the block's 16·T rows: row r's 128 quant bytes at r·GT_QS, its
// header after them (GT_QS = 144: a 16-byte skew a row, so ldmatrix's eight row reads of a matrix
// fall in distinct banks). Pair p of a row (quant bytes 32p .. 32p+32: byte j holds value j of
// sub-block 2p in its low nibble and value j of sub-block 2p+1 in its high one) is one
// ldmatrix.x4 for 16 rows: r0 = (row g, bytes 4t ..), r1 = (row g+8, same), r2 = (row g,
// bytes 16+4t ..), r3 = (row g+8, same). Two mma take it: mma w (w = 0, 1) has A = (r & 0x0F..,
// r' & 0x0F.., r & 0xF0.., r' & 0xF0..) of r = r(2w), r' = r(2w+1), so k 4t+b is position
// 16w+4t+b of sub-block 2p (the low nibble) and k 16+4t+b the same position of sub-block 2p+1
// (the high nibble in place: u8 16q). B's columns 0, 1, 2 are limbs 0, 1, 2 of sub-block 2p's x
// at the low k (zero at the high k), columns 4, 5, 6 those of sub-block 2p+1 at the high k (zero
// at the low k), columns 3 and 7 zero. Both mma accumulate into one C, which then holds for 16
// rows the limb sums over all 32 values of both sub-blocks: lane t = 0 (row g: D0, D1 of
// sub-block 2p; row g+8 the same), t = 1 (D2, 0), t = 2 and 3 the same for 2p+1 times 16. Each
// lane forms its part of 128²·D0 + 128·D1 + D2 (t = 2, 3: 1024·16D0 + 8·16D1, and 16D2 >> 4,
// exact; |.| < 2^30 as the dp4a form's) for rows g and g+8, and one shuffle gives each lane one
// (row, sub-block): even t row g, odd t row g+8; t < 2 sub-block 2p, else 2p+1. That lane adds
// (d·sc)·(D·s) − (dmin·m)·Σx of its sub-block to its row's sum, the header read from the stage.
//
// Work split: a block of NW warps computes 16·T rows; warp w takes super-blocks w, w + NW, ...,
// keeping S − 1 stages in flight ahead of the one it computes. A stage also holds x's part of
// its super-block (limb words, block scales, sums per 8; GT_X below), copied with its weights, so
// no global load waits inside the loop (reading x from L1/L2 there cost 11 points of copy at
// 4096×14336: round 14). The first stages' weights are copied before griddep_wait (PDL: weights
// only), their x parts after it. At the end lanes t and t^2 (a row's two sub-blocks) are added,
// then the NW warps' sums in shared memory in warp order (deterministic); the stores go through
// GemvRows::store (a q/k/v launch's RoPE and cache append, as warp-rows').
//
// On the H200 (round 14) it is faster than round 10's form on every bench shape but slower than
// the dp4a warp-rows form: in the decode step 2.33 ms against 2.05 ms a token (8B shape). Its
// short-row launches (4096 columns: 16 super-blocks, 2–4 stages a warp) pay the ring's fill and
// drain per block.

#define GT_QS 144

__device__ __forceinline__ void tc_imma(int (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Four 8×8 matrices of 16-bit elements (here 8 rows × 16 bytes) from shared memory: lanes 8i ..
// 8i+7 give the row addresses of matrix i; lane l receives bytes 4(l%4) .. 4(l%4)+3 of row l/4 of
// each. Volatile with a memory clobber: it stays after the cp.async wait that fills its rows.
__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr)
                 : "memory");
}

// 4 and 16 bytes from a shared-memory address (smem_addr's); volatile with a memory clobber, so a
// load stays after the cp.async wait that fills its bytes.
__device__ __forceinline__ u32 lds4(u32 a) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
    return v;
}
__device__ __forceinline__ uint4 lds16(u32 a) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a) : "memory");
    return v;
}

// A warp's copy plan: its lane's quant chunk sources (4T rows) and header source (h_live), and its
// x chunks (x0 always, x1 when x1_live), each with its stride per super-block; the destinations
// are offsets in a stage. Sources start at the warp's first super-block and move on by NW.
template <int T>
struct GtCopies {
    const u8* q[4 * T];
    const u8 *h, *x0, *x1;
    u32 dst, hdst, xd0, xd1, xs0, xs1;
    bool h_live, x1_live;
};

// Issues this warp's copies of its next super-block into the stage at byte `st` of its ring: the
// weights (w) and x's part (x), each part's sources then moving on by NW super-blocks. A live =
// false super-block (past the warp's last) issues nothing.
template <int T, int NW>
__device__ __forceinline__ void gemvt_issue(GtCopies<T>& c, u32 st, bool live, bool w, bool x) {
    if (!live) return;
    if (w) {
#pragma unroll
        for (int i = 0; i < 4 * T; i++) {
            cp_async16s(st + c.dst + 4 * i * GT_QS, c.q[i]);
            c.q[i] += NW * 128;
        }
        if (c.h_live) cp_async16s(st + c.hdst, c.h);
        c.h += NW * 16;
    }
    if (x) {
        cp_async16s(st + c.xd0, c.x0);
        if (c.x1_live) cp_async16s(st + c.xd1, c.x1);
        c.x0 += (size_t)NW * c.xs0;
        c.x1 += (size_t)NW * c.xs1;
    }
}

// x's part of a stage (after the rows, at GT_X): limb planes 0, 1, 2 of the super-block's 256
// values (GT_XP bytes apart: 16 bytes of skew a plane, so the B words of the lanes of different
// planes fall in different banks), then its 8 block scales, then its 32 sums per 8 values.
#define GT_XP 272
#define GT_XB (3 * GT_XP + 32 + 128)

// The source, per-super-block stride and stage offset of x chunk c (c < 58: 48 limb chunks, 2 of
// scales, 8 of sums) of super-block 0.
__device__ __forceinline__ void gt_x_chunk(const u8* xq, int cols, int c, const u8*& src, u32& stride, u32& dst) {
    const u8* sc = xq + 3 * (size_t)cols;
    if (c < 48) {
        src = xq + (size_t)(c >> 4) * cols + 16 * (c & 15), stride = 256, dst = (c >> 4) * GT_XP + 16 * (c & 15);
    } else if (c < 50) {
        src = sc + 16 * (c - 48), stride = 32, dst = 3 * GT_XP + 16 * (c - 48);
    } else {
        src = sc + (size_t)cols / 8 + 16 * (c - 50), stride = 128, dst = 3 * GT_XP + 32 + 16 * (c - 50);
    }
}

template <int T, int NW, int S>
__device__ __forceinline__ void gemvt_q4_k_body(const GemvRows& m, const u8* __restrict__ xq, int rows, int cols,
                                                int row_bytes) {
    constexpr int RT = 16 * T, GT_X = RT * GT_QS, SB = GT_X + GT_XB;
    extern __shared__ __align__(16) u8 gt_ring[];  // NW rings of S stages (dynamic: the host sizes it)
    __shared__ float red[NW][RT];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nsb = cols >> 8, row0 = blockIdx.x * RT;
    TRACE_BLOCK(TRACE_GEMVT);
    griddep_launch();  // the norm, SwiGLU or attention after it may be launched early (PDL)
    // Lane l copies quant chunk l % 8 of rows 4i + l/8 (i < 4T), row l's header (l < RT), and x
    // chunks l and l + 32 (< 58). Rows past the end repeat the last row (computed, never stored).
    GtCopies<T> c;
#pragma unroll
    for (int i = 0; i < 4 * T; i++)
        c.q[i] = m.weight(min(row0 + 4 * i + (lane >> 3), rows - 1), row_bytes) + 16 * (lane & 7) + (size_t)warp * 128;
    c.h = m.weight(min(row0 + lane % RT, rows - 1), row_bytes) + (size_t)nsb * 128 + (size_t)warp * 16;
    c.h_live = lane < RT;
    c.dst = (u32)((lane >> 3) * GT_QS + 16 * (lane & 7));
    c.hdst = (u32)((lane % RT) * GT_QS + 128);
    gt_x_chunk(xq, cols, lane, c.x0, c.xs0, c.xd0);
    gt_x_chunk(xq, cols, min(lane + 32, 57), c.x1, c.xs1, c.xd1);
    c.x0 += (size_t)warp * c.xs0, c.x1 += (size_t)warp * c.xs1;
    c.xd0 += GT_X, c.xd1 += GT_X;
    c.x1_live = lane + 32 < 58;
    const u32 my = smem_addr(gt_ring + warp * S * SB);
    const int nk = warp < nsb ? (nsb - warp + NW - 1) / NW : 0;
    // The first S − 1 stages' weights, then (launched early, PDL: x is the previous kernel's
    // output) their x parts, a group a stage: the first group also holds all S − 1 stages'
    // weights, so stage k is always the k-th group committed.
#pragma unroll
    for (int k = 0; k < S - 1; k++) gemvt_issue<T, NW>(c, my + k * SB, k < nk, true, false);
    griddep_wait();
#pragma unroll
    for (int k = 0; k < S - 1; k++) {
        gemvt_issue<T, NW>(c, my + k * SB, k < nk, false, true);
        cp_async_commit();
    }

    // Per lane: its (row, sub-block) after the shuffle (row g + 8·odd of each tile, sub-block
    // 2p + hs), its part of the limb sum (mul0, mul1, sh), and its B column (lo: g < 3, limb g of
    // sub-block 2p; hi: 4 ≤ g < 7, limb g − 4 of sub-block 2p + 1) at xb in a stage.
    const int odd = t & 1, hs = t >> 1;
    const int mul0 = t == 0 ? 16384 : t == 2 ? 1024 : 1, mul1 = t == 0 ? 128 : t == 2 ? 8 : 0, sh = t == 3 ? 4 : 0;
    const u32 sel_sc = 0x7440u + hs, sel_m = 0x7442u + hs;
    const bool b_lo = g < 3, b_any = g < 3 || (g >= 4 && g < 7);
    const u32 xb = (u32)(GT_X + (b_lo ? g : (g - 4) & 3) * GT_XP + (b_lo ? 0 : 32) + 4 * t);
    const u32 xsc = (u32)(GT_X + 3 * GT_XP + 4 * hs), xs8 = (u32)(GT_X + 3 * GT_XP + 32 + 16 * hs);
    const u32 M = 0x0F0F0F0Fu;
    // ldmatrix row addresses: lane l reads row (l % 8) + 8·(l/8 % 2) of a tile, bytes 16·(l/16) on.
    const u32 ld_off = (u32)(((lane & 7) + 8 * ((lane >> 3) & 1)) * GT_QS + 16 * (lane >> 4));
    float acc[T];
#pragma unroll
    for (int i = 0; i < T; i++) acc[i] = 0.0f;
    for (int k = 0; k < nk; k++) {
        const u32 sn = my + ((k + S - 1) % S) * SB;
        gemvt_issue<T, NW>(c, sn, k + S - 1 < nk, true, true);
        cp_async_commit();
        cp_async_wait<S - 1>();
        __syncwarp();
        const u32 st = my + (k % S) * SB;
        u32 b[4][2];
        float sx[4], xsum[4];
#pragma unroll
        for (int p = 0; p < 4; p++) {
            b[p][0] = b_any ? lds4(st + xb + 64 * p) : 0u;
            b[p][1] = b_any ? lds4(st + xb + 64 * p + 16) : 0u;
            sx[p] = __uint_as_float(lds4(st + xsc + 8 * p));
            const uint4 s8 = lds16(st + xs8 + 32 * p);
            xsum[p] = (__uint_as_float(s8.x) + __uint_as_float(s8.y)) + (__uint_as_float(s8.z) + __uint_as_float(s8.w));
        }
#pragma unroll
        for (int i = 0; i < T; i++) {
            const uint4 hd = lds16(st + (16 * i + g + 8 * odd) * GT_QS + 128);
            const float d = f16_to_f32((u16)(hd.x & 0xFFFFu)), dmin = f16_to_f32((u16)(hd.x >> 16));
#pragma unroll
            for (int p = 0; p < 4; p++) {
                u32 r[4];
                ldsm_x4(st + 16 * i * GT_QS + ld_off + 32 * p, r[0], r[1], r[2], r[3]);
                int cc[4] = {0, 0, 0, 0};
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    const u32 a = r[2 * w], a8 = r[2 * w + 1], bw = b[p][w];
                    tc_imma(cc, a & M, a8 & M, a & ~M, a8 & ~M, b_lo ? bw : 0u, b_lo ? 0u : bw);
                }
                const int vg = (cc[0] * mul0 + cc[1] * mul1) >> sh, v8 = (cc[2] * mul0 + cc[3] * mul1) >> sh;
                const int other = __shfl_xor_sync(0xffffffffu, odd ? vg : v8, 1);
                const int tot = (odd ? v8 : vg) + other;
                const u32 sm = q4k_sm(hd.y, hd.z, hd.w, p);
                const float sc = __int_as_float(__byte_perm(sm, 0x4B000000u, sel_sc)) - 8388608.0f;
                const float mn = __int_as_float(__byte_perm(sm, 0x4B000000u, sel_m)) - 8388608.0f;
                acc[i] = fmaf(d * sc, (float)tot * sx[p], acc[i]);
                acc[i] = fmaf(-(dmin * mn), xsum[p], acc[i]);
            }
        }
        __syncwarp();  // every lane's reads of this stage are done before it is refilled
    }
    cp_async_wait<0>();
    // A row's two sub-block lanes (t, t ^ 2), then the warps in order.
#pragma unroll
    for (int i = 0; i < T; i++) {
        const float v = acc[i] + __shfl_xor_sync(0xffffffffu, acc[i], 2);
        if (t < 2) red[warp][16 * i + g + 8 * t] = v;
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

// Entry points gemvt_q4_k_t<T>_w<NW>: 16·T rows per block, NW·32 threads, grid ⌈rows / 16T⌉,
// NW·GT_S·(16T·144 + GT_XB) bytes of dynamic shared memory (`tc_smem` in
// engine/src/cuda_gemv_tc.rs); the arguments of kernels/quant.cu's integer warp-rows entries
// (GemvRows, x (unused), x's limbs, rows, cols, row_bytes), so `launch_gemv_rows` launches both. The list is `GEMVT_VARIANTS` in
// engine/src/cuda_kernels.rs (one line here per entry there).
#define GT_S 4
#define GEMVT_ENTRY(T, NW)                                                                                     \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW(                             \
        GemvRows m, const float* x, const u8* xq, int rows, int cols, int row_bytes) {                         \
        gemvt_q4_k_body<T, NW, GT_S>(m, xq, rows, cols, row_bytes);                                            \
    }

GEMVT_ENTRY(1, 4)
GEMVT_ENTRY(1, 8)
GEMVT_ENTRY(1, 16)
GEMVT_ENTRY(2, 2)
GEMVT_ENTRY(2, 4)
