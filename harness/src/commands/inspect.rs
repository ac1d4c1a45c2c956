//! `llmdiff inspect`: metadata (long arrays summarized), the tensor table and the parsed config;
//! each key and tensor with its role (used / skipped / unknown, see `references::allowlist`).

use crate::cli::InspectArgs;
use crate::output::{config_json, meta_json, open_model};
use serde_json::json;
use std::process::ExitCode;

pub fn run(a: &InspectArgs) -> anyhow::Result<ExitCode> {
    let file = open_model(&a.model)?;
    let config = references::ModelConfig::from_header(&file.header);
    // The role of each key and tensor (none when the architecture is not one llmdiff runs).
    let audit = references::allowlist::audit(&file.header).ok();
    let key_role = |i: usize| audit.as_ref().map_or("-".to_string(), |a| a.keys[i].1.to_string());
    let tensor_role = |i: usize| audit.as_ref().map_or("-".to_string(), |a| a.tensors[i].1.to_string());
    let summarize_over = if a.full { usize::MAX } else { 16 };
    if a.json {
        let metadata: serde_json::Map<String, serde_json::Value> = file
            .metadata()
            .iter()
            .map(|(k, v)| (k.clone(), meta_json(v, summarize_over)))
            .collect();
        let tensors: Vec<_> = file
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| json!({"name": t.name, "type": t.ty.name(), "ne": t.ne, "offset": t.offset, "n_bytes": t.n_bytes, "use": tensor_role(i)}))
            .collect();
        let metadata_use: serde_json::Map<String, serde_json::Value> = file
            .metadata()
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), json!(key_role(i))))
            .collect();
        let doc = json!({
            "file": a.model.display().to_string(),
            "file_size": file.file_size(),
            "version": file.header.version,
            "alignment": file.header.alignment,
            "data_offset": file.header.data_offset,
            "metadata": metadata,
            "metadata_use": metadata_use,
            "tensors": tensors,
            "config": match &config { Ok(c) => config_json(c), Err(e) => json!({"error": e.to_string()}) },
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, {:.1} MiB",
        a.model.display(),
        file.header.version,
        file.metadata().len(),
        file.tensors().len(),
        file.file_size() as f64 / (1 << 20) as f64
    );
    println!("\nmetadata:");
    for (i, (k, v)) in file.metadata().iter().enumerate() {
        let shown = match v {
            references::MetaValue::Array { items, .. } if items.len() > summarize_over => {
                let head: Vec<String> = items.iter().take(6).map(|i| i.to_string()).collect();
                format!("[{}, ... ({} items)]", head.join(", "), items.len())
            }
            _ => v.to_string(),
        };
        println!("  {k:<48} {shown}   [{}]", key_role(i));
    }
    println!("\ntensors:");
    println!(
        "  {:<32} {:<6} {:<22} {:>12} {:>12}  use",
        "name", "type", "ne", "bytes", "offset"
    );
    for (i, t) in file.tensors().iter().enumerate() {
        let ne = format!("{:?}", t.ne);
        println!(
            "  {:<32} {:<6} {:<22} {:>12} {:>12}  {}",
            t.name,
            t.ty.name(),
            ne,
            t.n_bytes,
            t.offset,
            tensor_role(i)
        );
    }
    println!("\nconfig:");
    match config {
        Ok(c) => println!("{}", serde_json::to_string_pretty(&config_json(&c))?),
        Err(e) => println!("  (not a model llmdiff can run: {e})"),
    }
    Ok(ExitCode::SUCCESS)
}
