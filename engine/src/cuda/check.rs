//! `llmdiff kernels --check`: every kernel against the CPU engine on odd shapes, each case named
//! as llama.cpp's test-backend-ops names one (`OP(param=value,...)`).

use super::*;

/// A check case's name: its op and parameters, printed `OP(param=value,...)` as llama.cpp's
/// test-backend-ops prints a case (`GEMV(type=q4_k,ne=[4096,37],variant=...)`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Case {
    pub op: &'static str,
    pub params: Vec<(&'static str, String)>,
}

impl Case {
    pub fn new(op: &'static str) -> Case {
        Case { op, params: Vec::new() }
    }

    /// The case with parameter `name` = `value` appended.
    pub fn p(mut self, name: &'static str, value: impl std::fmt::Display) -> Case {
        self.params.push((name, value.to_string()));
        self
    }
}

impl std::fmt::Display for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}(", self.op)?;
        for (i, (k, v)) in self.params.iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { "" } else { "," })?;
        }
        write!(f, ")")
    }
}

/// One numerical check of a GPU kernel against the CPU engine's kernel on the same inputs.
#[derive(Clone, Debug)]
pub struct KernelCheck {
    /// `OP(vars)`, as llama.cpp's test-backend-ops prints a case.
    pub case: String,
    pub rel_l2: f64,
    pub max_abs: f64,
    pub tol: f64,
    pub pass: bool,
}

pub(super) fn compare(case: String, gpu: &[f32], cpu: &[f32], tol: f64) -> KernelCheck {
    let (mut num, mut den, mut max_abs) = (0f64, 0f64, 0f64);
    let mut nonfinite = false;
    for (&a, &b) in gpu.iter().zip(cpu) {
        if !a.is_finite() {
            nonfinite = true;
        }
        let d = (a as f64 - b as f64).abs();
        num += d * d;
        den += b as f64 * b as f64;
        max_abs = max_abs.max(d);
    }
    let rel_l2 = if den > 0.0 { (num / den).sqrt() } else { num.sqrt() };
    let pass = !nonfinite && rel_l2 <= tol && gpu.len() == cpu.len();
    KernelCheck {
        case,
        rel_l2,
        max_abs,
        tol,
        pass,
    }
}

/// [`compare`] for outputs that should hold NaN or inf: passes when `gpu` is non-finite exactly
/// where `cpu` is (and `cpu` somewhere is) and the finite rest agrees within `tol`.
pub(super) fn compare_nonfinite(case: String, gpu: &[f32], cpu: &[f32], tol: f64) -> KernelCheck {
    let same = gpu.len() == cpu.len() && gpu.iter().zip(cpu).all(|(a, b)| a.is_finite() == b.is_finite());
    let (g, c): (Vec<f32>, Vec<f32>) = gpu
        .iter()
        .zip(cpu)
        .filter(|(a, b)| a.is_finite() && b.is_finite())
        .map(|(a, b)| (*a, *b))
        .unzip();
    let r = compare(case, &g, &c, tol);
    KernelCheck {
        pass: r.pass && same && cpu.iter().any(|v| !v.is_finite()),
        ..r
    }
}

/// Deterministic values in [-1, 1).
/// Test weights for the checks: noise of `[rows, cols]` quantized to `ty` (the bytes a
/// [`test_weight`] borrows).
pub(super) fn test_bytes(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    references::quant::quantize(ty, &noise(rows * cols, seed)).expect("quantize test weights")
}

/// A quantized `[rows, cols]` weight over `bytes` (from [`test_bytes`]).
pub(super) fn test_weight(ty: GgmlType, bytes: &[u8], rows: usize, cols: usize) -> WeightRef<'_> {
    WeightRef::Quant(QMat {
        ty,
        bytes,
        rows,
        cols,
        row_bytes: bytes.len() / rows,
    })
}

