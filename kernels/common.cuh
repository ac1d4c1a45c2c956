// Shared helpers for llmdiff's NVRTC kernels: no CUDA headers needed (NVRTC has no libc), so
// fixed-width types, f16/bf16 decoding and the GEMVs' `GemvRows` are here. Prepended to every kernel
// module by engine::cuda_kernels before compilation.

// Per-type modules. The quantized products (matmul.cu, gemv.cu, gemv_rows.cu) and the prefill
// GEMM (gemm.cu) are compiled once per weight type, each build keeping only that type's entry
// points: the host passes -DLLMDIFF_TY_<id>=1 for the type (ids are the TY_* of matmul.cu), and an
// entry macro wraps its body in FOR_TYPE(TY)(...), which keeps the body where LLMDIFF_TY_<TY> is
// 1 and drops it where it is 0. Templates no entry instantiates cost NVRTC next to nothing, so a
// type's module compiles only its own kernels (see kernels/README.md, "Modules").
#define LLMDIFF_CAT_(a, b) a##b
#define LLMDIFF_CAT(a, b) LLMDIFF_CAT_(a, b)
#define LLMDIFF_KEEP_1(...) __VA_ARGS__
#define LLMDIFF_KEEP_0(...)
#define FOR_TYPE(TY) LLMDIFF_CAT(LLMDIFF_KEEP_, LLMDIFF_CAT(LLMDIFF_TY_, TY))
#ifndef LLMDIFF_TY_0
#define LLMDIFF_TY_0 0
#endif
#ifndef LLMDIFF_TY_1
#define LLMDIFF_TY_1 0
#endif
#ifndef LLMDIFF_TY_2
#define LLMDIFF_TY_2 0
#endif
#ifndef LLMDIFF_TY_3
#define LLMDIFF_TY_3 0
#endif
#ifndef LLMDIFF_TY_4
#define LLMDIFF_TY_4 0
#endif
#ifndef LLMDIFF_TY_5
#define LLMDIFF_TY_5 0
#endif
#ifndef LLMDIFF_TY_6
#define LLMDIFF_TY_6 0
#endif
#ifndef LLMDIFF_TY_7
#define LLMDIFF_TY_7 0
#endif
#ifndef LLMDIFF_TY_8
#define LLMDIFF_TY_8 0
#endif
#ifndef LLMDIFF_TY_9
#define LLMDIFF_TY_9 0
#endif
#ifndef LLMDIFF_TY_10
#define LLMDIFF_TY_10 0
#endif
#ifndef LLMDIFF_TY_11
#define LLMDIFF_TY_11 0
#endif
#ifndef LLMDIFF_TY_12
#define LLMDIFF_TY_12 0
#endif
#ifndef LLMDIFF_TY_13
#define LLMDIFF_TY_13 0
#endif

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// IEEE half (as stored in ggml blocks) to float, via the hardware conversion.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
}

// Unaligned little-endian 16-bit load (ggml blocks of 18, 34 or 210 bytes are only 2-byte aligned,
// and some not even that inside a row).
__device__ __forceinline__ u16 ld16(const u8* p) { return (u16)p[0] | ((u16)p[1] << 8); }

// 32-bit load at a 2-byte aligned address.
__device__ __forceinline__ u32 ld32(const u8* p) { return (u32)ld16(p) | ((u32)ld16(p + 2) << 16); }

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets it.
__device__ float block_sum(float v, float* scratch /* 32 floats */) {
    v = warp_sum(v);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int n_warps = blockDim.x >> 5;
    float t = lane < n_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ double block_sum_f64(double v, double* scratch /* 32 doubles */) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int n_warps = blockDim.x >> 5;
    double t = lane < n_warps ? scratch[lane] : 0.0;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

__device__ float block_max(float v, float* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int n_warps = blockDim.x >> 5;
    float t = lane < n_warps ? scratch[lane] : -__int_as_float(0x7f800000);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, o));
    return t;
}

