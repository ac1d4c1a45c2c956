// Tensor-core one-token GEMV (decode, n = 1) for Q4_K weights: out[rows] = W · x with W in the
// repacked device layout of kernels/quant.cu (per row: every super-block's 128 quant bytes back
// to back, then the 16-byte headers d, dmin, 12 scale bytes; byte j of pair p (bytes 32p .. 32p+32
// of a super-block) holds value j of sub-block 2p in its low nibble and value j of sub-block 2p+1
// in its high nibble). Host side: `engine/src/cuda_gemv_tc.rs`.
//
// Precision argument. A Q4_K weight is d·sc_s·q − dmin·m_s with q in 0..15, exact in bf16. x is
// split into three bf16s, hi = bf16(x), mid = bf16(x − hi), lo = bf16(x − hi − mid) (round to
// nearest; f32 subtractions, each exact): x has 24 significant bits, x − hi has at most 16
// (|x − hi| ≤ half an ulp of hi, a multiple of x's ulp), x − hi − mid at most 8, so lo is exact
// and x = hi + mid + lo exactly, with no scaling (bf16 has f32's exponent range; only |x| below
// ~2^-110, where lo would need bf16 subnormals finer than 2^-133, loses bits of that tiny part).
// One mma.sync m16n8k16 (bf16 × bf16 → f32) takes the 16 quants of 16 rows as A and the hi, mid
// and lo of the 16 matching x values as B's columns 0, 1, 2 (columns 3..7 zero): q × (8-bit
// value) products are exact, summed in the tensor cores' f32 accumulation, so the three partial
// dot products q·x_hi, q·x_mid, q·x_lo of a 32-value sub-block come out in separate accumulator
// columns. Per sub-block, the partial sums are scaled by sc_s (an exact small integer in f32)
// into a per-super-block sum, which is scaled by d; the min term dmin·Σ_s m_s·Σx_s uses Σx per
// sub-block summed in f32 from x. The three columns are added at the end ((hi + mid) + lo). So
// the numerics are the CUDA-core GEMV's (exact products, f32 accumulation) in another order.
//
// Fragments of mma.m16n8k16 (g = lane/4, t = lane%4; as in kernels/gemm.cu): A {a0,a1} = (row g,
// k 2t, 2t+1), {a2,a3} = (row g+8, k 2t..), {a4,a5} = (row g, k 2t+8, 2t+9), {a6,a7} = (row
// g+8, k 2t+8..); B {b0,b1} = (k 2t, 2t+1, column g), {b2,b3} = (k 2t+8.., column g); C {c0,c1}
// = (row g, columns 2t, 2t+1), {c2,c3} = (row g+8, same columns). The order of k inside one mma
// is free when A and B use the same one. Lane t loads 8 quant bytes of a pair (positions 8t ..
// 8t+8 of both sub-blocks) for row g and for row g+8, as two words; word w's bytes 0..3 hold
// positions P_b = 8t + 4w + b. One mma per (sub-block, word) takes k 2t ← P0, 2t+1 ← P2,
// 2t+8 ← P1, 2t+9 ← P3: A's halves are (byte 0, byte 2) and (byte 1, byte 3) of the word, one
// mask each (nibble | 0x4300 is the bf16 128 + q; one bf16x2 FMA subtracts 128 exactly), and
// B's are (x[P0], x[P2]), (x[P1], x[P3]) of the float4 x[32s + 8t + 4w ..], lane g taking
// component g (hi, mid, lo; zero for g ≥ 3).
//
// Work split: a block of NW warps computes 16·T rows (T tiles of 16; grid ⌈rows / 16T⌉). Warp
// w walks super-blocks w, w + NW, ...: it issues the loads of its T tiles' quants and headers,
// builds the super-block's B fragments from x (shared by the T tiles; x comes from L1/L2) and Σx
// per sub-block (a lane's 8 values, then two shuffles), then runs 16 mma per tile. Per-row partial
// sums stay in the C fragments; at the end the three columns are added (a shuffle), then the NW
// warps' sums in shared memory in warp order (deterministic). Rows past the end load the last row
// and are not stored. Needs cols % 256 == 0 (whole super-blocks). Building B costs ~30
// instructions per 4 x values per warp, paid once per super-block for the block's 16·T rows; the
// _p entries instead read B and Σx from the pre-pass gemvt_split_x (one launch, x·6 bytes in L2).

