//! The CUDA kernel module list: each [`KernelId`] names one `kernels/*.cu` source, embedded with
//! `include_str!` and compiled at run time by NVRTC (feature `cuda`, see `crate::cuda`). This list
//! needs no CUDA and is always built, so the sources and their entry points are known everywhere.

use references::GgmlType;

/// Code shared by every module (fixed-width types, f16 decoding, warp and block reductions, the
/// per-type gate `FOR_TYPE`).
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One NVRTC module. The quantized products and the prefill GEMM are built once per weight type
/// (the same sources, with `LLMDIFF_TY_<id>` defined for the type: `FOR_TYPE` in
/// `kernels/common.cuh` keeps that type's entry points only), so a model compiles the modules of
/// its own weight types ([`KernelId::for_types`]), each on its own thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// RMSNorm, RoPE, SwiGLU, GeGLU, soft-cap, scale, bias add, all-reduce sum, the data movement
    /// of device-resident activations, and the integer GEMV's x pre-pass (`kernels/ops.cu`); the
    /// DSA indexer's LayerNorm, scores and fp8 group rounding (`kernels/dsa.cu`).
    Ops,
    /// GQA and MLA attention over a KV cache per (token, head), MLA over each query's selected
    /// keys (DSA), and GQA decode split over the context (`kernels/attention.cu` with
    /// `LLMDIFF_ATTN_PART` 1).
    Attention,
    /// GQA prefill attention, tiled on CUDA cores and on tensor cores (`kernels/attention.cu` with
    /// `LLMDIFF_ATTN_PART` 2).
    AttentionTiled,
    /// One weight type's (of [`GPU_TYPES`]) quantized matvec/matmul and embedding gather
    /// (`kernels/matmul.cu`) and x-stationary one-token GEMVs (`kernels/gemv.cu`), built from
    /// `matmul.cu`, `gemv.cu` and `gemv_rows.cu` (their shared decoders) with `LLMDIFF_QUANT_PART` 1.
    Quant(GgmlType),
    /// One weight type's warp-rows one-token GEMVs (`kernels/gemv_rows.cu`; the same three files
    /// with `LLMDIFF_QUANT_PART` 2), for the types that have them ([`has_rows`]).
    QuantRows(GgmlType),
    /// One weight type's (of [`GEMM_TYPES`]) tensor-core GEMM for prefill (n > 1) (`kernels/gemm.cu`;
    /// host side in `cuda/gemm.rs`).
    Gemm(GgmlType),
    /// The GEMM's x pre-passes, shared by every type (`kernels/gemm.cu` with `LLMDIFF_GEMM_X`).
    GemmX,
}

/// The weight types with a tensor-core prefill GEMM (`GEMM_ENTRY` in `kernels/gemm.cu`).
pub const GEMM_TYPES: [GgmlType; 5] = [
    GgmlType::Q4K,
    GgmlType::Q8_0,
    GgmlType::Q4_1,
    GgmlType::F16,
    GgmlType::Q6K,
];

impl KernelId {
    /// Every module: the type-free ones, then per weight type its products, warp-rows GEMVs
    /// (where it has them) and prefill GEMM (where it has one).
    pub fn all() -> Vec<KernelId> {
        [
            KernelId::Ops,
            KernelId::Attention,
            KernelId::AttentionTiled,
            KernelId::GemmX,
        ]
        .into_iter()
        .chain(GPU_TYPES.map(KernelId::Quant))
        .chain(GPU_TYPES.into_iter().filter(|&t| has_rows(t)).map(KernelId::QuantRows))
        .chain(GEMM_TYPES.map(KernelId::Gemm))
        .collect()
    }

    /// The modules a model whose tensors have `types` uses: ops, attention and the f32 products
    /// (f32 weights, and those of the types dequantized to f32 on upload) always; each GPU type's
    /// products and warp-rows GEMVs; each GEMM type's GEMM with the pre-passes. In
    /// [`KernelId::all`]'s order.
    pub fn for_types(types: &[GgmlType]) -> Vec<KernelId> {
        KernelId::all()
            .into_iter()
            .filter(|id| match *id {
                KernelId::Ops | KernelId::Attention | KernelId::AttentionTiled | KernelId::Quant(GgmlType::F32) => true,
                KernelId::Quant(t) | KernelId::QuantRows(t) | KernelId::Gemm(t) => types.contains(&t),
                KernelId::GemmX => types.iter().any(|t| GEMM_TYPES.contains(t)),
            })
            .collect()
    }

