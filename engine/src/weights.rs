//! Weight loading and sharding for TP degree N. Each rank dequantizes only its own shards
//! straight from the GGUF bytes (never N full copies); small replicated tensors are loaded once and
//! shared between ranks behind an `Arc`.
//!
//! The sharding scheme (vLLM / Megatron defaults):
//! - Column-parallel (rank r holds output rows `r·out/N ..`): llama `attn_q`, `attn_k`, `attn_v`
//!   by whole heads (q by H/N heads, k/v by KV/N kv-heads); MLA `attn_q_b` (or a plain `attn_q`)
//!   and the reassembled `kv_b` by whole heads; FFN `gate` and `up` by columns of the hidden dim.
//! - Row-parallel (rank r holds input columns `r·in/N ..`, output reduced by a sum all-reduce):
//!   `attn_output` (o_proj) and FFN `down`.
//! - Replicated (every rank computes the same thing): the norms, MLA `attn_q_a`, `attn_kv_a_mqa`,
//!   the MoE router `ffn_gate_inp` and its `exp_probs_b` bias, and the DSA indexer (`indexer.*`:
//!   vLLM builds its projections as `ReplicatedLinear`).
//! - Vocab-parallel: `token_embd` and `output` (lm_head) split by vocab rows, `ceil(V/N)` per rank
//!   (the last rank may hold fewer). The embedding lookup is masked to the rank's rows and
//!   all-reduced; the logits are gathered (concatenated) in rank order.
//! - MoE, as vLLM's default TP (no expert parallelism): every rank holds every expert, and each
//!   expert's intermediate dim is split: `gate`/`up` column-parallel, `down` row-parallel. The
//!   shared expert is split the same way. One all-reduce follows the whole MoE block (routed
//!   experts and shared expert together).
//!
//! kv_b is reassembled from `attn_k_b` (ne `[nope, kv_lora, H]`, k_b stored transposed per head)
//! and `attn_v_b` (ne `[kv_lora, v, H]`): `kv_b = cat([k_bᵀ, v_b], dim=1).reshape(H·(nope+v), kv_lora)`,
//! then sharded by head. The loader faults (`kv-b-unsharded`, `kv-b-shard-swap`,
//! `k-b-untransposed`, `dequant-q4k-scale-min`, `moe-gate-rounded`, and the DSA indexer's
//! `indexer-wrong-layer`, `indexer-wrong-dtype`, `indexer-raw-quant`) live here as the
//! alternative paths they are in a real loader. The indexer's three matrices are weight taps
//! (`w.idx_q_b`, `w.idx_k`, `w.idx_proj`), replicated like the indexer.
//!
//! The GQA families' extras ([`GqaExtras`]): q/k/v biases (qwen2, glm4moe) are column-parallel,
//! sliced with their weight's rows; per-head q/k norms (qwen3, qwen3moe, gemma3) and gemma's
//! post-norms are replicated. glm4moe's pre-FFN norm is read from `post_attention_norm`.
//!
//! At a 16-bit compute dtype ([`Loader::compute_dtype`]) float tensors (F32, F16, BF16) are
//! rounded to it as they are read, except the RoPE frequency factors and the router's
//! `exp_probs_b` bias, which production engines keep in f32; quantized tensors keep their exact
//! dequantized values (the rules: [`crate::precision`]).

use crate::cpu_ops::{Mat, QMat, WeightRef};
use crate::fault::{Fault, FaultSet};
use crate::fault_dequant::{dequantize_q4k, ScaleMinOrder};
use crate::options::ComputeDtype;
use crate::EngineError;
use rayon::prelude::*;
use references::config::{Arch, MoeConfig};
use references::tap::WeightKind;
use references::{GgmlType, GgufFile, ModelConfig, TensorInfo};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

/// How a weight shard is stored: f32, or the file's quantized blocks (decoded on the fly by the
/// matmul, which saves memory bandwidth).
#[derive(Clone, Debug)]
pub enum WeightData {
    F32(Arc<Vec<f32>>),
    Quant { ty: GgmlType, bytes: Arc<Vec<u8>> },
}

/// A weight in torch layout `[rows = out, cols = in]`.
#[derive(Clone, Debug)]
pub struct Linear {
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Linear {
    fn f32(rows: usize, cols: usize, data: Vec<f32>) -> Linear {
        Linear {
            rows,
            cols,
            data: WeightData::F32(Arc::new(data)),
        }
    }

    /// The whole weight, as the matmul reads it.
    pub fn view(&self) -> WeightRef<'_> {
        self.first_rows(self.rows)
    }

    /// The first `n_rows` rows (the rows a rank computes with when it holds more than its shard).
    pub fn first_rows(&self, n_rows: usize) -> WeightRef<'_> {
        let n_rows = n_rows.min(self.rows);
        match &self.data {
            WeightData::F32(d) => WeightRef::F32(Mat {
                data: &d[..n_rows * self.cols],
                rows: n_rows,
                cols: self.cols,
            }),
            WeightData::Quant { ty, bytes } => {
                let row_bytes = bytes.len() / self.rows.max(1);
                WeightRef::Quant(QMat {
                    ty: *ty,
                    bytes: &bytes[..n_rows * row_bytes],
                    rows: n_rows,
                    cols: self.cols,
                    row_bytes,
                })
            }
        }
    }

    /// Row `row_idx` decoded to f32 into `out` (`cols` long).
    pub fn row_f32(&self, row_idx: usize, out: &mut [f32]) {
        match &self.data {
            WeightData::F32(d) => out.copy_from_slice(&d[row_idx * self.cols..(row_idx + 1) * self.cols]),
            WeightData::Quant { ty, bytes } => {
                let row_bytes = bytes.len() / self.rows.max(1);
                crate::dequant::dequantize(*ty, &bytes[row_idx * row_bytes..(row_idx + 1) * row_bytes], out)
                    .expect("weight shard lengths are checked at load");
            }
        }
    }

    /// Rows `rows` decoded to f32, in that order (a weight tap on a sample of rows).
    pub fn rows_to_f32(&self, rows: &[usize]) -> Vec<f32> {
        let mut out = vec![0f32; rows.len() * self.cols];
        for (&r, o) in rows.iter().zip(out.chunks_exact_mut(self.cols.max(1))) {
            self.row_f32(r, o);
        }
        out
    }

    /// The whole weight decoded to f32 (for weight taps).
    pub fn to_f32(&self) -> Vec<f32> {
        match &self.data {
            WeightData::F32(d) => d.to_vec(),
            WeightData::Quant { .. } => {
                let mut out = vec![0f32; self.rows * self.cols];
                out.par_chunks_exact_mut(self.cols.max(1))
                    .enumerate()
                    .for_each(|(row_idx, o)| self.row_f32(row_idx, o));
                out
            }
        }
    }
}

