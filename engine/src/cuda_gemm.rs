//! The tensor-core GEMM for prefill (`kernels/gemm.cu`, [`KernelId::Gemm`]): which products take
//! it, its launch (the x pre-pass, then the tiled `mma.sync` kernel), its checks against the CPU
//! engine, and its benchmark beside the warp-per-row matmul.
//!
//! Selection: a product of n > 1 tokens with a Q4_K (cols % 256 == 0), Q8_0 or Q4_1 (cols % 64
//! == 0) weight in the repacked device layout, unless `LLMDIFF_GEMM=0`; everything else keeps the
//! f32 SIMT `matmul_*` of `kernels/quant.cu`. Two tilings: 64 tokens per block (`gemm_<type>`,
//! the default) or 32 (`gemm_<type>_n32`, fewer registers, two blocks per SM);
//! `LLMDIFF_GEMM_BN=32` picks the second. Precision: the weights' integers are exact in f16,
//! each token's x is scaled by a power of two and split into two f16s (x_hi + x_lo, 22 bits), the
//! tensor cores accumulate in f32, block scales and offsets are applied in f32 (see
//! `kernels/gemm.cu`).

use super::{compare, dev, dev_mut, noise, ok, test_bytes, test_weight, CudaBackend, DevWeight, KernelCheck};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::kernels::WeightRef;
use crate::EngineError;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use references::GgmlType;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// Weight-row tile.
const GEMM_BM: usize = 128;

/// The GEMM's settings: on (`LLMDIFF_GEMM=0` turns it off, back to the SIMT matmul) and the token
/// tile (64, or 32 with `LLMDIFF_GEMM_BN=32`). Atomics so the checks and benches can switch them.
pub(super) struct GemmState {
    on: AtomicBool,
    bn: AtomicUsize,
}

impl GemmState {
    pub(super) fn from_env() -> GemmState {
        let get = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<usize>().ok());
        GemmState {
            on: AtomicBool::new(get("LLMDIFF_GEMM") != Some(0)),
            bn: AtomicUsize::new(if get("LLMDIFF_GEMM_BN") == Some(32) { 32 } else { 64 }),
        }
    }

    /// Sets (on, bn), returning the previous settings.
    fn set(&self, on: bool, bn: usize) -> (bool, usize) {
        (self.on.swap(on, Ordering::Relaxed), self.bn.swap(bn, Ordering::Relaxed))
    }
}

/// The GEMM entry for a weight in its device layout, if the type and shape qualify.
pub(super) fn gemm_entry_for(w: &DevWeight, cols: usize) -> Option<&'static str> {
    if cols == 0 {
        return None;
    }
    match w.ty {
        GgmlType::Q4K if cols % 256 == 0 && w.row_bytes == cols / 256 * 144 => Some("gemm_q4_k"),
        GgmlType::Q8_0 if cols % 64 == 0 && w.row_bytes == cols / 32 * 34 => Some("gemm_q8_0"),
        GgmlType::Q4_1 if cols % 64 == 0 && w.row_bytes == cols / 32 * 20 => Some("gemm_q4_1"),
        _ => None,
    }
}

/// A prefill-shaped timing: the tensor-core GEMM (both token tiles) and the SIMT matmul on the
/// same product.
#[derive(Clone, Debug)]
pub struct GemmBench {
    pub case: String,
    /// (path, seconds per product, TFLOP/s = 2·rows·cols·n / seconds / 1e12), path `gemm64`,
    /// `gemm32` or `simt`.
    pub paths: Vec<(String, f64, f64)>,
}

impl CudaBackend {
    /// The GEMM entry and token tile a product of n > 1 tokens with `w` takes, if any (`None`
    /// when off).
    pub(super) fn gemm_entry(&self, w: &DevWeight, cols: usize) -> Option<(&'static str, usize)> {
        if !self.gemm.on.load(Ordering::Relaxed) {
            return None;
        }
        Some((gemm_entry_for(w, cols)?, self.gemm.bn.load(Ordering::Relaxed)))
    }

