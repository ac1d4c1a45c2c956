//! The backend seam: the primitive ops the model code is written over, once, for every backend.
//! [`CpuBackend`] runs them on the host with the kernels in [`crate::cpu_ops`]; `CudaBackend`
//! (feature `cuda`, in `crate::cuda`) implements the same trait with NVRTC kernels from `kernels/`.
//!
//! Activations, KV caches and custom-op output buffers are [`Buf`]s: a tensor of f32 owned by the
//! backend that made it (host memory for the CPU, device memory for CUDA), so a CUDA step keeps
//! its data on the device between ops. Data crosses to the host only through
//! [`Backend::upload`] and [`Backend::download`] (the token ids' embedding is gathered on the
//! device; taps that are wanted, the logits, and the MoE router logits are downloaded).
//!
//! The trait stays object-safe (`dyn Backend`, one `Buf` type with a host and a device form)
//! rather than generic over a buffer type: the engine picks its backend at run time from the
//! CLI, and the model code in `rank.rs` stays one non-generic copy.
//!
//! Custom ops with caller-allocated outputs (attention, the MoE mix) are composed in the model
//! code from these primitives; their output-buffer contract lives there, not here.

use crate::cpu_ops::{self, GqaShape, MlaShape, QkRope, RopeFreqs, RopeLayout, RopeStyle, WeightRef};
use crate::dsa::{self, IndexShape};
use crate::moe_route::{route, Route};
use crate::options::ComputeDtype;
use half::f16;
use references::config::MoeConfig;

/// Which backend an engine runs on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    #[default]
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// A tensor of f32 owned by a backend. The default is an empty host buffer, which every backend
/// accepts as "not allocated yet" (ops that size their output replace it).
#[derive(Default)]
pub struct Buf {
    pub(crate) repr: BufRepr,
}

pub(crate) enum BufRepr {
    Host(Vec<f32>),
    #[cfg(feature = "cuda")]
    Dev(crate::device_buf::DevBuf),
}

impl Default for BufRepr {
    fn default() -> Self {
        BufRepr::Host(Vec::new())
    }
}

impl Buf {
    /// A host buffer holding `v`.
    pub fn host(v: Vec<f32>) -> Buf {
        Buf { repr: BufRepr::Host(v) }
    }

