//! One TP rank: its weight shards, its replica of the residual stream, its KV cache, and the
//! per-layer work it does between all-reduces (the attention block up to o_proj's partial sum,
//! the FFN or MoE block up to down's partial sum, the vocab-parallel embedding and lm_head).
//!
//! Attention and the MoE mix are custom ops in vLLM's style: the caller allocates the output
//! buffer and the op writes into it. When a tap wants an op's output, the buffer is filled with
//! the canary first, so an unwritten element shows (at a bf16/f16 compute dtype, that dtype's canary:
//! the backend's fill stores it, see [`crate::precision`]). The attention output buffers are a per-rank
//! double buffer (layer l writes buffer l mod 2), reused across layers and steps. Every tensor
//! here is a backend [`Buf`] (device memory on CUDA); taps download only what is wanted.

use crate::backend::{Backend, Buf};
use crate::cpu_ops::{GqaShape, MlaShape, QkRope, RopeFreqs, RopeLayout, RopeStyle};
use crate::dsa::{key_table, select_top_k, IndexShape};
use crate::fault::{Fault, FaultSet};
use crate::moe_route::Route;
use crate::taps::{Emit, RankTaps, TapPlan};
use crate::weights::{AttnShard, FfnShard, IndexerShard, MlpShard, MoeShard, RankShard};
use references::config::IndexerConfig;
use references::tap::{canary, Site};
use references::ModelConfig;

/// The hyper-parameters one rank uses in one layer (they differ from the file's under
/// `config-drift`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Hyper {
    pub rms_eps: f32,
    pub rope_base: f32,
    pub expert_scale: f32,
    pub rope_style: RopeStyle,
}

impl Hyper {
    /// What the file says.
    pub fn from_config(c: &ModelConfig) -> Hyper {
        Hyper {
            rms_eps: c.rms_eps,
            rope_base: c.rope_base,
            expert_scale: c.moe.as_ref().map_or(1.0, |m| m.weights_scale),
            rope_style: if c.arch.rope_neox() {
                RopeStyle::Neox
            } else {
                RopeStyle::Norm
            },
        }
    }

    /// What a loader reading the wrong keys (or falling back to defaults) would use.
    pub fn drifted(self) -> Hyper {
        Hyper {
            rms_eps: if self.rms_eps == 1e-6 { 1e-5 } else { 1e-6 },
            rope_base: if self.rope_base == 10000.0 { 500000.0 } else { 10000.0 },
            expert_scale: if self.expert_scale == 1.0 { 2.5 } else { 1.0 },
            ..self
        }
    }
}

/// Everything a rank needs to know about the step in progress.
pub struct StepCtx<'a> {
    pub backend: &'a dyn Backend,
    pub config: &'a ModelConfig,
    pub faults: &'a FaultSet,
    pub plan: &'a TapPlan,
    pub tp: usize,
    /// Position of the first new token.
    pub pos0: usize,
    pub n_tokens: usize,
    /// True for a single-token decode step after a prefill.
    pub is_decode: bool,
    /// Only the last token's logits are wanted (lm_head on one row; no taps).
    pub last_only: bool,
    /// The DSA indexer's q and key cache rounded to fp8 e4m3 (groups of 128), as production
    /// indexers store them.
    pub indexer_fp8: bool,
}

impl StepCtx<'_> {
    pub fn hyper(&self, layer_idx: usize, rank_idx: usize) -> Hyper {
        let mut h = Hyper::from_config(self.config);
        let fam = &self.config.family;
        if fam.is_swa(layer_idx) && fam.rope_base_swa > 0.0 {
            // gemma3's sliding-window layers rotate with the local base.
            h.rope_base = fam.rope_base_swa;
        }
        if self.faults.active(Fault::ConfigDrift, layer_idx, rank_idx) {
            h = h.drifted();
        }
        if self.faults.active(Fault::RopeNeox, layer_idx, rank_idx) {
            // The other pair layout than the model's: NEOX for a NORM model, NORM for a NEOX one.
            h.rope_style = match h.rope_style {
                RopeStyle::Norm => RopeStyle::Neox,
                RopeStyle::Neox => RopeStyle::Norm,
            };
        }
        h
    }
}

/// A layer's KV cache on one rank, in the backend's memory. llama: `k`, `v` `[T, KV_r·hd]` (k
/// after RoPE). MLA (expanded, after kv_b): `k` = k_nope `[T, H_r·nope]`, `k_pe` `[T, rope]`,
/// `v` `[T, H_r·v]`.
#[derive(Default)]
pub struct LayerCache {
    pub k: Buf,
    pub k_pe: Buf,
    pub v: Buf,
    /// The DSA indexer's roped (and, with `indexer_fp8`, fp8-rounded) keys `[T, D]`.
    pub idx_k: Buf,
}

