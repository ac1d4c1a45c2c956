// Causal attention over a KV cache. Three forms:
//
// Two NVRTC modules (about equal compile times): LLMDIFF_ATTN_PART 1 builds the per-(token, head)
// and split entry points, 2 the tiled ones (undefined: all).
//
// - `gqa_attention`, `gqa_attention_dpos`, `mla_attention`, `mla_attention_sparse` (MLA over each
//   query's selected keys, DSA): one block per (token, query head) of
//   256 threads, or 1024 when there are fewer blocks than SMs (decode; see `attn_threads` in
//   crate::cuda): scores in shared memory, max-subtracted softmax with the sum in f64, then the
//   weighted sum of V. Serve MLA, and GQA where the split kernel below does not take it (off with
//   `LLMDIFF_CUDA_DISABLE=attn-split`, or a shape it does not take: head_dim not a multiple of 4 or over
//   256, more than 16 query heads per KV head) in decode (n = 1) and the captured decode graph
//   (`*_dpos`), and short prefill chunks; row t
//   of the new tokens sees positions 0 ..= pos0 + t. `gqa_attention_masked` is the GQA form with
//   gemma's sliding window and score soft-cap (op by op only). Dynamic shared memory: (q width + pos0 + n
//   + G·out width) floats, G = max(1, blockDim / out width) (see attn_weighted_sum).
//   Memory-level parallelism matters more than arithmetic here (a decode step reads the whole
//   cache once): each thread's score reads its key row as float4 where the rows are 16-byte
//   aligned, and the weighted sum splits the positions over G thread groups (each walking its
//   positions eight at a time, independent accumulators), then adds the G partial rows in order.
//
// - `gqa_attn_tiled_<HD>` (HD = 64, 128, 256: the largest head_dim it takes): GQA prefill (n > 1,
//   not recorded; selection in engine/src/cuda/attn.rs, `LLMDIFF_CUDA_DISABLE=attn-tiled` turns it off),
//   flash-attention style on CUDA cores in f32: a block per 64 (token, query head) rows of one KV
//   head, K/V tiles staged once for the group's query heads, an online softmax. See the comment
//   above gqa_tiled.
//
// - `gqa_split_<HD>` and `gqa_split_<HD>_dpos` (HD = 128, 256): GQA decode (n = 1), op by op and
//   recorded, split over the context (flash-decoding): a block per (chunk of L = 16, 32 or 64
//   positions, KV head) holds the chunk's K/V rows in registers for the group's query heads and
//   writes their partial softmax (max, Σexp in f64, Σexp·v). `gqa_split_runs_<HD>[_dpos]`, for
//   caches of more chunks than the grid's cap, give each block a run of chunks, loading the next
//   chunk's rows while it computes one. The last block of each KV head to
//   finish combines the chunks in a fixed order (so the result does not depend on which block
//   that is) and writes the output row and, for the o-projection's integer GEMV, its int8 limbs
//   (x_limbs4). At the 8B shape (8 KV heads) and L = 32 a 512-token context is 128 blocks where
//   the per-(token, head) kernel had 32. Selection and scratch in engine/src/cuda/attn.rs; see the
//   comment above gqa_split.

// dot(q, k[0..len)) with four accumulators; float4 loads when `vec`.
__device__ __forceinline__ float attn_dot(const float* qs, const float* kr, int len, bool vec) {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int i = 0;
    if (vec) {
        for (; i + 4 <= len; i += 4) {
            float4 kv = *(const float4*)(kr + i);
            s0 = fmaf(qs[i], kv.x, s0);
            s1 = fmaf(qs[i + 1], kv.y, s1);
            s2 = fmaf(qs[i + 2], kv.z, s2);
            s3 = fmaf(qs[i + 3], kv.w, s3);
        }
    }
    for (; i < len; i++) s0 = fmaf(qs[i], kr[i], s0);
    return (s0 + s1) + (s2 + s3);
}

// p[0..n_ctx) = exp(p - max) normalized later: returns 1 / Σ exp (f64 sum), p holds the exps.
__device__ __forceinline__ float attn_softmax(float* p, int n_ctx, float mx_local, float* red, double* red64) {
    float mx = block_max(mx_local, red);
    double sum = 0.0;
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float e = expf(p[j] - mx);
        p[j] = e;
        sum += e;
    }
    sum = block_sum_f64(sum, red64);
    __syncthreads();
    return (float)(1.0 / sum);
}

// o[i] = inv · Σ_j p[j] · v[r_j·stride + i] for i < width, r_j = rows[j] (rows null: r_j = j, the
// causal forms; the sparse MLA's compacted key list otherwise); `part` is G·width floats of shared
// memory.
__device__ __forceinline__ void attn_weighted_sum_rows(const float* p, const int* rows, const float* __restrict__ v,
                                                       size_t stride, int width, int n_ctx, float inv, float* part,
                                                       float* o) {
#define ATTN_ROW(j) ((size_t)(rows ? rows[j] : (j)))
    int G = blockDim.x >= width ? blockDim.x / width : 1;
    for (int t = threadIdx.x; t < G * width; t += blockDim.x) {
        int g = t / width, i = t % width;
        float a[8];
#pragma unroll
        for (int u = 0; u < 8; u++) a[u] = 0.0f;
        int j = g;
        for (; j + 7 * G < n_ctx; j += 8 * G) {
#pragma unroll
            for (int u = 0; u < 8; u++) a[u] = fmaf(p[j + u * G], v[ATTN_ROW(j + u * G) * stride + i], a[u]);
        }
        for (; j < n_ctx; j += G) a[0] = fmaf(p[j], v[ATTN_ROW(j) * stride + i], a[0]);
        part[t] = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    }
#undef ATTN_ROW
    __syncthreads();
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float acc = 0.0f;
        for (int g = 0; g < G; g++) acc += part[g * width + i];
        o[i] = acc * inv;
    }
}

// attn_weighted_sum_rows over positions 0 .. n_ctx − 1.
__device__ __forceinline__ void attn_weighted_sum(const float* p, const float* __restrict__ v, size_t stride,
                                                  int width, int n_ctx, float inv, float* part, float* o) {
    attn_weighted_sum_rows(p, nullptr, v, stride, width, n_ctx, inv, part, o);
}

// GQA: q [n, H·hd], k/v [T, KV·hd]; query head h reads kv head h / (H/KV); out [n, H·hd].
__device__ __forceinline__ void gqa_attention_at(const float* __restrict__ q, const float* __restrict__ k,
                                                 const float* __restrict__ v, float* __restrict__ out, int pos0,
                                                 int n_heads, int n_kv_heads, int hd, float scale, float* red,
                                                 double* red64) {
    extern __shared__ float sm[];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int group = n_heads / n_kv_heads, kv_off = (head / group) * hd, kvw = n_kv_heads * hd;
    int n_ctx = pos0 + tok + 1;
    float* qs = sm;
    float* p = sm + hd;
    float* part = p + pos0 + (int)(gridDim.x / n_heads);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[(size_t)slot * hd + i];
    __syncthreads();
    bool vec = (hd % 4 == 0) && (kvw % 4 == 0);
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float s = attn_dot(qs, k + (size_t)j * kvw + kv_off, hd, vec) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, n_ctx, mx, red, red64);
    attn_weighted_sum(p, v + kv_off, kvw, hd, n_ctx, inv, part, out + (size_t)slot * hd);
}

#if LLMDIFF_ATTN_PART != 2  // the per-(token, head) and split kernels
extern "C" __global__ void __launch_bounds__(1024) gqa_attention(const float* __restrict__ q, const float* __restrict__ k,
                                         const float* __restrict__ v, float* __restrict__ out, int pos0, int n_heads,
                                         int n_kv_heads, int hd, float scale) {
    __shared__ float red[32];
    __shared__ double red64[32];
    gqa_attention_at(q, k, v, out, pos0, n_heads, n_kv_heads, hd, scale, red, red64);
}

