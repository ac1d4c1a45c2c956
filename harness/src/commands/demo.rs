//! `llmdiff demo`: the embedded default. It synthesizes the `deepseek-v3-mini` miniature in a
//! temp dir and shows what llmdiff reads from it. (diff-layers joins it once the engine lands.)

use crate::cli::DemoArgs;
use crate::commands::synth::write_spec;
use crate::output::{config_json, open_model};
use references::synth::preset;
use references::ModelConfig;
use serde_json::json;
use std::process::ExitCode;

pub fn run(a: &DemoArgs) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("deepseek-v3-mini.gguf");
    let spec = preset("deepseek-v3-mini").expect("built-in preset");
    let bytes = write_spec(&spec, 0, &path, !a.json)?;
    let file = open_model(&path)?;
    let config = ModelConfig::from_header(&file.header)?;
    anyhow::ensure!(
        config == spec.config,
        "the synthesized model reads back with another config"
    );
    if a.json {
        let doc = json!({"model": "deepseek-v3-mini", "tensor_bytes": bytes, "n_tensors": file.tensors().len(),
                         "config": config_json(&config)});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        println!(
            "synthesized deepseek-v3-mini: {} tensors, {:.1} MiB, read back with the config it was written from",
            file.tensors().len(),
            bytes as f64 / (1 << 20) as f64
        );
        println!("{}", serde_json::to_string_pretty(&config_json(&config))?);
    }
    Ok(ExitCode::SUCCESS)
}
