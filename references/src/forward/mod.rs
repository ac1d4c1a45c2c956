//! Reference forward passes for `llama` and `deepseek2` (MLA + MoE): one sequence, all
//! positions at once, tapping every site in execution order.
//!
//! Obviously correct before fast: f32 storage, f64 accumulation in dot products, norms and
//! softmax; weights dequantized by the scalar reference dequantizer one layer at a time, so peak
//! memory is about one layer's f32 weights plus activations, never the model.

mod deepseek2;
mod llama;
pub mod ops;
pub mod replay;

use crate::config::{Arch, ModelConfig};
use crate::dequant::dequantize_to_vec;
use crate::gguf::{GgufFile, TensorInfo};
use crate::tap::{Site, Tap, TapKey, WeightKind};

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("{0}")]
    Config(#[from] crate::config::ConfigError),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("token id {id} at position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("no tokens given")]
    Empty,
}

/// A weight matrix in torch layout `[rows, cols]` (`rows` = out features), dequantized to f32.
pub struct Mat {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

/// The reference model over an open GGUF file.
pub struct Reference<'a> {
    pub file: &'a GgufFile,
    pub config: ModelConfig,
}

impl<'a> Reference<'a> {
    pub fn new(file: &'a GgufFile) -> Result<Self, ForwardError> {
        Ok(Reference {
            file,
            config: ModelConfig::from_header(&file.header)?,
        })
    }

    /// Runs `tokens` (one sequence, positions 0..n) and returns logits `[n, vocab]` row-major.
    pub fn forward(&self, tokens: &[u32], tap: &mut dyn Tap) -> Result<Vec<f32>, ForwardError> {
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
        let mut x = self.embed(tokens)?;
        emit(tap, TapKey::global(Site::Embed), &x, n);
        for layer_idx in 0..c.n_layers {
            x = match c.arch {
                Arch::Llama => llama::layer(self, layer_idx, x, n, tap)?,
                Arch::Deepseek2 => deepseek2::layer(self, layer_idx, x, n, tap)?,
            };
            let prefix = format!("blk.{layer_idx}.");
            self.file
                .tensors()
                .iter()
                .filter(|t| t.name.starts_with(&prefix))
                .for_each(|t| self.file.release(t));
        }
        let h = ops::rms_norm(&x, c.d_model, &self.vector("output_norm.weight", c.d_model)?, c.rms_eps);
        emit(tap, TapKey::global(Site::OutputNorm), &h, n);
        let logits = self.logits(&h, n)?;
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

    /// A 2-D weight stored ne = {cols, rows}: torch `[rows, cols]`.
    pub(crate) fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Mat, ForwardError> {
        Ok(Mat {
            rows,
            cols,
            data: self.load(name, &[cols, rows])?,
        })
    }

    pub(crate) fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>, ForwardError> {
        self.load(name, &[len])
    }

    /// Rows `first..first + n_rows` of a tensor whose rows are ne[0] long.
    pub(crate) fn rows(&self, t: &TensorInfo, first: usize, n_rows: usize) -> Result<Vec<f32>, ForwardError> {
        let row_elems = t.ne[0] as usize;
        let row_bytes = t.ty.bytes_for(row_elems as u64).expect("validated at open") as usize;
        let data = self.file.tensor_data(t);
        let bytes = data
            .get(first * row_bytes..(first + n_rows) * row_bytes)
            .ok_or_else(|| Self::bad(&t.name, format!("rows {first}..{} out of range", first + n_rows)))?;
        dequantize_to_vec(t.ty, bytes).map_err(|e| Self::bad(&t.name, e.to_string()))
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
            x.extend(self.rows(t, id as usize, 1)?);
        }
        Ok(x)
    }

    /// Logits through the output matrix (or the tied embeddings), dequantized in row chunks so
    /// the vocab matrix is never held whole.
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
        const CHUNK_ROWS: usize = 8192;
        let mut logits = vec![0f32; n * c.vocab];
        let mut first = 0;
        while first < c.vocab {
            let n_rows = CHUNK_ROWS.min(c.vocab - first);
            let w = self.rows(t, first, n_rows)?;
            let part = ops::matmul_t(h, n, c.d_model, &w, n_rows);
            for tok in 0..n {
                logits[tok * c.vocab + first..tok * c.vocab + first + n_rows]
                    .copy_from_slice(&part[tok * n_rows..(tok + 1) * n_rows]);
            }
            first += n_rows;
        }
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

/// Records a weight (`blk.L.w.kind`, torch layout) if the tap wants it.
pub(crate) fn emit_weight(tap: &mut dyn Tap, layer_idx: usize, kind: WeightKind, w: &Mat) {
    let key = TapKey::layer(layer_idx, Site::Weight(kind));
    if tap.wants(&key) {
        tap.record(&key, &w.data, [w.rows, w.cols]);
    }
}

/// `x [n, cols] · wᵀ`.
pub(crate) fn linear(x: &[f32], n: usize, w: &Mat) -> Vec<f32> {
    ops::matmul_t(x, n, w.cols, &w.data, w.rows)
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