/// A SwiGLU MLP shard: gate/up `[f_r, d]`, down `[d, f_r]`.
pub struct MlpShard {
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
}

/// A rank's share of an MoE block.
pub struct MoeShard {
    /// Router `[n_experts, d]` (replicated).
    pub router: Linear,
    /// `exp_probs_b.bias` `[n_experts]` (replicated).
    pub bias: Option<Arc<Vec<f32>>>,
    pub experts: Vec<MlpShard>,
    pub shared: Option<MlpShard>,
}

pub enum FfnShard {
    Dense(MlpShard),
    Moe(MoeShard),
}

pub enum AttnShard {
    Gqa {
        q: Linear,
        k: Linear,
        v: Linear,
    },
    Mla {
        /// `(q_a [q_lora, d], q_a_norm)`, replicated; `None` when the model has a plain attn_q.
        q_a: Option<(Linear, Arc<Vec<f32>>)>,
        /// q_b (or plain attn_q) shard `[H_r·(nope+rope), in]`.
        q: Linear,
        /// kv_a_mqa `[kv_lora + rope, d]`, replicated.
        kv_a: Linear,
        kv_a_norm: Arc<Vec<f32>>,
        /// The reassembled kv_b as this rank holds it (its heads, or more under `kv-b-unsharded`).
        kv_b: Linear,
        /// Rows of `kv_b` the rank computes with: `H_r·(nope+v)`.
        kv_b_rows_used: usize,
        /// The DSA indexer of a layer that runs its own (glm-dsa, deepseek32); `None` for
        /// deepseek2 and for a `shared` indexer layer (it reuses the previous one's selection).
        indexer: Option<IndexerShard>,
    },
}

/// A layer's DSA lightning indexer, replicated on every rank (vLLM's `Indexer`: every projection
/// a `ReplicatedLinear`).
pub struct IndexerShard {
    /// `indexer.attn_q_b` `[H·D, q_lora]`, on the normed q_a.
    pub q_b: Linear,
    /// `indexer.attn_k` `[D, d]`, on the attn_norm output.
    pub k: Linear,
    /// `indexer.k_norm` weight and bias `[D]` (a LayerNorm).
    pub k_norm: (Arc<Vec<f32>>, Arc<Vec<f32>>),
    /// `indexer.proj` `[H, d]`: the per-head weights of the scores.
    pub proj: Linear,
}

/// A GQA layer's extras beyond llama's (qwen2/3, qwen3moe, glm4moe, gemma2/3); each `None` where
/// the family (or this file) has none.
#[derive(Default)]
pub struct GqaExtras {
    /// q, k and v biases, column-parallel: this rank's slices `[H_r·hd]`, `[KV_r·hd]`, `[KV_r·hd]`.
    pub qkv_bias: Option<[Arc<Vec<f32>>; 3]>,
    /// Per-head q and k RMSNorm weights `[hd]` (qwen3, gemma3), replicated.
    pub qk_norm: Option<[Arc<Vec<f32>>; 2]>,
    /// Gemma's RMSNorms on the reduced attention and FFN outputs (`post_attention_norm`,
    /// `post_ffw_norm` `[d]`), replicated: applied after the all-reduce, before the residual add.
    pub post_norms: Option<[Arc<Vec<f32>>; 2]>,
}

pub struct LayerShard {
    pub attn_norm: Arc<Vec<f32>>,
    pub attn: AttnShard,
    /// o_proj shard `[d, in_r]` (row-parallel).
    pub o: Linear,
    pub ffn_norm: Arc<Vec<f32>>,
    pub ffn: FfnShard,
    pub extras: GqaExtras,
}

impl LayerShard {
    /// The weights a weight tap can show, with their kinds.
    pub fn tappable(&self) -> Vec<(WeightKind, &Linear)> {
        let mut v = Vec::new();
        match &self.attn {
            AttnShard::Gqa { q, k, v: vv } => {
                v.extend([(WeightKind::Q, q), (WeightKind::K, k), (WeightKind::V, vv)]);
            }
            AttnShard::Mla { q_a, q, kv_a, kv_b, .. } => {
                match q_a {
                    Some((qa, _)) => v.extend([(WeightKind::QA, qa), (WeightKind::QB, q)]),
                    None => v.push((WeightKind::Q, q)),
                }
                v.extend([(WeightKind::KvA, kv_a), (WeightKind::KvB, kv_b)]);
            }
        }
        if let AttnShard::Mla { indexer: Some(ix), .. } = &self.attn {
            v.extend([
                (WeightKind::IdxQB, &ix.q_b),
                (WeightKind::IdxK, &ix.k),
                (WeightKind::IdxProj, &ix.proj),
            ]);
        }
        v.push((WeightKind::O, &self.o));
        match &self.ffn {
            FfnShard::Dense(m) => v.extend([
                (WeightKind::Gate, &m.gate),
                (WeightKind::Up, &m.up),
                (WeightKind::Down, &m.down),
            ]),
            FfnShard::Moe(m) => v.push((WeightKind::Router, &m.router)),
        }
        v
    }
}

