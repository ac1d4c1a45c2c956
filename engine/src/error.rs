//! The engine's error type: one line each, naming the tensor, constraint or input at fault.

/// Why the engine could not load or run a model.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Config(#[from] references::ConfigError),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("tensor {name}: {msg}")]
    BadTensor { name: String, msg: String },
    #[error("tensor {name}: {msg}")]
    Dequant { name: String, msg: String },
    #[error("TP degree {tp}: {msg}")]
    TpDegree { tp: usize, msg: String },
    #[error("fault spec {spec:?}: {msg}")]
    FaultSyntax { spec: String, msg: String },
    #[error("fault {spec}: {msg}")]
    FaultNotApplicable { spec: String, msg: String },
    #[error("token id {id} at position {pos} is outside the vocabulary ({vocab})")]
    TokenOutOfRange { id: u32, pos: usize, vocab: usize },
    #[error("no tokens given")]
    Empty,
    #[error("{n_past} cached + {n_new} new tokens exceed the context length {n_ctx}")]
    ContextFull { n_past: usize, n_new: usize, n_ctx: usize },
    #[error("decode before prefill: the KV cache is empty")]
    DecodeWithoutPrefill,
    #[error("cuda: {0}")]
    Cuda(String),
    #[error("kernel {kernel} does not compile: {msg}")]
    KernelCompile { kernel: String, msg: String },
    #[error("options: {0}")]
    Options(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
}
