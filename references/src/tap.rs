//! The tap protocol: the one key type that names every probe point ([`TapKey`]), its printed
//! form, and the two-phase [`Tap`] trait (`wants`, then `record`) that both the engine and the
//! reference call, as ggml's eval callback does.
//!
//! **RoPE order per family** (what `q`/`k` taps hold, so candidate dumps compare without
//! guesswork): llama/mistral GGUFs rotate llama.cpp's NORM pairs (2i, 2i+1): the converter
//! permuted HF's q/k rows so that these pairs are HF's halves; deepseek2's MLA rope part is NORM
//! pairs too. qwen2, qwen3, qwen3moe, glm4moe (its first `rope.dimension_count` values of each
//! head only), gemma2 and gemma3 rotate NeoX halves (i, i + rope_dim/2), the q/k rows stored as
//! HF has them, in both GGUF and HF-folder form.
//!
//! **The source does not change a tap.** An HF checkpoint folder is read as the GGUF llama.cpp's
//! converter writes for it (`crate::hf`): llama/mistral q/k rows are permuted at load to the NORM
//! pairs above, MLA's kv_b is split into k_b/v_b as the converter splits it, so every tap —
//! `q`/`k` included — holds the same layout and values from a folder as from its conversion
//! (`tests/tests/hf_folders.rs` diffs the two at every tap). A foreign dump of HF transformers'
//! own q/k after RoPE is still rotate-half for llama/mistral and declares `hf-rotate-half`.
//!
//! **Family sites:** qwen2/glm4moe's `q`/`k`/`v` include their biases; qwen3/qwen3moe/gemma3's
//! `q`/`k` are after the per-head RMSNorm and RoPE. Gemma: `embed` is after the √d_model scale,
//! `attn_proj` and `ffn_out` are after the post-attention / post-FFN norms (the values added to
//! the residual), `ffn_gate`/`ffn_up` feed GELU-tanh, and `logits` are after the final-logit
//! soft-capping, with `logits_pre_cap` before it (gemma2's attention soft-capping happens
//! inside `attn_out`). gpt-oss: `attn_sink` is the probability each head's sink takes.
//!
//! **No tap for capped attention scores:** they are `[H, n, n]` per layer and live only inside
//! fused attention kernels (flash attention applies the cap in registers), so no engine can
//! dump them without changing the kernel it is being checked on; and the cap is a pure
//! function of q and k, so a missing or wrong cap shows in full at `attn_out` judged on the
//! candidate's own q/k/v. The final-logit cap is tapped because its input is a real tensor
//! (`lm_head`'s output) that every engine holds.

use std::fmt;
use std::str::FromStr;

/// The canary a custom op's output buffer is filled with before the op runs: a quiet NaN whose
/// payload spells `0x1DF0D` ("llmdiff"-ish), so an unwritten element is recognisable bit for bit.
///
/// An engine that stores activations in bf16 or f16 cannot hold these bits: a conversion keeps
/// only the top payload bits (bf16 7, f16 9 after the quiet bit), and many conversions make every
/// NaN the canonical one. Each 16-bit dtype therefore has a canary of its own, the f32 canary
/// converted to it with its top payload bits kept ([`CANARY_BF16_BITS`], [`CANARY_F16_BITS`]);
/// its f32 widening is what an f32 tap of an unwritten 16-bit buffer shows, and [`is_canary`]
/// recognises all three forms. No canonical NaN (f32 `0x7FC0_0000`, bf16 `0x7FC0`/`0x7FFF`, f16
/// `0x7E00`/`0x7FFF`) matches any of them, so a NaN an op computes is never taken for one.
pub const CANARY_BITS: u32 = 0x7FC1_DF0D;

/// The bf16 canary: the top 16 bits of [`CANARY_BITS`] (payload `0x41`, quiet bit included).
pub const CANARY_BF16_BITS: u16 = 0x7FC1;

/// The f16 canary: [`CANARY_BITS`]'s sign, an all-ones exponent and the top 10 of its 23
/// mantissa bits (`0x20E`: quiet bit and payload `0x0E`).
pub const CANARY_F16_BITS: u16 = 0x7E0E;

/// The canary as an f32 (a NaN).
pub fn canary() -> f32 {
    f32::from_bits(CANARY_BITS)
}

/// The bf16 canary widened to f32 (bits `0x7FC1_0000`).
pub fn canary_bf16() -> f32 {
    f32::from_bits((CANARY_BF16_BITS as u32) << 16)
}

