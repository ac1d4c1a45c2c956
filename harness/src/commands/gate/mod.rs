//! `llmdiff gate`: re-run what each golden file describes, compare every tap and position within
//! the recorded thresholds, print a summary, and write JUnit XML. Exit 0 pass, 1 fail, 2 bad input.
//! JUnit and HTML are written on exit 2 as well, the failing golden file as a test error.
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
    let deadline = a.live.deadline_from(std::time::Instant::now());
    let mut results = Vec::new();
    // A golden file that cannot be gated (the server unreachable, past the deadline, a malformed
    // answer) stops the run with exit 2, but the JUnit and HTML reports are still written: that
    // golden file as a test error, the ones before it with their results.
    let mut error: Option<(usize, anyhow::Error)> = None;
    for (i, (path, g)) in a.golden.iter().zip(&goldens).enumerate() {
        let r = if server {
            server::gate_one(path, g, a, deadline)
        } else {
            local::gate_one(path, g, &a.engine)
        };
        match r {
            Ok(s) => results.push(s),
            Err(e) => {
                error = Some((i, e));
                break;
            }
        }
    }
    let mut suites: Vec<Suite> = results.iter().map(to_junit).collect();
    let mut shown = results.clone();
    if let Some((i, e)) = &error {
        let path = &a.golden[*i];
        let msg = format!("{e:#}").replace('\n', " ");
        let mut s = shared::error_suite(path, &msg);
        s.backend = match &a.live.server {
            Some(u) => format!("server {}", crate::server::redact_url(u)),
            None => "local".to_string(),
        };
        suites.push(to_junit(&s));
        if let Some(last) = suites.last_mut() {
            last.error = Some(msg);
        }
        shown.push(s);
    }
    if let Some(p) = &a.junit {
        write_atomic(p, crate::junit::render(&suites).as_bytes())?;
        eprintln!("junit: {}", p.display());
    }
    if let Some(p) = &a.html {
        write_atomic(p, reports::render_gate(&shown).as_bytes())?;
        eprintln!("report: {}", p.display());
    }
    if let Some((_, e)) = error {
        return Err(e);
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
