//! The engine's public face: [`Engine::load`] validates the TP degree and the faults against the
//! model, then has every rank load its own shards; [`Engine::prefill`], [`Engine::decode`] and
//! [`Engine::generate`] drive the ranks.
//!
//! A step runs bulk-synchronously, as TP engines do: the ranks run each phase (concurrently, one
//! rayon task per rank, on the CPU; in rank order on the driver thread where a device backend
//! only enqueues work), then the driver all-reduces their partial sums with a fixed-order sum
//! (rank 0 + rank 1 + ...; deterministic; at TP 1 the partial is the sum), and hands every rank
//! the result for its residual replica. Activations are backend buffers ([`Buf`]): on a device
//! backend they stay there, and only wanted taps and the logits are downloaded. Phases per step:
//! vocab-parallel embedding (+ all-reduce); per layer, attention up to o_proj (+ all-reduce) and
//! FFN/MoE (+ all-reduce); then output_norm and the lm_head slice (+ gather).
//!
//! One layer loop runs every family the engine takes (llama, deepseek2, qwen2/3, qwen3moe,
//! glm4moe, gemma2/3); the families differ only in what their shards hold
//! ([`crate::weights::GqaExtras`]: q/k/v biases, per-head q/k norms, gemma's post-norms, applied
//! to the reduced sum before the residual add) and in the config the ops read (RoPE pair style,
//! partial rotary, attention scale, sliding window, soft-caps, GELU-tanh, the embedding scale).
//!
//! Precision: at [`ComputeDtype::F32`] (the default) the backend runs as it is; at bf16 or f16 it
//! is wrapped in [`crate::precision::DtypeBackend`], which rounds every op's output to the dtype,
//! and the loader rounds float weights (the rules are in [`crate::precision`]).
//!
//! Decode graphs: where the backend has them (CUDA), a plain decode step (no tap, no fault, no MoE
//! or MLA) after another plain one is recorded once, embedding, layers and head, and replayed for
//! the next tokens, which the replay sets on the device with the position; logits are bitwise those
//! of the op-by-op step. Any other step drops the recording.

use crate::backend::{as_rank, Backend, BackendKind, BlockTrace, Buf, CommStats, CpuBackend, StepGraph};
use crate::fault::{Fault, FaultSet, FaultSpec};
use crate::options::{ComputeDtype, CudaOptions};
use crate::rank::{NormAt, PhaseOut, Rank, StepCtx};
use crate::taps::{flush, gather_columns, TapPlan};
use crate::weights::{Loader, WeightStorage};
use crate::EngineError;
use rayon::prelude::*;
use references::tap::{NoTap, Site, Tap, TapKey, WeightKind};
use references::{GgmlType, GgufFile, ModelConfig};

/// How to build an engine.
#[derive(Clone, Debug)]
pub struct EngineOptions {
    /// Tensor-parallel degree (number of ranks).
    pub tp: usize,
    /// Faults to inject.
    pub faults: Vec<FaultSpec>,
    pub backend: BackendKind,
    /// Quantized shards decoded in the matmul, or f32 shards.
    pub storage: WeightStorage,
    /// The CUDA backend's settings (ignored on the CPU).
    pub cuda: CudaOptions,
    /// The precision the engine computes in: f32 (the default), or bf16/f16 as production
    /// engines do (float weights and every op's output rounded to it, f32 accumulation; see
    /// [`crate::precision`]).
    pub compute_dtype: ComputeDtype,
    /// Run only the first N layers, then the output norm and head (a truncated model, as
    /// vLLM's `--hf-overrides '{"num_hidden_layers": N}'` runs one); None: every layer.
    pub n_layers: Option<usize>,
    /// Run only layers A..B (Rust range: A included, B not), from a residual handed to
    /// [`Engine::prefill_from`] (the input of layer A). The layers outside the range are neither
    /// read nor dequantized nor uploaded. The output norm and head run only when B is the model's
    /// last layer; otherwise a step's result is the residual after layer B-1 (`[n, d]`). Decode
    /// is refused (the K/V cache of the range would need the prefill from A). Not with `n_layers`.
    pub layers: Option<std::ops::Range<usize>>,
    /// The DSA indexer (glm-dsa, deepseek32) stores its q and key cache in fp8 e4m3 (groups of
    /// 128 with a per-group scale), as vLLM's does; false: f32 (or the compute dtype).
    pub indexer_fp8: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            tp: 1,
            faults: Vec::new(),
            backend: BackendKind::Cpu,
            storage: WeightStorage::default(),
            cuda: CudaOptions::default(),
            compute_dtype: ComputeDtype::F32,
            n_layers: None,
            layers: None,
            indexer_fp8: false,
        }
    }
}

