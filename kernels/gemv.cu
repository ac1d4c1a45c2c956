// Part of the `quant` NVRTC module (engine/src/cuda_kernels.rs), compiled after matmul.cu, whose
// type ids, decoders and helpers it uses.

// ---------------------------------------------------------------------------------------------
// GEMV for one token (n = 1): F16, BF16, Q8_0, Q4_1, Q4_K and Q6_K, in two work splits over the same
// per-unit primitives (gemv_load, gemv_x_load, gemv_dot; a unit's numerics are the same in both):
// x-stationary (gemv_body, entries gemv_*, below) and warp-rows (gemvw_body, entries gemvw_*, at
// the end of the file); `CudaBackend::gemv_default` picks one per type. (A third split, x staged
// in shared memory per block, never beat warp-rows in the H200 sweep and was removed.)
//
// The row is cut into units of V values (F16/BF16: 8, one 16-byte load; Q8_0: 16, one 16-byte
// load of quants plus the block's f16 scale; Q4_1: 16, one 8-byte load of quants, 8 values in
// the low nibbles and the 8 values 16 further on in the high ones, plus the block's f16 d and m;
// Q4_K: 32, one 16-byte load of quants, 16 values of
// sub-block 2j in the low nibbles and the same 16 positions of sub-block 2j+1 in the high ones,
// plus its super-block's 16-byte header, shared by 8 neighbouring threads, so in both splits the
// units of a warp are 32 consecutive ones starting at a multiple of 32; warp-rows MODE 3 takes
// pair units of 64 instead, see the integer form below). x-stationary: thread t
// of a block owns units t, t + T, ... (UPT of them) for every row: it loads its slice of x into registers
// once (and, for Q4_K, the slice's per-sub-block sums of x), then the block walks groups of R
// rows (grid-stride), loading the next group's weights while it computes the current one, and
// reduces each row over the block in a fixed order (deterministic).
//
// Quants become floats without I2F: a byte is placed in the mantissa of an exponent word with
// PRMT (2^23 + q, then one exact subtraction). Q4_K MODE 1 instead forms 1 + q/128 (no
// subtraction) and recovers Σx·q = 128·(Σx·(1 + q/128) − Σx): one op less per weight, ~4 bits less
// headroom in that partial sum. MODE 0 is the default.
//
// Q8_0 rows are repacked on upload (see `crate::cuda`): a row is its cols quant bytes, then its
// cols/32 f16 scales (same row_bytes), so the quants are 16-byte aligned when row_bytes is.
// Q4_K rows likewise: the 128 quant bytes of every super-block back to back, then the 16-byte
// headers (same row_bytes: 144 per super-block), so unit u's quants are bytes 16u .. 16u+16 and
// a warp's quant loads are one contiguous 512-byte run (the ggml layout interleaves a header
// every 144 bytes, so those loads were 32-byte strided).
// Q6_K rows likewise (warp-rows only, modes 0 and 2; see deq8 for the layout): a unit is 32 values, one
// 16-byte load of ql (16 values in the low nibbles, the same positions 64 on in the high ones),
// one of the 16 qh bytes holding their highs, and its two scale bytes and super-block d.
// Q4_1 rows likewise: the 16 quant bytes of every block back to back (cols/2 bytes), then each
// block's 4-byte header (f16 d, f16 m); same row_bytes (20 per block), so unit u's quants are
// bytes 8u .. 8u+8, 8-byte aligned when row_bytes is (an even number of blocks). A unit's dot is
// d·Σx·q + m·Σx, with Σx of its 16 x values computed once with the x slice.

template <int TY>
__host__ __device__ constexpr int gemv_vals() {
    return (TY == TY_Q4_K || TY == TY_Q6_K) ? 32 : (TY == TY_Q8_0 || TY == TY_Q4_1) ? 16 : 8;
}

// A unit's weights: its quants (a) and header (h; Q4_K: one word of it, see gemv_load). V is the
// unit's values: gemv_vals, or 64 for a Q4_K pair unit (warp-rows mode 3: the quants of units
// 2p and 2p + 1 in a and b, the whole 16-byte header in h).
template <int TY, int V = gemv_vals<TY>()>
struct WFrag {
    uint4 a, h;
};
template <>
struct WFrag<TY_Q4_K, 64> {
    uint4 a, b, h;
};
// Q6_K: the unit's 16 ql bytes (a), the 16 qh bytes its 2-bit highs are in (h, shared with the
// unit two on), its two scale bytes and its super-block's f16 d (s: scales low, d high).
template <>
struct WFrag<TY_Q6_K, 32> {
    uint4 a, h;
    u32 s;
};