impl LayerCache {
    fn bufs(&mut self) -> [&mut Buf; 4] {
        [&mut self.k, &mut self.k_pe, &mut self.v, &mut self.idx_k]
    }
}

/// Appends the rows of `new` (`[n, width]`) to `cache` at position `pos0`. Under
/// `kv-slot-off-by-one` in a decode step, the row lands one slot early (overwriting the previous
/// token's entry) and the slot of the new token stays zero.
fn cache_write(be: &dyn Backend, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, off_by_one: bool) {
    let slot0 = if off_by_one && pos0 > 0 { pos0 - 1 } else { pos0 };
    be.kv_write(cache, new, width, pos0, slot0);
}

/// Taps the first `rows` rows of a KV cache `[_, width]` (a decode step's `kv_cache_k`/`_v`):
/// only when wanted, copying that row range out of the backend's cache before the download.
fn emit_cache(be: &dyn Backend, taps: &mut RankTaps<'_>, site: Site, cache: &Buf, rows: usize, width: usize) {
    if !taps.wants_site(site) {
        return;
    }
    let len = rows * width;
    let mut part = be.alloc(len);
    be.copy(cache, 0, &mut part, 0, len);
    taps.emit_buf(be, site, &part, width, Emit::Column);
}

/// The output buffer for a custom op: sized `len` (zeros when first allocated), canary-filled
/// when a tap will look at it, otherwise holding whatever it held.
fn prepare_out(be: &dyn Backend, buf: &mut Buf, len: usize, canary_fill: bool) {
    if buf.len() != len {
        *buf = be.zeros(len);
    }
    if canary_fill {
        be.fill(buf, canary());
    }
}

pub struct Rank {
    pub idx: usize,
    pub shard: RankShard,
    pub cache: Vec<LayerCache>,
    /// This rank's replica of the residual stream `[n, d]`.
    pub x: Buf,
    /// The attention output double buffer.
    pub attn_out: [Buf; 2],
    /// The FFN/MoE output buffer (the custom op writes it; it is then handed on as the partial
    /// and a fresh one of the same size takes its place).
    pub ffn_out: Buf,
    /// The next block's normed input, made with the residual add (`add_residual`), and which
    /// block it is for; the block takes it instead of normalizing x itself.
    pub(crate) normed: Option<(NormAt, Buf)>,
    /// The DSA selection of the step's last layer with its own indexer, for the `shared`
    /// indexer layers after it.
    dsa_prev: Option<Vec<Vec<usize>>>,
}

/// Which block an input RMSNorm belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormAt {
    Attn(usize),
    Ffn(usize),
    Head,
}

impl NormAt {
    /// The block after phase `phase` (`Site::AttnProj` or `Site::FfnOut`) of layer `layer_idx`:
    /// the layer's FFN, the next layer's attention, or the head after the last layer.
    pub fn after(layer_idx: usize, phase: Site, n_layers: usize) -> NormAt {
        match phase {
            Site::AttnProj => NormAt::Ffn(layer_idx),
            _ if layer_idx + 1 < n_layers => NormAt::Attn(layer_idx + 1),
            _ => NormAt::Head,
        }
    }
}

/// The head's hyper-parameters on rank `rank_idx` (config drift applies to every layer).
fn head_hyper(ctx: &StepCtx<'_>, rank_idx: usize) -> Hyper {
    let hy = Hyper::from_config(ctx.config);
    if ctx.faults.active_global(Fault::ConfigDrift, rank_idx) {
        hy.drifted()
    } else {
        hy
    }
}

/// The RMSNorm weight and eps block `at` applies to the residual first.
fn norm_of<'s>(shard: &'s RankShard, ctx: &StepCtx<'_>, rank_idx: usize, at: NormAt) -> (&'s [f32], f32) {
    match at {
        NormAt::Attn(l) => (&shard.layers[l].attn_norm, ctx.hyper(l, rank_idx).rms_eps),
        NormAt::Ffn(l) => (&shard.layers[l].ffn_norm, ctx.hyper(l, rank_idx).rms_eps),
        NormAt::Head => (&shard.output_norm, head_hyper(ctx, rank_idx).rms_eps),
    }
}