// GemvRows (the output rows of one launch) is in common.cuh, shared with kernels/quant.cu.

__device__ __forceinline__ void tc_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Two floats rounded to bf16 (nearest even): lo in bits 0..15, hi in bits 16..31.
__device__ __forceinline__ u32 tc_bf16x2(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

// (128 + q) as bf16 pairs → q exactly: fma(v, 1, −128).
__device__ __forceinline__ u32 tc_minus128(u32 v) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(v), "r"(0x3F803F80u), "r"(0xC300C300u));
    return d;
}

// The B fragment pair of a float4 v = x[P0 .. P3] for column g: b0 = (P0, P2), b1 = (P1, P3) of
// component g of the split (0: hi, 1: mid, 2: lo; 3..7: zero).
__device__ __forceinline__ void tc_split(float4 v, int g, u32& b0, u32& b1) {
    u32 h0 = tc_bf16x2(v.x, v.z), h1 = tc_bf16x2(v.y, v.w);
    float rx = v.x - __uint_as_float(h0 << 16), rz = v.z - __uint_as_float(h0 & 0xFFFF0000u);
    float ry = v.y - __uint_as_float(h1 << 16), rw = v.w - __uint_as_float(h1 & 0xFFFF0000u);
    u32 m0 = tc_bf16x2(rx, rz), m1 = tc_bf16x2(ry, rw);
    rx -= __uint_as_float(m0 << 16);
    rz -= __uint_as_float(m0 & 0xFFFF0000u);
    ry -= __uint_as_float(m1 << 16);
    rw -= __uint_as_float(m1 & 0xFFFF0000u);
    u32 l0 = tc_bf16x2(rx, rz), l1 = tc_bf16x2(ry, rw);
    b0 = g == 0 ? h0 : g == 1 ? m0 : g == 2 ? l0 : 0u;
    b1 = g == 0 ? h1 : g == 1 ? m1 : g == 2 ? l1 : 0u;
}

// A small unsigned integer (< 2^23) as an exact float.
__device__ __forceinline__ float tc_u2f(u32 b) { return __uint_as_float(0x4B000000u | b) - 8388608.0f; }

// Header words h (d|dmin, 12 scale bytes): the 6-bit scales and mins of sub-blocks 2j and 2j+1
// (ggml's get_scale_min_k4), as bytes 0 and 1 of *sc and *mn.
__device__ __forceinline__ void tc_scale_min(uint4 h, int j, u32* sc, u32* mn) {
    const int sh = (j & 1) * 16;
    const u32 a = h.y >> sh, b = h.z >> sh, c = h.w >> sh;
    *sc = j < 2 ? (a & 0x3F3Fu) : ((c & 0x0F0Fu) | ((a >> 2) & 0x3030u));
    *mn = j < 2 ? (b & 0x3F3Fu) : (((c >> 4) & 0x0F0Fu) | ((b >> 2) & 0x3030u));
}

// The four A halves of one quant word: low nibbles (sub-block 2p) as (byte 0, byte 2) and (byte 1,
// byte 3), then the high nibbles (sub-block 2p+1) likewise, each as bf16 integers.
__device__ __forceinline__ void tc_nibbles(u32 w, u32& le, u32& lo, u32& he, u32& ho) {
    const u32 M = 0x000F000Fu, E = 0x43004300u;
    le = tc_minus128((w & M) | E);
    lo = tc_minus128(((w >> 8) & M) | E);
    he = tc_minus128(((w >> 4) & M) | E);
    ho = tc_minus128(((w >> 12) & M) | E);
}