template <int TY, int V>
__device__ __forceinline__ void gemv_load(const u8* row, int u, int cols, WFrag<TY, V>& f) {
    if constexpr (V == 64) {
        // Pair unit p = u: quant bytes 32p .. 32p+32, and the header of super-block p/4, which
        // the 4 lanes of a super-block load alike (one 128-byte run of 8 headers per warp).
        static_assert(TY == TY_Q4_K, "pair units are Q4_K only");
        f.a = ldg16(row + 32 * u);
        f.b = ldg16(row + 32 * u + 16);
        f.h = ldg16(row + (size_t)(cols >> 8) * 128 + 16 * (u >> 2));
    } else if constexpr (TY == TY_F16 || TY == TY_BF16) {
        f.a = ldg16(row + 16 * u);
    } else if constexpr (TY == TY_Q8_0) {
        f.a = ldg16(row + 16 * u);
        f.h.x = *(const u16*)(row + cols + 2 * (u >> 1));
    } else if constexpr (TY == TY_Q4_1) {
        const uint2 a = ldg8(row + 8 * u);
        f.a.x = a.x, f.a.y = a.y;
        f.h.x = ldg4(row + (cols >> 1) + 4 * (u >> 1));
    } else if constexpr (TY == TY_Q6_K) {
        // Repacked rows (see deq8): unit u = 8·sb + i of super-block sb is ql bytes 16u .. 16u+16
        // (n = i/4, p = i/2 % 2, is = i % 2), its highs are qh bytes 32n + 16is .. +16 of the
        // super-block, its scales bytes 2i, 2i+1 of the super-block's 16.
        const int nsb = cols >> 8, sb = u >> 3, i = u & 7;
        f.a = ldg16(row + 16 * u);
        f.h = ldg16(row + (size_t)nsb * 128 + 64 * sb + 32 * (i >> 2) + 16 * (i & 1));
        f.s = (u32)ldg2(row + (size_t)nsb * 192 + 16 * sb + 2 * i) | ((u32)ldg2(row + (size_t)nsb * 208 + 2 * sb) << 16);
    } else {
        // One header word per thread: the 8 threads of a super-block (units 8s .. 8s+7 are 8
        // neighbouring lanes, since blocks are whole warps and cols % 256 == 0) load words 0..3
        // twice over; gemv_dot gathers the four words with shuffles. 4 registers in flight per
        // row instead of 16 leaves room for more rows per step.
        f.a = ldg16(row + 16 * u);
        const u8* hp = row + (size_t)(cols >> 8) * 128 + 16 * (u >> 3) + 4 * (u & 3);
        f.h.x = ldg4(hp);
    }
}

// A Q4_K unit's dot from its two run sums s0 = Σx·q (sub-block 2j) and s1 (2j+1) and the runs'
// Σx (x0, x1): d·(sc0·s0 + sc1·s1) − dmin·(m0·x0 + m1·x1), with d, dmin (word h0) and the scales
// and mins (q4k_sm) from the super-block header, whose four words the 8 threads of the
// super-block hold one each (see gemv_load) and gather with 4 shuffles.
__device__ __forceinline__ float q4k_unit(u32 hword, int u, float s0, float s1, float x0, float x1) {
    const int base = (threadIdx.x & 31) & ~7;
    u32 h0 = __shfl_sync(0xffffffffu, hword, base), h1 = __shfl_sync(0xffffffffu, hword, base + 1);
    u32 h2 = __shfl_sync(0xffffffffu, hword, base + 2), h3 = __shfl_sync(0xffffffffu, hword, base + 3);
    const u32 sm = q4k_sm(h1, h2, h3, (u & 7) >> 1);
    float d = f16_to_f32((u16)(h0 & 0xFFFF)), dmin = f16_to_f32((u16)(h0 >> 16));
    float sc0 = byte_f<0>(sm, 8388608.0f), sc1 = byte_f<1>(sm, 8388608.0f);
    float m0 = byte_f<2>(sm, 8388608.0f), m1 = byte_f<3>(sm, 8388608.0f);
    return d * (sc0 * s0 + sc1 * s1) - dmin * (m0 * x0 + m1 * x1);
}

// s0 += Σ_b (byte b of lo − bias)·x0[b], s1 likewise of hi with x1 (bytes placed as 2^23 + byte:
// byte_f), one FMA a byte in this order.
__device__ __forceinline__ void byte_fma2(u32 lo, u32 hi, const float* x0, const float* x1, float bias, float& s0,
                                          float& s1) {
    s0 = fmaf(byte_f<0>(lo, bias), x0[0], s0);
    s0 = fmaf(byte_f<1>(lo, bias), x0[1], s0);
    s0 = fmaf(byte_f<2>(lo, bias), x0[2], s0);
    s0 = fmaf(byte_f<3>(lo, bias), x0[3], s0);
    s1 = fmaf(byte_f<0>(hi, bias), x1[0], s1);
    s1 = fmaf(byte_f<1>(hi, bias), x1[1], s1);
    s1 = fmaf(byte_f<2>(hi, bias), x1[2], s1);
    s1 = fmaf(byte_f<3>(hi, bias), x1[3], s1);
}

