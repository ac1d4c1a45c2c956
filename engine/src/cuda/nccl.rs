//! Multi-GPU tensor parallelism (feature `cuda`): one rank per GPU in one process, the
//! all-reduce through NCCL (cudarc's bindings, `ncclCommInitAll` over devices 0..tp).
//!
//! [`crate::cuda::backend_for`] picks the mode for `--backend cuda --tp N` ([`RankMode`]):
//! - `cuda-nccl` (real ranks) when 1 < N ≤ the device count: rank r's ops run on GPU r (the
//!   engine tags each rank's work with [`crate::backend::as_rank`]), so rank r's weight shards are
//!   uploaded to GPU r only (each GPU holds only its part), and the all-reduce is an NCCL sum.
//! - `cuda` (simulated ranks) otherwise: every rank on GPU 0, separate streams, the fixed-order
//!   device-side sum (see [`crate::cuda`]).
//!
//! [`RankMode::Simulated`] forces simulated ranks; [`RankMode::Nccl`] forces real ranks (also at
//! TP 1: an NCCL communicator of one rank), and fails if there are too few GPUs.
//!
//! What stays the same: the model code, taps (per rank, downloaded from that rank's GPU), the
//! canary and every fault. Activations and KV caches stay on each rank's GPU (as with simulated
//! ranks). The all-reduce runs one grouped `ncclAllReduce(sum)` over the ranks' device partials
//! on NCCL's streams (each joined to its GPU's stream before and after, so no host round trip),
//! and gives each rank the sum on its own GPU. The logits gather stays on the host (the lm_head
//! slices come back to the host anyway).
//! At TP 2 the NCCL sum is `p0 + p1` (fp addition commutes), bitwise the simulated ranks' sum; at
//! TP > 2 NCCL's ring order may differ from rank order by an ulp.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before the communicator is made
//! unless the environment already sets it.

use super::CudaBackend;
use crate::backend::{current_rank, Backend, Buf, CommClock, CommStats};
use crate::cpu_ops::{GqaShape, MlaShape, QkRope, RopeFreqs, RopeLayout, RopeStyle, WeightRef};
use crate::dsa::IndexShape;
use crate::moe_route::Route;
use crate::options::{ComputeDtype, CudaOptions, RankMode};
use crate::EngineError;
use cudarc::nccl::safe::{group_end, group_start, Comm, ReduceOp};
use references::config::MoeConfig;
use std::sync::Mutex;
use std::time::{Duration, Instant};

fn ok<T>(r: Result<T, cudarc::driver::DriverError>) -> T {
    r.unwrap_or_else(|e| panic!("cuda: {e}"))
}

fn nccl<T>(r: Result<T, cudarc::nccl::result::NcclError>) -> T {
    r.unwrap_or_else(|e| panic!("nccl: {e:?}"))
}

/// The communicators, one per rank. NCCL communicators are used from one thread at a time here
/// (the engine's driver thread, under the mutex).
struct Comms(Vec<Comm>);
// SAFETY: a communicator is a handle NCCL lets any thread use, one thread at a time; the mutex
// around `Comms` gives that.
unsafe impl Send for Comms {}

/// Whether `--backend cuda` runs real ranks (NCCL), from the mode asked for and the device count.
pub(crate) fn wants_real_ranks(mode: RankMode, tp: usize, n_devices: usize) -> Result<bool, EngineError> {
    match mode {
        RankMode::Simulated => Ok(false),
        RankMode::Nccl if tp <= n_devices => Ok(true),
        RankMode::Nccl => Err(EngineError::Cuda(format!(
            "--ranks nccl wants one GPU per rank: TP {tp} but {n_devices} device(s)"
        ))),
        RankMode::Auto => Ok(tp > 1 && tp <= n_devices),
    }
}

/// One rank per GPU; the all-reduce over NCCL.
pub struct NcclBackend {
    devs: Vec<CudaBackend>,
    comms: Mutex<Comms>,
    clock: CommClock,
    describe: String,
}