__device__ __forceinline__ uint2 tc_ld8(const u8* p) {
    uint2 v;
    asm("ld.global.nc.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ uint4 tc_ld16(const u8* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

// x pre-pass of the PRE variants: for super-block sb, sub-block s and lane t (one thread each,
// idx = (8·sb + s)·4 + t, so t = lane % 4), the B fragments of columns g = 0, 1, 2 as
// xb[(8·sb + s)·12 + 4g + t] = {b0, b1 of word 0, b0, b1 of word 1}, and xs[8·sb + s] = Σx of the
// sub-block, summed in the same order as the in-kernel form (8 values, then two shuffles).
extern "C" __global__ void __launch_bounds__(256) gemvt_split_x(const float* __restrict__ x, uint4* __restrict__ xb,
                                                               float* __restrict__ xs, int cols) {
    const int idx = blockIdx.x * blockDim.x + threadIdx.x, n = (cols >> 8) * 32;
    const int t = idx & 3, ss = idx >> 2;
    float4 v0 = make_float4(0.0f, 0.0f, 0.0f, 0.0f), v1 = v0;
    if (idx < n) {
        v0 = *(const float4*)(x + 32 * ss + 8 * t);
        v1 = *(const float4*)(x + 32 * ss + 8 * t + 4);
    }
    float s = ((v0.x + v0.y) + (v0.z + v0.w)) + ((v1.x + v1.y) + (v1.z + v1.w));
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (idx >= n) return;
    if (t == 0) xs[ss] = s;
#pragma unroll
    for (int g = 0; g < 3; g++) {
        uint4 b;
        tc_split(v0, g, b.x, b.y);
        tc_split(v1, g, b.z, b.w);
        xb[ss * 12 + 4 * g + t] = b;
    }
}

// PRE: B fragments and Σx from gemvt_split_x (xb, xsum) instead of built from x per warp.
template <int T, int NW, bool PRE>
__device__ __forceinline__ void gemvt_q4_k_body(const GemvRows& m, const float* __restrict__ x,
                                                const uint4* __restrict__ xb, const float* __restrict__ xsum,
                                                int rows, int cols, int row_bytes) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int nsb = cols >> 8, row0 = blockIdx.x * 16 * T;
    // Row g and row g+8 of each tile.
    const u8* rp[T][2];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) rp[i][r] = m.weight(min(row0 + 16 * i + g + 8 * r, rows - 1), row_bytes);
    // Lane t's first C column is 2t: the min term goes into column 0 only (lane t = 0).
    const float first = t == 0 ? 1.0f : 0.0f;
    float acc[T][4];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[i][e] = 0.0f;
    const size_t hdr0 = (size_t)nsb * 128;
    for (int sb = warp; sb < nsb; sb += NW) {
        uint2 q[T][2][4];
        uint4 h[T][2];
#pragma unroll
        for (int i = 0; i < T; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const u8* qp = rp[i][r] + (size_t)sb * 128 + 8 * t;
#pragma unroll
                for (int p = 0; p < 4; p++) q[i][r][p] = tc_ld8(qp + 32 * p);
                h[i][r] = tc_ld16(rp[i][r] + hdr0 + 16 * sb);
            }
        float sacc[T][4], mt[T][2];
#pragma unroll
        for (int i = 0; i < T; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) sacc[i][e] = 0.0f;
            mt[i][0] = mt[i][1] = 0.0f;
        }
        const float* xp = x + (size_t)sb * 256 + 8 * t;
#pragma unroll
        for (int p = 0; p < 4; p++) {
            // B for sub-blocks 2p (b[0]) and 2p+1 (b[1]), words 0 and 1; Σx of both.
            u32 b[2][2][2];
            float xs[2];
#pragma unroll
            for (int hs = 0; hs < 2; hs++) {
                if constexpr (PRE) {
                    const int ss = 8 * sb + 2 * p + hs;
                    uint4 v = make_uint4(0u, 0u, 0u, 0u);
                    if (g < 3) v = xb[ss * 12 + 4 * g + t];
                    b[hs][0][0] = v.x;
                    b[hs][0][1] = v.y;
                    b[hs][1][0] = v.z;
                    b[hs][1][1] = v.w;
                    xs[hs] = xsum[ss];
                } else {
                    const float4 v0 = *(const float4*)(xp + 32 * (2 * p + hs));
                    const float4 v1 = *(const float4*)(xp + 32 * (2 * p + hs) + 4);
                    float s = ((v0.x + v0.y) + (v0.z + v0.w)) + ((v1.x + v1.y) + (v1.z + v1.w));
                    s += __shfl_xor_sync(0xffffffffu, s, 1);
                    s += __shfl_xor_sync(0xffffffffu, s, 2);
                    xs[hs] = s;
                    tc_split(v0, g, b[hs][0][0], b[hs][0][1]);
                    tc_split(v1, g, b[hs][1][0], b[hs][1][1]);
                }
            }
#pragma unroll
            for (int i = 0; i < T; i++) {
                float tl[4] = {0.0f, 0.0f, 0.0f, 0.0f}, th[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int w = 0; w < 2; w++) {
                    u32 le0, lo0, he0, ho0, le1, lo1, he1, ho1;
                    tc_nibbles(w ? q[i][0][p].y : q[i][0][p].x, le0, lo0, he0, ho0);
                    tc_nibbles(w ? q[i][1][p].y : q[i][1][p].x, le1, lo1, he1, ho1);
                    tc_mma(tl, le0, le1, lo0, lo1, b[0][w][0], b[0][w][1]);
                    tc_mma(th, he0, he1, ho0, ho1, b[1][w][0], b[1][w][1]);
                }
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    u32 sc, mn;
                    tc_scale_min(h[i][r], p, &sc, &mn);
                    const float s0 = tc_u2f(sc & 0xFF), s1 = tc_u2f((sc >> 8) & 0xFF);
                    sacc[i][2 * r] = fmaf(s0, tl[2 * r], sacc[i][2 * r]);
                    sacc[i][2 * r + 1] = fmaf(s0, tl[2 * r + 1], sacc[i][2 * r + 1]);
                    sacc[i][2 * r] = fmaf(s1, th[2 * r], sacc[i][2 * r]);
                    sacc[i][2 * r + 1] = fmaf(s1, th[2 * r + 1], sacc[i][2 * r + 1]);
                    mt[i][r] = fmaf(tc_u2f(mn & 0xFF), xs[0], mt[i][r]);
                    mt[i][r] = fmaf(tc_u2f((mn >> 8) & 0xFF), xs[1], mt[i][r]);
                }
            }
        }
        // Fold the super-block in: d·Σ sc·(q·x) − dmin·Σ m·Σx (the min term in column 0 only).