/// Noise of `cols` values scaled as `kind` says: `x1e4`, `x1e-30`, or `mixed` (×1e4, 1, 1e-30, 0
/// and 1e-3 in turn, so a block of 32 holds very different magnitudes); else plain noise.
pub(super) fn scaled_test_x(kind: &str, cols: usize, seed: u64) -> Vec<f32> {
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

pub(super) fn noise(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

impl CudaBackend {
    /// One-row norms split over S blocks (`rms_norm_one` in kernels/ops.cu) against the unsplit
    /// launch, bit for bit: the add form's x, the normed row and its limbs (the integer GEMV's
    /// x), for S = 2 .. 32 and a width S does not divide into whole warps (which runs unsplit).
    /// Each split launch also must leave the arrival count at 0 for the next, so a later case
    /// would fail if one did not.
    pub(super) fn check_norm_split(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let was = self.norm_split.load(Ordering::Relaxed);
        // x after the add (or as given), the normed row, and its limbs as bits (words that are
        // not floats).
        let run = |split: usize, add: Option<bool>, x: &[f32], a: &[f32], w: &[f32]| {
            self.norm_split.store(split, Ordering::Relaxed);
            let (mut xb, mut o) = (self.upload(x), self.alloc(x.len()));
            match add {
                Some(f16) => self.add_rms_norm(&mut xb, &self.upload(a), f16, w, 1e-5, &mut o),
                None => self.rms_norm(&xb, w, 1e-5, &mut o),
            }
            let limbs = limbs_of(&o, x.len()).map(|q| {
                let words = self.stream.clone_dtoh(q).expect("download limbs");
                words.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            });
            ([self.download(&xb), self.download(&o)].concat(), limbs)
        };
        for (d, add) in [
            (4096usize, Some(false)),
            (4096, Some(true)),
            (4096, None),
            (2048, Some(false)),
            (3072, Some(false)),
        ] {
            let (x, a, w) = (noise(d, 23), noise(d, 24), noise(d, 25));
            let (one, one_limbs) = run(1, add, &x, &a, &w);
            for split in [2usize, 4, 8, 16, 32] {
                let (got, limbs) = run(split, add, &x, &a, &w);
                let form = add.map_or("RMS_NORM".to_string(), |f| {
                    Case::new("ADD_RMS_NORM").p("f16", f).to_string()
                });
                let c = compare(format!("{form}_SPLIT(ne=[{d},1],split={split})"), &got, &one, 0.0);
                out.push(KernelCheck {
                    pass: c.pass && limbs == one_limbs,
                    ..c
                });
            }
        }
        self.norm_split.store(was, Ordering::Relaxed);
        out
    }
}

/// Runs `f` (which uploads its inputs, runs ops and downloads a result) on the GPU and the CPU.
pub(super) fn both(gpu: &dyn Backend, f: impl Fn(&dyn Backend) -> Vec<f32>) -> (Vec<f32>, Vec<f32>) {
    (f(gpu), f(&CpuBackend))
}

impl CudaBackend {
    /// Runs every kernel against the CPU engine's on odd shapes (the fast/slow pairs of the
    /// CUDA backend): matmul/matvec and gather for every GPU weight type, RMSNorm, RoPE NORM and
    /// NEOX, SwiGLU, the GQA families' ops (bias add, GeGLU, scale, soft-cap, per-head norm,
    /// windowed and soft-capped attention), GQA and MLA attention in prefill and decode (GQA prefill in both kernels:
    /// per (token, head) and tiled, `ATTN_GQA_TILED` cases), the all-reduce, and the data
    /// movement ops (fill, column copy, residual add with and without f16 rounding, KV-cache
    /// writes, row gather and scaled scatter-add), and the DSA ops (`dsa.rs`).
    pub fn self_check(&self) -> Vec<KernelCheck> {
        Self::CHECKS.iter().flat_map(|(_, cases)| cases(self)).collect()
    }

    /// The check families' op names, in run order (`kernels --check` runs them all).
    pub fn check_families() -> impl Iterator<Item = &'static str> {
        Self::CHECKS.iter().map(|(op, _)| *op)
    }

    /// The checks of the families named `op` only.
    pub fn self_check_family(&self, op: &str) -> Vec<KernelCheck> {
        Self::CHECKS
            .iter()
            .filter(|(o, _)| *o == op)
            .flat_map(|(_, cases)| cases(self))
            .collect()
    }

    /// The check families in the order `self_check` runs them: (op, cases). Each case runs the
    /// GPU kernel and the CPU engine's on the same inputs and names itself by its parameters.
    #[allow(clippy::type_complexity)]
    const CHECKS: [(&'static str, fn(&CudaBackend) -> Vec<KernelCheck>); 28] = [
        ("MUL_MAT", CudaBackend::check_mul_mat_get_rows),
        ("GEMV", CudaBackend::check_gemv_xs),
        ("GEMV", CudaBackend::check_gemv_rows),
        ("GEMV", CudaBackend::check_gemv_int_extremes),
        ("GEMV_LIMBS", CudaBackend::check_gemv_limbs),
        ("MUL_MAT", CudaBackend::check_matvec_odd),
        ("RMS_NORM", CudaBackend::check_rms_norm),
        ("ROPE", CudaBackend::check_rope),
        ("MUL_MAT_MANY", CudaBackend::check_gemv_multi),
        ("MUL_MAT_QKV_ROPE", CudaBackend::check_qkv_rope),
        ("ADD_RMS_NORM", CudaBackend::check_add_rms_norm),
        ("RMS_NORM_SPLIT", CudaBackend::check_norm_split),
        ("ROPE_QK", CudaBackend::check_rope_qk),
        ("ROPE_QK_CACHE", CudaBackend::check_rope_qk_cache),
        ("SWIGLU", CudaBackend::check_swiglu),
        ("GQA_FAMILY_OPS", CudaBackend::check_family_ops),
        ("ATTN", CudaBackend::check_attention),
        ("ALL_REDUCE", CudaBackend::check_all_reduce),
        ("MOE_ROUTE", CudaBackend::check_moe_route),
        ("DATA_MOVEMENT", CudaBackend::check_data_movement),
        ("MUL_MAT_GEMM", CudaBackend::gemm_checks),
        ("ATTN_GQA_TILED", CudaBackend::attn_tiled_checks),
        ("ATTN_GQA_SPLIT", CudaBackend::attn_split_checks),
        ("DECODE_GRAPH", CudaBackend::check_decode_graph_cases),
        ("ATTN_MLA_SPARSE", CudaBackend::check_mla_sparse),
        ("LAYER_NORM", CudaBackend::check_layer_norm),
        ("INDEX_SCORES", CudaBackend::check_index_scores),
        ("FP8_GROUPS", CudaBackend::check_fp8_groups),
    ];

    /// Matmul/matvec and the embedding gather for every GPU weight type (`MUL_MAT` cases).
    fn check_mul_mat_get_rows(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let rows = 37;
        for ty in crate::cuda_kernels::GPU_TYPES {
            let cols = match ty {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 291,
                GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::IQ4XS => 512,
                _ => 320,
            };
            let wf = noise(rows * cols, 7 + ty as u64);
            let bytes = match ty {
                GgmlType::IQ4NL | GgmlType::IQ4XS | GgmlType::MXFP4 => {
                    codebook_test_bytes(ty, rows * cols, 7 + ty as u64)
                }
                _ => references::quant::quantize(ty, &wf).expect("quantize test weights"),
            };
            let q = QMat {
                ty,
                bytes: &bytes,
                rows,
                cols,
                row_bytes: bytes.len() / rows,
            };
            let w = if ty == GgmlType::F32 {
                WeightRef::F32(Mat { data: &wf, rows, cols })
            } else {
                WeightRef::Quant(q)
            };
            for n in [1usize, 5, 9, 17] {
                let x = noise(n * cols, 100 + n as u64);
                let (g, c) = both(self, |be| {
                    let mut o = be.alloc(n * rows);
                    be.linear(&be.upload(&x), n, w, &mut o);
                    be.download(&o)
                });
                let name = type_suffix(ty).unwrap_or("?");
                out.push(compare(
                    Case::new("MUL_MAT")
                        .p("type", name)
                        .p("ne", format!("[{cols},{rows}]"))
                        .p("n", n)
                        .to_string(),
                    &g,
                    &c,
                    1e-5,
                ));
            }
            let ids = [Some(3), None, Some(36), Some(0), None];
            let (g, c) = both(self, |be| {
                let mut o = be.upload(&vec![1f32; ids.len() * cols]);
                be.embed_rows(w, &ids, &mut o);
                be.download(&o)
            });
            out.push(compare(
                format!(
                    "GET_ROWS(type={},ne=[{cols},{rows}],n=5)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                0.0,
            ));
            // A decode step's gather (the token read from device memory) of a shard starting at
            // token 5: rows 3 and 0, and tokens below and past the shard (zeros).
            let (g, c) = both(self, |be| {
                let mut all = Vec::new();
                for token in [8, 4, 5 + rows as u32, 5] {
                    let mut o = be.upload(&vec![1f32; cols]);
                    be.embed_token(w, token, 5, &mut o);
                    all.extend(be.download(&o));
                }
                all
            });
            out.push(compare(
                format!(
                    "GET_ROWS(type={},ne=[{cols},{rows}],token from the device,shard at 5)",
                    type_suffix(ty).unwrap_or("?")
                ),
                &g,
                &c,
                0.0,
            ));
            // The test bytes die here; a later type's may reuse their address and length.
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// The warp-per-row matvec on repacked Q4_1 rows of an odd block count (`MUL_MAT` cases).
    fn check_matvec_odd(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let rows = 37;
        // Q4_1 with an odd number of blocks per row (no GEMV: the warp-per-row matvec on the
        // repacked layout), one token.
        {
            let (ty, cols) = (GgmlType::Q4_1, 352);
            let bytes = test_bytes(ty, rows, cols, 42);
            let w = test_weight(ty, &bytes, rows, cols);
            let x = noise(cols, 43);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(rows);
                be.linear(&be.upload(&x), 1, w, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("MUL_MAT")
                    .p("type", "q4_1")
                    .p("ne", format!("[{cols},{rows}]"))
                    .p("n", "1")
                    .p("path", "matvec")
                    .to_string(),
                &g,
                &c,
                1e-5,
            ));
            self.weights.lock().expect("weight map").clear();
        }
        out
    }

    /// RMSNorm (`RMS_NORM` cases).
    fn check_rms_norm(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // Decode-sized rows (one block of 1024 threads, float4 and scalar paths, rows longer
        // than the block) next to the small shapes.
        for (n, d) in [
            (1usize, 576usize),
            (7, 1000),
            (3, 64),
            (1, 4096),
            (1, 8192),
            (1, 8196),
            (1, 4098),
            (1, 100),
            (3, 8200),
            (2, 4098),
        ] {
            let x = noise(n * d, 11);
            let wt = noise(d, 12);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * d);
                be.rms_norm(&be.upload(&x), &wt, 1e-5, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("RMS_NORM").p("ne", format!("[{d},{n}]")).to_string(),
                &g,
                &c,
                1e-6,
            ));
        }
        self.weights.lock().expect("weight map").clear();
        out
    }

    /// RoPE NORM and NEOX (`ROPE` cases), plain and with frequency scaling: Llama 3.1+'s per-pair
    /// factors ([`llama3_factors`], `freqs=llama3`) alone and with a linear divisor of 2
    /// (`freqs=llama3/2`), against the CPU engine's `rope_scaled`.
    fn check_rope(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // One factor vector per rope_dim, alive for the whole family (the weight map keys the
        // device copy by the host slice's address).
        let factors: Vec<(usize, Vec<f32>)> = [64usize, 16].map(|d| (d, llama3_factors(d, 10000.0))).into();
        let factors_for = |d: usize| &factors.iter().find(|(fd, _)| *fd == d).expect("rope_dim listed").1[..];
        for (style, scaled) in [RopeStyle::Norm, RopeStyle::Neox]
            .into_iter()
            .flat_map(|s| [(s, None), (s, Some(1.0f32)), (s, Some(2.0))])
        {
            for (layout, pos0) in [
                (
                    RopeLayout {
                        n_heads: 3,
                        head_stride: 64,
                        offset: 0,
                        rope_dim: 64,
                    },
                    5usize,
                ),
                (
                    RopeLayout {
                        n_heads: 5,
                        head_stride: 40,
                        offset: 24,
                        rope_dim: 16,
                    },
                    1000,
                ),
            ] {
                // Positions past the original context (64) so every band of the factors shows.
                let (n, pos0) = if scaled.is_some() { (24, pos0 + 100) } else { (6, pos0) };
                let freqs = scaled.map_or(RopeFreqs::default(), |divisor| RopeFreqs {
                    divisor,
                    factors: Some(factors_for(layout.rope_dim)),
                });
                let tag = match scaled {
                    None => String::new(),
                    Some(1.0) => ",freqs=llama3".to_string(),
                    Some(d) => format!(",freqs=llama3/{d}"),
                };
                let x = noise(n * layout.n_heads * layout.head_stride, 13);
                let (g, c) = both(self, |be| {
                    let mut b = be.upload(&x);
                    be.rope(&mut b, layout, pos0, 10000.0, style, freqs);
                    be.download(&b)
                });
                out.push(compare(
                    format!(
                        "ROPE(style={style:?},heads={},stride={},off={},dim={},pos0={pos0},n={n}{tag})",
                        layout.n_heads, layout.head_stride, layout.offset, layout.rope_dim
                    ),
                    &g,
                    &c,
                    1e-5,
                ));
            }
        }
        // Nothing keyed by these factors' addresses outlives them.
        *self.rope_table.lock().expect("rope table") = None;
        self.weights.lock().expect("weight map").clear();
        out
    }

    /// The residual add fused with the next norm (`ADD_RMS_NORM` cases).
    fn check_add_rms_norm(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // The residual add fused with the next norm: x after the add, then the normed rows; on
        // the GPU also against the add and the norm as two launches, bit for bit.
        for (d, n, f16) in [
            (4096usize, 2usize, false),
            (4098, 3, true),
            (576, 5, false),
            (4096, 1, false),
            (4096, 1, true),
            (576, 1, false),
            (8192, 1, false),
            (8196, 1, true),
        ] {
            let (x, a, wt) = (noise(n * d, 19), noise(n * d, 20), noise(d, 21));
            let (g, c) = both(self, |be| {
                let (mut xb, mut o) = (be.upload(&x), be.alloc(n * d));
                be.add_rms_norm(&mut xb, &be.upload(&a), f16, &wt, 1e-5, &mut o);
                [be.download(&xb), be.download(&o)].concat()
            });
            let case = Case::new("ADD_RMS_NORM")
                .p("ne", format!("[{d},{n}]"))
                .p("f16", f16)
                .to_string();
            out.push(compare(case.clone(), &g, &c, 1e-6));
            let (mut xb, mut o) = (self.upload(&x), self.alloc(n * d));
            self.add_assign(&mut xb, &self.upload(&a), f16);
            self.rms_norm(&xb, &wt, 1e-5, &mut o);
            let two = [self.download(&xb), self.download(&o)].concat();
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &two, 0.0));
        }
        out
    }

    /// RoPE of q and k in one launch (`ROPE_QK` cases).
    fn check_rope_qk(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // q and k in one launch: 5 + 2 heads (a chunk spanning both), MLA-like offsets.
        for (ql, kl, pos0) in [
            (
                RopeLayout {
                    n_heads: 5,
                    head_stride: 24,
                    offset: 0,
                    rope_dim: 24,
                },
                RopeLayout {
                    n_heads: 2,
                    head_stride: 24,
                    offset: 0,
                    rope_dim: 24,
                },
                7usize,
            ),
            (
                RopeLayout {
                    n_heads: 3,
                    head_stride: 40,
                    offset: 24,
                    rope_dim: 16,
                },
                RopeLayout {
                    n_heads: 1,
                    head_stride: 16,
                    offset: 0,
                    rope_dim: 16,
                },
                513,
            ),
        ] {
            let n = 5;
            let xq = noise(n * ql.n_heads * ql.head_stride, 15);
            let xk = noise(n * kl.n_heads * kl.head_stride, 16);
            let (g, c) = both(self, |be| {
                let (mut q, mut k) = (be.upload(&xq), be.upload(&xk));
                be.rope_qk(
                    &mut q,
                    ql,
                    &mut k,
                    kl,
                    pos0,
                    10000.0,
                    RopeStyle::Neox,
                    RopeFreqs::default(),
                );
                [be.download(&q), be.download(&k)].concat()
            });
            out.push(compare(
                format!(
                    "ROPE_QK(q={}x{}+{},k={}x{},dim={},pos0={pos0})",
                    ql.n_heads, ql.head_stride, ql.offset, kl.n_heads, kl.head_stride, ql.rope_dim
                ),
                &g,
                &c,
                1e-5,
            ));
        }
        out
    }

    /// RoPE with the KV-cache append in one launch (`ROPE_QK_CACHE` cases).
    fn check_rope_qk_cache(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // RoPE with the KV-cache append in one launch (rope_qk_cache), after 7 cached rows:
        // against the CPU engine, and bit for bit against the GPU's separate launches (rope_qk,
        // then kv_write twice). GQA-like (4 + 2 heads of 16, NORM; 1 and 3 rows) and a partial
        // rope (dims 8..24 of heads of 24, NEOX).
        for (hd, off, dim, style, n) in [
            (16usize, 0usize, 16usize, RopeStyle::Norm, 1usize),
            (16, 0, 16, RopeStyle::Norm, 3),
            (24, 8, 16, RopeStyle::Neox, 2),
        ] {
            let layout = |heads| RopeLayout {
                n_heads: heads,
                head_stride: hd,
                offset: off,
                rope_dim: dim,
            };
            let (ql, kl, vw, pos0) = (layout(4), layout(2), 20usize, 7usize);
            let (xq, xk, xv) = (noise(n * 4 * hd, 17), noise(n * 2 * hd, 18), noise(n * vw, 19));
            let (old_k, old_v) = (noise(pos0 * 2 * hd, 20), noise(pos0 * vw, 21));
            let run = |be: &dyn Backend, fused: bool| {
                let (mut q, mut k, v) = (be.upload(&xq), be.upload(&xk), be.upload(&xv));
                let (mut kc, mut vc) = (Buf::default(), Buf::default());
                be.kv_write(&mut kc, &be.upload(&old_k), 2 * hd, 0, 0);
                be.kv_write(&mut vc, &be.upload(&old_v), vw, 0, 0);
                if fused {
                    let rope = QkRope {
                        q: ql,
                        k: kl,
                        pos0,
                        base: 10000.0,
                        style,
                        freqs: RopeFreqs::default(),
                    };
                    be.rope_qk_cache(&mut q, &mut k, &v, vw, rope, [&mut kc, &mut vc]);
                } else {
                    be.rope_qk(&mut q, ql, &mut k, kl, pos0, 10000.0, style, RopeFreqs::default());
                    be.kv_write(&mut kc, &k, 2 * hd, pos0, pos0);
                    be.kv_write(&mut vc, &v, vw, pos0, pos0);
                }
                [be.download(&q), be.download(&k), be.download(&kc), be.download(&vc)].concat()
            };
            let case = Case::new("ROPE_QK_CACHE")
                .p("hd", hd)
                .p("off", off)
                .p("dim", dim)
                .p("style", format!("{style:?}"))
                .p("n", n)
                .p("pos0", pos0)
                .to_string();
            let (g, c) = both(self, |be| run(be, true));
            out.push(compare(case.clone(), &g, &c, 1e-5));
            out.push(compare(format!("{case}_VS_SEPARATE"), &g, &run(self, false), 0.0));
        }
        out
    }

    /// SwiGLU (`SWIGLU` cases).
    fn check_swiglu(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        {
            let gate = noise(1001, 14);
            let up = noise(1001, 15);
            let (g, c) = both(self, |be| {
                let mut b = be.upload(&gate);
                be.swiglu(&mut b, &be.upload(&up));
                be.download(&b)
            });
            out.push(compare("SWIGLU(ne=[1001])".into(), &g, &c, 1e-6));
        }
        out
    }

    /// The qwen/glm4moe/gemma ops (`GQA_FAMILY_OPS` cases): the q/k/v bias add, GELU-tanh GLU,
    /// the embedding scale, the final-logit soft-cap, the per-head q/k RMSNorm (rows of
    /// head_dim), and attention with a sliding window and a score soft-cap in prefill and decode
    /// (`gqa_attention_masked`).
    fn check_family_ops(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let (n, w) = (5usize, 96usize);
        let y = noise(n * w, 40);
        let bias = noise(w, 41);
        let (g, c) = both(self, |be| {
            let mut b = be.upload(&y);
            be.add_bias(&mut b, &bias);
            be.download(&b)
        });
        out.push(compare(
            Case::new("ADD_BIAS").p("ne", format!("[{w},{n}]")).to_string(),
            &g,
            &c,
            1e-7,
        ));
        let gate: Vec<f32> = noise(1001, 42).iter().map(|v| v * 3.0).collect();
        let up = noise(1001, 43);
        let (g, c) = both(self, |be| {
            let mut b = be.upload(&gate);
            be.geglu(&mut b, &be.upload(&up));
            be.download(&b)
        });
        out.push(compare("GEGLU(ne=[1001])".into(), &g, &c, 1e-6));
        let (g, c) = both(self, |be| {
            let mut b = be.upload(&y);
            be.scale(&mut b, 8.0);
            be.download(&b)
        });
        out.push(compare(Case::new("SCALE").p("s", 8).to_string(), &g, &c, 1e-7));
        let logits: Vec<f32> = noise(999, 44).iter().map(|v| v * 60.0).collect();
        let (g, c) = both(self, |be| {
            let mut b = be.upload(&logits);
            be.softcap(&mut b, 30.0);
            be.download(&b)
        });
        out.push(compare("SOFTCAP(ne=[999],cap=30)".into(), &g, &c, 1e-6));
        for hd in [16usize, 64, 128] {
            let x = noise(7 * 6 * hd, 45);
            let wn = noise(hd, 46);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(x.len());
                be.rms_norm(&be.upload(&x), &wn, 1e-6, &mut o);
                be.download(&o)
            });
            let case = Case::new("RMS_NORM_HEADS").p("hd", hd).p("rows", 7 * 6);
            out.push(compare(case.to_string(), &g, &c, 1e-5));
        }
        for (pos0, n, window, softcap) in [
            (0usize, 9usize, Some(4usize), None),
            (12, 1, Some(4), None),
            (0, 9, None, Some(5.0f32)),
            (12, 1, Some(4), Some(5.0)),
        ] {
            let hd = 16;
            let t = pos0 + n;
            let s = GqaShape {
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: hd,
                scale: 0.25,
                window,
                softcap,
            };
            let q: Vec<f32> = noise(n * 4 * hd, 47).iter().map(|v| v * 4.0).collect();
            let k = noise(t * 2 * hd, 48);
            let v = noise(t * 2 * hd, 49);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * 4 * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            });
            let case = Case::new("ATTN_GQA_MASKED")
                .p("window", window.map_or("none".to_string(), |w| w.to_string()))
                .p("softcap", softcap.map_or("none".to_string(), |c| c.to_string()))
                .p("pos0", pos0)
                .p("n", n);
            out.push(compare(case.to_string(), &g, &c, 1e-5));
        }
        out
    }

    /// GQA and MLA attention, the per-(token, head) kernel (`ATTN` cases).
    fn check_attention(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // The per-(token, head) kernel in prefill and decode (the tiled and split ones have their
        // own cases below).
        let tiled = self.attn.set(false);
        let split = self.attn.set_split(0);
        for (pos0, n, hd) in [
            (0usize, 7usize, 40usize),
            (7, 1, 40),
            (30, 3, 40),
            (517, 1, 128),
            (0, 70, 64),
            (300, 2, 37),
        ] {
            let t = pos0 + n;
            let s = GqaShape {
                window: None,
                softcap: None,
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let q = noise(n * 6 * hd, 16);
            let k = noise(t * 2 * hd, 17);
            let v = noise(t * 2 * hd, 18);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * 6 * hd);
                be.gqa_attention(&be.upload(&q), &be.upload(&k), &be.upload(&v), pos0, s, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("ATTN_GQA")
                    .p("H", "6")
                    .p("KV", "2")
                    .p("hd", hd)
                    .p("pos0", pos0)
                    .p("n", n)
                    .to_string(),
                &g,
                &c,
                1e-5,
            ));
            let m = MlaShape {
                n_heads: 3,
                nope: 24,
                rope: 8,
                v_dim: 20,
                scale: 0.2,
            };
            let q = noise(n * 3 * 32, 19);
            let kn = noise(t * 3 * 24, 20);
            let kp = noise(t * 8, 21);
            let v = noise(t * 3 * 20, 22);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * 60);
                let (qd, knd, kpd, vd) = (be.upload(&q), be.upload(&kn), be.upload(&kp), be.upload(&v));
                be.mla_attention(&qd, &knd, &kpd, &vd, pos0, m, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("ATTN_MLA")
                    .p("H", "3")
                    .p("nope", "24")
                    .p("rope", "8")
                    .p("v", "20")
                    .p("pos0", pos0)
                    .p("n", n)
                    .to_string(),
                &g,
                &c,
                1e-5,
            ));
        }
        self.attn.set(tiled);
        self.attn.set_split(split);
        out
    }

    /// The all-reduce sum (`ALL_REDUCE` cases).
    fn check_all_reduce(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        {
            let parts: Vec<Vec<f32>> = (0..8).map(|r| noise(999, 30 + r)).collect();
            let (g, c) = both(self, |be| {
                let bufs: Vec<Buf> = parts.iter().map(|p| be.upload(p)).collect();
                let refs: Vec<&Buf> = bufs.iter().collect();
                be.download(&be.all_reduce(&refs)[0])
            });
            out.push(compare("ALL_REDUCE(ranks=8,ne=[999])".into(), &g, &c, 0.0));
        }
        out
    }

    /// MoE routing (`MOE_ROUTE` cases).
    fn check_moe_route(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // MoE routing: chosen experts and weights (ids as floats, then weights) against the host's
        // route(); DeepSeek-V3-like (sigmoid, bias, 8 groups keep 3, normalized, scaled) and a
        // softmax router without groups, over 7 tokens of random logits.
        for (n_exp, k, gating, groups, bias) in [
            (64usize, 6usize, Gating::Sigmoid, (8usize, 3usize), true),
            (37, 4, Gating::Softmax, (1, 1), false),
            (256, 8, Gating::Sigmoid, (8, 4), true),
        ] {
            let m = MoeConfig {
                n_experts: n_exp,
                n_used: k,
                n_shared: 0,
                expert_ffn: 4,
                n_dense_lead: 0,
                weights_scale: 2.5,
                weights_norm: bias,
                gating,
                n_groups: groups.0,
                n_groups_used: groups.1,
            };
            let logits: Vec<f32> = noise(7 * n_exp, 60 + k as u64).iter().map(|v| 4.0 * v).collect();
            let b = noise(n_exp, 70);
            let (g, c) = both(self, |be| {
                let routes = be.moe_route(&be.upload(&logits), n_exp, &m, bias.then_some(&b[..]), 2.5);
                let ids = routes.iter().flat_map(|r| r.experts.iter().map(|&e| e as f32));
                ids.chain(routes.iter().flat_map(|r| r.weights.iter().copied()))
                    .collect()
            });
            out.push(compare(
                format!(
                    "MOE_ROUTE(experts={n_exp},k={k},{gating:?},groups={}/{},bias={bias})",
                    groups.1, groups.0
                ),
                &g,
                &c,
                1e-6,
            ));
        }
        out
    }

    /// Fill, column copy, residual add, KV writes, gather and scatter-add (`DATA_MOVEMENT` cases).
    fn check_data_movement(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // Data movement: exact (tolerance 0); the canary must survive bit for bit.
        {
            let (g, c) = both(self, |be| {
                let mut b = be.upload(&noise(77, 50));
                be.fill(&mut b, references::tap::canary());
                be.download(&b)
            });
            let bits_ok = g.iter().all(|v| v.to_bits() == references::tap::canary().to_bits());
            out.push(KernelCheck {
                case: "FILL(canary,ne=[77])".into(),
                rel_l2: 0.0,
                max_abs: 0.0,
                tol: 0.0,
                pass: bits_ok && g.len() == c.len(),
            });
            // The 16-bit store (round_dtype): bit for bit the host's rounding, on ordinary values
            // over a wide range, exact ties, overflow, f16 subnormals and underflow, infinities,
            // and NaNs (each dtype's canary must come out of the f32 canary and stay).
            let mut vals: Vec<f32> = noise(300, 56)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (2f32).powi((i % 60) as i32 - 30))
                .collect();
            vals.extend([
                1.0 + (-8f32).exp2(),
                1.0 + 3.0 * (-8f32).exp2(),
                1.0 + (-11f32).exp2(),
                -(1.0 + 3.0 * (-11f32).exp2()),
                65504.0,
                65520.0,
                70000.0,
                f32::MAX,
                -f32::MAX,
                3.0 * (-24f32).exp2(),
                1e-8,
                1e-40,
                0.0,
                -0.0,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                -f32::NAN,
                references::tap::canary(),
                references::tap::canary_bf16(),
                references::tap::canary_f16(),
                f32::from_bits(0x7F80_0001),
            ]);
            for dtype in [ComputeDtype::Bf16, ComputeDtype::F16] {
                let (g, c) = both(self, |be| {
                    let mut b = be.upload(&vals);
                    be.round_to(&mut b, dtype);
                    be.download(&b)
                });
                let bits_ok = g.len() == c.len() && g.iter().zip(&c).all(|(a, b)| a.to_bits() == b.to_bits());
                out.push(KernelCheck {
                    case: format!("ROUND(dtype={dtype},ne=[{}])", vals.len()),
                    rel_l2: 0.0,
                    max_abs: 0.0,
                    tol: 0.0,
                    pass: bits_ok,
                });
            }
            let src = noise(9 * 13, 51);
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(9 * 5);
                be.copy_cols(&be.upload(&src), 13, 7, 5, &mut o);
                be.download(&o)
            });
            out.push(compare("COPY_COLS(ne=[13,9],cols=7..12)".into(), &g, &c, 0.0));
            for f16_round in [false, true] {
                let (x, a) = (
                    noise(501, 52),
                    noise(501, 53).iter().map(|v| v * 3e3).collect::<Vec<_>>(),
                );
                let (g, c) = both(self, |be| {
                    let mut b = be.upload(&x);
                    be.add_assign(&mut b, &be.upload(&a), f16_round);
                    be.download(&b)
                });
                out.push(compare(
                    Case::new("ADD").p("f16_round", f16_round).p("ne", "[501]").to_string(),
                    &g,
                    &c,
                    0.0,
                ));
            }
            for (pos0, slot0, n) in [(0usize, 0usize, 5usize), (5, 5, 1), (5, 4, 1), (70, 70, 3)] {
                let width = 24;
                let old = noise(pos0.max(1) * width + 48, 54);
                let new = noise(n * width, 55);
                let (g, c) = both(self, |be| {
                    let mut cache = Buf::default();
                    if pos0 > 0 {
                        // A cache that held more rows than it keeps (a re-prefill truncates).
                        be.kv_write(&mut cache, &be.upload(&old), width, 0, 0);
                    }
                    be.kv_write(&mut cache, &be.upload(&new), width, pos0, slot0);
                    be.download(&cache)
                });
                out.push(compare(
                    Case::new("KV_WRITE")
                        .p("width", width)
                        .p("pos0", pos0)
                        .p("slot0", slot0)
                        .p("n", n)
                        .to_string(),
                    &g,
                    &c,
                    0.0,
                ));
            }
            let x = noise(6 * 33, 56);
            let y = noise(4 * 33, 57);
            let (rows_, weights) = ([4usize, 0, 4, 2], [0.5f32, -1.25, 2.0, 0.75]);
            let (g, c) = both(self, |be| {
                let xd = be.upload(&x);
                let gathered = be.gather_rows(&xd, 33, &rows_);
                let mut o = be.dup(&xd);
                be.add_rows_scaled(&mut o, &be.upload(&y), 33, &rows_, &weights);
                let mut v = be.download(&gathered);
                v.extend(be.download(&o));
                v
            });
            out.push(compare("GATHER_SCATTER_ADD(ne=[33,6],rows=4)".into(), &g, &c, 0.0));
        }
        out
    }

    /// A recorded decode step against the same ops one by one (`DECODE_GRAPH` cases).
    fn check_decode_graph_cases(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // The recorded step with the split decode attention (at its setting, the default where it
        // is off) and with the per-(token, head) kernel.
        let split = self.attn.split_chunk();
        for chunk in [if split == 0 { attn::SPLIT_CHUNK_DEFAULT } else { split }, 0] {
            self.attn.set_split(chunk);
            out.push(self.check_decode_graph(chunk));
        }
        self.attn.set_split(split);
        out
    }

    /// A decode step's position-dependent ops (RoPE, KV append, GQA attention) recorded as a
    /// graph at one position and replayed at the next, against the same ops launched one by one
    /// on this GPU: bit-exact (the same kernels, the position read from device memory), and the
    /// last value says whether the recorded side really was recorded and replayed (1).
    pub(super) fn check_decode_graph(&self, split: usize) -> KernelCheck {
        let (hd, nh, nkv, pos0) = (64usize, 4usize, 2usize, 37usize);
        let (kw, qw) = (nkv * hd, nh * hd);
        let shape = GqaShape {
            window: None,
            softcap: None,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
            scale: 0.125,
        };
        let layout = |h| RopeLayout {
            n_heads: h,
            head_stride: hd,
            offset: 0,
            rope_dim: hd,
        };
        let (pk, pv) = (noise(pos0 * kw, 60), noise(pos0 * kw, 61));
        let inputs: Vec<[Vec<f32>; 3]> = (0..2)
            .map(|i| [noise(qw, 62 + i), noise(kw, 64 + i), noise(kw, 66 + i)])
            .collect();
        let run = |record: bool| {
            let be: &dyn Backend = self;
            let (mut kc, mut vc) = (Buf::default(), Buf::default());
            be.kv_write(&mut kc, &be.upload(&pk), kw, 0, 0);
            be.kv_write(&mut vc, &be.upload(&pv), kw, 0, 0);
            let mut q = be.upload(&inputs[0][0]);
            let mut k = be.upload(&inputs[0][1]);
            let mut v = be.upload(&inputs[0][2]);
            let next: Vec<Buf> = inputs[1].iter().map(|x| be.upload(x)).collect();
            let mut o = be.alloc(qw);
            let step = |q: &mut Buf, k: &mut Buf, v: &Buf, kc: &mut Buf, vc: &mut Buf, o: &mut Buf, pos: usize| {
                be.rope(q, layout(nh), pos, 10000.0, RopeStyle::Norm, RopeFreqs::default());
                be.rope(k, layout(nkv), pos, 10000.0, RopeStyle::Norm, RopeFreqs::default());
                be.kv_write(kc, k, kw, pos, pos);
                be.kv_write(vc, v, kw, pos, pos);
                be.gqa_attention(q, kc, vc, pos, shape, o);
            };
            let recording = record && be.graph_begin(pos0, 0);
            step(&mut q, &mut k, &v, &mut kc, &mut vc, &mut o, pos0);
            let graph = if recording { be.graph_end() } else { None };
            let mut res = be.download(&o);
            be.copy(&next[0], 0, &mut q, 0, qw);
            be.copy(&next[1], 0, &mut k, 0, kw);
            be.copy(&next[2], 0, &mut v, 0, kw);
            match &graph {
                Some(g) => {
                    assert!(g.fits(pos0 + 1));
                    g.replay(pos0 + 1, 0);
                    kc.set_len((pos0 + 2) * kw);
                    vc.set_len((pos0 + 2) * kw);
                }
                None => step(&mut q, &mut k, &v, &mut kc, &mut vc, &mut o, pos0 + 1),
            }
            res.extend(be.download(&o));
            res.extend(be.download(&kc));
            res.extend(be.download(&vc));
            res.push(if graph.is_some() || !record { 1.0 } else { 0.0 });
            res
        };
        let (g, c) = (run(true), run(false));
        compare(
            format!(
                "DECODE_GRAPH(rope+kv_append+gqa,hd={hd},heads={nh}/{nkv},pos0={pos0},replayed at pos0+1,attn={})",
                if split == 0 {
                    "per-head".to_string()
                } else {
                    format!("split{split}")
                }
            ),
            &g,
            &c,
            0.0,
        )
    }
}