    /// Launches the pre-pass and GEMM `entry` (token tile `bn`, 64 or 32) on device buffers:
    /// x [n, cols], out [n, rows].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn launch_gemm(
        &self,
        s: &Arc<CudaStream>,
        w: &DevWeight,
        rows: usize,
        cols: usize,
        x: &CudaSlice<f32>,
        n: usize,
        out: &mut CudaSlice<f32>,
        entry: &'static str,
        bn: usize,
    ) {
        let n_pad = n.div_ceil(bn) * bn;
        // x_hi then x_lo, f16 each: n_pad·cols f32 words hold both.
        let mut xh = self.new_buf(n_pad * cols);
        let mut xs = self.new_buf(n_pad * (cols / 32));
        let mut inv = self.new_buf(n_pad);
        let (nn, np, c) = (n as i32, n_pad as i32, cols as i32);
        {
            let mut b = s.launch_builder(self.func("gemm_split_x"));
            b.arg(x)
                .arg(dev_mut(&mut xh))
                .arg(dev_mut(&mut xs))
                .arg(dev_mut(&mut inv))
                .arg(&nn)
                .arg(&np)
                .arg(&c);
            let cfg = LaunchConfig {
                grid_dim: (n_pad as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: matches gemm_split_x in kernels/gemm.cu: x has n·cols floats, xh 2·n_pad·cols
            // halves, xs n_pad·cols/32 floats, inv n_pad floats.
            ok(unsafe { b.launch(cfg) });
        }
        let (r, rb) = (rows as i32, w.row_bytes as i32);
        let name = if bn == 32 {
            format!("{entry}_n32")
        } else {
            entry.to_string()
        };
        let mut b = s.launch_builder(self.func(&name));
        b.arg(&w.data)
            .arg(dev(&xh))
            .arg(dev(&xs))
            .arg(dev(&inv))
            .arg(out)
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
        // SAFETY: matches gemm_* in kernels/gemm.cu: W is rows·row_bytes in the device layout
        // (gemm_entry_for checked the type and row length), the pre-pass buffers are sized for
        // n_pad tokens, out has n·rows floats. The scratch buffers go back to the pool after the
        // launch; work on this stream that reuses them runs after this kernel.
        ok(unsafe { b.launch(cfg) });
    }

    /// `Backend::linear` through the GEMM with token tile `bn` (`Some`) or the SIMT matmul
    /// (`None`), for the checks; says whether the GEMM was taken.
    fn linear_path(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf, bn: Option<usize>) -> bool {
        let prev = self.gemm.set(bn.is_some(), bn.unwrap_or(64));
        let dw = self.weight(w, &self.stream);
        let took = n > 1 && self.gemm_entry(&dw, w.cols()).is_some();
        self.linear(x, n, w, out);
        self.gemm.set(prev.0, prev.1);
        took
    }

    /// The GEMM against the CPU engine: Q4_K, Q8_0 and Q4_1 at row counts that are not a
    /// multiple of the 128-row tile, n = 2, 9, 17, 65, 130 (partial 64-token tiles), one and
    /// several blocks per row, rows whose length is or is not a multiple of 16 bytes; tokens of
    /// very different magnitudes (×3e4, ×1e-6, an all-zero token, one outlier value ×100) so the
    /// per-token scaling and hi/lo split are exercised. rel_l2 is taken per token (a large token
    /// would hide a small one's error) and the worst is reported. Also the SIMT matmul on the
    /// same types (the `LLMDIFF_GEMM=0` path).
    pub(super) fn gemm_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let cases: [(GgmlType, &[(usize, usize)]); 3] = [
            (GgmlType::Q4K, &[(37, 256), (130, 768), (259, 512)]),
            (GgmlType::Q8_0, &[(37, 64), (130, 320), (131, 256)]),
            (GgmlType::Q4_1, &[(37, 64), (130, 576), (131, 512)]),
        ];
        for (ty, shapes) in cases {
            let name = crate::cuda_kernels::type_suffix(ty).unwrap_or("?");
            for &(rows, cols) in shapes {
                let bytes = test_bytes(ty, rows, cols, 60 + ty as u64 + cols as u64);
                let w = test_weight(ty, &bytes, rows, cols);
                for n in [2usize, 9, 17, 65, 130] {
                    let x = gemm_test_x(n, cols);
                    let mut c = CpuBackend.alloc(n * rows);
                    CpuBackend.linear(&Buf::host(x.clone()), n, w, &mut c);
                    let c = c.as_host().to_vec();
                    let paths: &[Option<usize>] = if n == 9 {
                        &[Some(64), Some(32), None]
                    } else {
                        &[Some(64), Some(32)]
                    };
                    for &bn in paths {
                        let xd = self.upload(&x);
                        let mut g = self.upload(&vec![f32::NAN; n * rows]);
                        let took = self.linear_path(&xd, n, w, &mut g, bn);
                        let g = self.download(&g);
                        let path = bn.map_or("simt".to_string(), |b| format!("gemm{b}"));
                        let mut check = per_token(
                            format!("MUL_MAT(type={name},ne=[{cols},{rows}],n={n},path={path})"),
                            &g,
                            &c,
                            n,
                            rows,
                            1e-5,
                        );
                        // The case must have taken the path it names.
                        check.pass &= took == bn.is_some();
                        out.push(check);
                    }
                }
                self.weights.lock().expect("weight map").clear();
            }
        }
        out
    }

    /// Times a prefill-shaped product on the GEMM (64- and 32-token tiles) and on the SIMT
    /// matmul (`bench_linear` with the GEMM switched).
    pub fn bench_gemm(&self, ty: GgmlType, rows: usize, cols: usize, n: usize) -> Result<GemmBench, EngineError> {
        let flop = 2.0 * rows as f64 * cols as f64 * n as f64;
        let mut paths = Vec::new();
        for (label, on, bn, iters) in [
            ("gemm64", true, 64, 50),
            ("gemm32", true, 32, 50),
            ("simt", false, 64, 10),
        ] {
            let prev = self.gemm.set(on, bn);
            let r = self.bench_linear(ty, rows, cols, n, iters);
            self.gemm.set(prev.0, prev.1);
            let secs = r?.seconds;
            paths.push((label.to_string(), secs, flop / secs / 1e12));
        }
        let name = crate::cuda_kernels::type_suffix(ty).unwrap_or("?");
        Ok(GemmBench {
            case: format!("GEMM(type={name},rows={rows},cols={cols},n={n})"),
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
