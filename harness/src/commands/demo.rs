//! `llmdiff demo`: the embedded default, the seed story on GLM-5's shapes. It synthesizes the
//! `glm5-mini` miniature (glm-dsa: MLA with 64 heads, kv_b [28672, 512], the DSA lightning
//! indexer, MoE) in a temp dir and diffs a TP 8 engine against the reference three times: healthy;
//! with kv_b loaded unsharded in layer 1 (every rank computes with rank 0's heads); with the MLA
//! custom op never writing its output buffer on rank 3. It prints each diagnosis and writes
//! `llmdiff-demo.html` (the kv_b run). Seconds, no downloads. Exit 0 when the healthy run agrees
//! and both faults are found.

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

/// Longer than the indexer's top_k (16 in glm5-mini), so every query's sparse selection matters.
const PROMPT: &str = "<|user|>Why does the model answer ,,,,[v elas(l(l(l ?";
const PRESET: &str = "glm5-mini";
const TP: usize = 8;
/// The seed story's two faults, in the order the demo tells them.
const FAULTS: [(&str, &str); 2] = [
    (
        "kv-b-unsharded@1",
        "kv_b loaded unsharded: every rank computes with rank 0's heads",
    ),
    (
        "phantom-attn-out@1:3",
        "the MLA custom op never writes its preallocated output on rank 3",
    ),
];

pub fn run(a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(format!("{PRESET}.gguf"));
    let spec = preset(PRESET).expect("built-in preset");
    write_spec(&spec, 0, &path, !a.json)?;
    let file = open_model(&path)?;
    let tokens = Tokenizer::for_model(&file)?.encode(PROMPT, true)?;
    let base = format!(
        "llmdiff synth --preset {PRESET} -o m.gguf && llmdiff diff-layers m.gguf --tp {TP} --prompt {}",
        shell_quote(PROMPT)
    );
    let diff = |inject: Option<&str>| -> anyhow::Result<reports::DiffRun> {
        let faults = inject.map(str::parse).transpose()?.into_iter().collect();
        let repro = match inject {
            Some(f) => format!("{base} --inject {f}"),
            None => base.clone(),
        };
        run_diff(&DiffPlan {
            file: &file,
            model_name: format!("{PRESET} (synthetic glm-dsa)"),
            tokens: tokens.clone(),
            engine: engine::EngineOptions {
                tp: TP,
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
        })
    };
    let healthy = diff(None)?;
    let faulty = FAULTS
        .iter()
        .map(|(f, _)| diff(Some(f)))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let html = Path::new("llmdiff-demo.html");
    write_atomic(html, reports::render_diff(&faulty[0]).as_bytes())?;
    let ok = healthy.verdict == "agree" && faulty.iter().all(|r| r.verdict == "diverged");
    if a.json {
        let runs: serde_json::Map<_, _> = FAULTS
            .iter()
            .zip(&faulty)
            .map(|((f, _), r)| (f.to_string(), json!(r)))
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({"healthy": healthy, "faulty": runs, "html": html}))?
        );
    } else {
        println!("== 1. healthy engine, TP {TP}, against the reference ==\n");
        print_summary(&healthy);
        for (i, ((f, story), run)) in FAULTS.iter().zip(&faulty).enumerate() {
            println!("\n== {}. the same engine with --inject {f} ({story}) ==\n", i + 2);
            print_summary(run);
        }
        println!("\nreport written to {}", std::fs::canonicalize(html)?.display());
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
