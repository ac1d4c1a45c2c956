//! `llmdiff logits`: per-position entropy and top-k log-probabilities from one forward pass.

use crate::cli::{BackendArg, InputArgs, LogitsArgs};
use crate::logprobs::{entropy, log_softmax, top_k};
use crate::output::open_model;
use crate::runner::Runner;
use anyhow::bail;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::GgufFile;
use serde_json::json;
use std::process::ExitCode;

/// The token ids for `--prompt` (the model's tokenizer, special tokens parsed, no BOS added) or
/// `--tokens`, checked against the vocabulary.
pub fn input_tokens(file: &GgufFile, input: &InputArgs) -> anyhow::Result<Vec<u32>> {
    let tokens = match (&input.tokens, &input.prompt) {
        (Some(t), _) => t.clone(),
        (None, Some(p)) => Tokenizer::for_model(file)?.encode(p, true)?,
        (None, None) => bail!("give --prompt TEXT or --tokens 1,2,3"),
    };
    if tokens.is_empty() {
        bail!("the input has no tokens");
    }
    Ok(tokens)
}

pub fn run(a: &LogitsArgs) -> anyhow::Result<ExitCode> {
    let backend = a.engine.backend_or(BackendArg::Reference);
    let (kind, mut opts) = a.engine.engine_options(backend)?;
    if a.json {
        opts.cuda.progress = None; // the kernel compile note: quiet under --json
    }
    let file = open_model(&a.model)?;
    let tokens = input_tokens(&file, &a.input)?;
    let logits = Runner::new(&file, kind, opts)?.logits(&tokens, &mut NoTap)?;
    if let Some(p) = &a.dump_f32 {
        let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
        crate::output::write_atomic(p, &bytes)?;
    }
    let vocab = logits.len() / tokens.len();
    let positions: Vec<_> = logits
        .chunks(vocab)
        .map(|row| {
            let lp = log_softmax(row);
            (entropy(&lp), top_k(&lp, a.top_k))
        })
        .collect();
    if a.json {
        let pos: Vec<_> = positions
            .iter()
            .map(|(h, top)| json!({"entropy": h, "top": top.iter().map(|(i, l)| json!([i, l])).collect::<Vec<_>>()}))
            .collect();
        let doc = json!({"model": a.model.display().to_string(), "backend": backend.name(),
                         "tp": a.engine.tp(), "injected": a.engine.injected(), "tokens": tokens, "positions": pos});
        println!("{}", serde_json::to_string(&doc)?);
    } else {
        println!(
            "{:>4} {:>8} {:>9}  top-{} (id:logprob)",
            "pos", "token", "entropy", a.top_k
        );
        for (i, (h, top)) in positions.iter().enumerate() {
            let shown: Vec<String> = top.iter().map(|(id, lp)| format!("{id}:{lp:.3}")).collect();
            println!("{i:>4} {:>8} {h:>9.4}  {}", tokens[i], shown.join(" "));
        }
    }
    Ok(ExitCode::SUCCESS)
}
