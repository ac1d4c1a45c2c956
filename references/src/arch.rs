//! The architectures llmdiff runs and the error of a model's configuration: the bottom of the
//! config layer, shared by `config` (which builds a `ModelConfig`) and `allowlist` (which says
//! what of a file that config reads), so neither imports the other.

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("missing metadata key {0}")]
    Missing(String),
    #[error("metadata key {key}: {msg}")]
    Bad { key: String, msg: String },
    #[error("unsupported architecture {0:?}: llmdiff runs llama (Llama 2/3/3.1+, SmolLM2 and other dense GQA models in the llama layout), deepseek2 (DeepSeek-V2/V3-style MLA + MoE), deepseek32 (DeepSeek-V3.2), glm-dsa (GLM-5), qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3 and gpt-oss")]
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
    /// DeepSeek-V3.2: deepseek2's MLA + MoE plus the DSA lightning indexer (NeoX-RoPE indexer).
    Deepseek32,
    /// GLM-5 (`glm-dsa`): as deepseek32 with an interleaved-RoPE indexer and `shared` indexer
    /// layers that reuse the previous `full` layer's selection.
    GlmDsa,
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
            Arch::Deepseek32 => "deepseek32",
            Arch::GlmDsa => "glm-dsa",
        }
    }

    /// Every architecture, in the order above.
    pub const ALL: [Arch; 11] = [
        Arch::Llama,
        Arch::Deepseek2,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Qwen3Moe,
        Arch::Glm4Moe,
        Arch::Gemma2,
        Arch::Gemma3,
        Arch::GptOss,
        Arch::Deepseek32,
        Arch::GlmDsa,
    ];

    /// True for the families that rotate NeoX halves (i, i + d/2) rather than llama.cpp's NORM
    /// pairs (2i, 2i + 1): qwen2/3, qwen3moe, glm4moe, gemma2/3, gpt-oss. (The MLA families rotate
    /// NORM pairs; the DSA indexer's own RoPE is chosen in `forward/dsa.rs`.)
    pub fn rope_neox(self) -> bool {
        !matches!(self, Arch::Llama) && !self.is_mla()
    }

    /// The Gemma family (embedding scale, pre/post norms, GELU-tanh, soft-capping, sliding windows).
    pub fn is_gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// True for the MLA + MoE families (deepseek2 and the DSA ones built on it).
    pub fn is_mla(self) -> bool {
        matches!(self, Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa)
    }

    /// True for the families with the DSA lightning indexer.
    pub fn has_indexer(self) -> bool {
        matches!(self, Arch::Deepseek32 | Arch::GlmDsa)
    }
}
