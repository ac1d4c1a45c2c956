//! The CUDA kernel module list: each [`KernelId`] names one `kernels/*.cu` source, embedded with
//! `include_str!` and compiled at run time by NVRTC (feature `cuda`, see `crate::cuda`). This list
//! needs no CUDA and is always built, so the sources and their entry points are known everywhere.

use references::GgmlType;

/// Code shared by every module (fixed-width types, f16 decoding, warp and block reductions).
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One NVRTC module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// Quantized matvec/matmul and the embedding gather (`kernels/matmul.cu`), and the one-token
    /// GEMV (`kernels/gemv.cu`: per-unit decode, the integer form, x-stationary; `kernels/gemv_rows.cu`:
    /// warp-rows), one module over their shared decoders.
    Quant,
    /// RMSNorm, RoPE, SwiGLU, GeGLU, soft-cap, scale, bias add, all-reduce sum, and the data movement of device-resident
    /// activations (`kernels/ops.cu`).
    Ops,
    /// GQA and MLA attention over a KV cache (`kernels/attention.cu`).
    Attention,
    /// The tensor-core GEMM for prefill (n > 1) with Q4_K, Q8_0 and Q4_1 weights, and its x
    /// pre-pass (`kernels/gemm.cu`; host side in `cuda/gemm.rs`).
    Gemm,
}

impl KernelId {
    pub const ALL: [KernelId; 4] = [KernelId::Quant, KernelId::Ops, KernelId::Attention, KernelId::Gemm];

    /// The module's name in messages: its source file under `kernels/`, or its files joined by `+`.
    pub fn file(self) -> &'static str {
        match self {
            KernelId::Quant => "matmul.cu+gemv.cu+gemv_rows.cu",
            KernelId::Ops => "ops.cu",
            KernelId::Attention => "attention.cu",
            KernelId::Gemm => "gemm.cu",
        }
    }

    /// The module's source files under `kernels/`, in compile order, each (name, text).
    pub fn files(self) -> &'static [(&'static str, &'static str)] {
        match self {
            KernelId::Quant => &[
                ("matmul.cu", include_str!("../../kernels/matmul.cu")),
                ("gemv.cu", include_str!("../../kernels/gemv.cu")),
                ("gemv_rows.cu", include_str!("../../kernels/gemv_rows.cu")),
            ],
            KernelId::Ops => &[("ops.cu", include_str!("../../kernels/ops.cu"))],
            KernelId::Attention => &[("attention.cu", include_str!("../../kernels/attention.cu"))],
            KernelId::Gemm => &[("gemm.cu", include_str!("../../kernels/gemm.cu"))],
        }
    }

    /// The source NVRTC compiles: [`COMMON`], then the module's files in order, each after a
    /// `#line` naming it (so a compile error names the file and line).
    pub fn full_source(self) -> String {
        let mut s = format!("{COMMON}\n");
        for (name, text) in self.files() {
            s.push_str(&format!("#line 1 \"{name}\"\n{text}"));
        }
        s
    }

    /// The `extern "C"` entry points the module defines.
    pub fn functions(self) -> Vec<String> {
        match self {
            KernelId::Quant => GPU_TYPES
                .iter()
                .flat_map(|&t| {
                    let s = type_suffix(t).expect("GPU_TYPES have suffixes");
                    [format!("matvec_{s}"), format!("matmul_{s}"), format!("gather_{s}")]
                })
                .chain(GEMV_VARIANTS.iter().map(|v| v.entry()))
                .chain(["gemv_x_limbs", "gemv_read_probe"].map(String::from))
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
            ]
            .map(String::from)
            .to_vec(),
            KernelId::Attention => [
                "gqa_attention",
                "gqa_attention_dpos",
                "gqa_attention_masked",
                "mla_attention",
                "gqa_attn_tiled_64",
                "gqa_attn_tiled_128",
                "gqa_attn_tiled_256",
                "gqa_attn_tc_64",
                "gqa_attn_tc_128",
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
            KernelId::Gemm => [
                "gemm_split_x",
                "gemm2_split_x",
                "gemm6_split_x",
                "gemm2_q4_k",
                "gemm2_q4_k_n64",
                "gemm2_q6_k",
                "gemm2_q6_k_n64",
            ]
            .map(String::from)
            .into_iter()
            .chain(
                ["q4_k", "q8_0", "q4_1", "f16", "q6_k"]
                    .iter()
                    .flat_map(|t| [format!("gemm_{t}"), format!("gemm_{t}_n32")]),
            )
            .collect(),
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
        for id in KernelId::ALL {
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
            }
        }
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
