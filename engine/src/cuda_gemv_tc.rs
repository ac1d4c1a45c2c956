//! The tensor-core one-token GEMV for Q4_K (`kernels/gemv_tc.cu`, [`KernelId::GemvTc`](crate::cuda_kernels::KernelId)):
//! its selection and its checks against the CPU engine; the launch is `launch_gemv_rows` (the
//! `gemvt_*` entries take the integer warp-rows arguments, `GemvRows` and x's int8 limbs included,
//! so `linear_many` keeps a layer's q/k/v or gate/up in one launch, with the q/k/v store).
//!
//! The quants (as u8) meet x's int8 limbs, the integer form of `kernels/quant.cu`, in `mma.sync`
//! m16n8k32, each lane's A fragments loaded straight from the weight rows (a pair of sub-blocks
//! of two rows), and the per-(row, sub-block) scaling on every lane. The same exact integer sums
//! as the dp4a form, so the same precision.
//!
//! Selection: only with `LLMDIFF_GEMV_KIND=tc` (Q4_K rows with cols % 256 == 0; other types keep
//! their default split), or `LLMDIFF_GEMV_VARIANT=gemvt_...`; `LLMDIFF_GEMV_R` (16 or 32 rows per
//! block), `LLMDIFF_GEMV_NW` (4, 8 or 16 warps) and `LLMDIFF_GEMV_U` (super-blocks a warp keeps
//! in flight: 1, or 2 double-buffered) pick the nearest compiled variant, by default 32 rows, 4
//! warps, U 1.
//!
//! On the H200: round 10's form loaded fragments 4 bytes at a time from 8 rows and stalled on
//! those loads; round 14's staged rows in a `cp.async` ring per warp, read by `ldmatrix`, and was
//! capped by shared memory (8B decode 2.33 against the dp4a form's 2.05 ms). This one (round 22)
//! loads each lane's fragment bytes into registers, a pair of sub-blocks (32 contiguous bytes) of
//! each of two rows, as the dp4a form loads its weights: exact, but 13 % slower than the dp4a form
//! in the 8B decode step (2.19 against 1.95 ms; tests/gpu/h200-results/round22).

use super::{compare, noise, CudaBackend, KernelCheck};
use crate::backend::{Backend, Buf, CpuBackend};
use crate::cuda_kernels::{GemvVariant, GEMVT_VARIANTS};
use crate::kernels::{QMat, WeightRef};
use references::GgmlType;

/// Rows per block, warps per block and super-blocks in flight of the tensor-core GEMV when not set.
const DEFAULT_R: usize = 32;
const DEFAULT_NW: usize = 4;
const DEFAULT_U: usize = 1;

/// The tensor-core variant nearest to `r` rows per block (then `nw` warps, then `u` super-blocks
/// in flight), by default [`DEFAULT_R`], [`DEFAULT_NW`] and [`DEFAULT_U`].
pub(super) fn pick(r: Option<usize>, nw: Option<usize>, u: Option<usize>) -> GemvVariant {
    let (r, nw, u) = (r.unwrap_or(DEFAULT_R), nw.unwrap_or(DEFAULT_NW), u.unwrap_or(DEFAULT_U));
    *GEMVT_VARIANTS
        .iter()
        .min_by_key(|v| (v.r.abs_diff(r), v.nw.abs_diff(nw), v.upt.abs_diff(u)))
        .expect("GEMVT_VARIANTS is not empty")
}

/// Test activations of one magnitude class: `noise` (in [-1, 1)), `x1e4`, `x1e-30`, or `mixed`
/// (values cycling through ×1e4, ×1, ×1e-30, 0, ×1e-3, so one 32-value block of limbs holds all of
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
    /// Every tensor-core GEMV variant against the CPU engine: Q4_K rows of 1 to 56 super-blocks,
    /// row counts that are not a multiple of 16 or of the block's 16·T rows (and fewer rows than
    /// a tile), rows of different scales; x of magnitude ~1, ~1e4, ~1e-30 and mixed within a
    /// 32-value block (with zeros); then several products in one launch (`GemvRows`, row counts
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
                for v in GEMVT_VARIANTS.into_iter().filter(|v| self.gemv_fits(*v, cols)) {
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
                for v in GEMVT_VARIANTS.into_iter().filter(|v| self.gemv_fits(*v, cols)) {
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
        assert_eq!(pick(None, None, None).entry(), "gemvt_q4_k_t2_w4_u1");
        assert_eq!(pick(Some(16), None, None).entry(), "gemvt_q4_k_t1_w4_u1");
        assert_eq!(pick(Some(32), Some(2), Some(2)).entry(), "gemvt_q4_k_t2_w4_u2");
        assert_eq!(pick(Some(64), None, None).entry(), "gemvt_q4_k_t2_w4_u1");
        assert_eq!(pick(Some(8), Some(8), Some(2)).entry(), "gemvt_q4_k_t1_w8_u2");
        assert_eq!(pick(Some(16), Some(16), None).entry(), "gemvt_q4_k_t1_w16_u1");
    }
}
