//! `llmdiff synth`: deterministic random-weight GGUF models.
use crate::cli::SynthArgs;
use std::process::ExitCode;
pub fn run(_a: &SynthArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("synth: not built yet")
}
