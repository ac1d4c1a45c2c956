//! clap argument structs for every subcommand. Validation into a plan happens in `commands`.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "llmdiff",
    version,
    about = "Differential debugging for LLM deployments: run a tensor-parallel engine beside a slow, obviously-correct reference, tap every layer, and say where and why they part.",
    after_help = "Exit codes: 0 agree/pass/healthy, 1 divergence/gate failed/unhealthy, 2 bad input or usage.\nEvery command takes --json: results on stdout, logs on stderr."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// Run a model despite this unknown `{arch}.*` metadata key or tensor (repeatable): llmdiff
    /// cannot tell whether it changes the model, so the result is at your risk.
    #[arg(long = "allow-unknown", value_name = "KEY", global = true)]
    pub allow_unknown: Vec<String>,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Show a GGUF file's metadata, tensor table and parsed model config.
    Inspect(InspectArgs),
    /// Write a deterministic random-weight GGUF model (llama, deepseek2, glm-dsa, qwen3, qwen3moe) from a preset or dims.
    #[command(after_help = "Examples:\n  llmdiff synth --preset smollm2-135m -o smol.gguf\n\n  \
        # the 8B shape of the GPU benchmarks (4.07 GB):\n  \
        llmdiff synth --arch llama --n-layers 32 --d-model 4096 --n-heads 32 --n-kv-heads 8 \\\n      \
        --ffn-dim 14336 --vocab 32000 --quant Q4_K -o llama8b.gguf")]
    Synth(SynthArgs),
    /// Token ids for a prompt, from the model's own tokenizer (as llama.cpp tokenizes, special tokens parsed).
    Tokenize(TokenizeArgs),
    /// Next-token log-probabilities (f64 log-softmax) and entropy at every position.
    Logits(LogitsArgs),
    /// Run the engine beside the reference, compare every tap, and say where and why they part.
    #[command(name = "diff-layers", after_help = crate::cli::FAULT_HELP.as_str())]
    DiffLayers(DiffLayersArgs),
    /// Greedy continuation of a prompt on the reference or the engine (cpu, cuda; --inject a fault
    /// to see what a broken deployment answers).
    #[command(after_help = crate::cli::FAULT_HELP.as_str())]
    Generate(GenerateArgs),
    /// Time prefill and decode on a backend (the figures peers are compared against). The last
    /// decode step's logits are checked against a prefill of the same tokens; exit 1 if they
    /// differ (the timing would be of a wrong result).
    Bench(BenchArgs),
    /// The CUDA kernels: compile them all (--check also tests each against the CPU engine's), or
    /// time the quantized GEMV against the device's copy bandwidth (--bench). Needs --features cuda.
    Kernels(KernelsArgs),
    /// Flag flat or degenerate next-token distributions on prompts; KL statistics against the reference.
    #[command(after_help = crate::cli::FAULT_HELP.as_str())]
    Entropy(EntropyArgs),
    /// Re-run what golden files describe and compare within their thresholds (CI regression gate),
    /// or gate a live OpenAI-compatible server against them (--server).
    #[command(after_help = crate::cli::GATE_HELP.as_str())]
    Gate(GateArgs),
    /// Write golden files for `gate`.
    Golden(GoldenArgs),
    /// Re-render a saved diff-layers run document (--json-out) as a self-contained HTML report.
    Report(ReportArgs),
    /// The embedded default: synthesize a miniature MLA+MoE model, diff a healthy and a faulty TP 2 engine, write llmdiff-demo.html.
    Demo(DemoArgs),
}

/// A threshold or tolerance option: a finite number ≥ 0 (NaN, infinities and negatives are
/// refused by clap: exit 2).
pub fn non_negative(s: &str) -> Result<f64, String> {
    let x: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number"))?;
    if x.is_finite() && x >= 0.0 {
        Ok(x)
    } else {
        Err(format!("{s}: expected a finite number >= 0"))
    }
}

/// A duration in seconds: finite and > 0.
pub fn positive_seconds(s: &str) -> Result<f64, String> {
    let x = non_negative(s)?;
    if x > 0.0 && x <= 86_400.0 * 365.0 {
        Ok(x)
    } else {
        Err(format!("{s}: expected a number of seconds > 0"))
    }
}

/// A percentage: finite, within 0..=100.
pub fn percent(s: &str) -> Result<f64, String> {
    let x = non_negative(s)?;
    if x <= 100.0 {
        Ok(x)
    } else {
        Err(format!("{s}: expected a percentage within 0..=100"))
    }
}

#[derive(Args, Debug)]
pub struct InspectArgs {
    /// The model: a GGUF file or an HF checkpoint folder (config.json + safetensors).
    pub model: PathBuf,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Show every metadata array item instead of a summary.
    #[arg(long)]
    pub full: bool,
}