/// The f16 canary widened to f32 (bits `0x7FC1_C000`).
pub fn canary_f16() -> f32 {
    half::f16::from_bits(CANARY_F16_BITS).to_f32()
}

/// True when `x` carries the exact bits of the canary in one of its forms: the f32 canary, or
/// the bf16 or f16 canary widened to f32.
pub fn is_canary(x: f32) -> bool {
    let b = x.to_bits();
    b == CANARY_BITS || b == canary_bf16().to_bits() || b == canary_f16().to_bits()
}

/// Which weight a weight tap shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WeightKind {
    Q,
    K,
    V,
    O,
    QA,
    QB,
    KvA,
    KvB,
    Gate,
    Up,
    Down,
    Router,
    /// The DSA indexer's `indexer.attn_q_b` `[H·D, q_lora]` (replicated).
    IdxQB,
    /// The DSA indexer's `indexer.attn_k` `[D, d]` (replicated).
    IdxK,
    /// The DSA indexer's `indexer.proj` (vLLM's `weights_proj`) `[H, d]` (replicated).
    IdxProj,
}

impl WeightKind {
    pub const ALL: [WeightKind; 15] = [
        WeightKind::Q,
        WeightKind::K,
        WeightKind::V,
        WeightKind::O,
        WeightKind::QA,
        WeightKind::QB,
        WeightKind::KvA,
        WeightKind::KvB,
        WeightKind::Gate,
        WeightKind::Up,
        WeightKind::Down,
        WeightKind::Router,
        WeightKind::IdxQB,
        WeightKind::IdxK,
        WeightKind::IdxProj,
    ];
    pub fn name(self) -> &'static str {
        match self {
            WeightKind::Q => "q",
            WeightKind::K => "k",
            WeightKind::V => "v",
            WeightKind::O => "o",
            WeightKind::QA => "q_a",
            WeightKind::QB => "q_b",
            WeightKind::KvA => "kv_a",
            WeightKind::KvB => "kv_b",
            WeightKind::Gate => "gate",
            WeightKind::Up => "up",
            WeightKind::Down => "down",
            WeightKind::Router => "router",
            WeightKind::IdxQB => "idx_q_b",
            WeightKind::IdxK => "idx_k",
            WeightKind::IdxProj => "idx_proj",
        }
    }
}