    pub fn len(&self) -> usize {
        match &self.repr {
            BufRepr::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            BufRepr::Dev(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Sets the number of values in use: a device buffer keeps its memory (`len` must fit its
    /// capacity); a host one is resized (new values zero). For KV caches a replayed decode graph
    /// appended to on the device.
    pub(crate) fn set_len(&mut self, len: usize) {
        match &mut self.repr {
            BufRepr::Host(v) => v.resize(len, 0.0),
            #[cfg(feature = "cuda")]
            BufRepr::Dev(d) => d.set_len(len),
        }
    }

    /// Values the buffer can hold without reallocating (its length for a host buffer).
    pub(crate) fn capacity(&self) -> usize {
        match &self.repr {
            BufRepr::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            BufRepr::Dev(d) => d.capacity(),
        }
    }

    /// True for host memory.
    pub fn is_host(&self) -> bool {
        matches!(self.repr, BufRepr::Host(_))
    }

    /// The host values; panics on a device buffer (a backend mix-up is a bug, not an input).
    pub fn as_host(&self) -> &[f32] {
        match &self.repr {
            BufRepr::Host(v) => v,
            #[cfg(feature = "cuda")]
            BufRepr::Dev(_) => panic!("a device buffer used as a host one"),
        }
    }

    /// The host vector; panics on a device buffer.
    pub fn as_host_mut(&mut self) -> &mut Vec<f32> {
        match &mut self.repr {
            BufRepr::Host(v) => v,
            #[cfg(feature = "cuda")]
            BufRepr::Dev(_) => panic!("a device buffer used as a host one"),
        }
    }
}

/// The primitive ops. Every op writes all of its `out` unless it says otherwise; `out` buffers
/// are sized by the caller ([`Backend::alloc`]).
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;

    /// A buffer of `len` values whose contents are unspecified (zeros on the host).
    fn alloc(&self, len: usize) -> Buf;
    /// A buffer of `len` zeros.
    fn zeros(&self, len: usize) -> Buf {
        let mut b = self.alloc(len);
        self.fill(&mut b, 0.0);
        b
    }
    /// True when the ranks' phases should run on threads of their own (the CPU, where each rank
    /// computes); false when ranks only enqueue work on a device, which the driver thread does
    /// in rank order without a thread hand-off per phase.
    fn parallel_ranks(&self) -> bool {
        true
    }
    /// A buffer holding a copy of `data`.
    fn upload(&self, data: &[f32]) -> Buf;
    /// The buffer's values on the host (waits for the work that writes them).
    fn download(&self, b: &Buf) -> Vec<f32>;
    /// [`Backend::download`] into `out` (replaced), reusing its allocation where the backend can.
    fn download_into(&self, b: &Buf, out: &mut Vec<f32>) {
        *out = self.download(b);
    }
    /// Sets every value of `b` (the canary fill, zeroing).
    fn fill(&self, b: &mut Buf, value: f32);
    /// Every value of `b` rounded to `dtype` in place ([`ComputeDtype::round`]: nearest, ties
    /// to even; a NaN keeps its top payload bits, so each dtype's canary stays as it is). The
    /// store of a 16-bit engine, on f32 containers; a no-op at f32.
    fn round_to(&self, b: &mut Buf, dtype: ComputeDtype);
    /// `dst[dst_off..dst_off + len] = src[src_off..src_off + len]`.
    fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize);
    /// Columns `col0 .. col0 + n_cols` of `src` `[rows, src_width]` into `dst` `[rows, n_cols]`.
    fn copy_cols(&self, src: &Buf, src_width: usize, col0: usize, n_cols: usize, dst: &mut Buf);
    /// `x += a`, then each value rounded through f16 when `f16_round`.
    fn add_assign(&self, x: &mut Buf, a: &Buf, f16_round: bool);
    /// Rows `rows[i]` of `x` `[_, width]` stacked into `[rows.len(), width]`.
    fn gather_rows(&self, x: &Buf, width: usize, rows: &[usize]) -> Buf;
    /// `out[rows[i]] += weights[i] · y[i]` for each row i of `y` `[rows.len(), width]`, in order.
    fn add_rows_scaled(&self, out: &mut Buf, y: &Buf, width: usize, rows: &[usize], weights: &[f32]);
    /// KV-cache write: the cache keeps its first `pos0` rows of `width` and then holds
    /// `pos0 + n` rows (rows nothing wrote are zero); the `n` rows of `new` land at row `slot0`.
    fn kv_write(&self, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, slot0: usize);

    /// `out[n, w.rows] = x[n, w.cols] · wᵀ`.
    fn linear(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf);
    /// Products of one input with several weights, `outs[i] = x · ws[i]ᵀ` (a layer's q/k/v, or
    /// gate/up): `linear` on each here; one launch on CUDA where the GEMV allows.
    fn linear_many(&self, x: &Buf, n: usize, ws: &[WeightRef<'_>], outs: &mut [&mut Buf]) {
        assert_eq!(ws.len(), outs.len(), "linear_many: one output per weight");
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.linear(x, n, *w, out);
        }
    }
    /// RMSNorm over rows of `weight.len()`.
    fn rms_norm(&self, x: &Buf, weight: &[f32], eps: f32, out: &mut Buf);
    /// The residual add then the next block's input norm: `add_assign(x, a, f16_round)`, then
    /// `rms_norm(x, weight, eps, out)` (one launch on CUDA, same bits).
    fn add_rms_norm(&self, x: &mut Buf, a: &Buf, f16_round: bool, weight: &[f32], eps: f32, out: &mut Buf) {
        self.add_assign(x, a, f16_round);
        self.rms_norm(x, weight, eps, out);
    }
    /// MoE routing of router logits `[n, n_exp]` ([`crate::moe_route::route`]): on the host here (the
    /// logits come down), a kernel on CUDA (only the chosen experts and weights come down).
    fn moe_route(&self, logits: &Buf, n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route> {
        route(&self.download(logits), n_exp, m, bias, scale)
    }
    /// RoPE in place; row i is at position `pos0 + i`; pair i's angle divided as `freqs` says
    /// (Llama 3.1+'s per-pair factors, a linear factor; [`RopeFreqs::default`] for none).
    fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>);
    /// RoPE on a layer's q and k, rows at the same positions: `rope` on each (one launch on CUDA).
    #[allow(clippy::too_many_arguments)]
    fn rope_qk(
        &self,
        q: &mut Buf,
        q_layout: RopeLayout,
        k: &mut Buf,
        k_layout: RopeLayout,
        pos0: usize,
        base: f32,
        style: RopeStyle,
        freqs: RopeFreqs<'_>,
    ) {
        self.rope(q, q_layout, pos0, base, style, freqs);
        self.rope(k, k_layout, pos0, base, style, freqs);
    }
    /// `rope_qk`, then the new rows of k (after RoPE) and of v appended to their caches at
    /// `pos0` (`kv_write` without a slot shift): one launch on CUDA. k's rows are
    /// `rope.k.n_heads·head_stride` wide, v's `v_width`; `caches` = [k cache, v cache].
    fn rope_qk_cache(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        v_width: usize,
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        rope_qk_then_append(self, q, k, v, v_width, rope, caches)
    }
    /// A GQA layer's q, k and v products (`linear_many` of `ws` into `outs`), then
    /// `rope_qk_cache`. On CUDA a one-row step under a warp-rows GEMV does it all in the GEMV's
    /// launch (NORM RoPE and the appends in its store).
    fn linear_qkv_rope(
        &self,
        x: &Buf,
        n: usize,
        ws: [WeightRef<'_>; 3],
        outs: [&mut Buf; 3],
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        let [q, k, v] = outs;
        self.linear_many(x, n, &ws, &mut [&mut *q, &mut *k, &mut *v]);
        self.rope_qk_cache(q, k, v, ws[2].rows(), rope, caches);
    }
    /// `gate = silu(gate)·up`.
    fn swiglu(&self, gate: &mut Buf, up: &Buf);
    /// `gate = gelu_tanh(gate)·up` (gemma's GeGLU). The default runs the host's op on a
    /// download and uploads the result (a backend without a kernel for it stays correct).
    fn geglu(&self, gate: &mut Buf, up: &Buf) {
        let u = self.download(up);
        host_round_trip(self, gate, |g| cpu_ops::geglu(g, &u));
    }
    /// `y[t] += bias` for every row t of `y` `[n, bias.len()]` (the q/k/v biases of qwen2 and
    /// glm4moe). The default uploads the bias repeated per row and adds it (`add_assign`).
    fn add_bias(&self, y: &mut Buf, bias: &[f32]) {
        let n = y.len() / bias.len().max(1);
        let b = self.upload(&bias.repeat(n));
        self.add_assign(y, &b, false);
    }
    /// `x = x·s` element-wise (gemma's √d_model embedding scale). Default: on the host.
    fn scale(&self, x: &mut Buf, s: f32) {
        host_round_trip(self, x, |v| v.iter_mut().for_each(|a| *a *= s));
    }
    /// `x = cap·tanh(x/cap)` element-wise (gemma's final-logit soft-capping). Default: on the host.
    fn softcap(&self, x: &mut Buf, cap: f32) {
        host_round_trip(self, x, |v| v.iter_mut().for_each(|a| *a = cpu_ops::softcap(*a, cap)));
    }
    /// Causal GQA attention over a KV cache into `out` `[n, H·hd]`.
    fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf);
    /// Causal MLA attention over an expanded cache into `out` `[n, H·v]`.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, pos0: usize, shape: MlaShape, out: &mut Buf);
    /// MLA attention of each query over only its selected cache rows (the DSA indexer's keys):
    /// row t of `keys` (`[n, top_k]`, positions as f32, −1 padding) lists query t's keys. Writes
    /// `out` `[n, H·v]`. Default: on the host ([`dsa::mla_attention_sparse`]).
    #[allow(clippy::too_many_arguments)]
    fn mla_attention_sparse(
        &self,
        q: &Buf,
        k_nope: &Buf,
        k_pe: &Buf,
        v: &Buf,
        shape: MlaShape,
        keys: &Buf,
        top_k: usize,
        out: &mut Buf,
    ) {
        let [q, kn, kp, v, keys] = [q, k_nope, k_pe, v, keys].map(|b| self.download(b));
        let mut o = vec![0f32; out.len()];
        dsa::mla_attention_sparse(&q, &kn, &kp, &v, shape, &keys, top_k, &mut o);
        let u = self.upload(&o);
        self.copy(&u, 0, out, 0, o.len());
    }
    /// LayerNorm over rows of `weight.len()` with a bias (the DSA indexer's key norm). Default: on
    /// the host.
    fn layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf) {
        let xs = self.download(x);
        host_round_trip(self, out, |o| dsa::layer_norm(&xs, weight, bias, eps, o));
    }
    /// The DSA indexer's scores `out` `[n, pos0+n]` of roped queries `q` `[n, H·D]` over the key
    /// cache `k` `[T, D]` with head weights `w` `[n, H]` ([`dsa::index_scores`]). Default: on the
    /// host.
    fn index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, shape: IndexShape, out: &mut Buf) {
        let [q, k, w] = [q, k, w].map(|b| self.download(b));
        host_round_trip(self, out, |o| dsa::index_scores(&q, &k, &w, pos0, shape, o));
    }
    /// fp8 e4m3 rounding in groups of 128 of each row of `width` ([`dsa::fp8_groups`]: the
    /// indexer's q and keys as production stores them). Default: on the host.
    fn fp8_groups(&self, x: &mut Buf, width: usize) {
        host_round_trip(self, x, |v| dsa::fp8_groups(v, width));
    }
    /// Sum all-reduce of the ranks' partials in fixed order: rank 0 + rank 1 + .... Returns the
    /// sum once per device holding ranks: one buffer when every rank shares a device, one per
    /// rank (on that rank's device) otherwise; rank r reads `sums[r.min(sums.len() - 1)]`.
    fn all_reduce(&self, partials: &[&Buf]) -> Vec<Buf>;
    /// Embedding gather: row `rows[t]` of `w` decoded into `out[t]`, or zeros for `None` (a token
    /// outside this rank's vocab range).
    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut Buf);
    /// A decode step's embedding: `token`'s row of this rank's vocab shard `w` (its first token
    /// `vocab_start`) into `out`, or zeros when the shard does not hold it. A backend with graphs
    /// reads the token from where a replay sets it (see [`StepGraph::replay`]).
    fn embed_token(&self, w: WeightRef<'_>, token: u32, vocab_start: usize, out: &mut Buf) {
        let row = (token as usize).checked_sub(vocab_start).filter(|r| *r < w.rows());
        self.embed_rows(w, &[row], out)
    }

    /// Starts recording the device work the calling thread issues next (a decode step, its
    /// embedding included) into a replayable graph, the step's `token` being at position `pos0`. Until
    /// [`Backend::graph_end`] the work is recorded, not run, so nothing may be downloaded. Returns
    /// false where the backend has no graphs (the CPU, the default) or they are turned off.
    fn graph_begin(&self, _pos0: usize, _token: u32) -> bool {
        false
    }
    /// Ends the recording that [`Backend::graph_begin`] started and runs the recorded work once
    /// (the step's own result). Returns the graph for replay at later positions, or `None` when
    /// the step could not be recorded for replay (it allocated, or used a position-dependent
    /// path the graph cannot replay).
    fn graph_end(&self) -> Option<Box<dyn StepGraph>> {
        None
    }

    /// A copy of `b`.
    fn dup(&self, b: &Buf) -> Buf {
        let mut out = self.alloc(b.len());
        self.copy(b, 0, &mut out, 0, b.len());
        out
    }
    /// One line on how the ranks are placed (device, ranks per GPU, collective), for the terminal.
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// Time spent in the all-reduce since the last reset, where the backend keeps it.
    fn comm_stats(&self) -> Option<CommStats> {
        None
    }
    fn reset_comm_stats(&self) {}
    /// Empties the kernel trace (see [`BlockTrace`]); false where the backend keeps none (built
    /// without it, or the CPU).
    fn kernel_trace_reset(&self) -> bool {
        false
    }
    /// The blocks the kernel trace recorded since [`Backend::kernel_trace_reset`] (waits for the
    /// work in flight), and how many it had no room for; `None` where the backend keeps none.
    fn kernel_trace_take(&self) -> Option<(Vec<BlockTrace>, usize)> {
        None
    }
}

