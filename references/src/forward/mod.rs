//! Reference forward passes for `llama`, `deepseek2` (MLA + MoE), the DSA families
//! `deepseek32` / `glm-dsa` (deepseek2 plus the lightning indexer and sparse attention, `dsa.rs`)
//! and the GQA/MoE families (`qwen2`, `qwen3`, `qwen3moe`, `glm4moe`, `gemma2`, `gemma3`,
//! `gpt-oss`; one file each, glm4moe reusing qwen's block): one sequence, all positions at once,
//! tapping every site in execution order.
//!
//! Obviously correct before fast: f32 storage, f64 accumulation in dot products, norms and
//! softmax. Weights stay in the file's mmap: each matmul task dequantizes its own few rows with
//! the scalar reference dequantizer ([`Mat`]), and the pages of a finished layer are released,
//! so peak memory is the activations plus about one layer of the file, never the model in f32.
//! A weight tap decodes only the rows its tap asks for ([`crate::tap::Tap::weight_rows`]: a
//! sample, by default in `diff-layers`), and the products keep reading the stored weight as they
//! do untapped. A tap that asks for a whole weight (`--full-weights`) has it decoded once (over
//! all cores) and its products read that copy, so such a pass holds one layer's tapped weights
//! in f32 as well.

mod deepseek2;
pub mod dsa;
mod gemma;
mod glm4moe;
mod gpt_oss;
mod llama;
pub mod ops;
mod qwen;
pub mod replay;
pub mod yarn;

/// kv_b reassembled from llama.cpp's k_b/v_b split (weight fingerprints compare shards of it).
pub use deepseek2::{reassemble_kv_b, ExpertParts, Routing};

use crate::config::{Arch, ModelConfig};
use crate::dequant::{dequantize, dequantize_to_vec};
use crate::ggml_type::GgmlType;
use crate::gguf::{GgufFile, TensorInfo};
use crate::tap::{Site, Tap, TapKey, WeightKind};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("token id {id} at position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("no tokens given")]
    Empty,
    #[error("layer span: {0}")]
    Span(String),
}

/// Which layers a pass runs ([`Reference::forward_span`]): `layers` (A..B, Rust range), from
/// `residual` (`[n, d]`, the input of layer A; None: the embeddings, and A must be 0); the output
/// norm and head run when `head`.
#[derive(Clone, Debug)]
pub struct Span {
    pub layers: std::ops::Range<usize>,
    pub residual: Option<Vec<f32>>,
    pub head: bool,
}

/// A weight matrix in torch layout `[rows, cols]` (`rows` = out features).
pub struct Mat<'a> {
    pub rows: usize,
    pub cols: usize,
    data: MatData<'a>,
    /// The whole matrix in f32 once a weight tap asked for it whole ([`Mat::to_f32`]): the products
    /// then read their rows from it instead of dequantizing them a second time. Dropped with the
    /// `Mat` (one layer), so a tapped run holds about one layer's weights in f32.
    decoded: std::sync::OnceLock<Vec<f32>>,
}

enum MatData<'a> {
    /// f32 the reference built itself (kv_b, reassembled from k_b and v_b).
    F32(Vec<f32>),
    /// The file's bytes: `rows` rows of `ty`, `row_bytes` each. Products dequantize them with the
    /// reference dequantizer a task's rows at a time, so a weight is never held whole in f32.
    Stored {
        ty: GgmlType,
        bytes: &'a [u8],
        row_bytes: usize,
    },
}