#[derive(Args, Debug)]
pub struct SynthArgs {
    /// A named preset (see --list-presets).
    #[arg(long, conflicts_with = "arch")]
    pub preset: Option<String>,
    /// Build from explicit dims instead of a preset.
    #[arg(long, value_parser = ["llama", "deepseek2"])]
    pub arch: Option<String>,
    /// Weight type for the 2-D weights (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K,
    /// IQ4_NL, IQ4_XS, MXFP4, TQ1_0, TQ2_0), or llama.cpp's mix Q4_K_M / Q5_K_M (Q4_K / Q5_K with the output matrix, and attn_v and
    /// ffn_down in half the layers, in Q6_K). Defaults to the preset's own types.
    #[arg(long)]
    pub quant: Option<String>,
    /// RNG seed; the same seed gives the same bytes.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Output GGUF path.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// List the presets and exit.
    #[arg(long)]
    pub list_presets: bool,
    /// Write a split model, at most N tensors a file: -o OUT.gguf gives OUT-00001-of-0000K.gguf
    /// .. (gguf-split's names and keys); open the first.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub split_max_tensors: Option<u64>,
    /// Write a split model, at most SIZE bytes of tensor data a file (a tensor larger than that
    /// gets a file of its own): a byte count or with K, M or G (10³, 10⁶, 10⁹, as gguf-split
    /// reads it), e.g. 4G; the files are named as for --split-max-tensors.
    #[arg(long, value_name = "SIZE", conflicts_with = "split_max_tensors")]
    pub split_max_size: Option<String>,
    #[command(flatten)]
    pub dims: DimArgs,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

/// Explicit dims for `synth --arch`, or overrides of a preset's. A dim not given keeps the
/// preset's (with --arch: llama-tiny's or deepseek-v3-mini's).
#[derive(Args, Debug, Default, Clone)]
pub struct DimArgs {
    /// Transformer blocks.
    #[arg(long)]
    pub n_layers: Option<usize>,
    /// Hidden size (a multiple of 32, divisible by --n-heads); head_dim is d_model / n_heads.
    #[arg(long)]
    pub d_model: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub n_heads: Option<usize>,
    /// KV heads (GQA; must divide --n-heads). deepseek2 (MLA) always has one latent KV head.
    #[arg(long)]
    pub n_kv_heads: Option<usize>,
    /// Feed-forward width (a multiple of 32); for deepseek2, the dense layers'.
    #[arg(long)]
    pub ffn_dim: Option<usize>,
    /// Vocabulary size (at least 259: 3 control tokens and 256 byte tokens).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// Routed experts (deepseek2 only); the groups and top-k shrink to fit.
    #[arg(long)]
    pub n_experts: Option<usize>,
    /// Experts each token is routed to (top-k; deepseek2 only; at most --n-experts).
    #[arg(long)]
    pub n_experts_used: Option<usize>,
    /// Each routed (and shared) expert's FFN width (deepseek2 only; a multiple of 32).
    #[arg(long)]
    pub expert_ffn: Option<usize>,
    /// Leading dense layers before the MoE ones (deepseek2 only; 0: every layer MoE).
    #[arg(long)]
    pub n_dense_lead: Option<usize>,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

/// Where a forward pass runs.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendArg {
    /// The slow, obviously-correct CPU reference.
    Reference,
    /// The tensor-parallel engine, ranks as CPU threads.
    Cpu,
    /// The tensor-parallel engine on a GPU (build with --features cuda).
    Cuda,
}

impl BackendArg {
    /// The engine backend this selects (`None` for the reference).
    pub fn engine_kind(self) -> Option<engine::BackendKind> {
        match self {
            BackendArg::Reference => None,
            BackendArg::Cpu => Some(engine::BackendKind::Cpu),
            BackendArg::Cuda => Some(engine::BackendKind::Cuda),
        }
    }

    /// The name printed and stored (`reference`, `cpu`, `cuda`).
    pub fn name(self) -> &'static str {
        match self {
            BackendArg::Reference => "reference",
            BackendArg::Cpu => "cpu",
            BackendArg::Cuda => "cuda",
        }
    }
}

/// `--cuda-graphs on|off`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnOff {
    On,
    Off,
}

/// `--ranks auto|simulated|nccl`: how `--backend cuda` runs TP ranks.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum RanksArg {
    /// One GPU per rank over NCCL when there are enough GPUs and TP > 1, else simulated.
    Auto,
    /// Every rank on one GPU, the all-reduce a device-side sum.
    Simulated,
    /// One GPU per rank, the all-reduce through NCCL (needs TP GPUs).
    Nccl,
}

