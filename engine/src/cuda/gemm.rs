//! The tensor-core GEMM for prefill (`kernels/gemm.cu`, [`KernelId::Gemm`]): which products take
//! it, its launch (the x pre-pass, then the tiled `mma.sync` kernel), its checks against the CPU
//! engine, and its benchmark beside the warp-per-row matmul.
//!
//! Selection: a product of n > 1 tokens with a Q4_K (cols % 256 == 0), Q6_K (cols % 2048 == 0:
//! rows of 16-byte multiples), Q8_0, Q4_1 or F16 (cols % 64 == 0) weight in its device layout,
//! unless `LLMDIFF_CUDA_DISABLE=gemm`; everything else (F32, BF16, the other quant types) keeps the
//! f32 SIMT `matmul_*` of `kernels/gemv.cu`. Kernels:
//! - v2 (the default; Q4_K and Q6_K, other types take v1): `gemm2_q4_k` / `gemm2_q6_k`, 128 rows
//!   × 128 tokens per block, `cp.async` stages, quants dequantized from shared memory straight
//!   into the MMA fragments, or `gemm2_q*_k_n64` (64 tokens), and K split in two (the output
//!   zeroed, then added into), when the grid would leave SMs idle (picked per launch by
//!   [`gemm2_tile`]; the checks and benches force each). Up to
//!   three weights of one type that share x (`linear_many`: q/k/v, gate/up) go in one launch; a
//!   Q4_K_M layer's q, k (Q4_K) and v (Q6_K) take a pre-pass and launch per type, each with the
//!   tile and split for its own row tiles (Q6_K's pre-pass orders x so that each k16 tile is one
//!   run of 16, one Q6_K scale).
//! - v1 (Q8_0, Q4_1, F16): `gemm_<type>`, 128 rows × 64 tokens, or 32 (`gemm_<type>_n32`, fewer
//!   registers, two blocks per SM; the checks and benches only).
//!
//! Either way the x pre-pass runs once per x, however many weights share it. Precision: the
//! weights' integers are exact in f16, each token's x is scaled by a power of two and split into
//! two f16s (x_hi + x_lo, 22 bits), the tensor cores accumulate in f32, block scales and offsets
//! are applied in f32 (see `kernels/gemm.cu`).

use super::{compare, dev, dev_mut, noise, ok, test_bytes, test_weight, Case, CudaBackend, DevWeight, KernelCheck};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::cpu_ops::WeightRef;
use crate::EngineError;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use references::GgmlType;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Weight-row tile (both kernels).
const GEMM_BM: usize = 128;

/// `GemmState::kind`, `GemmPlan::kind`: v1, v2.
const KIND_V1: usize = 1;
const KIND_V2: usize = 2;

/// The GEMM's settings: on (`LLMDIFF_CUDA_DISABLE=gemm` turns it off, back to the SIMT matmul),
/// the kernel (v2, or v1 forced), the token tile asked for (0: the kernel's default) and v2's K
/// split (0: by the grid, see [`gemm2_tile`]). By default v2, chosen tile and split; atomics so
/// the checks and benches can switch them.
pub(super) struct GemmState {
    on: AtomicBool,
    kind: AtomicUsize,
    bn: AtomicUsize,
    split: AtomicUsize,
    /// The device's opt-in shared memory per block: v2 tiles that need more are not used.
    smem_max: usize,
}

impl GemmState {
    pub(super) fn new(on: bool, smem_max: usize) -> GemmState {
        GemmState {
            on: AtomicBool::new(on),
            kind: AtomicUsize::new(KIND_V2),
            bn: AtomicUsize::new(0),
            split: AtomicUsize::new(0),
            smem_max,
        }
    }

    /// Sets (on, kind, bn, split), returning the previous settings.
    fn set(&self, s: GemmSetting) -> GemmSetting {
        (
            self.on.swap(s.0, Ordering::Relaxed),
            self.kind.swap(s.1, Ordering::Relaxed),
            self.bn.swap(s.2, Ordering::Relaxed),
            self.split.swap(s.3, Ordering::Relaxed),
        )
    }
}

