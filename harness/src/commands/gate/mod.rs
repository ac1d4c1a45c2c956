//! `llmdiff gate`: re-run what each golden file describes, compare every tap and position within
//! the recorded thresholds, print a summary, and write JUnit XML. Exit 0 pass, 1 fail, 2 bad input.
//! Two modes, siblings that share [`shared`]: a local run ([`local`]) or, with `--server URL`, a
//! live deployment ([`server`]); the outputs (summary, `--json`, `--junit`, `--html`) are the same.

use crate::cli::GateArgs;
use crate::golden::{read_golden, Golden};
use crate::junit::Suite;
use crate::output::write_atomic;
use anyhow::bail;
use shared::{print_suite, to_junit};
use std::process::ExitCode;

pub mod local;
pub mod server;
pub mod shared;

pub fn run(a: &GateArgs) -> anyhow::Result<ExitCode> {
    let server = a.live.server.is_some();
    let e = &a.engine;
    if server
        && (e.backend.is_some()
            || e.tp.is_some()
            || !e.inject.is_empty()
            || e.cuda_graphs.is_some()
            || e.ranks.is_some())
    {
        bail!("--backend, --tp, --inject, --cuda-graphs and --ranks apply to a local run, not to --server");
    }
    if !server && (a.kld_threshold.is_some() || a.min_top1.is_some()) {
        bail!("--kld-threshold and --min-top1 apply to --server");
    }
    if server && a.live.top_logprobs == 0 {
        bail!("--top-logprobs must be at least 1");
    }
    // Read every golden file first: a bad one is bad input before any work.
    let goldens: Vec<Golden> = a.golden.iter().map(|p| read_golden(p)).collect::<anyhow::Result<_>>()?;
    if server {
        for (path, g) in a.golden.iter().zip(&goldens) {
            server::check_servable(path, g)?;
        }
    }
    let mut results = Vec::new();
    for (path, g) in a.golden.iter().zip(&goldens) {
        results.push(if server {
            server::gate_one(path, g, a)?
        } else {
            local::gate_one(path, g, &a.engine)?
        });
    }
    let suites: Vec<Suite> = results.iter().map(to_junit).collect();
    if let Some(p) = &a.junit {
        write_atomic(p, crate::junit::render(&suites).as_bytes())?;
        eprintln!("junit: {}", p.display());
    }
    if let Some(p) = &a.html {
        write_atomic(p, reports::render_gate(&results).as_bytes())?;
        eprintln!("report: {}", p.display());
    }
    let pass = results.iter().all(|r| r.verdict == "pass");
    if a.json {
        let doc = serde_json::json!({"verdict": if pass { "pass" } else { "fail" }, "suites": results});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for r in &results {
            print_suite(r);
        }
    }
    Ok(if pass { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
