//! The architectures llmdiff runs and the error of a model's configuration: the bottom of the
//! config layer, shared by `config` (which builds a `ModelConfig`) and `allowlist` (which says
//! what of a file that config reads), so neither imports the other.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("missing metadata key {0}")]
    Missing(String),
    #[error("metadata key {key}: {msg}")]
    Bad { key: String, msg: String },
    #[error("unsupported architecture {0:?}: llmdiff runs llama (Llama 2/3/3.1+, SmolLM2 and other dense GQA models in the llama layout), deepseek2 (DeepSeek-V2/V3-style MLA + MoE), qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3 and gpt-oss")]
    UnsupportedArch(String),
    #[error("unknown {what} {name:?} in a {arch} file{note}: llmdiff cannot tell whether it changes the model (--allow-unknown {name} runs anyway, at your risk)")]
    Unknown {
        what: &'static str,
        name: String,
        arch: &'static str,
        /// Empty, or " (why)" when the reason is known.
        note: String,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Deepseek2,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Glm4Moe,
    Gemma2,
    Gemma3,
    GptOss,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Deepseek2 => "deepseek2",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Glm4Moe => "glm4moe",
            Arch::Gemma2 => "gemma2",
            Arch::Gemma3 => "gemma3",
            Arch::GptOss => "gpt-oss",
        }
    }

    /// Every architecture, in the order above.
    pub const ALL: [Arch; 9] = [
        Arch::Llama,
        Arch::Deepseek2,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Glm4Moe,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::GptOss,
    ];

    /// True for the families that rotate NeoX halves (i, i + d/2) rather than llama.cpp's NORM
    /// pairs (2i, 2i + 1): qwen2/3, qwen3moe, glm4moe, gemma2/3, gpt-oss.
    pub fn rope_neox(self) -> bool {
        !matches!(self, Arch::Llama | Arch::Deepseek2)
    }

    /// The Gemma family (embedding scale, pre/post norms, GELU-tanh, soft-capping, sliding windows).
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }
}
