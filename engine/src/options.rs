//! The engine's typed settings: the compute precision ([`ComputeDtype`], passed in through
//! [`crate::EngineOptions::compute_dtype`]) and the CUDA backend's settings ([`CudaOptions`],
//! through [`crate::EngineOptions::cuda`]). The CUDA settings are built without the `cuda` feature
//! too, so a caller sets them the same way in every build (the CPU backend ignores them).
//!
//! The environment is read here and nowhere else in the engine, once, by
//! [`CudaOptions::from_env`]: `LLMDIFF_CUDA_DISABLE=item,item,...` turns off default fast paths
//! one by one (an escape hatch for bisecting a wrong result to one kernel family, like llama.cpp's
//! `GGML_CUDA_DISABLE_*`); each item falls back to a simpler path that computes the same op. An
//! unknown item is an error that names it. `LLMDIFF_KERNEL_CACHE=DIR` (or `off`) places the
//! compiled-kernel cache, by default `$XDG_CACHE_HOME/llmdiff/kernels` or
//! `~/.cache/llmdiff/kernels`.

use crate::EngineError;

/// The precision the engine computes in (`--compute-dtype`): what each op's output is stored in
/// between ops. The default, f32, is the engine as it always was, bit for bit. At bf16 or f16
/// the engine runs as a production engine at that precision does (see [`crate::precision`] for
/// the rules and the emulation): float weights rounded to the dtype at load, every op's output
/// (activations, the residual stream, the KV cache, the logits) rounded to it, products and sums
/// inside an op accumulated in f32.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ComputeDtype {
    #[default]
    F32,
    Bf16,
    F16,
}

impl ComputeDtype {
    pub const ALL: [ComputeDtype; 3] = [ComputeDtype::F32, ComputeDtype::Bf16, ComputeDtype::F16];

    /// The dtype's name as `--compute-dtype` spells it.
    pub fn name(self) -> &'static str {
        match self {
            ComputeDtype::F32 => "f32",
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F16 => "f16",
        }
    }

    /// Unit roundoff u of round-to-nearest: half the spacing of the values in [1, 2), 2^-(p)
    /// for p stored mantissa bits + 1 (f32 2^-24, bf16 2^-8, f16 2^-11). A stored value is the
    /// exact one times (1 + δ), |δ| ≤ u (f16 below 2^-14 is subnormal: absolute error 2^-25).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            ComputeDtype::F32 => (-24f64).exp2(),
            ComputeDtype::Bf16 => (-8f64).exp2(),
            ComputeDtype::F16 => (-11f64).exp2(),
        }
    }

    /// `x` rounded to the dtype (round to nearest, ties to even; overflow to ±inf) and widened
    /// back to f32. A NaN keeps its sign and the top payload bits the dtype holds, and is made
    /// quiet, as a hardware conversion that keeps payloads does: the f32 canary becomes the
    /// dtype's canary ([`ComputeDtype::canary`]). Identity at f32.
    #[inline]
    pub fn round(self, x: f32) -> f32 {
        match self {
            ComputeDtype::F32 => x,
            ComputeDtype::Bf16 => round_bf16(x),
            ComputeDtype::F16 => round_f16(x),
        }
    }

    /// The canary an unwritten output buffer holds at this dtype: the f32 canary rounded to the
    /// dtype (a quiet NaN the dtype can store, so rounding leaves it alone):
    /// [`references::tap::canary`], [`references::tap::canary_bf16`] or
    /// Every value of `v` rounded to the dtype in place (nothing at f32).
    pub fn round_slice(self, v: &mut [f32]) {
        match self {
            ComputeDtype::F32 => {}
            ComputeDtype::Bf16 => v.iter_mut().for_each(|x| *x = round_bf16(*x)),
            ComputeDtype::F16 => v.iter_mut().for_each(|x| *x = round_f16(*x)),
        }
    }

    /// [`references::tap::canary_f16`]. [`references::tap::is_canary`] recognises each.
    pub fn canary(self) -> f32 {
        match self {
            ComputeDtype::F32 => references::tap::canary(),
            ComputeDtype::Bf16 => references::tap::canary_bf16(),
            ComputeDtype::F16 => references::tap::canary_f16(),
        }
    }
}

impl std::fmt::Display for ComputeDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ComputeDtype {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<ComputeDtype, EngineError> {
        match s.trim() {
            "f32" | "fp32" => Ok(ComputeDtype::F32),
            "bf16" => Ok(ComputeDtype::Bf16),
            "f16" | "fp16" => Ok(ComputeDtype::F16),
            other => Err(EngineError::Options(format!(
                "compute dtype: unknown {other:?} (expected f32, bf16 or f16)"
            ))),
        }
    }
}

/// How `--backend cuda` runs the ranks of a TP > 1 engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RankMode {
    /// Real ranks (one per GPU, the all-reduce over NCCL) when 1 < TP ≤ the device count, else
    /// simulated ones.
    #[default]
    Auto,
    /// Every rank on GPU 0, one stream, the fixed-order device-side sum.
    Simulated,
    /// One GPU per rank, the all-reduce over NCCL (also at TP 1); too few GPUs is an error.
    Nccl,
}