    /// The module's short name (cache files, timings): `ops`, `attention`, `attention_tiled`,
    /// `quant_<type>`, `quant_rows_<type>`, `gemm_<type>`, `gemm_x`.
    pub fn name(self) -> String {
        let suffix = |t: GgmlType| type_suffix(t).unwrap_or("unknown");
        match self {
            KernelId::Ops => "ops".into(),
            KernelId::Attention => "attention".into(),
            KernelId::AttentionTiled => "attention_tiled".into(),
            KernelId::Quant(t) => format!("quant_{}", suffix(t)),
            KernelId::QuantRows(t) => format!("quant_rows_{}", suffix(t)),
            KernelId::Gemm(t) => format!("gemm_{}", suffix(t)),
            KernelId::GemmX => "gemm_x".into(),
        }
    }

    /// The module's name in messages: its name, then its source files under `kernels/` joined by `+`.
    pub fn file(self) -> String {
        let files: Vec<&str> = self.files().iter().map(|(n, _)| *n).collect();
        format!("{} ({})", self.name(), files.join("+"))
    }

    /// The module's source files under `kernels/`, in compile order, each (name, text).
    pub fn files(self) -> &'static [(&'static str, &'static str)] {
        match self {
            KernelId::Quant(_) | KernelId::QuantRows(_) => &[
                ("matmul.cu", include_str!("../../kernels/matmul.cu")),
                ("gemv.cu", include_str!("../../kernels/gemv.cu")),
                ("gemv_rows.cu", include_str!("../../kernels/gemv_rows.cu")),
            ],
            KernelId::Ops => &[
                ("ops.cu", include_str!("../../kernels/ops.cu")),
                ("dsa.cu", include_str!("../../kernels/dsa.cu")),
            ],
            KernelId::Attention | KernelId::AttentionTiled => {
                &[("attention.cu", include_str!("../../kernels/attention.cu"))]
            }
            KernelId::Gemm(_) | KernelId::GemmX => &[("gemm.cu", include_str!("../../kernels/gemm.cu"))],
        }
    }

    /// The module's preprocessor definitions, written at the top of its source: the type gate
    /// `LLMDIFF_TY_<id>` (the type's `TY_*` id, its index in [`GPU_TYPES`]), the part of a file
    /// built (`LLMDIFF_QUANT_PART`, `LLMDIFF_ATTN_PART`), or `LLMDIFF_GEMM_X`.
    pub fn defines(self) -> Vec<(String, &'static str)> {
        let ty = |t: GgmlType| {
            let id = GPU_TYPES.iter().position(|&g| g == t).unwrap_or(usize::MAX);
            (format!("LLMDIFF_TY_{id}"), "1")
        };
        match self {
            KernelId::Quant(t) => vec![ty(t), ("LLMDIFF_QUANT_PART".into(), "1")],
            KernelId::QuantRows(t) => vec![ty(t), ("LLMDIFF_QUANT_PART".into(), "2")],
            KernelId::Gemm(t) => vec![ty(t)],
            KernelId::GemmX => vec![("LLMDIFF_GEMM_X".into(), "1")],
            KernelId::Attention => vec![("LLMDIFF_ATTN_PART".into(), "1")],
            KernelId::AttentionTiled => vec![("LLMDIFF_ATTN_PART".into(), "2")],
            KernelId::Ops => Vec::new(),
        }
    }

    /// The source NVRTC compiles: the module's [`defines`](KernelId::defines), [`COMMON`], then
    /// the module's files in order, each after a `#line` naming it (so a compile error names the
    /// file and line). Everything that decides the module's code but the NVRTC options and arch.
    pub fn full_source(self) -> String {
        let mut s = String::new();
        for (name, value) in self.defines() {
            s.push_str(&format!("#define {name} {value}\n"));
        }
        s.push_str(&format!("#line 1 \"common.cuh\"\n{COMMON}\n"));
        for (name, text) in self.files() {
            s.push_str(&format!("#line 1 \"{name}\"\n{text}"));
        }
        s
    }

    /// The `extern "C"` entry points the module defines.
    pub fn functions(self) -> Vec<String> {
        match self {
            KernelId::Quant(ty) => {
                let s = type_suffix(ty).unwrap_or("unknown");
                [format!("matvec_{s}"), format!("matmul_{s}"), format!("gather_{s}")]
                    .into_iter()
                    .chain(
                        GEMV_VARIANTS
                            .iter()
                            .filter(|v| v.ty == ty && v.kind == GemvKind::Xs)
                            .map(|v| v.entry()),
                    )
                    .collect()
            }
            KernelId::QuantRows(ty) => GEMV_VARIANTS
                .iter()
                .filter(|v| v.ty == ty && v.kind == GemvKind::Wr)
                .map(|v| v.entry())
                .chain((ty == GgmlType::Q4K).then(|| "gemv_read_probe".to_string()))
                .collect(),
            KernelId::Ops => [
                "rms_norm",
                "add_rms_norm",
                "rope_qk",
                "swiglu",
                "swiglu_limbs",
                "geglu",
                "softcap_f32",
                "scale_f32",
                "add_bias",
                "all_reduce_sum",
                "fill_u32",
                "round_dtype",
                "copy_cols",
                "add_assign",
                "gather_rows_f32",
                "add_rows_scaled",
                "rope_table",
                "rope_table_dpos",
                "kv_append_dpos",
                "set_i32",
                "nop",
                "moe_route",
                "gemv_x_limbs",
                "layer_norm",
                "index_scores",
                "fp8_groups",
            ]
            .map(String::from)
            .to_vec(),
            KernelId::Attention => [
                "gqa_attention",
                "gqa_attention_dpos",
                "gqa_attention_masked",
                "mla_attention",
                "mla_attention_sparse",
                "gqa_split_128",
                "gqa_split_128_dpos",
                "gqa_split_256",
                "gqa_split_256_dpos",
                "gqa_split_runs_128",
                "gqa_split_runs_128_dpos",
                "gqa_split_runs_256",
                "gqa_split_runs_256_dpos",
            ]
            .map(String::from)
            .to_vec(),
            KernelId::AttentionTiled => [
                "gqa_attn_tiled_64",
                "gqa_attn_tiled_128",
                "gqa_attn_tiled_256",
                "gqa_attn_tc_64",
                "gqa_attn_tc_128",
            ]
            .map(String::from)
            .to_vec(),
            KernelId::Gemm(ty) => {
                let s = type_suffix(ty).unwrap_or("unknown");
                let v2: &[&str] = match ty {
                    GgmlType::Q4K => &["gemm2_q4_k", "gemm2_q4_k_n64"],
                    GgmlType::Q6K => &["gemm2_q6_k", "gemm2_q6_k_n64"],
                    _ => &[],
                };
                [format!("gemm_{s}"), format!("gemm_{s}_n32")]
                    .into_iter()
                    .chain(v2.iter().map(|f| f.to_string()))
                    .collect()
            }
            KernelId::GemmX => ["gemm_split_x", "gemm2_split_x", "gemm6_split_x"]
                .map(String::from)
                .to_vec(),
        }
    }
}

