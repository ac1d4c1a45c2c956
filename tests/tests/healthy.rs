//! Healthy runs (issue 5): every preset × weight type × valid TP degree, prefill and decode, plus
//! the real SmolLM2 at TP 1 and 3 on a real prompt, must all agree with the reference (no false
//! positive). The worst healthy rel_l2 per site over all of them is the measured basis of the
//! default thresholds in `harness::compare`; the margin to the f32 default must be ≥ 10×.

use engine::valid_tp_degrees;
use harness::compare::{ActDtype, Tolerances};
use harness::diff::run_diff;
use llmdiff_tests::fixtures::smollm2;
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::tap::TapKey;
use references::tokenizer::Tokenizer;
use references::{GgmlType, GgufFile, ModelConfig};
use std::collections::BTreeMap;
use std::time::Instant;

const QUANTS: [GgmlType; 6] = [
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

/// The worst rel_l2 seen per site, with the case and tap it came from.
#[derive(Default)]
struct Worst {
    by_site: BTreeMap<String, (f64, String, f64)>,
    n_runs: usize,
    false_positives: Vec<String>,
}

fn run_case(worst: &mut Worst, case: String, file: &GgufFile, toks: Vec<u32>, tp: usize, decode_steps: usize) {
    let run = run_diff(&plan(file, toks, tp, Vec::new(), decode_steps)).unwrap_or_else(|e| panic!("{case}: {e:#}"));
    worst.n_runs += 1;
    if run.verdict != "agree" {
        worst.false_positives.push(format!(
            "{case}: {} at {} ({})",
            run.verdict,
            run.first_divergence.as_ref().map_or("?".into(), |f| f.tap.clone()),
            run.diagnosis.as_ref().map_or(String::new(), |d| d.explanation.clone())
        ));
    }
    for t in &run.taps {
        let e = worst
            .by_site
            .entry(t.site.clone())
            .or_insert((0.0, String::new(), t.threshold));
        if t.metrics.rel_l2 > e.0 || e.1.is_empty() {
            *e = (t.metrics.rel_l2.max(e.0), format!("{case} {}", t.tap), t.threshold);
        }
    }
}

fn tps(c: &ModelConfig) -> Vec<usize> {
    let valid = valid_tp_degrees(c);
    [1, 2, 3, 4, 8].into_iter().filter(|t| valid.contains(t)).collect()
}

#[test]
fn healthy_runs_agree_with_margin() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let mut worst = Worst::default();
    // (preset, layers, tokens): the big presets cut or given fewer tokens.
    let presets: [(&str, Option<usize>, usize); 4] = [
        ("llama-tiny", None, 8),
        ("deepseek-v3-mini", None, 8),
        ("smollm2-135m", Some(2), 6),
        ("glm5-mini", None, 4),
    ];
    for (name, n_layers, n_tokens) in presets {
        let t_preset = Instant::now();
        for quant in QUANTS {
            let s = spec(name, n_layers, Some(quant));
            let file = synth(dir.path(), &format!("{name}-{quant:?}"), &s);
            let toks = tokens(s.config.vocab, n_tokens);
            for tp in tps(&s.config) {
                run_case(
                    &mut worst,
                    format!("{name} {quant:?} tp{tp}"),
                    &file,
                    toks.clone(),
                    tp,
                    0,
                );
                // The decode path (KV cache) on one weight type per preset.
                if quant == GgmlType::Q8_0 {
                    let case = format!("{name} {quant:?} tp{tp} decode 3");
                    run_case(&mut worst, case, &file, toks.clone(), tp, 3);
                }
            }
            std::fs::remove_file(&file.path).ok();
        }
        eprintln!("{name}: {:.1}s", t_preset.elapsed().as_secs_f64());
    }
    // The real model on a real prompt.
    let t_real = Instant::now();
    let file = GgufFile::open(smollm2()).expect("open SmolLM2");
    let tok = Tokenizer::from_gguf(&file.header).expect("SmolLM2 tokenizer");
    let toks = tok
        .encode("The capital of France is Paris, and the capital of Italy is", false)
        .unwrap();
    for tp in [1, 3] {
        run_case(
            &mut worst,
            format!("SmolLM2-135M Q4_1 tp{tp}"),
            &file,
            toks.clone(),
            tp,
            0,
        );
    }
    eprintln!(
        "SmolLM2 real ({} tokens): {:.1}s",
        toks.len(),
        t_real.elapsed().as_secs_f64()
    );

    let default_f32 = Tolerances::default().threshold(&"blk.0.attn_out".parse::<TapKey>().unwrap(), ActDtype::F32);
    eprintln!(
        "\n{} healthy runs, {} false positives, {:.1}s\n{:<12} {:>11} {:>10} {:>8}  worst at",
        worst.n_runs,
        worst.false_positives.len(),
        t0.elapsed().as_secs_f64(),
        "site",
        "worst rel_l2",
        "threshold",
        "margin"
    );
    let mut min_margin = f64::INFINITY;
    for (site, (rel, at, thr)) in &worst.by_site {
        let margin = if *rel > 0.0 { thr / rel } else { f64::INFINITY };
        eprintln!("{site:<12} {rel:>11.3e} {thr:>10.1e} {margin:>8.1}  {at}");
        // Activation sites held to the f32 default (weights and expert ids compare exactly).
        if !site.starts_with("w.") && *thr > 0.0 {
            min_margin = min_margin.min(margin);
        }
    }
    let worst_act = worst
        .by_site
        .iter()
        .filter(|(s, (_, _, thr))| !s.starts_with("w.") && *thr > 0.0)
        .map(|(_, (r, _, _))| *r)
        .fold(0f64, f64::max);
    eprintln!(
        "worst activation rel_l2 {worst_act:.3e}: {:.1}× under the f32 default {default_f32:.0e}; smallest per-site margin {min_margin:.1}×",
        default_f32 / worst_act
    );
    assert!(
        worst.false_positives.is_empty(),
        "false positives:\n{}",
        worst.false_positives.join("\n")
    );
    assert!(
        min_margin >= 10.0,
        "a healthy site comes within {min_margin:.1}× of its threshold (want ≥ 10×): the defaults in compare.rs need a look"
    );
}