impl RankMode {
    /// The mode's name as `--ranks` spells it.
    pub fn name(self) -> &'static str {
        match self {
            RankMode::Auto => "auto",
            RankMode::Simulated => "simulated",
            RankMode::Nccl => "nccl",
        }
    }
}

impl std::str::FromStr for RankMode {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<RankMode, EngineError> {
        match s.trim() {
            "auto" | "" => Ok(RankMode::Auto),
            "simulated" => Ok(RankMode::Simulated),
            "nccl" => Ok(RankMode::Nccl),
            other => Err(EngineError::Options(format!(
                "ranks: unknown mode {other:?} (expected auto, simulated or nccl)"
            ))),
        }
    }
}

/// Default fast paths turned off (`LLMDIFF_CUDA_DISABLE`); all false by default. Each names the
/// path it turns off and the fallback taken instead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CudaDisable {
    /// `gemm`: the tensor-core GEMM of n > 1 tokens (`kernels/gemm.cu`); the SIMT `matmul_*` instead.
    pub gemm: bool,
    /// `gemv`: the one-token GEMV variants; the warp-per-row `matvec_*` instead.
    pub gemv: bool,
    /// `pdl`: programmatic dependent launch of the warp-rows GEMVs and of the one-token norms,
    /// SwiGLU and split attention; plain launches instead.
    pub pdl: bool,
    /// `pdl-chain`: programmatic dependent launch of the norms, SwiGLU and split attention only
    /// (the GEMVs keep it).
    pub pdl_chain: bool,
    /// `graphs`: decode CUDA graphs; every decode step launched op by op.
    pub graphs: bool,
    /// `attn-tiled`: the tiled prefill GQA attention; a block per (token, head) instead.
    pub attn_tiled: bool,
    /// `attn-tc`: the tiled prefill attention's tensor-core form; its CUDA-core form instead.
    pub attn_tc: bool,
    /// `attn-split`: the split decode GQA attention; a block per (token, head) instead.
    pub attn_split: bool,
    /// `qkv-store`: RoPE and the KV append in the q/k/v GEMV's store; their own launch instead.
    pub qkv_store: bool,
    /// `norm-split`: a one-row norm split over several blocks; one block instead.
    pub norm_split: bool,
}

/// A [`CudaDisable`] flag, by reference.
type Flag = fn(&mut CudaDisable) -> &mut bool;

/// The items of `LLMDIFF_CUDA_DISABLE`, each with its flag.
const DISABLE_ITEMS: [(&str, Flag); 10] = [
    ("gemm", |d| &mut d.gemm),
    ("gemv", |d| &mut d.gemv),
    ("pdl", |d| &mut d.pdl),
    ("pdl-chain", |d| &mut d.pdl_chain),
    ("graphs", |d| &mut d.graphs),
    ("attn-tiled", |d| &mut d.attn_tiled),
    ("attn-tc", |d| &mut d.attn_tc),
    ("attn-split", |d| &mut d.attn_split),
    ("qkv-store", |d| &mut d.qkv_store),
    ("norm-split", |d| &mut d.norm_split),
];

impl CudaDisable {
    /// The item names `parse` takes.
    pub fn items() -> impl Iterator<Item = &'static str> {
        DISABLE_ITEMS.iter().map(|(n, _)| *n)
    }

    /// Parses a comma-separated list of items (spaces allowed, empty items ignored).
    pub fn parse(list: &str) -> Result<CudaDisable, EngineError> {
        let mut d = CudaDisable::default();
        for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let Some((_, flag)) = DISABLE_ITEMS.iter().find(|(n, _)| *n == item) else {
                let known: Vec<&str> = CudaDisable::items().collect();
                return Err(EngineError::Options(format!(
                    "LLMDIFF_CUDA_DISABLE: unknown item {item:?} (known: {})",
                    known.join(", ")
                )));
            };
            *flag(&mut d) = true;
        }
        Ok(d)
    }
}

/// The CUDA backend's settings (ignored by the CPU backend).
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// Record and replay plain decode steps as CUDA graphs (default true).
    pub graphs: bool,
    /// How the ranks of a TP > 1 engine run.
    pub ranks: RankMode,
    /// Compile the kernels with the kernel trace (`bench --trace`; see
    /// [`crate::Engine::kernel_trace_take`]); one GPU only.
    pub kernel_trace: bool,
    /// Default fast paths turned off.
    pub disable: CudaDisable,
    /// Where compiled kernel modules (CUBIN for the device's arch) are kept between runs, keyed
    /// by a hash of their source, compile options, device architecture and NVRTC version; `None`
    /// compiles every run. Only [`CudaOptions::from_env`] sets it: a default engine never touches the disk.
    pub kernel_cache: Option<std::path::PathBuf>,
    /// The weight types of the model the backend will run: the kernel modules of these types
    /// (and those every model uses) are compiled when the backend opens, any other on first use;
    /// `None` compiles every module (`kernels --check`). [`crate::Engine::load`] sets it from the
    /// model file when unset.
    pub weight_types: Option<Vec<references::GgmlType>>,
    /// Told, before a long step, what the backend is doing (e.g. "compiling 9 CUDA kernel
    /// modules"); the engine itself never prints.
    pub progress: Option<fn(&str)>,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions {
            graphs: true,
            ranks: RankMode::Auto,
            kernel_trace: false,
            disable: CudaDisable::default(),
            kernel_cache: None,
            weight_types: None,
            progress: None,
        }
    }
}