#pragma unroll
        for (int i = 0; i < T; i++)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                const float d = f16_to_f32((u16)(h[i][r].x & 0xFFFFu)), dmin = f16_to_f32((u16)(h[i][r].x >> 16));
                acc[i][2 * r] = fmaf(d, sacc[i][2 * r], acc[i][2 * r]);
                acc[i][2 * r + 1] = fmaf(d, sacc[i][2 * r + 1], acc[i][2 * r + 1]);
                acc[i][2 * r] = fmaf(-first * dmin, mt[i][r], acc[i][2 * r]);
            }
    }
    // Columns: lane t = 0 holds hi (c0) and mid (c1), lane t = 1 lo (c0) and column 3 (zero).
    __shared__ float red[NW][16 * T];
#pragma unroll
    for (int i = 0; i < T; i++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float v = acc[i][2 * r] + acc[i][2 * r + 1];
            v += __shfl_xor_sync(0xffffffffu, v, 1);
            if (t == 0) red[warp][16 * i + g + 8 * r] = v;
        }
    __syncthreads();
    if (threadIdx.x < 16 * T) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < NW; w++) s += red[w][threadIdx.x];
        const int row = row0 + threadIdx.x;
        if (row < rows) *m.slot(row) = s;
    }
}

// Entry points gemvt_q4_k_t<T>_w<NW>: 16·T rows per block, NW·32 threads, grid ⌈rows / 16T⌉; the
// arguments of kernels/quant.cu's gemvw_* (so `launch_gemv_rows` launches both). With the x
// pre-pass, gemvt_q4_k_t<T>_w<NW>_p: the same after gemvt_split_x, with its xb and xs after x.
// The list is `GEMVT_VARIANTS` in engine/src/cuda_kernels.rs (one line here per entry there).
#define GEMVT_ENTRY(T, NW)                                                                                     \
    extern "C" __global__ void __launch_bounds__(NW * 32)                                                      \
        gemvt_q4_k_t##T##_w##NW(GemvRows m, const float* x, int rows, int cols, int row_bytes) {               \
        gemvt_q4_k_body<T, NW, false>(m, x, nullptr, nullptr, rows, cols, row_bytes);                          \
    }
#define GEMVT_ENTRY_P(T, NW)                                                                                   \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW##_p(                         \
        GemvRows m, const float* x, const uint4* xb, const float* xs, int rows, int cols, int row_bytes) {    \
        gemvt_q4_k_body<T, NW, true>(m, x, xb, xs, rows, cols, row_bytes);                                     \
    }

