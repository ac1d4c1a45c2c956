// Part of the `quant` NVRTC module (engine/src/cuda_kernels.rs), compiled after matmul.cu and gemv.cu,
// whose type ids, decoders and helpers it uses.

// Warp-rows GEMV: a block of NW warps computes R rows (grid ⌈rows/R⌉, no grid-stride). Warp w's
// lane l takes units c + l (MODE 3: pair units of 64 values) for the 32-aligned chunks c = 32w,
// 32w + 32·NW, ... of the row, U chunks per step: the step first issues all U×R weight loads
// (quants and headers), then per chunk loads that chunk's x (from L1/L2; x is shared by the R
// rows) and does its R dots. A chunk wholly past the row's end is skipped (a warp-uniform test,
// so Q4_K's full-warp shuffles in gemv_dot stay whole); in a live chunk the lanes past the end
// use unit 0 with weight 0. Per-row partial sums stay in registers; at the end each is summed
// over the warp (warp_sum), then over the NW warps in shared memory in warp order
// (deterministic). No x slice is kept resident and nothing is double-buffered, so registers are
// few and many warps keep many loads in flight.

// The end of a warp-rows block's R rows (row0 .. row0 + R): each warp's R partial sums summed
// over the warp, then over the NW warps in warp order through `red` (NW·R floats of shared
// memory), so the result does not depend on timing; warp 0's lanes below R store the rows, each
// also passing its sum to its RoPE pair (lane ^ 1). `after_sync()` runs on every thread between
// the block barrier (every warp is done computing) and the stores (the entries pass a no-op).
template <int R, int NW, typename F>
__device__ __forceinline__ void gemvw_store(const GemvRows& m, const float (&acc)[R], float* red, int row0, int rows,
                                            F&& after_sync) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) red[warp * R + r] = v;
    }
    __syncthreads();
    after_sync();
    if (warp == 0) {
        float s = 0.0f;
        if (lane < R) {
#pragma unroll
            for (int w = 0; w < NW; w++) s += red[w * R + lane];
        }
        const float pair = __shfl_xor_sync(0xffffffffu, s, 1);
        const int row = row0 + lane;
        if (lane < R && row < rows) m.store(row, s, pair);
    }
}

template <int TY, int R, int NW, int U, int MODE>
__device__ __forceinline__ void gemvw_body(const GemvRows& m, const float* __restrict__ x, const u8* __restrict__ xq,
                                           int rows, int cols, int row_bytes) {
    constexpr int V = MODE == 3 ? 64 : gemv_vals<TY>();
    constexpr int STEP = NW * 32 * U;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_units = cols / V, row0 = blockIdx.x * R;
    TRACE_BLOCK(TRACE_GEMVW);
    griddep_launch();  // the norm, SwiGLU or attention after it may be launched early (PDL)
    const u8* rp[R];
#pragma unroll
    for (int r = 0; r < R; r++) rp[r] = m.weight(min(row0 + r, rows - 1), row_bytes);
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.0f;
    for (int c0 = warp * 32; c0 < n_units; c0 += STEP) {
        WFrag<TY, V> f[U][R];
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int c = c0 + k * NW * 32;
            if (c < n_units) {
                const int u = c + lane < n_units ? c + lane : 0;
#pragma unroll
                for (int r = 0; r < R; r++) gemv_load<TY>(rp[r], u, cols, f[k][r]);
            }
        }
        // Launched early (PDL): the first weights are in flight before x (the previous kernel's
        // output) is read. A warp with no chunk reads and writes no global memory.
        if (c0 == warp * 32) griddep_wait();
#pragma unroll
        for (int k = 0; k < U; k++) {
            const int c = c0 + k * NW * 32;
            if (c < n_units) {
                const bool in = c + lane < n_units;
                const int u = in ? c + lane : 0;
                const float live = in ? 1.0f : 0.0f;
                if constexpr (MODE >= 2) {
                    XLimbs<TY, V> q;
                    gemv_xq_load<TY>(xq, cols, u, q);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r] = fmaf(live, gemv_dot_q<TY>(f[k][r], q, u), acc[r]);
                } else {
                    float xv[V], xs[2];
                    gemv_x_load<TY>(x, u, xv, xs);
#pragma unroll
                    for (int r = 0; r < R; r++) acc[r] = fmaf(live, gemv_dot<TY, MODE>(f[k][r], xv, xs, u), acc[r]);
                }
            }
        }
    }
    __shared__ float red[NW * R];
    gemvw_store<R, NW>(m, acc, red, row0, rows, [] {});
}