/// A loaded, sharded model with its KV cache.
pub struct Engine {
    config: ModelConfig,
    tp: usize,
    faults: FaultSet,
    compute_dtype: ComputeDtype,
    backend: Box<dyn Backend>,
    ranks: Vec<Rank>,
    n_past: usize,
    /// Record and replay plain decode steps as graphs where the backend can ([`CudaOptions::graphs`]
    /// or [`Engine::set_decode_graphs`] turns it off).
    decode_graphs: bool,
    /// The last step was a plain decode step (its buffers are in the backend's pool, so the next
    /// one allocates nothing and can be recorded).
    graph_warm: bool,
    /// The recorded decode step, with the logits buffers it writes.
    graph: Option<DecodeGraph>,
    /// The first layer run (0 unless [`EngineOptions::layers`] starts later): a step then starts
    /// from a residual, not the embeddings.
    first_layer: usize,
    /// Whether a step ends with the output norm and head (false: a range ending before the last
    /// layer, whose result is the residual).
    head: bool,
    /// [`EngineOptions::indexer_fp8`].
    indexer_fp8: bool,
}

/// A recorded decode step (layers and head; the embedding runs before it) and the ranks' logits
/// slices it writes.
struct DecodeGraph {
    graph: Box<dyn StepGraph>,
    logits: Vec<Buf>,
}

/// The divisibility constraints a TP degree must meet, as (what, count) pairs.
fn tp_constraints(c: &ModelConfig) -> Vec<(&'static str, usize)> {
    let mut v = vec![("attention heads", c.n_heads)];
    if c.mla.is_none() {
        v.push(("KV heads", c.n_kv_heads));
    }
    let has_dense = c.moe.as_ref().is_none_or(|m| m.n_dense_lead > 0);
    if has_dense {
        v.push(("FFN hidden size", c.ffn_dim));
    }
    if let Some(m) = &c.moe {
        v.push(("expert FFN size", m.expert_ffn));
        if m.n_shared > 0 {
            v.push(("shared-expert FFN size", m.expert_ffn * m.n_shared));
        }
    }
    v
}

/// The TP degrees (up to 64) that divide every constraint.
pub fn valid_tp_degrees(c: &ModelConfig) -> Vec<usize> {
    let cons = tp_constraints(c);
    (1..=64).filter(|tp| cons.iter().all(|(_, n)| n % tp == 0)).collect()
}

fn check_tp(c: &ModelConfig, tp: usize) -> Result<(), EngineError> {
    if tp == 0 {
        return Err(EngineError::TpDegree {
            tp,
            msg: "must be at least 1".into(),
        });
    }
    let broken: Vec<String> = tp_constraints(c)
        .into_iter()
        .filter(|(_, n)| n % tp != 0)
        .map(|(what, n)| format!("the {n} {what}"))
        .collect();
    if !broken.is_empty() {
        let valid: Vec<String> = valid_tp_degrees(c).iter().map(|t| t.to_string()).collect();
        return Err(EngineError::TpDegree {
            tp,
            msg: format!(
                "does not divide {} (each rank must hold whole heads and equal slices); valid TP degrees for this model: {}",
                broken.join(" and "),
                valid.join(", ")
            ),
        });
    }
    Ok(())
}

/// Refuses the architectures the TP engine does not run yet (gpt-oss: it is in the reference
/// only), naming what works instead.
fn check_arch(c: &ModelConfig) -> Result<(), EngineError> {
    use references::config::Arch;
    if matches!(
        c.arch,
        Arch::Llama
            | Arch::Deepseek2
            | Arch::Qwen2
            | Arch::Qwen3
            | Arch::Qwen3Moe
            | Arch::Glm4Moe
            | Arch::Gemma2
            | Arch::Gemma3
            | Arch::Deepseek32
            | Arch::GlmDsa
    ) {
        return Ok(());
    }
    Err(EngineError::Unsupported(format!(
        "the TP engine does not run {} yet; what works: `diff-layers --backend reference`, `diff-layers --candidate DUMP` (your engine's dump), `entropy --server URL`",
        c.arch.name()
    )))
}

/// YaRN RoPE runs where the engine can express it: in the MLA families, whose YaRN is a per-pair
/// frequency divisor (`RankShard::rope_freqs`, from `YarnConfig::inv_freq`) with the softmax
/// scale's mscale and no factor on cos/sin. Elsewhere (or with an explicit cos/sin factor) it is
/// refused rather than computed as another model.
fn check_yarn(c: &ModelConfig) -> Result<(), EngineError> {
    match &c.yarn {
        Some(y) if y.factor != 1.0 && (c.mla.is_none() || y.attention_factor(true) != 1.0) => {
            Err(EngineError::Unsupported(format!(
                "the TP engine implements YaRN rope scaling (factor {}) for the MLA families without a cos/sin factor only; what works: `diff-layers --backend reference`, `diff-layers --candidate DUMP` (your engine's dump), `entropy --server URL`",
                y.factor
            )))
        }
        _ => Ok(()),
    }
}