/// Where and how the engine runs: one set of arguments, flattened into every command that runs a
/// forward pass (logits, generate, bench, diff-layers, entropy, gate, golden bless). `--inject` is
/// parsed here, by clap, and nowhere else.
#[derive(Args, Debug, Clone, Default)]
pub struct EngineArgs {
    /// Where the forward pass runs: reference (the slow, obviously-correct CPU reference), cpu
    /// (the tensor-parallel engine, ranks as CPU threads) or cuda (build with --features cuda).
    /// Default: the command's own (cpu for diff-layers and generate, the golden file's for gate,
    /// reference otherwise).
    #[arg(long, value_enum)]
    pub backend: Option<BackendArg>,
    /// Tensor-parallel degree of the engine (default 1; gate: the golden file's).
    #[arg(long)]
    pub tp: Option<usize>,
    /// Inject a fault into the engine: NAME[@LAYER][:RANK]; may be repeated (see the catalog below).
    #[arg(long = "inject", value_name = "FAULT")]
    pub inject: Vec<engine::FaultSpec>,
    /// --backend cuda: replay each decode step as a CUDA graph (on, the default) or launch op by op.
    #[arg(long, value_enum, value_name = "on|off")]
    pub cuda_graphs: Option<OnOff>,
    /// --backend cuda: real ranks (one GPU each, NCCL), simulated ranks on one GPU, or auto (real
    /// when TP > 1 and there are TP GPUs).
    #[arg(long, value_enum)]
    pub ranks: Option<RanksArg>,
    /// The precision the engine computes in: f32 (default), or bf16/f16 as production engines do
    /// (float weights and every op's output rounded to it, f32 accumulation; quantized weights
    /// keep their exact values). Engine backends only.
    #[arg(long, value_name = "f32|bf16|f16")]
    pub compute_dtype: Option<engine::ComputeDtype>,
    /// DSA models (glm-dsa, deepseek32): the engine's indexer stores its q and key cache in fp8
    /// e4m3 (groups of 128, per-group scale) as vLLM's does, so near-tie key choices may differ
    /// from the reference's exact scores (judged by the selection margin rule). Engine backends only.
    #[arg(long)]
    pub indexer_fp8: bool,
}

impl EngineArgs {
    /// `--backend`, or the command's default.
    pub fn backend_or(&self, default: BackendArg) -> BackendArg {
        self.backend.unwrap_or(default)
    }

    /// `--tp`, or 1.
    pub fn tp(&self) -> usize {
        self.tp.unwrap_or(1)
    }

    /// The faults as stored and printed (`NAME@L:R`).
    pub fn injected(&self) -> Vec<String> {
        self.inject.iter().map(|f| f.to_string()).collect()
    }

    /// The engine backend `backend` selects (`None`: the reference) and the engine's options, with
    /// every combination checked: the reference takes no --tp, --inject or CUDA flags; TP ≥ 1; the
    /// CUDA flags need --backend cuda. The one place the arguments become `EngineOptions`.
    pub fn engine_options(
        &self,
        backend: BackendArg,
    ) -> anyhow::Result<(Option<engine::BackendKind>, engine::EngineOptions)> {
        let tp = self.tp();
        if tp == 0 {
            anyhow::bail!("--tp must be at least 1");
        }
        let kind = backend.engine_kind();
        if kind.is_none() {
            if tp != 1 {
                anyhow::bail!("--tp applies to the engine backends (cpu, cuda), not the reference");
            }
            if !self.inject.is_empty() {
                anyhow::bail!("--inject needs an engine backend (cpu, cuda): the reference has no faults");
            }
            if self.indexer_fp8 {
                anyhow::bail!("--indexer-fp8 applies to the engine backends (cpu, cuda): the reference scores exactly");
            }
            if self.compute_dtype.is_some_and(|d| d != engine::ComputeDtype::F32) {
                anyhow::bail!(
                    "--compute-dtype applies to the engine backends (cpu, cuda): the reference computes in f64"
                );
            }
        }
        if backend != BackendArg::Cuda && (self.cuda_graphs.is_some() || self.ranks.is_some()) {
            anyhow::bail!("--cuda-graphs and --ranks apply to --backend cuda");
        }
        let mut opts = engine::EngineOptions {
            tp,
            faults: self.inject.clone(),
            backend: kind.unwrap_or_default(),
            compute_dtype: self.compute_dtype.unwrap_or_default(),
            indexer_fp8: self.indexer_fp8,
            ..engine::EngineOptions::default()
        };
        if backend == BackendArg::Cuda {
            // LLMDIFF_CUDA_DISABLE (the one escape hatch), then the flags, which win.
            opts.cuda = engine::CudaOptions::from_env()?;
            opts.cuda.progress = Some(|m| eprintln!("{m}"));
            if let Some(g) = self.cuda_graphs {
                opts.cuda.graphs = g == OnOff::On;
            }
            if let Some(r) = self.ranks {
                opts.cuda.ranks = match r {
                    RanksArg::Auto => engine::RankMode::Auto,
                    RanksArg::Simulated => engine::RankMode::Simulated,
                    RanksArg::Nccl => engine::RankMode::Nccl,
                };
            }
        }
        Ok((kind, opts))
    }
}