/// One block of a traced kernel launch (`bench --trace`; on CUDA, `EngineOptions::kernel_trace`):
/// device timestamps in ns, on one clock for every SM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockTrace {
    /// What the kernel is (e.g. "gemv", "attention"): the backend's name for the kernel family.
    pub kernel: &'static str,
    pub block: u32,
    /// Blocks in the launch.
    pub grid: u32,
    /// The multiprocessor the block ran on.
    pub sm: u32,
    pub start: u64,
    /// When the block's wait for the kernel before it returned (programmatic dependent launch),
    /// if it waited.
    pub wait: Option<u64>,
    pub end: u64,
}

/// A decode step's device work, recorded once by [`Backend::graph_begin`]/[`Backend::graph_end`]
/// and replayed: the same kernels on the same buffers, with the position and the token read from
/// device memory. Valid while the buffers it recorded stay where they are (the engine drops it on any
/// other kind of step).
pub trait StepGraph: Send {
    /// Runs the recorded step again for `token` at position `pos0` (its KV rows land there).
    fn replay(&self, pos0: usize, token: u32);
    /// True when a step at `pos0` fits what was recorded (the KV caches' capacity and the
    /// attention's shared memory); otherwise the engine records a new graph.
    fn fits(&self, pos0: usize) -> bool;
}

