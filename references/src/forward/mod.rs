//! Reference forward passes (llama, deepseek2): scalar, f32 storage with f64 accumulation,
//! tapping every site in execution order. (Being written.)

use crate::config::ModelConfig;
use crate::gguf::GgufFile;
use crate::tap::Tap;

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

/// The reference model over an open GGUF file. Weights are dequantized one layer at a time.
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
        let _ = (tokens, tap);
        unimplemented!("reference forward")
    }
}