impl NcclBackend {
    /// Opens devices 0..tp, compiles the kernels on each, and makes the communicators.
    pub fn new(tp: usize, opts: &CudaOptions) -> Result<NcclBackend, EngineError> {
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // Before NCCL reads its environment; NVLink multicast must stay off on shared hosts.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let devs = (0..tp)
            .map(|d| CudaBackend::on_device(d, opts))
            .collect::<Result<Vec<_>, _>>()?;
        let streams = devs
            .iter()
            .map(|d| d.context().new_stream())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::Cuda(format!("NCCL streams: {e}")))?;
        let comms = std::panic::catch_unwind(|| Comm::from_devices(streams))
            .map_err(|_| EngineError::Cuda("NCCL: libnccl not found (is NCCL installed?)".into()))?
            .map_err(|e| EngineError::Cuda(format!("NCCL init over {tp} GPU(s): {e:?}")))?;
        let (name, _) = devs[0].device();
        let describe = format!(
            "cuda-nccl: {tp} rank(s), one per GPU ({tp} x {name}), all-reduce over NCCL (NCCL_NVLS_ENABLE={})",
            std::env::var("NCCL_NVLS_ENABLE").unwrap_or_default()
        );
        Ok(NcclBackend {
            devs,
            comms: Mutex::new(Comms(comms)),
            clock: CommClock::default(),
            describe,
        })
    }

    /// The calling rank's GPU.
    fn dev(&self) -> &CudaBackend {
        &self.devs[current_rank().min(self.devs.len() - 1)]
    }

    /// Sum over NCCL into one new buffer per rank (on that rank's GPU); returns the sums and the
    /// time from the collective's launch to its end (the NCCL streams are synchronized for the
    /// figure, the GPUs' own streams are not).
    fn nccl_sum(&self, partials: &[&Buf]) -> (Vec<Buf>, Duration) {
        let len = partials[0].len();
        let mut sums: Vec<Buf> = self.devs.iter().map(|d| d.alloc(len)).collect();
        if len == 0 {
            return (sums, Duration::ZERO);
        }
        let comms = self.comms.lock().expect("nccl comms");
        for (c, d) in comms.0.iter().zip(&self.devs) {
            ok(c.stream().join(&d.stream()));
        }
        let t0 = Instant::now();
        nccl(group_start());
        for ((c, p), out) in comms.0.iter().zip(partials).zip(sums.iter_mut()) {
            let send = super::dev_view(p);
            let mut recv = super::dev_view_mut(out);
            nccl(c.all_reduce(&send, &mut recv, &ReduceOp::Sum));
        }
        nccl(group_end());
        for c in &comms.0 {
            ok(c.stream().synchronize());
        }
        let collective = t0.elapsed();
        for (c, d) in comms.0.iter().zip(&self.devs) {
            ok(d.stream().join(&c.stream()));
        }
        (sums, collective)
    }
}

/// Forwards each listed [`Backend`] op to the calling rank's GPU (`NcclBackend::dev`): every op
/// but the all-reduce runs there unchanged.
macro_rules! on_rank_gpu {
    ($(fn $name:ident(&self $(, $arg:ident: $ty:ty)*) $(-> $ret:ty)?;)*) => {
        $(fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
            self.dev().$name($($arg),*)
        })*
    };
}

