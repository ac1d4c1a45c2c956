//! `llmdiff entropy`: flag flat or degenerate next-token distributions, with KL statistics
//! against the reference. Two modes, siblings that share [`shared`]: a local backend ([`local`])
//! or a live OpenAI-compatible server from its top-k logprobs ([`server`]).

use crate::cli::EntropyArgs;
use std::process::ExitCode;

pub mod local;
pub mod server;
pub mod shared;

pub fn run(a: &EntropyArgs) -> anyhow::Result<ExitCode> {
    if a.live.server.is_some() {
        server::run(a)
    } else {
        local::run(a)
    }
}
