//! `llmdiff report RUN.json -o OUT.html`: re-render a saved diff-layers run document as an HTML
//! report. Refuses a document of another format version with a hint to regenerate it.

use crate::cli::ReportArgs;
use crate::output::write_atomic;
use anyhow::{bail, Context};
use reports::{DiffRun, DIFF_FORMAT};
use std::process::ExitCode;

pub fn run(a: &ReportArgs) -> anyhow::Result<ExitCode> {
    let text = crate::output::read_text(&a.run)?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not a JSON document", a.run.display()))?;
    match value.get("format").and_then(|f| f.as_u64()) {
        Some(f) if f == u64::from(DIFF_FORMAT) => {}
        Some(f) => bail!(
            "{}: run document format {f}, this llmdiff reads format {DIFF_FORMAT}; hint: regenerate it with this version's `llmdiff diff-layers ... --json-out RUN.json` (its repro command is inside the file)",
            a.run.display()
        ),
        None => bail!(
            "{}: no \"format\" field, so not a diff-layers run document; hint: write one with `llmdiff diff-layers ... --json-out RUN.json`",
            a.run.display()
        ),
    }
    let run: DiffRun = serde_json::from_value(value)
        .with_context(|| format!("{}: not a diff-layers run document", a.run.display()))?;
    run.validate()
        .map_err(|e| anyhow::anyhow!("{}: invalid run document: {e}", a.run.display()))?;
    let html = reports::render_diff(&run);
    write_atomic(&a.output, html.as_bytes())?;
    if a.json {
        println!(
            "{}",
            serde_json::json!({"report": a.output.display().to_string(), "bytes": html.len(), "verdict": run.verdict})
        );
    } else {
        eprintln!("report: {} ({} KiB)", a.output.display(), html.len().div_ceil(1024));
    }
    Ok(ExitCode::SUCCESS)
}