/// What differs from the CUDA backend: the name, ranks on several GPUs (so `parallel_ranks` stays
/// false: one driver thread enqueues every rank's work), and the all-reduce over NCCL with its
/// clock. Decode graphs and the kernel trace keep the trait's defaults (off).
impl Backend for NcclBackend {
    fn name(&self) -> &'static str {
        "cuda-nccl"
    }
    fn describe(&self) -> String {
        self.describe.clone()
    }
    fn parallel_ranks(&self) -> bool {
        false
    }
    fn all_reduce(&self, partials: &[&Buf]) -> Vec<Buf> {
        let t0 = Instant::now();
        let (out, collective) = self.nccl_sum(partials);
        self.clock.add(t0.elapsed(), collective);
        out
    }
    fn comm_stats(&self) -> Option<CommStats> {
        Some(self.clock.read())
    }
    fn reset_comm_stats(&self) {
        self.clock.reset()
    }

    on_rank_gpu! {
        fn alloc(&self, len: usize) -> Buf;
        fn zeros(&self, len: usize) -> Buf;
        fn upload(&self, data: &[f32]) -> Buf;
        fn download(&self, b: &Buf) -> Vec<f32>;
        fn fill(&self, b: &mut Buf, value: f32);
        fn round_to(&self, b: &mut Buf, dtype: ComputeDtype);
        fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize);
        fn copy_cols(&self, src: &Buf, src_width: usize, col0: usize, n_cols: usize, dst: &mut Buf);
        fn add_assign(&self, x: &mut Buf, a: &Buf, f16_round: bool);
        fn gather_rows(&self, x: &Buf, width: usize, rows: &[usize]) -> Buf;
        fn add_rows_scaled(&self, out: &mut Buf, y: &Buf, width: usize, rows: &[usize], weights: &[f32]);
        fn kv_write(&self, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, slot0: usize);
        fn linear(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf);
        fn linear_many(&self, x: &Buf, n: usize, ws: &[WeightRef<'_>], outs: &mut [&mut Buf]);
        fn rms_norm(&self, x: &Buf, weight: &[f32], eps: f32, out: &mut Buf);
        fn add_rms_norm(&self, x: &mut Buf, a: &Buf, f16_round: bool, weight: &[f32], eps: f32, out: &mut Buf);
        fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>);
        fn moe_route(&self, logits: &Buf, n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route>;
        fn rope_qk(&self, q: &mut Buf, q_layout: RopeLayout, k: &mut Buf, k_layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>);
        fn rope_qk_cache(&self, q: &mut Buf, k: &mut Buf, v: &Buf, v_width: usize, rope: QkRope<'_>, caches: [&mut Buf; 2]);
        fn linear_qkv_rope(&self, x: &Buf, n: usize, ws: [WeightRef<'_>; 3], outs: [&mut Buf; 3], rope: QkRope<'_>, caches: [&mut Buf; 2]);
        fn swiglu(&self, gate: &mut Buf, up: &Buf);
        fn geglu(&self, gate: &mut Buf, up: &Buf);
        fn add_bias(&self, y: &mut Buf, bias: &[f32]);
        fn scale(&self, x: &mut Buf, s: f32);
        fn softcap(&self, x: &mut Buf, cap: f32);
        fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf);
        fn mla_attention(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, pos0: usize, shape: MlaShape, out: &mut Buf);
        fn mla_attention_sparse(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, shape: MlaShape, keys: &Buf, top_k: usize, out: &mut Buf);
        fn layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf);
        fn index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, shape: IndexShape, out: &mut Buf);
        fn fp8_groups(&self, x: &mut Buf, width: usize);
        fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut Buf);
        fn embed_token(&self, w: WeightRef<'_>, token: u32, vocab_start: usize, out: &mut Buf);
    }
}

#[cfg(test)]
mod tests {
    use super::wants_real_ranks;
    use crate::options::RankMode;

    #[test]
    fn mode_selection() {
        assert!(!wants_real_ranks(RankMode::Auto, 1, 2).unwrap());
        assert!(wants_real_ranks(RankMode::Auto, 2, 2).unwrap());
        assert!(!wants_real_ranks(RankMode::Auto, 4, 2).unwrap());
        assert!(!wants_real_ranks(RankMode::Auto, 2, 0).unwrap());
        assert!(!wants_real_ranks(RankMode::Simulated, 2, 2).unwrap());
        assert!(wants_real_ranks(RankMode::Nccl, 1, 2).unwrap());
        assert!(wants_real_ranks(RankMode::Nccl, 4, 2).is_err());
    }
}