/// The host backend: ranks are threads, ops are the rayon kernels.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

/// A dense SwiGLU FFN, `out[n, down.rows] = (silu(h·gateᵀ) ⊙ h·upᵀ)·downᵀ`, from the trait's ops:
/// `linear_many` of `ws` = [gate, up], `swiglu`, then `linear` of down.
pub(crate) fn ffn_swiglu<B: Backend + ?Sized>(be: &B, h: &Buf, n: usize, ws: [WeightRef<'_>; 3], out: &mut Buf) {
    let [gate, up, down] = ws;
    let mut g = be.alloc(n * gate.rows());
    let mut u = be.alloc(n * up.rows());
    be.linear_many(h, n, &[gate, up], &mut [&mut g, &mut u]);
    be.swiglu(&mut g, &u);
    be.linear(&g, n, down, out);
}

/// `Backend::rope_qk_cache` composed of its parts: `rope_qk`, then `kv_write` of k and of v (the
/// default, and a backend's fallback for shapes its fused launch does not take).
pub(crate) fn rope_qk_then_append<B: Backend + ?Sized>(
    be: &B,
    q: &mut Buf,
    k: &mut Buf,
    v: &Buf,
    v_width: usize,
    rope: QkRope<'_>,
    caches: [&mut Buf; 2],
) {
    let [kc, vc] = caches;
    be.rope_qk(q, rope.q, k, rope.k, rope.pos0, rope.base, rope.style, rope.freqs);
    be.kv_write(kc, k, rope.k.n_heads * rope.k.head_stride, rope.pos0, rope.pos0);
    be.kv_write(vc, v, v_width, rope.pos0, rope.pos0);
}

/// `f` on `x`'s values on the host, then written back: the default of the ops a backend has no
/// kernel for (nothing may be recording: the download waits for the device).
fn host_round_trip<B: Backend + ?Sized>(be: &B, x: &mut Buf, f: impl FnOnce(&mut [f32])) {
    let mut v = be.download(x);
    f(&mut v);
    let u = be.upload(&v);
    be.copy(&u, 0, x, 0, v.len());
}

fn h(b: &Buf) -> &[f32] {
    b.as_host()
}

fn hm(b: &mut Buf) -> &mut Vec<f32> {
    b.as_host_mut()
}

/// The host embedding gather (also the CUDA self-check's slow side).
pub fn embed_rows_host(w: WeightRef<'_>, rows: &[Option<usize>], out: &mut [f32]) {
    let cols = w.cols();
    for (o, r) in out.chunks_exact_mut(cols.max(1)).zip(rows) {
        match (r, w) {
            (None, _) => o.fill(0.0),
            (Some(r), WeightRef::F32(m)) => o.copy_from_slice(m.row(*r)),
            (Some(r), WeightRef::Quant(q)) => {
                crate::dequant::dequantize(q.ty, &q.bytes[r * q.row_bytes..(r + 1) * q.row_bytes], o)
                    .expect("weight shard lengths are checked at load")
            }
        }
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn alloc(&self, len: usize) -> Buf {
        Buf::host(vec![0.0; len])
    }
    fn upload(&self, data: &[f32]) -> Buf {
        Buf::host(data.to_vec())
    }
    fn download(&self, b: &Buf) -> Vec<f32> {
        h(b).to_vec()
    }
    fn fill(&self, b: &mut Buf, value: f32) {
        hm(b).fill(value)
    }
    fn round_to(&self, b: &mut Buf, dtype: ComputeDtype) {
        dtype.round_slice(hm(b))
    }
    fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize) {
        hm(dst)[dst_off..dst_off + len].copy_from_slice(&h(src)[src_off..src_off + len])
    }
    fn copy_cols(&self, src: &Buf, src_width: usize, col0: usize, n_cols: usize, dst: &mut Buf) {
        for (row, o) in h(src).chunks_exact(src_width).zip(hm(dst).chunks_exact_mut(n_cols)) {
            o.copy_from_slice(&row[col0..col0 + n_cols]);
        }
    }
    fn add_assign(&self, x: &mut Buf, a: &Buf, f16_round: bool) {
        for (xv, &av) in hm(x).iter_mut().zip(h(a)) {
            *xv += av;
            if f16_round {
                *xv = f16::from_f32(*xv).to_f32();
            }
        }
    }
    fn gather_rows(&self, x: &Buf, width: usize, rows: &[usize]) -> Buf {
        let x = h(x);
        Buf::host(
            rows.iter()
                .flat_map(|&t| x[t * width..(t + 1) * width].to_vec())
                .collect(),
        )
    }
    fn add_rows_scaled(&self, out: &mut Buf, y: &Buf, width: usize, rows: &[usize], weights: &[f32]) {
        let out = hm(out);
        for ((&t, &w), yr) in rows.iter().zip(weights).zip(h(y).chunks_exact(width)) {
            for (o, &v) in out[t * width..(t + 1) * width].iter_mut().zip(yr) {
                *o += w * v;
            }
        }
    }
    fn kv_write(&self, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, slot0: usize) {
        let (c, new) = (hm(cache), h(new));
        c.truncate(pos0 * width);
        c.resize(pos0 * width + new.len(), 0.0);
        c[slot0 * width..slot0 * width + new.len()].copy_from_slice(new);
    }
    fn linear(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf) {
        cpu_ops::matmul_any(h(x), n, w, hm(out))
    }
    fn rms_norm(&self, x: &Buf, weight: &[f32], eps: f32, out: &mut Buf) {
        cpu_ops::rms_norm(h(x), weight, eps, hm(out))
    }
    fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>) {
        cpu_ops::rope_scaled(hm(x), layout, pos0, base, style, freqs)
    }
    fn swiglu(&self, gate: &mut Buf, up: &Buf) {
        cpu_ops::swiglu(hm(gate), h(up))
    }
    fn geglu(&self, gate: &mut Buf, up: &Buf) {
        cpu_ops::geglu(hm(gate), h(up))
    }
    fn add_bias(&self, y: &mut Buf, bias: &[f32]) {
        for row in hm(y).chunks_exact_mut(bias.len().max(1)) {
            row.iter_mut().zip(bias).for_each(|(a, &b)| *a += b);
        }
    }
    fn scale(&self, x: &mut Buf, s: f32) {
        hm(x).iter_mut().for_each(|a| *a *= s)
    }
    fn softcap(&self, x: &mut Buf, cap: f32) {
        hm(x).iter_mut().for_each(|a| *a = cpu_ops::softcap(*a, cap))
    }
    fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) {
        cpu_ops::gqa_attention(h(q), h(k), h(v), pos0, shape, hm(out))
    }
    fn mla_attention(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, pos0: usize, shape: MlaShape, out: &mut Buf) {
        cpu_ops::mla_attention(h(q), h(k_nope), h(k_pe), h(v), pos0, shape, hm(out))
    }
    fn mla_attention_sparse(
        &self,
        q: &Buf,
        k_nope: &Buf,
        k_pe: &Buf,
        v: &Buf,
        shape: MlaShape,
        keys: &Buf,
        top_k: usize,
        out: &mut Buf,
    ) {
        dsa::mla_attention_sparse(h(q), h(k_nope), h(k_pe), h(v), shape, h(keys), top_k, hm(out))
    }
    fn layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf) {
        dsa::layer_norm(h(x), weight, bias, eps, hm(out))
    }
    fn index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, shape: IndexShape, out: &mut Buf) {
        dsa::index_scores(h(q), h(k), h(w), pos0, shape, hm(out))
    }
    fn fp8_groups(&self, x: &mut Buf, width: usize) {
        dsa::fp8_groups(hm(x), width)
    }
    fn all_reduce(&self, partials: &[&Buf]) -> Vec<Buf> {
        let parts: Vec<&[f32]> = partials.iter().map(|p| h(p)).collect();
        vec![Buf::host(crate::collective::all_reduce(&parts))]
    }
    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut Buf) {
        embed_rows_host(w, rows, hm(out))
    }
}

