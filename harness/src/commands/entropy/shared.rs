//! What the local and `--server` entropy checks share: the thresholds a run uses, the outputs
//! (`--json-out`, `--html`, `--json`) with the exit code, and the terminal summary.

use crate::cli::EntropyArgs;
use crate::entropy::default_thresholds;
use crate::kld_verdict::{Band, Verdict};
use crate::output::{term, write_atomic};
use anyhow::Context;
use references::tokenizer::Tokenizer;
use reports::{EntropyRun, EntropyThresholds};
use std::path::Path;
use std::process::ExitCode;

/// The thresholds a run uses: `--thresholds FILE` or the defaults, then `--kld-threshold`.
pub fn thresholds(a: &EntropyArgs) -> anyhow::Result<EntropyThresholds> {
    let mut t = match &a.thresholds {
        Some(p) => load_thresholds(p)?,
        None => default_thresholds(),
    };
    if let Some(k) = a.kld_threshold {
        t.kld_position = k;
    }
    Ok(t)
}

/// Thresholds from a file: `{"thresholds": {...}}` or the bare object.
fn load_thresholds(path: &Path) -> anyhow::Result<EntropyThresholds> {
    let text = crate::output::read_text(path)?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    let t = v.get("thresholds").cloned().unwrap_or(v);
    let t: EntropyThresholds =
        serde_json::from_value(t).with_context(|| format!("{}: bad thresholds", path.display()))?;
    check_thresholds(&t).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    Ok(t)
}

/// Every entropy threshold finite; all but the (negative) top-1 logprob floor ≥ 0.
pub fn check_thresholds(t: &EntropyThresholds) -> Result<(), String> {
    use crate::golden::check_threshold;
    check_threshold("flat_norm_entropy", t.flat_norm_entropy)?;
    check_threshold("degenerate_repetition", t.degenerate_repetition)?;
    check_threshold("degenerate_top5_recurrence", t.degenerate_top5_recurrence)?;
    check_threshold("kld_position", t.kld_position)?;
    if !(t.flat_top1_logprob.is_finite() && t.flat_top1_logprob <= 0.0) {
        return Err(format!(
            "flat_top1_logprob is {}: a logprob threshold must be a finite number <= 0",
            t.flat_top1_logprob
        ));
    }
    Ok(())
}

/// What a run reports beside its [`EntropyRun`] document: warnings (a continuation cut short for
/// length) and, with `--against-reference`, the calibrated verdict. They go into the JSON as the
/// top-level keys `warnings` and `kld_verdict`, and into the HTML report as a section under the
/// title.
#[derive(Default)]
pub struct Extra {
    pub warnings: Vec<String>,
    pub kld_verdict: Option<serde_json::Value>,
    /// One line per item for the HTML section (the verdict's headline and evidence).
    pub html_lines: Vec<String>,
    /// The exit code the verdict asks for when the run is otherwise healthy (`--precision-loss-exit`).
    pub exit_code: Option<u8>,
    /// `--chat`: the template findings and the answers' verdict (JSON key `chat`).
    pub chat: Option<serde_json::Value>,
}

impl Extra {
    /// Records the calibrated verdict: its JSON, its lines for the HTML report, and the exit code
    /// its band asks for (`--precision-loss-exit`).
    pub fn set_verdict(&mut self, v: &Verdict, precision_loss_exit: u8) -> anyhow::Result<()> {
        self.html_lines.push(v.headline.clone());
        self.html_lines.extend(v.evidence.iter().cloned());
        self.html_lines.extend(v.blind_spot.iter().cloned());
        self.kld_verdict = Some(serde_json::to_value(v)?);
        if v.band == Band::PrecisionLoss {
            self.exit_code = Some(precision_loss_exit);
        }
        Ok(())
    }

    fn json(&self, run: &EntropyRun) -> anyhow::Result<serde_json::Value> {
        let mut v = serde_json::to_value(run)?;
        if let Some(o) = v.as_object_mut() {
            if !self.warnings.is_empty() {
                o.insert("warnings".into(), serde_json::json!(self.warnings));
            }
            if let Some(k) = &self.kld_verdict {
                o.insert("kld_verdict".into(), k.clone());
            }
            if let Some(c) = &self.chat {
                o.insert("chat".into(), c.clone());
            }
        }
        Ok(v)
    }

    /// The report page with this section after its title.
    fn html(&self, page: String) -> String {
        let lines: Vec<&String> = self.html_lines.iter().chain(&self.warnings).collect();
        if lines.is_empty() {
            return page;
        }
        let items: String = lines
            .iter()
            .map(|l| format!("<li>{}</li>", crate::junit::escape(l)))
            .collect();
        let section = format!("<section id=verdict-notes><ul>{items}</ul></section>");
        match page.find("</h1>") {
            Some(at) => format!("{}{section}{}", &page[..at + 5], &page[at + 5..]),
            None => page,
        }
    }
}

