//! `references`: the obviously-correct side of llmdiff.
//!
//! It reads and writes GGUF files ([`gguf`]), derives model hyper-parameters from their metadata
//! ([`config`]), defines the one tap-key type and the tap protocol ([`tap`]), and holds the scalar
//! reference dequantizers and round-to-nearest quantizers ([`dequant`], [`quant`]).
//! It depends on nothing else in the workspace.

pub mod allowlist;
pub mod arch;
pub mod config;
pub mod dequant;
pub mod forward;
pub mod ggml_type;
pub mod gguf;
pub mod hf;
#[rustfmt::skip]
pub mod iq_grids;
pub mod quant;
pub mod source;
pub mod synth;
pub mod tap;
pub mod tokenizer;
pub mod writer;

pub use config::{ConfigError, ModelConfig};
pub use ggml_type::GgmlType;
pub use gguf::{GgufError, GgufFile, MetaValue, ModelSource, TensorInfo};
pub use tap::{Site, Tap, TapKey};