impl Mat<'_> {
    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Mat<'static> {
        assert_eq!(data.len(), rows * cols, "Mat::from_f32: data is not [rows, cols]");
        Mat {
            rows,
            cols,
            data: MatData::F32(data),
            decoded: Default::default(),
        }
    }

    /// Rows `first..first + out.len() / cols`, as f32, into `out`.
    pub fn rows_into(&self, first: usize, out: &mut [f32]) {
        if let (MatData::Stored { row_bytes, .. }, None) = (&self.data, self.decoded.get()) {
            let n_rows = out.len() / self.cols.max(1);
            WEIGHT_BYTES_READ.fetch_add((n_rows * row_bytes) as u64, std::sync::atomic::Ordering::Relaxed);
        }
        let n_rows = out.len() / self.cols.max(1);
        if let Some(d) = self.decoded.get() {
            return out.copy_from_slice(&d[first * self.cols..(first + n_rows) * self.cols]);
        }
        match &self.data {
            MatData::F32(d) => out.copy_from_slice(&d[first * self.cols..(first + n_rows) * self.cols]),
            MatData::Stored { ty, bytes, row_bytes } => {
                dequantize(*ty, &bytes[first * row_bytes..(first + n_rows) * row_bytes], out)
                    .expect("row sizes are checked when a stored Mat is made")
            }
        }
    }

    /// Rows `rows` in f32, in that order (a weight tap on a sample of rows): only those rows
    /// are dequantized, and nothing is kept.
    pub fn rows_f32(&self, rows: &[usize]) -> Vec<f32> {
        let mut out = vec![0f32; rows.len() * self.cols];
        if self.cols > 0 {
            for (&r, o) in rows.iter().zip(out.chunks_exact_mut(self.cols)) {
                self.rows_into(r, o);
            }
        }
        out
    }

    /// The whole matrix in f32 (for weight taps), dequantized over all cores in blocks of rows
    /// (dequantization is per row, so the result does not depend on the split) and kept for
    /// the products that follow (see `decoded`).
    pub fn to_f32(&self) -> Vec<f32> {
        use rayon::prelude::*;
        const ROWS_PER_TASK: usize = 64;
        if let MatData::F32(d) = &self.data {
            return d.clone();
        }
        self.decoded
            .get_or_init(|| {
                let mut out = vec![0f32; self.rows * self.cols];
                if self.cols > 0 {
                    out.par_chunks_mut(ROWS_PER_TASK * self.cols)
                        .enumerate()
                        .for_each(|(i, block)| self.rows_into(i * ROWS_PER_TASK, block));
                }
                out
            })
            .clone()
    }
}

/// Bytes of stored weights the reference has dequantized in this process (every product's rows,
/// the routed experts' only; a weight decoded once for its tap counts once).
static WEIGHT_BYTES_READ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// [`WEIGHT_BYTES_READ`]'s count so far: the difference over a pass is what it read.
pub fn weight_bytes_read() -> u64 {
    WEIGHT_BYTES_READ.load(std::sync::atomic::Ordering::Relaxed)
}

/// The reference model over an open GGUF file.
pub struct Reference<'a> {
    pub file: &'a GgufFile,
    pub config: ModelConfig,
    /// Score the DSA indexer as production engines do (vLLM: q and the key cache in fp8 e4m3,
    /// groups of 128 with a per-group scale) instead of in f32: a simulated healthy fp8
    /// candidate, never the ground truth. Off by default.
    pub indexer_fp8: bool,
}

impl<'a> Reference<'a> {
    pub fn new(file: &'a GgufFile) -> Result<Self, ForwardError> {
        Ok(Reference {
            file,
            config: ModelConfig::from_header(&file.header)?,
            indexer_fp8: false,
        })
    }

    /// Runs `tokens` (one sequence, positions 0..n) and returns logits `[n, vocab]` row-major.
    pub fn forward(&self, tokens: &[u32], tap: &mut dyn Tap) -> Result<Vec<f32>, ForwardError> {
        let span = Span {
            layers: 0..self.config.n_layers,
            residual: None,
            head: true,
        };
        self.forward_span(tokens, span, tap)
    }