/// A probe site. The declaration order is the execution order within a layer; `Embed` comes
/// before every layer, `OutputNorm` and `Logits` after the last.
///
/// Every activation tap is row-major `[n_tokens, width]`; the widths below use H heads,
/// KV kv-heads, hd head dim, d model dim, f FFN dim, and for MLA nope/rope/v/kv_lora/q_lora.
/// A rank-local form (`@rN`) holds rank N's columns of the same tensor (see [`rank_columns`]),
/// except at `AttnProj` and `FfnOut`, where `@rN` is rank N's partial sum before the all-reduce.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Site {
    /// Token embeddings `[n, d]`.
    Embed,
    /// A weight as the loader built it, torch layout `[out, in]` (`blk.3.w.kv_b@r1` is rank 1's
    /// shard). kv_b is the reassembled `[H·(nope+v), kv_lora]`. Weight taps precede activations.
    Weight(WeightKind),
    /// RMSNorm(x)·w before attention `[n, d]`.
    AttnNorm,
    /// MLA: q_a projection output before its norm `[n, q_lora]`.
    QA,
    /// DSA lightning indexer (deepseek32, glm-dsa `full` layers): the index score of every key
    /// for every query `[n, n]`, row t = query t, column s = key s, `Σ_h w_h·relu(q_h·k_s)` with
    /// w = weights_proj(x)/sqrt(head_dim·n_heads); keys after the query (s > t) hold 0 (not
    /// scored). Indexer RoPE (on the first rope-dim entries of each head; q_b's heads and the
    /// key are `[rope | nope]`): NeoX halves for deepseek32, interleaved pairs for glm-dsa, as
    /// llama-cpp-python 0.3.36's vendored llama.cpp builds them.
    IndexerScore,
    /// DSA: the key positions query t attends to, ascending, as f32 `[n, top_k]`; rows of
    /// queries with fewer than top_k causal keys are padded with −1. A glm-dsa `shared` layer
    /// records the selection it reuses from the previous `full` layer.
    IndexerTopk,
    /// Queries after RoPE: llama `[n, H·hd]`; MLA `[n, H·(nope+rope)]`, per head `[q_nope | q_pe]`.
    Q,
    /// MLA: the latent after kv_a_norm `[n, kv_lora]`.
    KvLatent,
    /// MLA: the shared rope key after RoPE `[n, rope]`.
    KPe,
    /// Keys: llama after RoPE `[n, KV·hd]`; MLA k_nope from kv_b `[n, H·nope]`.
    K,
    /// Values: llama `[n, KV·hd]`; MLA from kv_b `[n, H·v]`.
    V,
    /// Decode steps only (GQA families): the K cache rows the step's attention read, positions
    /// `0..=p` for the step at position p, `[p+1, KV·hd]` (rank-local: the rank's KV heads, as
    /// `k`). Taps of several decode steps are stacked in step order, so over decode positions
    /// `n_prefill..n` the tap has `Σ (p+1)` rows ([`cache_rows`]). A correct cache holds the
    /// step's own `k` rows, so the reference's form is its `k` cut that way ([`DecodeCacheTap`]),
    /// and a slot written at the wrong position or left stale diverges here, before `attn_out`.
    /// Prefill does not emit it (attention reads the step's own `k`/`v` there).
    KvCacheK,
    /// As [`Site::KvCacheK`] for the V cache `[p+1, KV·hd]`.
    KvCacheV,
    /// gpt-oss: the probability each query's attention sink takes, `[n, H]`: for head h at query
    /// t, `exp(sink_h) / (exp(sink_h) + Σ_s exp(score_ts))` over the keys it sees (its sliding
    /// window on windowed layers). 0 where sinks are ignored; the rest of the mass is what `attn_out`
    /// mixes, so a candidate that drops its sinks diverges here first. Cheap (`[n, H]`), and
    /// the one number that tells "sinks dropped" apart from other attention faults.
    AttnSink,
    /// The attention custom op's output buffer, before o_proj: `[n, H·hd]` (MLA `[n, H·v]`).
    AttnOut,
    /// o_proj output after the all-reduce `[n, d]`.
    AttnProj,
    /// x + attn_proj `[n, d]`.
    ResidAttn,
    /// RMSNorm before the FFN `[n, d]`.
    FfnNorm,
    /// MoE router logits x·Wgᵀ before the gating function `[n, n_experts]`.
    MoeLogits,
    /// Chosen expert ids, ascending, as f32 `[n, n_used]`.
    MoeTopk,
    /// Dense FFN gate projection before SiLU `[n, f]` (not tapped in MoE layers).
    FfnGate,
    /// Dense FFN up projection `[n, f]` (not tapped in MoE layers).
    FfnUp,
    /// FFN output after the all-reduce `[n, d]`: down(silu(gate)·up), or the MoE mix (routed +
    /// shared experts), which is a custom op writing a caller-allocated buffer.
    FfnOut,
    /// resid_attn + ffn_out `[n, d]`.
    ResidOut,
    /// Final RMSNorm `[n, d]`.
    OutputNorm,
    /// Gemma 2/3 with `final_logit_softcapping`: the logits before the cap `[n, vocab]` (HF's
    /// `lm_head` output). Only those files have it.
    LogitsPreCap,
    /// Logits `[n, vocab]` (after the vocab-parallel gather; after Gemma's final soft-cap).
    Logits,
}

impl Site {
    /// Every activation site (weights excluded), in execution order.
    pub const ACTIVATIONS: [Site; 26] = [
        Site::Embed,
        Site::AttnNorm,
        Site::QA,
        Site::IndexerScore,
        Site::IndexerTopk,
        Site::Q,
        Site::KvLatent,
        Site::KPe,
        Site::K,
        Site::V,
        Site::KvCacheK,
        Site::KvCacheV,
        Site::AttnSink,
        Site::AttnOut,
        Site::AttnProj,
        Site::ResidAttn,
        Site::FfnNorm,
        Site::MoeLogits,
        Site::MoeTopk,
        Site::FfnGate,
        Site::FfnUp,
        Site::FfnOut,
        Site::ResidOut,
        Site::OutputNorm,
        Site::LogitsPreCap,
        Site::Logits,
    ];

    /// The printed name (without layer or rank).
    pub fn name(self) -> String {
        match self {
            Site::Weight(w) => format!("w.{}", w.name()),
            other => other.activation_name().to_string(),
        }
    }

