//! `llmdiff demo`: the embedded default run.
use crate::cli::DemoArgs;
use std::process::ExitCode;
pub fn run(_a: &DemoArgs) -> anyhow::Result<ExitCode> {
    anyhow::bail!("demo: not built yet")
}