/// The forms of the one-token GEMV: the two work splits of `kernels/gemv.cu` and `kernels/gemv_rows.cu`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKind {
    /// x-stationary (`gemv_*`): a block holds its slice of x in registers and walks groups of R
    /// rows grid-stride, double-buffering the next group's weights.
    Xs,
    /// warp-rows (`gemvw_*`): a block of NW warps computes R rows; each warp walks 32-unit
    /// chunks of the row, U chunks per step, reloading x per chunk.
    Wr,
}

/// One compiled variant of the one-token GEMV (`kernels/gemv.cu`, `kernels/gemv_rows.cu`): R rows per block (step),
/// `upt` units per thread (x-stationary: UPT, the units each thread owns; warp-rows: U, the
/// chunks per step), NW warps per block (warp-rows only; 0 for x-stationary, whose block is sized to
/// the row), MODE how quants meet x: 0 as exact floats, 1 (Q4_K) as floats 1 + q/128, 2
/// (warp-rows Q4_K, Q4_1, Q8_0) as integers, through dp4a with x in int8 limbs, 3 (warp-rows
/// Q4_K) the same with pair units: a thread takes 64 values (two sub-blocks) per row, so a chunk
/// is 32 pairs (2048 values) and the header is decoded once per 64 weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvVariant {
    pub kind: GemvKind,
    pub ty: GgmlType,
    pub r: usize,
    pub nw: usize,
    pub upt: usize,
    pub mode: usize,
}

