//! The backend seam: the primitive ops the model code is written over, once, for every backend.
//! [`CpuBackend`] runs them on the host with the kernels in [`crate::kernels`]; `CudaBackend`
//! (feature `cuda`, in `crate::cuda`) implements the same trait with NVRTC kernels from `kernels/`.
//!
//! Custom ops with caller-allocated outputs (attention, the MoE mix) are composed in the model
//! code from these primitives; their output-buffer contract lives there, not here.

use crate::kernels::{self, GqaShape, MlaShape, RopeLayout, RopeStyle, WeightRef};

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

/// The primitive ops. Every op writes all of its `out`.
pub trait Backend: Send + Sync {
    fn name(&self) -> &'static str;
    /// `out[n, w.rows] = x[n, w.cols] · wᵀ`.
    fn linear(&self, x: &[f32], n: usize, w: WeightRef<'_>, out: &mut [f32]);
    /// RMSNorm over rows of `weight.len()`.
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]);
    /// RoPE in place; row i is at position `pos0 + i`.
    fn rope(&self, x: &mut [f32], layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle);
    /// `gate = silu(gate)·up`.
    fn swiglu(&self, gate: &mut [f32], up: &[f32]);
    /// Causal GQA attention over a KV cache into `out` `[n, H·hd]`.
    fn gqa_attention(&self, q: &[f32], k: &[f32], v: &[f32], pos0: usize, shape: GqaShape, out: &mut [f32]);
    /// Causal MLA attention over an expanded cache into `out` `[n, H·v]`.
    #[allow(clippy::too_many_arguments)]
    fn mla_attention(
        &self,
        q: &[f32],
        k_nope: &[f32],
        k_pe: &[f32],
        v: &[f32],
        pos0: usize,
        shape: MlaShape,
        out: &mut [f32],
    );
    /// Sum all-reduce of the ranks' partials in fixed order: rank 0 + rank 1 + ....
    fn all_reduce(&self, partials: &[Vec<f32>]) -> Vec<f32> {
        crate::engine::all_reduce(partials)
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
    /// Embedding gather: row `rows[t]` of `w` decoded into `out[t]`, or zeros for `None` (a token
    /// outside this rank's vocab range).
    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut [f32]) {
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
}

/// The host backend: ranks are threads, ops are the rayon kernels.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuBackend;

impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }
    fn linear(&self, x: &[f32], n: usize, w: WeightRef<'_>, out: &mut [f32]) {
        kernels::matmul_any(x, n, w, out)
    }
    fn rms_norm(&self, x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
        kernels::rms_norm(x, weight, eps, out)
    }
    fn rope(&self, x: &mut [f32], layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle) {
        kernels::rope(x, layout, pos0, base, style)
    }
    fn swiglu(&self, gate: &mut [f32], up: &[f32]) {
        kernels::swiglu(gate, up)
    }
    fn gqa_attention(&self, q: &[f32], k: &[f32], v: &[f32], pos0: usize, shape: GqaShape, out: &mut [f32]) {
        kernels::gqa_attention(q, k, v, pos0, shape, out)
    }
    fn mla_attention(
        &self,
        q: &[f32],
        k_nope: &[f32],
        k_pe: &[f32],
        v: &[f32],
        pos0: usize,
        shape: MlaShape,
        out: &mut [f32],
    ) {
        kernels::mla_attention(q, k_nope, k_pe, v, pos0, shape, out)
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