/// A GQA layer's RoPE (every head rotating `rope_dim` from its start: all of it, or glm4moe's
/// partial rotary, with the model's frequency scaling: the linear factor and `factors`, the
/// rank's copy of `rope_freqs.weight`) and attention shape (scale, gemma's sliding window on its
/// local layers and score soft-cap) on a rank whose q and k have `q_rows` and `k_rows` rows.
fn gqa_rope_shape<'f>(
    ctx: &StepCtx<'_>,
    layer_idx: usize,
    hy: &Hyper,
    q_rows: usize,
    k_rows: usize,
    factors: Option<&'f [f32]>,
) -> (QkRope<'f>, GqaShape) {
    let c = ctx.config;
    let hd = c.head_dim;
    let (h_r, kv_r) = (q_rows / hd, k_rows / hd);
    let layout = |heads| RopeLayout {
        n_heads: heads,
        head_stride: hd,
        offset: 0,
        rope_dim: c.rope_dim,
    };
    let rope = QkRope {
        q: layout(h_r),
        k: layout(kv_r),
        pos0: ctx.pos0,
        base: hy.rope_base,
        style: hy.rope_style,
        freqs: RopeFreqs {
            divisor: c.rope_scaling.linear_factor.unwrap_or(1.0),
            factors,
        },
    };
    let fam = &c.family;
    let shape = GqaShape {
        n_heads: h_r,
        n_kv_heads: kv_r,
        head_dim: hd,
        scale: fam.attn_scale.map_or(1.0 / (hd as f32).sqrt(), |s| s as f32),
        window: fam.sliding_window.filter(|_| fam.is_swa(layer_idx)),
        softcap: fam.attn_softcap,
    };
    (rope, shape)
}

/// The DSA indexer's top_k and RoPE pair layout (NEOX halves when true) that rank `rank_idx`
/// uses in layer `layer_idx`: the file's, or under `indexer-topk-drift` half its top_k and under
/// `indexer-rope-drift` the other pair layout.
pub fn indexer_hyper(ix: &IndexerConfig, faults: &FaultSet, layer_idx: usize, rank_idx: usize) -> (usize, bool) {
    let mut top_k = ix.top_k;
    if faults.active(Fault::IndexerTopkDrift, layer_idx, rank_idx) {
        top_k = (top_k / 2).max(1);
    }
    let neox = ix.rope_neox != faults.active(Fault::IndexerRopeDrift, layer_idx, rank_idx);
    (top_k, neox)
}

/// What a layer's DSA indexer step reads: the file's indexer config, the layer's replicated
/// indexer weights (`None` on a `shared` layer), the RoPE frequency factors, and where it runs
/// (for the indexer faults).
struct DsaIn<'a> {
    ix: &'a IndexerConfig,
    shard: Option<&'a IndexerShard>,
    freqs: Option<&'a [f32]>,
    layer_idx: usize,
    rank_idx: usize,
}