impl GemvVariant {
    /// The entry point: `gemv_<type>_r<R>_u<UPT>_m<MODE>` or `gemvw_<type>_r<R>_w<NW>_u<U>_m<MODE>`.
    pub fn entry(self) -> String {
        let s = type_suffix(self.ty).expect("GEMV types have suffixes");
        match self.kind {
            GemvKind::Xs => format!("gemv_{s}_r{}_u{}_m{}", self.r, self.upt, self.mode),
            GemvKind::Wr => format!("gemvw_{s}_r{}_w{}_u{}_m{}", self.r, self.nw, self.upt, self.mode),
        }
    }

    /// Values per unit (one thread's share of a row per step).
    pub fn unit_values(ty: GgmlType) -> usize {
        match ty {
            GgmlType::Q4K | GgmlType::Q6K => 32,
            GgmlType::Q8_0 | GgmlType::Q4_1 => 16,
            _ => 8,
        }
    }

    /// Whether the variant takes x as int8 limbs (the integer form: modes 2 and 3 of x-stationary
    /// and warp-rows), from the `gemv_x_limbs` pre-pass or the op that
    /// wrote x.
    pub fn takes_limbs(self) -> bool {
        matches!(self.mode, 2 | 3)
    }

    /// The largest block an x-stationary variant was compiled for (`__launch_bounds__`).
    pub fn max_threads(_ty: GgmlType) -> usize {
        512
    }
}

const fn gv(ty: GgmlType, r: usize, upt: usize, mode: usize) -> GemvVariant {
    GemvVariant {
        kind: GemvKind::Xs,
        ty,
        r,
        nw: 0,
        upt,
        mode,
    }
}

const fn gw(ty: GgmlType, r: usize, nw: usize, u: usize, mode: usize) -> GemvVariant {
    GemvVariant {
        kind: GemvKind::Wr,
        ty,
        r,
        nw,
        upt: u,
        mode,
    }
}