#[derive(Args, Debug)]
pub struct KernelsArgs {
    /// Compile every kernel module and run each kernel against the CPU engine's on odd shapes.
    #[arg(long)]
    pub check: bool,
    /// Time GEMV (4096×14336 and 14336×4096 for Q4_K, Q8_0, Q4_1, F16; Q4_1 also 1536×576 and
    /// 576×1536; Q4_K also the 8B's attention and output shapes; Q6_K the 8B Q4_K_M's ffn_down,
    /// attn_v and output), the default path and every compiled variant, against device-to-device
    /// copy bandwidth. Launches run back to back as a decode step's do (PDL unless
    /// LLMDIFF_CUDA_DISABLE=pdl), the integer forms given x's limbs made once; their time with a limbs
    /// pre-pass before every launch is shown beside. Then the prefill GEMM at 512 tokens (Q4_K,
    /// F16, Q6_K; every GEMM path beside the SIMT matmul, in TFLOP/s) and prefill attention.
    #[arg(long)]
    pub bench: bool,
    /// Also time the batched form (matmul) at this many tokens (0: skip).
    #[arg(long, default_value_t = 0)]
    pub bench_tokens: usize,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

/// The prompt, as text or token ids.
#[derive(Args, Debug, Clone)]
#[group(required = true, multiple = false)]
pub struct InputArgs {
    /// Prompt text, tokenized with the model's own tokenizer (special tokens parsed).
    #[arg(long)]
    pub prompt: Option<String>,
    /// Comma-separated token ids, e.g. 1,2,3.
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
}

/// diff-layers' prompt: as [`InputArgs`], but optional, since `--candidate` brings its tokens.
#[derive(Args, Debug, Clone)]
#[group(required = false, multiple = false)]
pub struct DiffInputArgs {
    /// Prompt text, tokenized with the model's own tokenizer (special tokens parsed). Optional
    /// with --candidate; if given, it must match the dump's tokens.
    #[arg(long)]
    pub prompt: Option<String>,
    /// Comma-separated token ids, e.g. 1,2,3 (optional with --candidate: must then match the dump's).
    #[arg(long, value_delimiter = ',')]
    pub tokens: Option<Vec<u32>>,
}

impl DiffInputArgs {
    /// The same input as the required-group form.
    pub fn as_input(&self) -> InputArgs {
        InputArgs {
            prompt: self.prompt.clone(),
            tokens: self.tokens.clone(),
        }
    }
    /// True when neither --prompt nor --tokens was given.
    pub fn is_empty(&self) -> bool {
        self.prompt.is_none() && self.tokens.is_none()
    }
}

#[derive(Args, Debug)]
pub struct LogitsArgs {
    /// The model: a GGUF file (the first shard of a split one) or an HF checkpoint folder
    /// (config.json + safetensors).
    pub model: PathBuf,
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// How many top tokens to show per position.
    #[arg(long, default_value_t = 5)]
    pub top_k: usize,
    /// Also write the raw logits `[n_tokens, vocab]` as little-endian f32 to this file (for
    /// comparing two runs element by element).
    #[arg(long)]
    pub dump_f32: Option<PathBuf>,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The GGUF model whose tokenizer metadata is used.
    pub model: PathBuf,
    /// The text to tokenize.
    #[arg(long)]
    pub prompt: String,
    /// Treat special-token text (e.g. <|im_start|>) as plain text.
    #[arg(long)]
    pub no_special: bool,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

/// `gate --help`: examples, what --server checks, then the fault catalog.
pub static GATE_HELP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        "Examples:
  # this build against every committed golden file (what .ci/run does)
  llmdiff gate --golden golden/gate-smollm2-reference.json --golden golden/gate-smollm2-cpu-tp3.json --junit gate.xml
  # a live deployment (vLLM, SGLang, llama.cpp server) against golden files; no model file needed
  llmdiff gate --server http://127.0.0.1:8000 --served-model smollm2 --golden golden/gate-smollm2-server.json --junit gate.xml
  llmdiff gate --server https://llm.example.com/v1 --api-key $KEY --send-tokens --golden golden/gate-smollm2-server.json --html gate.html
  # a golden file for a server gate: positions only, 8 greedy tokens per prompt
  llmdiff golden bless --model .cache/SmolLM2-135M-Instruct.Q4_1.gguf --prompt 'The capital of France is' --no-taps -o golden/gate-NAME.json

With --server, per golden prompt (sent as text, or as token ids with --send-tokens; the echo must
give the golden's tokens back): every position's KLD(golden || server) over the server's top-k,
both renormalized, within --kld-threshold (0.25 nats); its top-1 the golden's unless a near-tie
(within 0.5 nats in the golden); the greedy continuation the golden's up to a near-tie; the entropy
verdict healthy. Per golden file: mean KLD within 0.02 nats, same top-1 at >= --min-top1 (90) %.
Connection, HTTP and format errors exit 2.

{}",
        FAULT_HELP.as_str()
    )
});

