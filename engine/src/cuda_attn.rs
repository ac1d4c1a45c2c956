//! The tiled prefill GQA attention (`gqa_attn_tiled_<HD>` in `kernels/attention.cu`): which calls
//! take it, its launch, its checks against the CPU engine, and its benchmark beside the
//! per-(token, head) kernel.
//!
//! Selection: [`Backend::gqa_attention`] with n > 1 new tokens making at least 32 rows (n ·
//! H/KV; any n > 1 with `LLMDIFF_ATTN_TILED=1`), not being recorded into a decode graph,
//! head_dim ≤ 256, n_heads a multiple of n_kv_heads and the block's shared memory within the
//! device's opt-in limit, unless `LLMDIFF_ATTN_TILED=0`; decode (n = 1), short chunks, the
//! captured `gqa_attention_dpos` and MLA keep the per-(token, head) kernels. A block owns 64 (token, query
//! head) rows of one KV head, so the G = H/KV query heads that share a KV head read each K/V tile
//! once, and walks the causal prefix in 32-position tiles with an online softmax (running max;
//! the denominator summed in f64, the rest f32; see the kernel's comment).

use super::{compare, dev, dev_mut, drv, noise, ok, CudaBackend, KernelCheck};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::kernels::GqaShape;
use crate::EngineError;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use std::sync::atomic::{AtomicBool, Ordering};

/// Rows ((token, query head) pairs of one KV head) per block (`AT_R` in kernels/attention.cu).
const AT_R: usize = 64;
/// Positions per K/V tile (`AT_BK`).
const AT_BK: usize = 32;
/// Row stride of the P tile in floats (`AT_PS`).
const AT_PS: usize = 36;
/// Threads per block (`AT_THREADS`).
const AT_THREADS: u32 = 256;

/// Below this many rows (n · H/KV) the tiled kernel is not taken by default: its blocks would
/// be mostly empty and too few, each walking the whole prefix alone (a short chunk after a long
/// cache), where the per-(token, head) kernel has n·H blocks.
const AT_MIN_ROWS: usize = AT_R / 2;

/// The tiled attention's settings: on unless `LLMDIFF_ATTN_TILED=0` (an atomic so the bench can
/// switch it), `LLMDIFF_ATTN_TILED=1` takes it for every n > 1 (not only from [`AT_MIN_ROWS`]
/// rows), and the dynamic shared memory its entries were allowed at load.
pub(super) struct AttnState {
    on: AtomicBool,
    force: bool,
    smem_max: usize,
}

impl AttnState {
    pub(super) fn new(smem_max: usize) -> AttnState {
        let v = std::env::var("LLMDIFF_ATTN_TILED").ok();
        let v = v.as_deref().map(str::trim);
        AttnState {
            on: AtomicBool::new(v != Some("0")),
            force: v == Some("1"),
            smem_max,
        }
    }

    /// Sets on/off, returning the previous setting.
    pub(super) fn set(&self, on: bool) -> bool {
        self.on.swap(on, Ordering::Relaxed)
    }
}

/// The tiled entry for a head width (the smallest of 64, 128, 256 that holds it).
fn tiled_entry(hd: usize) -> Option<&'static str> {
    match hd {
        1..=64 => Some("gqa_attn_tiled_64"),
        65..=128 => Some("gqa_attn_tiled_128"),
        129..=256 => Some("gqa_attn_tiled_256"),
        _ => None,
    }
}

/// Dynamic shared memory in bytes of a tiled block for head width `hd`: Q (64 rows), K (32
/// rows) at a row stride of hd rounded up to 4, plus 4 when that is an even number of float4s;
/// V (32 rows) at hd rounded up to 4; P 64 × 36 (see kernels/attention.cu).
pub(super) fn attn_tiled_smem(hd: usize) -> usize {
    let hd4 = hd.div_ceil(4) * 4;
    let qs = if (hd4 / 4) % 2 == 1 { hd4 } else { hd4 + 4 };
    (AT_R * qs + AT_BK * qs + AT_BK * hd4 + AT_R * AT_PS) * 4
}

/// A timing of the prefill attention: the per-(token, head) kernel and the tiled one.
#[derive(Clone, Debug)]
pub struct AttnBench {
    pub case: String,
    /// Seconds per call, per-(token, head) kernel.
    pub old_s: f64,
    /// Seconds per call, tiled kernel.
    pub tiled_s: f64,
}

