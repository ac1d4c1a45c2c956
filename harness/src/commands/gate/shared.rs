//! What the local and `--server` gates share: a case from its checks, and a suite as JUnit and
//! as the terminal summary.

use crate::golden::Check;
use crate::junit::{Case, Suite};
use crate::output::term;
use reports::{GateCase as CaseResult, GateSuite as SuiteResult};
use std::path::Path;

/// A case from its checks: failed where a check is over its tolerance (ratio > 1 or NaN).
pub fn case_of(name: String, checks: Vec<Check>, skipped: bool) -> CaseResult {
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

/// The suite of a golden file that could not be gated: no cases, verdict `"error"`, the error
/// as its message (JUnit: an `<error>`; the HTML report: FAIL with the message).
pub fn error_suite(path: &Path, msg: &str) -> SuiteResult {
    SuiteResult {
        golden: path.display().to_string(),
        verdict: "error".to_string(),
        backend: String::new(),
        tp: 1,
        message: Some(format!("error (exit 2): {msg}")),
        cases: Vec::new(),
        seconds: 0.0,
        server: None,
    }
}

pub fn to_junit(r: &SuiteResult) -> Suite {
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

pub fn print_suite(r: &SuiteResult) {
    let n_pass = r.cases.iter().filter(|c| c.passed).count();
    let worst = r
        .cases
        .iter()
        .filter(|c| c.worst_ratio.is_finite())
        .max_by(|a, b| a.worst_ratio.total_cmp(&b.worst_ratio));
    println!(
        "{} {}: {}, {}/{} cases pass{}  ({:.1}s)",
        if r.verdict == "pass" { "PASS" } else { "FAIL" },
        term(&r.golden),
        term(&match &r.server {
            Some(_) => r.backend.clone(),
            None => format!("{} TP {}", r.backend, r.tp),
        }),
        n_pass,
        r.cases.len(),
        match r.cases.iter().find(|c| !c.passed) {
            // A failed run's headline names what failed, not the worst of what passed.
            Some(f) => format!(", first failure: {}", term(&f.name)),
            None => worst.map_or(String::new(), |w| format!(
                ", worst {} at {:.2} of its tolerance",
                term(&w.name),
                w.worst_ratio
            )),
        },
        r.seconds
    );
    if let Some(m) = &r.message {
        println!("  {}", term(m));
        for c in r.cases.iter().filter(|c| !c.passed).take(6) {
            let Some(f) = c.failures.first() else { continue };
            println!(
                "  ✗ {}: {} ({} over): {}",
                term(&c.name),
                term(&f.item),
                c.failures.len(),
                term(&f.detail)
            );
        }
    }
}