// One unit's dot with its x slice xv (V values) and, for Q4_K, xs = its two 16-value runs' sums
// (Q4_1: the sum of its 16 values).
template <int TY, int MODE>
__device__ __forceinline__ float gemv_dot(const WFrag<TY>& f, const float* xv, const float* xs, int u) {
    if constexpr (TY == TY_F16 || TY == TY_BF16) {
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float lo, hi;
            if constexpr (TY == TY_F16) {
                lo = f16_to_f32((u16)(w[k] & 0xFFFF));
                hi = f16_to_f32((u16)(w[k] >> 16));
            } else {
                lo = __uint_as_float(w[k] << 16);
                hi = __uint_as_float(w[k] & 0xFFFF0000u);
            }
            s0 = fmaf(lo, xv[2 * k], s0);
            s1 = fmaf(hi, xv[2 * k + 1], s1);
        }
        return s0 + s1;
    } else if constexpr (TY == TY_Q8_0) {
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w};
        float s0 = 0.0f, s1 = 0.0f;
        const float bias = 8388736.0f;  // 2^23 + 128: the bytes are q + 128 after the xor
#pragma unroll
        for (int k = 0; k < 4; k++) {
            u32 v = w[k] ^ 0x80808080u;
            s0 = fmaf(byte_f<0>(v, bias), xv[4 * k], s0);
            s1 = fmaf(byte_f<1>(v, bias), xv[4 * k + 1], s1);
            s0 = fmaf(byte_f<2>(v, bias), xv[4 * k + 2], s0);
            s1 = fmaf(byte_f<3>(v, bias), xv[4 * k + 3], s1);
        }
        return f16_to_f32((u16)f.h.x) * (s0 + s1);
    } else if constexpr (TY == TY_Q4_1) {
        // Word k holds quant bytes 4k .. 4k+3 of the unit: low nibbles are x values xv[4k ..),
        // high nibbles the values 16 further on, xv[8 + 4k ..) (see gemv_x_at).
        const u32 w[2] = {f.a.x, f.a.y};
        const float bias = 8388608.0f;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 2; k++) {
            u32 lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
            byte_fma2(lo, hi, xv + 4 * k, xv + 8 + 4 * k, bias, s0, s1);
        }
        float d = f16_to_f32((u16)(f.h.x & 0xFFFFu)), m = f16_to_f32((u16)(f.h.x >> 16));
        return fmaf(d, s0 + s1, m * xs[0]);
    } else if constexpr (TY == TY_Q6_K) {
        // Byte k·4 + b of the quants: low nibble at xv[4k + b] (run 0), high nibble at
        // xv[16 + 4k + b] (run 1); their 2-bit highs are bits 2p, 2p + 1 (run 0) and 4 + 2p,
        // 5 + 2p (run 1) of the qh byte at the same place. Each byte becomes 2^23 + q, less
        // 2^23 + 32: q − 32 exactly.
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w}, hw[4] = {f.h.x, f.h.y, f.h.z, f.h.w};
        const int sh = 2 * ((u >> 1) & 1);
        const float bias = 8388640.0f;
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 hb = hw[k] >> sh;
            const u32 lo = (w[k] & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u);
            const u32 hi = ((w[k] >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u);
            byte_fma2(lo, hi, xv + 4 * k, xv + 16 + 4 * k, bias, s0, s1);
        }
        const float sc0 = (float)(i8)(f.s & 0xFFu), sc1 = (float)(i8)((f.s >> 8) & 0xFFu);
        return f16_to_f32((u16)(f.s >> 16)) * (sc0 * s0 + sc1 * s1);
    } else {
        // xv[0..16): 16 values of sub-block 2j (low nibbles), xv[16..32): the same positions of
        // sub-block 2j+1 (high nibbles); word k holds positions 4k .. 4k+3 of both.
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w};
        float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            if constexpr (MODE == 0) {
                u32 lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
                const float bias = 8388608.0f;
                byte_fma2(lo, hi, xv + 4 * k, xv + 16 + 4 * k, bias, s0, s1);
            } else {
                // Each byte 1000qqqq placed as bits 16..23 under exponent byte 0x3F: 1 + q/128.
                u32 lo = (w[k] & 0x0F0F0F0Fu) | 0x80808080u, hi = ((w[k] >> 4) & 0x0F0F0F0Fu) | 0x80808080u;
#pragma unroll
                for (int b = 0; b < 4; b++) {
                    s0 = fmaf(__int_as_float(__byte_perm(lo, 0x3F000000u, 0x7044u + (b << 8))), xv[4 * k + b], s0);
                    s1 = fmaf(__int_as_float(__byte_perm(hi, 0x3F000000u, 0x7044u + (b << 8))), xv[16 + 4 * k + b],
                              s1);
                }
            }
        }
        if constexpr (MODE == 1) {
            s0 = 128.0f * (s0 - xs[0]);
            s1 = 128.0f * (s1 - xs[1]);
        }
        return q4k_unit(f.h.x, u, s0, s1, xs[0], xs[1]);
    }
}