// `gqa_attention` with pos0 read from device memory (*pos_dev), for a captured decode graph: its
// dynamic shared memory is sized for the cache's capacity, so any position that fits works.
extern "C" __global__ void __launch_bounds__(1024) gqa_attention_dpos(const float* __restrict__ q, const float* __restrict__ k,
                                              const float* __restrict__ v, float* __restrict__ out,
                                              const int* __restrict__ pos_dev, int n_heads, int n_kv_heads, int hd,
                                              float scale) {
    __shared__ float red[32];
    __shared__ double red64[32];
    gqa_attention_at(q, k, v, out, *pos_dev, n_heads, n_kv_heads, hd, scale, red, red64);
}

// `gqa_attention` with gemma's extras: row t reads keys max(0, n_ctx − window) .. n_ctx − 1
// (window 0: all of them, n_ctx = pos0 + t + 1), and each score is soft-capped cap·tanh(s/cap)
// after the scale (cap 0: none). Not recorded (no device-position form); the same shared memory
// as gqa_attention.
extern "C" __global__ void __launch_bounds__(1024) gqa_attention_masked(const float* __restrict__ q, const float* __restrict__ k,
                                                const float* __restrict__ v, float* __restrict__ out, int pos0,
                                                int n_heads, int n_kv_heads, int hd, float scale, int window,
                                                float softcap) {
    __shared__ float red[32];
    __shared__ double red64[32];
    extern __shared__ float masked_sm[];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int group = n_heads / n_kv_heads, kv_off = (head / group) * hd, kvw = n_kv_heads * hd;
    int n_ctx = pos0 + tok + 1;
    int first = (window > 0 && n_ctx > window) ? n_ctx - window : 0;
    int len = n_ctx - first;
    float* qs = masked_sm;
    float* p = masked_sm + hd;
    float* part = p + pos0 + (int)(gridDim.x / n_heads);
    for (int i = threadIdx.x; i < hd; i += blockDim.x) qs[i] = q[(size_t)slot * hd + i];
    __syncthreads();
    bool vec = (hd % 4 == 0) && (kvw % 4 == 0);
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < len; j += blockDim.x) {
        float s = attn_dot(qs, k + (size_t)(first + j) * kvw + kv_off, hd, vec) * scale;
        if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, len, mx, red, red64);
    attn_weighted_sum(p, v + (size_t)first * kvw + kv_off, kvw, hd, len, inv, part, out + (size_t)slot * hd);
}

// MLA over the expanded cache: q [n, H·(nope+rope)] per head [q_nope | q_pe]; k_nope [T, H·nope];
// k_pe [T, rope] shared by all heads; v [T, H·vd]; out [n, H·vd].
extern "C" __global__ void __launch_bounds__(1024) mla_attention(const float* __restrict__ q, const float* __restrict__ k_nope,
                                         const float* __restrict__ k_pe, const float* __restrict__ v,
                                         float* __restrict__ out, int pos0, int n_heads, int nope, int rope, int vd,
                                         float scale) {
    extern __shared__ float mla_sm[];
    __shared__ float red[32];
    __shared__ double red64[32];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int qw = nope + rope, kw = n_heads * nope, vw = n_heads * vd;
    int n_ctx = pos0 + tok + 1;
    float* qs = mla_sm;
    float* p = mla_sm + qw;
    float* part = p + pos0 + (int)(gridDim.x / n_heads);
    for (int i = threadIdx.x; i < qw; i += blockDim.x) qs[i] = q[(size_t)slot * qw + i];
    __syncthreads();
    bool vec_n = (nope % 4 == 0) && (kw % 4 == 0), vec_r = rope % 4 == 0;
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        float a = attn_dot(qs, k_nope + (size_t)j * kw + (size_t)head * nope, nope, vec_n);
        float b = attn_dot(qs + nope, k_pe + (size_t)j * rope, rope, vec_r);
        float s = (a + b) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, n_ctx, mx, red, red64);
    attn_weighted_sum(p, v + (size_t)head * vd, vw, vd, n_ctx, inv, part, out + (size_t)tok * vw + (size_t)head * vd);
}