    fn activation_name(self) -> &'static str {
        match self {
            Site::Embed => "embed",
            Site::Weight(_) => "w",
            Site::AttnNorm => "attn_norm",
            Site::QA => "q_a",
            Site::IndexerScore => "indexer_score",
            Site::IndexerTopk => "indexer_topk",
            Site::Q => "q",
            Site::KvLatent => "kv_latent",
            Site::KPe => "k_pe",
            Site::K => "k",
            Site::V => "v",
            Site::KvCacheK => "kv_cache_k",
            Site::KvCacheV => "kv_cache_v",
            Site::AttnOut => "attn_out",
            Site::AttnSink => "attn_sink",
            Site::AttnProj => "attn_proj",
            Site::ResidAttn => "resid_attn",
            Site::FfnNorm => "ffn_norm",
            Site::MoeLogits => "moe_logits",
            Site::MoeTopk => "moe_topk",
            Site::FfnGate => "ffn_gate",
            Site::FfnUp => "ffn_up",
            Site::FfnOut => "ffn_out",
            Site::ResidOut => "resid_out",
            Site::OutputNorm => "output_norm",
            Site::LogitsPreCap => "logits_pre_cap",
            Site::Logits => "logits",
        }
    }

    /// True for the sites outside any layer.
    pub fn is_global(self) -> bool {
        matches!(self, Site::Embed | Site::OutputNorm | Site::LogitsPreCap | Site::Logits)
    }

    /// True for custom ops that write a caller-allocated output buffer (canary-checked).
    pub fn is_custom_op_output(self) -> bool {
        matches!(self, Site::AttnOut | Site::FfnOut)
    }

    pub fn parse(s: &str) -> Option<Site> {
        if let Some(w) = s.strip_prefix("w.") {
            return WeightKind::ALL.into_iter().find(|k| k.name() == w).map(Site::Weight);
        }
        Site::ACTIVATIONS.into_iter().find(|site| site.activation_name() == s)
    }
}

/// The one tap-key type: layer, site and rank. Printed `embed`, `blk.3.attn_out`,
/// `blk.3.attn_out@r1`, `blk.3.w.kv_b@r1`, `output_norm` or `logits`.
///
/// Keys order by execution: embed, then layer by layer (weights, then activations in site
/// order, the rank-local form before the reduced one), then output_norm and logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TapKey {
    pub layer: Option<u32>,
    pub site: Site,
    pub rank: Option<u32>,
}

impl TapKey {
    pub fn global(site: Site) -> TapKey {
        TapKey {
            layer: None,
            site,
            rank: None,
        }
    }
    pub fn layer(layer: usize, site: Site) -> TapKey {
        TapKey {
            layer: Some(layer as u32),
            site,
            rank: None,
        }
    }
    pub fn ranked(layer: usize, site: Site, rank: usize) -> TapKey {
        TapKey {
            layer: Some(layer as u32),
            site,
            rank: Some(rank as u32),
        }
    }
    /// The same key without its rank (the reference's full tensor for a rank-local tap).
    pub fn unranked(self) -> TapKey {
        TapKey { rank: None, ..self }
    }

    fn order_key(&self) -> (u8, u32, Site, u32) {
        let phase = match (self.site, self.layer) {
            (Site::Embed, _) => 0,
            (_, Some(_)) => 1,
            _ => 2,
        };
        (
            phase,
            self.layer.unwrap_or(0),
            self.site,
            self.rank.map_or(u32::MAX, |r| r),
        )
    }
}

impl PartialOrd for TapKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for TapKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.order_key().cmp(&other.order_key())
    }
}

impl fmt::Display for TapKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(l) = self.layer {
            write!(f, "blk.{l}.")?;
        }
        write!(f, "{}", self.site.name())?;
        if let Some(r) = self.rank {
            write!(f, "@r{r}")?;
        }
        Ok(())
    }
}

impl FromStr for TapKey {
    type Err = String;
    fn from_str(s: &str) -> Result<TapKey, String> {
        let bad = || format!("bad tap key {s:?} (expected e.g. embed, blk.3.attn_out, blk.3.attn_out@r1)");
        let (body, rank) = match s.split_once("@r") {
            Some((b, r)) => (b, Some(r.parse::<u32>().map_err(|_| bad())?)),
            None => (s, None),
        };
        let (layer, site) = match body.strip_prefix("blk.") {
            Some(rest) => {
                let (l, site) = rest.split_once('.').ok_or_else(bad)?;
                (Some(l.parse::<u32>().map_err(|_| bad())?), site)
            }
            None => (None, body),
        };
        let site = Site::parse(site).ok_or_else(bad)?;
        if layer.is_none() != site.is_global() {
            return Err(bad());
        }
        Ok(TapKey { layer, site, rank })
    }
}