// Where unit u's run r of 4 x values starts: contiguous for F16/BF16/Q8_0; for Q4_K (units of 32
// values in two runs of 16, 32 apart) the low-nibble run then the high-nibble one.
template <int TY>
__device__ __forceinline__ int gemv_x_at(int u, int r) {
    if constexpr (TY == TY_Q4_K) {
        int base = 256 * (u >> 3) + 64 * ((u & 7) >> 1) + 16 * (u & 1);
        return base + (r < 4 ? 4 * r : 32 + 4 * (r - 4));
    } else if constexpr (TY == TY_Q6_K) {
        // Unit u = 8·sb + i: positions 128n + 32p + 16is .. +16 of super-block sb (low nibbles),
        // then those 64 further on (high nibbles); n, p, is as in gemv_load.
        const int i = u & 7;
        int base = 256 * (u >> 3) + 128 * (i >> 2) + 32 * ((i >> 1) & 1) + 16 * (i & 1);
        return base + (r < 4 ? 4 * r : 64 + 4 * (r - 4));
    } else if constexpr (TY == TY_Q4_1) {
        // Unit u: block u/2, quant bytes 8(u%2) .. +8: x values 8(u%2) .. +8 of the block (low
        // nibbles), then those 16 further on (high nibbles).
        int base = 32 * (u >> 1) + 8 * (u & 1);
        return base + (r < 2 ? 4 * r : 16 + 4 * (r - 2));
    } else {
        return gemv_vals<TY>() * u + 4 * r;
    }
}

// Unit u's V x values in gemv_dot's order (float4 loads at gemv_x_at) and, for Q4_K, the sums
// of its two 16-value runs (Q4_1: of its 16 values); both GEMV work splits use it.
template <int TY>
__device__ __forceinline__ void gemv_x_load(const float* __restrict__ x, int u, float* xv, float* xs) {
    constexpr int V = gemv_vals<TY>();
#pragma unroll
    for (int i = 0; i < V / 4; i++) {
        float4 v = ldx16f(x + gemv_x_at<TY>(u, i));
        xv[4 * i] = v.x;
        xv[4 * i + 1] = v.y;
        xv[4 * i + 2] = v.z;
        xv[4 * i + 3] = v.w;
    }
    if constexpr (TY == TY_Q4_K) {
        float a = 0.0f, b = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            a += xv[i];
            b += xv[16 + i];
        }
        xs[0] = a;
        xs[1] = b;
    } else if constexpr (TY == TY_Q4_1) {
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; i++) a += xv[i];
        xs[0] = a;
        xs[1] = 0.0f;
    }
}

// ---------------------------------------------------------------------------------------------
// Integer GEMV form (MODE 2, both work splits; Q4_K, Q4_1, Q8_0; warp-rows Q6_K): the weights' integers meet x as int8
// through dp4a, four products and their sum in one instruction, where the float forms spend two
// or three instructions a weight (the H200 sweep found Q4_K and Q8_0 limited by that decode and
// FMA work, not by memory: the same time for the same weights, although Q8_0 has twice the bytes).
//
// Precision argument. x_limbs4 (common.cuh: in the pre-pass gemv_x_limbs of ops.cu, one launch per x, or
// in the norm, SwiGLU or split GQA attention that wrote a decode row) writes, for every block of 32
// x values with max |x| = m·2^e (m in [0.5, 1)), y = x·2^-e·(127/m) (|y| ≤ 127) as three int8
// limbs y ≈ l0 + l1/128 + l2/128² (l0 = rint(y), l1 = rint(128·(y − l0)), l2 = rint(128·(128·(y −
// l0) − l1)); every subtraction and ×128 is exact), so |y − limbs| ≤ 2^-15: each x is carried to
// 2^-22 of its block's max |x|, finer than the prefill GEMM's x split (2^-22 of the token's max).
// A unit's run of 16 (Q8_0: its 16 values) gives integer sums D_l = Σ q·l_l (exact in int32);
// D = 128²·D0 + 128·D1 + D2 is exact too (|l0| ≤ 127, |l1|, |l2| ≤ 64, so for 4-bit q and n
// values |D| ≤ 15·n·(127·128² + 64·128 + 64): < 2^29 for a run of 16, < 2^30 for a pair unit's
// sub-block of 32; Q8_0 keeps D0 apart) and one I2F rounds it like an f32 sum; × the block's
// scale s = (m/127)·2^(e−14) gives Σ q·x. The
// pre-pass also writes Σx per 8 values (f32) for the offset terms (Q4_K dmin·m·Σx, Q4_1 m·Σx).
// A block with a non-finite x gets s = NaN (and zero limbs), so NaN and inf reach the output as
// they do in the float forms; an all-zero block gets s = 0.
// The scale s is a normal float only for blocks with max |x| ≥ 2^-104 (~5e-32): below that it
// is subnormal and carries fewer bits (x ×1e-36 gave rel_l2 1.2e-3 against the CPU engine in
// an earlier measurement), a range no working model's activations reach.
//
// On the H200 it cuts a Q4_K row-unit from ~5 to ~3 instructions
// a weight and the 8B GEMVs by 8–12 %, pre-pass included (its launch is ~2.6 µs); the kernel
// then issues on ~56 % of cycles and waits on memory the rest. Two ways to hide that latency
// were tried and removed: the next step's weights double-buffered in registers, and a ring of
// steps staged through shared memory by cp.async (both slower).
//
// MODE 3 (warp-rows Q4_K, pair units): a thread takes pair p = units 2p, 2p+1 of a row (quant
// bytes 32p .. 32p+32: all 32 positions of sub-blocks 2j and 2j+1, j = p % 4, low and high
// nibbles), 64 values, with the whole 16-byte header (one load; the 4 threads of a super-block
// load the same one) and 64 x values × 3 limbs, both sub-blocks' scales and Σx. Each sub-block's
// int sums cover its 32 values (one I2F each, |D| < 2^30 as above), the header is decoded once
// per 64 weights and without shuffles, and the high nibbles stay in place (dp4a on bytes 16q, the
// 16 taken out exactly in limbs_f16): in SASS ~126 instructions per row per 64 weights at R 4
// (~121 at R 8), where mode 2 at R 8 spends ~170 (it keeps the high nibbles in place too).
// A chunk is 32 pairs (2048 values), so a 4096-wide row is 2 chunks, a 14336-wide one 7. Its
// entries cap registers at 128 (__maxnreg__): ptxas otherwise trades the loads' early issue for
// fewer registers (the header loads sink towards their use).
//
// Layout of the pre-pass's output (bytes, cols % 32 == 0): limb planes 0, 1, 2 (cols int8 each,
// in x order), then s per 32 values (cols/32 f32), then Σx per 8 values (cols/8 f32).

