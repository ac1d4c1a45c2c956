//! `llmdiff generate`: a greedy continuation of a prompt on the reference or the engine (cpu or
//! cuda, any TP, faults if asked): what the deployment would answer, at a glance. A healthy engine
//! continues as the reference does; `--inject phantom-attn-out` shows the garbage a broken one
//! produces.

use crate::cli::{BackendArg, GenerateArgs};
use crate::commands::logits::input_tokens;
use crate::output::open_model;
use crate::runner::Runner;
use references::tokenizer::Tokenizer;
use serde_json::json;
use std::io::IsTerminal;
use std::process::ExitCode;
use std::time::Instant;

/// What `generate` produced.
pub struct Generated {
    pub backend: &'static str,
    pub injected: Vec<String>,
    pub prompt: Vec<u32>,
    pub tokens: Vec<u32>,
    /// Decoded by the model's tokenizer, when it has one.
    pub prompt_text: Option<String>,
    pub text: Option<String>,
    pub stopped_at_eos: bool,
    pub seconds: f64,
}

/// Runs the greedy continuation `a` asks for.
pub fn generate(a: &GenerateArgs) -> anyhow::Result<Generated> {
    let (kind, mut opts) = a.engine.engine_options(a.engine.backend_or(BackendArg::Cpu))?;
    if a.json {
        opts.cuda.progress = None; // the kernel compile note: quiet under --json
    }
    let file = open_model(&a.model)?;
    let prompt = input_tokens(&file, &a.input)?;
    let tokenizer = Tokenizer::for_model(&file).ok();
    let stop = if a.ignore_eos {
        None
    } else {
        tokenizer.as_ref().and_then(|t| t.eos_id())
    };
    let mut runner = Runner::new(&file, kind, opts)?;
    let t0 = Instant::now();
    let (tokens, _) = runner.greedy(&prompt, a.max_new_tokens, stop)?;
    let seconds = t0.elapsed().as_secs_f64();
    let text = |ids: &[u32]| tokenizer.as_ref().and_then(|t| t.decode(ids).ok());
    Ok(Generated {
        backend: runner.backend_name(),
        injected: a.engine.injected(),
        prompt_text: text(&prompt),
        text: text(&tokens),
        stopped_at_eos: stop.is_some() && tokens.last() == stop.as_ref(),
        prompt,
        tokens,
        seconds,
    })
}

pub fn run(a: &GenerateArgs) -> anyhow::Result<ExitCode> {
    let g = generate(a)?;
    let n = g.tokens.len();
    if a.json {
        let doc = json!({
            "model": a.model.display().to_string(), "backend": g.backend, "tp": a.engine.tp(), "injected": g.injected,
            "prompt_tokens": g.prompt, "tokens": g.tokens, "prompt_text": g.prompt_text, "text": g.text,
            "stopped_at_eos": g.stopped_at_eos, "seconds": g.seconds, "tokens_per_s": n as f64 / g.seconds,
        });
        println!("{doc}");
    } else {
        // The continuation in bold on a terminal.
        let (b0, b1) = if std::io::stdout().is_terminal() {
            ("\x1b[1m", "\x1b[0m")
        } else {
            ("", "")
        };
        match (&g.prompt_text, &g.text) {
            (Some(p), Some(t)) => println!("{p}{b0}{t}{b1}"),
            _ => println!("{:?} -> {b0}{:?}{b1}", g.prompt, g.tokens),
        }
        let faults = if g.injected.is_empty() {
            String::new()
        } else {
            format!(", injected {}", g.injected.join(" "))
        };
        eprintln!(
            "{n} new tokens in {:.2} s ({:.1} tok/s, prefill included) on {} TP {}{faults}",
            g.seconds,
            n as f64 / g.seconds,
            g.backend,
            a.engine.tp()
        );
    }
    Ok(ExitCode::SUCCESS)
}
