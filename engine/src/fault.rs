//! The fault-injection catalog. Each [`Fault`] names a real alternative code path in the loader,
//! a kernel or the rank loop (never a perturbation added to a tap afterwards), and a
//! [`FaultSpec`] scopes it to a layer and/or a rank, parsed from `NAME[@LAYER][:RANK]`:
//! `NAME@L:R` is layer L on rank R only, `NAME@L` every rank of layer L, bare `NAME` every layer.

use crate::EngineError;
use std::fmt;
use std::str::FromStr;

/// One fault of the catalog.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    PhantomAttnOut,
    KvBUnsharded,
    KvBShardSwap,
    KBUntransposed,
    DequantQ4kScaleMin,
    F16Residual,
    AllreduceSkip,
    RopeNeox,
    MoeGateRounded,
    StaleAttnOut,
    ConfigDrift,
    KvSlotOffByOne,
    IndexerRawQuant,
    IndexerWrongDtype,
    IndexerTopkDrift,
    IndexerRopeDrift,
    IndexerWrongLayer,
    IndexerStaleCache,
}

impl Fault {
    pub const ALL: [Fault; 18] = [
        Fault::PhantomAttnOut,
        Fault::KvBUnsharded,
        Fault::KvBShardSwap,
        Fault::KBUntransposed,
        Fault::DequantQ4kScaleMin,
        Fault::F16Residual,
        Fault::AllreduceSkip,
        Fault::RopeNeox,
        Fault::MoeGateRounded,
        Fault::StaleAttnOut,
        Fault::ConfigDrift,
        Fault::KvSlotOffByOne,
        Fault::IndexerRawQuant,
        Fault::IndexerWrongDtype,
        Fault::IndexerTopkDrift,
        Fault::IndexerRopeDrift,
        Fault::IndexerWrongLayer,
        Fault::IndexerStaleCache,
    ];

    /// The name used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Fault::PhantomAttnOut => "phantom-attn-out",
            Fault::KvBUnsharded => "kv-b-unsharded",
            Fault::KvBShardSwap => "kv-b-shard-swap",
            Fault::KBUntransposed => "k-b-untransposed",
            Fault::DequantQ4kScaleMin => "dequant-q4k-scale-min",
            Fault::F16Residual => "f16-residual",
            Fault::AllreduceSkip => "allreduce-skip",
            Fault::RopeNeox => "rope-neox",
            Fault::MoeGateRounded => "moe-gate-rounded",
            Fault::StaleAttnOut => "stale-attn-out",
            Fault::ConfigDrift => "config-drift",
            Fault::KvSlotOffByOne => "kv-slot-off-by-one",
            Fault::IndexerRawQuant => "indexer-raw-quant",
            Fault::IndexerWrongDtype => "indexer-wrong-dtype",
            Fault::IndexerTopkDrift => "indexer-topk-drift",
            Fault::IndexerRopeDrift => "indexer-rope-drift",
            Fault::IndexerWrongLayer => "indexer-wrong-layer",
            Fault::IndexerStaleCache => "indexer-stale-cache",
        }
    }

    /// One line for `--help`.
    pub fn describe(self) -> &'static str {
        match self {
            Fault::PhantomAttnOut => "the attention op computes into its own scratch and never writes the caller's `out` buffer",
            Fault::KvBUnsharded => "every rank is handed the full kv_b [H·(nope+v), kv_lora] and uses its first rows (rank 0's heads)",
            Fault::KvBShardSwap => "two ranks' kv_b shards are exchanged at load (rank R and R+1; default 0 and 1)",
            Fault::KBUntransposed => "kv_b is reassembled with k_b reshaped instead of transposed per head",
            Fault::DequantQ4kScaleMin => "the Q4_K dequantizer unpacks each 6-bit scale/min pair swapped",
            Fault::F16Residual => "the residual stream is stored in f16 after each add (overflows to inf on large activations)",
            Fault::AllreduceSkip => "the row-parallel outputs (o_proj, FFN down) are not all-reduced: each rank keeps its partial",
            Fault::RopeNeox => "RoPE rotates the other pair layout: NEOX pairs (i, i+d/2) where the model needs NORM pairs (2i, 2i+1), NORM pairs for a NEOX model (qwen, glm4moe, gemma)",
            Fault::MoeGateRounded => "the MoE router weights are rounded to FP8 E4M3 at load, so near-tie expert choices flip",
            Fault::StaleAttnOut => "the caller reads the other buffer of its double-buffered attention output: the previous layer's values",
            Fault::ConfigDrift => "the engine reads a different rms eps, rope base and expert weights scale than the file gives",
            Fault::KvSlotOffByOne => "decode writes the new token's K/V one cache slot early (slot mapping off by one): prefill is unaffected",
            Fault::IndexerRawQuant => "the DSA indexer's weights_proj (`indexer.proj`, Q8_0) is handed its quantized blocks un-dequantized: the int8 values without their block scales (vLLM builds it unquantized)",
            Fault::IndexerWrongDtype => "the DSA indexer's 16-bit float weight (the first F16/BF16 of attn_k, proj, attn_q_b) is decoded as the other 16-bit float: F16 bytes read as BF16 (or BF16 as F16)",
            Fault::IndexerTopkDrift => "the DSA indexer keeps half the file's top_k (a rank that read a default instead of `attention.indexer.top_k`)",
            Fault::IndexerRopeDrift => "the DSA indexer rotates its q and key with the other RoPE pair layout (NEOX halves for interleaved pairs, or the reverse), as llama.cpp versions differed on glm-dsa",
            Fault::IndexerWrongLayer => "the DSA indexer's weights are loaded from the nearest other layer with an indexer (a layer index slip in the loader)",
            Fault::IndexerStaleCache => "decode scores its keys against the indexer's key cache before writing the step's own key (that slot still zeros), then writes it: prefill is unaffected",
        }
    }

    /// True for the faults of the DSA lightning indexer (glm-dsa, deepseek32 only).
    pub fn is_indexer(self) -> bool {
        matches!(
            self,
            Fault::IndexerRawQuant
                | Fault::IndexerWrongDtype
                | Fault::IndexerTopkDrift
                | Fault::IndexerRopeDrift
                | Fault::IndexerWrongLayer
                | Fault::IndexerStaleCache
        )
    }

    pub fn from_name(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A fault and its scope: `layer: None` is every layer, `rank: None` every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultSpec {
    pub fault: Fault,
    pub layer: Option<u32>,
    pub rank: Option<u32>,
}

impl FaultSpec {
    pub fn new(fault: Fault) -> FaultSpec {
        FaultSpec {
            fault,
            layer: None,
            rank: None,
        }
    }

    /// True when this spec puts its fault in `layer` on `rank`.
    pub fn covers(&self, layer_idx: usize, rank_idx: usize) -> bool {
        self.layer.is_none_or(|l| l as usize == layer_idx) && self.rank.is_none_or(|r| r as usize == rank_idx)
    }
}

impl fmt::Display for FaultSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.fault)?;
        if let Some(l) = self.layer {
            write!(f, "@{l}")?;
        }
        if let Some(r) = self.rank {
            write!(f, ":{r}")?;
        }
        Ok(())
    }
}