__device__ __forceinline__ int dp4a(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// The same with a's bytes unsigned (0..255).
__device__ __forceinline__ int dp4a_u8(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// A unit's x in limbs: l[limb][word] in gemv_dot's word order (Q4_K: words 0..V/8 the
// low-nibble run, V/8..V/4 the high-nibble run; Q4_1: 0..1 and 2..3; Q8_0: 0..3), the scale of
// each run's block (s[0], s[1]; one block for Q4_1 and Q8_0) and Σx of each run (Q4_1: of the
// unit, in xs[0]). V as in WFrag (a Q4_K pair unit's runs are whole sub-blocks 2j and 2j + 1).
template <int TY, int V = gemv_vals<TY>()>
struct XLimbs {
    u32 l[3][V / 4];
    float s[2], xs[2];
};

// x's limbs are another kernel's output (coherent global loads, ldx*), or with SH a kernel's own
// in shared memory (plain loads).
template <bool SH>
__device__ __forceinline__ uint4 xq_ld16(const void* p) {
    if constexpr (SH)
        return *(const uint4*)p;
    else
        return ldx16(p);
}
template <bool SH>
__device__ __forceinline__ uint2 xq_ld8(const void* p) {
    if constexpr (SH)
        return *(const uint2*)p;
    else
        return ldx8(p);
}
template <bool SH>
__device__ __forceinline__ float xq_ld4f(const void* p) {
    if constexpr (SH)
        return *(const float*)p;
    else
        return ldx4f(p);
}
template <bool SH>
__device__ __forceinline__ float2 xq_ld8f(const void* p) {
    const uint2 v = xq_ld8<SH>(p);
    return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}
template <bool SH>
__device__ __forceinline__ float4 xq_ld16f(const void* p) {
    const uint4 v = xq_ld16<SH>(p);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}

// The limbs of x the integer GEMVs use (see the precision argument above).
#define GEMV_NLIMB 3
template <int TY, int V, bool SH = false>
__device__ __forceinline__ void gemv_xq_load(const u8* __restrict__ xq, int cols, int u, XLimbs<TY, V>& q) {
    const float* sc = (const float*)(xq + 3 * (size_t)cols);
    const float* s8 = sc + cols / 32;
    const int a = V == 64 ? 64 * u : gemv_x_at<TY>(u, 0);
#pragma unroll
    for (int l = 0; l < GEMV_NLIMB; l++) {
        const u8* p = xq + (size_t)l * cols;
        if constexpr (TY == TY_Q4_K) {
            // The low-nibble run's V/2 values at a, the high-nibble run's 32 further on.
#pragma unroll
            for (int i = 0; i < V / 32; i++) {
                uint4 v = xq_ld16<SH>(p + a + 16 * i), w = xq_ld16<SH>(p + a + 32 + 16 * i);
                q.l[l][4 * i] = v.x, q.l[l][4 * i + 1] = v.y, q.l[l][4 * i + 2] = v.z, q.l[l][4 * i + 3] = v.w;
                q.l[l][V / 8 + 4 * i] = w.x, q.l[l][V / 8 + 4 * i + 1] = w.y;
                q.l[l][V / 8 + 4 * i + 2] = w.z, q.l[l][V / 8 + 4 * i + 3] = w.w;
            }
        } else if constexpr (TY == TY_Q6_K) {
            // The low-nibble run's 16 values at a, the high-nibble run's 64 further on.
            uint4 v = xq_ld16<SH>(p + a), w = xq_ld16<SH>(p + a + 64);
            q.l[l][0] = v.x, q.l[l][1] = v.y, q.l[l][2] = v.z, q.l[l][3] = v.w;
            q.l[l][4] = w.x, q.l[l][5] = w.y, q.l[l][6] = w.z, q.l[l][7] = w.w;
        } else if constexpr (TY == TY_Q4_1) {
            uint2 v = xq_ld8<SH>(p + a), w = xq_ld8<SH>(p + a + 16);
            q.l[l][0] = v.x, q.l[l][1] = v.y, q.l[l][2] = w.x, q.l[l][3] = w.y;
        } else {
            uint4 v = xq_ld16<SH>(p + a);
            q.l[l][0] = v.x, q.l[l][1] = v.y, q.l[l][2] = v.z, q.l[l][3] = v.w;
        }
    }
    if constexpr (TY == TY_Q4_K && V == 64) {
        // Σx of each sub-block from its four sums per 8 (s8 + a/8 is 16-byte aligned: a % 64 == 0).
        float2 s2 = xq_ld8f<SH>(sc + a / 32);
        float4 x0 = xq_ld16f<SH>(s8 + a / 8), x1 = xq_ld16f<SH>(s8 + a / 8 + 4);
        q.s[0] = s2.x, q.s[1] = s2.y;
        q.xs[0] = (x0.x + x0.y) + (x0.z + x0.w), q.xs[1] = (x1.x + x1.y) + (x1.z + x1.w);
    } else if constexpr (TY == TY_Q6_K) {
        q.s[0] = xq_ld4f<SH>(sc + a / 32), q.s[1] = xq_ld4f<SH>(sc + a / 32 + 2);
        q.xs[0] = q.xs[1] = 0.0f;
    } else if constexpr (TY == TY_Q4_K) {
        float2 s2 = xq_ld8f<SH>(sc + a / 32);
        float2 x0 = xq_ld8f<SH>(s8 + a / 8), x1 = xq_ld8f<SH>(s8 + a / 8 + 4);
        q.s[0] = s2.x, q.s[1] = s2.y;
        q.xs[0] = x0.x + x0.y, q.xs[1] = x1.x + x1.y;
    } else {
        q.s[0] = xq_ld4f<SH>(sc + a / 32), q.s[1] = 0.0f;
        q.xs[0] = TY == TY_Q4_1 ? xq_ld4f<SH>(s8 + a / 8) + xq_ld4f<SH>(s8 + a / 8 + 2) : 0.0f, q.xs[1] = 0.0f;
    }
}

// 128²·D0 + 128·D1 + D2 as a float (exact in int32 for 4-bit quants, see above).
__device__ __forceinline__ float limbs_f(int d0, int d1, int d2) { return (float)(d0 * 16384 + d1 * 128 + d2); }
// The same from 16·D0, 16·D1, 16·D2 (sums over quants 16q, see gemv_dot_q): 16·D2 is a multiple of
// 16, so its shift is exact, and the sum is the same integer as limbs_f's.
__device__ __forceinline__ float limbs_f16(int d0, int d1, int d2) { return (float)(d0 * 1024 + d1 * 8 + (d2 >> 4)); }

// One unit's dot in the integer form: the same value as gemv_dot's, to the precision argued above.
// OWN (Q4_K): f.h is the unit's whole super-block header (pair units), else one word of it, gathered by shuffles (q4k_unit).
template <int TY, int V, bool OWN = V == 64>
__device__ __forceinline__ float gemv_dot_q(const WFrag<TY, V>& f, const XLimbs<TY, V>& q, int u) {
    if constexpr (TY == TY_Q4_K) {
        // Word k holds positions 4k .. 4k+3 of the low-nibble run and of the high-nibble one (a
        // pair unit's 8 words, a then b: all 32 positions of sub-blocks 2j and 2j + 1).
        u32 w[V / 8] = {f.a.x, f.a.y, f.a.z, f.a.w};
        if constexpr (V == 64) w[4] = f.b.x, w[5] = f.b.y, w[6] = f.b.z, w[7] = f.b.w;
        int a[3] = {0, 0, 0}, b[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < V / 8; k++) {
            // The high nibbles stay in place (bytes 16q, one op less a word; limbs_f16 takes the
            // 16 out).
            u32 lo = w[k] & 0x0F0F0F0Fu, hi = w[k] & 0xF0F0F0F0u;
#pragma unroll
            for (int l = 0; l < GEMV_NLIMB; l++) {
                a[l] = dp4a(lo, q.l[l][k], a[l]);
                b[l] = dp4a_u8(hi, q.l[l][V / 8 + k], b[l]);
            }
        }
        if constexpr (OWN) {
            // The whole header is the lane's: (d·sc0·s0)·D0 + (d·sc1·s1)·D1 − dmin·(m0·x0 + m1·x1),
            // the same terms as q4k_unit's, grouped so that the header's part needs no sums. The
            // unit's sub-blocks are 2j and 2j + 1: j = u % 4 for a pair unit, (u % 8) / 2 else.
            const u32 sm = q4k_sm(f.h.y, f.h.z, f.h.w, V == 64 ? u & 3 : (u & 7) >> 1);
            const float d = f16_to_f32((u16)(f.h.x & 0xFFFF)), dmin = f16_to_f32((u16)(f.h.x >> 16));
            const float c0 = d * byte_f<0>(sm, 8388608.0f) * q.s[0], c1 = d * byte_f<1>(sm, 8388608.0f) * q.s[1];
            const float off = dmin * (byte_f<2>(sm, 8388608.0f) * q.xs[0] + byte_f<3>(sm, 8388608.0f) * q.xs[1]);
            return fmaf(c0, limbs_f(a[0], a[1], a[2]), fmaf(c1, limbs_f16(b[0], b[1], b[2]), -off));
        } else {
            float s0 = limbs_f(a[0], a[1], a[2]) * q.s[0], s1 = limbs_f16(b[0], b[1], b[2]) * q.s[1];
            return q4k_unit(f.h.x, u, s0, s1, q.xs[0], q.xs[1]);
        }
    } else if constexpr (TY == TY_Q4_1) {
        const u32 w[2] = {f.a.x, f.a.y};
        int a[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 2; k++) {
            u32 lo = w[k] & 0x0F0F0F0Fu, hi = (w[k] >> 4) & 0x0F0F0F0Fu;
#pragma unroll
            for (int l = 0; l < GEMV_NLIMB; l++) a[l] = dp4a(hi, q.l[l][2 + k], dp4a(lo, q.l[l][k], a[l]));
        }
        float d = f16_to_f32((u16)(f.h.x & 0xFFFFu)), m = f16_to_f32((u16)(f.h.x >> 16));
        return fmaf(d, limbs_f(a[0], a[1], a[2]) * q.s[0], m * q.xs[0]);
    } else if constexpr (TY == TY_Q6_K) {
        // The 6-bit quants as signed bytes q − 32 (__vsub4), as gemv_dot assembles them; |q − 32|
        // ≤ 32, so 128²·D0 over a run of 16 stays under 2^30 (16·32·127·128²) and limbs_f is exact.
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w}, hw[4] = {f.h.x, f.h.y, f.h.z, f.h.w};
        const int sh = 2 * ((u >> 1) & 1);
        int a[3] = {0, 0, 0}, b[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 hb = hw[k] >> sh;
            const u32 lo = __vsub4((w[k] & 0x0F0F0F0Fu) | ((hb << 4) & 0x30303030u), 0x20202020u);
            const u32 hi = __vsub4(((w[k] >> 4) & 0x0F0F0F0Fu) | (hb & 0x30303030u), 0x20202020u);
#pragma unroll
            for (int l = 0; l < GEMV_NLIMB; l++) {
                a[l] = dp4a(lo, q.l[l][k], a[l]);
                b[l] = dp4a(hi, q.l[l][4 + k], b[l]);
            }
        }
        const float sc0 = (float)(i8)(f.s & 0xFFu), sc1 = (float)(i8)((f.s >> 8) & 0xFFu);
        const float d = f16_to_f32((u16)(f.s >> 16));
        return d * fmaf(sc0 * q.s[0], limbs_f(a[0], a[1], a[2]), sc1 * q.s[1] * limbs_f(b[0], b[1], b[2]));
    } else {
        // Signed 8-bit quants: |D0| reaches 16·128·127, so 128²·D0 would overflow int32.
        const u32 w[4] = {f.a.x, f.a.y, f.a.z, f.a.w};
        int a[3] = {0, 0, 0};
#pragma unroll
        for (int k = 0; k < 4; k++)
#pragma unroll
            for (int l = 0; l < GEMV_NLIMB; l++) a[l] = dp4a(w[k], q.l[l][k], a[l]);
        float d = f16_to_f32((u16)f.h.x);
        return d * q.s[0] * fmaf((float)a[0], 16384.0f, (float)(a[1] * 128 + a[2]));
    }
}

template <int TY, int R, int UPT>
__device__ __forceinline__ void gemv_load_group(const u8* __restrict__ W, int g, int rows, int row_bytes, int cols,
                                                const int* us, WFrag<TY> (&f)[R][UPT]) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        int row = min(g * R + r, rows - 1);
        const u8* rp = W + (size_t)row * row_bytes;
#pragma unroll
        for (int k = 0; k < UPT; k++) gemv_load<TY>(rp, us[k], cols, f[r][k]);
    }
}