/// A rank's layer shards, indexed by the model's layer number: layers `first..` (0 unless the
/// engine runs a layer range, `EngineOptions::layers`; the layers before it are never loaded).
pub struct Layers {
    pub first: usize,
    pub shards: Vec<LayerShard>,
}

impl Layers {
    /// Layer `layer_idx`'s shard, or None where it was not loaded.
    pub fn get(&self, layer_idx: usize) -> Option<&LayerShard> {
        self.shards.get(layer_idx.checked_sub(self.first)?)
    }
}

impl std::ops::Index<usize> for Layers {
    type Output = LayerShard;
    fn index(&self, layer_idx: usize) -> &LayerShard {
        match layer_idx.checked_sub(self.first) {
            Some(i) => &self.shards[i],
            None => panic!("layer {layer_idx} was not loaded (layers {}..)", self.first),
        }
    }
}

/// Everything one rank holds.
pub struct RankShard {
    pub rank_idx: usize,
    /// Vocab rows `[V_r, d]` of token_embd.
    pub embd: Linear,
    pub vocab_range: Range<usize>,
    /// The layers this rank loaded (all, or a range: see [`Layers`]).
    pub layers: Layers,
    pub output_norm: Arc<Vec<f32>>,
    /// Per-pair RoPE frequency divisors, `[rope_dim / 2]`, replicated: Llama 3.1+'s
    /// `rope_freqs.weight`, or YaRN's ramp (each pair's plain frequency over YaRN's, from
    /// `YarnConfig::inv_freq`); None when the model scales no frequency.
    pub rope_freqs: Option<Arc<Vec<f32>>>,
    /// lm_head rows `[V_r, d]`; the embedding shard when the embeddings are tied.
    pub lm_head: Linear,
}

/// The vocab rows rank `rank_idx` of `tp` holds: `ceil(V/tp)` each, the last rank fewer.
pub fn vocab_range(vocab: usize, tp: usize, rank_idx: usize) -> Range<usize> {
    let per = vocab.div_ceil(tp);
    (rank_idx * per).min(vocab)..((rank_idx + 1) * per).min(vocab)
}

/// Rounds to the nearest FP8 E4M3 value (3 mantissa bits, max 448; ties to even, as torch's and
/// CUDA's conversions round), as a router stored in FP8.
pub fn round_fp8_e4m3(x: f32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let a = x.abs().min(448.0);
    let e = a.log2().floor().max(-6.0);
    let quantum = (e - 3.0).exp2();
    ((a / quantum).round_ties_even() * quantum).min(448.0).copysign(x)
}

/// The layer whose DSA indexer `indexer-wrong-layer` loads in place of layer `layer_idx`'s: the
/// nearest other layer with an indexer of its own (the earlier one on a tie), `None` when there
/// is none.
pub fn indexer_stand_in(c: &ModelConfig, layer_idx: usize) -> Option<usize> {
    let ix = c.indexer.as_ref()?;
    let full = |l: usize| ix.full.get(l).copied().unwrap_or(true);
    let n = ix.full.len().max(c.n_layers);
    (1..n).find_map(|dist| {
        [layer_idx.checked_sub(dist), Some(layer_idx + dist).filter(|&l| l < n)]
            .into_iter()
            .flatten()
            .find(|&l| full(l))
    })
}

/// The indexer weight of layer `layer_idx` that `indexer-wrong-dtype` decodes as the other
/// 16-bit float: the first of `attn_k`, `proj`, `attn_q_b` stored F16 or BF16, if any.
pub fn indexer_float_weight(file: &GgufFile, layer_idx: usize) -> Option<&'static str> {
    ["attn_k", "proj", "attn_q_b"].into_iter().find(|w| {
        file.tensor(&format!("blk.{layer_idx}.indexer.{w}.weight"))
            .is_some_and(|t| matches!(t.ty, GgmlType::F16 | GgmlType::BF16))
    })
}

/// Replicated tensors by (name, faulty-Q4_K decode).
type ReplicatedCache = HashMap<(String, bool), Arc<Vec<f32>>>;

/// How the loader stores weight shards.
///
/// Measured on the SmolLM2-135M-shaped synth (Q8_0; 2 cores shared with other jobs, AVX-512):
/// prefill of 64 tokens takes ~0.3–0.4 s either way; decode took 27–46 ms/token quantized and
/// 30–36 ms f32 across runs (decoding blocks costs about what reading 4x the bytes saves). With
/// speed a wash, the default keeps the blocks: 3.8x less memory for Q8_0, 7x for Q4.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightStorage {
    /// Keep the file's quantized blocks and decode them tile by tile inside the matmul.
    #[default]
    Quantized,
    /// Dequantize every shard to f32 at load (more memory, no decode work per step).
    F32,
}

/// Reads, checks and dequantizes tensors for the ranks; caches replicated ones.
pub struct Loader<'a> {
    pub file: &'a GgufFile,
    pub config: &'a ModelConfig,
    pub faults: &'a FaultSet,
    pub tp: usize,
    pub storage: WeightStorage,
    /// Float tensors are rounded to this as they are read (identity at f32).
    pub dtype: ComputeDtype,
    /// Layers before this one are not loaded (a layer range starting there).
    pub first_layer: usize,
    replicated: Mutex<ReplicatedCache>,
}