/// A probe callback. `wants` is asked first; `record` runs only for wanted keys and must copy
/// `data` (row-major, `shape = [rows, cols]`), since the caller may overwrite it afterwards.
pub trait Tap: Send {
    fn wants(&self, key: &TapKey) -> bool;
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]);
    /// [`Tap::record`] of a tensor the caller no longer needs (a dequantized weight, a download):
    /// a tap that keeps its data takes it as is rather than copying it. A real-sized model's
    /// weight taps are gigabytes a layer, so the copy (and the fresh pages it touches) showed.
    fn record_owned(&mut self, key: &TapKey, data: Vec<f32>, shape: [usize; 2]) {
        self.record(key, &data, shape);
    }
    /// For a weight key the tap wants, of whole shape `shape` (`[rows, cols]`, torch layout): the
    /// rows it asks for, ascending and below `rows`, or `None` for the whole weight (the
    /// default). A side then decodes only those rows and hands them to
    /// [`Tap::record_weight_rows`] ([`record_weight`] does both), so a weight tap costs a few
    /// rows instead of the whole matrix in f32.
    fn weight_rows(&self, _key: &TapKey, _shape: [usize; 2]) -> Option<Vec<usize>> {
        None
    }
    /// Records rows `rows` (as [`Tap::weight_rows`] gave them) of a weight whose whole shape is
    /// `shape`; `data` is `[rows.len(), shape[1]]`. A tap that asks for rows implements this;
    /// the default records the rows as a `[rows.len(), shape[1]]` tensor.
    fn record_weight_rows(&mut self, key: &TapKey, rows: &[usize], data: Vec<f32>, shape: [usize; 2]) {
        self.record_owned(key, data, [rows.len(), shape[1]]);
    }
    /// True when the tap wants no key at all, so a caller need not ask for each (a decode step
    /// asks for thousands).
    fn wants_nothing(&self) -> bool {
        false
    }
    /// True once the tap's owner has what it needs (`diff-layers --stop-at-first` past the first
    /// divergence): a pass may end after its current layer, its result then incomplete.
    fn stopped(&self) -> bool {
        false
    }
}

/// Hands weight `key` (whole shape `shape`) to `tap`, which must want it: the rows it asks for
/// ([`Tap::weight_rows`]) decoded by `decode(Some(rows))`, or the whole weight by `decode(None)`.
/// The one path both sides take, so the contract is the same on both.
pub fn record_weight(
    tap: &mut dyn Tap,
    key: &TapKey,
    shape: [usize; 2],
    decode: impl FnOnce(Option<&[usize]>) -> Vec<f32>,
) {
    match tap.weight_rows(key, shape) {
        Some(rows) => {
            let data = decode(Some(&rows));
            tap.record_weight_rows(key, &rows, data, shape);
        }
        None => tap.record_owned(key, decode(None), shape),
    }
}

/// Rows `rows` of a row-major `[_, cols]` matrix, in that order.
pub fn select_rows(data: &[f32], cols: usize, rows: &[usize]) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * cols);
    for &r in rows {
        out.extend_from_slice(&data[r * cols..(r + 1) * cols]);
    }
    out
}

/// A tap that wants nothing.
pub struct NoTap;
impl Tap for NoTap {
    fn wants(&self, _: &TapKey) -> bool {
        false
    }
    fn record(&mut self, _: &TapKey, _: &[f32], _: [usize; 2]) {}
    fn wants_nothing(&self) -> bool {
        true
    }
}

