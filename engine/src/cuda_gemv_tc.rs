//! The tensor-core one-token GEMV for Q4_K (`kernels/gemv_tc.cu`, [`KernelId::GemvTc`](crate::cuda_kernels::KernelId)):
//! its selection and its checks against the CPU engine; the launch is `launch_gemv_rows` (the
//! `gemvt_*` entries take the warp-rows arguments, `GemvRows` included, so `linear_many` keeps a
//! layer's q/k/v or gate/up in one launch).
//!
//! Two forms: mode 0 (`gemvt_q4_k_t<T>_w<NW>`), each warp builds the B fragments of its
//! super-blocks from x (~30 instructions per 4 values, amortized over the block's 16·T rows), and
//! mode 1 (`..._p`), a pre-pass kernel (`gemvt_split_x`, one more launch) builds them once per
//! launch into pooled scratch (x·6 bytes, in L2) with Σx per 32, and each warp loads them.
//!
//! Selection: only with `LLMDIFF_GEMV_KIND=tc` (mode 0) or `tcp` (mode 1) (Q4_K rows with cols %
//! 256 == 0; other types keep their default split), or `LLMDIFF_GEMV_VARIANT=gemvt_...`;
//! `LLMDIFF_GEMV_R` (16, 32 or 64 rows per block) and `LLMDIFF_GEMV_NW` (4 or 8 warps) pick the
//! nearest compiled variant, by default 32 rows and 8 warps. Precision: the weights' 4-bit integers are exact in bf16, x is
//! split exactly into three bf16s (hi, mid, lo) that are B's first three columns, products are
//! exact and accumulated in f32 (see the header of `kernels/gemv_tc.cu`).

use super::{compare, dev_mut, noise, ok, CudaBackend, KernelCheck};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::cuda_kernels::{GemvVariant, GEMVT_VARIANTS};
use crate::kernels::{QMat, WeightRef};
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use references::GgmlType;
use std::sync::Arc;

/// Rows per block and warps per block of the tensor-core GEMV when not set.
const DEFAULT_R: usize = 32;
const DEFAULT_NW: usize = 8;

/// The tensor-core variant of `mode` nearest to `r` rows per block (then `nw` warps), by default
/// [`DEFAULT_R`] and [`DEFAULT_NW`].
pub(super) fn pick(r: Option<usize>, nw: Option<usize>, mode: usize) -> GemvVariant {
    let (r, nw) = (r.unwrap_or(DEFAULT_R), nw.unwrap_or(DEFAULT_NW));
    *GEMVT_VARIANTS
        .iter()
        .filter(|v| v.mode == mode)
        .min_by_key(|v| (v.r.abs_diff(r), v.nw.abs_diff(nw)))
        .expect("GEMVT_VARIANTS is not empty")
}

/// Test activations of one magnitude class: `noise` (in [-1, 1)), `x1e4`, `x1e-30`, or `mixed`
/// (values cycling through ×1e4, ×1, ×1e-30, 0, ×1e-3, so one 16-value mma step holds all of
/// them).
pub(super) fn tc_test_x(kind: &str, cols: usize, seed: u64) -> Vec<f32> {
    let x = noise(cols, seed);
    match kind {
        "x1e4" => x.iter().map(|v| v * 1e4).collect(),
        "x1e-30" => x.iter().map(|v| v * 1e-30).collect(),
        "mixed" => x
            .iter()
            .enumerate()
            .map(|(i, v)| v * [1e4f32, 1.0, 1e-30, 0.0, 1e-3][i % 5])
            .collect(),
        _ => x,
    }
}

/// Q4_K test weights: noise, rows scaled by 1, 30 or 0.01 (so d and dmin vary by row), quantized.
fn tc_test_w(rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut wf = noise(rows * cols, seed);
    for (r, row) in wf.chunks_exact_mut(cols).enumerate() {
        let f = [1.0f32, 30.0, 0.01][r % 3];
        row.iter_mut().for_each(|v| *v *= f);
    }
    references::quant::quantize(GgmlType::Q4K, &wf).expect("quantize test weights")
}