impl DsaIn<'_> {
    /// The step's selection as the sparse attention's key table `[n, top_k]` on the backend, and
    /// top_k. A layer with its own indexer scores every causal key of each query from `h` (the
    /// attn_norm output) and `qr` (the normed q_a), appending the step's keys to `idx_cache`, and
    /// takes the top-k on the host; a `shared` layer reuses `prev` (the last such layer's).
    #[allow(clippy::too_many_arguments)]
    fn keys(
        &self,
        ctx: &StepCtx<'_>,
        hy: &Hyper,
        h: &Buf,
        qr: &Buf,
        idx_cache: &mut Buf,
        prev: &mut Option<Vec<Vec<usize>>>,
        taps: &mut RankTaps<'_>,
    ) -> (Buf, usize) {
        let be = ctx.backend;
        let (n, ix) = (ctx.n_tokens, self.ix);
        let (heads, dh, rope) = (ix.n_heads, ix.head_dim, ctx.config.rope_dim);
        let (top_k, rope_neox) = indexer_hyper(ix, ctx.faults, self.layer_idx, self.rank_idx);
        let sel = match self.shard {
            Some(w) => {
                let mut q = be.alloc(n * heads * dh);
                be.linear(qr, n, w.q_b.view(), &mut q);
                let mut k_raw = be.alloc(n * dh);
                be.linear(h, n, w.k.view(), &mut k_raw);
                let mut k = be.alloc(n * dh);
                be.layer_norm(&k_raw, &w.k_norm.0, &w.k_norm.1, ix.k_norm_eps, &mut k);
                let layout = |n_heads| RopeLayout {
                    n_heads,
                    head_stride: dh,
                    offset: 0,
                    rope_dim: rope,
                };
                let style = if rope_neox { RopeStyle::Neox } else { RopeStyle::Norm };
                let freqs = RopeFreqs {
                    divisor: 1.0,
                    factors: self.freqs,
                };
                be.rope_qk(
                    &mut q,
                    layout(heads),
                    &mut k,
                    layout(1),
                    ctx.pos0,
                    hy.rope_base,
                    style,
                    freqs,
                );
                if ctx.indexer_fp8 {
                    be.fp8_groups(&mut q, dh);
                    be.fp8_groups(&mut k, dh);
                }
                // `indexer-stale-cache`: a decode step scores before its own key is written (a
                // placeholder row of zeros holds the slot: the op reads pos0+n rows), then writes it.
                let stale = ctx.is_decode
                    && ctx
                        .faults
                        .active(Fault::IndexerStaleCache, self.layer_idx, self.rank_idx);
                if stale {
                    be.kv_write(idx_cache, &be.zeros(n * dh), dh, ctx.pos0, ctx.pos0);
                } else {
                    be.kv_write(idx_cache, &k, dh, ctx.pos0, ctx.pos0);
                }
                let mut w_heads = be.alloc(n * heads);
                be.linear(h, n, w.proj.view(), &mut w_heads);
                be.scale(&mut w_heads, (1.0 / ((dh * heads) as f64).sqrt()) as f32);
                let width = ctx.pos0 + n;
                let mut scores = be.alloc(n * width);
                let shape = IndexShape {
                    n_heads: heads,
                    head_dim: dh,
                };
                be.index_scores(&q, idx_cache, &w_heads, ctx.pos0, shape, &mut scores);
                if stale {
                    be.kv_write(idx_cache, &k, dh, ctx.pos0, ctx.pos0);
                }

                taps.emit_buf(be, Site::IndexerScore, &scores, width, Emit::Replicated);
                select_top_k(&be.download(&scores), n, ctx.pos0, top_k)
            }
            // Engine::new refuses a layer range that starts at a `shared` layer.
            None => prev.clone().expect("a shared indexer layer follows a full one"),
        };
        let table = be.upload(&key_table(&sel, top_k));
        taps.emit_buf(be, Site::IndexerTopk, &table, top_k, Emit::Replicated);
        *prev = Some(sel);
        (table, top_k)
    }
}

/// A rank's result from one phase: a partial sum (or slice) and its tap copies.
pub struct PhaseOut<'p> {
    pub data: Buf,
    pub taps: RankTaps<'p>,
}

impl Rank {
    pub fn new(shard: RankShard, n_layers: usize) -> Rank {
        Rank {
            idx: shard.rank_idx,
            shard,
            cache: (0..n_layers).map(|_| LayerCache::default()).collect(),
            x: Buf::default(),
            attn_out: [Buf::default(), Buf::default()],
            ffn_out: Buf::default(),
            normed: None,
            dsa_prev: None,
        }
    }

    pub fn reset(&mut self) {
        for c in &mut self.cache {
            *c = LayerCache::default();
        }
        self.x = Buf::default();
        self.normed = None;
        self.dsa_prev = None;
    }

    /// Adds a block's reduced output into the residual and makes the next block's normed input
    /// in the same op (`Backend::add_rms_norm`: one launch on CUDA, the same bits as the add then
    /// the norm); block `next` takes it.
    pub fn add_residual(&mut self, ctx: &StepCtx<'_>, reduced: &Buf, f16_round: bool, next: NormAt) {
        let be = ctx.backend;
        let mut h = be.alloc(self.x.len());
        let (w, eps) = norm_of(&self.shard, ctx, self.idx, next);
        be.add_rms_norm(&mut self.x, reduced, f16_round, w, eps, &mut h);
        self.normed = Some((next, h));
    }

    /// Block `at`'s normed input: the one `add_residual` made for it, or RMSNorm of x now.
    fn normed_input(&mut self, ctx: &StepCtx<'_>, at: NormAt) -> Buf {
        match self.normed.take() {
            Some((tag, h)) if tag == at => h,
            _ => {
                let be = ctx.backend;
                let mut h = be.alloc(self.x.len());
                let (w, eps) = norm_of(&self.shard, ctx, self.idx, at);
                be.rms_norm(&self.x, w, eps, &mut h);
                h
            }
        }
    }

    /// Records that `n` rows were appended at `pos0` to every KV cache on the device (a replayed
    /// decode graph wrote them): each cache's length goes from `pos0` rows to `pos0 + n`.
    pub fn cache_appended(&mut self, pos0: usize, n: usize) {
        for c in &mut self.cache {
            for b in c.bufs() {
                if pos0 > 0 && !b.is_empty() {
                    let width = b.len() / pos0;
                    b.set_len((pos0 + n) * width);
                }
            }
        }
    }