/// The columns of a full `[n, width]` activation (or the rows of a `[out, in]` weight, for
/// column-parallel weights) that rank `rank` of `tp` holds, as `start..end`; `None` where the
/// rank-local form is not a slice (partial sums, replicated tensors) or `tp` does not divide the
/// heads. Sharding follows vLLM: q/k/v/attn_out and MLA heads by whole heads, FFN gate/up by
/// columns, and `w.o`/`w.down` by input columns (row-parallel, which `weight_in_columns` gives).
pub fn rank_columns(
    site: Site,
    c: &crate::config::ModelConfig,
    tp: usize,
    rank: usize,
) -> Option<std::ops::Range<usize>> {
    let split = |width: usize, parts: usize| -> Option<std::ops::Range<usize>> {
        if parts == 0 || !width.is_multiple_of(parts) || rank >= tp {
            return None;
        }
        let w = width / parts;
        Some(rank * w..(rank + 1) * w)
    };
    let heads_per_rank = |n_heads: usize| (tp > 0 && n_heads.is_multiple_of(tp)).then_some(tp);
    match (&c.mla, site) {
        (None, Site::Q | Site::AttnOut | Site::Weight(WeightKind::Q)) => {
            split(c.n_heads * c.head_dim, heads_per_rank(c.n_heads)?)
        }
        (
            None,
            Site::K
            | Site::V
            | Site::KvCacheK
            | Site::KvCacheV
            | Site::Weight(WeightKind::K)
            | Site::Weight(WeightKind::V),
        ) => split(c.n_kv_heads * c.head_dim, heads_per_rank(c.n_kv_heads)?),
        (Some(m), Site::Q | Site::Weight(WeightKind::QB)) => {
            split(c.n_heads * (m.qk_nope + m.qk_rope), heads_per_rank(c.n_heads)?)
        }
        (Some(m), Site::K) => split(c.n_heads * m.qk_nope, heads_per_rank(c.n_heads)?),
        (Some(m), Site::V | Site::AttnOut) => split(c.n_heads * m.v_head_dim, heads_per_rank(c.n_heads)?),
        (Some(m), Site::Weight(WeightKind::KvB)) => {
            split(c.n_heads * (m.qk_nope + m.v_head_dim), heads_per_rank(c.n_heads)?)
        }
        (_, Site::Logits) if rank < tp => {
            // Vocab-parallel: ceil(V / tp) rows of the output matrix per rank, the last one short.
            let per = c.vocab.div_ceil(tp);
            Some((rank * per).min(c.vocab)..((rank + 1) * per).min(c.vocab))
        }
        (_, Site::FfnGate | Site::FfnUp | Site::Weight(WeightKind::Gate) | Site::Weight(WeightKind::Up)) => {
            split(c.ffn_dim, tp)
        }
        _ => None,
    }
}

/// For row-parallel weights (`w.o`, `w.down`), the input columns rank `rank` holds.
pub fn weight_in_columns(
    kind: WeightKind,
    c: &crate::config::ModelConfig,
    tp: usize,
    rank: usize,
) -> Option<std::ops::Range<usize>> {
    match kind {
        WeightKind::O => rank_columns(Site::AttnOut, c, tp, rank),
        WeightKind::Down => rank_columns(Site::FfnUp, c, tp, rank),
        _ => None,
    }
}

/// The cache rows the decode steps at positions `n_prefill..n` read, stacked in step order: for
/// each such position p, rows `0..=p` of `x [n, width]` (`Σ (p+1)` rows). What a correct KV
/// cache holds when `x` is the `k` (or `v`) tap: the form of [`Site::KvCacheK`]/[`Site::KvCacheV`].
pub fn cache_rows(x: &[f32], n: usize, n_prefill: usize) -> Vec<f32> {
    let width = x.len().checked_div(n).unwrap_or(0);
    let mut out = Vec::new();
    for p in n_prefill..n {
        out.extend_from_slice(&x[..(p + 1) * width]);
    }
    out
}

/// The number of decode steps D whose stacked cache taps ([`cache_rows`]) have `rows` rows over
/// `n` tokens (the steps at positions `n - D..n`); `None` when no D fits.
pub fn cache_steps(rows: usize, n: usize) -> Option<usize> {
    let mut total = 0;
    for d in 1..n {
        total += n - d + 1;
        if total == rows {
            return Some(d);
        }
        if total > rows {
            return None;
        }
    }
    None
}

/// The row range of step `i` (0-based, position `n - d + i`) inside stacked cache taps of `d`
/// decode steps over `n` tokens.
pub fn cache_step_rows(n: usize, d: usize, i: usize) -> std::ops::Range<usize> {
    let first = n - d;
    // Σ_{j<i} (first + j + 1)
    let start = i * (first + 1) + i * i.saturating_sub(1) / 2;
    start..start + first + i + 1
}

/// Wraps the reference's tap for a run whose last `n - n_prefill` tokens the candidate ran as
/// decode steps: besides what `inner` wants, it records each layer's [`Site::KvCacheK`] and
/// [`Site::KvCacheV`] from the reference's own `k` and `v` ([`cache_rows`]: what a correct
/// cache holds at each step), right after `v`, so they come in execution order.
pub struct DecodeCacheTap<'a> {
    inner: &'a mut dyn Tap,
    n: usize,
    n_prefill: usize,
    held_k: Option<(TapKey, Vec<f32>, usize)>,
}

impl<'a> DecodeCacheTap<'a> {
    pub fn new(inner: &'a mut dyn Tap, n: usize, n_prefill: usize) -> Self {
        DecodeCacheTap {
            inner,
            n,
            n_prefill,
            held_k: None,
        }
    }