    /// Runs the layers of `span` over `tokens` (positions 0..n): from the embeddings or the given
    /// residual, then the head when asked. Returns logits `[n, vocab]`, or without the head the
    /// residual `[n, d]` after the last layer run. No weight of a layer outside the span is read.
    pub fn forward_span(&self, tokens: &[u32], span: Span, tap: &mut dyn Tap) -> Result<Vec<f32>, ForwardError> {
        if tokens.is_empty() {
            return Err(ForwardError::Empty);
        }
        let c = &self.config;
        for (pos, &id) in tokens.iter().enumerate() {
            if id as usize >= c.vocab {
                return Err(ForwardError::TokenOutOfRange {
                    id,
                    pos,
                    vocab: c.vocab,
                });
            }
        }
        let n = tokens.len();
        let layers = span.layers.clone();
        if layers.start > layers.end || layers.end > c.n_layers {
            return Err(ForwardError::Span(format!(
                "layers {}..{} of a {}-layer model",
                layers.start, layers.end, c.n_layers
            )));
        }
        let mut x = match span.residual {
            Some(r) if r.len() == n * c.d_model => r,
            Some(r) => {
                return Err(ForwardError::Span(format!(
                    "the residual at layer {} has {} values, not {n} tokens × d_model {}",
                    layers.start,
                    r.len(),
                    c.d_model
                )))
            }
            None if layers.start > 0 => {
                return Err(ForwardError::Span(format!(
                    "starting at layer {} needs the residual there",
                    layers.start
                )))
            }
            None => {
                let mut x = self.embed(tokens)?;
                if c.arch.is_gemma() {
                    // Gemma scales the embeddings by √d_model (the embed tap shows the scaled rows).
                    let s = (c.d_model as f64).sqrt();
                    x.iter_mut().for_each(|v| *v = (*v as f64 * s) as f32);
                }
                emit(tap, TapKey::global(Site::Embed), &x, n);
                x
            }
        };
        if let Some(ix) = &c.indexer {
            // A DSA `shared` layer reuses the selection of the `full` layer before it.
            if layers.start > 0 && !ix.full.get(layers.start).copied().unwrap_or(true) {
                return Err(ForwardError::Span(format!(
                    "layer {} reuses an earlier layer's DSA selection: start the range at a layer that scores its own (indexer `full`)",
                    layers.start
                )));
            }
        }
        let mut dsa_state = dsa::DsaState::default();
        for layer_idx in layers.clone() {
            x = match c.arch {
                Arch::Llama => llama::layer(self, layer_idx, x, n, tap)?,
                Arch::Deepseek2 => deepseek2::layer(self, layer_idx, x, n, tap, None)?,
                Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => qwen::layer(self, layer_idx, x, n, tap)?,
                Arch::Glm4Moe => glm4moe::layer(self, layer_idx, x, n, tap)?,
                Arch::Gemma2 | Arch::Gemma3 => gemma::layer(self, layer_idx, x, n, tap)?,
                Arch::GptOss => gpt_oss::layer(self, layer_idx, x, n, tap)?,
                Arch::Deepseek32 | Arch::GlmDsa => deepseek2::layer(self, layer_idx, x, n, tap, Some(&mut dsa_state))?,
            };
            let prefix = format!("blk.{layer_idx}.");
            self.file
                .tensors()
                .iter()
                .filter(|t| t.name.starts_with(&prefix))
                .for_each(|t| self.file.release(t));
            if tap.stopped() {
                // The tap's owner has its answer: no logits (an empty result).
                return Ok(Vec::new());
            }
        }
        if !span.head {
            return Ok(x);
        }
        let h = ops::rms_norm(&x, c.d_model, &self.vector("output_norm.weight", c.d_model)?, c.rms_eps);
        emit(tap, TapKey::global(Site::OutputNorm), &h, n);
        let mut logits = self.logits(&h, n)?;
        if let Some(cap) = c.family.final_softcap {
            // Gemma's final-logit soft-capping (the logits tap shows the capped values).
            emit(tap, TapKey::global(Site::LogitsPreCap), &logits, n);
            logits
                .iter_mut()
                .for_each(|z| *z = ops::softcap(*z as f64, cap as f64) as f32);
        }
        emit(tap, TapKey::global(Site::Logits), &logits, n);
        Ok(logits)
    }

    pub(crate) fn tensor(&self, name: &str) -> Result<&TensorInfo, ForwardError> {
        self.file
            .tensor(name)
            .ok_or_else(|| ForwardError::MissingTensor(name.to_string()))
    }

    fn bad(name: &str, msg: String) -> ForwardError {
        ForwardError::BadTensor {
            name: name.to_string(),
            msg,
        }
    }

    /// Dequantizes a whole tensor, checking its dims against `want` (ne order).
    pub(crate) fn load(&self, name: &str, want: &[usize]) -> Result<Vec<f32>, ForwardError> {
        let t = self.tensor(name)?;
        let ne: Vec<usize> = t.ne.iter().map(|&d| d as usize).collect();
        if ne != want {
            return Err(Self::bad(name, format!("dims {ne:?}, expected {want:?}")));
        }
        dequantize_to_vec(t.ty, self.file.tensor_data(t)).map_err(|e| Self::bad(name, e.to_string()))
    }