impl CudaBackend {
    /// The x pre-pass of the mode-1 tensor-core variants (`gemvt_split_x`): returns the B
    /// fragments (cols/256 · 8 · 12 uint4, as f32 words: 1.5·cols) and Σx per 32 values (cols/32),
    /// pooled scratch that goes back to the pool when dropped (after the launches that use it are
    /// enqueued on this stream).
    pub(super) fn gemv_tc_split_x(&self, s: &Arc<CudaStream>, x: &CudaSlice<f32>, cols: usize) -> (Buf, Buf) {
        assert!(
            cols % 256 == 0 && x.len() >= cols,
            "gemv_tc: x is not whole super-blocks"
        );
        let mut xb = self.new_buf(cols / 256 * 8 * 12 * 4);
        let mut xs = self.new_buf(cols / 32);
        let threads = cols / 256 * 32;
        let c = cols as i32;
        let mut b = s.launch_builder(self.func("gemvt_split_x"));
        b.arg(x).arg(dev_mut(&mut xb)).arg(dev_mut(&mut xs)).arg(&c);
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gemvt_split_x in kernels/gemv_tc.cu: x has cols floats (cols % 256 ==
        // 0), xb cols/256·96 uint4 (16-byte aligned: a whole pooled allocation), xs cols/32 floats.
        ok(unsafe { b.launch(cfg) });
        (xb, xs)
    }

    /// Every tensor-core GEMV variant against the CPU engine: Q4_K rows of 1 to 56 super-blocks,
    /// row counts that are not a multiple of 16 or of the block's 16·T rows (and fewer rows than
    /// a tile), rows of different scales; x of magnitude ~1, ~1e4, ~1e-30 and mixed within a
    /// 16-value step (with zeros); then several products in one launch (`GemvRows`, row counts
    /// that split tiles between matrices). rel_l2 tolerance 1e-5, as the other GEMV checks.
    pub(super) fn gemv_tc_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let shapes: [(usize, usize); 6] = [(256, 1), (256, 37), (512, 17), (1280, 67), (4864, 130), (14336, 20)];
        for (cols, rows) in shapes {
            let bytes = tc_test_w(rows, cols, 300 + cols as u64 + rows as u64);
            let w = WeightRef::Quant(QMat {
                ty: GgmlType::Q4K,
                bytes: &bytes,
                rows,
                cols,
                row_bytes: bytes.len() / rows,
            });
            for kind in ["noise", "x1e4", "x1e-30", "mixed"] {
                let x = tc_test_x(kind, cols, 310 + cols as u64);
                let mut c = CpuBackend.alloc(rows);
                CpuBackend.linear(&Buf::host(x.clone()), 1, w, &mut c);
                let c = c.as_host().to_vec();
                let xd = self.upload(&x);
                for v in GEMVT_VARIANTS {
                    let mut g = self.upload(&vec![f32::NAN; rows]);
                    self.linear_with(&xd, 1, w, &mut g, Some(v));
                    out.push(compare(
                        format!("GEMV_TC(type=q4_k,ne=[{cols},{rows}],x={kind},variant={})", v.entry()),
                        &self.download(&g),
                        &c,
                        1e-5,
                    ));
                }
            }
            self.weights.lock().expect("weight map").clear();
        }
        // Several products in one launch: row counts that split 16-, 32- and 64-row blocks between
        // matrices, a one-row matrix, a matrix smaller than a tile.
        let many: [(usize, &[usize]); 4] = [
            (512, &[37, 5, 12]),
            (1280, &[16, 33, 1]),
            (256, &[100, 28]),
            (4096, &[70, 9, 64]),
        ];
        for (cols, rows_each) in many {
            let bytes: Vec<Vec<u8>> = rows_each
                .iter()
                .enumerate()
                .map(|(i, &r)| tc_test_w(r, cols, 400 + i as u64 + cols as u64))
                .collect();
            let ws: Vec<WeightRef> = bytes
                .iter()
                .zip(rows_each)
                .map(|(b, &r)| {
                    WeightRef::Quant(QMat {
                        ty: GgmlType::Q4K,
                        bytes: b,
                        rows: r,
                        cols,
                        row_bytes: b.len() / r,
                    })
                })
                .collect();
            for kind in ["noise", "mixed"] {
                let x = tc_test_x(kind, cols, 410 + cols as u64);
                let c: Vec<f32> = ws
                    .iter()
                    .flat_map(|w| {
                        let mut o = CpuBackend.alloc(w.rows());
                        CpuBackend.linear(&Buf::host(x.clone()), 1, *w, &mut o);
                        o.as_host().to_vec()
                    })
                    .collect();
                let xd = self.upload(&x);
                for v in GEMVT_VARIANTS {
                    let mut os: Vec<Buf> = rows_each.iter().map(|&r| self.upload(&vec![f32::NAN; r])).collect();
                    let mut refs: Vec<&mut Buf> = os.iter_mut().collect();
                    self.linear_many_with(&xd, 1, &ws, &mut refs, Some(v), None);
                    let g: Vec<f32> = os.iter().flat_map(|o| self.download(o)).collect();
                    out.push(compare(
                        format!(
                            "GEMV_TC_MANY(type=q4_k,cols={cols},rows={rows_each:?},x={kind},variant={})",
                            v.entry()
                        ),
                        &g,
                        &c,
                        1e-5,
                    ));
                }
            }
            self.weights.lock().expect("weight map").clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn pick_takes_the_nearest_tensor_core_variant() {
        assert_eq!(pick(None, None, 0).entry(), "gemvt_q4_k_t2_w8");
        assert_eq!(pick(Some(16), Some(4), 0).entry(), "gemvt_q4_k_t1_w4");
        assert_eq!(pick(Some(64), None, 0).entry(), "gemvt_q4_k_t4_w8");
        assert_eq!(pick(Some(8), Some(2), 0).entry(), "gemvt_q4_k_t1_w4");
        assert_eq!(pick(None, None, 1).entry(), "gemvt_q4_k_t2_w8_p");
        assert_eq!(pick(Some(16), Some(8), 1).entry(), "gemvt_q4_k_t1_w8_p");
        assert_eq!(pick(Some(16), Some(4), 2).entry(), "gemvt_q4_k_t1_w4_i");
    }
}