/// The fault catalog, one line each, for `--help`.
pub static FAULT_HELP: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    let mut s = String::from("Faults for --inject NAME[@LAYER][:RANK] (NAME@L:R: layer L on rank R; NAME@L: every rank of layer L; NAME: every layer):\n");
    for f in engine::Fault::ALL {
        s.push_str(&format!("  {:<22} {}\n", f.name(), f.describe()));
    }
    s.push_str("\nExit codes: 0 agree, 1 diverged, 2 bad input.");
    s
});

#[derive(Args, Debug)]
pub struct DiffLayersArgs {
    /// The model: a GGUF file (the first shard of a split one) or an HF checkpoint folder
    /// (config.json + safetensors).
    pub model: PathBuf,
    #[command(flatten)]
    pub input: DiffInputArgs,
    /// Diff a foreign engine's tensor dump (safetensors, tap keys as names; one file per rank is
    /// fine) instead of running our engine: the tokens come from the dump. Write one from
    /// PyTorch with harness/adapters/llmdiff_dump.py (README: Foreign engines).
    #[arg(long, value_name = "DUMP", num_args = 1.., conflicts_with_all = ["inject", "decode_steps", "tp", "backend", "cuda_graphs", "ranks"])]
    pub candidate: Vec<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Override a threshold (rel_l2; the end-to-end threshold and, where the tap has a local
    /// error, its bound): SITE=VALUE, TAPKEY=VALUE or PATTERN=VALUE, e.g. attn_out=1e-2,
    /// blk.3.q@r1=1e-2, 'blk.*.q=0.1', '*=0.1' (glob over the printed key: '*' any run, '?' one
    /// character; a pattern without '@rN' also matches every rank). May be repeated. Most specific
    /// wins: exact key > pattern (more literal characters first, then the later one) > site > '*'.
    #[arg(long = "tolerance", value_name = "SITE=VALUE")]
    pub tolerance: Vec<String>,
    /// A JSON file of threshold overrides, same keys and precedence as --tolerance:
    /// {"attn_out": 1e-2, "blk.*.q": 0.1, "*": 0.2}.
    #[arg(long)]
    pub tolerance_file: Option<PathBuf>,
    /// Healthy baselines that set per-tap bounds, for engines whose noise the model does not
    /// predict (fused kernels, fp8 GEMMs with their own scaling): a saved run document
    /// (--json-out) of a healthy run, or a healthy candidate's dump (.safetensors, diffed first).
    /// Each tap's local bound becomes 3 × the baseline's local error, and its end-to-end
    /// threshold at least 3 × the baseline's end-to-end error (never below the f32 floor).
    #[arg(long, value_name = "HEALTHY", num_args = 1..)]
    pub baseline: Vec<PathBuf>,
    /// Stop at the first divergence: comparing ends there and both sides stop computing a layer
    /// after it (the taps after it are not compared).
    #[arg(long)]
    pub stop_at_first: bool,
    /// Compare every row of the weight taps (blk.L.w.*). By default each weight is compared on
    /// a sample of its rows (32 spread over each TP shard, its first and last row included;
    /// shapes are still checked whole), which finds loading, sharding, transposition and
    /// dequantization faults, as they reach every block, at a fraction of the cost. A fault
    /// confined to rows outside the sample shows at the first activation that reads them
    /// instead (one tap later), or not at all if that change is within tolerance.
    #[arg(long)]
    pub full_weights: bool,
    /// Run both sides truncated to the first N layers, then the output norm and head: a verdict
    /// on layers 0..N without the rest of the model. A foreign engine must run with the same
    /// truncation (vLLM: --hf-overrides '{"num_hidden_layers": N}'; HF: num_hidden_layers=N in
    /// the config); see docs/perf.md.
    #[arg(long, value_name = "N")]
    pub n_layers: Option<usize>,
    /// Run both sides over layers A..B only, from one residual (the input of layer A): Rust range
    /// syntax, A included, B not (`4..7` is layers 4, 5, 6; `A..` to the last layer, `..B` from
    /// layer 0). The taps of other layers do not exist; the output norm and head run only when B
    /// is the last layer, otherwise the verdict is on the range's layer taps. See docs/perf.md
    /// (bisecting a long model).
    #[arg(long, value_name = "A..B", conflicts_with = "n_layers")]
    pub layers: Option<String>,
    /// With --layers: where the residual at layer A comes from. `reference` (default): the
    /// reference runs layers 0..A untapped; `engine`: each side's own hidden state (both run 0..A
    /// untapped, and the two are compared first as blk.{A-1}.resid_out, so a fault before A is
    /// named at that entry tap); a dump's path (.safetensors,
    /// comma-separated for one file per rank) holding `blk.{A-1}.resid_out`: nothing runs before
    /// A. With --candidate the default is the candidate dump's own (`candidate`).
    #[arg(long, value_name = "reference|engine|candidate|DUMP", requires = "layers")]
    pub residual_from: Option<String>,
    /// Feed the last N tokens through the engine's decode path (KV cache) one at a time; some
    /// faults only show in decode. The reference still runs the whole sequence.
    #[arg(long, default_value_t = 0)]
    pub decode_steps: usize,
    /// Print the run document as JSON on stdout (or write it to a file with --json-out).
    #[arg(long)]
    pub json: bool,
    /// Write the run document to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Write an HTML report.
    #[arg(long)]
    pub html: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    /// The model: a GGUF file (the first shard of a split one) or an HF checkpoint folder
    /// (config.json + safetensors).
    pub model: PathBuf,
    #[command(flatten)]
    pub input: InputArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// At most this many new tokens.
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Keep going past the end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// The model: a GGUF file (the first shard of a split one) or an HF checkpoint folder
    /// (config.json + safetensors).
    pub model: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Prompt length for the prefill (token ids cycle through the vocabulary deterministically).
    #[arg(long, default_value_t = 64)]
    pub n_prompt: usize,
    /// Decode steps after the prefill (engine backends). The per-token figure leaves out the
    /// first 2 (an op-by-op warm-up step and the one that records the CUDA decode graph) when
    /// there are more than 2; the figure with them is reported too.
    #[arg(long, default_value_t = 32)]
    pub n_decode: usize,
    /// Timed repetitions; the best is reported.
    #[arg(long, default_value_t = 3)]
    pub reps: usize,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
    /// `--backend cuda`: compile the kernels with the kernel trace, trace one steady decode step
    /// and write it to this file as a Chrome trace (chrome://tracing, ui.perfetto.dev): every
    /// block of every GEMV, norm, SwiGLU and attention launch on its SM's track. Where the step's
    /// time goes is printed (and under "kernel_trace" in --json). The other figures are then of
    /// the traced kernels, a little slower than the plain ones.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
}

/// How to reach a live OpenAI-compatible server (`entropy --server`, `gate --server`).
#[derive(Args, Debug, Clone)]
pub struct ServerArgs {
    /// Check a live OpenAI-compatible server (base URL, e.g. http://127.0.0.1:8000 or
    /// https://host/v1) from its top-k logprobs instead of running a backend here.
    #[arg(long)]
    pub server: Option<String>,
    /// The model name to send to --server (vLLM: the --served-model-name; llama.cpp: any).
    #[arg(long, default_value = "default")]
    pub served_model: String,
    /// Bearer API key for --server (default: the OPENAI_API_KEY environment variable).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests in flight at once to --server.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// top_logprobs asked of --server per position (vLLM's default cap, --max-logprobs, is 20).
    #[arg(long, default_value_t = 20)]
    pub top_logprobs: usize,
    /// Per-request timeout for --server, seconds, counted from when the request is sent; a request
    /// sent while others are in flight also gets their share (a server answering one at a time
    /// works through them first).
    #[arg(long, default_value_t = 120.0, value_parser = positive_seconds)]
    pub timeout: f64,
    /// Retries (exponential backoff from 0.5 s) on connection errors, 429 and 5xx.
    #[arg(long, default_value_t = 3)]
    pub retries: u32,
    /// Total time limit of the whole run's requests to --server, seconds (retries and backoff
    /// included; 0: none). Past it the run stops with exit 2.
    #[arg(long, default_value_t = 900.0, value_parser = non_negative)]
    pub deadline: f64,
}

impl ServerArgs {
    /// When the whole run must end, counted from `start` (`None` with `--deadline 0`).
    pub fn deadline_from(&self, start: std::time::Instant) -> Option<std::time::Instant> {
        (self.deadline > 0.0)
            .then(|| std::time::Duration::try_from_secs_f64(self.deadline.min(1e9)).ok())
            .flatten()
            .map(|d| start + d)
    }

