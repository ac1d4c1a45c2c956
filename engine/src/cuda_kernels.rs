//! The CUDA kernel module list: each [`KernelId`] names one `kernels/*.cu` source, embedded with
//! `include_str!` and compiled at run time by NVRTC (feature `cuda`, see `crate::cuda`). This list
//! needs no CUDA and is always built, so the sources and their entry points are known everywhere.

use references::GgmlType;

/// Code shared by every module (fixed-width types, f16 decoding, warp and block reductions).
pub const COMMON: &str = include_str!("../../kernels/common.cuh");

/// One NVRTC module.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelId {
    /// Quantized matvec/matmul and the embedding gather (`kernels/quant.cu`).
    Quant,
    /// RMSNorm, RoPE, SwiGLU, all-reduce sum, and the data movement of device-resident
    /// activations (`kernels/ops.cu`).
    Ops,
    /// GQA and MLA attention over a KV cache (`kernels/attention.cu`).
    Attention,
    /// The tensor-core GEMM for prefill (n > 1) with Q4_K, Q8_0 and Q4_1 weights, and its x
    /// pre-pass (`kernels/gemm.cu`; host side in `cuda_gemm.rs`).
    Gemm,
}

impl KernelId {
    pub const ALL: [KernelId; 4] = [KernelId::Quant, KernelId::Ops, KernelId::Attention, KernelId::Gemm];

    /// The source file's name under `kernels/`.
    pub fn file(self) -> &'static str {
        match self {
            KernelId::Quant => "quant.cu",
            KernelId::Ops => "ops.cu",
            KernelId::Attention => "attention.cu",
            KernelId::Gemm => "gemm.cu",
        }
    }

    /// The module's own source (without [`COMMON`]).
    pub fn source(self) -> &'static str {
        match self {
            KernelId::Quant => include_str!("../../kernels/quant.cu"),
            KernelId::Ops => include_str!("../../kernels/ops.cu"),
            KernelId::Attention => include_str!("../../kernels/attention.cu"),
            KernelId::Gemm => include_str!("../../kernels/gemm.cu"),
        }
    }

    /// The source NVRTC compiles: [`COMMON`] then the module.
    pub fn full_source(self) -> String {
        format!("{COMMON}\n#line 1 \"{}\"\n{}", self.file(), self.source())
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
                .collect(),
            KernelId::Ops => [
                "rms_norm",
                "rope",
                "swiglu",
                "all_reduce_sum",
                "fill_u32",
                "copy_cols",
                "add_assign",
                "gather_rows_f32",
                "add_rows_scaled",
                "rope_dpos",
                "kv_append_dpos",
                "set_i32",
                "nop",
            ]
            .map(String::from)
            .to_vec(),
            KernelId::Attention => ["gqa_attention", "gqa_attention_dpos", "mla_attention"]
                .map(String::from)
                .to_vec(),
            KernelId::Gemm => std::iter::once("gemm_split_x".to_string())
                .chain(
                    ["q4_k", "q8_0", "q4_1"]
                        .iter()
                        .flat_map(|t| [format!("gemm_{t}"), format!("gemm_{t}_n32")]),
                )
                .collect(),
        }
    }
}

/// One compiled variant of the x-stationary one-token GEMV in `kernels/quant.cu`
/// (`gemv_<type>_r<R>_u<UPT>_m<MODE>`): R rows per block step, UPT units per thread, MODE the
/// Q4_K integer-to-float form (0 exact, 1 offset), MAXT the block-size bound it was compiled for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemvVariant {
    pub ty: GgmlType,
    pub r: usize,
    pub upt: usize,
    pub mode: usize,
}

impl GemvVariant {
    pub fn entry(self) -> String {
        let s = type_suffix(self.ty).expect("GEMV types have suffixes");
        format!("gemv_{s}_r{}_u{}_m{}", self.r, self.upt, self.mode)
    }

    /// Values per unit (one thread's share of a row per step).
    pub fn unit_values(ty: GgmlType) -> usize {
        match ty {
            GgmlType::Q4K => 32,
            GgmlType::Q8_0 | GgmlType::Q4_1 => 16,
            _ => 8,
        }
    }

    /// The largest block the variant was compiled for (`__launch_bounds__`).
    pub fn max_threads(_ty: GgmlType) -> usize {
        512
    }
}

const fn gv(ty: GgmlType, r: usize, upt: usize, mode: usize) -> GemvVariant {
    GemvVariant { ty, r, upt, mode }
}

/// Every compiled GEMV variant (the `GEMV_RU` and `GEMV_ENTRY` lines of `kernels/quant.cu`):
/// R 2 and 4 × UPT 1, 2, 4 for every type (and Q4_K mode 1), plus Q4_K R 6 and 8 at UPT 1.
pub const GEMV_VARIANTS: [GemvVariant; 38] = {
    let tys = [
        (GgmlType::F16, 0),
        (GgmlType::BF16, 0),
        (GgmlType::Q8_0, 0),
        (GgmlType::Q4_1, 0),
        (GgmlType::Q4K, 0),
        (GgmlType::Q4K, 1),
    ];
    let ru = [(2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (4, 4)];
    let mut out = [gv(GgmlType::F16, 2, 1, 0); 38];
    let mut i = 0;
    while i < 36 {
        let (ty, m) = tys[i / 6];
        let (r, u) = ru[i % 6];
        out[i] = gv(ty, r, u, m);
        i += 1;
    }
    out[36] = gv(GgmlType::Q4K, 6, 1, 0);
    out[37] = gv(GgmlType::Q4K, 8, 1, 0);
    out
};

/// The weight types decoded in registers by `kernels/quant.cu`. Others (Q2_K, Q3_K) are
/// dequantized to f32 on the host when uploaded.
pub const GPU_TYPES: [GgmlType; 11] = [
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
                let defined = src.contains(&format!("void {f}("))
                    || {
                        // matvec_/matmul_/gather_ entry points come from the MATMUL_ENTRY macro.
                        let (kind, ty) = f.split_once('_').unwrap();
                        ["matvec", "matmul", "gather"].contains(&kind) && src.contains(&format!("MATMUL_ENTRY({ty},"))
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
                            (src.contains(&format!("GEMV_RU({ty}, ")) && src.contains(&format!(", {m}, ")))
                                || src.contains(&format!("GEMV_ENTRY({ty}, TY_Q4_K, {r}, {u}, {m}, "))
                        })
                    };
                assert!(defined, "{f} not defined in {}", id.file());
            }
        }
    }
}