    /// A 2-D weight stored ne = {cols, rows}: torch `[rows, cols]`, read from the file as needed.
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Mat<'a>, ForwardError> {
        let t = self.tensor(name)?;
        let ne: Vec<usize> = t.ne.iter().map(|&d| d as usize).collect();
        if ne != [cols, rows] {
            return Err(Self::bad(name, format!("dims {ne:?}, expected {:?}", [cols, rows])));
        }
        self.stored_rows(t, 0, rows)
    }

    /// Rows `first..first + n_rows` of a tensor whose rows are ne[0] long, as a stored [`Mat`].
    pub(crate) fn stored_rows(&self, t: &TensorInfo, first: usize, n_rows: usize) -> Result<Mat<'a>, ForwardError> {
        let cols = t.ne[0] as usize;
        let row_bytes = t.ty.bytes_for(cols as u64).expect("validated at open") as usize;
        let bytes = self
            .file
            .tensor_data(t)
            .get(first * row_bytes..(first + n_rows) * row_bytes)
            .ok_or_else(|| Self::bad(&t.name, format!("rows {first}..{} out of range", first + n_rows)))?;
        Ok(Mat {
            rows: n_rows,
            cols,
            data: MatData::Stored {
                ty: t.ty,
                bytes,
                row_bytes,
            },
            decoded: Default::default(),
        })
    }

    /// Layer `l`'s weight `kind` whole, as the forward pass builds it (kv_b reassembled from
    /// k_b and v_b), or `None` when the model has no such weight: what a diagnosis reads after
    /// a weight tap compared on a sample of rows diverged.
    pub fn weight(&self, l: usize, kind: WeightKind) -> Result<Option<Mat<'a>>, ForwardError> {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let stored = match kind {
            WeightKind::Q => "attn_q",
            WeightKind::K => "attn_k",
            WeightKind::V => "attn_v",
            WeightKind::O => "attn_output",
            WeightKind::QA => "attn_q_a",
            WeightKind::QB => "attn_q_b",
            WeightKind::KvA => "attn_kv_a_mqa",
            WeightKind::Gate => "ffn_gate",
            WeightKind::Up => "ffn_up",
            WeightKind::Down => "ffn_down",
            WeightKind::Router => "ffn_gate_inp",
            WeightKind::IdxQB => "indexer.attn_q_b",
            WeightKind::IdxK => "indexer.attn_k",
            WeightKind::IdxProj => "indexer.proj",
            WeightKind::KvB => {
                let c = &self.config;
                let Some(m) = c.mla.as_ref() else { return Ok(None) };
                if self.file.tensor(&name("attn_k_b")).is_none() {
                    return Ok(None);
                }
                let (nh, nope, dv, kvl) = (c.n_heads, m.qk_nope, m.v_head_dim, m.kv_lora_rank);
                let k_b = self.load(&name("attn_k_b"), &[nope, kvl, nh])?;
                let v_b = self.load(&name("attn_v_b"), &[kvl, dv, nh])?;
                return Ok(Some(reassemble_kv_b(&k_b, &v_b, nh, nope, dv, kvl)));
            }
        };
        let Some(t) = self.file.tensor(&name(stored)) else {
            return Ok(None);
        };
        if t.ne.len() != 2 {
            return Err(Self::bad(&t.name, format!("dims {:?}, expected a matrix", t.ne)));
        }
        self.stored_rows(t, 0, t.ne[1] as usize).map(Some)
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ForwardError> {
        self.load(name, &[len])
    }

    /// The embedding rows of `tokens` as the `embed` tap holds them (Gemma's √d_model scale
    /// applied): a vocab-parallel rank's partial is these rows for the tokens of its slice.
    pub fn embedding(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        let mut x = self.embed(tokens)?;
        if self.config.arch.is_gemma() {
            let s = (self.config.d_model as f64).sqrt();
            x.iter_mut().for_each(|v| *v = (*v as f64 * s) as f32);
        }
        Ok(x)
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let t = self.tensor("token_embd.weight")?;
        if t.ne.len() != 2 || t.ne[0] as usize != c.d_model || (t.ne[1] as usize) < c.vocab {
            return Err(Self::bad(
                &t.name,
                format!("dims {:?}, expected [{}, {}]", t.ne, c.d_model, c.vocab),
            ));
        }
        let mut x = Vec::with_capacity(tokens.len() * c.d_model);
        for &id in tokens {
            x.extend(self.stored_rows(t, id as usize, 1)?.to_f32());
        }
        Ok(x)
    }

    /// Logits through the output matrix (or the tied embeddings).
    fn logits(&self, h: &[f32], n: usize) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let name = if c.tied_embeddings {
            "token_embd.weight"
        } else {
            "output.weight"
        };
        let t = self.tensor(name)?;
        if t.ne.len() != 2 || t.ne[0] as usize != c.d_model || (t.ne[1] as usize) < c.vocab {
            return Err(Self::bad(
                name,
                format!("dims {:?}, expected [{}, {}]", t.ne, c.d_model, c.vocab),
            ));
        }
        let logits = linear(h, n, &self.stored_rows(t, 0, c.vocab)?);
        self.file.release(t);
        Ok(logits)
    }
}