    /// The client options, asking for `max_tokens` greedy tokens per prompt, all requests ending
    /// by `deadline` ([`Self::deadline_from`], taken once per run).
    pub fn options(&self, max_tokens: usize, deadline: Option<std::time::Instant>) -> crate::server::ServerOptions {
        let (url, basic) = crate::server::split_credentials(&self.server.clone().unwrap_or_default());
        crate::server::ServerOptions {
            url,
            basic,
            model: self.served_model.clone(),
            api_key: self
                .api_key
                .clone()
                .or_else(|| std::env::var("OPENAI_API_KEY").ok())
                .filter(|k| !k.is_empty()),
            top_k: self.top_logprobs,
            max_tokens,
            timeout: std::time::Duration::try_from_secs_f64(self.timeout.clamp(0.1, 86_400.0))
                .unwrap_or(std::time::Duration::from_secs(120)),
            retries: self.retries,
            backoff: std::time::Duration::from_millis(500),
            concurrency: self.concurrency.max(1),
            deadline,
            deadline_seconds: deadline.map(|_| self.deadline),
        }
    }
}

/// The calibrated verdict of a server against a reference (`entropy --server
/// --against-reference`, `gate --server`): one rule and one threshold set.
#[derive(Args, Debug, Clone)]
pub struct VerdictArgs {
    /// The floors and band thresholds (default: the committed golden/kld-calibration.json).
    #[arg(long)]
    pub kld_calibration: Option<PathBuf>,
    /// Exit code when the server is in the "precision loss" band (a quantized KV cache or weights:
    /// a trade-off, not a bug): 0 accepts it, 1 (the default) fails like "broken".
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(0..=1))]
    pub precision_loss_exit: u8,
}

