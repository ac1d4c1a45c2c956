//! The `entropy` report: the overall verdict, a per-prompt table, entropy per position (backend
//! against the reference when it ran) for each prompt, and the histogram of per-position KLD.

use crate::charts::{render_entropy_chart, render_kld_histogram};
use crate::html::{escape, page};
use crate::schema::EntropyRun;

/// Renders an entropy run as one self-contained HTML page.
pub fn render_entropy(run: &EntropyRun) -> String {
    let bad = run.verdict != "healthy" || run.agreement.as_deref() == Some("diverged");
    let mut body = format!(
        "<h1>llmdiff entropy report</h1><p class=sub>{} · {} TP {} · {} prompts{}</p>",
        escape(&run.model),
        escape(&run.backend),
        run.tp,
        run.prompts.len(),
        if run.injected.is_empty() {
            String::new()
        } else {
            format!(" · injected {}", escape(&run.injected.join(" ")))
        }
    );
    body.push_str(&format!(
        "<section id=diagnosis class=\"diag{}\"><div class=verdict>{}</div><p class=evidence>{}</p></section>",
        if bad { "" } else { " agree" },
        escape(&run.verdict.to_uppercase()),
        escape(&match (&run.agreement, &run.kld) {
            (Some(a), Some(k)) => format!(
                "against the reference: {a}; KLD mean {:.3e}, p99 {:.3e}, max {:.3e}, same top-1 {:.2} %",
                k.mean, k.p99, k.max, k.same_top1_pct
            ),
            _ => "no reference comparison (run with --against-reference)".to_string(),
        })
    ));
    body.push_str("<section><h2>Prompts</h2><div class=scroll><table class=sort><thead><tr><th>prompt</th><th>verdict</th><th>H/ln V</th><th>top-1 logprob</th><th>top-5 recurrence</th><th>repetition</th><th>KLD mean</th></tr></thead><tbody>");
    for p in &run.prompts {
        body.push_str(&format!(
            "<tr><td>{}</td><td>{}</td><td>{:.3}</td><td>{:.3}</td><td>{:.2}</td><td>{:.2}</td><td>{}</td></tr>",
            escape(&p.label),
            escape(&p.verdict),
            p.norm_entropy,
            p.mean_top1_logprob,
            p.top5_recurrence,
            p.repetition,
            p.kld.as_ref().map_or("–".to_string(), |k| format!("{:.3e}", k.mean))
        ));
    }
    body.push_str("</tbody></table></div></section>");
    let kld: Vec<f64> = run
        .prompts
        .iter()
        .flat_map(|p| p.kld_positions.iter().copied())
        .collect();
    if !kld.is_empty() {
        body.push_str(&format!(
            "<section><h2>KL divergence per position</h2>{}</section>",
            render_kld_histogram(&kld)
        ));
    }
    for p in run.prompts.iter().filter(|p| !p.entropies.is_empty()) {
        body.push_str(&format!(
            "<section><h2>Entropy per position: {}</h2>{}</section>",
            escape(&p.label),
            render_entropy_chart(&p.entropies, &p.reference_entropies)
        ));
    }
    page(&format!("llmdiff entropy: {}", run.model), &body)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{EntropyThresholds, PromptEntropy};

    #[test]
    fn renders_verdict_prompts_and_charts() {
        let prompt = PromptEntropy {
            label: "a <b> prompt".into(),
            n_tokens: 3,
            verdict: "degenerate".into(),
            reasons: vec!["repetition 0.9".into()],
            mean_entropy: 1.0,
            min_entropy: 0.5,
            norm_entropy: 0.1,
            mean_top1_logprob: -0.5,
            top5_recurrence: 0.2,
            recurring_top5: vec![],
            repetition: 0.9,
            continuation: vec![],
            continuation_text: None,
            nonfinite: 0,
            kld: None,
            entropies: vec![1.0, 2.0, 0.5],
            reference_entropies: vec![1.0, 1.5, 0.5],
            kld_positions: vec![0.0, 0.3, 1e-6],
            entropy_upper: None,
            topk_residual: None,
            overlap: None,
        };
        let run = EntropyRun {
            format: 1,
            llmdiff_version: "0".into(),
            model: "m.gguf".into(),
            backend: "cpu".into(),
            tp: 2,
            injected: vec![],
            vocab: 10,
            max_new_tokens: 0,
            thresholds: EntropyThresholds {
                flat_norm_entropy: 0.6,
                flat_top1_logprob: -4.0,
                degenerate_repetition: 0.6,
                degenerate_top5_recurrence: 0.6,
                kld_position: 0.05,
            },
            verdict: "degenerate".into(),
            agreement: None,
            prompts: vec![prompt],
            kld: None,
            seconds: 0.0,
            overlap: None,
            server: None,
        };
        let html = render_entropy(&run);
        assert!(html.contains("DEGENERATE"));
        assert!(html.contains("a &lt;b&gt; prompt"), "labels are escaped");
        assert_eq!(
            html.matches("<svg").count(),
            2,
            "one KLD histogram and one entropy chart"
        );
    }
}