// Entry points gemvw_<type>_r<R>_w<NW>_u<U>_m<MODE>, launched with NW·32 threads; the list is
// `GEMV_VARIANTS` in engine/src/cuda_kernels.rs (one line here per entry there).
// MODE 2 and 3 entries (GEMVW_ENTRY_Q) take the pre-pass's output (gemv_x_limbs) after x; MODE 3
// ones are bounded by registers (128) instead of threads (see the integer form).
#define GEMVW_ENTRY(NAME, TY, R, NW, U, M)                                                                \
    FOR_TYPE(TY)(extern "C" __global__ void __launch_bounds__(NW * 32)                                                 \
        gemvw_##NAME##_r##R##_w##NW##_u##U##_m##M(GemvRows m, const float* x, int rows, int cols,         \
                                                  int row_bytes) {                                        \
        gemvw_body<TY, R, NW, U, M>(m, x, nullptr, rows, cols, row_bytes);                                \
    })
#define GEMVW_BOUNDS_2(NW) __launch_bounds__(NW * 32)
#define GEMVW_BOUNDS_3(NW) __maxnreg__(128)
#define GEMVW_ENTRY_Q(NAME, TY, R, NW, U, M)                                                              \
    FOR_TYPE(TY)(extern "C" __global__ void GEMVW_BOUNDS_##M(NW)                                                       \
        gemvw_##NAME##_r##R##_w##NW##_u##U##_m##M(GemvRows m, const float* x, const u8* xq, int rows,     \
                                                  int cols, int row_bytes) {                              \
        gemvw_body<TY, R, NW, U, M>(m, x, xq, rows, cols, row_bytes);                                     \
    })

// A type's module is built twice (LLMDIFF_QUANT_PART 1: matmul.cu's and gemv.cu's entry points;
// 2: the warp-rows ones below, for the types that have them), so the two halves of the largest
// module (Q4_K) compile in parallel; undefined: all.
#if LLMDIFF_QUANT_PART != 1
GEMVW_ENTRY(q4_k, TY_Q4_K, 1, 4, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 1, 4, 4, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 2, 2, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 2, 4, 1, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 2, 4, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 2, 4, 4, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 2, 1, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 2, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 4, 1, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 4, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 8, 2, 1, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 8, 4, 1, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 8, 4, 2, 0)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 4, 1, 1)
GEMVW_ENTRY(q4_k, TY_Q4_K, 4, 4, 2, 1)
GEMVW_ENTRY(q4_k, TY_Q4_K, 8, 4, 1, 1)
GEMVW_ENTRY(q4_1, TY_Q4_1, 1, 4, 2, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 2, 2, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 2, 2, 2, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 2, 4, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 2, 4, 2, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 2, 4, 4, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 4, 2, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 4, 2, 2, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 4, 4, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 4, 4, 2, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 4, 4, 4, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 8, 2, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 8, 4, 1, 0)
GEMVW_ENTRY(q4_1, TY_Q4_1, 8, 4, 2, 0)
GEMVW_ENTRY(q8_0, TY_Q8_0, 2, 4, 2, 0)
GEMVW_ENTRY(q8_0, TY_Q8_0, 4, 4, 1, 0)
GEMVW_ENTRY(q8_0, TY_Q8_0, 4, 4, 2, 0)
GEMVW_ENTRY(q8_0, TY_Q8_0, 8, 4, 1, 0)
GEMVW_ENTRY(f16, TY_F16, 1, 4, 2, 0)
GEMVW_ENTRY(f16, TY_F16, 2, 4, 1, 0)
GEMVW_ENTRY(f16, TY_F16, 2, 4, 2, 0)
GEMVW_ENTRY(bf16, TY_BF16, 2, 4, 1, 0)
GEMVW_ENTRY(bf16, TY_BF16, 2, 4, 2, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 2, 4, 1, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 2, 4, 2, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 4, 2, 1, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 4, 4, 1, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 4, 4, 2, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 8, 2, 1, 0)
GEMVW_ENTRY(q6_k, TY_Q6_K, 8, 4, 1, 0)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 2, 4, 2, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 4, 1, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 4, 2, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 2, 1, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 4, 1, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 4, 2, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 1, 4, 2, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 2, 4, 1, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 4, 4, 1, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 4, 4, 2, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 8, 4, 1, 2)
GEMVW_ENTRY_Q(q4_1, TY_Q4_1, 8, 4, 2, 2)
GEMVW_ENTRY_Q(q8_0, TY_Q8_0, 4, 4, 1, 2)
GEMVW_ENTRY_Q(q8_0, TY_Q8_0, 4, 4, 2, 2)
GEMVW_ENTRY_Q(q8_0, TY_Q8_0, 8, 4, 1, 2)
GEMVW_ENTRY_Q(q8_0, TY_Q8_0, 8, 4, 2, 2)
GEMVW_ENTRY_Q(q6_k, TY_Q6_K, 2, 4, 1, 2)
GEMVW_ENTRY_Q(q6_k, TY_Q6_K, 4, 2, 1, 2)
GEMVW_ENTRY_Q(q6_k, TY_Q6_K, 4, 4, 1, 2)
GEMVW_ENTRY_Q(q6_k, TY_Q6_K, 8, 2, 1, 2)
GEMVW_ENTRY_Q(q6_k, TY_Q6_K, 8, 4, 1, 2)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 2, 1, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 2, 2, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 2, 4, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 2, 7, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 1, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 2, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 4, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 4, 7, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 1, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 2, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 4, 1, 3)
GEMVW_ENTRY_Q(q4_k, TY_Q4_K, 8, 7, 1, 3)