impl CudaBackend {
    /// The tiled entry a GQA attention of n new tokens takes, if any (`None` when off, for n = 1,
    /// below [`AT_MIN_ROWS`] rows unless forced, and for shapes it does not take).
    pub(super) fn attn_tiled_entry(&self, n: usize, shape: GqaShape) -> Option<&'static str> {
        if n < 2 || !self.attn.on.load(Ordering::Relaxed) {
            return None;
        }
        let group = shape.n_heads / shape.n_kv_heads.max(1);
        if !self.attn.force && n * group < AT_MIN_ROWS {
            return None;
        }
        self.attn_tiled_fits(shape)
    }

    /// The tiled entry for a shape, if the kernel takes it (H a multiple of KV, hd ≤ 256, its
    /// shared memory within the limit), whatever n and the settings.
    pub(super) fn attn_tiled_fits(&self, shape: GqaShape) -> Option<&'static str> {
        if shape.n_kv_heads == 0 || shape.n_heads % shape.n_kv_heads != 0 {
            return None;
        }
        let e = tiled_entry(shape.head_dim)?;
        (attn_tiled_smem(shape.head_dim) <= self.attn.smem_max).then_some(e)
    }

    /// Launches tiled entry `entry` on q [n, H·hd], k/v [≥ pos0 + n, KV·hd], out [n, H·hd].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gqa_tiled(
        &self,
        entry: &'static str,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        out: &mut CudaSlice<f32>,
        n: usize,
        pos0: usize,
        shape: GqaShape,
    ) {
        let group = shape.n_heads / shape.n_kv_heads;
        let blocks = (n * group).div_ceil(AT_R) * shape.n_kv_heads;
        if blocks == 0 {
            return;
        }
        let args = [
            n as i32,
            pos0 as i32,
            shape.n_heads as i32,
            shape.n_kv_heads as i32,
            shape.head_dim as i32,
        ];
        let mut b = self.stream.launch_builder(self.func(entry));
        b.arg(q).arg(k).arg(v).arg(out);
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (blocks as u32, 1, 1),
            block_dim: (AT_THREADS, 1, 1),
            shared_mem_bytes: attn_tiled_smem(shape.head_dim) as u32,
        };
        // SAFETY: matches gqa_attn_tiled_* in kernels/attention.cu: q and out hold n·H·hd floats,
        // k and v (pos0 + n)·KV·hd, H % KV == 0, hd within the entry's width, shared memory as
        // attn_tiled_smem (allowed at load up to smem_max).
        ok(unsafe { b.launch(cfg) });
    }

    /// The tiled kernel against the CPU engine (tolerance 1e-5 as the other attention checks):
    /// head widths 36, 37, 40, 64, 96, 128, 200, 256 (every entry, odd widths, even and odd
    /// float4 counts), n = 2, 7, 70, 130 (partial and several row tiles), pos0 = 0 and 300,
    /// heads/KV 6/2, 32/8, 5/1 and 4/4; output canary-filled with NaN first (an element
    /// left unwritten fails the check), and `sharp` cases with q ×8 and keys scaled up along
    /// the positions, so the running max moves from tile to tile.
    pub(super) fn attn_tiled_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let spans = [
            (0usize, 2usize),
            (0, 7),
            (0, 70),
            (0, 130),
            (300, 2),
            (300, 7),
            (300, 70),
            (300, 130),
        ];
        let mut cases: Vec<(usize, usize, usize, usize, usize, bool)> = Vec::new();
        for hd in [40, 64, 128, 37] {
            for &(pos0, n) in &spans {
                cases.push((6, 2, hd, pos0, n, false));
            }
        }
        for hd in [128, 37] {
            for &(pos0, n) in &spans {
                cases.push((32, 8, hd, pos0, n, false));
            }
        }
        for hd in [64, 40] {
            for &(pos0, n) in &spans {
                cases.push((5, 1, hd, pos0, n, false));
            }
        }
        for (h, kv, hd, pos0, n) in [
            (4, 4, 36, 0, 70),
            (6, 2, 96, 300, 70),
            (6, 2, 200, 0, 130),
            (8, 2, 256, 300, 130),
            (8, 2, 256, 0, 7),
        ] {
            cases.push((h, kv, hd, pos0, n, false));
        }
        for (h, kv, hd, pos0, n) in [(32, 8, 128, 0, 130), (6, 2, 37, 300, 70), (5, 1, 64, 300, 130)] {
            cases.push((h, kv, hd, pos0, n, true));
        }
        for (h, kv, hd, pos0, n, sharp) in cases {
            let t = pos0 + n;
            let s = GqaShape {
                n_heads: h,
                n_kv_heads: kv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let seed = (h * 1000 + hd * 10 + n + pos0) as u64;
            let mut q = noise(n * h * hd, seed);
            let mut k = noise(t * kv * hd, seed + 1);
            let v = noise(t * kv * hd, seed + 2);
            if sharp {
                q.iter_mut().for_each(|x| *x *= 8.0);
                for (j, row) in k.chunks_exact_mut(kv * hd).enumerate() {
                    let f = 0.5 + j as f32 / t as f32;
                    row.iter_mut().for_each(|x| *x *= f);
                }
            }
            let case = format!(
                "ATTN_GQA_TILED(H={h},KV={kv},hd={hd},pos0={pos0},n={n}{})",
                if sharp { ",sharp" } else { "" }
            );
            // Checked whatever LLMDIFF_ATTN_TILED says and at any n.
            let Some(entry) = self.attn_tiled_fits(s) else {
                out.push(KernelCheck {
                    case,
                    rel_l2: f64::NAN,
                    max_abs: f64::NAN,
                    tol: 1e-5,
                    pass: false,
                });
                continue;
            };
            let g = {
                let (qd, kd, vd) = (self.upload(&q), self.upload(&k), self.upload(&v));
                let mut o = self.upload(&vec![f32::NAN; n * h * hd]);
                self.launch_gqa_tiled(entry, dev(&qd), dev(&kd), dev(&vd), dev_mut(&mut o), n, pos0, s);
                self.download(&o)
            };
            let c = {
                let be = &CpuBackend;
                let mut o = be.alloc(n * h * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            };
            out.push(compare(case, &g, &c, 1e-5));
        }
        out
    }

    /// Times GQA attention of `n` new tokens at pos0 = 0 (a prefill) with `h` query heads, `kv`
    /// KV heads of width `hd`: the per-(token, head) kernel, then the tiled one, on the same
    /// device buffers; the mean of `iters` calls each, after two warm-up calls.
    pub fn bench_attention(
        &self,
        n: usize,
        h: usize,
        kv: usize,
        hd: usize,
        iters: usize,
    ) -> Result<AttnBench, EngineError> {
        let s = GqaShape {
            n_heads: h,
            n_kv_heads: kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let (q, k, v) = (
            self.upload(&noise(n * h * hd, 51)),
            self.upload(&noise(n * kv * hd, 52)),
            self.upload(&noise(n * kv * hd, 53)),
        );
        let mut o: Buf = self.alloc(n * h * hd);
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let mut time = |on: bool| -> Result<f64, EngineError> {
            let prev = self.attn.set(on);
            for _ in 0..2 {
                self.gqa_attention(&q, &k, &v, 0, s, &mut o);
            }
            let t0 = self.stream.record_event(flags).map_err(drv("event"))?;
            for _ in 0..iters {
                self.gqa_attention(&q, &k, &v, 0, s, &mut o);
            }
            let t1 = self.stream.record_event(flags).map_err(drv("event"))?;
            t1.synchronize().map_err(drv("sync"))?;
            self.attn.set(prev);
            Ok(t0.elapsed_ms(&t1).map_err(drv("elapsed"))? as f64 / 1e3 / iters as f64)
        };
        let old_s = time(false)?;
        // NaN when the tiled kernel would not be taken (the second timing would be the old kernel).
        let prev = self.attn.set(true);
        let takes = self.attn_tiled_entry(n, s).is_some();
        self.attn.set(prev);
        let tiled_s = if takes { time(true)? } else { f64::NAN };
        Ok(AttnBench {
            case: format!("ATTN_GQA(H={h},KV={kv},hd={hd},pos0=0,n={n})"),
            old_s,
            tiled_s,
        })
    }
}
