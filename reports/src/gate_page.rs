//! The `gate` report: overall pass/fail, one section per golden file with its first failure and
//! the bless hint, the server's agreement figures for `gate --server`, and a sortable table of its
//! cases (worst measure / threshold).

use crate::html::{escape, page};
use crate::schema::GateSuite;

/// Renders a gate run (one suite per golden file) as one self-contained HTML page.
pub fn render_gate(suites: &[GateSuite]) -> String {
    let pass = suites.iter().all(|s| s.verdict == "pass");
    let n_cases: usize = suites.iter().map(|s| s.cases.len()).sum();
    let n_failed: usize = suites
        .iter()
        .map(|s| s.cases.iter().filter(|c| !c.passed && !c.skipped).count())
        .sum();
    let mut body = format!(
        "<h1>llmdiff gate report</h1><p class=sub>{} golden files · {n_cases} cases</p>\
         <section id=diagnosis class=\"diag{}\"><div class=verdict>{}</div><p class=evidence>{}</p></section>",
        suites.len(),
        if pass { " agree" } else { "" },
        if pass { "PASS" } else { "FAIL" },
        if pass {
            "every case within its golden file's tolerance".to_string()
        } else {
            format!("{n_failed} of {n_cases} cases failed")
        }
    );
    for s in suites {
        body.push_str(&format!(
            "<section><h2>{} {} <span class=sub>({} TP {}, {:.1} s)</span></h2>",
            if s.verdict == "pass" { "PASS" } else { "FAIL" },
            escape(&s.golden),
            escape(&s.backend),
            s.tp,
            s.seconds
        ));
        if let Some(m) = &s.message {
            body.push_str(&format!("<p class=evidence>{}</p>", escape(m)));
        }
        if let Some(f) = &s.server {
            body.push_str(&format!(
                "<p class=evidence>server {} (model {}, top-{}, {} alignment): top-k KLD over {} positions mean {:.4}, p99 {:.4}, max {:.4}; same top-1 {:.1} %; overlap@k {:.3}; greedy {} of {} tokens equal; requests {:.1} s</p>",
                escape(&f.source.url),
                escape(&f.source.served_model),
                f.source.top_k,
                escape(&f.source.alignment),
                f.kld.n_positions,
                f.kld.mean,
                f.kld.p99,
                f.kld.max,
                f.kld.same_top1_pct,
                f.overlap.overlap_at_k,
                f.n_greedy_equal,
                f.n_greedy_compared,
                f.request_seconds
            ));
        }
        body.push_str(
            "<div class=scroll><table class=sort><thead><tr><th>case</th><th>result</th><th>worst / tolerance</th><th>first failure</th></tr></thead><tbody>",
        );
        for c in &s.cases {
            let result = if c.skipped {
                "skipped"
            } else if c.passed {
                "pass"
            } else {
                "FAIL"
            };
            let first = c
                .failures
                .first()
                .map_or(String::new(), |f| format!("{}: {}", f.item, f.detail));
            body.push_str(&format!(
                "<tr><td>{}</td><td>{result}</td><td>{:.3}</td><td>{}</td></tr>",
                escape(&c.name),
                c.worst_ratio,
                escape(&first)
            ));
        }
        body.push_str("</tbody></table></div></section>");
    }
    page("llmdiff gate", &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{GateCase, GateCheck};

    #[test]
    fn failing_suite_shows_its_first_failure() {
        let suite = GateSuite {
            golden: "golden/gate-x.json".into(),
            verdict: "fail".into(),
            backend: "cpu".into(),
            tp: 3,
            message: Some("first in execution order: blk.4.attn_out@r1 <over>".into()),
            cases: vec![GateCase {
                name: "prompt 1 / blk.4".into(),
                passed: false,
                skipped: false,
                worst_ratio: 13886.0,
                failures: vec![GateCheck {
                    item: "blk.4.attn_out@r1".into(),
                    ratio: 13886.0,
                    detail: "rel 1.1".into(),
                }],
            }],
            seconds: 1.0,
            server: None,
        };
        let html = render_gate(&[suite]);
        assert!(html.contains(">FAIL<"));
        assert!(html.contains("1 of 1 cases failed"));
        assert!(html.contains("blk.4.attn_out@r1 &lt;over&gt;"), "messages are escaped");
    }
}