impl VerdictArgs {
    pub fn calibration(&self) -> anyhow::Result<crate::kld_verdict::Calibration> {
        match &self.kld_calibration {
            Some(p) => crate::kld_verdict::Calibration::load(p),
            None => Ok(crate::kld_verdict::Calibration::committed()),
        }
    }
}

#[derive(Args, Debug)]
pub struct EntropyArgs {
    /// The GGUF model (optional with --server: then it gives the tokenizer, the vocabulary size
    /// and, with --against-reference, the reference).
    #[arg(required_unless_present = "server")]
    pub model: Option<PathBuf>,
    #[command(flatten)]
    pub live: ServerArgs,
    /// Vocabulary size for --server without MODEL.gguf (bounds the entropy and normalizes H / ln V).
    #[arg(long)]
    pub vocab: Option<usize>,
    /// One prompt per line, or JSONL of {"prompt": TEXT} / {"tokens": [ids]}.
    #[arg(long)]
    pub prompts: PathBuf,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Length of the greedy continuation scored for repetition (0 skips it).
    #[arg(long, default_value_t = 32)]
    pub max_new_tokens: usize,
    /// Also run the reference on every prompt and give KL-divergence statistics against it.
    #[arg(long)]
    pub against_reference: bool,
    /// A JSON file of thresholds ({"thresholds": {...}} as in golden/entropy-calibration.json).
    #[arg(long)]
    pub thresholds: Option<PathBuf>,
    /// The per-position KLD (nats) whose first crossing is reported as context; the calibrated
    /// verdict decides (see --kld-calibration).
    #[arg(long, value_parser = non_negative)]
    pub kld_threshold: Option<f64>,
    #[command(flatten)]
    pub verdict: VerdictArgs,
    /// With --server --against-reference: a trusted model source (the original GGUF, not the file
    /// the server loaded) to run as the reference; without it a fault in the deployed file's
    /// metadata is on both sides and invisible.
    #[arg(long, requires = "against_reference")]
    pub trusted_model: Option<PathBuf>,
    /// With --server --against-reference: also send each prompt as a one-turn conversation to
    /// /v1/chat/completions and check the server's prompt against the model's own chat template
    /// (rendered here) and its answer's logprobs against the reference.
    #[arg(long, requires = "against_reference")]
    pub chat: bool,
    /// With --server --against-reference: when to send the repeated-span probe that tells a RoPE
    /// fault from a uniform one (docs/entropy.md): `auto` only when the prompts read as a uniform
    /// rise, `always` (its figures are then reported even for a healthy server), `never`.
    #[arg(long, default_value = "auto", value_parser = ["auto", "always", "never"])]
    pub repeat_probe: String,
    /// Write an HTML report (entropy per position, KLD histogram).
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Print the run document as JSON on stdout.
    #[arg(long)]
    pub json: bool,
    /// Write the run document to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct GateArgs {
    /// Golden file(s) to check (golden/gate-*.json); may be repeated.
    #[arg(long, required = true)]
    pub golden: Vec<PathBuf>,
    /// A local run's engine: --backend runs on this backend instead of the one the golden file
    /// was blessed on (taps the two do not share are skipped); --inject makes the gate fail.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Gate a live server instead of a local run (with the --server options below).
    #[command(flatten)]
    pub live: ServerArgs,
    /// With --server: the per-position top-k KLD tolerance (nats; default: the golden file's,
    /// 0.25).
    #[arg(long, value_parser = non_negative)]
    pub kld_threshold: Option<f64>,
    /// With --server: send the golden prompts as token ids (exact; vLLM, SGLang and llama.cpp's
    /// own server take them, llama-cpp-python's does not) instead of their text.
    #[arg(long)]
    pub send_tokens: bool,
    /// With --server: also require this least share of positions whose top-1 is the golden's, in
    /// percent (without it the calibrated verdict alone decides the agreement case).
    #[arg(long, value_parser = percent)]
    pub min_top1: Option<f64>,
    #[command(flatten)]
    pub verdict: VerdictArgs,
    /// Write a JUnit XML report (one testcase per tap group and per prompt).
    #[arg(long)]
    pub junit: Option<PathBuf>,
    /// Write an HTML report (per golden file: verdict, first failure, every case).
    #[arg(long)]
    pub html: Option<PathBuf>,
    /// Print the result as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct GoldenArgs {
    #[command(subcommand)]
    pub command: GoldenCommand,
}