// MLA over only the cache rows each query selected (DSA, the indexer's top-k; the CPU engine's
// dsa::mla_attention_sparse): `mla_attention` with row t's keys listed in keys[t·top_k ..][..top_k]
// (positions as floats, −1 padding) instead of 0 ..= pos0 + t. The block first compacts the
// list in order into shared memory (`sel`): an entry is kept where it is ≥ 0 and below `rows`,
// the rows every cache holds (padding, NaN and a position past the caches are dropped, so no
// row outside the caches is read), truncated to an integer as the CPU's `as usize`. Then scores,
// softmax (f64 sum) and the weighted sum over the kept keys, as mla_attention over positions.
// A row with no key writes zeros (the CPU's empty sum). Dynamic shared memory: (q width +
// 2·top_k + G·vd) floats: q, the scores, the kept positions (ints), the partial rows.
extern "C" __global__ void __launch_bounds__(1024) mla_attention_sparse(
    const float* __restrict__ q, const float* __restrict__ k_nope, const float* __restrict__ k_pe,
    const float* __restrict__ v, const float* __restrict__ keys, float* __restrict__ out, int top_k, int rows,
    int n_heads, int nope, int rope, int vd, float scale) {
    extern __shared__ float mla_sparse_sm[];
    __shared__ float red[32];
    __shared__ double red64[32];
    __shared__ int warp_kept[32];
    int slot = blockIdx.x, tok = slot / n_heads, head = slot % n_heads;
    int qw = nope + rope, kw = n_heads * nope, vw = n_heads * vd;
    float* qs = mla_sparse_sm;
    float* p = qs + qw;
    int* sel = (int*)(p + top_k);
    float* part = (float*)(sel + top_k);
    for (int i = threadIdx.x; i < qw; i += blockDim.x) qs[i] = q[(size_t)slot * qw + i];
    // Stable compaction of the key list: per pass of blockDim entries, a ballot per warp, the
    // warps' counts in order through shared memory.
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = blockDim.x >> 5;
    const float* kr = keys + (size_t)tok * top_k;
    int n_ctx = 0;
    for (int j0 = 0; j0 < top_k; j0 += blockDim.x) {
        int j = j0 + threadIdx.x, pos = -1;
        if (j < top_k) {
            float f = kr[j];
            if (f >= 0.0f && f < (float)rows) pos = (int)f;
        }
        unsigned kept = __ballot_sync(0xffffffffu, pos >= 0);
        if (lane == 0) warp_kept[warp] = __popc(kept);
        __syncthreads();
        int at = n_ctx, pass = 0;
        for (int w = 0; w < n_warps; w++) {
            int c = warp_kept[w];
            at += w < warp ? c : 0;
            pass += c;
        }
        if (pos >= 0) sel[at + __popc(kept & ((1u << lane) - 1u))] = pos;
        n_ctx += pass;
        __syncthreads();  // sel and qs complete; warp_kept free for the next pass
    }
    float* o = out + (size_t)tok * vw + (size_t)head * vd;
    if (n_ctx == 0) {  // block-uniform
        for (int i = threadIdx.x; i < vd; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    bool vec_n = (nope % 4 == 0) && (kw % 4 == 0), vec_r = rope % 4 == 0;
    float mx = -__int_as_float(0x7f800000);
    for (int j = threadIdx.x; j < n_ctx; j += blockDim.x) {
        size_t key = (size_t)sel[j];
        float a = attn_dot(qs, k_nope + key * kw + (size_t)head * nope, nope, vec_n);
        float b = attn_dot(qs + nope, k_pe + key * rope, rope, vec_r);
        float s = (a + b) * scale;
        p[j] = s;
        mx = fmaxf(mx, s);
    }
    float inv = attn_softmax(p, n_ctx, mx, red, red64);
    attn_weighted_sum_rows(p, sel, v + (size_t)head * vd, vw, vd, n_ctx, inv, part, o);
}
#endif

// ---------------------------------------------------------------------------------------------
// Prefill GQA attention, tiled (flash-attention's online softmax, on CUDA cores, all f32 but the
// softmax denominator).
//
// A block owns AT_R = 64 "rows" of one KV head: the rows are the (token, query head of the group)
// pairs of that KV head, numbered token-major (row = t·G + h, G = H / KV query heads per KV
// head), so the G heads that read the same K/V rows share every K/V tile the block loads. Blocks
// are numbered heaviest first (the last rows see the longest prefix), KV head fastest.
// The block stages its Q rows once, then walks the causal prefix 0 ..= pos0 + (its last token) in
// tiles of AT_BK = 32 positions: K and V rows staged in shared memory (float4 loads, a row's
// 16-byte groups on consecutive threads), S = Q·Kᵀ for the tile, the online softmax update, then
// O += P·V. Thread layout: 8 threads per row group (tx: keys tx + 8j, j < 4; output float4
// columns tx + 8c, c < CG), 32 row groups (ty: rows ty and ty + 32); a thread keeps 2×4 scores and
// 2×CG float4 of O in registers.
//
// Numerics per row (the CPU engine's softmax is max-subtracted with an f64 sum, then Σ p_j·v_j):
// s_j = dot(q, k_j)·scale in f32 (one fmaf chain over d); masked positions (j > pos0 + t) are
// -inf. Per tile: m' = max(m, tile max); α = expf(m − m') (0 on the first tile); p_j =
// expf(s_j − m'); l = l·α + Σ p_j with l and the tile's Σ in f64 (fixed order: the thread's 4,
// then a butterfly over its 8 lanes); O = O·α + Σ p_j·v_j in f32 (positions in order within a
// thread's columns). At the end out = O · (float)(1 / l). The sum stays f64 as in the other
// kernels: it costs one f64 add per score beside 2·hd f32 FMAs, and keeps the denominator's
// rounding from growing with the context; l and O are scaled by the same f32 α, so the ratio
// does not see α's rounding. Every tile of every row has a finite m' (position 0 is in the
// first tile and is never masked), so no inf − inf.
// Deterministic (fixed order everywhere, no atomics). Every element of `out` of a row < n·G and
// d < hd is written; rows past n·G (the last block's tail) compute on zero q and are not stored.
//
// Shared memory (floats): Q AT_R × QS, K AT_BK × QS, V AT_BK × HD4, P AT_R × AT_PS, where HD4 =
// hd rounded up to 4 (zero-padded) and QS = HD4, plus 4 when HD4/4 is even (an odd number of
// float4s per row: the 8 key threads' float4 reads of 8 different K rows hit distinct banks).
// hd = 128: 19072 floats (76.3 KB; with 128 registers a thread, 2 blocks per SM on an H200). The
// host computes the same (`attn_tiled_smem` in crate::cuda's attn submodule, cuda/attn.rs).

#define AT_BK 32
#define AT_NX 8
#define AT_TK 4
#define AT_NY 32
#define AT_TR 2
#define AT_R 64
#define AT_THREADS 256
#define AT_PS 36

// Four floats of a row from `src`, `left` of them valid (the rest 0); one float4 load when `vec`.
__device__ __forceinline__ float4 at_ld4(const float* __restrict__ src, int left, bool vec) {
    if (vec) return *(const float4*)src;
    float4 r;
    r.x = left > 0 ? src[0] : 0.0f;
    r.y = left > 1 ? src[1] : 0.0f;
    r.z = left > 2 ? src[2] : 0.0f;
    r.w = left > 3 ? src[3] : 0.0f;
    return r;
}

__device__ __forceinline__ float at_f4(const float4& a, int u) {
    return u == 0 ? a.x : u == 1 ? a.y : u == 2 ? a.z : a.w;
}

// The first row of this block's tile of AT_R rows of KV head blockIdx.x % KV, of a tiled GQA
// prefill with rows_total rows per KV head: tiles numbered heaviest first (the last rows see the
// longest prefix), KV head fastest.
__device__ __forceinline__ int at_row0(int rows_total, int n_kv_heads) {
    const int n_tiles = (rows_total + AT_R - 1) / AT_R;
    return (n_tiles - 1 - (int)(blockIdx.x / n_kv_heads)) * AT_R;
}

// CG float4 output columns per thread: hd <= 32·CG.
template <int CG>
__device__ __forceinline__ void gqa_tiled(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, float* __restrict__ out, int n, int pos0,
                                          int n_heads, int n_kv_heads, int hd, float scale) {
    extern __shared__ __align__(16) float at_sm[];
    const int G = n_heads / n_kv_heads;
    const int rows_total = n * G;
    const int kvh = blockIdx.x % n_kv_heads;
    const int row0 = at_row0(rows_total, n_kv_heads);
    const int hd4 = (hd + 3) & ~3, ng = hd4 >> 2;
    const int qs = (ng & 1) ? hd4 : hd4 + 4;
    float* Qs = at_sm;
    float* Ks = Qs + AT_R * qs;
    float* Vs = Ks + AT_BK * qs;
    float* Ps = Vs + AT_BK * hd4;
    const int tx = threadIdx.x % AT_NX, ty = threadIdx.x / AT_NX;
    const int kvw = n_kv_heads * hd;
    const bool vec = (hd & 3) == 0;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int row_last = min(row0 + AT_R, rows_total) - 1;
    const int kmax = pos0 + row_last / G;

    for (int e = threadIdx.x; e < AT_R * ng; e += AT_THREADS) {
        int r = e / ng, g = e - r * ng, row = row0 + r;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row < rows_total) {
            int tok = row / G, h = kvh * G + (row - tok * G);
            x = at_ld4(q + ((size_t)tok * n_heads + h) * hd + 4 * g, hd - 4 * g, vec);
        }
        *(float4*)(Qs + r * qs + 4 * g) = x;
    }

    int lim[AT_TR];
    float m[AT_TR];
    double l[AT_TR];
    float4 o[AT_TR][CG];
#pragma unroll
    for (int i = 0; i < AT_TR; i++) {
        int row = row0 + ty + AT_NY * i;
        lim[i] = row < rows_total ? pos0 + row / G : kmax;
        m[i] = NEG_INF;
        l[i] = 0.0;
#pragma unroll
        for (int c = 0; c < CG; c++) o[i][c] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }

    for (int kt = 0; kt <= kmax; kt += AT_BK) {
        __syncthreads();  // the previous tile's P·V is done with Ks/Vs/Ps (and Qs is stored)
        for (int e = threadIdx.x; e < AT_BK * ng; e += AT_THREADS) {
            int j = e / ng, g = e - j * ng, key = kt + j;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f), b = a;
            if (key <= kmax) {
                size_t off = (size_t)key * kvw + (size_t)kvh * hd + 4 * g;
                a = at_ld4(k + off, hd - 4 * g, vec);
                b = at_ld4(v + off, hd - 4 * g, vec);
            }
            *(float4*)(Ks + j * qs + 4 * g) = a;
            *(float4*)(Vs + j * hd4 + 4 * g) = b;
        }
        __syncthreads();

        float s[AT_TR][AT_TK];
#pragma unroll
        for (int i = 0; i < AT_TR; i++)
#pragma unroll
            for (int j = 0; j < AT_TK; j++) s[i][j] = 0.0f;
#pragma unroll 2
        for (int g = 0; g < ng; g++) {
            float4 qa[AT_TR], kb[AT_TK];
#pragma unroll
            for (int i = 0; i < AT_TR; i++) qa[i] = *(const float4*)(Qs + (ty + AT_NY * i) * qs + 4 * g);
#pragma unroll
            for (int j = 0; j < AT_TK; j++) kb[j] = *(const float4*)(Ks + (tx + AT_NX * j) * qs + 4 * g);
#pragma unroll
            for (int i = 0; i < AT_TR; i++)
#pragma unroll
                for (int j = 0; j < AT_TK; j++) {
                    s[i][j] = fmaf(qa[i].x, kb[j].x, s[i][j]);
                    s[i][j] = fmaf(qa[i].y, kb[j].y, s[i][j]);
                    s[i][j] = fmaf(qa[i].z, kb[j].z, s[i][j]);
                    s[i][j] = fmaf(qa[i].w, kb[j].w, s[i][j]);
                }
        }

#pragma unroll
        for (int i = 0; i < AT_TR; i++) {
            float mt = NEG_INF;
#pragma unroll
            for (int j = 0; j < AT_TK; j++) {
                float x = kt + tx + AT_NX * j <= lim[i] ? s[i][j] * scale : NEG_INF;
                s[i][j] = x;
                mt = fmaxf(mt, x);
            }
#pragma unroll
            for (int w = 1; w < AT_NX; w <<= 1) mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, w));
            float mn = fmaxf(m[i], mt);
            float alpha = expf(m[i] - mn);
            m[i] = mn;
            double ps = 0.0;
            float* prow = Ps + (ty + AT_NY * i) * AT_PS;
#pragma unroll
            for (int j = 0; j < AT_TK; j++) {
                float p = expf(s[i][j] - mn);
                prow[tx + AT_NX * j] = p;
                ps += (double)p;
            }
#pragma unroll
            for (int w = 1; w < AT_NX; w <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, w);
            l[i] = l[i] * (double)alpha + ps;
#pragma unroll
            for (int c = 0; c < CG; c++) {
                o[i][c].x *= alpha;
                o[i][c].y *= alpha;
                o[i][c].z *= alpha;
                o[i][c].w *= alpha;
            }
        }
        __syncthreads();

        // Positions past kmax have p = 0 and V rows of zeros; stop at the tile's last live group of 4.
        int kend = min(AT_BK, ((kmax - kt) | 3) + 1);
        for (int kk = 0; kk < kend; kk += 4) {
            float4 pa[AT_TR];
#pragma unroll
            for (int i = 0; i < AT_TR; i++) pa[i] = *(const float4*)(Ps + (ty + AT_NY * i) * AT_PS + kk);
#pragma unroll
            for (int u = 0; u < 4; u++) {
#pragma unroll
                for (int c = 0; c < CG; c++) {
                    int g = tx + AT_NX * c;
                    if (g < ng) {
                        float4 vv = *(const float4*)(Vs + (kk + u) * hd4 + 4 * g);
#pragma unroll
                        for (int i = 0; i < AT_TR; i++) {
                            float p = at_f4(pa[i], u);
                            o[i][c].x = fmaf(p, vv.x, o[i][c].x);
                            o[i][c].y = fmaf(p, vv.y, o[i][c].y);
                            o[i][c].z = fmaf(p, vv.z, o[i][c].z);
                            o[i][c].w = fmaf(p, vv.w, o[i][c].w);
                        }
                    }
                }
            }
        }
    }