template <int TY, int R, int UPT, int MODE>
__device__ __forceinline__ void gemv_body(const u8* __restrict__ W, const float* __restrict__ x,
                                          const u8* __restrict__ xq, float* __restrict__ out, int rows, int cols,
                                          int row_bytes) {
    constexpr int V = gemv_vals<TY>();
    __shared__ float red[2][32][R];
    const int T = blockDim.x, t = threadIdx.x, lane = t & 31, warp = t >> 5, n_warps = T >> 5;
    const int n_units = cols / V, n_groups = (rows + R - 1) / R;
    int g = blockIdx.x;
    if (g >= n_groups) return;
    int us[UPT];
    float live[UPT];
#pragma unroll
    for (int k = 0; k < UPT; k++) {
        int u = t + k * T;
        live[k] = u < n_units ? 1.0f : 0.0f;
        us[k] = u < n_units ? u : 0;
    }
    WFrag<TY> cur[R][UPT], nxt[R][UPT];
    gemv_load_group<TY, R, UPT>(W, g, rows, row_bytes, cols, us, cur);
    // The x slice: floats (modes 0, 1) or int8 limbs (mode 2); the other form is left unused.
    float xv[UPT][MODE == 2 ? 1 : V], xs[UPT][2];
    XLimbs<TY> xl[UPT];
#pragma unroll
    for (int k = 0; k < UPT; k++) {
        if constexpr (MODE == 2)
            gemv_xq_load<TY>(xq, cols, us[k], xl[k]);
        else
            gemv_x_load<TY>(x, us[k], xv[k], xs[k]);
    }
    int buf = 0;
    for (;;) {
        int gn = g + gridDim.x;
        bool more = gn < n_groups;
        if (more) gemv_load_group<TY, R, UPT>(W, gn, rows, row_bytes, cols, us, nxt);
        float acc[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            acc[r] = 0.0f;
#pragma unroll
            for (int k = 0; k < UPT; k++) {
                float dot;
                if constexpr (MODE == 2)
                    dot = gemv_dot_q<TY>(cur[r][k], xl[k], us[k]);
                else
                    dot = gemv_dot<TY, MODE>(cur[r][k], xv[k], xs[k], us[k]);
                acc[r] = fmaf(live[k], dot, acc[r]);
            }
        }
#pragma unroll
        for (int r = 0; r < R; r++) {
            float v = warp_sum(acc[r]);
            if (lane == 0) red[buf][warp][r] = v;
        }
        __syncthreads();
        if (t < R) {
            float s = 0.0f;
            for (int w = 0; w < n_warps; w++) s += red[buf][w][t];
            int row = g * R + t;
            if (row < rows) out[row] = s;
        }
        if (!more) break;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int k = 0; k < UPT; k++) cur[r][k] = nxt[r][k];
        g = gn;
        buf ^= 1;
    }
}