/// The warp-rows variants (the `GEMVW_ENTRY` then `GEMVW_ENTRY_Q` lines of `kernels/gemv_rows.cu`, in
/// the same order): a sweep set for Q4_K (mode 0, and three of mode 1) and Q4_1, two to four for
/// Q8_0, F16, BF16, seven for Q6_K; then the integer form (mode 2, x in int8 limbs from the `gemv_x_limbs`
/// pre-pass) for Q4_K, Q4_1, Q8_0 and Q6_K; then Q4_K's pair units (mode 3): R 2, 4, 8 × NW 1, 2, 4, 7
/// at U 1 (NW 7: the 7 chunks of a 14336-wide row in one step).
const GEMVW_VARIANTS: [GemvVariant; 79] = {
    use GgmlType::{BF16, F16, Q4K, Q4_1, Q6K, Q8_0};
    [
        gw(Q4K, 1, 4, 2, 0),
        gw(Q4K, 1, 4, 4, 0),
        gw(Q4K, 2, 2, 2, 0),
        gw(Q4K, 2, 4, 1, 0),
        gw(Q4K, 2, 4, 2, 0),
        gw(Q4K, 2, 4, 4, 0),
        gw(Q4K, 4, 2, 1, 0),
        gw(Q4K, 4, 2, 2, 0),
        gw(Q4K, 4, 4, 1, 0),
        gw(Q4K, 4, 4, 2, 0),
        gw(Q4K, 8, 2, 1, 0),
        gw(Q4K, 8, 4, 1, 0),
        gw(Q4K, 8, 4, 2, 0),
        gw(Q4K, 4, 4, 1, 1),
        gw(Q4K, 4, 4, 2, 1),
        gw(Q4K, 8, 4, 1, 1),
        gw(Q4_1, 1, 4, 2, 0),
        gw(Q4_1, 2, 2, 1, 0),
        gw(Q4_1, 2, 2, 2, 0),
        gw(Q4_1, 2, 4, 1, 0),
        gw(Q4_1, 2, 4, 2, 0),
        gw(Q4_1, 2, 4, 4, 0),
        gw(Q4_1, 4, 2, 1, 0),
        gw(Q4_1, 4, 2, 2, 0),
        gw(Q4_1, 4, 4, 1, 0),
        gw(Q4_1, 4, 4, 2, 0),
        gw(Q4_1, 4, 4, 4, 0),
        gw(Q4_1, 8, 2, 1, 0),
        gw(Q4_1, 8, 4, 1, 0),
        gw(Q4_1, 8, 4, 2, 0),
        gw(Q8_0, 2, 4, 2, 0),
        gw(Q8_0, 4, 4, 1, 0),
        gw(Q8_0, 4, 4, 2, 0),
        gw(Q8_0, 8, 4, 1, 0),
        gw(F16, 1, 4, 2, 0),
        gw(F16, 2, 4, 1, 0),
        gw(F16, 2, 4, 2, 0),
        gw(BF16, 2, 4, 1, 0),
        gw(BF16, 2, 4, 2, 0),
        gw(Q6K, 2, 4, 1, 0),
        gw(Q6K, 2, 4, 2, 0),
        gw(Q6K, 4, 2, 1, 0),
        gw(Q6K, 4, 4, 1, 0),
        gw(Q6K, 4, 4, 2, 0),
        gw(Q6K, 8, 2, 1, 0),
        gw(Q6K, 8, 4, 1, 0),
        gw(Q4K, 2, 4, 2, 2),
        gw(Q4K, 4, 4, 1, 2),
        gw(Q4K, 4, 4, 2, 2),
        gw(Q4K, 8, 2, 1, 2),
        gw(Q4K, 8, 4, 1, 2),
        gw(Q4K, 8, 4, 2, 2),
        gw(Q4_1, 1, 4, 2, 2),
        gw(Q4_1, 2, 4, 1, 2),
        gw(Q4_1, 4, 4, 1, 2),
        gw(Q4_1, 4, 4, 2, 2),
        gw(Q4_1, 8, 4, 1, 2),
        gw(Q4_1, 8, 4, 2, 2),
        gw(Q8_0, 4, 4, 1, 2),
        gw(Q8_0, 4, 4, 2, 2),
        gw(Q8_0, 8, 4, 1, 2),
        gw(Q8_0, 8, 4, 2, 2),
        gw(Q6K, 2, 4, 1, 2),
        gw(Q6K, 4, 2, 1, 2),
        gw(Q6K, 4, 4, 1, 2),
        gw(Q6K, 8, 2, 1, 2),
        gw(Q6K, 8, 4, 1, 2),
        gw(Q4K, 2, 1, 1, 3),
        gw(Q4K, 2, 2, 1, 3),
        gw(Q4K, 2, 4, 1, 3),
        gw(Q4K, 2, 7, 1, 3),
        gw(Q4K, 4, 1, 1, 3),
        gw(Q4K, 4, 2, 1, 3),
        gw(Q4K, 4, 4, 1, 3),
        gw(Q4K, 4, 7, 1, 3),
        gw(Q4K, 8, 1, 1, 3),
        gw(Q4K, 8, 2, 1, 3),
        gw(Q4K, 8, 4, 1, 3),
        gw(Q4K, 8, 7, 1, 3),
    ]
};

/// Every compiled GEMV variant. x-stationary (`kernels/gemv.cu`: the `GEMV_RU` and
/// `GEMV_ENTRY` lines): R 2 and 4 × UPT 1, 2, 4 for every type (and Q4_K mode 1), plus Q4_K R 6
/// and 8 at UPT 1, then those of the integer form ([`GEMV_XS_INT`]). Then the warp-rows ones
/// ([`GEMVW_VARIANTS`]).
pub const GEMV_VARIANTS: [GemvVariant; 126] = {
    let tys = [
        (GgmlType::F16, 0),
        (GgmlType::BF16, 0),
        (GgmlType::Q8_0, 0),
        (GgmlType::Q4_1, 0),
        (GgmlType::Q4K, 0),
        (GgmlType::Q4K, 1),
    ];
    let ru = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)];
    let mut out = [gv(GgmlType::F16, 2, 1, 0); 126];
    let mut i = 0;
    while i < 36 {
        let (ty, m) = tys[i / 6];
        let (r, u) = ru[i % 6];
        out[i] = gv(ty, r, u, m);
        i += 1;
    }
    out[36] = gv(GgmlType::Q4K, 6, 1, 0);
    out[37] = gv(GgmlType::Q4K, 8, 1, 0);
    let mut j = 0;
    while j < GEMV_XS_INT.len() {
        out[38 + j] = GEMV_XS_INT[j];
        j += 1;
    }
    let mut j = 0;
    while j < GEMVW_VARIANTS.len() {
        out[38 + GEMV_XS_INT.len() + j] = GEMVW_VARIANTS[j];
        j += 1;
    }
    out
};