#pragma unroll
    for (int i = 0; i < AT_TR; i++) {
        int row = row0 + ty + AT_NY * i;
        if (row >= rows_total) continue;
        int tok = row / G, h = kvh * G + (row - tok * G);
        float* dst = out + ((size_t)tok * n_heads + h) * hd;
        float inv = (float)(1.0 / l[i]);
#pragma unroll
        for (int c = 0; c < CG; c++) {
            int g = tx + AT_NX * c;
            if (g >= ng) continue;
            float4 r = make_float4(o[i][c].x * inv, o[i][c].y * inv, o[i][c].z * inv, o[i][c].w * inv);
            if (vec) {
                *(float4*)(dst + 4 * g) = r;
            } else {
                int d = 4 * g;
                if (d < hd) dst[d] = r.x;
                if (d + 1 < hd) dst[d + 1] = r.y;
                if (d + 2 < hd) dst[d + 2] = r.z;
                if (d + 3 < hd) dst[d + 3] = r.w;
            }
        }
    }
}

// q [n, H·hd], k/v [T, KV·hd] (T >= pos0 + n), out [n, H·hd]; H % KV == 0, hd <= HD. Grid:
// ceil(n·(H/KV) / 64) · KV blocks of 256 threads, dynamic shared memory as above.
#define GQA_TILED(HD, MINB)                                                                                      \
    extern "C" __global__ void __launch_bounds__(AT_THREADS, MINB) gqa_attn_tiled_##HD(                              \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                 \
        float* __restrict__ out, int n, int pos0, int n_heads, int n_kv_heads, int hd, float scale) {         \
        gqa_tiled<HD / 32>(q, k, v, out, n, pos0, n_heads, n_kv_heads, hd, scale);                             \
    }
// Blocks per SM the register allocation aims at (the shared memory allows 5, 2 and 1 at hd 64, 128
// and 256 on an H200).
#if LLMDIFF_ATTN_PART != 1  // the tiled kernels
GQA_TILED(64, 2)
GQA_TILED(128, 2)
GQA_TILED(256, 1)
#endif

// ---------------------------------------------------------------------------------------------
// Prefill GQA attention on the tensor cores (`gqa_attn_tc_<HD>`, HD = 64, 128: head widths that
// are a multiple of 8 up to HD), the default where it fits; the CUDA-core kernel above stays for
// the other widths and `LLMDIFF_CUDA_DISABLE=attn-tc`. The same rows, blocks and online softmax as
// gqa_tiled: a block owns TC_R = 64 rows (token, query head) of one KV head, heaviest first; the
// causal prefix is walked in tiles of TC_BK = 32 positions, K/V tiles double-buffered in shared
// memory by cp.async. A warp owns 16 rows: lane (g = lane/4, t = lane%4) holds rows g and g + 8.
//
// Precision (3xTF32). mma.sync m16n8k8 reads tf32 (an f32 with 10 explicit mantissa bits). Every
// f32 operand x is split into big (x with the low 13 mantissa bits cleared: a tf32) and small = x
// − big (exact in f32, |small| < 2^-10·|x|), and a·b is formed as a_big·b_big (exact) plus
// a_small·b_big + a_big·b_small, each sum accumulated in f32: the dropped a_small·b_small and
// small's own tf32 truncation are ~2^-21 of |a·b|, beside f32's 2^-24 rounding per term in the
// CUDA-core kernel. Both S = Q·Kᵀ and O += P·V are so formed (S: the big and small sums each in
// two accumulators by the parity of the 8-wide column group, added at the end of the tile; O: one
// big and one small accumulator per output column group, added at the end);
// the softmax is gqa_tiled's (max-subtracted expf in f32, the denominator in f64, O and l scaled
// by the same α), in a fixed order: deterministic.
//
// Fragments (m16n8k8 tf32): A a0 = (row g, k t), a1 = (row g+8, k t), a2 = (g, t+4), a3 = (g+8,
// t+4); B b0 = (k t, column g), b1 = (k t+4, column g); C c0, c1 = (row g, columns 2t, 2t+1), c2,
// c3 = (row g+8, same). S: A from Q rows (k = d), B from K rows (column = position). O += P·V: the
// k order inside one mma is free when A and B agree, so the 8 positions of S's n-tile j become k
// in the order 2t ↔ k t, 2t+1 ↔ k t+4: then a0..a3 are S's c0, c2, c1, c3 of that tile (no
// shuffle), and B reads V rows 8j + 2t and 8j + 2t + 1 at column g.
//
// Shared memory (floats): Q TC_R × TS, then two stages of K and V, TC_BK × TS each; the row stride
// TS = HD + 4 puts the fragment reads (8 rows × 4 consecutive columns, or 4 rows two apart × 8
// consecutive columns) on 32 distinct banks. hd = 128: 25344 floats (99 KB, two blocks per SM
// on an H200); `tiled_block` in cuda/attn.rs computes the same. Columns hd .. HD of Q, K and V
// are zeros (written once; the copies never touch them), so every loop runs over HD (no
// per-column branch: the mma chains of successive column groups overlap) and a narrower head
// adds zero terms. Positions past the prefix's last (kmax) load row kmax (finite) and are
// masked to p = 0.