// Entry points gemv_<type>_r<R>_u<UPT>_m<MODE>; MAXT bounds the block (registers per thread).
#define GEMV_ENTRY(NAME, TY, R, U, M, MAXT)                                                               \
    FOR_TYPE(TY)(extern "C" __global__ void __launch_bounds__(MAXT)                                                    \
        gemv_##NAME##_r##R##_u##U##_m##M(const u8* W, const float* x, float* out, int rows, int cols,     \
                                          int row_bytes) {                                                \
        gemv_body<TY, R, U, M>(W, x, nullptr, out, rows, cols, row_bytes);                                \
    })
// Mode 2 (the integer form) takes the pre-pass's output (gemv_x_limbs) after x.
#define GEMV_ENTRY_Q(NAME, TY, R, U, MAXT)                                                                \
    FOR_TYPE(TY)(extern "C" __global__ void __launch_bounds__(MAXT)                                                    \
        gemv_##NAME##_r##R##_u##U##_m2(const u8* W, const float* x, const u8* xq, float* out, int rows,   \
                                        int cols, int row_bytes) {                                        \
        gemv_body<TY, R, U, 2>(W, x, xq, out, rows, cols, row_bytes);                                     \
    })
#define GEMV_RU(NAME, TY, M, MAXT)        \
    GEMV_ENTRY(NAME, TY, 2, 1, M, MAXT)   \
    GEMV_ENTRY(NAME, TY, 2, 2, M, MAXT)   \
    GEMV_ENTRY(NAME, TY, 2, 4, M, MAXT)   \
    GEMV_ENTRY(NAME, TY, 4, 1, M, MAXT)   \
    GEMV_ENTRY(NAME, TY, 4, 2, M, MAXT)   \
    GEMV_ENTRY(NAME, TY, 4, 4, M, MAXT)