    /// True when `key` is an unranked `k`/`v` whose layer's cache taps the inner tap wants.
    fn feeds_cache(&self, key: &TapKey) -> bool {
        let at = |site| TapKey { site, ..*key };
        matches!(key.site, Site::K | Site::V)
            && key.rank.is_none()
            && key.layer.is_some()
            && self.n_prefill < self.n
            && (self.inner.wants(&at(Site::KvCacheK)) || self.inner.wants(&at(Site::KvCacheV)))
    }
}

impl Tap for DecodeCacheTap<'_> {
    fn wants(&self, key: &TapKey) -> bool {
        self.inner.wants(key) || self.feeds_cache(key)
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        self.record_owned(key, data.to_vec(), shape);
    }
    fn record_owned(&mut self, key: &TapKey, data: Vec<f32>, shape: [usize; 2]) {
        let feeds = self.feeds_cache(key) && shape[0] == self.n;
        let rows: usize = (self.n_prefill..self.n).map(|p| p + 1).sum();
        let cache = |x: &[f32]| cache_rows(x, self.n, self.n_prefill);
        let emit = |inner: &mut dyn Tap, k: TapKey, x: Vec<f32>, width: usize| {
            if inner.wants(&k) {
                inner.record_owned(&k, x, [rows, width]);
            }
        };
        match key.site {
            Site::K if feeds => {
                let k_rows = cache(&data);
                if self.inner.wants(key) {
                    self.inner.record_owned(key, data, shape);
                }
                self.held_k = Some((
                    TapKey {
                        site: Site::KvCacheK,
                        ..*key
                    },
                    k_rows,
                    shape[1],
                ));
                return;
            }
            Site::V if feeds => {
                let v_rows = cache(&data);
                let held = self.held_k.take().filter(|(ck, _, _)| ck.layer == key.layer);
                if self.inner.wants(key) {
                    self.inner.record_owned(key, data, shape);
                }
                if let Some((ck, k_rows, wk)) = held {
                    emit(&mut *self.inner, ck, k_rows, wk);
                }
                emit(
                    &mut *self.inner,
                    TapKey {
                        site: Site::KvCacheV,
                        ..*key
                    },
                    v_rows,
                    shape[1],
                );
                return;
            }
            _ => {}
        }
        if self.inner.wants(key) {
            self.inner.record_owned(key, data, shape);
        }
    }
    fn weight_rows(&self, key: &TapKey, shape: [usize; 2]) -> Option<Vec<usize>> {
        self.inner.weight_rows(key, shape)
    }
    fn record_weight_rows(&mut self, key: &TapKey, rows: &[usize], data: Vec<f32>, shape: [usize; 2]) {
        self.inner.record_weight_rows(key, rows, data, shape);
    }
    fn wants_nothing(&self) -> bool {
        self.inner.wants_nothing()
    }
}

/// A recorded tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Recorded {
    pub key: TapKey,
    pub shape: [usize; 2],
    pub data: Vec<f32>,
}

/// A tap that keeps copies of everything its filter accepts, in arrival order.
pub struct CollectTap<F: Fn(&TapKey) -> bool + Send> {
    pub filter: F,
    pub recorded: Vec<Recorded>,
}

impl<F: Fn(&TapKey) -> bool + Send> CollectTap<F> {
    pub fn new(filter: F) -> Self {
        CollectTap {
            filter,
            recorded: Vec::new(),
        }
    }
    pub fn get(&self, key: &TapKey) -> Option<&Recorded> {
        self.recorded.iter().find(|r| r.key == *key)
    }
}