/// Refuses configs whose dims would make a kernel divide by zero or index nothing.
fn check_shapes(c: &ModelConfig) -> Result<(), EngineError> {
    let mut zero = vec![("embedding_length", c.d_model), ("vocab", c.vocab)];
    match &c.mla {
        None => zero.push(("head dim (embedding_length / head_count)", c.head_dim)),
        Some(m) => zero.extend([
            ("kv_lora_rank", m.kv_lora_rank),
            ("key_length_mla", m.qk_nope + m.qk_rope),
            ("value_length_mla", m.v_head_dim),
        ]),
    }
    if let Some(m) = &c.moe {
        zero.extend([
            ("expert_count", m.n_experts),
            ("expert_feed_forward_length", m.expert_ffn),
        ]);
    }
    match zero.into_iter().find(|(_, v)| *v == 0) {
        Some((what, _)) => Err(EngineError::Unsupported(format!("{what} is 0"))),
        None => Ok(()),
    }
}

/// Refuses a fault that would not change anything on this model and TP degree.
fn check_fault(
    spec: &FaultSpec,
    file: &GgufFile,
    c: &ModelConfig,
    tp: usize,
    dtype: ComputeDtype,
) -> Result<(), EngineError> {
    let refuse = |msg: String| {
        Err(EngineError::FaultNotApplicable {
            spec: spec.to_string(),
            msg,
        })
    };
    if let Some(layer_idx) = spec.layer {
        if layer_idx as usize >= c.n_layers {
            return refuse(format!(
                "layer {layer_idx} does not exist (the model has {} layers)",
                c.n_layers
            ));
        }
    }
    if let Some(r) = spec.rank {
        if r as usize >= tp {
            return refuse(format!("rank {r} does not exist at TP {tp}"));
        }
    }
    let layers: Vec<usize> = match spec.layer {
        Some(layer_idx) => vec![layer_idx as usize],
        None => (0..c.n_layers).collect(),
    };
    match spec.fault {
        Fault::KvBUnsharded | Fault::KvBShardSwap | Fault::KBUntransposed if c.mla.is_none() => refuse(format!(
            "needs an MLA model (deepseek2) with kv_b; this is {}",
            c.arch.name()
        )),
        Fault::KvBUnsharded | Fault::KvBShardSwap | Fault::AllreduceSkip if tp < 2 => {
            refuse("needs TP ≥ 2 (at TP 1 the shard is the whole tensor and nothing is reduced)".into())
        }
        Fault::F16Residual if dtype == ComputeDtype::F16 => {
            refuse("the engine computes in f16: its residual stream is stored in f16 already".into())
        }
        Fault::MoeGateRounded if !layers.iter().any(|&layer_idx| c.is_moe_layer(layer_idx)) => {
            refuse("needs an MoE layer in its scope".into())
        }
        f if f.is_indexer() => check_indexer_fault(spec, file, c, &layers).map_or(Ok(()), refuse),
        Fault::DequantQ4kScaleMin => {
            let in_scope = |name: &str| match spec.layer {
                Some(layer_idx) => name.starts_with(&format!("blk.{layer_idx}.")),
                None => true,
            };
            if file
                .tensors()
                .iter()
                .any(|t| t.ty == GgmlType::Q4K && in_scope(&t.name))
            {
                Ok(())
            } else {
                refuse("no Q4_K tensor in its scope".into())
            }
        }
        _ => Ok(()),
    }
}

/// Why a DSA indexer fault does not apply to `layers` (its scope) of this model, or `None` when
/// it does: the model must have an indexer, a layer in scope its own (not a `shared` layer), and
/// the fault's weight a type it acts on (a Q8_0 `indexer.proj`, an F16/BF16 indexer weight) or
/// another indexer layer to be confused with.
fn check_indexer_fault(spec: &FaultSpec, file: &GgufFile, c: &ModelConfig, layers: &[usize]) -> Option<String> {
    let Some(ix) = &c.indexer else {
        return Some(format!(
            "needs a DSA model (glm-dsa, deepseek32) with an indexer; this is {}",
            c.arch.name()
        ));
    };
    let own: Vec<usize> = layers
        .iter()
        .copied()
        .filter(|&l| ix.full.get(l).copied().unwrap_or(true))
        .collect();
    if own.is_empty() {
        return Some(format!(
            "layer {} is a `shared` indexer layer: it has no indexer of its own (it reuses the previous full layer's selection)",
            layers.first().copied().unwrap_or(0)
        ));
    }
    let ty = |l: usize, w: &str| file.tensor(&format!("blk.{l}.indexer.{w}.weight")).map(|t| t.ty);
    let typed = |w: &str, ok: &[GgmlType], what: &str| {
        if own.iter().any(|&l| ty(l, w).is_some_and(|t| ok.contains(&t))) {
            return None;
        }
        let found = ty(own[0], w).map_or("missing", |t| t.name());
        Some(format!(
            "blk.{}.indexer.{w}.weight is {found}, not {what}: the fault has nothing to act on",
            own[0]
        ))
    };
    match spec.fault {
        Fault::IndexerRawQuant => typed("proj", &[GgmlType::Q8_0], "Q8_0 (the raw-blocks path supports Q8_0)"),
        Fault::IndexerWrongDtype if own.iter().all(|&l| crate::weights::indexer_float_weight(file, l).is_none()) => {
            Some(format!(
                "no indexer weight of layer {} (attn_k, proj, attn_q_b) is F16 or BF16: nothing to read as the other 16-bit float",
                own[0]
            ))
        }
        Fault::IndexerTopkDrift if ix.top_k < 2 => {
            Some(format!("the indexer's top_k is {}: half of it keeps nothing", ix.top_k))
        }
        Fault::IndexerWrongLayer if own.iter().all(|&l| crate::weights::indexer_stand_in(c, l).is_none()) => {
            Some("the model has one indexer layer: no other layer's indexer to load instead".into())
        }
        _ => None,
    }
}