/// Wall time spent in the all-reduce: `total` is the whole call (uploads of the partials, the
/// collective, the download of the sum); `collective` is the part between the launch of the
/// collective and its completion (NCCL only; zero for the simulated ranks' device sum).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CommStats {
    pub calls: u64,
    pub total_s: f64,
    pub collective_s: f64,
}

/// A thread-safe accumulator of [`CommStats`].
#[derive(Debug, Default)]
pub struct CommClock {
    calls: std::sync::atomic::AtomicU64,
    total_ns: std::sync::atomic::AtomicU64,
    collective_ns: std::sync::atomic::AtomicU64,
}

impl CommClock {
    pub fn add(&self, total: std::time::Duration, collective: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.total_ns.fetch_add(total.as_nanos() as u64, Relaxed);
        self.collective_ns.fetch_add(collective.as_nanos() as u64, Relaxed);
    }
    pub fn read(&self) -> CommStats {
        use std::sync::atomic::Ordering::Relaxed;
        CommStats {
            calls: self.calls.load(Relaxed),
            total_s: self.total_ns.load(Relaxed) as f64 * 1e-9,
            collective_s: self.collective_ns.load(Relaxed) as f64 * 1e-9,
        }
    }
    pub fn reset(&self) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.store(0, Relaxed);
        self.total_ns.store(0, Relaxed);
        self.collective_ns.store(0, Relaxed);
    }
}

thread_local! {
    static CURRENT_RANK: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// Runs `f` as rank `rank_idx`: a backend with one device per rank (`cuda-nccl`) sends the ops
/// that `f` issues on this thread to that rank's GPU. Backends with one device ignore it.
pub fn as_rank<T>(rank_idx: usize, f: impl FnOnce() -> T) -> T {
    let prev = CURRENT_RANK.with(|c| c.replace(rank_idx));
    let out = f();
    CURRENT_RANK.with(|c| c.set(prev));
    out
}

/// The rank the calling thread works for (see [`as_rank`]).
pub fn current_rank() -> usize {
    CURRENT_RANK.with(|c| c.get())
}