/// Records `data` (`[n, len / n]`) at `key` if the tap wants it.
pub(crate) fn emit(tap: &mut dyn Tap, key: TapKey, data: &[f32], n: usize) {
    if tap.wants(&key) {
        tap.record(&key, data, [n, data.len() / n.max(1)]);
    }
}

/// Records a weight (`blk.L.w.kind`, torch layout) if the tap wants it: the rows it asks for
/// only, or the whole weight ([`crate::tap::record_weight`]).
pub(crate) fn emit_weight(tap: &mut dyn Tap, layer_idx: usize, kind: WeightKind, w: &Mat) {
    let key = TapKey::layer(layer_idx, Site::Weight(kind));
    if tap.wants(&key) {
        crate::tap::record_weight(tap, &key, [w.rows, w.cols], |rows| match rows {
            Some(rows) => w.rows_f32(rows),
            None => w.to_f32(),
        });
    }
}

/// Layer `l`'s GQA attention projections q, k, v, o (`attn_q`, `attn_k`, `attn_v`,
/// `attn_output`), tapped in that order.
pub(crate) fn attn_weights<'a>(r: &Reference<'a>, l: usize, tap: &mut dyn Tap) -> Result<[Mat<'a>; 4], ForwardError> {
    let c = &r.config;
    let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let w = [
        r.matrix(&name("attn_q"), nh * hd, d)?,
        r.matrix(&name("attn_k"), nkv * hd, d)?,
        r.matrix(&name("attn_v"), nkv * hd, d)?,
        r.matrix(&name("attn_output"), d, nh * hd)?,
    ];
    for (kind, w) in [WeightKind::Q, WeightKind::K, WeightKind::V, WeightKind::O]
        .into_iter()
        .zip(&w)
    {
        emit_weight(tap, l, kind, w);
    }
    Ok(w)
}

/// `x [n, cols] · wᵀ`.
pub(crate) fn linear(x: &[f32], n: usize, w: &Mat) -> Vec<f32> {
    ops::matmul_t_with(x, n, w.cols, w.rows, |first, out| w.rows_into(first, out))
}

/// Layer `l`'s dense FFN on `h` (the ffn_norm output): loads and taps its weights, taps gate and
/// up, and returns the output (not tapped: the caller taps ffn_out).
pub(crate) fn dense_ffn(
    r: &Reference,
    l: usize,
    h: &[f32],
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    let (d, f) = (r.config.d_model, r.config.ffn_dim);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let gate = r.matrix(&name("ffn_gate"), f, d)?;
    let up = r.matrix(&name("ffn_up"), f, d)?;
    let down = r.matrix(&name("ffn_down"), d, f)?;
    for (kind, w) in [
        (WeightKind::Gate, &gate),
        (WeightKind::Up, &up),
        (WeightKind::Down, &down),
    ] {
        emit_weight(tap, l, kind, w);
    }
    let (g, u, out) = swiglu_ffn(h, n, &gate, &up, &down);
    emit(tap, TapKey::layer(l, Site::FfnGate), &g, n);
    emit(tap, TapKey::layer(l, Site::FfnUp), &u, n);
    Ok(out)
}

/// The dense SwiGLU FFN (also used for shared and routed experts): returns (gate, up, out).
pub(crate) fn swiglu_ffn(x: &[f32], n: usize, gate: &Mat, up: &Mat, down: &Mat) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let g = linear(x, n, gate);
    let u = linear(x, n, up);
    let out = linear(&ops::swiglu(&g, &u), n, down);
    (g, u, out)
}