impl CudaOptions {
    /// The defaults with `LLMDIFF_CUDA_DISABLE` applied (unset or empty: nothing disabled).
    pub fn from_env() -> Result<CudaOptions, EngineError> {
        let disable = match std::env::var("LLMDIFF_CUDA_DISABLE") {
            Ok(v) => CudaDisable::parse(&v)?,
            Err(std::env::VarError::NotPresent) => CudaDisable::default(),
            Err(e) => return Err(EngineError::Options(format!("LLMDIFF_CUDA_DISABLE: {e}"))),
        };
        Ok(CudaOptions {
            disable,
            kernel_cache: kernel_cache_dir(
                std::env::var_os("LLMDIFF_KERNEL_CACHE"),
                std::env::var_os("XDG_CACHE_HOME"),
                std::env::var_os("HOME"),
            ),
            ..CudaOptions::default()
        })
    }

    /// Decode graphs are on: asked for and not disabled.
    pub fn graphs_on(&self) -> bool {
        self.graphs && !self.disable.graphs
    }
}

/// The kernel cache folder from `LLMDIFF_KERNEL_CACHE` (`off` or empty: none), else the XDG
/// cache home, else `~/.cache`; `None` where none of them is set.
fn kernel_cache_dir(
    explicit: Option<std::ffi::OsString>,
    xdg: Option<std::ffi::OsString>,
    home: Option<std::ffi::OsString>,
) -> Option<std::path::PathBuf> {
    use std::path::PathBuf;
    let nonempty = |v: Option<std::ffi::OsString>| v.filter(|v| !v.is_empty());
    if let Some(dir) = explicit {
        return (dir != "off" && !dir.is_empty()).then(|| PathBuf::from(dir));
    }
    nonempty(xdg)
        .map(PathBuf::from)
        .or_else(|| nonempty(home).map(|h| PathBuf::from(h).join(".cache")))
        .map(|base| base.join("llmdiff").join("kernels"))
}

/// `x` rounded to bf16 (nearest, ties to even; overflow to ±inf), widened back to f32. A NaN keeps
/// its sign and top 7 payload bits and is made quiet.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    if x.is_nan() {
        return f32::from_bits((b & 0xFFFF_0000) | 0x0040_0000);
    }
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(r)
}

/// `x` rounded to f16 (nearest, ties to even; subnormals below 2^-14, ±inf beyond 65504),
/// widened back to f32. A NaN keeps its sign and top 10 mantissa bits and is made quiet.
#[inline]
pub fn round_f16(x: f32) -> f32 {
    if x.is_nan() {
        return f32::from_bits((x.to_bits() & 0xFFFF_E000) | 0x0040_0000);
    }
    half::f16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_cache_folder_follows_the_environment() {
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        let p = |s: &str| Some(std::path::PathBuf::from(s));
        assert_eq!(kernel_cache_dir(os("/c"), os("/x"), os("/h")), p("/c"));
        assert_eq!(kernel_cache_dir(os("off"), os("/x"), os("/h")), None);
        assert_eq!(kernel_cache_dir(None, os("/x"), os("/h")), p("/x/llmdiff/kernels"));
        assert_eq!(kernel_cache_dir(None, os(""), os("/h")), p("/h/.cache/llmdiff/kernels"));
        assert_eq!(kernel_cache_dir(None, None, None), None);
    }

    #[test]
    fn disable_items_parse_and_an_unknown_one_is_named() {
        let d = CudaDisable::parse(" gemm, pdl-chain ,,graphs").unwrap();
        assert!(d.gemm && d.pdl_chain && d.graphs);
        assert!(!d.gemv && !d.pdl && !d.attn_tiled && !d.norm_split);
        assert_eq!(CudaDisable::parse("").unwrap(), CudaDisable::default());
        let e = CudaDisable::parse("gemm,bogus").unwrap_err().to_string();
        assert!(e.contains("\"bogus\""), "{e}");
        // Every listed item sets exactly one flag.
        for item in CudaDisable::items() {
            let d = CudaDisable::parse(item).unwrap();
            assert_ne!(d, CudaDisable::default(), "{item}");
        }
    }

    #[test]
    fn rank_modes_parse_by_name() {
        for m in [RankMode::Auto, RankMode::Simulated, RankMode::Nccl] {
            assert_eq!(m.name().parse::<RankMode>().unwrap(), m);
        }
        assert!("both".parse::<RankMode>().is_err());
    }

    #[test]
    fn graphs_need_both_the_option_and_no_disable() {
        let mut o = CudaOptions::default();
        assert!(o.graphs_on());
        o.disable.graphs = true;
        assert!(!o.graphs_on());
        o = CudaOptions {
            graphs: false,
            ..CudaOptions::default()
        };
        assert!(!o.graphs_on());
    }
}