/// Writes `--json-out` and `--html`, prints the JSON or the human summary, and maps the verdict to
/// the exit code (0 healthy and agreeing, 1 otherwise). Shared by the local and `--server` checks.
pub fn finish(
    a: &EntropyArgs,
    run: &EntropyRun,
    extra: &Extra,
    print_human: impl FnOnce(),
) -> anyhow::Result<ExitCode> {
    let doc = extra.json(run)?;
    if let Some(p) = &a.json_out {
        write_atomic(p, serde_json::to_string_pretty(&doc)?.as_bytes())?;
    }
    if let Some(p) = &a.html {
        write_atomic(p, extra.html(reports::render_entropy(run)).as_bytes())?;
        eprintln!("report: {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_human();
        for w in &extra.warnings {
            println!("  warning: {}", term(w));
        }
    }
    if run.prompts.is_empty() || run.kld.as_ref().is_some_and(|k| k.n_positions == 0) {
        // A verdict of health or agreement needs at least one compared value.
        anyhow::bail!("no prompt or position was checked: nothing to give a verdict on");
    }
    // 0 healthy and within noise (or agreeing, locally); precision loss: --precision-loss-exit.
    let healthy = run.verdict == "healthy";
    Ok(match run.agreement.as_deref() {
        _ if !healthy => ExitCode::from(1),
        None | Some("agree") | Some("within numeric noise") => ExitCode::SUCCESS,
        Some("precision loss") => ExitCode::from(extra.exit_code.unwrap_or(1)),
        Some(_) => ExitCode::from(1),
    })
}

/// Prints the calibrated verdict's headline and evidence under the summary.
pub fn print_verdict(v: &Verdict) {
    println!("\n  {}", v.headline);
    for e in &v.evidence {
        println!("    {}", term(e));
    }
    if let Some(b) = &v.blind_spot {
        println!("    note: {b}");
    }
}

pub fn print_summary(run: &EntropyRun, tok: Option<&Tokenizer>) {
    let ln_v = (run.vocab as f64).ln();
    println!(
        "{}: {} prompts, {} TP {}{}; ln V = {:.2}",
        term(&run.model),
        run.prompts.len(),
        run.backend,
        run.tp,
        if run.injected.is_empty() {
            String::new()
        } else {
            format!(", injected {}", run.injected.join(" "))
        },
        ln_v
    );
    println!(
        "\n  {:<4} {:<10} {:>6} {:>6} {:>7} {:>7} {:>6} {:>5} {:>9}  prompt",
        "#", "verdict", "H", "minH", "H/lnV", "top1lp", "rec5", "rep", "KLD"
    );
    for (i, p) in run.prompts.iter().enumerate() {
        println!(
            "  {:<4} {:<10} {:>6.3} {:>6.3} {:>7.4} {:>7.2} {:>6.2} {:>5.2} {:>9}  {}",
            i + 1,
            p.verdict,
            p.mean_entropy,
            p.min_entropy,
            p.norm_entropy,
            p.mean_top1_logprob,
            p.top5_recurrence,
            p.repetition,
            p.kld.as_ref().map_or("-".to_string(), |k| format!("{:.2e}", k.mean)),
            term(&p.label)
        );
    }
    for (i, p) in run.prompts.iter().enumerate().filter(|(_, p)| p.verdict != "healthy") {
        let names: Vec<String> = p
            .recurring_top5
            .iter()
            .map(|(id, n)| {
                let s = tok
                    .and_then(|t| t.decode(&[*id]).ok())
                    .unwrap_or_else(|| id.to_string());
                format!("{s:?}×{n}")
            })
            .collect();
        println!("\n  #{} {}: {}", i + 1, term(&p.verdict), term(&p.reasons.join("; ")));
        println!("     recurring top-5: {}", term(&names.join(" ")));
        if let Some(t) = &p.continuation_text {
            println!("     continuation: {t:?}");
        }
    }
    if let Some(k) = &run.kld {
        println!(
            "\n  KLD vs reference over {} positions: mean {:.6} ± {:.6}, median {:.6}, p90 {:.6}, p99 {:.6}, p99.9 {:.6}, max {:.6}",
            k.n_positions, k.mean, k.mean_se, k.median, k.p90, k.p99, k.p99_9, k.max
        );
        println!("  same top-1 {:.2} %, RMS Δp {:.3} %", k.same_top1_pct, k.rms_dp_pct);
        // The calibrated verdict (a band, not one position's maximum) decides; the first position
        // over --kld-threshold is context.
        let first = run
            .prompts
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.kld.as_ref().and_then(|k| k.first_over).map(|pos| (i, pos)));
        if let Some((i, pos)) = first {
            println!(
                "  first position over KLD {}: prompt #{} position {}",
                k.threshold,
                i + 1,
                pos
            );
        }
    }
    print_verdict_line(run);
}

fn print_verdict_line(run: &EntropyRun) {
    println!(
        "\nverdict: {} over {} prompts, {} positions{}  ({:.1}s)",
        run.verdict,
        run.prompts.len(),
        run.prompts.iter().map(|p| p.n_tokens).sum::<usize>(),
        run.agreement
            .as_ref()
            .map_or(String::new(), |a| format!(", against the reference: {a}")),
        run.seconds
    );
}
