//! `llmdiff gate`: re-run what each golden file describes, compare every tap and position within
//! the recorded thresholds, print a summary, and write JUnit XML. Exit 0 pass, 1 fail, 2 bad input.
//! With `--server URL` the golden files gate a live deployment instead ([`super::gate_server`]);
//! the outputs (summary, `--json`, `--junit`, `--html`) are the same.

use crate::cli::{BackendArg, GateArgs};
use crate::entropy::Runner;
use crate::golden::{
    bless_hint, compare_position, compare_tap, materialize, read_golden, repo_root_of, run_prompt, sha256_file, Check,
    Golden,
};
use crate::junit::{Case, Suite};
use crate::output::write_atomic;
use anyhow::bail;
use engine::FaultSpec;
use references::ModelConfig;
use std::collections::HashMap;
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use reports::{GateCase as CaseResult, GateSuite as SuiteResult};

/// The tap group a tap belongs to: `embed`, `blk.N` or `output`.
fn group_of(tap: &str) -> String {
    if tap.starts_with("embed") {
        "embed".into()
    } else if let Some(rest) = tap.strip_prefix("blk.") {
        format!("blk.{}", rest.split('.').next().unwrap_or(""))
    } else {
        "output".into()
    }
}

pub fn run(a: &GateArgs) -> anyhow::Result<ExitCode> {
    let faults: Vec<FaultSpec> = a
        .inject
        .iter()
        .map(|s| s.parse::<FaultSpec>().map_err(|e| anyhow::anyhow!("--inject {s}: {e}")))
        .collect::<Result<_, _>>()?;
    let server = a.live.server.is_some();
    if server && (a.backend.is_some() || !faults.is_empty()) {
        bail!("--backend and --inject apply to a local run, not to --server");
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
            crate::commands::gate_server::check_servable(path, g)?;
        }
    }
    let mut results = Vec::new();
    for (path, g) in a.golden.iter().zip(&goldens) {
        results.push(if server {
            crate::commands::gate_server::gate_one(path, g, a)?
        } else {
            gate_one(path, g, a.backend, &faults)?
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

fn gate_one(path: &Path, g: &Golden, backend: Option<BackendArg>, faults: &[FaultSpec]) -> anyhow::Result<SuiteResult> {
    let t0 = Instant::now();
    let name = path.display().to_string();
    let hint = bless_hint(path);
    let root = repo_root_of(path)?;
    let model = materialize(&g.model, &root)?;
    let sha = sha256_file(&model.path)?;
    // The golden's own side (the reference, or the engine, blessed on the cpu), or --backend.
    let backend = backend.unwrap_or(if g.backend == "reference" {
        BackendArg::Reference
    } else {
        BackendArg::Cpu
    });
    let engine = backend != BackendArg::Reference;
    let overridden = engine != (g.backend != "reference");
    let mut result = SuiteResult {
        golden: name,
        verdict: "pass".to_string(),
        backend: format!("{backend:?}").to_lowercase(),
        tp: g.tp,
        message: None,
        cases: Vec::new(),
        seconds: 0.0,
        server: None,
    };
    if sha != g.model_sha256 {
        let what = match &g.model {
            crate::golden::ModelSource::Synth { .. } => "synth is no longer deterministic, or its output changed",
            crate::golden::ModelSource::Path { .. } => "the model file changed",
        };
        let msg = format!(
            "model sha256 {}… but the golden file was blessed on {}…: {what}; if intended, re-bless: {hint}",
            &sha[..16],
            &g.model_sha256[..16.min(g.model_sha256.len())]
        );
        result.cases.push(CaseResult {
            name: "model sha256".into(),
            passed: false,
            skipped: false,
            worst_ratio: f64::INFINITY,
            failures: vec![Check {
                item: "model".into(),
                ratio: f64::INFINITY,
                detail: msg.clone(),
            }],
        });
        result.verdict = "fail".to_string();
        result.message = Some(msg);
        result.seconds = t0.elapsed().as_secs_f64();
        return Ok(result);
    }
    let file = model.open()?;
    let vocab = ModelConfig::from_header(&file.header)?.vocab;
    let tp = if engine { g.tp } else { 1 };
    let mut runner = Runner::new(&file, backend, tp, faults.to_vec())?;
    result.tp = tp;
    let mut first_fail: Option<String> = None;
    for (pi, p) in g.prompts.iter().enumerate() {
        let (taps, _, logps) = run_prompt(&mut runner, &p.tokens, vocab, !p.taps.is_empty())?;
        let new: HashMap<&str, &crate::golden::TapSummary> = taps.iter().map(|t| (t.tap.as_str(), t)).collect();
        // Tap groups in execution order (the golden's order).
        let mut groups: Vec<(String, Vec<Check>, bool)> = Vec::new();
        for old in &p.taps {
            let grp = group_of(&old.tap);
            if groups.last().is_none_or(|g| g.0 != grp) {
                groups.push((grp, Vec::new(), false));
            }
            let slot = groups.last_mut().expect("pushed above");
            match new.get(old.tap.as_str()) {
                Some(n) => slot.1.push(compare_tap(n, old, &g.thresholds)),
                None if overridden => slot.2 = true,
                None => slot.1.push(Check {
                    item: old.tap.clone(),
                    ratio: f64::INFINITY,
                    detail: "the run has no such tap (stale golden file?)".into(),
                }),
            }
        }
        if !overridden {
            let known: std::collections::HashSet<&str> = p.taps.iter().map(|t| t.tap.as_str()).collect();
            let extra: Vec<&str> = taps
                .iter()
                .map(|t| t.tap.as_str())
                .filter(|t| !known.contains(t))
                .collect();
            if !extra.is_empty() {
                groups.push((
                    "new taps".into(),
                    vec![Check {
                        item: extra[0].to_string(),
                        ratio: f64::INFINITY,
                        detail: format!(
                            "{} taps the golden file lacks (stale golden file?), e.g. {}",
                            extra.len(),
                            extra[0]
                        ),
                    }],
                    false,
                ));
            }
        }
        for (grp, checks, skipped_some) in groups {
            let case = case_of(format!("prompt {} / {grp}", pi + 1), checks, skipped_some && overridden);
            if first_fail.is_none() {
                if let Some(f) = case.failures.first() {
                    first_fail = Some(format!("prompt {} {}: {}", pi + 1, f.item, f.detail));
                }
            }
            result.cases.push(case);
        }
        let pos_checks: Vec<Check> = if logps.len() != p.positions.len() {
            vec![Check {
                item: "positions".into(),
                ratio: f64::INFINITY,
                detail: format!("{} positions, golden {}", logps.len(), p.positions.len()),
            }]
        } else {
            logps
                .iter()
                .zip(&p.positions)
                .enumerate()
                .map(|(i, (lp, old))| compare_position(i, lp, old, &g.thresholds))
                .collect()
        };
        let case = case_of(format!("prompt {} / positions", pi + 1), pos_checks, false);
        if first_fail.is_none() {
            if let Some(f) = case.failures.first() {
                first_fail = Some(format!("prompt {} {}: {}", pi + 1, f.item, f.detail));
            }
        }
        result.cases.push(case);
    }
    if let Some(f) = first_fail {
        let n_fail = result.cases.iter().filter(|c| !c.passed).count();
        result.verdict = "fail".to_string();
        result.message = Some(format!(
            "{n_fail} of {} cases failed; first in execution order: {f}; if the change is intended, re-bless: {hint}",
            result.cases.len()
        ));
    }
    result.seconds = t0.elapsed().as_secs_f64();
    Ok(result)
}

/// A case from its checks: failed where a check is over its tolerance (ratio > 1 or NaN).
pub(crate) fn case_of(name: String, checks: Vec<Check>, skipped: bool) -> CaseResult {
    let worst = checks.iter().map(|c| c.ratio).fold(0.0f64, f64::max);
    let failures: Vec<Check> = checks
        .into_iter()
        .filter(|c| c.ratio.is_nan() || c.ratio > 1.0)
        .collect();
    CaseResult {
        name,
        passed: failures.is_empty(),
        skipped: skipped && failures.is_empty() && worst == 0.0,
        worst_ratio: worst,
        failures,
    }
}

fn to_junit(r: &SuiteResult) -> Suite {
    let suite = Path::new(&r.golden)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| r.golden.clone());
    Suite {
        name: suite.clone(),
        seconds: r.seconds,
        properties: vec![
            ("golden".into(), r.golden.clone()),
            ("backend".into(), r.backend.clone()),
            ("tp".into(), r.tp.to_string()),
        ],
        cases: r
            .cases
            .iter()
            .map(|c| Case {
                name: c.name.clone(),
                classname: format!("llmdiff.gate.{suite}"),
                seconds: 0.0,
                failure: c.failures.first().map(|f| {
                    let details: Vec<String> = c.failures.iter().map(|f| format!("{}: {}", f.item, f.detail)).collect();
                    (
                        format!(
                            "{} of the checks over tolerance; first {}: {}",
                            c.failures.len(),
                            f.item,
                            f.detail
                        ),
                        details.join("\n"),
                    )
                }),
                skipped: c.skipped.then(|| "not emitted by this backend".to_string()),
            })
            .collect(),
        error: None,
    }
}

fn print_suite(r: &SuiteResult) {
    let n_pass = r.cases.iter().filter(|c| c.passed).count();
    let worst = r
        .cases
        .iter()
        .filter(|c| c.worst_ratio.is_finite())
        .max_by(|a, b| a.worst_ratio.total_cmp(&b.worst_ratio));
    println!(
        "{} {}: {}, {}/{} cases pass{}  ({:.1}s)",
        if r.verdict == "pass" { "PASS" } else { "FAIL" },
        r.golden,
        match &r.server {
            Some(_) => r.backend.clone(),
            None => format!("{} TP {}", r.backend, r.tp),
        },
        n_pass,
        r.cases.len(),
        worst.map_or(String::new(), |w| format!(
            ", worst {} at {:.2} of its tolerance",
            w.name, w.worst_ratio
        )),
        r.seconds
    );
    if let Some(m) = &r.message {
        println!("  {m}");
        for c in r.cases.iter().filter(|c| !c.passed).take(6) {
            let f = &c.failures[0];
            println!("  ✗ {}: {} ({} over): {}", c.name, f.item, c.failures.len(), f.detail);
        }
    }
}