// A bound for the Q4_K GEMV, not a product (`kernels --bench`): the loads of warp-rows
// gemvw_q4_k_r8_w4_u1_m2 (the default's, but NW 2 in launches of 8192+ rows) with no arithmetic
// but an XOR of the words, so its time is what that access pattern costs on its own: `pattern` 0
// the weights' loads, 1 those and x's limb loads (gemv_xq_load, from `xq`), 2 the same weight
// bytes read as one stream (four independent 16-byte loads a thread a step, grid-stride). One
// word per warp goes to `out` (4 per block) so the loads are kept. Launched with PDL as the GEMVs
// are, so back-to-back launches overlap as theirs do. Q4_K device layout, cols % 256 == 0; grid
// ⌈rows/8⌉ blocks of 128 threads.
#if LLMDIFF_TY_8  // TY_Q4_K: in the Q4_K module
extern "C" __global__ void __launch_bounds__(128) gemv_read_probe(const u8* __restrict__ W, const u8* __restrict__ xq,
                                                                   int rows, int cols, int row_bytes, int pattern,
                                                                   u32* __restrict__ out) {
    griddep_launch();  // launched as the GEMVs are (PDL): the next probe may start early
    u32 acc = 0;
    if (pattern == 2) {
        const size_t n16 = (size_t)rows * row_bytes / 16, stride = (size_t)gridDim.x * blockDim.x;
        for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += 4 * stride) {
            uint4 v[4];
#pragma unroll
            for (int k = 0; k < 4; k++) v[k] = i + k * stride < n16 ? ldg16(W + 16 * (i + k * stride)) : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (int k = 0; k < 4; k++) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
        }
    } else {
        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_units = cols / 32, row0 = blockIdx.x * 8;
        for (int c0 = warp * 32; c0 < n_units; c0 += 4 * 32) {
            const int u = c0 + lane < n_units ? c0 + lane : 0;
            WFrag<TY_Q4_K> f[8];
#pragma unroll
            for (int r = 0; r < 8; r++) gemv_load<TY_Q4_K>(W + (size_t)min(row0 + r, rows - 1) * row_bytes, u, cols, f[r]);
            if (pattern == 1) {
                XLimbs<TY_Q4_K> q;
                gemv_xq_load<TY_Q4_K>(xq, cols, u, q);
#pragma unroll
                for (int l = 0; l < 3; l++)
#pragma unroll
                    for (int k = 0; k < 8; k++) acc ^= q.l[l][k];
                acc ^= __float_as_uint(q.s[0] + q.s[1] + q.xs[0] + q.xs[1]);
            }
#pragma unroll
            for (int r = 0; r < 8; r++) acc ^= f[r].a.x ^ f[r].a.y ^ f[r].a.z ^ f[r].a.w ^ f[r].h.x;
        }
    }
    acc = __reduce_xor_sync(0xffffffffu, acc);
    griddep_wait();  // the launch before it has stored (`out` is shared)
    if ((threadIdx.x & 31) == 0) out[blockIdx.x * 4 + (threadIdx.x >> 5)] = acc;
}
#endif
#endif  // LLMDIFF_QUANT_PART != 1