/// The v1 GEMM entry for a weight in its device layout, if the type and shape qualify.
pub(super) fn gemm_entry_for(w: &DevWeight, cols: usize) -> Option<&'static str> {
    if cols == 0 {
        return None;
    }
    match w.ty {
        GgmlType::Q4K if cols % 256 == 0 && w.row_bytes == cols / 256 * 144 => Some("gemm_q4_k"),
        GgmlType::Q8_0 if cols % 64 == 0 && w.row_bytes == cols / 32 * 34 => Some("gemm_q8_0"),
        GgmlType::Q4_1 if cols % 64 == 0 && w.row_bytes == cols / 32 * 20 => Some("gemm_q4_1"),
        GgmlType::F16 if cols % 64 == 0 && w.row_bytes == cols * 2 => Some("gemm_f16"),
        // 16-byte quant loads, as the GEMV's (rows of a multiple of 8 super-blocks).
        GgmlType::Q6K if cols % 256 == 0 && w.row_bytes == cols / 256 * 210 && w.row_bytes % 16 == 0 => {
            Some("gemm_q6_k")
        }
        _ => None,
    }
}

/// How products of n > 1 tokens that share x run: `kind` v2 with token tile `bn` (128 or 64), or v1 with `bn` (64 or 32); v2 splits K in `splits` (1 or 2; the others 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GemmPlan {
    kind: usize,
    splits: usize,
    bn: usize,
}

/// Dynamic shared memory of `gemm2_q4_k` (bn 128) or `gemm2_q4_k_n64`, or of `gemm2_q6_k[_n64]`
/// (`q6`): `G2<TY, NI>::SMEM` in kernels/gemm.cu. Q4_K: five stages of 128 rows × 32 quant bytes and bn tokens × 256 bytes of x, two
/// buffers of 128 16-byte headers, of bn × 64 bytes of Σx fragments and of 128 96-byte row
/// constants. Q6_K: five stages of 128 rows × 64 bytes (ql, qh) and the x tile, two buffers of
/// 128 32-byte headers and of 128 64-byte row constants. The kernel traps if it gets less.
fn gemm2_smem(bn: usize, q6: bool) -> usize {
    if q6 {
        return 5 * (GEMM_BM * 64 + bn * 256) + 2 * GEMM_BM * 32 + 2 * GEMM_BM * 64;
    }
    5 * (GEMM_BM * 32 + bn * 256) + 2 * GEMM_BM * 16 + 2 * bn * 64 + 2 * GEMM_BM * 96
}

/// Whether v2 has a kernel for weights of `ty` (Q4_K: `gemm2_q4_k*`; Q6_K: `gemm2_q6_k*`).
fn v2_type(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::Q4K | GgmlType::Q6K)
}

/// v2's token tile and K split for `tiles` row tiles of 128, n tokens and rows of `n_sb`
/// super-blocks on `sms` SMs (`bn` 128 or 64 asks for that tile, `split` 1 or 2 for that split;
/// 0 leaves it to the estimate): the (tile, split) with the smallest estimate (waves of blocks)
/// × (tokens per block) / split. 64-token blocks count 15 % less efficient per token (more
/// dequantization and fragment loads per MMA), a split of two 3 % (the output zeroed first, its
/// stores atomic). The split helps where the row tiles fill a wave and a half: the 8B's q/k/v
/// at 512 tokens (192 blocks on 132 SMs) was 212 µs at 64-token tiles on an H200.
pub(super) fn gemm2_tile(tiles: usize, n: usize, n_sb: usize, sms: usize, bn: usize, split: usize) -> (usize, usize) {
    let cost = |(bn, s): (usize, usize)| {
        let eff = if bn == 64 { 1.15 } else { 1.0 } * if s == 2 { 1.03 } else { 1.0 };
        (tiles * n.div_ceil(bn) * s).div_ceil(sms.max(1)) as f64 * bn as f64 * eff / s as f64
    };
    let mut best = None;
    for cand in [(128, 1), (64, 1), (128, 2), (64, 2)] {
        let ok = (bn == 0 || bn == cand.0) && (split == 0 || split == cand.1) && cand.1 <= n_sb.max(1);
        if ok && best.is_none_or(|b| cost(cand) < cost(b)) {
            best = Some(cand);
        }
    }
    best.unwrap_or((if bn == 64 { 64 } else { 128 }, 1))
}