#define TC_R AT_R
#define TC_BK 32
#define TC_THREADS 128

// big: x with its low 13 mantissa bits cleared (a tf32, exact), small = x − big (exact in f32,
// |small| < 2^-10·|x|; the mma reads its top 11 bits).
__device__ __forceinline__ void tf32_split(float x, u32& big, u32& small) {
    big = __float_as_uint(x) & 0xffffe000u;
    small = __float_as_uint(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A·B in 3xTF32, A given split (ab, as), B as two f32s (b0, b1) split here: big += ab·bb,
// small += as·bb + ab·bs (two accumulators, so the dependent chains are shorter).
__device__ __forceinline__ void mma_3xtf32(float (&big)[4], float (&small)[4], const u32 (&ab)[4], const u32 (&as)[4],
                                           float b0, float b1) {
    u32 bb0, bs0, bb1, bs1;
    tf32_split(b0, bb0, bs0);
    tf32_split(b1, bb1, bs1);
    mma_tf32(small, as, bb0, bb1);
    mma_tf32(small, ab, bs0, bs1);
    mma_tf32(big, ab, bb0, bb1);
}

template <int HD>
__device__ __forceinline__ void gqa_tc(const float* __restrict__ q, const float* __restrict__ k,
                                       const float* __restrict__ v, float* __restrict__ out, int n, int pos0,
                                       int n_heads, int n_kv_heads, int hd, float scale) {
    constexpr int TS = HD + 4, ND = HD / 8;
    extern __shared__ __align__(16) float tc_sm[];
    const int G = n_heads / n_kv_heads;
    const int rows_total = n * G;
    const int kvh = blockIdx.x % n_kv_heads;
    const int row0 = at_row0(rows_total, n_kv_heads);
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = (threadIdx.x >> 5) * 16 + g;  // block-local rows r0 and r0 + 8
    const int h4 = hd >> 2, kvw = n_kv_heads * hd;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const int kmax = pos0 + (min(row0 + TC_R, rows_total) - 1) / G;
    float* Qs = tc_sm;
    float* KVs = Qs + TC_R * TS;

    // One stage: positions kt .. kt + TC_BK (clamped to kmax) of K and V into stage s.
    auto stage = [&](int kt, int s) {
        float* Ks = KVs + s * 2 * TC_BK * TS;
        float* Vs = Ks + TC_BK * TS;
        for (int e = threadIdx.x; e < TC_BK * h4; e += TC_THREADS) {
            int j = e / h4, c4 = e - j * h4;
            size_t off = (size_t)min(kt + j, kmax) * kvw + (size_t)kvh * hd + 4 * c4;
            cp_async16(Ks + j * TS + 4 * c4, k + off);
            cp_async16(Vs + j * TS + 4 * c4, v + off);
        }
        cp_async_commit();
    };
    if (hd < HD) {  // the padding columns of the K/V stages (the Q rows' are written below)
        for (int e = threadIdx.x; e < 4 * TC_BK * (HD / 4 - h4); e += TC_THREADS) {
            int r = e / (HD / 4 - h4), c4 = h4 + e % (HD / 4 - h4);
            *(float4*)(KVs + r * TS + 4 * c4) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }
    stage(0, 0);
    for (int e = threadIdx.x; e < TC_R * (HD / 4); e += TC_THREADS) {
        int r = e / (HD / 4), c4 = e - r * (HD / 4), row = row0 + r;
        float4 x = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (row < rows_total && c4 < h4) {
            int tok = row / G, h = kvh * G + (row - tok * G);
            x = *(const float4*)(q + ((size_t)tok * n_heads + h) * hd + 4 * c4);
        }
        *(float4*)(Qs + r * TS + 4 * c4) = x;
    }

    int lim[2];
    float m[2];
    double l[2];
#pragma unroll
    for (int i = 0; i < 2; i++) {
        int row = row0 + r0 + 8 * i;
        lim[i] = row < rows_total ? pos0 + row / G : kmax;
        m[i] = NEG_INF;
        l[i] = 0.0;
    }
    float o[ND][4], ol[ND][4];  // O's big and small sums
#pragma unroll
    for (int c = 0; c < ND; c++)
#pragma unroll
        for (int u = 0; u < 4; u++) o[c][u] = ol[c][u] = 0.0f;

    const int n_kt = kmax / TC_BK + 1;
    for (int it = 0; it < n_kt; it++) {
        const int kt = it * TC_BK;
        if (it + 1 < n_kt) {
            stage(kt + TC_BK, (it + 1) & 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // stage it (and Q) visible to every warp
        const float* Ks = KVs + (it & 1) * 2 * TC_BK * TS;
        const float* Vs = Ks + TC_BK * TS;

        float s[TC_BK / 8][4], sp[3][TC_BK / 8][4];  // S's big sum (even column groups), and the
                                                      // odd groups' big, the even and odd small
#pragma unroll
        for (int j = 0; j < TC_BK / 8; j++)
#pragma unroll
            for (int u = 0; u < 4; u++) s[j][u] = sp[0][j][u] = sp[1][j][u] = sp[2][j][u] = 0.0f;
#pragma unroll
        for (int c = 0; c < ND; c++) {
            u32 ab[4], as[4];
            const float* qr = Qs + r0 * TS + 8 * c + t;
            tf32_split(qr[0], ab[0], as[0]);
            tf32_split(qr[8 * TS], ab[1], as[1]);
            tf32_split(qr[4], ab[2], as[2]);
            tf32_split(qr[8 * TS + 4], ab[3], as[3]);
#pragma unroll
            for (int j = 0; j < TC_BK / 8; j++) {
                const float* kr = Ks + (8 * j + g) * TS + 8 * c + t;
                mma_3xtf32(c & 1 ? sp[0][j] : s[j], sp[1 + (c & 1)][j], ab, as, kr[0], kr[4]);
            }
        }
#pragma unroll
        for (int j = 0; j < TC_BK / 8; j++)
#pragma unroll
            for (int u = 0; u < 4; u++) s[j][u] = (s[j][u] + sp[0][j][u]) + (sp[1][j][u] + sp[2][j][u]);

        // Online softmax, rows r0 (c0, c1 of each tile) and r0 + 8 (c2, c3).
#pragma unroll
        for (int i = 0; i < 2; i++) {
            float mt = NEG_INF;
#pragma unroll
            for (int j = 0; j < TC_BK / 8; j++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    float x = kt + 8 * j + 2 * t + u <= lim[i] ? s[j][2 * i + u] * scale : NEG_INF;
                    s[j][2 * i + u] = x;
                    mt = fmaxf(mt, x);
                }
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
            float mn = fmaxf(m[i], mt);
            float alpha = expf(m[i] - mn);
            m[i] = mn;
            double ps = 0.0;
#pragma unroll
            for (int j = 0; j < TC_BK / 8; j++)
#pragma unroll
                for (int u = 0; u < 2; u++) {
                    float p = expf(s[j][2 * i + u] - mn);
                    s[j][2 * i + u] = p;
                    ps += (double)p;
                }
            ps += __shfl_xor_sync(0xffffffffu, ps, 1);
            ps += __shfl_xor_sync(0xffffffffu, ps, 2);
            l[i] = l[i] * (double)alpha + ps;
#pragma unroll
            for (int c = 0; c < ND; c++) {
                o[c][2 * i] *= alpha;
                o[c][2 * i + 1] *= alpha;
                ol[c][2 * i] *= alpha;
                ol[c][2 * i + 1] *= alpha;
            }
        }

        // O += P·V: tile j's positions 8j + 2t, 8j + 2t + 1 are k t, t + 4.
#pragma unroll
        for (int j = 0; j < TC_BK / 8; j++) {
            u32 ab[4], as[4];
            tf32_split(s[j][0], ab[0], as[0]);
            tf32_split(s[j][2], ab[1], as[1]);
            tf32_split(s[j][1], ab[2], as[2]);
            tf32_split(s[j][3], ab[3], as[3]);
            const float* vr = Vs + (8 * j + 2 * t) * TS + g;
#pragma unroll
            for (int c = 0; c < ND; c++) mma_3xtf32(o[c], ol[c], ab, as, vr[8 * c], vr[TS + 8 * c]);
        }
        __syncthreads();  // every warp is done with stage it before the next one is loaded into it
    }

#pragma unroll
    for (int i = 0; i < 2; i++) {
        int row = row0 + r0 + 8 * i;
        if (row >= rows_total) continue;
        int tok = row / G, h = kvh * G + (row - tok * G);
        float* dst = out + ((size_t)tok * n_heads + h) * hd + 2 * t;
        float inv = (float)(1.0 / l[i]);
#pragma unroll
        for (int c = 0; c < ND; c++) {
            if (8 * c + 2 * t >= hd) break;
            *(float2*)(dst + 8 * c) =
                make_float2((o[c][2 * i] + ol[c][2 * i]) * inv, (o[c][2 * i + 1] + ol[c][2 * i + 1]) * inv);
        }
    }
}

// Arguments and grid as gqa_attn_tiled_<HD> (ceil(n·(H/KV) / 64) · KV blocks), blocks of 128
// threads, dynamic shared memory as above; hd a multiple of 8, at most HD.
#if LLMDIFF_ATTN_PART != 1  // the tiled kernels
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) gqa_attn_tc_64(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ out,
    int n, int pos0, int n_heads, int n_kv_heads, int hd, float scale) {
    gqa_tc<64>(q, k, v, out, n, pos0, n_heads, n_kv_heads, hd, scale);
}
extern "C" __global__ void __launch_bounds__(TC_THREADS, 2) gqa_attn_tc_128(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v, float* __restrict__ out,
    int n, int pos0, int n_heads, int n_kv_heads, int hd, float scale) {
    gqa_tc<128>(q, k, v, out, n, pos0, n_heads, n_kv_heads, hd, scale);
}
#endif

// ---------------------------------------------------------------------------------------------
// Decode GQA attention split over the context (flash-decoding): one new token (n = 1), row 0
// sees positions 0 ..= pos0 (n_ctx = pos0 + 1).
//
// Grid: a block per (context split, KV head), blockIdx.x = split·KV + kv head, so the live splits
// are the first blocks. The context's C = ceil(n_ctx / L) chunks of L = 4·(warps) positions are
// dealt out in runs of U consecutive chunks, S = ceil(C / U) splits: U = 1 (a chunk a block) in
// the plain entries (`gqa_split`), U = ceil(C / s_max) in the `_runs_` ones (`gqa_split_runs`;
// S ≤ s_max, and U = 1 until C passes s_max), which the host takes where the caches' capacity
// holds more than s_max chunks. L and s_max are the host's (functions of the shape, the setting
// and the device, never of the position) and U and S follow from n_ctx, so the `_dpos` form and
// the plain one agree bit for bit. A block owns the G = H/KV query heads of its KV head and the
// positions of chunks [split·U, split·U + U) ∩ [0, C). Blocks past S exit at once (the `_dpos`
// grid covers the cache's capacity, up to s_max splits). Warp w holds positions chunk·L +
// p·(warps) + w, p < 4: each lane loads float4 columns lane and lane + 32 (CW = 1 for hd ≤ 128, 2
// for hd ≤ 256) of its K and V rows into registers (one round trip for the whole chunk), so each
// K/V row is read once for the G heads. Launched early (PDL), it loads the first chunk's rows
// below pos0 (earlier steps wrote them) before griddep_wait and row pos0 (the q/k/v GEMV before
// it appends it) after, by coherent loads. In a run, the next chunk's K rows are loaded once the
// scores are taken and its V rows once the partial rows are, so they arrive while the block
// computes.
//
// Per block, per head h of the group: s_j = dot(q_h, k_j)·scale (the lane's columns by fmaf, then
// a warp butterfly); m = max over the chunk (fmaxf, so NaN scores do not set it); e_j = expf(s_j −
// m) (m = −inf, a chunk of only −inf or NaN scores: e_j = expf(s_j), so −inf gives 0 and NaN
// stays NaN); the partial sum l = Σ e_j in f64 (lane-strided, then a butterfly); the partial row
// o = Σ e_j·v_j in f32 (each warp's positions in order, then the warps in order through shared
// memory, `hr` heads at a time). A run's later chunks merge into the split's partials in chunk
// order: m = max(m_old, m_chunk), e_j relative to it, α = expf(m_old − m) (0 when m_old = −inf),
// l = l_old·α + Σ e_j, o = α·o_old + Σ e_j·v_j (one fmaf a value). Partials go to `part` (layout
// below; a run's stay there between its chunks), then the last block of the KV head to arrive
// (an atomic counter per KV head, after a barrier and __threadfence; that block resets it to 0,
// so the next launch and a replayed graph find it at 0) combines the S splits for its G heads:
// M = max m_s; α_s = expf(m_s − M); l = Σ α_s·l_s (f64, lane-strided then a butterfly); O =
// Σ α_s·o_s (f32, each column's splits strided over R = max(1, blockDim / (G·hd/4)) thread
// groups, eight splits' loads in flight, then the groups in order); out = O · (float)(1 / l).
// Every sum runs in an order fixed by (n_ctx, L, s_max, shape), so the result does not depend on
// which block arrives last. The combining block also writes the output row's int8 limbs for the
// integer GEMV (x_limbs4) when `xq` is not null (the host passes it when the row H·hd is a
// multiple of 128 and G·hd of 32, so every 32-value block lies in one KV head's span and each
// warp's 8-lane groups hold whole blocks).
//
// `part` (floats, N = s_cap·KV·G): Σe per (split, kv head, head) as f64 (2N floats), then m (N),
// then from round_up(3N, 4) the partial rows, (split, kv head) major, G·hd each. `cnt`: one
// unsigned per KV head, 0 between launches. Both belong to one rank (crate::cuda's attn
// submodule, cuda/attn.rs), so ranks on separate streams never share them.
//
// Dynamic shared memory (floats): q G·hd, scores/exps G·L, (runs only) α round_up(G, 4), then
// max(warps·hr·hd, round_up(2G, 4) + 4·R·(G·hd/4)) for the warps' partial rows and the combine
// (`split_plan` in cuda/attn.rs sizes it for the runs' layout).
//
// The two bodies stay apart: written as one (the plain entries a run of one), the plain entries
// took ~2 % longer in the 8B decode step on the H200, for the same arithmetic. They
// share the pieces that leave the plain entries' SASS as it was measured (a few instructions moved
// or with commuted operands): the partials' layout, the scores, the position's own row, the
// warps' partial rows and the arrival and combine.

// The pieces below the scores (AS_PPW, as_scores, as_own_row, as_warp_rows, AsPart) are in
// common.cuh.

// A split's end, in every block of the split kernels: the arrival on the KV head's counter and, in
// the last block to arrive, the combine of its S splits and the output row (see above). `red`:
// the block's shared memory past the scores.
__device__ __forceinline__ void as_finish(const AsPart& pt, unsigned* cnt, float* red,
                                          float* __restrict__ out, u8* __restrict__ xq, int S, int kvh, int KV, int G,
                                          int hd, int n_heads) {
    __shared__ int as_last;
    const int nw = blockDim.x >> 5, w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int hd4 = hd >> 2, ncol = G * hd4;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // The last block of this KV head to arrive combines. As cooperative groups' grid sync: the
    // block's partials are ordered before thread 0's fence and arrival by the barrier, and the
    // last block's reads after its fence by the barrier that follows (they bypass L1: __ldcg).
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        const unsigned t = atomicAdd(cnt + kvh, 1u);
        as_last = t == (unsigned)(S - 1);
        if (as_last) {
            atomicExch(cnt + kvh, 0u);
            __threadfence();
        }
    }
    __syncthreads();
    if (!as_last) return;

    float* Ms = red;
    float* Is = red + G;
    float4* acc4 = (float4*)(red + ((2 * G + 3) & ~3));
    const size_t ms_stride = (size_t)KV * G;
    const float* pm = pt.m + (size_t)kvh * G;
    const double* ps = pt.s + (size_t)kvh * G;
    for (int h = w; h < G; h += nw) {
        float m = NEG_INF;
        for (int s = lane; s < S; s += 32) m = fmaxf(m, __ldcg(pm + s * ms_stride + h));
        m = as_warp_max(m);
        double sum = 0.0;
        for (int s = lane; s < S; s += 32)
            sum += (double)expf(__ldcg(pm + s * ms_stride + h) - m) * __ldcg(ps + s * ms_stride + h);
        sum = as_warp_sum64(sum);
        if (lane == 0) {
            Ms[h] = m;
            Is[h] = (float)(1.0 / sum);
        }
    }
    __syncthreads();

    const int R = max(1, (int)blockDim.x / ncol);
    const float4* pc = (const float4*)(pt.o + (size_t)kvh * G * hd);
    const size_t o_stride = (size_t)KV * ncol;
    for (int t = threadIdx.x; t < R * ncol; t += blockDim.x) {
        const int r = t / ncol, c = t - r * ncol, h = c / hd4;
        const float M = Ms[h];
        float4 a = zero;
        int s = r;
        // Eight splits' loads in flight, then their terms in split order.
        for (; s + 7 * R < S; s += 8 * R) {
            float m8[8];
            float4 o8[8];
#pragma unroll
            for (int u = 0; u < 8; u++) {
                m8[u] = __ldcg(pm + (size_t)(s + u * R) * ms_stride + h);
                o8[u] = __ldcg(pc + (size_t)(s + u * R) * o_stride + c);
            }
#pragma unroll
            for (int u = 0; u < 8; u++) a = as_fma4(expf(m8[u] - M), o8[u], a);
        }
        for (; s < S; s += R)
            a = as_fma4(expf(__ldcg(pm + (size_t)s * ms_stride + h) - M), __ldcg(pc + (size_t)s * o_stride + c), a);
        acc4[t] = a;
    }
    __syncthreads();

    float4* out4 = (float4*)(out + (size_t)kvh * G * hd);
    for (int c0 = threadIdx.x & ~31; c0 < ncol; c0 += blockDim.x) {
        const int c = c0 + lane;
        const bool live = c < ncol;
        float4 a = zero;
        if (live) {
            a = acc4[c];
            for (int r = 1; r < R; r++) a = as_add4(a, acc4[r * ncol + c]);
            const float inv = Is[c / hd4];
            a = make_float4(a.x * inv, a.y * inv, a.z * inv, a.w * inv);
            out4[c] = a;
        }
        if (xq) x_limbs4(a, kvh * ncol + c, xq, n_heads * hd, live);
    }
}

// The plain entries' body: a chunk a block (see above).
template <int CW>
__device__ __forceinline__ void gqa_split(const float* __restrict__ q, const float* __restrict__ k,
                                          const float* __restrict__ v, float* __restrict__ out, float* part,
                                          unsigned* cnt, u8* __restrict__ xq, int pos0, int n_heads,
                                          int n_kv_heads, int hd, float scale, int s_cap, int hr) {
    extern __shared__ __align__(16) float as_sm[];
    const int KV = n_kv_heads, G = n_heads / KV;
    const int nw = blockDim.x >> 5, L = nw * AS_PPW;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = blockIdx.x % KV, sp = blockIdx.x / KV;
    const int n_ctx = pos0 + 1, j0 = sp * L;
    if (j0 >= n_ctx) return;
    const int S = (n_ctx + L - 1) / L;
    const int hd4 = hd >> 2, kvw = KV * hd, ncol = G * hd4;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    const AsPart pt(part, s_cap, KV, G);
    const size_t slot = (size_t)sp * KV + kvh;

    // The chunk's K and V rows, in flight while q is staged: the rows below the position (earlier
    // steps wrote them) before the wait for the q/k/v GEMV (PDL, common.cuh), the position's row
    // (that GEMV appends it) after it, by coherent loads.
    float4 kr[AS_PPW][CW], vr[AS_PPW][CW];
#pragma unroll
    for (int p = 0; p < AS_PPW; p++) {
        const int j = j0 + p * nw + w;
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + 32 * c;
            float4 a = zero, b = zero;
            if (j < pos0 && col < hd4) {
                const size_t off = (size_t)j * kvw + (size_t)kvh * hd + 4 * col;
                a = *(const float4*)(k + off);
                b = *(const float4*)(v + off);
            }
            kr[p][c] = a;
            vr[p][c] = b;
        }
    }
    griddep_wait();
    as_own_row<CW>(k, v, kr, vr, j0, nw, w, lane, pos0, kvw, kvh, hd);
    float* qs = as_sm;
    float* es = qs + G * hd;
    float* red = es + G * L;
    const float4* q4 = (const float4*)(q + (size_t)kvh * G * hd);
    for (int i = threadIdx.x; i < ncol; i += blockDim.x) ((float4*)qs)[i] = q4[i];
    __syncthreads();

    as_scores<CW>(qs, kr, es, G, hd4, L, nw, w, lane, j0, n_ctx, scale);
    __syncthreads();

    // The chunk's max and Σ exp per head (a warp per head).
    as_softmax(es, pt, slot, G, L, nw, w, lane);
    __syncthreads();

    // The partial rows Σ e_j·v_j, hr heads at a time: each warp's positions, then the warps in order.
    float4* po = (float4*)(pt.o + slot * G * hd);
    float4* red4 = (float4*)red;
    for (int h0 = 0; h0 < G; h0 += hr) {
        const int nh = min(hr, G - h0);
        as_warp_rows<CW>(es, vr, red4, h0, nh, L, nw, w, lane, hd4);
        __syncthreads();
        for (int i = threadIdx.x; i < nh * hd4; i += blockDim.x) {
            float4 a = red4[i];
            for (int u = 1; u < nw; u++) a = as_add4(a, red4[u * nh * hd4 + i]);
            po[h0 * hd4 + i] = a;
        }
        __syncthreads();
    }
    as_finish(pt, cnt, red, out, xq, S, kvh, KV, G, hd, n_heads);
}

// Rows j0 + p·nw + w (p < AS_PPW) of one cache (K or V) of the KV head at column offset off0,
// the lane's float4 columns lane + 32·c: rows below pos0 (earlier steps wrote them) by plain loads,
// row pos0 (the q/k/v GEMV before this kernel appends it) by coherent loads when OWN, else
// zeros, as are rows past it.
template <int CW, bool OWN>
__device__ __forceinline__ void as_rows(const float* __restrict__ x, float4 (&r)[AS_PPW][CW], int j0, int nw, int w,
                                        int lane, int pos0, int kvw, int off0, int hd4) {
#pragma unroll
    for (int p = 0; p < AS_PPW; p++) {
        const int j = j0 + p * nw + w;
#pragma unroll
        for (int c = 0; c < CW; c++) {
            const int col = lane + 32 * c;
            const size_t off = (size_t)j * kvw + off0 + 4 * col;
            float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (j < pos0 && col < hd4) a = *(const float4*)(x + off);
            if constexpr (OWN) {
                if (j == pos0 && col < hd4) a = ldx16f(x + off);
            }
            r[p][c] = a;
        }
    }
}

// The `_runs_` entries' body: runs of chunks a block (see above).
template <int CW>
__device__ __forceinline__ void gqa_split_runs(const float* __restrict__ q, const float* __restrict__ k,
                                               const float* __restrict__ v, float* __restrict__ out, float* part,
                                               unsigned* cnt, u8* __restrict__ xq, int pos0, int n_heads,
                                               int n_kv_heads, int hd, float scale, int s_cap, int s_max, int hr) {
    extern __shared__ __align__(16) float as_sm[];
    const int KV = n_kv_heads, G = n_heads / KV;
    const int nw = blockDim.x >> 5, L = nw * AS_PPW;
    const int w = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kvh = blockIdx.x % KV, sp = blockIdx.x / KV;
    const int n_ctx = pos0 + 1, chunks = (n_ctx + L - 1) / L;
    const int run = (chunks + s_max - 1) / s_max, S = (chunks + run - 1) / run;
    if (sp >= S) return;
    const int c0 = sp * run, c1 = min(chunks, c0 + run);
    const int hd4 = hd >> 2, kvw = KV * hd, ncol = G * hd4;
    const float NEG_INF = -__int_as_float(0x7f800000);
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);

    const AsPart pt(part, s_cap, KV, G);
    const size_t slot = (size_t)sp * KV + kvh;

    // The first chunk's K and V rows, in flight while q is staged: the rows below the position
    // before the wait for the q/k/v GEMV (PDL, common.cuh), the position's row after it.
    float4 kr[AS_PPW][CW], vr[AS_PPW][CW];
    as_rows<CW, false>(k, kr, c0 * L, nw, w, lane, pos0, kvw, kvh * hd, hd4);
    as_rows<CW, false>(v, vr, c0 * L, nw, w, lane, pos0, kvw, kvh * hd, hd4);
    griddep_wait();
    as_own_row<CW>(k, v, kr, vr, c0 * L, nw, w, lane, pos0, kvw, kvh, hd);
    float* qs = as_sm;
    float* es = qs + G * hd;
    float* alpha = es + G * L;
    float* red = alpha + ((G + 3) & ~3);
    const float4* q4 = (const float4*)(q + (size_t)kvh * G * hd);
    for (int i = threadIdx.x; i < ncol; i += blockDim.x) ((float4*)qs)[i] = q4[i];
    __syncthreads();

    float4* po = (float4*)(pt.o + slot * G * hd);
    float4* red4 = (float4*)red;
    for (int ch = c0; ch < c1; ch++) {
        const int j0 = ch * L;
        const bool first = ch == c0, more = ch + 1 < c1;

        as_scores<CW>(qs, kr, es, G, hd4, L, nw, w, lane, j0, n_ctx, scale);
        // The next chunk's K rows, in flight through this chunk's softmax and rows.
        if (more) as_rows<CW, true>(k, kr, j0 + L, nw, w, lane, pos0, kvw, kvh * hd, hd4);
        __syncthreads();

        // The chunk's max and Σ exp per head (a warp per head), after the first chunk merged into
        // the split's running ones: M = max(m_old, m), α = expf(m_old − M), l = l_old·α + Σ e.
        for (int h = w; h < G; h += nw) {
            float m = NEG_INF;
            for (int i = lane; i < L; i += 32) m = fmaxf(m, es[h * L + i]);
            m = as_warp_max(m);
            const float m_old = first ? NEG_INF : pt.m[slot * G + h];
            m = fmaxf(m_old, m);
            const float ms = m == NEG_INF ? 0.0f : m;
            double sum = 0.0;
            for (int i = lane; i < L; i += 32) {
                const float e = expf(es[h * L + i] - ms);
                es[h * L + i] = e;
                sum += (double)e;
            }
            sum = as_warp_sum64(sum);
            if (lane == 0) {
                if (!first) {
                    const float al = expf(m_old - ms);
                    sum = pt.s[slot * G + h] * (double)al + sum;
                    alpha[h] = al;
                }
                pt.m[slot * G + h] = m;
                pt.s[slot * G + h] = sum;
            }
        }
        __syncthreads();

        // The partial rows Σ e_j·v_j, hr heads at a time: each warp's positions, then the warps in
        // order, then (after the first chunk) α·(the split's row so far) + that.
        for (int h0 = 0; h0 < G; h0 += hr) {
            const int nh = min(hr, G - h0);
            as_warp_rows<CW>(es, vr, red4, h0, nh, L, nw, w, lane, hd4);
            // The next chunk's V rows, once this chunk's are all used.
            if (more && h0 + nh == G) as_rows<CW, true>(v, vr, j0 + L, nw, w, lane, pos0, kvw, kvh * hd, hd4);
            __syncthreads();
            for (int i = threadIdx.x; i < nh * hd4; i += blockDim.x) {
                float4 a = red4[i];
                for (int u = 1; u < nw; u++) a = as_add4(a, red4[u * nh * hd4 + i]);
                if (!first) a = as_fma4(alpha[h0 + i / hd4], po[h0 * hd4 + i], a);
                po[h0 * hd4 + i] = a;
            }
            __syncthreads();
        }
    }
    as_finish(pt, cnt, red, out, xq, S, kvh, KV, G, hd, n_heads);
}

// The entries' body: a chunk a block, or runs of chunks (s_max is the runs' alone).
template <int CW, bool RUNS>
__device__ __forceinline__ void gqa_split_at(const float* __restrict__ q, const float* __restrict__ k,
                                             const float* __restrict__ v, float* __restrict__ out, float* part,
                                             unsigned* cnt, u8* __restrict__ xq, int pos0, int n_heads,
                                             int n_kv_heads, int hd, float scale, int s_cap, int s_max, int hr) {
    if constexpr (RUNS)
        gqa_split_runs<CW>(q, k, v, out, part, cnt, xq, pos0, n_heads, n_kv_heads, hd, scale, s_cap, s_max, hr);
    else
        gqa_split<CW>(q, k, v, out, part, cnt, xq, pos0, n_heads, n_kv_heads, hd, scale, s_cap, hr);
}

// q [1, H·hd], k/v [≥ pos0 + 1, KV·hd] (16-byte aligned rows: hd % 4 == 0), out [1, H·hd]; part
// and cnt as above (s_cap ≥ S splits); s_max ≥ 1; xq null or the row's limbs. Grid: KV · (S, or
// s_cap for `_dpos`) blocks of 32·L/4 threads (L = 16, 32 or 64), shared memory as above. Launch
// bounds (512, 1): ptxas gives the 128 and 256 forms ~102 and ~122 registers (the runs ~128), no
// spills (with (512) alone it held the 128 form to 64 and spilled in the combine's eight-load
// batches).
#define GQA_SPLIT(NAME, CW, RUNS)                                                                              \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(                                                 \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                 \
        float* __restrict__ out, float* part, unsigned* cnt, u8* __restrict__ xq, int pos0, int n_heads,       \
        int n_kv_heads, int hd, float scale, int s_cap, int s_max, int hr) {                                   \
        TRACE_BLOCK(TRACE_ATTN_SPLIT);                                                                         \
        griddep_launch(); /* launched early (PDL, common.cuh): the o GEMV may start */                         \
        gqa_split_at<CW, RUNS>(q, k, v, out, part, cnt, xq, pos0, n_heads, n_kv_heads, hd, scale, s_cap,       \
                               s_max, hr);                                                                     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME##_dpos(                                          \
        const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,                 \
        float* __restrict__ out, float* part, unsigned* cnt, u8* __restrict__ xq,                              \
        const int* __restrict__ pos_dev, int n_heads, int n_kv_heads, int hd, float scale, int s_cap,          \
        int s_max, int hr) {                                                                                   \
        TRACE_BLOCK(TRACE_ATTN_SPLIT);                                                                         \
        griddep_launch();                                                                                      \
        gqa_split_at<CW, RUNS>(q, k, v, out, part, cnt, xq, *pos_dev, n_heads, n_kv_heads, hd, scale, s_cap,   \
                               s_max, hr);                                                                     \
    }
#if LLMDIFF_ATTN_PART != 2  // the per-(token, head) and split kernels
GQA_SPLIT(gqa_split_128, 1, false)
GQA_SPLIT(gqa_split_256, 2, false)
GQA_SPLIT(gqa_split_runs_128, 1, true)
GQA_SPLIT(gqa_split_runs_256, 2, true)
#endif
