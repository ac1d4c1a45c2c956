//! The fused one-token SwiGLU FFN on CUDA (`ffn_q4k_*` in `kernels/quant.cu`), opt-in:
//! `Backend::ffn_swiglu` for a decode step whose gate, up and down are Q4_K, in one persistent
//! launch: a block a SM, the weights of both products streamed through one ring of bulk copies
//! (TMA) in shared memory, gate/up's rows paired so that each group's store is SwiGLU's output,
//! a grid barrier, then down on SwiGLU's limbs, made in every block. The kernel's comment has the
//! whole scheme.
//!
//! Why it was tried: op by op (gate/up GEMV, SwiGLU, down GEMV), each GEMV's weights start to
//! stream only as the kernel before it places its blocks, and SwiGLU's launch sits between them
//! with HBM idle. Here the copy warp never waits for anything but a free stage.
//!
//! What it measured (H200, 8B shape at depth 512, `tests/gpu/h200-results/round23`): exact to
//! 1.9e-6 of the CPU engine, but the step is 9–10 % slower than op by op (2.13 against 1.95 ms).
//! Traced, its gate/up half ends 17.9 µs after the norm before it, where the op-by-op gate/up
//! and SwiGLU take 23.2 µs; the loss is the grid barrier (2.3 µs), the down half (15 µs against
//! the GEMV's 10.5 µs) and the kernels around it, which lose their early placement beside a grid
//! that holds every SM. With down left to the default GEMV (variants with RB 0) it is no faster.
//!
//! Selection: off unless `LLMDIFF_FFN` is set: `1` takes [`DEFAULT`], `p<P>r<RB>a<SA>b<SB>` a
//! variant (P gate and P up rows a stage; RB down rows a stage, 0 for the default GEMV on
//! SwiGLU's output; SA and SB warp groups a team in each product). Shapes it does not take (other
//! types, n > 1, rows not a multiple of 256 values, wider than its warps cover) go op by op.
//! `kernels --check` runs every variant against the CPU engine whatever the setting.

use super::{
    compare, dev, dev_mut, limbs_of, limbs_words, noise, test_bytes, test_weight, CudaBackend, KernelCheck, RawArgs,
};
use crate::backend::{ffn_swiglu_ops, Backend, Buf, CpuBackend};
use crate::cuda_kernels::{ffn_entry as entry, FfnVariant, FFN_VARIANTS};
use crate::kernels::WeightRef;
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::LaunchConfig;
use references::GgmlType;

/// The variant `LLMDIFF_FFN=1` (or an unknown name) takes: the fastest in round 23.
const DEFAULT: FfnVariant = (4, 2, 4, 1);
/// Compute warps a block (`FFN_WARPS`), plus the copy warp.
const WARPS: usize = 16;
/// Most ring stages a block keeps.
const MAX_STAGES: usize = 32;

/// Teams of a product whose rows are `units` pair units, S warp groups a team (the kernel's
/// `ffn_teams`); 0 when one team does not fit the compute warps.
fn teams(units: usize, s: usize) -> usize {
    let fit = WARPS / (units.div_ceil(32).max(2) * s);
    [8, 4, 2, 1, 0].into_iter().find(|&t| t <= fit).unwrap_or(0)
}

/// The variant `LLMDIFF_FFN` asks for (`p<P>r<RB>a<SA>b<SB>`, or `1` for [`DEFAULT`]): None (op by
/// op) when it is unset or `0`.
pub(super) fn from_env() -> Option<FfnVariant> {
    match std::env::var("LLMDIFF_FFN").ok().as_deref() {
        None | Some("0") => None,
        Some(v) => Some(
            FFN_VARIANTS
                .iter()
                .copied()
                .find(|(p, rb, sa, sb)| v == format!("p{p}r{rb}a{sa}b{sb}"))
                .unwrap_or(DEFAULT),
        ),
    }
}

/// Bytes of one Q4_K row of `cols` values in the device layout (144 per super-block).
fn row_bytes(cols: usize) -> usize {
    cols / 256 * 144
}

/// A stage's bytes: P gate and P up rows of `d`, or RB down rows of `f`.
fn stage_bytes((p, rb, ..): FfnVariant, d: usize, f: usize) -> usize {
    (2 * p * row_bytes(d)).max(rb * row_bytes(f))
}

/// Dynamic shared memory of variant `v` with `ns` stages: the ring, 2·ns barriers, the warps' row
/// sums (double-buffered) and SwiGLU's limbs (kernels/quant.cu's layout comment).
fn smem(v: FfnVariant, d: usize, f: usize, ns: usize) -> usize {
    ns * stage_bytes(v, d, f) + 16 * ns + 4 * 2 * WARPS * (2 * v.0).max(v.1) + 4 * limbs_words(f)
}