/// `Gemm2Parts` in kernels/gemm.cu: up to three Q4_K weights of one width sharing x, their
/// outputs, row counts and the row-tile ends of parts 0 and 1; unused pointers are 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Gemm2Parts {
    w: [u64; 3],
    out: [u64; 3],
    rows: [i32; 3],
    tend: [i32; 2],
}

// SAFETY: #[repr(C)] plain integers laid out as the kernel's struct (six 8-byte pointers, five
// ints, padded to 72 bytes, 8-byte aligned).
unsafe impl cudarc::driver::DeviceRepr for Gemm2Parts {}

/// A prefill-shaped timing: the tensor-core GEMMs (v2 at its chosen and both token tiles, v1 at
/// both) and the SIMT matmul on the same product.
#[derive(Clone, Debug)]
pub struct GemmBench {
    pub case: String,
    /// (path, seconds per product, TFLOP/s = 2·rows·cols·n / seconds / 1e12), path `gemm2`
    /// (v2, tile chosen per launch), `gemm2_128`, `gemm2_64`, `gemm64`, `gemm32` (v1) or `simt`.
    pub paths: Vec<(String, f64, f64)>,
}

/// A product of n > 1 tokens on the GEMM: its weight, output and rows.
pub(super) type GemmPart<'a> = (&'a DevWeight, &'a mut CudaSlice<f32>, usize);