impl FromStr for FaultSpec {
    type Err = EngineError;
    fn from_str(s: &str) -> Result<FaultSpec, EngineError> {
        let bad = |msg: String| EngineError::FaultSyntax {
            spec: s.to_string(),
            msg,
        };
        let (rest, rank) = match s.split_once(':') {
            Some((a, r)) => (
                a,
                Some(
                    r.parse::<u32>()
                        .map_err(|_| bad(format!("rank {r:?} is not a number")))?,
                ),
            ),
            None => (s, None),
        };
        let (name, layer) = match rest.split_once('@') {
            Some((n, l)) => (
                n,
                Some(
                    l.parse::<u32>()
                        .map_err(|_| bad(format!("layer {l:?} is not a number")))?,
                ),
            ),
            None => (rest, None),
        };
        let fault = Fault::from_name(name).ok_or_else(|| {
            let names: Vec<&str> = Fault::ALL.iter().map(|f| f.name()).collect();
            bad(format!("unknown fault {name:?} (known: {})", names.join(", ")))
        })?;
        Ok(FaultSpec { fault, layer, rank })
    }
}

/// The faults of one engine, queried by the code paths that implement them.
#[derive(Clone, Debug, Default)]
pub struct FaultSet {
    specs: Vec<FaultSpec>,
}

impl FaultSet {
    pub fn new(specs: Vec<FaultSpec>) -> FaultSet {
        FaultSet { specs }
    }

    pub fn specs(&self) -> &[FaultSpec] {
        &self.specs
    }

    pub fn is_empty(&self) -> bool {
        self.specs.is_empty()
    }

    /// True when `fault` is injected in `layer_idx` on `rank_idx`.
    pub fn active(&self, fault: Fault, layer_idx: usize, rank_idx: usize) -> bool {
        self.specs
            .iter()
            .any(|s| s.fault == fault && s.covers(layer_idx, rank_idx))
    }

    /// True when `fault` is injected outside the layers (bare specs only) on `rank_idx`.
    pub fn active_global(&self, fault: Fault, rank_idx: usize) -> bool {
        self.specs
            .iter()
            .any(|s| s.fault == fault && s.layer.is_none() && s.rank.is_none_or(|r| r as usize == rank_idx))
    }

    /// The specs for one fault.
    pub fn of(&self, fault: Fault) -> impl Iterator<Item = &FaultSpec> {
        self.specs.iter().filter(move |s| s.fault == fault)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_and_print() {
        for s in [
            "kv-b-unsharded",
            "kv-b-unsharded@3",
            "kv-b-unsharded@3:1",
            "rope-neox:2",
        ] {
            let f: FaultSpec = s.parse().unwrap();
            assert_eq!(f.to_string(), s);
        }
        let f: FaultSpec = "allreduce-skip@2:1".parse().unwrap();
        assert_eq!(
            f,
            FaultSpec {
                fault: Fault::AllreduceSkip,
                layer: Some(2),
                rank: Some(1)
            }
        );
        assert!(f.covers(2, 1) && !f.covers(2, 0) && !f.covers(1, 1));
        assert!("nope"
            .parse::<FaultSpec>()
            .unwrap_err()
            .to_string()
            .contains("unknown fault"));
        assert!("rope-neox@x".parse::<FaultSpec>().is_err());
        assert!("rope-neox@1:y".parse::<FaultSpec>().is_err());
    }

    #[test]
    fn every_fault_has_a_name_and_a_description() {
        for f in Fault::ALL {
            assert_eq!(Fault::from_name(f.name()), Some(f));
            assert!(!f.describe().is_empty() && !f.describe().contains('\n'));
        }
    }
}