    /// True when every KV cache can take `n` more rows at `pos0` without growing (so a recorded
    /// step allocates nothing and its buffers stay where they are).
    pub fn cache_fits(&self, pos0: usize, n: usize) -> bool {
        self.cache.iter().all(|c| {
            [&c.k, &c.k_pe, &c.v, &c.idx_k]
                .iter()
                .all(|b| b.is_empty() || pos0 == 0 || (pos0 + n) * (b.len() / pos0) <= b.capacity())
        })
    }

    /// Vocab-parallel embedding: rows of tokens in this rank's vocab range, zeros elsewhere.
    pub fn embed<'p>(&self, ctx: &StepCtx<'p>, tokens: &[u32]) -> PhaseOut<'p> {
        let be = ctx.backend;
        let d = ctx.config.d_model;
        let mut out = be.alloc(tokens.len() * d);
        let range = &self.shard.vocab_range;
        if let [token] = tokens {
            // A decode step's: recorded with the step where the backend has graphs.
            be.embed_token(self.shard.embd.view(), *token, range.start, &mut out);
        } else {
            let rows: Vec<Option<usize>> = tokens
                .iter()
                .map(|&t| range.contains(&(t as usize)).then(|| t as usize - range.start))
                .collect();
            be.embed_rows(self.shard.embd.view(), &rows, &mut out);
        }
        if ctx.config.arch.is_gemma() {
            // Gemma scales the embeddings by √d_model (the partial sums scale with them).
            be.scale(&mut out, (d as f64).sqrt() as f32);
        }
        let mut taps = RankTaps::new(ctx.plan, self.idx, None);
        taps.emit_buf(be, Site::Embed, &out, d, Emit::Partial);
        PhaseOut { data: out, taps }
    }

    /// attn_norm → attention (custom op) → o_proj partial `[n, d]`.
    pub fn attn_block<'p>(&mut self, ctx: &StepCtx<'p>, layer_idx: usize) -> PhaseOut<'p> {
        let be = ctx.backend;
        let c = ctx.config;
        let (n, d) = (ctx.n_tokens, c.d_model);
        let hy = ctx.hyper(layer_idx, self.idx);
        let mut taps = RankTaps::new(ctx.plan, self.idx, Some(layer_idx));
        let h = self.normed_input(ctx, NormAt::Attn(layer_idx));
        let lw = &self.shard.layers[layer_idx];
        taps.emit_buf(be, Site::AttnNorm, &h, d, Emit::Replicated);
        let off_by_one = ctx.is_decode && ctx.faults.active(Fault::KvSlotOffByOne, layer_idx, self.idx);
        let cache = &mut self.cache[layer_idx];
        let phantom = ctx.faults.active(Fault::PhantomAttnOut, layer_idx, self.idx);
        let write_idx = layer_idx % 2;
        let read_idx = if ctx.faults.active(Fault::StaleAttnOut, layer_idx, self.idx) {
            (layer_idx + 1) % 2
        } else {
            write_idx
        };
        let canary_fill = taps.wants_site(Site::AttnOut);
        let out_width;
        match &lw.attn {
            AttnShard::Gqa { q, k, v } => {
                let factors = self.shard.rope_freqs.as_deref().map(Vec::as_slice);
                let (rope, shape) = gqa_rope_shape(ctx, layer_idx, &hy, q.rows, k.rows, factors);
                let mut qv = be.alloc(n * q.rows);
                let mut kv = be.alloc(n * k.rows);
                let mut vv = be.alloc(n * v.rows);
                let ws = [q.view(), k.view(), v.view()];
                let ex = &lw.extras;
                if off_by_one || ex.qkv_bias.is_some() || ex.qk_norm.is_some() {
                    // The products, then the biases and per-head norms between them and RoPE.
                    be.linear_many(&h, n, &ws, &mut [&mut qv, &mut kv, &mut vv]);
                    if let Some([qb, kb, vb]) = &ex.qkv_bias {
                        be.add_bias(&mut qv, qb);
                        be.add_bias(&mut kv, kb);
                        be.add_bias(&mut vv, vb);
                    }
                    if let Some([qn, kn]) = &ex.qk_norm {
                        for (y, w) in [(&mut qv, qn), (&mut kv, kn)] {
                            // RMSNorm over rows of head_dim: each head on its own.
                            let mut normed = be.alloc(y.len());
                            be.rms_norm(y, w, hy.rms_eps, &mut normed);
                            *y = normed;
                        }
                    }
                    if off_by_one {
                        be.rope_qk(
                            &mut qv, rope.q, &mut kv, rope.k, rope.pos0, rope.base, rope.style, rope.freqs,
                        );
                        cache_write(be, &mut cache.k, &kv, k.rows, ctx.pos0, true);
                        cache_write(be, &mut cache.v, &vv, v.rows, ctx.pos0, true);
                    } else {
                        be.rope_qk_cache(&mut qv, &mut kv, &vv, v.rows, rope, [&mut cache.k, &mut cache.v]);
                    }
                } else {
                    let outs = [&mut qv, &mut kv, &mut vv];
                    be.linear_qkv_rope(&h, n, ws, outs, rope, [&mut cache.k, &mut cache.v]);
                }
                taps.emit_buf(be, Site::Q, &qv, q.rows, Emit::Column);
                taps.emit_buf(be, Site::K, &kv, k.rows, Emit::Column);
                taps.emit_buf(be, Site::V, &vv, v.rows, Emit::Column);
                out_width = q.rows;
                for buf in &mut self.attn_out {
                    prepare_out(be, buf, n * out_width, false);
                }
                prepare_out(be, &mut self.attn_out[write_idx], n * out_width, canary_fill);
                let op = |out: &mut Buf| be.gqa_attention(&qv, &cache.k, &cache.v, ctx.pos0, shape, out);
                if phantom {
                    let mut scratch = be.alloc(n * out_width);
                    op(&mut scratch);
                } else {
                    op(&mut self.attn_out[write_idx]);
                }
                if ctx.is_decode {
                    // The cache rows this step's attention read (positions 0..=pos).
                    let rows = ctx.pos0 + n;
                    emit_cache(be, &mut taps, Site::KvCacheK, &cache.k, rows, k.rows);
                    emit_cache(be, &mut taps, Site::KvCacheV, &cache.v, rows, v.rows);
                }
            }
            AttnShard::Mla {
                q_a,
                q,
                kv_a,
                kv_a_norm,
                kv_b,
                kv_b_rows_used,
                indexer,
            } => {
                let m = c.mla.as_ref().expect("MLA weights on a non-MLA config");
                let (nope, rope, vd, kvl) = (m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank);
                let qw = nope + rope;
                let h_r = q.rows / qw;
                let q_normed;
                let q_in = match q_a {
                    Some((qa, qa_norm)) => {
                        let mut a = be.alloc(n * qa.rows);
                        be.linear(&h, n, qa.view(), &mut a);
                        taps.emit_buf(be, Site::QA, &a, qa.rows, Emit::Replicated);
                        let mut an = be.alloc(a.len());
                        be.rms_norm(&a, qa_norm, hy.rms_eps, &mut an);
                        q_normed = an;
                        &q_normed
                    }
                    None => &h,
                };
                let keys = c.indexer.as_ref().map(|ix| {
                    let dsa = DsaIn {
                        ix,
                        shard: indexer.as_ref(),
                        freqs: self.shard.rope_freqs.as_deref().map(Vec::as_slice),
                        layer_idx,
                        rank_idx: self.idx,
                    };
                    dsa.keys(ctx, &hy, &h, q_in, &mut cache.idx_k, &mut self.dsa_prev, &mut taps)
                });
                let mut qv = be.alloc(n * q.rows);
                be.linear(q_in, n, q.view(), &mut qv);
                let mut ckv = be.alloc(n * kv_a.rows);
                be.linear(&h, n, kv_a.view(), &mut ckv);
                let mut latent = be.alloc(n * kvl);
                let mut k_pe = be.alloc(n * rope);
                be.copy_cols(&ckv, kvl + rope, 0, kvl, &mut latent);
                be.copy_cols(&ckv, kvl + rope, kvl, rope, &mut k_pe);
                let mut latent_n = be.alloc(latent.len());
                be.rms_norm(&latent, kv_a_norm, hy.rms_eps, &mut latent_n);
                taps.emit_buf(be, Site::KvLatent, &latent_n, kvl, Emit::Replicated);
                be.rope_qk(
                    &mut qv,
                    RopeLayout {
                        n_heads: h_r,
                        head_stride: qw,
                        offset: nope,
                        rope_dim: rope,
                    },
                    &mut k_pe,
                    RopeLayout {
                        n_heads: 1,
                        head_stride: rope,
                        offset: 0,
                        rope_dim: rope,
                    },
                    ctx.pos0,
                    hy.rope_base,
                    hy.rope_style,
                    // YaRN's per-pair divisors where the file declares it.
                    RopeFreqs {
                        divisor: 1.0,
                        factors: self.shard.rope_freqs.as_deref().map(Vec::as_slice),
                    },
                );
                taps.emit_buf(be, Site::Q, &qv, q.rows, Emit::Column);
                taps.emit_buf(be, Site::KPe, &k_pe, rope, Emit::Replicated);
                let used = kv_b.first_rows(*kv_b_rows_used);
                let mut kvx = be.alloc(n * used.rows());
                be.linear(&latent_n, n, used, &mut kvx);
                // kvx rows are [head 0: nope | v][head 1: nope | v]...: as [n·H_r, nope + v] rows,
                // k_nope [n, H_r·nope] and v [n, H_r·v] are its two column ranges.
                let mut k_nope = be.alloc(n * h_r * nope);
                let mut vv = be.alloc(n * h_r * vd);
                be.copy_cols(&kvx, nope + vd, 0, nope, &mut k_nope);
                be.copy_cols(&kvx, nope + vd, nope, vd, &mut vv);
                taps.emit_buf(be, Site::K, &k_nope, h_r * nope, Emit::Column);
                taps.emit_buf(be, Site::V, &vv, h_r * vd, Emit::Column);
                cache_write(be, &mut cache.k, &k_nope, h_r * nope, ctx.pos0, off_by_one);
                cache_write(be, &mut cache.k_pe, &k_pe, rope, ctx.pos0, off_by_one);
                cache_write(be, &mut cache.v, &vv, h_r * vd, ctx.pos0, off_by_one);
                out_width = h_r * vd;
                let mut scale = 1.0 / (qw as f32).sqrt();
                if let Some(y) = &c.yarn {
                    let mscale = 1.0 + y.log_multiplier * (y.factor).ln();
                    scale *= mscale * mscale;
                }
                let shape = MlaShape {
                    n_heads: h_r,
                    nope,
                    rope,
                    v_dim: vd,
                    scale,
                };
                for buf in &mut self.attn_out {
                    prepare_out(be, buf, n * out_width, false);
                }
                prepare_out(be, &mut self.attn_out[write_idx], n * out_width, canary_fill);
                let op = |out: &mut Buf| match &keys {
                    Some((table, top_k)) => {
                        be.mla_attention_sparse(&qv, &cache.k, &cache.k_pe, &cache.v, shape, table, *top_k, out)
                    }
                    None => be.mla_attention(&qv, &cache.k, &cache.k_pe, &cache.v, ctx.pos0, shape, out),
                };
                if phantom {
                    let mut scratch = be.alloc(n * out_width);
                    op(&mut scratch);
                } else {
                    op(&mut self.attn_out[write_idx]);
                }
            }
        }
        let attn_out = &self.attn_out[read_idx];
        taps.emit_buf(be, Site::AttnOut, attn_out, out_width, Emit::Column);
        let mut partial = be.alloc(n * d);
        be.linear(attn_out, n, lw.o.view(), &mut partial);
        taps.emit_buf(be, Site::AttnProj, &partial, d, Emit::Partial);
        PhaseOut { data: partial, taps }
    }

    /// ffn_norm → dense SwiGLU or MoE mix (custom op) → partial `[n, d]`.
    pub fn ffn_block<'p>(&mut self, ctx: &StepCtx<'p>, layer_idx: usize) -> PhaseOut<'p> {
        let be = ctx.backend;
        let c = ctx.config;
        let (n, d) = (ctx.n_tokens, c.d_model);
        let hy = ctx.hyper(layer_idx, self.idx);
        let mut taps = RankTaps::new(ctx.plan, self.idx, Some(layer_idx));
        let h = self.normed_input(ctx, NormAt::Ffn(layer_idx));
        let lw = &self.shard.layers[layer_idx];
        taps.emit_buf(be, Site::FfnNorm, &h, d, Emit::Replicated);
        prepare_out(be, &mut self.ffn_out, n * d, taps.wants_site(Site::FfnOut));
        let gelu = c.arch.is_gemma();
        match &lw.ffn {
            FfnShard::Dense(mlp) if !gelu && !taps.wants_site(Site::FfnGate) && !taps.wants_site(Site::FfnUp) => {
                let ws = [mlp.gate.view(), mlp.up.view(), mlp.down.view()];
                crate::backend::ffn_swiglu(be, &h, n, ws, &mut self.ffn_out);
            }
            FfnShard::Dense(mlp) => {
                let f_r = mlp.gate.rows;
                let mut g = be.alloc(n * f_r);
                let mut u = be.alloc(n * f_r);
                be.linear_many(&h, n, &[mlp.gate.view(), mlp.up.view()], &mut [&mut g, &mut u]);
                taps.emit_buf(be, Site::FfnGate, &g, f_r, Emit::Column);
                taps.emit_buf(be, Site::FfnUp, &u, f_r, Emit::Column);
                if gelu {
                    be.geglu(&mut g, &u);
                } else {
                    be.swiglu(&mut g, &u);
                }
                be.linear(&g, n, mlp.down.view(), &mut self.ffn_out);
            }
            FfnShard::Moe(moe) => {
                let mc = c.moe.as_ref().expect("MoE weights on a non-MoE config");
                let n_exp = moe.router.rows;
                let mut logits_buf = be.alloc(n * n_exp);
                be.linear(&h, n, moe.router.view(), &mut logits_buf);
                taps.emit_buf(be, Site::MoeLogits, &logits_buf, n_exp, Emit::Replicated);
                let bias = moe.bias.as_deref().map(|b| b.as_slice());
                let routes = be.moe_route(&logits_buf, n_exp, mc, bias, hy.expert_scale);
                let ids: Vec<f32> = routes
                    .iter()
                    .flat_map(|r| {
                        let mut e = r.experts.clone();
                        e.sort_unstable();
                        e.into_iter().map(|x| x as f32)
                    })
                    .collect();
                taps.emit(Site::MoeTopk, &ids, mc.n_used, Emit::Replicated);
                moe_mix(be, &h, n, d, &routes, moe, &mut self.ffn_out);
            }
        }
        taps.emit_buf(be, Site::FfnOut, &self.ffn_out, d, Emit::Partial);
        // The op's output is handed on as the partial, and a fresh buffer (from the backend's pool
        // on a device: no copy, no launch) takes its place for the next layer.
        let data = std::mem::replace(&mut self.ffn_out, be.alloc(n * d));
        PhaseOut { data, taps }
    }

    /// output_norm → this rank's vocab slice of the logits `[n, V_r]`.
    pub fn head<'p>(&mut self, ctx: &StepCtx<'p>) -> PhaseOut<'p> {
        let be = ctx.backend;
        let (n, d) = (ctx.n_tokens, ctx.config.d_model);
        let mut taps = RankTaps::new(ctx.plan, self.idx, None);
        let mut h = self.normed_input(ctx, NormAt::Head);
        taps.emit_buf(be, Site::OutputNorm, &h, d, Emit::Replicated);
        let mut n = n;
        if ctx.last_only && n > 1 {
            let mut last = be.alloc(d);
            be.copy(&h, (n - 1) * d, &mut last, 0, d);
            (h, n) = (last, 1);
        }
        let w = &self.shard.lm_head;
        let mut logits = be.alloc(n * w.rows);
        be.linear(&h, n, w.view(), &mut logits);
        if let Some(cap) = ctx.config.family.final_softcap {
            // Gemma's final-logit soft-capping, element-wise on each vocab slice.
            be.softcap(&mut logits, cap);
        }
        taps.emit_buf(be, Site::Logits, &logits, w.rows, Emit::Column);
        PhaseOut { data: logits, taps }
    }
}