impl CudaBackend {
    /// `Backend::ffn_swiglu` by the fused kernel, variant `v`; false (nothing enqueued) when the
    /// shape or the types are not the kernel's.
    pub(super) fn ffn_fused(&self, h: &Buf, n: usize, ws: [WeightRef<'_>; 3], out: &mut Buf, v: FfnVariant) -> bool {
        let [gate, up, down] = ws;
        let (d, f, d_out) = (gate.cols(), gate.rows(), down.rows());
        let shape_ok = n == 1
            && ws
                .iter()
                .all(|w| matches!(w, WeightRef::Quant(q) if q.ty == GgmlType::Q4K))
            && up.rows() == f
            && up.cols() == d
            && down.cols() == f
            && d % 256 == 0
            && f % 256 == 0
            && (256..=32768).contains(&d)
            && f <= 32768
            && f % v.0 == 0
            && d_out % v.1.max(1) == 0
            && d_out > 0
            && teams(d / 64, v.2) > 0
            && teams(f / 64, v.3) > 0
            && h.len() == d
            && out.len() == d_out;
        if !shape_ok {
            return false;
        }
        let name = entry(v);
        let cap = self
            .func(&name)
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .map_or(0, |b| b.max(0) as usize);
        let fixed = smem(v, d, f, 0);
        // A multiple of 8, so of both products' team counts (the kernel's `ffn_teams`).
        let ns = (cap.saturating_sub(fixed) / (stage_bytes(v, d, f) + 16)).min(MAX_STAGES) / 8 * 8;
        let threads = ((WARPS + 1) * 32) as u32;
        if ns == 0 {
            return false;
        }
        let s = &self.stream;
        let dws = ws.map(|w| self.weight(w, s));
        if dws.iter().any(|w| w.ty != GgmlType::Q4K) {
            return false;
        }
        let limbs = self.x_limbs(s, dev(h), d, limbs_of(h, d));
        let mut act = self.new_buf(f);
        // RB 0: the kernel makes SwiGLU's limbs (into `aq`) and the default GEMV does down.
        let mut aq = (v.1 == 0).then(|| self.new_buf(limbs_words(f)));
        let mut a = RawArgs::default();
        a.buf(&dws[0].data)
            .buf(&dws[1].data)
            .buf(&dws[2].data)
            .buf(limbs.get())
            .buf(dev_mut(&mut act))
            .buf(match &mut aq {
                Some(q) => dev_mut(q),
                None => dev_mut(out),
            })
            .buf(&*self.ffn_bar)
            .i32(d as i32)
            .i32(f as i32)
            .i32(d_out as i32)
            .i32(ns as i32);
        let cfg = LaunchConfig {
            grid_dim: (self.sms, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem(v, d, f, ns) as u32,
        };
        // SAFETY: matches ffn_q4k_* in kernels/quant.cu (whose compute warps wait before reading
        // hq or writing; the copy warp reads only weights): gate and up f rows of d values, down
        // d_out rows of f, all Q4_K in the device layout; hq limbs_words(d) words; act f floats,
        // out d_out; the barrier's count, which every launch of this backend's grid size draws on;
        // a grid of as many blocks as SMs, each SM able to hold one (launch bounds and shared
        // memory sized for it), and all of this device's work on one stream, so every block is
        // resident at once for the grid barrier.
        unsafe { self.launch_chained(&name, cfg, &mut a) };
        drop(limbs);
        if let Some(q) = aq {
            super::attach_limbs(&mut act, Some(q));
            self.linear(&act, 1, down, out);
        }
        true
    }

    /// The fused FFN against the CPU engine's op-by-op FFN (`kernels --check`): the 8B shape, a
    /// TP 2 shard of it, and a narrower one whose rows leave warps idle, every variant on one.
    pub(super) fn ffn_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let shapes = [
            (4096, 14336, 4096, DEFAULT),
            (4096, 7168, 4096, DEFAULT),
            (2048, 5632, 1024, DEFAULT),
        ];
        let all = FFN_VARIANTS.iter().map(|&v| (2048, 5632, 2048, v));
        for (d, f, d_out, v) in shapes.into_iter().chain(all) {
            let shapes = [(f, d), (f, d), (d_out, f)];
            let mats: Vec<Vec<u8>> = (0..3)
                .map(|i| test_bytes(GgmlType::Q4K, shapes[i].0, shapes[i].1, 900 + i as u64 + d as u64))
                .collect();
            let ws: Vec<WeightRef<'_>> = (0..3)
                .map(|i| test_weight(GgmlType::Q4K, &mats[i], shapes[i].0, shapes[i].1))
                .collect();
            let ws = [ws[0], ws[1], ws[2]];
            let h: Vec<f32> = noise(d, 77).iter().map(|v| 3.0 * v).collect();
            let case = format!(
                "FFN_SWIGLU_FUSED(type=q4_K,d={d},f={f},d_out={d_out},p={},rb={},sa={},sb={})",
                v.0, v.1, v.2, v.3
            );
            // Weights are cached by host address and length: this case's may sit where an earlier
            // case's (or check's) were.
            self.weights.lock().expect("weight map").clear();
            let mut o = self.alloc(d_out);
            if !self.ffn_fused(&self.upload(&h), 1, ws, &mut o, v) {
                out.push(compare(case, &[], &[0.0], 0.0));
                continue;
            }
            let gpu = self.download(&o);
            let mut c = CpuBackend.alloc(d_out);
            ffn_swiglu_ops(&CpuBackend, &CpuBackend.upload(&h), 1, ws, &mut c);
            out.push(compare(case, &gpu, &CpuBackend.download(&c), 1e-5));
        }
        out
    }
}