/// Test bytes of `n` values of a codebook type (IQ4_NL, IQ4_XS, MXFP4; the project quantizes
/// none of the IQ types): noise bytes, so every index and IQ4_XS sub-block scale (ls 0..63, both
/// signs of ls − 32) occurs, with each f16 d set to a finite value in [0.002, 0.022) and each
/// MXFP4 exponent byte to 0..=140 (2^(e − 128): the two subnormal scales e = 0, 1 included, none
/// large enough for a product to overflow).
pub(super) fn codebook_test_bytes(ty: GgmlType, n: usize, seed: u64) -> Vec<u8> {
    let len = n / ty.block_elems() * ty.block_bytes();
    let mut b: Vec<u8> = noise(len, seed)
        .iter()
        .map(|v| ((v * 0.5 + 0.5) * 256.0) as u8)
        .collect();
    for blk in b.chunks_exact_mut(ty.block_bytes()) {
        match ty {
            GgmlType::MXFP4 => blk[0] %= 141,
            _ => {
                let d = half::f16::from_f32(0.002 + 0.02 * blk[1] as f32 / 256.0);
                blk[..2].copy_from_slice(&d.to_le_bytes());
            }
        }
    }
    b
}

/// Llama 3.1+'s per-pair RoPE frequency divisors (what `rope_freqs.weight` holds), as the
/// converter computes them: factor 8, low/high frequency factors 1 and 4, and an original context
/// of 64 positions, small enough that pairs of a rope_dim of 16 or 64 fall in all three bands
/// (kept: 1, smoothed, divided by 8).
pub(super) fn llama3_factors(rope_dim: usize, base: f64) -> Vec<f32> {
    let (factor, low, high, orig) = (8.0f64, 1.0f64, 4.0f64, 64.0f64);
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    (0..rope_dim / 2)
        .map(|i| {
            let freq = base.powf(-2.0 * i as f64 / rope_dim as f64);
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::{codebook_test_bytes, llama3_factors, Case};
    use references::GgmlType;

    #[test]
    fn codebook_test_bytes_are_finite_and_cover_the_scales() {
        for ty in [GgmlType::IQ4NL, GgmlType::IQ4XS, GgmlType::MXFP4] {
            let b = codebook_test_bytes(ty, 37 * 512, 9);
            assert_eq!(b.len(), 37 * 512 / ty.block_elems() * ty.block_bytes());
            let mut f = vec![0f32; 37 * 512];
            crate::dequant::dequantize(ty, &b, &mut f).expect("whole blocks");
            assert!(f.iter().all(|v| v.is_finite()), "{ty:?}");
            assert!(f.iter().any(|&v| v > 0.0) && f.iter().any(|&v| v < 0.0), "{ty:?}");
        }
        let e: Vec<u8> = codebook_test_bytes(GgmlType::MXFP4, 37 * 512, 9)
            .chunks_exact(17)
            .map(|blk| blk[0])
            .collect();
        assert!(
            e.iter().all(|&e| e <= 140) && e.contains(&0) && e.contains(&1),
            "MXFP4 exponents"
        );
    }

    #[test]
    fn the_check_factors_cover_all_three_bands() {
        for d in [16usize, 32, 64, 128] {
            let f = llama3_factors(d, 10000.0);
            assert_eq!(f.len(), d / 2);
            assert_eq!(f[0], 1.0, "the fastest pair is kept");
            assert_eq!(f[d / 2 - 1], 8.0, "the slowest pair is divided by the factor");
            assert!(
                f.iter().any(|&v| v > 1.0 && v < 8.0),
                "rope_dim {d}: no smoothed pair in {f:?}"
            );
        }
    }

    #[test]
    fn a_case_prints_its_op_and_parameters_in_order() {
        let c = Case::new("GEMV")
            .p("type", "q4_k")
            .p("ne", format!("[{},{}]", 4096, 37))
            .p("n", 1);
        assert_eq!(c.to_string(), "GEMV(type=q4_k,ne=[4096,37],n=1)");
        assert_eq!(Case::new("SWIGLU").to_string(), "SWIGLU()");
    }
}
