//! `llmdiff demo`: the embedded default. It synthesizes the `deepseek-v3-mini` miniature (MLA +
//! MoE) in a temp dir, diffs a healthy TP 2 engine against the reference, then the seed story's
//! fault (kv_b loaded unsharded in layer 1), prints the diagnosis and writes `llmdiff-demo.html`.
//! Seconds, no downloads. Exit 0 when the healthy run agrees and the fault is found.

use crate::cli::DemoArgs;
use crate::commands::diff_layers::print_summary;
use crate::compare::{ActDtype, Tolerances};
use crate::diff::{run_diff, DiffPlan};
use crate::output::{open_model, shell_quote, write_atomic, write_spec};
use references::synth::preset;
use references::tokenizer::Tokenizer;
use serde_json::json;
use std::path::Path;
use std::process::ExitCode;

const PROMPT: &str = "<|im_start|>user\nWhere do the two passes part?<|im_end|>";
const FAULT: &str = "kv-b-unsharded@1";

pub fn run(a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("deepseek-v3-mini.gguf");
    let spec = preset("deepseek-v3-mini").expect("built-in preset");
    write_spec(&spec, 0, &path, !a.json)?;
    let file = open_model(&path)?;
    let tokens = Tokenizer::for_model(&file)?.encode(PROMPT, true)?;
    let plan = |faults: Vec<engine::FaultSpec>, repro: String| DiffPlan {
        file: &file,
        model_name: "deepseek-v3-mini (synthetic)".to_string(),
        tokens: tokens.clone(),
        engine: engine::EngineOptions {
            tp: 2,
            faults,
            backend: engine::BackendKind::Cpu,
            ..engine::EngineOptions::default()
        },
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro,
    };
    let base = "llmdiff synth --preset deepseek-v3-mini -o m.gguf && llmdiff diff-layers m.gguf --tp 2";
    let prompt = shell_quote(PROMPT);
    let healthy = run_diff(&plan(Vec::new(), format!("{base} --prompt {prompt}")))?;
    let faulty = run_diff(&plan(
        vec![FAULT.parse()?],
        format!("{base} --prompt {prompt} --inject {FAULT}"),
    ))?;
    let html = Path::new("llmdiff-demo.html");
    write_atomic(html, reports::render_diff(&faulty).as_bytes())?;
    let ok = healthy.verdict == "agree" && faulty.verdict == "diverged";
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"healthy": healthy, "faulty": faulty, "html": html}))?
        );
    } else {
        println!("== 1. healthy engine, TP 2, against the reference ==\n");
        print_summary(&healthy);
        println!("\n== 2. the same engine with --inject {FAULT} (the seed story: kv_b loaded unsharded) ==\n");
        print_summary(&faulty);
        println!("\nreport written to {}", std::fs::canonicalize(html)?.display());
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