/// The warps per block of the pair-unit GEMV (mode 3) for rows of `cols` values: of the compiled
/// NW, the one that walks the row's chunks of 32 pairs (2048 values) in the fewest steps (U 1),
/// then with the fewest idle warps (4096 wide: 2; 14336: 7; 8192: 4; 28672: 7, two steps).
pub fn pair_nw(cols: usize) -> usize {
    let chunks = (cols / 64).div_ceil(32).max(1);
    GEMV_VARIANTS
        .iter()
        .filter(|v| v.kind == GemvKind::Wr && v.mode == 3)
        .map(|v| v.nw)
        .min_by_key(|nw| (chunks.div_ceil(*nw), chunks.div_ceil(*nw) * nw - chunks))
        .expect("pair-unit variants")
}

/// The x-stationary variants of the integer form (mode 2; the `GEMV_ENTRY_Q` lines of
/// `kernels/gemv.cu`, in the same order): each thread holds its x slice as int8 limbs.
const GEMV_XS_INT: [GemvVariant; 9] = {
    use GgmlType::{Q4K, Q4_1, Q8_0};
    [
        gv(Q4K, 2, 1, 2),
        gv(Q4K, 4, 1, 2),
        gv(Q4K, 8, 1, 2),
        gv(Q4_1, 2, 2, 2),
        gv(Q4_1, 4, 1, 2),
        gv(Q4_1, 4, 2, 2),
        gv(Q8_0, 2, 2, 2),
        gv(Q8_0, 4, 1, 2),
        gv(Q8_0, 4, 2, 2),
    ]
};

/// The weight types decoded in registers by `kernels/matmul.cu` (IQ4_NL, IQ4_XS and MXFP4 by its
/// generic warp-per-row matvec/matmul and gather only). Others (Q2_K, Q3_K, the IQ1/IQ2/IQ3 and
/// TQ types) are dequantized to f32 on the host when uploaded.
pub const GPU_TYPES: [GgmlType; 14] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::IQ4NL,
    GgmlType::IQ4XS,
    GgmlType::MXFP4,
];

/// Whether a weight type has warp-rows GEMVs (its [`KernelId::QuantRows`] module).
pub fn has_rows(ty: GgmlType) -> bool {
    GEMV_VARIANTS.iter().any(|v| v.ty == ty && v.kind == GemvKind::Wr)
}