#[derive(Subcommand, Debug)]
pub enum GoldenCommand {
    /// Run a model and write a golden file for `gate` (golden/gate-*.json).
    Bless(BlessArgs),
}

#[derive(Args, Debug)]
pub struct BlessArgs {
    /// Re-bless an existing golden file from its own recipe (model, backend, TP, tokens, thresholds).
    #[arg(long, conflicts_with_all = ["model", "synth", "output"])]
    pub update: Option<PathBuf>,
    /// The model, inside the repository (stored relative to the repository root).
    #[arg(long, conflicts_with = "synth")]
    pub model: Option<PathBuf>,
    /// Synthesize this preset at gate time instead of naming a file.
    #[arg(long)]
    pub synth: Option<String>,
    /// Weight type for --synth (default: the preset's).
    #[arg(long, requires = "synth")]
    pub quant: Option<String>,
    /// Seed for --synth.
    #[arg(long, default_value_t = 0, requires = "synth")]
    pub seed: u64,
    /// A prompt (tokenized with the model's tokenizer); may be repeated.
    #[arg(long)]
    pub prompt: Vec<String>,
    /// A prompt as comma-separated token ids; may be repeated.
    #[arg(long)]
    pub tokens: Vec<String>,
    /// Keep at most this many tokens of each prompt (gate runs stay quick).
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Greedy continuation tokens to record per prompt (`gate --server` checks them).
    #[arg(long, default_value_t = crate::golden::GOLDEN_CONTINUATION)]
    pub continuation: usize,
    /// Record no tap summaries: a small positions-only file (top-k, entropy, continuation), for
    /// gating a server or a long prompt list.
    #[arg(long)]
    pub no_taps: bool,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Per-tap relative tolerance.
    #[arg(long, value_parser = non_negative)]
    pub tap_rel: Option<f64>,
    /// Per-position |Δ logprob| tolerance.
    #[arg(long, value_parser = non_negative)]
    pub logprob_abs: Option<f64>,
    /// Output file, golden/gate-NAME.json.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Print the result as JSON on stdout (logs stay on stderr).
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// The run document written by `diff-layers --json-out`.
    pub run: PathBuf,
    /// The HTML file to write (atomically: a temporary file, then a rename).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Print {"report", "bytes", "verdict"} as JSON on stdout.
    #[arg(long)]
    pub json: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine_args(argv: &[&str]) -> Result<EngineArgs, clap::Error> {
        let full = ["llmdiff", "generate", "m.gguf", "--prompt", "x"].iter().chain(argv);
        match Cli::try_parse_from(full)?.command {
            Command::Generate(a) => Ok(a.engine),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn one_set_of_engine_arguments_checked_in_one_place() {
        // --inject is parsed by clap into FaultSpec: a bad name never reaches a command.
        assert!(engine_args(&["--inject", "no-such-fault"]).is_err());
        let a = engine_args(&["--backend", "cpu", "--tp", "2", "--inject", "f16-residual@1:0"]).unwrap();
        let (kind, opts) = a.engine_options(a.backend_or(BackendArg::Reference)).unwrap();
        assert_eq!(kind, Some(engine::BackendKind::Cpu));
        assert_eq!((opts.tp, opts.faults.len()), (2, 1));
        assert_eq!(a.injected(), vec!["f16-residual@1:0".to_string()]);
        assert_eq!(opts.compute_dtype, engine::ComputeDtype::F32);
        let a = engine_args(&["--backend", "cpu", "--compute-dtype", "bf16"]).unwrap();
        let (_, opts) = a.engine_options(a.backend_or(BackendArg::Reference)).unwrap();
        assert_eq!(opts.compute_dtype, engine::ComputeDtype::Bf16);
        assert!(engine_args(&["--compute-dtype", "fp8"]).is_err());
        // The reference takes no --tp, --inject or CUDA flags; the CUDA flags need --backend cuda.
        for bad in [
            &["--backend", "reference", "--tp", "2"][..],
            &["--backend", "reference", "--inject", "f16-residual"],
            &["--backend", "reference", "--compute-dtype", "f16"],
            &["--backend", "cpu", "--cuda-graphs", "off"],
            &["--backend", "cpu", "--ranks", "nccl"],
            &["--backend", "cpu", "--tp", "0"],
        ] {
            let a = engine_args(bad).unwrap();
            assert!(a.engine_options(a.backend_or(BackendArg::Cpu)).is_err(), "{bad:?}");
        }
        // Defaults are the command's: generate runs the cpu engine at TP 1.
        let a = engine_args(&[]).unwrap();
        assert_eq!(a.backend_or(BackendArg::Cpu), BackendArg::Cpu);
        assert_eq!(a.tp(), 1);
    }
}
