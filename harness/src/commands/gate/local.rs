//! `llmdiff gate` on a local run: re-run what a golden file describes (its model, on its backend
//! or `--backend`, faults if `--inject`), and compare every tap and position within the recorded
//! thresholds.

use super::shared::case_of;
use crate::cli::{BackendArg, EngineArgs};
use crate::golden::{
    bless_hint, compare_position, compare_tap, materialize, repo_root_of, run_prompt, sha256_file, Check, Golden,
};
use crate::runner::Runner;
use references::ModelConfig;
use std::collections::HashMap;
use std::path::Path;
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

/// Gates one golden file on a local run with `engine`'s backend (default: the golden's own side) and faults.
pub fn gate_one(path: &Path, g: &Golden, engine_args: &EngineArgs) -> anyhow::Result<SuiteResult> {
    let t0 = Instant::now();
    let name = path.display().to_string();
    let hint = bless_hint(path);
    let root = repo_root_of(path)?;
    let model = materialize(&g.model, &root)?;
    let sha = sha256_file(&model.path)?;
    // The golden's own side (the reference, or the engine, blessed on the cpu), or --backend.
    let backend = engine_args.backend.unwrap_or(if g.backend == "reference" {
        BackendArg::Reference
    } else {
        BackendArg::Cpu
    });
    let engine = backend != BackendArg::Reference;
    let overridden = engine != (g.backend != "reference");
    let mut result = SuiteResult {
        golden: name,
        verdict: "pass".to_string(),
        backend: backend.name().to_string(),
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
    let mut args = engine_args.clone();
    // The golden's TP on the engine unless --tp; the reference refuses a --tp other than 1.
    args.tp = Some(if engine {
        engine_args.tp.unwrap_or(g.tp)
    } else {
        engine_args.tp.unwrap_or(1)
    });
    let (kind, opts) = args.engine_options(backend)?;
    let tp = opts.tp;
    let mut runner = Runner::new(&file, kind, opts)?;
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