// Asynchronous global→shared copies (sm_80+): a copy of 16 bytes (cached in L2 only), a commit
// closing the thread's group of copies so far, and a wait until at most N of its groups are
// still in flight. All are compiler memory barriers, so shared-memory reads stay between the
// wait and the next copy into the same place.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async16s(u32 dst, const void* src) {  // dst: a shared address
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) { cp_async16s(smem_addr(dst), src); }
// 4 bytes (both addresses 4-byte aligned; cached in L1 and L2: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// The output rows of a one-token GEMV (gemv_rows.cu's warp-rows): up
// to three matrices of the same type and columns that share x (a layer's q/k/v, or gate/up) in
// one launch, their rows numbered one after the other: matrix 0 has rows [0, end0), matrix 1
// [end0, end1), matrix 2 [end1, rows). A single product is end0 = end1 = rows; the unused
// pointers are null and never touched.
// Programmatic dependent launch (sm_90; `CudaBackend::launch_pdl`): a kernel so launched may start
// while the kernel before it on the stream still runs. griddep_wait() returns once that kernel has
// completed and its writes are visible (at once for a plain launch), so before it such a kernel
// reads nothing an earlier kernel wrote (only weights) and writes nothing. griddep_launch() lets
// the next kernel, if so launched, start before this one ends.
//
// Kernel trace (`llmdiff bench --trace`; compiled in only with -DLLMDIFF_TRACE, see
// engine/src/cuda/trace.rs): thread 0 of each block of a kernel that opens with TRACE_BLOCK(tag)
// records the block's start, its griddep_wait's return (0: it never waited) and its end
// (%globaltimer, ns), then tag | SM << 8 | block << 16 | grid << 40, as 4 u64 words at the slot
// it took from llmdiff_trace_n at its start (past llmdiff_trace_cap nothing is written; the count still
// grows, so the host sees the overflow). The slot's atomic is issued at the start and its
// result used only at the end, so a traced block waits for no round trip of its own.
#ifdef LLMDIFF_TRACE
__device__ u64* llmdiff_trace_rec;
__device__ u32* llmdiff_trace_n;
__device__ u32 llmdiff_trace_cap;
__shared__ u64 llmdiff_trace_wait;
__device__ __forceinline__ u64 trace_now() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// A traced block's record (start, the wait's return or a mark, end), written by thread 0 at the
// block's end into the slot it took at its start, so no block waits for a round trip of its own.
__device__ __forceinline__ void trace_span(u32 slot, u32 tag, u64 t0, u64 tm, u64 t1) {
    if (threadIdx.x == 0 && slot < llmdiff_trace_cap) {
        u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        u64* r = llmdiff_trace_rec + 4 * (size_t)slot;
        r[0] = t0;
        r[1] = tm;
        r[2] = t1;
        r[3] = (u64)(tag & 0xff) | ((u64)(sm & 0xff) << 8) | ((u64)(blockIdx.x & 0xffffff) << 16) |
               ((u64)(gridDim.x & 0xffffff) << 40);
    }
}
struct TraceBlock {
    u64 t0;
    u32 slot, tag;
    __device__ __forceinline__ explicit TraceBlock(u32 tag_) : t0(0), slot(0xffffffffu), tag(tag_) {
        if (threadIdx.x == 0) {
            t0 = trace_now();
            llmdiff_trace_wait = 0;
            slot = atomicAdd(llmdiff_trace_n, 1u);
        }
    }
    __device__ __forceinline__ ~TraceBlock() { trace_span(slot, tag, t0, llmdiff_trace_wait, trace_now()); }
};
#define TRACE_BLOCK(tag) TraceBlock trace_block_(tag)
#define TRACE_NOW() trace_now()
#define TRACE_CLOCK() ((u64)clock64())
#define TRACE_WAIT()                                         \
    do {                                                     \
        if (threadIdx.x == 0) llmdiff_trace_wait = trace_now(); \
    } while (0)
#else
#define TRACE_BLOCK(tag)
#define TRACE_NOW() 0ull
#define TRACE_CLOCK() 0ull
#define TRACE_WAIT() \
    do {             \
    } while (0)