impl<F: Fn(&TapKey) -> bool + Send> Tap for CollectTap<F> {
    fn wants(&self, key: &TapKey) -> bool {
        (self.filter)(key)
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        self.record_owned(key, data.to_vec(), shape);
    }
    fn record_owned(&mut self, key: &TapKey, data: Vec<f32>, shape: [usize; 2]) {
        self.recorded.push(Recorded { key: *key, shape, data });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn printed_forms_round_trip() {
        for s in [
            "embed",
            "blk.3.attn_out",
            "blk.3.attn_out@r1",
            "blk.3.w.kv_b@r1",
            "output_norm",
            "logits",
            "blk.0.moe_topk",
        ] {
            let k: TapKey = s.parse().unwrap();
            assert_eq!(k.to_string(), s);
        }
        assert!("blk.x.q".parse::<TapKey>().is_err());
        assert!("blk.1.logits".parse::<TapKey>().is_err());
        assert!("attn_out".parse::<TapKey>().is_err());
        assert!("blk.1.nope".parse::<TapKey>().is_err());
    }

    #[test]
    fn execution_order() {
        let keys: Vec<TapKey> = [
            "logits",
            "blk.1.q",
            "blk.0.resid_out",
            "blk.0.attn_out",
            "blk.0.attn_out@r1",
            "blk.0.w.q@r0",
            "output_norm",
            "embed",
        ]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
        let mut sorted = keys.clone();
        sorted.sort();
        let printed: Vec<String> = sorted.iter().map(|k| k.to_string()).collect();
        assert_eq!(
            printed,
            [
                "embed",
                "blk.0.w.q@r0",
                "blk.0.attn_out@r1",
                "blk.0.attn_out",
                "blk.0.resid_out",
                "blk.1.q",
                "output_norm",
                "logits"
            ]
        );
    }

    #[test]
    fn cache_rows_stack_each_decode_steps_prefix() {
        // 4 tokens of width 2, the last 2 decoded: positions 2 and 3 read rows 0..=2 and 0..=3.
        let x: Vec<f32> = (0..8).map(|i| i as f32).collect();
        let c = cache_rows(&x, 4, 2);
        assert_eq!(c.len(), (3 + 4) * 2);
        assert_eq!(&c[..6], &x[..6]);
        assert_eq!(&c[6..], &x[..]);
        assert_eq!(cache_steps(7, 4), Some(2));
        assert_eq!(cache_steps(4, 4), Some(1));
        assert_eq!(cache_steps(9, 4), Some(3));
        assert_eq!(cache_steps(5, 4), None);
        assert_eq!(cache_step_rows(4, 2, 0), 0..3);
        assert_eq!(cache_step_rows(4, 2, 1), 3..7);
        assert_eq!(cache_step_rows(8, 3, 2), (6 + 7)..(6 + 7 + 8));
    }

    #[test]
    fn decode_cache_tap_adds_the_cache_keys_after_v() {
        let mut inner = CollectTap::new(|k: &TapKey| k.site != Site::K);
        {
            let mut t = DecodeCacheTap::new(&mut inner, 3, 2);
            let (k, v) = (TapKey::layer(0, Site::K), TapKey::layer(0, Site::V));
            assert!(t.wants(&k) && t.wants(&v));
            t.record(&k, &[1.0, 2.0, 3.0], [3, 1]);
            t.record(&v, &[4.0, 5.0, 6.0], [3, 1]);
        }
        let keys: Vec<String> = inner.recorded.iter().map(|r| r.key.to_string()).collect();
        assert_eq!(keys, ["blk.0.v", "blk.0.kv_cache_k", "blk.0.kv_cache_v"]);
        assert_eq!(inner.recorded[1].data, [1.0, 2.0, 3.0]);
        assert_eq!(inner.recorded[1].shape, [3, 1]);
        assert_eq!(inner.recorded[2].data, [4.0, 5.0, 6.0]);
    }

    #[test]
    fn canary_is_a_recognisable_nan() {
        assert!(canary().is_nan());
        assert!(is_canary(canary()));
        assert!(!is_canary(f32::NAN));
    }

    #[test]
    fn each_dtype_canary_is_the_f32_canary_narrowed_and_recognised() {
        // Widened bit patterns, written out.
        assert_eq!(canary_bf16().to_bits(), 0x7FC1_0000);
        assert_eq!(canary_f16().to_bits(), 0x7FC1_C000);
        // The half crate's conversions (which keep the top payload bits) narrow the f32 canary
        // to each 16-bit canary, and widen them back to what is_canary takes.
        assert_eq!(half::bf16::from_f32(canary()).to_bits(), CANARY_BF16_BITS);
        assert_eq!(half::f16::from_f32(canary()).to_bits(), CANARY_F16_BITS);
        assert_eq!(
            half::bf16::from_bits(CANARY_BF16_BITS).to_f32().to_bits(),
            canary_bf16().to_bits()
        );
        for c in [canary(), canary_bf16(), canary_f16()] {
            assert!(c.is_nan() && is_canary(c), "{:#x}", c.to_bits());
            assert!(!is_canary(-c), "the sign is part of the canary");
        }
        // Canonical NaNs of every width, infinities and ordinary values are not canaries.
        let canonical = [
            f32::NAN,
            f32::from_bits(0x7FFF_FFFF),
            half::bf16::from_bits(0x7FC0).to_f32(),
            half::bf16::from_bits(0x7FFF).to_f32(),
            half::f16::from_bits(0x7E00).to_f32(),
            half::f16::from_bits(0x7FFF).to_f32(),
        ];
        for x in canonical.into_iter().chain([f32::INFINITY, 0.0, 1.0, -3.5]) {
            assert!(!is_canary(x), "{:#x}", x.to_bits());
        }
    }
}