/// (on, kind, bn, split) as `GemmState` holds them.
type GemmSetting = (bool, usize, usize, usize);
/// The settings of the paths the checks and benches name: (label, setting).
type GemmPath = (&'static str, GemmSetting);
const PATHS: [GemmPath; 8] = [
    ("gemm2", (true, KIND_V2, 0, 0)),
    ("gemm2_128", (true, KIND_V2, 128, 1)),
    ("gemm2_64", (true, KIND_V2, 64, 1)),
    ("gemm2_128_k2", (true, KIND_V2, 128, 2)),
    ("gemm2_64_k2", (true, KIND_V2, 64, 2)),
    ("gemm64", (true, KIND_V1, 64, 0)),
    ("gemm32", (true, KIND_V1, 32, 0)),
    ("simt", (false, KIND_V1, 0, 0)),
];

impl CudaBackend {
    /// How products of n > 1 tokens with `ws` (weight, rows) that share x of `cols` run on the
    /// GEMM, if all of them can (`None` when off). v2 takes them when all are Q4_K or Q6_K (a
    /// launch per type) and its tile fits the device's shared memory; otherwise v1.
    pub(super) fn gemm_plan(&self, ws: &[(&DevWeight, usize)], cols: usize, n: usize) -> Option<GemmPlan> {
        let st = &self.gemm;
        if !st.on.load(Ordering::Relaxed) || n < 2 || ws.is_empty() {
            return None;
        }
        if ws.iter().any(|(w, _)| gemm_entry_for(w, cols).is_none()) {
            return None;
        }
        let bn = st.bn.load(Ordering::Relaxed);
        let kind = st.kind.load(Ordering::Relaxed);
        if kind >= KIND_V2 && ws.iter().all(|(w, _)| v2_type(w.ty)) {
            let q6 = ws.iter().any(|(w, _)| w.ty == GgmlType::Q6K);
            let tiles = ws.iter().map(|(_, r)| r.div_ceil(GEMM_BM)).sum();
            if let Some((bn, splits)) = self.v2_tile(tiles, n, cols, q6) {
                return Some(GemmPlan {
                    kind: KIND_V2,
                    bn,
                    splits,
                });
            }
        }
        Some(GemmPlan {
            kind: KIND_V1,
            bn: if bn == 32 { 32 } else { 64 },
            splits: 1,
        })
    }

    /// v2's (token tile, K split) for one launch of `tiles` row tiles (`q6`: Q6_K's kernel) at n
    /// tokens: [`gemm2_tile`]'s pick under the forced settings, or the 64-token tile where the
    /// 128-token one's shared memory does not fit (`None` if neither does).
    fn v2_tile(&self, tiles: usize, n: usize, cols: usize, q6: bool) -> Option<(usize, usize)> {
        let st = &self.gemm;
        let bn = st.bn.load(Ordering::Relaxed);
        let ask = if bn == 128 || bn == 64 { bn } else { 0 };
        let split = st.split.load(Ordering::Relaxed);
        let (bn, splits) = gemm2_tile(tiles, n, cols / 256, self.sms as usize, ask, split);
        [bn, 64]
            .into_iter()
            .find(|&b| gemm2_smem(b, q6) <= st.smem_max)
            .map(|b| (b, splits))
    }

    /// Launches the plan's x pre-pass, then its GEMM over every part (v2: a pre-pass per weight
    /// type, then up to three parts of that type a launch; v1: one pre-pass, one launch a part),
    /// on device buffers: x [n, cols], each part's out [n, rows].
    pub(super) fn launch_gemm(
        &self,
        s: &Arc<CudaStream>,
        parts: &mut [GemmPart<'_>],
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        plan: GemmPlan,
    ) {
        let v2 = plan.kind >= KIND_V2;
        // x_hi then x_lo, f16 each: n_pad·cols f32 words hold both. v1: Σx per 32 values (f32);
        // v2: 16 words of Σx fragments per 256 values. v2 sized for its larger token tile (a
        // group of one type may take another tile than the plan's).
        let tile = if v2 { 128 } else { plan.bn };
        let cap = n.div_ceil(tile) * tile;
        let mut xh = self.new_buf(cap * cols);
        let mut xs = self.new_buf(cap * (cols / if v2 { 16 } else { 32 }));
        let mut inv = self.new_buf(cap);
        let (nn, c) = (n as i32, cols as i32);
        let split_x = |name: &str, n_pad: usize, bufs: [&mut Buf; 3]| {
            let np = n_pad as i32;
            let [xh, xs, inv] = bufs;
            let mut b = s.launch_builder(self.func(name));
            b.arg(x)
                .arg(dev_mut(xh))
                .arg(dev_mut(xs))
                .arg(dev_mut(inv))
                .arg(&nn)
                .arg(&np)
                .arg(&c);
            let cfg = LaunchConfig {
                grid_dim: (n_pad as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches gemm_split_x / gemm2_split_x / gemm6_split_x in kernels/gemm.cu: x
            // has n·cols floats, xh 2·n_pad·cols halves, xs n_pad·cols/32 floats (v2: n_pad·cols/16
            // words; v2 is Q4_K and Q6_K only, cols % 256 == 0), inv n_pad floats. A later
            // pre-pass into the same buffers runs after the GEMMs before it on this stream.
            ok(unsafe { b.launch(cfg) });
        };
        if !v2 {
            let (bn, n_pad) = (plan.bn, n.div_ceil(plan.bn) * plan.bn);
            let np = n_pad as i32;
            split_x("gemm_split_x", n_pad, [&mut xh, &mut xs, &mut inv]);
            for (w, out, rows) in parts.iter_mut() {
                let entry = gemm_entry_for(w, cols).expect("gemm: plan for an unsupported weight");
                let name = if bn == 32 {
                    format!("{entry}_n32")
                } else {
                    entry.to_string()
                };
                let (r, rb) = (*rows as i32, w.row_bytes as i32);
                let mut b = s.launch_builder(self.func(&name));
                b.arg(&w.data)
                    .arg(dev(&xh))
                    .arg(dev(&xs))
                    .arg(dev(&inv))
                    .arg(&mut **out)
                    .arg(&r)
                    .arg(&c)
                    .arg(&rb)
                    .arg(&nn)
                    .arg(&np);
                let cfg = LaunchConfig {
                    grid_dim: ((n_pad / bn) as u32, rows.div_ceil(GEMM_BM) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: matches gemm_* in kernels/gemm.cu: W is rows·row_bytes in the device
                // layout (gemm_entry_for checked the type and row length), the pre-pass buffers
                // are sized for n_pad tokens, out has n·rows floats. The scratch buffers go back
                // to the pool after the launch; work on this stream that reuses them runs after
                // this kernel.
                ok(unsafe { b.launch(cfg) });
            }
            return;
        }
        let n_parts = parts.len();
        for ty in [GgmlType::Q4K, GgmlType::Q6K] {
            let mut group: Vec<&mut GemmPart<'_>> = parts.iter_mut().filter(|p| p.0.ty == ty).collect();
            if group.is_empty() {
                continue;
            }
            let q6 = ty == GgmlType::Q6K;
            // A group of some of the parts (a Q4_K_M layer's q, k and v) takes the tile and
            // split for its own row tiles.
            let (bn, splits) = if group.len() < n_parts {
                let tiles = group.iter().map(|p| p.2.div_ceil(GEMM_BM)).sum();
                self.v2_tile(tiles, n, cols, q6).unwrap_or((plan.bn, plan.splits))
            } else {
                (plan.bn, plan.splits)
            };
            let n_pad = n.div_ceil(bn) * bn;
            let np = n_pad as i32;
            let name = if q6 { "gemm6_split_x" } else { "gemm2_split_x" };
            split_x(name, n_pad, [&mut xh, &mut xs, &mut inv]);
            let name = match (q6, plan.kind, bn) {
                (true, _, 128) => "gemm2_q6_k",
                (true, _, _) => "gemm2_q6_k_n64",
                (_, _, 128) => "gemm2_q4_k",
                _ => "gemm2_q4_k_n64",
            };
            let block = if q6 { 210 } else { 144 };
            for chunk in group.chunks_mut(3) {
                let mut m = Gemm2Parts::default();
                let k = chunk.len();
                let mut guards = Vec::with_capacity(2 * k);
                let mut tiles = 0usize;
                for (i, (w, out, rows)) in chunk.iter_mut().map(|p| &mut **p).enumerate() {
                    assert!(
                        w.row_bytes == cols / 256 * block && out.len() >= n * *rows,
                        "gemm2: a part is not of this width, or its output is short"
                    );
                    // Split K: the splits add their sums into zeros.
                    if splits > 1 {
                        ok(s.memset_zeros(&mut **out));
                    }
                    let (wp, gw) = w.data.device_ptr(s);
                    let (op, go) = out.device_ptr_mut(s);
                    (m.w[i], m.out[i], m.rows[i]) = (wp, op, *rows as i32);
                    guards.push(gw);
                    guards.push(go);
                    tiles += rows.div_ceil(GEMM_BM);
                    if i < 2 {
                        m.tend[i] = tiles as i32;
                    }
                }
                for i in k..2 {
                    m.tend[i] = tiles as i32;
                }
                let mut b = s.launch_builder(self.func(name));
                b.arg(&m)
                    .arg(dev(&xh))
                    .arg(dev(&xs))
                    .arg(dev(&inv))
                    .arg(&c)
                    .arg(&nn)
                    .arg(&np);
                let cfg = LaunchConfig {
                    grid_dim: ((n_pad / bn) as u32, tiles as u32, splits as u32),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: gemm2_smem(bn, q6) as u32,
                };
                // SAFETY: matches gemm2_q4_k[_n64] / gemm2_q6_k[_n64] in kernels/gemm.cu
                // (grid z the K splits, at most the
                // row's super-blocks, with the outputs zeroed above where there are two): each
                // part's W is rows·row_bytes of this group's type in the device layout (type by
                // the filter, row length checked above; Q6_K rows a multiple of 16 bytes,
                // gemm_entry_for) and its out n·rows floats, the grid's row tiles are the parts'
                // in order (tend), the pre-pass buffers (this type's order) are sized for at least
                // n_pad tokens, and the dynamic shared memory is G2<TY, NI>::SMEM
                // (gemm2_smem; the function's limit was raised at load). The pointers stay valid
                // (and ordered on this stream) while `guards` lives, past the launch.
                ok(unsafe { b.launch(cfg) });
                drop(guards);
            }
        }
    }

    /// `Backend::linear` (one weight) or `linear_many` (`ws` of several) with the GEMM set to
    /// `path` (a `PATHS` setting), for the checks; says whether the GEMM was taken, and how.
    fn linear_path(
        &self,
        x: &Buf,
        n: usize,
        ws: &[WeightRef<'_>],
        outs: &mut [&mut Buf],
        path: GemmSetting,
    ) -> Option<GemmPlan> {
        let prev = self.gemm.set(path);
        let dws: Vec<_> = ws.iter().map(|w| self.weight(*w, &self.stream)).collect();
        let parts: Vec<_> = dws.iter().zip(ws).map(|(d, w)| (&**d, w.rows())).collect();
        let plan = self.gemm_plan(&parts, ws[0].cols(), n);
        if let ([w], [out]) = (ws, &mut *outs) {
            self.linear(x, n, *w, out);
        } else {
            self.linear_many(x, n, ws, outs);
        }
        self.gemm.set(prev);
        plan
    }

    /// The GEMM against the CPU engine: Q4_K, Q8_0, Q4_1 and F16 at row counts that are not a
    /// multiple of the 128-row tile, n = 2, 9, 17, 65, 130 (partial token tiles), one and
    /// several blocks per row, rows whose length is or is not a multiple of 16 bytes; tokens of
    /// very different magnitudes (×3e4, ×1e-6, an all-zero token, one outlier value ×100) so the
    /// per-token scaling and hi/lo split are exercised; on v2 at both token tiles (Q4_K; the
    /// others take v1 there) and v1 at both. rel_l2 is taken per token (a large token would
    /// hide a small one's error) and the worst is reported. Also the SIMT matmul on the same types
    /// (the `LLMDIFF_CUDA_DISABLE=gemm` path),
    /// three Q4_K weights sharing x (`linear_many`, one pre-pass; on v2 one launch), and two Q4_K
    /// and a Q6_K weight sharing x (on v2 a pre-pass and launch per type).
    pub(super) fn gemm_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let cases: [(GgmlType, &[(usize, usize)]); 5] = [
            (GgmlType::Q4K, &[(37, 256), (130, 768), (259, 512)]),
            (GgmlType::Q8_0, &[(37, 64), (130, 320), (131, 256)]),
            (GgmlType::Q4_1, &[(37, 64), (130, 576), (131, 512)]),
            (GgmlType::F16, &[(37, 64), (130, 320), (131, 256)]),
            // 8 and 16 super-blocks a row (the GEMM needs a multiple of 8).
            (GgmlType::Q6K, &[(37, 2048), (131, 4096)]),
        ];
        for (ty, shapes) in cases {
            let name = crate::cuda_kernels::type_suffix(ty).unwrap_or("?");
            for &(rows, cols) in shapes {
                let bytes = test_bytes(ty, rows, cols, 60 + ty as u64 + cols as u64);
                let w = test_weight(ty, &bytes, rows, cols);
                for n in [2usize, 9, 17, 65, 130] {
                    let paths: &[GemmPath] = if n == 9 { &PATHS[1..] } else { &PATHS[1..7] };
                    out.extend(self.gemm_case(name, &[w], cols, n, paths));
                }
                self.weights.lock().expect("weight map").clear();
            }
        }
        // Three Q4_K weights of one width sharing x.
        let cols = 512;
        let bytes: Vec<(usize, Vec<u8>)> = [37usize, 130, 259]
            .iter()
            .map(|&r| (r, test_bytes(GgmlType::Q4K, r, cols, 90 + r as u64)))
            .collect();
        let ws: Vec<WeightRef<'_>> = bytes
            .iter()
            .map(|(r, b)| test_weight(GgmlType::Q4K, b, *r, cols))
            .collect();
        for n in [9usize, 130] {
            out.extend(self.gemm_case("q4_K", &ws, cols, n, &PATHS[1..7]));
        }
        self.weights.lock().expect("weight map").clear();
        // A Q4_K_M layer's q, k (Q4_K) and v (Q6_K) sharing x: on v2 a launch (and pre-pass) per type.
        let cols = 2048;
        let mixed = [(GgmlType::Q4K, 130usize), (GgmlType::Q4K, 37), (GgmlType::Q6K, 37)];
        let bytes: Vec<Vec<u8>> = mixed
            .iter()
            .map(|&(ty, r)| test_bytes(ty, r, cols, 95 + r as u64 + ty as u64))
            .collect();
        let ws: Vec<WeightRef<'_>> = mixed
            .iter()
            .zip(&bytes)
            .map(|(&(ty, r), b)| test_weight(ty, b, r, cols))
            .collect();
        for n in [9usize, 130] {
            out.extend(self.gemm_case("q4_K+q6_K", &ws, cols, n, &PATHS[..7]));
        }
        self.weights.lock().expect("weight map").clear();
        out
    }

    /// One check per path in `paths` of the product(s) of `ws` (sharing x of n tokens) against
    /// the CPU engine: per-token rel_l2 ≤ 1e-5 over every output, and the case must have taken
    /// the path it names (v2 paths: that for Q4_K and Q6_K; v1 for the other types).
    fn gemm_case(
        &self,
        name: &str,
        ws: &[WeightRef<'_>],
        cols: usize,
        n: usize,
        paths: &[GemmPath],
    ) -> Vec<KernelCheck> {
        let x = gemm_test_x(n, cols);
        let cpu: Vec<Vec<f32>> = ws
            .iter()
            .map(|w| {
                let mut c = CpuBackend.alloc(n * w.rows());
                CpuBackend.linear(&Buf::host(x.clone()), n, *w, &mut c);
                c.as_host().to_vec()
            })
            .collect();
        let rows: Vec<usize> = ws.iter().map(|w| w.rows()).collect();
        let mut out = Vec::new();
        for &(label, path) in paths {
            let xd = self.upload(&x);
            let mut gs: Vec<Buf> = rows.iter().map(|r| self.upload(&vec![f32::NAN; n * r])).collect();
            let mut refs: Vec<&mut Buf> = gs.iter_mut().collect();
            let plan = self.linear_path(&xd, n, ws, &mut refs, path);
            let shape = rows.iter().map(|r| format!("{cols},{r}")).collect::<Vec<_>>().join(";");
            let mut check = compare(
                Case::new("MUL_MAT")
                    .p("type", name)
                    .p("ne", format!("[{shape}]"))
                    .p("n", n)
                    .p("path", label)
                    .to_string(),
                &[],
                &[],
                1e-5,
            );
            for ((g, c), &r) in gs.iter().zip(&cpu).zip(&rows) {
                let one = per_token(String::new(), &self.download(g), c, n, r, 1e-5);
                check.rel_l2 = check.rel_l2.max(one.rel_l2);
                check.max_abs = check.max_abs.max(one.max_abs);
                check.pass &= one.pass;
            }
            // The case must have taken the path it names.
            let ty_of = |w: &WeightRef<'_>| match w {
                WeightRef::Quant(q) => Some(q.ty),
                _ => None,
            };
            let v2 = ws.iter().all(|w| ty_of(w).is_some_and(v2_type));
            let want_kind = match path.1 {
                k if v2 && k >= KIND_V2 => k,
                _ => KIND_V1,
            };
            let want_bn = match (want_kind, path.2) {
                (KIND_V1, b) => Some(if b == 32 { 32 } else { 64 }),
                (_, 0) => None,
                (_, b) => Some(b),
            };
            check.pass &= match plan {
                None => !path.0,
                Some(p) => {
                    path.0
                        && p.kind == want_kind
                        && want_bn.is_none_or(|b| b == p.bn)
                        && (want_kind == KIND_V1 || path.3 == 0 || p.splits == path.3.min(cols / 256))
                }
            };
            out.push(check);
        }
        out
    }

    /// Times a prefill-shaped product on each of `PATHS` (`bench_linear` with the GEMM switched);
    /// the v2 paths for Q4_K and Q6_K only, v1's paths and the SIMT matmul for all
    /// (elsewhere v2 would fall back to v1).
    pub fn bench_gemm(&self, ty: GgmlType, rows: usize, cols: usize, n: usize) -> Result<GemmBench, EngineError> {
        let flop = 2.0 * rows as f64 * cols as f64 * n as f64;
        let mut paths = Vec::new();
        let runs = |p: &GemmPath| match p.1 .1 {
            KIND_V1 => true,
            _ => v2_type(ty),
        };
        for (label, path) in PATHS.into_iter().filter(runs) {
            let iters = if path.0 { 50 } else { 10 };
            let prev = self.gemm.set(path);
            let r = self.bench_linear(ty, rows, cols, n, iters);
            self.gemm.set(prev);
            let secs = r?.seconds;
            paths.push((label.to_string(), secs, flop / secs / 1e12));
        }
        let name = crate::cuda_kernels::type_suffix(ty).unwrap_or("?");
        Ok(GemmBench {
            case: Case::new("GEMM")
                .p("type", name)
                .p("rows", rows)
                .p("cols", cols)
                .p("n", n)
                .to_string(),
            paths,
        })
    }
}

/// Test activations: noise, with token t scaled by 1, 3e4, 1e-6, 0 (all zeros) or 1 with one
/// value ×100, by t % 5.
fn gemm_test_x(n: usize, cols: usize) -> Vec<f32> {
    let mut x = noise(n * cols, 200 + n as u64 + cols as u64);
    for (t, row) in x.chunks_exact_mut(cols).enumerate() {
        let f = [1.0f32, 3e4, 1e-6, 0.0, 1.0][t % 5];
        row.iter_mut().for_each(|v| *v *= f);
        if t % 5 == 4 {
            row[cols / 3] *= 100.0;
        }
    }
    x
}

/// One check over n tokens: the worst per-token rel_l2 (and max_abs), pass if every token passes.
fn per_token(case: String, gpu: &[f32], cpu: &[f32], n: usize, rows: usize, tol: f64) -> KernelCheck {
    let mut worst = compare(case.clone(), &[], &[], tol);
    worst.pass = gpu.len() == cpu.len() && gpu.len() == n * rows;
    for t in 0..n.min(gpu.len() / rows.max(1)) {
        let c = compare(
            String::new(),
            &gpu[t * rows..(t + 1) * rows],
            &cpu[t * rows..(t + 1) * rows],
            tol,
        );
        worst.rel_l2 = worst.rel_l2.max(c.rel_l2);
        worst.max_abs = worst.max_abs.max(c.max_abs);
        worst.pass &= c.pass;
    }
    worst
}

#[cfg(test)]
mod tests {
    use super::gemm2_tile;

    #[test]
    fn gemm2_tile_splits_k_where_the_row_tiles_fill_a_wave_and_a_half() {
        // The 8B shape at 512 tokens on 132 SMs: q/k/v (48 row tiles, 16 super-blocks a row) in
        // two splits of 128-token tiles (3 waves of half blocks, not 2 whole waves); o (32 tiles),
        // gate/up (224) and down (32 tiles, 56 super-blocks) whole.
        assert_eq!(gemm2_tile(48, 512, 16, 132, 0, 0), (128, 2));
        assert_eq!(gemm2_tile(32, 512, 16, 132, 0, 0), (128, 1));
        assert_eq!(gemm2_tile(224, 512, 16, 132, 0, 0), (128, 1));
        assert_eq!(gemm2_tile(32, 512, 56, 132, 0, 0), (128, 1));
        // A row of one super-block is never split; asked-for tiles and splits are kept.
        assert_eq!(gemm2_tile(48, 512, 1, 132, 0, 0).1, 1);
        assert_eq!(gemm2_tile(48, 512, 1, 132, 128, 2), (128, 1));
        assert_eq!(gemm2_tile(48, 512, 16, 132, 64, 1), (64, 1));
        assert_eq!(gemm2_tile(48, 512, 16, 132, 0, 1), (64, 1));
        assert_eq!(gemm2_tile(32, 512, 16, 132, 128, 2), (128, 2));
    }
}