#if LLMDIFF_QUANT_PART != 2  // see gemv_rows.cu
GEMV_RU(f16, TY_F16, 0, 512)
GEMV_RU(bf16, TY_BF16, 0, 512)
GEMV_RU(q8_0, TY_Q8_0, 0, 512)
GEMV_RU(q4_1, TY_Q4_1, 0, 512)
GEMV_RU(q4_k, TY_Q4_K, 0, 512)
GEMV_RU(q4_k, TY_Q4_K, 1, 512)
GEMV_ENTRY(q4_k, TY_Q4_K, 6, 1, 0, 512)
GEMV_ENTRY(q4_k, TY_Q4_K, 8, 1, 0, 512)
GEMV_ENTRY_Q(q4_k, TY_Q4_K, 2, 1, 512)
GEMV_ENTRY_Q(q4_k, TY_Q4_K, 4, 1, 512)
GEMV_ENTRY_Q(q4_k, TY_Q4_K, 8, 1, 512)
GEMV_ENTRY_Q(q4_1, TY_Q4_1, 2, 2, 512)
GEMV_ENTRY_Q(q4_1, TY_Q4_1, 4, 1, 512)
GEMV_ENTRY_Q(q4_1, TY_Q4_1, 4, 2, 512)
GEMV_ENTRY_Q(q8_0, TY_Q8_0, 2, 2, 512)
GEMV_ENTRY_Q(q8_0, TY_Q8_0, 4, 1, 512)
GEMV_ENTRY_Q(q8_0, TY_Q8_0, 4, 2, 512)
#endif