/// The entry-point suffix for a weight type with a GPU decoder.
pub fn type_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        GgmlType::IQ4NL => "iq4_nl",
        GgmlType::IQ4XS => "iq4_xs",
        GgmlType::MXFP4 => "mxfp4",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_point_is_defined_in_its_source() {
        for id in KernelId::all() {
            let src = id.full_source();
            for f in id.functions() {
                // `void f(`, or `void __launch_bounds__(N) f(`.
                let defined = src.contains(&format!("void {f}("))
                    || src.contains(&format!(") {f}("))
                    || {
                        // gqa_attn_tiled_<HD> come from GQA_TILED(<HD>, <min blocks>).
                        f.strip_prefix("gqa_attn_tiled_")
                            .is_some_and(|hd| src.contains(&format!("GQA_TILED({hd},")))
                    }
                    || {
                        // gqa_split[_runs]_<HD>[_dpos] come from GQA_SPLIT(gqa_split[_runs]_<HD>, CW, RUNS).
                        let base = f.strip_suffix("_dpos").unwrap_or(&f);
                        f.starts_with("gqa_split_") && src.contains(&format!("GQA_SPLIT({base},"))
                    }
                    || {
                        // matvec_/matmul_/gather_ entry points come from the MATMUL_ENTRY macro.
                        let (kind, ty) = f.split_once('_').unwrap();
                        ["matvec", "matmul", "gather"].contains(&kind) && src.contains(&format!("MATMUL_ENTRY({ty},"))
                    }
                    || {
                        // gemvw_<ty>_r<R>_w<NW>_u<U>_m<M> come from GEMVW_ENTRY(<ty>, TY_<TY>, <R>,
                        // <NW>, <U>, <M>), or GEMVW_ENTRY_Q(...) with the same arguments for the
                        // integer form (modes 2 and 3).
                        f.strip_prefix("gemvw_").is_some_and(|rest| {
                            let (ty, tail) = rest.split_once("_r").unwrap();
                            let (r, tail) = tail.split_once("_w").unwrap();
                            let (nw, tail) = tail.split_once("_u").unwrap();
                            let (u, m) = tail.split_once("_m").unwrap();
                            let tyc = format!("TY_{}", ty.to_uppercase());
                            let mac = if m == "2" || m == "3" {
                                "GEMVW_ENTRY_Q"
                            } else {
                                "GEMVW_ENTRY"
                            };
                            src.contains(&format!("{mac}({ty}, {tyc}, {r}, {nw}, {u}, {m})\n"))
                        })
                    }
                    || {
                        // gemm2_q4_k[_n64], gemm2_q6_k[_n64] come from GEMM2_ENTRY(<name>, <TY>, <NI>).
                        src.contains(&format!("GEMM2_ENTRY({f}, "))
                    }
                    || {
                        // gemm_<ty> and gemm_<ty>_n32 come from GEMM_ENTRY(<ty>, ...).
                        f.strip_prefix("gemm_").is_some_and(|rest| {
                            let ty = rest.strip_suffix("_n32").unwrap_or(rest);
                            src.contains(&format!("GEMM_ENTRY({ty}, "))
                        })
                    }
                    || {
                        // gemv_<ty>_r<R>_u<U>_m<M> come from GEMV_RU(<ty>, TY, <M>, ...) or
                        // GEMV_ENTRY(<ty>, TY, <R>, <U>, <M>, ...).
                        f.strip_prefix("gemv_").is_some_and(|rest| {
                            let (ty, tail) = rest.split_once("_r").unwrap();
                            let m = tail.rsplit_once("_m").unwrap().1;
                            let (r, u) = tail.split_once("_u").unwrap();
                            let u = u.split_once("_m").unwrap().0;
                            let tyc = format!("TY_{}", ty.to_uppercase());
                            if m == "2" {
                                return src.contains(&format!("GEMV_ENTRY_Q({ty}, {tyc}, {r}, {u}, "));
                            }
                            (src.contains(&format!("GEMV_RU({ty}, ")) && src.contains(&format!(", {m}, ")))
                                || src.contains(&format!("GEMV_ENTRY({ty}, TY_Q4_K, {r}, {u}, {m}, "))
                        })
                    };
                assert!(defined, "{f} not defined in {}", id.file());
                // Each entry point sits inside its module's gate, which the compile checks
                // (`nvrtc_compile_times` in cuda/compile.rs); here: the gate's define is set.
                if let KernelId::Quant(t) | KernelId::QuantRows(t) | KernelId::Gemm(t) = id {
                    assert!(src.contains(&format!(
                        "#define LLMDIFF_TY_{} 1",
                        GPU_TYPES.iter().position(|&g| g == t).unwrap()
                    )));
                }
            }
        }
    }

    #[test]
    fn every_entry_point_has_exactly_one_module() {
        let mut seen = std::collections::HashMap::new();
        for id in KernelId::all() {
            for f in id.functions() {
                if let Some(other) = seen.insert(f.clone(), id) {
                    panic!("{f} is in {other:?} and {id:?}");
                }
            }
        }
        // Every type's products and GEMVs, the pre-passes, and nothing of one type in another's module.
        for ty in GPU_TYPES {
            let s = type_suffix(ty).unwrap();
            for f in [format!("matvec_{s}"), format!("matmul_{s}"), format!("gather_{s}")] {
                assert_eq!(seen.get(&f), Some(&KernelId::Quant(ty)), "{f}");
            }
        }
        for v in GEMV_VARIANTS {
            let want = match v.kind {
                GemvKind::Xs => KernelId::Quant(v.ty),
                GemvKind::Wr => KernelId::QuantRows(v.ty),
            };
            assert_eq!(seen.get(&v.entry()), Some(&want), "{}", v.entry());
        }
        for ty in GEMM_TYPES {
            let s = type_suffix(ty).unwrap();
            assert_eq!(seen.get(&format!("gemm_{s}")), Some(&KernelId::Gemm(ty)));
        }
        for f in [
            "gemv_x_limbs",
            "gemm_split_x",
            "gemm2_split_x",
            "gemm6_split_x",
            "gemv_read_probe",
        ] {
            assert!(seen.contains_key(f), "{f}");
        }
        assert_eq!(
            seen.len(),
            14 * 3 + GEMV_VARIANTS.len() + 22 + 1 + 3 + 12 + 1 + 5 + 5 * 2 + 4 + 3 + 1
        );
    }

    #[test]
    fn a_model_compiles_the_modules_of_its_weight_types() {
        use GgmlType::*;
        use KernelId::*;
        let base = [Ops, Attention, AttentionTiled];
        // The 8B Q4_K shape: f32 norms, Q4_K, and Q6_K (output head, some v/down).
        let q4k = KernelId::for_types(&[F32, Q4K, Q6K, Q4K]);
        let want: Vec<KernelId> = base
            .into_iter()
            .chain([
                GemmX,
                Quant(F32),
                Quant(Q4K),
                Quant(Q6K),
                QuantRows(Q4K),
                QuantRows(Q6K),
            ])
            .chain([Gemm(Q4K), Gemm(Q6K)])
            .collect();
        assert_eq!(q4k, want);
        // Types dequantized on upload need the f32 products only; no GEMM type, no pre-passes.
        let q2k = KernelId::for_types(&[Q2K, F32]);
        assert_eq!(q2k, base.into_iter().chain([Quant(F32)]).collect::<Vec<_>>());
        // Q5_K has no warp-rows GEMVs and no GEMM.
        assert_eq!(KernelId::for_types(&[Q5K]).last(), Some(&Quant(Q5K)));
        assert_eq!(KernelId::all().len(), 4 + GPU_TYPES.len() + 6 + GEMM_TYPES.len());
        assert!(KernelId::all()
            .iter()
            .all(|&id| KernelId::for_types(&GPU_TYPES).contains(&id)));
    }

    #[test]
    fn every_module_has_its_own_source_and_name() {
        // The disk cache keys a module by its full source (defines included) and names it.
        let all = KernelId::all();
        for (i, a) in all.iter().enumerate() {
            let src = a.full_source();
            for (name, value) in a.defines() {
                assert!(src.starts_with("#define ") && src.contains(&format!("#define {name} {value}\n")));
            }
            for b in &all[i + 1..] {
                assert_ne!(src, b.full_source(), "{a:?} {b:?}");
                assert_ne!(a.name(), b.name());
            }
        }
        assert_eq!(KernelId::QuantRows(GgmlType::Q4K).name(), "quant_rows_q4_k");
        assert_eq!(KernelId::QuantRows(GgmlType::Q4K).defines()[0].0, "LLMDIFF_TY_8");
    }

    #[test]
    fn the_gpu_types_are_exactly_those_with_a_suffix() {
        for id in 0..=40u32 {
            let Ok(ty) = GgmlType::from_id(id) else { continue };
            assert_eq!(type_suffix(ty).is_some(), GPU_TYPES.contains(&ty), "{ty:?}");
        }
        for ty in [GgmlType::IQ4NL, GgmlType::IQ4XS, GgmlType::MXFP4] {
            assert!(GPU_TYPES.contains(&ty), "{ty:?} keeps its ggml bytes on the device");
        }
    }

    #[test]
    fn pair_units_take_the_warps_that_fit_the_row() {
        for (cols, nw) in [
            (256, 1),
            (2048, 1),
            (4096, 2),
            (5632, 4),
            (8192, 4),
            (14336, 7),
            (16384, 4),
            (28672, 7),
        ] {
            assert_eq!(pair_nw(cols), nw, "cols {cols}");
        }
    }

    #[test]
    fn gemv_variants_are_distinct_and_warp_rows_are_well_formed() {
        for (i, a) in GEMV_VARIANTS.iter().enumerate() {
            assert!(
                GEMV_VARIANTS[i + 1..].iter().all(|b| b.entry() != a.entry()),
                "{}",
                a.entry()
            );
            if a.kind != GemvKind::Xs {
                assert!([1, 2, 4, 8].contains(&a.r) && [1, 2, 4, 7, 8, 14].contains(&a.nw) && (1..=4).contains(&a.upt));
            }
            // Pair units (mode 3) are warp-rows Q4_K only.
            assert!(
                a.mode != 3 || (a.kind == GemvKind::Wr && a.ty == GgmlType::Q4K),
                "{}",
                a.entry()
            );
        }
    }
}