fn mlp(be: &dyn Backend, x: &Buf, n: usize, w: &MlpShard, out: &mut Buf) {
    crate::backend::ffn_swiglu(be, x, n, [w.gate.view(), w.up.view(), w.down.view()], out);
}

/// The MoE mix custom op: writes `out` `[n, d]` = Σ_e w_e·expert_e(x) + shared(x), over this
/// rank's slice of every expert. Tokens are grouped per expert so each expert runs one matmul.
pub fn moe_mix(be: &dyn Backend, x: &Buf, n: usize, d: usize, routes: &[Route], moe: &MoeShard, out: &mut Buf) {
    be.fill(out, 0.0);
    for (e_idx, expert) in moe.experts.iter().enumerate() {
        let (tokens, weights): (Vec<usize>, Vec<f32>) = routes
            .iter()
            .enumerate()
            .filter_map(|(t, r)| r.experts.iter().position(|&e| e == e_idx).map(|p| (t, r.weights[p])))
            .unzip();
        if tokens.is_empty() {
            continue;
        }
        let xs = be.gather_rows(x, d, &tokens);
        let mut y = be.alloc(tokens.len() * d);
        mlp(be, &xs, tokens.len(), expert, &mut y);
        be.add_rows_scaled(out, &y, d, &tokens, &weights);
    }
    if let Some(sh) = &moe.shared {
        let mut y = be.alloc(n * d);
        mlp(be, x, n, sh, &mut y);
        be.add_assign(out, &y, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drift_changes_every_hyper_parameter() {
        let h = Hyper {
            rms_eps: 1e-5,
            rope_base: 10000.0,
            expert_scale: 2.5,
            rope_style: RopeStyle::Norm,
        };
        let d = h.drifted();
        assert!(d.rms_eps != h.rms_eps && d.rope_base != h.rope_base && d.expert_scale != h.expert_scale);
    }
}