/// True for the GGUF float types (not block-quantized).
fn is_float(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

fn name_of(s: &str) -> String {
    format!("{s}.weight")
}

impl<'a> Loader<'a> {
    pub fn new(
        file: &'a GgufFile,
        config: &'a ModelConfig,
        faults: &'a FaultSet,
        tp: usize,
        storage: WeightStorage,
    ) -> Self {
        Loader {
            file,
            config,
            faults,
            tp,
            storage,
            dtype: ComputeDtype::F32,
            first_layer: 0,
            replicated: Mutex::new(HashMap::new()),
        }
    }

    /// The loader that skips the layers before `first` (neither read nor dequantized).
    pub fn first_layer(self, first: usize) -> Self {
        Loader {
            first_layer: first,
            ..self
        }
    }

    /// The loader with float tensors rounded to `dtype` as they are read.
    pub fn compute_dtype(self, dtype: ComputeDtype) -> Self {
        Loader { dtype, ..self }
    }

    fn info(&self, name: &str) -> Result<&'a TensorInfo, EngineError> {
        self.file
            .tensor(name)
            .ok_or_else(|| EngineError::MissingTensor(name.to_string()))
    }

    /// The tensor's info after checking its dims against what the config implies.
    fn checked(&self, name: &str, ne: &[usize]) -> Result<&'a TensorInfo, EngineError> {
        let t = self.info(name)?;
        let want: Vec<u64> = ne.iter().map(|&x| x as u64).collect();
        // GGUF drops trailing 1-dims in some writers: compare with them stripped.
        let strip = |v: &[u64]| -> Vec<u64> {
            let mut v = v.to_vec();
            while v.len() > 1 && v.last() == Some(&1) {
                v.pop();
            }
            v
        };
        if strip(&t.ne) != strip(&want) {
            return Err(EngineError::BadTensor {
                name: name.to_string(),
                msg: format!("ne {:?}, but the config implies {:?}", t.ne, want),
            });
        }
        Ok(t)
    }

    /// Decodes `src` of type `ty` into `dst`; a float type is then rounded to the compute dtype
    /// unless `keep_f32`.
    fn dequant(
        &self,
        name: &str,
        ty: GgmlType,
        src: &[u8],
        dst: &mut [f32],
        bad_q4k: bool,
        keep_f32: bool,
    ) -> Result<(), EngineError> {
        self.dequant_exact(name, ty, src, dst, bad_q4k)?;
        if is_float(ty) && !keep_f32 {
            self.dtype.round_slice(dst);
        }
        Ok(())
    }

    fn dequant_exact(
        &self,
        name: &str,
        ty: GgmlType,
        src: &[u8],
        dst: &mut [f32],
        bad_q4k: bool,
    ) -> Result<(), EngineError> {
        if ty == GgmlType::Q4K && bad_q4k {
            if !dequantize_q4k(src, dst, ScaleMinOrder::Swapped) {
                return Err(EngineError::Dequant {
                    name: name.to_string(),
                    msg: "Q4_K data is not whole blocks".into(),
                });
            }
            return Ok(());
        }
        crate::dequant::dequantize(ty, src, dst).map_err(|e| EngineError::Dequant {
            name: name.to_string(),
            msg: e.to_string(),
        })
    }

    /// Rows `rows` (each `ne[0]` elements; rows counted over all outer dims) of a tensor.
    pub fn rows(&self, name: &str, ne: &[usize], rows: Range<usize>, bad_q4k: bool) -> Result<Vec<f32>, EngineError> {
        self.rows_as(name, ne, rows, bad_q4k, false)
    }

    /// [`Loader::rows`], a float tensor kept in f32 when `keep_f32`.
    fn rows_as(
        &self,
        name: &str,
        ne: &[usize],
        rows: Range<usize>,
        bad_q4k: bool,
        keep_f32: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let t = self.checked(name, ne)?;
        let row_len = ne[0];
        let n_rows: usize = ne[1..].iter().product();
        if rows.end > n_rows || rows.start > rows.end {
            return Err(EngineError::BadTensor {
                name: name.to_string(),
                msg: format!("rows {rows:?} outside its {n_rows} rows"),
            });
        }
        let row_bytes = t.n_bytes as usize / n_rows.max(1);
        let src = &self.file.tensor_data(t)[rows.start * row_bytes..rows.end * row_bytes];
        let mut out = vec![0f32; rows.len() * row_len];
        self.dequant(name, t.ty, src, &mut out, bad_q4k, keep_f32)?;
        Ok(out)
    }

    /// Columns `cols` of rows `rows`: the input slice of a row-parallel weight.
    pub fn cols(
        &self,
        name: &str,
        ne: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
        bad_q4k: bool,
    ) -> Result<Vec<f32>, EngineError> {
        let t = self.checked(name, ne)?;
        let row_len = ne[0];
        let n_rows: usize = ne[1..].iter().product();
        if rows.end > n_rows || cols.end > row_len {
            return Err(EngineError::BadTensor {
                name: name.to_string(),
                msg: format!("rows {rows:?} cols {cols:?} outside [{n_rows}, {row_len}]"),
            });
        }
        let row_bytes = t.n_bytes as usize / n_rows.max(1);
        let data = self.file.tensor_data(t);
        let mut tmp = vec![0f32; row_len];
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for row_idx in rows {
            self.dequant(
                name,
                t.ty,
                &data[row_idx * row_bytes..(row_idx + 1) * row_bytes],
                &mut tmp,
                bad_q4k,
                false,
            )?;
            out.extend_from_slice(&tmp[cols.clone()]);
        }
        Ok(out)
    }

    /// A replicated tensor, whole, shared between ranks.
    /// A small replicated float tensor production engines keep in f32 (RoPE frequency factors,
    /// the router's score-correction bias): never rounded to the compute dtype.
    fn replicated_f32(&self, name: &str, ne: &[usize]) -> Result<Arc<Vec<f32>>, EngineError> {
        let n_rows: usize = ne[1..].iter().product();
        Ok(Arc::new(self.rows_as(name, ne, 0..n_rows, false, true)?))
    }

    fn replicated(&self, name: &str, ne: &[usize], bad_q4k: bool) -> Result<Arc<Vec<f32>>, EngineError> {
        let key = (name.to_string(), bad_q4k);
        if let Some(v) = self.replicated.lock().expect("loader cache").get(&key) {
            return Ok(v.clone());
        }
        let n_rows: usize = ne[1..].iter().product();
        let v = Arc::new(self.rows(name, ne, 0..n_rows, bad_q4k)?);
        self.replicated.lock().expect("loader cache").insert(key, v.clone());
        Ok(v)
    }

    fn replicated_linear(&self, name: &str, n_in: usize, n_out: usize, bad_q4k: bool) -> Result<Linear, EngineError> {
        Ok(Linear {
            rows: n_out,
            cols: n_in,
            data: WeightData::F32(self.replicated(name, &[n_in, n_out], bad_q4k)?),
        })
    }

    /// Whether a shard of type `ty` stays in its quantized blocks (the faulty Q4_K decode and
    /// F32 tensors are stored as f32, and so are F16/BF16 ones the compute dtype cannot hold
    /// exactly: F16 at bf16, BF16 at f16, which are rounded).
    fn keeps_blocks(&self, ty: GgmlType, bad_q4k: bool) -> bool {
        let representable = !matches!(
            (ty, self.dtype),
            (GgmlType::F16, ComputeDtype::Bf16) | (GgmlType::BF16, ComputeDtype::F16)
        );
        self.storage == WeightStorage::Quantized
            && ty != GgmlType::F32
            && !(ty == GgmlType::Q4K && bad_q4k)
            && representable
    }

    /// Rows `rows` of a tensor (rows `ne[0]` long, counted over the outer dims) as a weight
    /// `[rows.len(), ne[0]]`.
    fn shard_rows(&self, name: &str, ne: &[usize], rows: Range<usize>, bad_q4k: bool) -> Result<Linear, EngineError> {
        let t = self.checked(name, ne)?;
        if !self.keeps_blocks(t.ty, bad_q4k) {
            return Ok(Linear::f32(rows.len(), ne[0], self.rows(name, ne, rows, bad_q4k)?));
        }
        let n_rows: usize = ne[1..].iter().product();
        if rows.end > n_rows || rows.start > rows.end {
            return Err(EngineError::BadTensor {
                name: name.to_string(),
                msg: format!("rows {rows:?} outside its {n_rows} rows"),
            });
        }
        let row_bytes = t.n_bytes as usize / n_rows.max(1);
        let bytes = self.file.tensor_data(t)[rows.start * row_bytes..rows.end * row_bytes].to_vec();
        // The copy is what the engine keeps: the file's pages are dropped from this process now
        // (another rank reading them faults them back from the page cache), so loading does not
        // hold the model twice.
        self.file.release(t);
        Ok(Linear {
            rows: rows.len(),
            cols: ne[0],
            data: WeightData::Quant {
                ty: t.ty,
                bytes: Arc::new(bytes),
            },
        })
    }

    /// Columns `cols` of rows `rows` as a weight `[rows.len(), cols.len()]`; kept in blocks when
    /// the column range falls on block boundaries.
    fn shard_cols(
        &self,
        name: &str,
        ne: &[usize],
        rows: Range<usize>,
        cols: Range<usize>,
        bad_q4k: bool,
    ) -> Result<Linear, EngineError> {
        let t = self.checked(name, ne)?;
        let be = t.ty.block_elems();
        let aligned = cols.start.is_multiple_of(be) && cols.end.is_multiple_of(be) && cols.end <= ne[0];
        if !self.keeps_blocks(t.ty, bad_q4k) || !aligned {
            let data = self.cols(name, ne, rows.clone(), cols.clone(), bad_q4k)?;
            return Ok(Linear::f32(rows.len(), cols.len(), data));
        }
        let n_rows: usize = ne[1..].iter().product();
        if rows.end > n_rows {
            return Err(EngineError::BadTensor {
                name: name.to_string(),
                msg: format!("rows {rows:?} outside its {n_rows} rows"),
            });
        }
        let row_bytes = t.n_bytes as usize / n_rows.max(1);
        let (b0, b1) = (cols.start / be * t.ty.block_bytes(), cols.end / be * t.ty.block_bytes());
        let data = self.file.tensor_data(t);
        let mut bytes = Vec::with_capacity(rows.len() * (b1 - b0));
        for row_idx in rows.clone() {
            bytes.extend_from_slice(&data[row_idx * row_bytes + b0..row_idx * row_bytes + b1]);
        }
        self.file.release(t);
        Ok(Linear {
            rows: rows.len(),
            cols: cols.len(),
            data: WeightData::Quant {
                ty: t.ty,
                bytes: Arc::new(bytes),
            },
        })
    }

    /// Column-parallel: output rows `rows` of a 2-D weight `[n_out, n_in]` (ne `{n_in, n_out}`).
    fn column(
        &self,
        name: &str,
        n_in: usize,
        n_out: usize,
        rows: Range<usize>,
        bad_q4k: bool,
    ) -> Result<Linear, EngineError> {
        self.shard_rows(name, &[n_in, n_out], rows, bad_q4k)
    }

    /// Row-parallel: input columns `cols` of a 2-D weight `[n_out, n_in]`.
    fn row_parallel(
        &self,
        name: &str,
        n_in: usize,
        n_out: usize,
        cols: Range<usize>,
        bad_q4k: bool,
    ) -> Result<Linear, EngineError> {
        self.shard_cols(name, &[n_in, n_out], 0..n_out, cols, bad_q4k)
    }

    fn part(&self, width: usize, rank_idx: usize) -> Range<usize> {
        let w = width / self.tp;
        rank_idx * w..(rank_idx + 1) * w
    }

    /// The rank whose kv_b heads rank `rank_idx` is handed in `layer_idx` (itself unless a
    /// `kv-b-shard-swap` pairs it with another).
    fn kv_b_source_rank(&self, layer_idx: usize, rank_idx: usize) -> usize {
        let mut src = rank_idx;
        for s in self.faults.of(Fault::KvBShardSwap) {
            if s.layer.is_some_and(|spec_layer| spec_layer as usize != layer_idx) {
                continue;
            }
            let a = s.rank.unwrap_or(0) as usize % self.tp;
            let b = (a + 1) % self.tp;
            if src == a {
                src = b;
            } else if src == b {
                src = a;
            }
        }
        src
    }

    /// Loads everything rank `rank_idx` holds.
    pub fn load_rank(&self, rank_idx: usize) -> Result<RankShard, EngineError> {
        let c = self.config;
        let d = c.d_model;
        let global_q4k = self.faults.active_global(Fault::DequantQ4kScaleMin, rank_idx);
        let vocab_range = vocab_range(c.vocab, self.tp, rank_idx);
        let embd = self.column("token_embd.weight", d, c.vocab, vocab_range.clone(), global_q4k)?;
        let lm_head = if c.tied_embeddings {
            embd.clone()
        } else {
            self.column("output.weight", d, c.vocab, vocab_range.clone(), global_q4k)?
        };
        let output_norm = self.replicated("output_norm.weight", &[d], false)?;
        let rope_freqs = if c.rope_scaling.freq_factors {
            Some(self.replicated_f32("rope_freqs.weight", &[c.rope_dim / 2])?)
        } else {
            c.yarn.as_ref().filter(|y| y.factor != 1.0).map(|y| {
                let (base, dim) = (c.rope_base as f64, c.rope_dim);
                let yarn = y.inv_freq(base, dim);
                let divisors = (0..dim / 2).map(|i| (base.powf(-((2 * i) as f64) / dim as f64) / yarn[i]) as f32);
                Arc::new(divisors.collect())
            })
        };
        let shards = (self.first_layer..c.n_layers)
            .map(|layer_idx| self.load_layer(layer_idx, rank_idx))
            .collect::<Result<Vec<_>, _>>()?;
        let layers = Layers {
            first: self.first_layer,
            shards,
        };
        Ok(RankShard {
            rank_idx,
            embd,
            vocab_range,
            layers,
            output_norm,
            rope_freqs,
            lm_head,
        })
    }

    fn load_layer(&self, layer_idx: usize, rank_idx: usize) -> Result<LayerShard, EngineError> {
        let c = self.config;
        let d = c.d_model;
        let bad = self.faults.active(Fault::DequantQ4kScaleMin, layer_idx, rank_idx);
        let b = |s: &str| name_of(&format!("blk.{layer_idx}.{s}"));
        let attn_norm = self.replicated(&b("attn_norm"), &[d], false)?;
        // glm4moe stores its pre-FFN norm as `post_attention_norm` (gemma's is a post-norm).
        let ffn_norm_name = if c.arch == Arch::Glm4Moe {
            "post_attention_norm"
        } else {
            "ffn_norm"
        };
        let ffn_norm = self.replicated(&b(ffn_norm_name), &[d], false)?;
        let extras = self.gqa_extras(layer_idx, rank_idx)?;
        let (attn, o) = match &c.mla {
            None => {
                let hd = c.head_dim;
                let (hw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
                let attn = AttnShard::Gqa {
                    q: self.column(&b("attn_q"), d, hw, self.part(hw, rank_idx), bad)?,
                    k: self.column(&b("attn_k"), d, kvw, self.part(kvw, rank_idx), bad)?,
                    v: self.column(&b("attn_v"), d, kvw, self.part(kvw, rank_idx), bad)?,
                };
                (
                    attn,
                    self.row_parallel(&b("attn_output"), hw, d, self.part(hw, rank_idx), bad)?,
                )
            }
            Some(m) => {
                let h = c.n_heads;
                let qw = m.qk_nope + m.qk_rope;
                let (q_a, q) = match m.q_lora_rank {
                    Some(ql) => {
                        let qa = self.replicated_linear(&b("attn_q_a"), d, ql, bad)?;
                        let qa_norm = self.replicated(&b("attn_q_a_norm"), &[ql], false)?;
                        let qb = self.column(&b("attn_q_b"), ql, h * qw, self.part(h * qw, rank_idx), bad)?;
                        (Some((qa, qa_norm)), qb)
                    }
                    None => (
                        None,
                        self.column(&b("attn_q"), d, h * qw, self.part(h * qw, rank_idx), bad)?,
                    ),
                };
                let kv_a = self.replicated_linear(&b("attn_kv_a_mqa"), d, m.kv_lora_rank + m.qk_rope, bad)?;
                let kv_a_norm = self.replicated(&b("attn_kv_a_norm"), &[m.kv_lora_rank], false)?;
                let h_r = h / self.tp;
                let heads = if self.faults.active(Fault::KvBUnsharded, layer_idx, rank_idx) {
                    0..h
                } else {
                    let src = self.kv_b_source_rank(layer_idx, rank_idx);
                    src * h_r..(src + 1) * h_r
                };
                let untransposed = self.faults.active(Fault::KBUntransposed, layer_idx, rank_idx);
                let kv_b = self.kv_b(layer_idx, heads, untransposed, bad)?;
                let attn = AttnShard::Mla {
                    q_a,
                    q,
                    kv_a,
                    kv_a_norm,
                    kv_b,
                    kv_b_rows_used: h_r * (m.qk_nope + m.v_head_dim),
                    indexer: self.indexer(layer_idx, rank_idx, bad)?,
                };
                let vw = h * m.v_head_dim;
                (
                    attn,
                    self.row_parallel(&b("attn_output"), vw, d, self.part(vw, rank_idx), bad)?,
                )
            }
        };
        let ffn = match &c.moe {
            Some(moe) if c.is_moe_layer(layer_idx) => FfnShard::Moe(self.load_moe(layer_idx, rank_idx, moe, bad)?),
            _ => {
                let f = c.ffn_dim;
                FfnShard::Dense(MlpShard {
                    gate: self.column(&b("ffn_gate"), d, f, self.part(f, rank_idx), bad)?,
                    up: self.column(&b("ffn_up"), d, f, self.part(f, rank_idx), bad)?,
                    down: self.row_parallel(&b("ffn_down"), f, d, self.part(f, rank_idx), bad)?,
                })
            }
        };
        Ok(LayerShard {
            attn_norm,
            attn,
            o,
            ffn_norm,
            ffn,
            extras,
        })
    }

    /// Layer `layer_idx`'s DSA indexer, replicated: `None` without one (deepseek2) or on a
    /// `shared` indexer layer. The loader's indexer faults on rank `rank_idx`: the tensors of
    /// another layer (`indexer-wrong-layer`), its 16-bit float weight decoded as the other one
    /// (`indexer-wrong-dtype`, [`indexer_float_weight`]), `proj`'s Q8_0 integers without their
    /// scales (`indexer-raw-quant`).
    fn indexer(&self, layer_idx: usize, rank_idx: usize, bad: bool) -> Result<Option<IndexerShard>, EngineError> {
        let c = self.config;
        let Some(ix) = c
            .indexer
            .as_ref()
            .filter(|ix| ix.full.get(layer_idx).copied().unwrap_or(true))
        else {
            return Ok(None);
        };
        let ql = c
            .mla
            .as_ref()
            .and_then(|m| m.q_lora_rank)
            .ok_or_else(|| EngineError::Unsupported("the DSA indexer needs q_a (q_lora_rank)".into()))?;
        let (d, h, dh) = (c.d_model, ix.n_heads, ix.head_dim);
        let active = |f: Fault| self.faults.active(f, layer_idx, rank_idx);
        let src = match indexer_stand_in(c, layer_idx) {
            Some(other) if active(Fault::IndexerWrongLayer) => other,
            _ => layer_idx,
        };
        let b = |s: &str| format!("blk.{src}.indexer.{s}");
        let misread = active(Fault::IndexerWrongDtype)
            .then(|| indexer_float_weight(self.file, src))
            .flatten();
        let load = |w: &str, n_in: usize, n_out: usize| {
            if misread == Some(w) {
                self.misread_float(&b(&format!("{w}.weight")), n_in, n_out)
            } else {
                self.replicated_linear(&b(&format!("{w}.weight")), n_in, n_out, bad)
            }
        };
        let k = load("attn_k", d, dh)?;
        let proj = if active(Fault::IndexerRawQuant) {
            self.raw_q8_0(&b("proj.weight"), d, h)?
        } else {
            load("proj", d, h)?
        };
        Ok(Some(IndexerShard {
            q_b: load("attn_q_b", ql, h * dh)?,
            k,
            k_norm: (
                self.replicated(&b("k_norm.weight"), &[dh], false)?,
                self.replicated(&b("k_norm.bias"), &[dh], false)?,
            ),
            proj,
        }))
    }

    /// `indexer-wrong-dtype`: an F16 weight `[n_out, n_in]` decoded as BF16, or a BF16 one as
    /// F16 (any other type is read as it is: `check_fault` refuses the fault there).
    fn misread_float(&self, name: &str, n_in: usize, n_out: usize) -> Result<Linear, EngineError> {
        let t = self.checked(name, &[n_in, n_out])?;
        let as_ty = match t.ty {
            GgmlType::F16 => GgmlType::BF16,
            GgmlType::BF16 => GgmlType::F16,
            _ => return self.replicated_linear(name, n_in, n_out, false),
        };
        let mut out = vec![0f32; n_in * n_out];
        self.dequant(name, as_ty, self.file.tensor_data(t), &mut out, false, false)?;
        Ok(Linear::f32(n_out, n_in, out))
    }

    /// `indexer-raw-quant`: a Q8_0 weight `[n_out, n_in]` as its blocks' int8 values, the block
    /// scales never applied (any other type is read as it is: `check_fault` refuses the fault
    /// there).
    fn raw_q8_0(&self, name: &str, n_in: usize, n_out: usize) -> Result<Linear, EngineError> {
        let t = self.checked(name, &[n_in, n_out])?;
        if t.ty != GgmlType::Q8_0 {
            return self.replicated_linear(name, n_in, n_out, false);
        }
        let mut out = vec![0f32; n_in * n_out];
        if !crate::fault_dequant::q8_0_raw_ints(self.file.tensor_data(t), &mut out) {
            return Err(EngineError::Dequant {
                name: name.to_string(),
                msg: "Q8_0 data is not whole blocks".into(),
            });
        }
        Ok(Linear::f32(n_out, n_in, out))
    }

    /// Layer `layer_idx`'s [`GqaExtras`] on rank `rank_idx`: the biases and q/k norms where the
    /// file has them (qwen3, qwen3moe and gemma3 must have their q/k norms, as llama.cpp's loader
    /// requires), gemma's post-norms.
    fn gqa_extras(&self, layer_idx: usize, rank_idx: usize) -> Result<GqaExtras, EngineError> {
        let c = self.config;
        if c.mla.is_some() {
            return Ok(GqaExtras::default());
        }
        let (d, hd) = (c.d_model, c.head_dim);
        let has = |s: &str| self.file.tensor(s).is_some();
        let b = |s: &str| name_of(&format!("blk.{layer_idx}.{s}"));
        let bias = |s: &str| format!("blk.{layer_idx}.{s}.bias");
        let qkv_bias = if has(&bias("attn_q")) || has(&bias("attn_k")) || has(&bias("attn_v")) {
            let (hw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
            let slice = |s: &str, w: usize| -> Result<Arc<Vec<f32>>, EngineError> {
                Ok(Arc::new(self.cols(
                    &bias(s),
                    &[w],
                    0..1,
                    self.part(w, rank_idx),
                    false,
                )?))
            };
            Some([slice("attn_q", hw)?, slice("attn_k", kvw)?, slice("attn_v", kvw)?])
        } else {
            None
        };
        let norm_required = matches!(c.arch, Arch::Qwen3 | Arch::Qwen3Moe | Arch::Gemma3);
        let qk_norm = if norm_required || has(&b("attn_q_norm")) || has(&b("attn_k_norm")) {
            Some([
                self.replicated(&b("attn_q_norm"), &[hd], false)?,
                self.replicated(&b("attn_k_norm"), &[hd], false)?,
            ])
        } else {
            None
        };
        let post_norms = if c.arch.is_gemma() {
            Some([
                self.replicated(&b("post_attention_norm"), &[d], false)?,
                self.replicated(&b("post_ffw_norm"), &[d], false)?,
            ])
        } else {
            None
        };
        Ok(GqaExtras {
            qkv_bias,
            qk_norm,
            post_norms,
        })
    }

    /// The reassembled kv_b rows of `heads`: per head `[k_bᵀ (nope rows) ; v_b (v rows)]`, each
    /// row kv_lora wide. With `untransposed`, k_b's per-head `[kv_lora, nope]` block is
    /// reinterpreted as `[nope, kv_lora]` by a reshape instead of a transpose.
    fn kv_b(
        &self,
        layer_idx: usize,
        heads: Range<usize>,
        untransposed: bool,
        bad_q4k: bool,
    ) -> Result<Linear, EngineError> {
        let c = self.config;
        let m = c.mla.as_ref().expect("kv_b is MLA-only");
        let (h, nope, vd, kvl) = (c.n_heads, m.qk_nope, m.v_head_dim, m.kv_lora_rank);
        let k_name = name_of(&format!("blk.{layer_idx}.attn_k_b"));
        let v_name = name_of(&format!("blk.{layer_idx}.attn_v_b"));
        // k_b rows are nope wide: head hh holds rows hh·kv_lora .. (hh+1)·kv_lora.
        let kb = self.rows(&k_name, &[nope, kvl, h], heads.start * kvl..heads.end * kvl, bad_q4k)?;
        // v_b rows are kv_lora wide: head hh holds rows hh·v .. (hh+1)·v.
        let vb = self.rows(&v_name, &[kvl, vd, h], heads.start * vd..heads.end * vd, bad_q4k)?;
        let per_head = (nope + vd) * kvl;
        let mut out = vec![0f32; heads.len() * per_head];
        for (i, head) in out.chunks_exact_mut(per_head).enumerate() {
            let k_slab = &kb[i * kvl * nope..(i + 1) * kvl * nope]; // [kv_lora][nope]
            let (k_rows, v_rows) = head.split_at_mut(nope * kvl);
            if untransposed {
                k_rows.copy_from_slice(k_slab);
            } else {
                for j in 0..nope {
                    for c_idx in 0..kvl {
                        k_rows[j * kvl + c_idx] = k_slab[c_idx * nope + j];
                    }
                }
            }
            v_rows.copy_from_slice(&vb[i * vd * kvl..(i + 1) * vd * kvl]);
        }
        Ok(Linear::f32(heads.len() * (nope + vd), kvl, out))
    }

    fn load_moe(&self, layer_idx: usize, rank_idx: usize, moe: &MoeConfig, bad: bool) -> Result<MoeShard, EngineError> {
        let d = self.config.d_model;
        let (n_exp, eff) = (moe.n_experts, moe.expert_ffn);
        let b = |s: &str| name_of(&format!("blk.{layer_idx}.{s}"));
        let mut router = self.replicated_linear(&b("ffn_gate_inp"), d, n_exp, false)?;
        if self.faults.active(Fault::MoeGateRounded, layer_idx, rank_idx) {
            let rounded = router.to_f32().into_iter().map(round_fp8_e4m3).collect();
            router = Linear::f32(router.rows, router.cols, rounded);
        }
        let bias_name = format!("blk.{layer_idx}.exp_probs_b.bias");
        let bias = match self.file.tensor(&bias_name) {
            Some(_) => Some(self.replicated_f32(&bias_name, &[n_exp])?),
            None => None,
        };
        let part = self.part(eff, rank_idx);
        let experts = (0..n_exp)
            .map(|e| {
                let rows = e * eff + part.start..e * eff + part.end;
                Ok(MlpShard {
                    gate: self.shard_rows(&b("ffn_gate_exps"), &[d, eff, n_exp], rows.clone(), bad)?,
                    up: self.shard_rows(&b("ffn_up_exps"), &[d, eff, n_exp], rows, bad)?,
                    down: self.shard_cols(
                        &b("ffn_down_exps"),
                        &[eff, d, n_exp],
                        e * d..(e + 1) * d,
                        part.clone(),
                        bad,
                    )?,
                })
            })
            .collect::<Result<Vec<_>, EngineError>>()?;
        let shared = if moe.n_shared > 0 {
            let sh = eff * moe.n_shared;
            let p = self.part(sh, rank_idx);
            Some(MlpShard {
                gate: self.column(&b("ffn_gate_shexp"), d, sh, p.clone(), bad)?,
                up: self.column(&b("ffn_up_shexp"), d, sh, p.clone(), bad)?,
                down: self.row_parallel(&b("ffn_down_shexp"), sh, d, p, bad)?,
            })
        } else {
            None
        };
        Ok(MoeShard {
            router,
            bias,
            experts,
            shared,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_ranges_cover_the_vocab() {
        for (v, tp) in [(512, 3), (49152, 8), (10, 4), (7, 8)] {
            let mut next = 0;
            for rank_idx in 0..tp {
                let range = vocab_range(v, tp, rank_idx);
                assert_eq!(range.start, next);
                next = range.end;
            }
            assert_eq!(next, v);
        }
    }

    #[test]
    fn fp8_rounding() {
        assert_eq!(round_fp8_e4m3(1.0), 1.0);
        assert_eq!(round_fp8_e4m3(1.07), 1.125);
        assert_eq!(round_fp8_e4m3(-0.3), -0.3125);
        assert_eq!(round_fp8_e4m3(1000.0), 448.0);
        assert_eq!(round_fp8_e4m3(0.0), 0.0);
    }
}