/// Refuses the faults of `opts` that do not apply to `file` (what [`Engine::load`] checks before
/// it reads a weight), without loading anything: a caller can say so before other work starts.
pub fn check_faults(file: &GgufFile, opts: &EngineOptions) -> Result<(), EngineError> {
    let mut config = ModelConfig::from_header(&file.header)?;
    // The layers the engine would run (Engine::load refuses bad counts and ranges itself).
    let n = match (&opts.n_layers, &opts.layers) {
        (Some(n), _) => *n,
        (None, Some(r)) => r.end,
        (None, None) => config.n_layers,
    };
    if (1..=config.n_layers).contains(&n) {
        config.n_layers = n;
    }
    for spec in &opts.faults {
        check_fault(spec, file, &config, opts.tp, opts.compute_dtype)?;
    }
    Ok(())
}

impl Engine {
    /// Loads `file` sharded over `opts.tp` ranks, with `opts.faults` injected.
    pub fn load(file: &GgufFile, opts: EngineOptions) -> Result<Engine, EngineError> {
        let mut config = ModelConfig::from_header(&file.header)?;
        if let Some(n) = opts.n_layers {
            if n == 0 || n > config.n_layers {
                return Err(EngineError::Options(format!(
                    "n_layers {n}: the model has {} layers (1..={0} allowed)",
                    config.n_layers
                )));
            }
            config.n_layers = n;
        }
        let (first_layer, head) = match &opts.layers {
            None => (0, true),
            Some(r) => {
                let total = config.n_layers;
                if opts.n_layers.is_some() || r.start >= r.end || r.end > total {
                    return Err(EngineError::Options(format!(
                        "layers {}..{}: the model has {total} layers (A < B <= {total} allowed, not with n_layers)",
                        r.start, r.end
                    )));
                }
                let shared_start = config.indexer.as_ref().is_some_and(|ix| !ix.full[r.start]);
                if shared_start {
                    return Err(EngineError::Options(format!(
                        "layers {}..{}: layer {} is a `shared` DSA indexer layer (it reuses an earlier layer's selection); start the range at a layer with its own indexer",
                        r.start, r.end, r.start
                    )));
                }
                config.n_layers = r.end;
                (r.start, r.end == total)
            }
        };
        check_arch(&config)?;
        check_yarn(&config)?;
        check_shapes(&config)?;
        let mut backend: Box<dyn Backend> = match opts.backend {
            BackendKind::Cpu => Box::new(CpuBackend),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                // Compile the kernels of the model's weight types up front.
                let mut cuda = opts.cuda.clone();
                cuda.weight_types.get_or_insert_with(|| {
                    let types: std::collections::BTreeSet<_> = file.tensors().iter().map(|t| t.ty).collect();
                    types.into_iter().collect()
                });
                crate::cuda::backend_for(opts.tp, &cuda)?
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => {
                return Err(EngineError::Cuda(
                    "this build has no cuda backend: rebuild with --features cuda".into(),
                ))
            }
        };
        if opts.compute_dtype != ComputeDtype::F32 {
            // Every op's outputs rounded to the dtype; at f32 the backend runs as it is.
            backend = Box::new(crate::precision::DtypeBackend::new(backend, opts.compute_dtype));
        }
        check_tp(&config, opts.tp)?;
        for spec in &opts.faults {
            check_fault(spec, file, &config, opts.tp, opts.compute_dtype)?;
        }
        let faults = FaultSet::new(opts.faults);
        let loader = Loader::new(file, &config, &faults, opts.tp, opts.storage)
            .compute_dtype(opts.compute_dtype)
            .first_layer(first_layer);
        let shards = (0..opts.tp)
            .into_par_iter()
            .map(|r| loader.load_rank(r))
            .collect::<Result<Vec<_>, _>>()?;
        // The shards hold copies: the file's pages the loader read are dropped from this process
        // (they stay in the page cache), so a run's peak memory is not the model twice over.
        file.tensors().iter().for_each(|t| file.release(t));
        let ranks = shards.into_iter().map(|s| Rank::new(s, config.n_layers)).collect();
        Ok(Engine {
            tp: opts.tp,
            faults,
            compute_dtype: opts.compute_dtype,
            backend,
            ranks,
            n_past: 0,
            decode_graphs: opts.cuda.graphs_on(),
            graph_warm: false,
            graph: None,
            first_layer,
            head,
            indexer_fp8: opts.indexer_fp8,
            config,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The hyper-parameters layer `layer_idx` runs with on rank `rank_idx`, faults included:
    /// what a production engine logs at start-up, for comparison with the file's.
    pub fn effective_config(&self, layer_idx: usize, rank_idx: usize) -> ModelConfig {
        let mut h = crate::rank::Hyper::from_config(&self.config);
        if self
            .faults
            .active(crate::fault::Fault::ConfigDrift, layer_idx, rank_idx)
        {
            h = h.drifted();
        }
        let mut c = self.config.clone();
        c.rms_eps = h.rms_eps;
        c.rope_base = h.rope_base;
        if let Some(m) = c.moe.as_mut() {
            m.weights_scale = h.expert_scale;
        }
        if let Some(ix) = c.indexer.as_mut() {
            (ix.top_k, ix.rope_neox) = crate::rank::indexer_hyper(ix, &self.faults, layer_idx, rank_idx);
        }
        c
    }

    pub fn tp(&self) -> usize {
        self.tp
    }

    /// The precision the engine computes in.
    pub fn compute_dtype(&self) -> ComputeDtype {
        self.compute_dtype
    }

    pub fn faults(&self) -> &[FaultSpec] {
        self.faults.specs()
    }

    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// How the ranks are placed, in one line (e.g. "cuda-nccl: 2 ranks on 2 GPUs, ...").
    pub fn backend_description(&self) -> String {
        self.backend.describe()
    }

    /// All-reduce time since the last [`Engine::reset_comm_stats`], where the backend keeps it.
    pub fn comm_stats(&self) -> Option<CommStats> {
        self.backend.comm_stats()
    }

    /// Empties the kernel trace; false where the backend keeps none (see
    /// [`EngineOptions::kernel_trace`]).
    pub fn kernel_trace_reset(&self) -> bool {
        self.backend.kernel_trace_reset()
    }

    /// The kernel blocks traced since [`Engine::kernel_trace_reset`], and how many had no room.
    pub fn kernel_trace_take(&self) -> Option<(Vec<BlockTrace>, usize)> {
        self.backend.kernel_trace_take()
    }

    pub fn reset_comm_stats(&self) {
        self.backend.reset_comm_stats()
    }

    /// Tokens in the KV cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Empties the KV cache.
    pub fn reset(&mut self) {
        self.graph = None;
        self.graph_warm = false;
        for r in &mut self.ranks {
            r.reset();
        }
        self.n_past = 0;
    }

    /// Turns decode graphs on or off (on by default where the backend has them): a decode step
    /// with no tap, no fault and a dense attention-and-FFN model is recorded once (layers and
    /// head) and replayed for the next tokens, one launch instead of one per op.
    pub fn set_decode_graphs(&mut self, on: bool) {
        self.decode_graphs = on;
        self.graph = None;
        self.graph_warm = false;
    }

    /// Resets the cache and runs `tokens` at positions 0..n. Returns logits `[n, vocab]`, or
    /// the residual `[n, d]` after the last layer run where the engine has no head (a layer range
    /// ending before the model's last layer).
    pub fn prefill(&mut self, tokens: &[u32], tap: &mut dyn Tap) -> Result<Vec<f32>, EngineError> {
        self.reset();
        let mut logits = Vec::new();
        self.step(tokens, None, tap, false, false, &mut logits)?;
        Ok(logits)
    }

    /// [`Engine::prefill`] of an engine running a layer range A..B ([`EngineOptions::layers`]):
    /// `residual` `[n, d]` is the input of layer A (the residual after layer A-1), `tokens` give
    /// the positions and the count. Returns what `prefill` returns.
    pub fn prefill_from(
        &mut self,
        tokens: &[u32],
        residual: &[f32],
        tap: &mut dyn Tap,
    ) -> Result<Vec<f32>, EngineError> {
        if residual.len() != tokens.len() * self.config.d_model {
            return Err(EngineError::Options(format!(
                "the residual at layer {} has {} values, not {} tokens × d_model {}",
                self.first_layer,
                residual.len(),
                tokens.len(),
                self.config.d_model
            )));
        }
        self.reset();
        let mut logits = Vec::new();
        self.step(tokens, Some(residual), tap, false, false, &mut logits)?;
        Ok(logits)
    }

    /// `prefill` for generation: only the last token's logits `[vocab]` (lm_head on one row,
    /// one row brought back), as llama.cpp's prompt processing returns by default. No taps.
    pub fn prefill_last(&mut self, tokens: &[u32]) -> Result<Vec<f32>, EngineError> {
        self.reset();
        let mut logits = Vec::new();
        self.step(tokens, None, &mut NoTap, false, true, &mut logits)?;
        Ok(logits)
    }

    /// Runs one token at the next position over the KV cache. Returns logits `[vocab]`.
    pub fn decode(&mut self, token: u32, tap: &mut dyn Tap) -> Result<Vec<f32>, EngineError> {
        let mut logits = Vec::new();
        self.decode_into(token, tap, &mut logits)?;
        Ok(logits)
    }

    /// [`Engine::decode`] into `logits` (replaced), so a loop can reuse one buffer: a fresh
    /// vocab-sized one each step costs page faults (and its free a heap trim), ~10-20 µs a step
    /// beside a 0.6-2 ms GPU decode step.
    pub fn decode_into(&mut self, token: u32, tap: &mut dyn Tap, logits: &mut Vec<f32>) -> Result<(), EngineError> {
        if self.n_past == 0 {
            return Err(EngineError::DecodeWithoutPrefill);
        }
        if self.first_layer > 0 || !self.head {
            return Err(EngineError::Options(
                "decode with a layer range is not supported: the K/V cache of the range would need the prefill from its first layer; diff the prefill".into(),
            ));
        }
        self.step(&[token], None, tap, true, false, logits)
    }

    /// Greedy generation: prefill `prompt`, then decode up to `max_new` tokens, stopping after
    /// emitting `stop`. Returns the new tokens (the stop token included when reached).
    pub fn generate(&mut self, prompt: &[u32], max_new: usize, stop: Option<u32>) -> Result<Vec<u32>, EngineError> {
        let mut out = Vec::new();
        if max_new == 0 {
            return Ok(out);
        }
        let mut logits = self.prefill_last(prompt)?;
        let mut next = argmax(&logits);
        loop {
            out.push(next);
            if Some(next) == stop || out.len() == max_new {
                return Ok(out);
            }
            self.decode_into(next, &mut NoTap, &mut logits)?;
            next = argmax(&logits);
        }
    }

    fn step(
        &mut self,
        tokens: &[u32],
        residual: Option<&[f32]>,
        tap: &mut dyn Tap,
        is_decode: bool,
        last_only: bool,
        logits: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let c = &self.config;
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        if residual.is_some() != (self.first_layer > 0) {
            return Err(EngineError::Options(format!(
                "this engine starts at layer {}: a step needs {}",
                self.first_layer,
                if self.first_layer > 0 {
                    "the residual there (prefill_from)"
                } else {
                    "tokens, not a residual"
                }
            )));
        }
        if let Some((pos, &id)) = tokens.iter().enumerate().find(|(_, &t)| t as usize >= c.vocab) {
            return Err(EngineError::TokenOutOfRange {
                id,
                pos: self.n_past + pos,
                vocab: c.vocab,
            });
        }
        if self.n_past + tokens.len() > c.context_length {
            return Err(EngineError::ContextFull {
                n_past: self.n_past,
                n_new: tokens.len(),
                n_ctx: c.context_length,
            });
        }
        let plan = TapPlan::build(tap, c.n_layers, self.tp);
        let ctx = StepCtx {
            backend: self.backend.as_ref(),
            config: c,
            faults: &self.faults,
            plan: &plan,
            tp: self.tp,
            pos0: self.n_past,
            n_tokens: tokens.len(),
            is_decode,
            last_only,
            indexer_fp8: self.indexer_fp8,
        };
        let (n, d) = (tokens.len(), c.d_model);
        // A plain decode step: nothing tapped, no fault, no host round trip mid-step (MoE
        // routing) and no attention without a device-position form (MLA, gemma's masked
        // attention): llama, qwen2 and qwen3.
        use references::config::Arch;
        let graphable = self.decode_graphs
            && is_decode
            && self.head
            && residual.is_none()
            && plan.is_empty()
            && self.faults.specs().is_empty()
            && matches!(c.arch, Arch::Llama | Arch::Qwen2 | Arch::Qwen3);
        if !graphable {
            self.graph = None;
        }

        let be = self.backend.as_ref();
        let parallel = be.parallel_ranks();
        if graphable {
            let pos0 = self.n_past;
            match self.graph.as_ref().filter(|g| g.graph.fits(pos0)) {
                Some(g) => {
                    g.graph.replay(pos0, tokens[0]);
                    download_logits(be, &g.logits, n, logits);
                    for r in &mut self.ranks {
                        r.cache_appended(pos0, n);
                    }
                    self.n_past += n;
                    return Ok(());
                }
                None => self.graph = None,
            }
        }
        // Recorded only when the caches need not grow (growing allocates); the next step then.
        let recording = graphable
            && self.graph_warm
            && self.ranks.iter().all(|r| r.cache_fits(self.n_past, n))
            && be.graph_begin(self.n_past, tokens[0]);
        self.graph_warm = graphable;

        if let Some(res) = residual {
            // A layer range: every rank's replica of the residual is the given input of its
            // first layer (no embedding).
            for r in &mut self.ranks {
                as_rank(r.idx, || {
                    r.normed = None;
                    r.x = be.upload(res);
                });
            }
        } else {
            // Vocab-parallel embedding (recorded with the step), then all-reduce.
            let outs: Vec<PhaseOut> = per_rank(parallel, &mut self.ranks, |r| r.embed(&ctx, tokens));
            let (partials, taps): (Vec<_>, Vec<_>) = outs.into_iter().map(|o| (o.data, o.taps)).unzip();
            flush(tap, taps);
            let sums = all_reduce_bufs(be, &partials);
            for r in &mut self.ranks {
                let idx = r.idx;
                as_rank(idx, || {
                    let x = sum_for(&sums, &partials, idx);
                    if idx == 0 {
                        record_if(be, tap, &plan, TapKey::global(Site::Embed), x, d);
                    }
                    // A new step: no normed input is left from an unfinished one.
                    r.normed = None;
                    // In place when the size allows: a recorded decode step keeps reading r.x there.
                    if r.x.len() == x.len() {
                        be.copy(x, 0, &mut r.x, 0, x.len());
                    } else {
                        r.x = be.dup(x);
                    }
                });
            }
        }

        for layer_idx in self.first_layer..c.n_layers {
            if !recording && tap.stopped() {
                // The tap's owner has its answer (diff-layers --stop-at-first): the step ends
                // here, its logits unwritten and the caches not advanced.
                return Ok(());
            }
            self.weight_taps(tap, &plan, layer_idx);
            for (phase_site, resid_site) in [(Site::AttnProj, Site::ResidAttn), (Site::FfnOut, Site::ResidOut)] {
                let outs: Vec<PhaseOut> = per_rank(parallel, &mut self.ranks, |r| match phase_site {
                    Site::AttnProj => r.attn_block(&ctx, layer_idx),
                    _ => r.ffn_block(&ctx, layer_idx),
                });
                let (partials, taps): (Vec<_>, Vec<_>) = outs.into_iter().map(|o| (o.data, o.taps)).unzip();
                flush(tap, taps);
                let sums = all_reduce_bufs(be, &partials);
                for (rank_idx, r) in self.ranks.iter_mut().enumerate() {
                    as_rank(rank_idx, || {
                        let skip = self.faults.active(Fault::AllreduceSkip, layer_idx, rank_idx);
                        let reduced = if skip {
                            &partials[rank_idx]
                        } else {
                            sum_for(&sums, &partials, rank_idx)
                        };
                        // Gemma's post-norm of the block's output, on the reduced sum (replicated).
                        let post = r.shard.layers[layer_idx].extras.post_norms.as_ref().map(|[a, f]| {
                            if phase_site == Site::AttnProj {
                                a.clone()
                            } else {
                                f.clone()
                            }
                        });
                        let post_normed;
                        let reduced = match post {
                            Some(w) => {
                                let mut o = be.alloc(reduced.len());
                                be.rms_norm(reduced, &w, ctx.hyper(layer_idx, rank_idx).rms_eps, &mut o);
                                post_normed = o;
                                &post_normed
                            }
                            None => reduced,
                        };
                        if rank_idx == 0 {
                            record_if(be, tap, &plan, TapKey::layer(layer_idx, phase_site), reduced, d);
                        }
                        let f16_resid = self.faults.active(Fault::F16Residual, layer_idx, rank_idx);
                        // The add and the next block's input norm in one op.
                        let next = NormAt::after(layer_idx, phase_site, c.n_layers);
                        r.add_residual(&ctx, reduced, f16_resid, next);
                        record_if(be, tap, &plan, TapKey::ranked(layer_idx, resid_site, rank_idx), &r.x, d);
                        if rank_idx == 0 {
                            record_if(be, tap, &plan, TapKey::layer(layer_idx, resid_site), &r.x, d);
                        }
                    });
                }
            }
        }

        if !self.head {
            // A range ending before the last layer: the residual is the result.
            *logits = as_rank(0, || be.download(&self.ranks[0].x));
            self.n_past += n;
            return Ok(());
        }
        // output_norm and the vocab-parallel lm_head, then gather (on the host: the logits are
        // the step's result).
        let outs: Vec<PhaseOut> = per_rank(parallel, &mut self.ranks, |r| r.head(&ctx));
        let (slices, taps): (Vec<_>, Vec<_>) = outs.into_iter().map(|o| (o.data, o.taps)).unzip();
        flush(tap, taps);
        let graph = if recording { be.graph_end() } else { None };
        download_logits(be, &slices, if last_only { 1 } else { n }, logits);
        if let Some(graph) = graph {
            self.graph = Some(DecodeGraph { graph, logits: slices });
        }
        // The gathered `logits` tap was recorded by `flush` if wanted.
        self.n_past += n;
        Ok(())
    }

    fn weight_taps(&self, tap: &mut dyn Tap, plan: &TapPlan, layer_idx: usize) {
        if plan.is_empty() {
            return;
        }
        for r in &self.ranks {
            for (kind, w) in r.shard.layers[layer_idx].tappable() {
                let key = TapKey::ranked(layer_idx, Site::Weight(kind), r.idx);
                // Asked of the tap too, just before the weight is decoded: a tap that times its
                // capture then sees the decode.
                if plan.wants(&key) && tap.wants(&key) {
                    // The rows the tap asks for only (the CUDA backend's weights are tapped from
                    // this host copy too: no device copy-back).
                    references::tap::record_weight(tap, &key, [w.rows, w.cols], |rows| match rows {
                        Some(rows) => w.rows_to_f32(rows),
                        None => w.to_f32(),
                    });
                }
            }
        }
    }

    /// Rank `rank_idx`'s weight `kind` of layer `layer_idx` whole, as its weight tap shows it
    /// (`[rows, cols]`), or `None` where the layer or rank has none: what a diagnosis reads after
    /// a weight compared on a sample of rows diverged.
    pub fn weight_f32(&self, layer_idx: usize, kind: WeightKind, rank_idx: usize) -> Option<(Vec<f32>, [usize; 2])> {
        let layer = self.ranks.get(rank_idx)?.shard.layers.get(layer_idx)?;
        let (_, w) = layer.tappable().into_iter().find(|(k, _)| *k == kind)?;
        Some((w.to_f32(), [w.rows, w.cols]))
    }
}

/// The ranks' logits slices, downloaded and gathered into `out` (`[n, vocab]`).
fn download_logits(be: &dyn Backend, slices: &[Buf], n: usize, out: &mut Vec<f32>) {
    if let [only] = slices {
        // One rank: its slice is the whole `[n, vocab]` already.
        return as_rank(0, || be.download_into(only, out));
    }
    let slices: Vec<Vec<f32>> = slices
        .iter()
        .enumerate()
        .map(|(rank_idx, s)| as_rank(rank_idx, || be.download(s)))
        .collect();
    let refs: Vec<&[f32]> = slices.iter().map(|s| s.as_slice()).collect();
    *out = gather_columns(&refs, n).0;
}

/// Runs `f` for every rank (as that rank, see [`as_rank`]): one rayon task per rank when
/// `parallel`, else in rank order on this thread.
fn per_rank<'p, F>(parallel: bool, ranks: &mut [Rank], f: F) -> Vec<PhaseOut<'p>>
where
    F: Fn(&mut Rank) -> PhaseOut<'p> + Sync + Send,
{
    if parallel {
        ranks.par_iter_mut().map(|r| as_rank(r.idx, || f(r))).collect()
    } else {
        ranks.iter_mut().map(|r| as_rank(r.idx, || f(r))).collect()
    }
}

/// The backend's all-reduce over the ranks' partial buffers; `None` at TP 1, where the one
/// partial is the sum (the caller reads it in place).
fn all_reduce_bufs(be: &dyn Backend, partials: &[Buf]) -> Option<Vec<Buf>> {
    if partials.len() == 1 {
        return None;
    }
    let refs: Vec<&Buf> = partials.iter().collect();
    Some(be.all_reduce(&refs))
}

/// Rank `rank_idx`'s view of the reduced sum.
fn sum_for<'a>(sums: &'a Option<Vec<Buf>>, partials: &'a [Buf], rank_idx: usize) -> &'a Buf {
    match sums {
        Some(s) => &s[rank_idx.min(s.len() - 1)],
        None => &partials[0],
    }
}

/// Records `data` under `key` if it is wanted (downloaded only then).
fn record_if(be: &dyn Backend, tap: &mut dyn Tap, plan: &TapPlan, key: TapKey, data: &Buf, width: usize) {
    if plan.wants(&key) {
        let host = be.download(data);
        let shape = [host.len() / width.max(1), width];
        tap.record_owned(&key, host, shape);
    }
}

/// The index of the largest value (the first on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}