#endif
// Trace tags (engine/src/cuda/trace.rs `TRACE_TAGS` names them; 2, 3 and 10 on are retired).
#define TRACE_GEMVW 1
#define TRACE_ATTN_SPLIT 4
#define TRACE_RMS_NORM 5
#define TRACE_ADD_RMS_NORM 6
#define TRACE_SWIGLU 7
#define TRACE_X_LIMBS 8
#define TRACE_GATHER 9
__device__ __forceinline__ void griddep_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    TRACE_WAIT();
}
__device__ __forceinline__ void griddep_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// 16, 8, 4 or 2 bytes of weights (never written during a run) through the read-only path, not kept in
// L1 (L1::no_allocate): a weight byte is read once per launch, and the lines it would take are
// those of x's limbs, which every row of the block rereads (8B decode −1.3 %).
__device__ __forceinline__ uint4 ldg16(const u8* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ uint2 ldg8(const u8* p) {
    uint2 v;
    asm("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg4(const u8* p) {
    u32 v;
    asm("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 ldg2(const u8* p) {
    u16 v;
    asm("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// 16, 8 or 4 bytes of another kernel's output (a GEMV's x or x limbs): coherent loads (not the
// read-only .nc path: under PDL the writer may still be running when this kernel starts), volatile
// so that they stay after griddep_wait.
__device__ __forceinline__ uint4 ldx16(const void* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint2 ldx8(const void* p) {
    uint2 v;
    asm volatile("ld.global.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float ldx4f(const void* p) {
    float v;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ float4 ldx16f(const void* p) {
    const uint4 v = ldx16(p);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
}
__device__ __forceinline__ float2 ldx8f(const void* p) {
    const uint2 v = ldx8(p);
    return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

// SwiGLU's product silu(g)·u (ops.cu's swiglu kernels).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// RoPE's rotation of the pair (x0, x1) by the angle of cosine c and sine s, each operation rounded
// (no FMA contraction, as the CPU engine's f32): rope_qk and a GEMV's q/k store give the same bits.
__device__ __forceinline__ void rope_rot(float x0, float x1, float c, float s, float& y0, float& y1) {
    y0 = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    y1 = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

struct GemvRows {
    const u8 *w0, *w1, *w2;
    float *out0, *out1, *out2;
    int end0, end1;
    // A one-row q/k/v launch's store (cs null: plain stores; see store): NORM RoPE on the rows
    // below end1 (q, then k) by the angles cs[i] of pair i, each head of head_dim rows rotating
    // its first rope_dim; the rows from end0 on (k, then v) also appended to the caches kc
    // [T, end1 - end0] and vc [T, rows - end1] at row *pos_dev (a recording) or kv_row.
    const float2* cs;
    float *kc, *vc;
    const int* pos_dev;
    int head_dim, rope_dim, kv_row, rows;
    // Row `row`'s weight row (of row_bytes) and output slot; selects, not an indexed array, so the
    // parameter block is never copied to local memory.
    __device__ __forceinline__ const u8* weight(int row, int row_bytes) const {
        const u8* base = row < end0 ? w0 : row < end1 ? w1 : w2;
        return base + (size_t)(row - (row < end0 ? 0 : row < end1 ? end0 : end1)) * row_bytes;
    }
    __device__ __forceinline__ float* slot(int row) const {
        float* base = row < end0 ? out0 : row < end1 ? out1 : out2;
        return base + (row - (row < end0 ? 0 : row < end1 ? end0 : end1));
    }
    // Stores row `row`'s sum s; `pair` is row (row ^ 1)'s (the same block's: R, end0 and end1
    // even when cs is set and the launch has q or k rows), the other half of its RoPE pair.
    __device__ __forceinline__ void store(int row, float s, float pair) const {
        const int local = row - (row < end0 ? 0 : row < end1 ? end0 : end1);
        float v = s, other;
        if (cs && row < end1) {
            const int d = local % head_dim;
            if (d < rope_dim) {
                const float2 a = cs[d >> 1];
                if (d & 1)
                    rope_rot(pair, s, a.x, a.y, other, v);
                else
                    rope_rot(s, pair, a.x, a.y, v, other);
            }
        }
        *slot(row) = v;
        if (cs && row >= end0) {
            const size_t at = (size_t)(pos_dev ? *pos_dev : kv_row);
            if (row < end1)
                kc[at * (end1 - end0) + local] = v;
            else
                vc[at * (rows - end1) + local] = v;
        }
    }
};

// (Shared by the GEMVs of gemv.cu and gemv_rows.cu.)
#define GEMV_MAGIC 0x4B000000u  // 2^23: an integer below 2^23 in the mantissa is exact

// Byte b (0..3) of w as an exact float (w's bytes are unsigned), minus `bias`.
template <int B>
__device__ __forceinline__ float byte_f(u32 w, float bias) {
    return __int_as_float(__byte_perm(w, GEMV_MAGIC, 0x7440u + B)) - bias;
}

// (The integer GEMV's, gemv.cu.) The 6-bit scales and mins of sub-blocks 2j and 2j+1 (ggml's get_scale_min_k4) from a Q4_K
// super-block header's words h1 .. h3 (its 12 scale bytes q[0..12)), as the bytes sc0, sc1, m0, m1
// of one word: for j < 2 the low 6 bits of q[2j], q[2j+1] (in h1) and q[2j+4], q[2j+5] (h2); for
// j ≥ 2 the low (scales) and high (mins) nibbles of q[2j+4], q[2j+5] (h3) under the top 2 bits of
// q[2j−4], q[2j−3] (h1, scales) and q[2j], q[2j+1] (h2, mins). Branch-free: j is fixed per lane.
__device__ __forceinline__ u32 q4k_sm(u32 h1, u32 h2, u32 h3, int j) {
    const bool hi = j >= 2;
    const u32 sel = (j & 1) ? 0x7632u : 0x5410u;  // bytes 2(j%2), 2(j%2) + 1 of a word, then of the next
    const u32 t = __byte_perm(h1, h2, sel);
    const u32 n = hi ? __byte_perm(h3, h3 >> 4, sel) : t;
    return (n & 0x0F0F0F0Fu) | ((t >> (hi ? 2 : 0)) & 0x30303030u);
}

// The integer GEMV's x limbs (see the integer form in gemv.cu): for the float4 `v` = x values
// 4·i4 .. 4·i4 + 4 of a row of `cols` (cols % 32 == 0), writes their three int8 limbs to the limb
// planes of `xq`, and (one lane of each group) the 32-value block's scale and the 8-value sums.
// Eight neighbouring lanes (8g .. 8g + 7) hold one 32-value block, so the whole warp must call it
// with i4 = (its first value)/4 + lane; lanes with live = false (past the row, whole groups of
// 8) take part in the shuffles and write nothing.
__device__ __forceinline__ void x_limbs4(float4 v, int i4, u8* __restrict__ xq, int cols, bool live) {
    const int lane = threadIdx.x & 31;
    const float e4[4] = {v.x, v.y, v.z, v.w};
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    bool bad = !(isfinite(v.x) && isfinite(v.y) && isfinite(v.z) && isfinite(v.w));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        bad |= __shfl_xor_sync(0xffffffffu, (int)bad, o) != 0;
    }
    u32 w0 = 0, w1 = 0, w2 = 0;
    float s = bad ? __int_as_float(0x7fc00000) : 0.0f;
    const u32 mb = __float_as_uint(m);
    if (!bad && mb >= 0x07800000u && mb < 0x7E800000u) {
        // m in [2^-112, 2^126): e = m's exponent + 1 in [-111, 126], so 2^-e and 2^(e-14) are
        // normal floats and a product with them is ldexpf's correctly rounded result; each
        // rint is y + 1.5·2^23 (round to nearest even at ulp 1, |y| <= 128), whose low mantissa
        // byte is the limb's two's-complement byte. The same values as the general path below
        // (8B decode −2 %, logits bitwise equal).
        const int e = (int)(mb >> 23) - 126;
        const float mant = __uint_as_float((mb & 0x007FFFFFu) | 0x3F000000u), k = 127.0f / mant;
        const float p = __uint_as_float((u32)(127 - e) << 23), rnd = 12582912.0f;
        u32 b0[4], b1[4], b2[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float y = __fmul_rn(e4[j] * p, k);  // rounded before + rnd (no FMA)
            const float f0 = y + rnd, r0 = f0 - rnd, t = (y - r0) * 128.0f;
            const float f1 = t + rnd, r1 = f1 - rnd, f2 = (t - r1) * 128.0f + rnd;
            b0[j] = __float_as_uint(f0);
            b1[j] = __float_as_uint(f1);
            b2[j] = __float_as_uint(f2);
        }
        w0 = __byte_perm(__byte_perm(b0[0], b0[1], 0x0040u), __byte_perm(b0[2], b0[3], 0x0040u), 0x5410u);
        w1 = __byte_perm(__byte_perm(b1[0], b1[1], 0x0040u), __byte_perm(b1[2], b1[3], 0x0040u), 0x5410u);
        w2 = __byte_perm(__byte_perm(b2[0], b2[1], 0x0040u), __byte_perm(b2[2], b2[3], 0x0040u), 0x5410u);
        s = (mant / 127.0f) * __uint_as_float((u32)(e + 113) << 23);
    } else if (!bad && m > 0.0f) {  // m outside that range: the general arithmetic
        int e;
        const float mant = frexpf(m, &e), k = 127.0f / mant;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const float y = ldexpf(e4[j], -e) * k;
            const float r0 = rintf(y), t = (y - r0) * 128.0f, r1 = rintf(t), r2 = rintf((t - r1) * 128.0f);
            w0 |= ((u32)(int)r0 & 0xFFu) << (8 * j);
            w1 |= ((u32)(int)r1 & 0xFFu) << (8 * j);
            w2 |= ((u32)(int)r2 & 0xFFu) << (8 * j);
        }
        s = ldexpf(mant / 127.0f, e - 14);
    }
    // Σx per 8 values: this lane's four, then its neighbour's (lanes 2h, 2h + 1), fixed order.
    float a = (v.x + v.y) + (v.z + v.w);
    a += __shfl_xor_sync(0xffffffffu, a, 1);
    if (!live) return;
    u32* planes = (u32*)xq;
    planes[i4] = w0;
    planes[cols / 4 + i4] = w1;
    planes[cols / 2 + i4] = w2;
    float* sc = (float*)(xq + 3 * (size_t)cols);
    if ((lane & 7) == 0) sc[i4 / 8] = s;
    if ((lane & 1) == 0) sc[cols / 32 + i4 / 2] = a;
}

// ---------------------------------------------------------------------------------------------
// Pieces of the split (flash-decoding) GQA attention, shared by attention.cu's `gqa_split_*`
// (whose comment describes the scheme): a warp
// holds AS_PPW positions' K and V rows (float4 columns lane + 32·c, c < CW) in registers.
#define AS_PPW 4

__device__ __forceinline__ float4 as_fma4(float a, float4 b, float4 c) {
    return make_float4(fmaf(a, b.x, c.x), fmaf(a, b.y, c.y), fmaf(a, b.z, c.z), fmaf(a, b.w, c.w));
}

__device__ __forceinline__ float4 as_add4(float4 a, float4 b) {
    return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

__device__ __forceinline__ float as_warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double as_warp_sum64(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// The scores of a chunk's positions j0 + p·(warps) + w (the warp's K rows in kr) for the G heads:
// es[h·L + i] = dot(q_h, k)·scale (the lane's columns by fmaf, then a warp butterfly), −inf past
// n_ctx.
template <int CW>
__device__ __forceinline__ void as_scores(const float* qs, const float4 (&kr)[AS_PPW][CW], float* es, int G, int hd4,
                                          int L, int nw, int w, int lane, int j0, int n_ctx, float scale) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int h = 0; h < G; h++) {
        float4 qv[CW];
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + 32 * c;
            qv[c] = col < hd4 ? ((const float4*)qs)[h * hd4 + col] : zero;
        }
#pragma unroll
        for (int p = 0; p < AS_PPW; p++) {
            float s = 0.0f;
#pragma unroll
            for (int c = 0; c < CW; c++) {
                s = fmaf(qv[c].x, kr[p][c].x, s);
                s = fmaf(qv[c].y, kr[p][c].y, s);
                s = fmaf(qv[c].z, kr[p][c].z, s);
                s = fmaf(qv[c].w, kr[p][c].w, s);
            }
            s = warp_sum(s);
            if (lane == 0) es[h * L + p * nw + w] = j0 + p * nw + w < n_ctx ? s * scale : NEG_INF;
        }
    }
}

// Row pos0 of K and V (the q/k/v GEMV before this kernel appends it), by coherent loads after
// griddep_wait, into the registers of the warp that holds it in the chunk at j0 (as as_rows).
template <int CW>
__device__ __forceinline__ void as_own_row(const float* __restrict__ k, const float* __restrict__ v,
                                           float4 (&kr)[AS_PPW][CW], float4 (&vr)[AS_PPW][CW], int j0, int nw, int w,
                                           int lane, int pos0, int kvw, int kvh, int hd) {
    const int hd4 = hd >> 2;
#pragma unroll
    for (int p = 0; p < AS_PPW; p++) {
        if (j0 + p * nw + w != pos0) continue;
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + 32 * c;
            if (col < hd4) {
                const size_t off = (size_t)pos0 * kvw + (size_t)kvh * hd + 4 * col;
                kr[p][c] = ldx16f(k + off);
                vr[p][c] = ldx16f(v + off);
            }
        }
    }
}

// The warp's share of the partial rows of heads h0 .. h0 + nh: Σ e_j·v_j over its positions (in
// order), to red4[(w·nh + hh)·hd/4 + column].
template <int CW>
__device__ __forceinline__ void as_warp_rows(const float* es, const float4 (&vr)[AS_PPW][CW], float4* red4, int h0,
                                             int nh, int L, int nw, int w, int lane, int hd4) {
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int hh = 0; hh < nh; hh++) {
        const int h = h0 + hh;
        float4 acc[CW];
#pragma unroll
        for (int c = 0; c < CW; c++) acc[c] = zero;
#pragma unroll
        for (int p = 0; p < AS_PPW; p++) {
            const float e = es[h * L + p * nw + w];
#pragma unroll
            for (int c = 0; c < CW; c++) acc[c] = as_fma4(e, vr[p][c], acc[c]);
        }
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + 32 * c;
            if (col < hd4) red4[(w * nh + hh) * hd4 + col] = acc[c];
        }
    }
}

// The split kernels' partials in `part` for N = s_cap·KV·G (layout above): Σe (f64), the maxima
// and the partial rows.
struct AsPart {
    double* s;
    float* m;
    float* o;
    __device__ __forceinline__ AsPart(float* part, int s_cap, int KV, int G) {
        const size_t N = (size_t)s_cap * KV * G;
        s = (double*)part;
        m = part + 2 * N;
        o = part + ((3 * N + 3) & ~(size_t)3);
    }
};

// A chunk's max and Σ exp per head (a warp per head, warps w, w + nw, ...) over its L scores in
// es, replaced by their exps: m = max (fmaxf, so NaN scores do not set it), e = expf(s − m) (m =
// −inf: expf(s)), the sum in f64 (lane-strided, then a butterfly); m and the sum go to the
// partials of `slot`.
__device__ __forceinline__ void as_softmax(float* es, const AsPart& pt, size_t slot, int G, int L, int nw, int w,
                                           int lane) {
    const float NEG_INF = -__int_as_float(0x7f800000);
    for (int h = w; h < G; h += nw) {
        float m = NEG_INF;
        for (int i = lane; i < L; i += 32) m = fmaxf(m, es[h * L + i]);
        m = as_warp_max(m);
        const float ms = m == NEG_INF ? 0.0f : m;
        double sum = 0.0;
        for (int i = lane; i < L; i += 32) {
            const float e = expf(es[h * L + i] - ms);
            es[h * L + i] = e;
            sum += (double)e;
        }
        sum = as_warp_sum64(sum);
        if (lane == 0) {
            pt.m[slot * G + h] = m;
            pt.s[slot * G + h] = sum;
        }
    }
}