GEMVT_ENTRY(1, 4)
GEMVT_ENTRY(1, 8)
GEMVT_ENTRY(2, 4)
GEMVT_ENTRY(2, 8)
GEMVT_ENTRY(4, 4)
GEMVT_ENTRY(4, 8)
GEMVT_ENTRY_P(1, 4)
GEMVT_ENTRY_P(1, 8)
GEMVT_ENTRY_P(2, 4)
GEMVT_ENTRY_P(2, 8)
GEMVT_ENTRY_P(4, 4)
GEMVT_ENTRY_P(4, 8)

// ---------------------------------------------------------------------------------------------
// Integer tensor-core form (mode 2, entries gemvt_q4_k_t<T>_w<NW>_i): the quants meet x's int8
// limbs (the integer form of kernels/quant.cu: three limb planes, a scale per 32 values, Σx per
// 8, from the gemv_x_limbs pre-pass or the op that wrote x) in mma.sync m16n8k32 (u8 × s8 → s32),
// so a warp's 16 rows × 32 values are one instruction where dp4a takes 24 per 32 values a row.
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

template <int T, int NW, bool PF>
__device__ __forceinline__ void gemvt_q4_k_int_body(const GemvRows& m, const u8* __restrict__ xq, int rows, int cols,
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
    // Super-block sb's quants (rows g and g+8 of each tile) and headers (the lane's epilogue row).
    auto load = [&](int sb, uint2 (&q)[T][2][4], uint4 (&hd)[T]) {
#pragma unroll
        for (int i = 0; i < T; i++) {
#pragma unroll
            for (int r = 0; r < 2; r++)
#pragma unroll
                for (int p = 0; p < 4; p++) q[i][r][p] = tc_ld8(rp[i][r] + (size_t)sb * 128 + 32 * p + 8 * t);
            hd[i] = tc_ld16((odd ? rp[i][1] : rp[i][0]) + hdr0 + 16 * sb);
        }
    };
    uint2 q[T][2][4], qn[T][2][4];
    uint4 hd[T], hn[T];
    if (PF && warp < nsb) load(warp, qn, hn);
    for (int sb = warp; sb < nsb; sb += NW) {
        if constexpr (PF) {
            // The next super-block's loads go out before this one's products (PF: prefetch).
#pragma unroll
            for (int i = 0; i < T; i++) {
                hd[i] = hn[i];
#pragma unroll
                for (int r = 0; r < 2; r++)
#pragma unroll
                    for (int p = 0; p < 4; p++) q[i][r][p] = qn[i][r][p];
            }
            if (sb + NW < nsb) load(sb + NW, qn, hn);
        } else {
            load(sb, q, hd);
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

// Entry points gemvt_q4_k_t<T>_w<NW>_i (and _ip: with the next super-block's weights loaded
// before the current one's products): the arguments of kernels/quant.cu's integer warp-rows
// entries (GemvRows, x (unused), x's limbs, rows, cols, row_bytes).
#define GEMVT_ENTRY_I(T, NW)                                                                                   \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW##_i(                         \
        GemvRows m, const float* x, const u8* xq, int rows, int cols, int row_bytes) {                         \
        gemvt_q4_k_int_body<T, NW, false>(m, xq, rows, cols, row_bytes);                                       \
    }
#define GEMVT_ENTRY_IP(T, NW)                                                                                  \
    extern "C" __global__ void __launch_bounds__(NW * 32) gemvt_q4_k_t##T##_w##NW##_ip(                        \
        GemvRows m, const float* x, const u8* xq, int rows, int cols, int row_bytes) {                         \
        gemvt_q4_k_int_body<T, NW, true>(m, xq, rows, cols, row_bytes);                                        \
    }

GEMVT_ENTRY_I(1, 4)
GEMVT_ENTRY_I(1, 8)
GEMVT_ENTRY_I(2, 4)
GEMVT_ENTRY_I(2, 8)
GEMVT_ENTRY_I(1, 16)
GEMVT_ENTRY_I(2, 16)
GEMVT_ENTRY_IP(1, 4)
GEMVT_ENTRY_IP(1, 8)
GEMVT_ENTRY_IP(1, 16)
GEMVT_ENTRY_IP(2, 4)
GEMVT_ENTRY_IP(2, 8)
