//! The reference against HF transformers fp32 on the same GGUF weights (expectations committed
//! in golden/ by tests/peers/hf_logits.py): top-1 agreement 100 % and max |Δlogprob| over HF's
//! top-50 at every position within 2e-3.

use harness::logprobs::log_softmax;
use llmdiff_tests::fixtures::{golden, smollm2};
use references::forward::Reference;
use references::tap::NoTap;
use references::GgufFile;
use serde_json::Value;
use std::path::Path;

/// Worst |Δlogprob| and top-1 agreement of the reference against a golden HF file.
fn compare(model: &Path, golden_file: &str) -> (f64, usize, usize) {
    compare_edited(model, golden_file, |_| {})
}

/// [`compare`] with the reference's config first changed by `edit`.
fn compare_edited(
    model: &Path,
    golden_file: &str,
    edit: impl FnOnce(&mut references::config::ModelConfig),
) -> (f64, usize, usize) {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(golden(golden_file)).unwrap()).unwrap();
    let file = GgufFile::open(model).unwrap();
    let mut r = Reference::new(&file).unwrap();
    edit(&mut r.config);
    let (mut worst, mut same_top1, mut n_pos) = (0f64, 0, 0);
    for case in doc["cases"].as_array().unwrap() {
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let logits = r.forward(&tokens, &mut NoTap).unwrap();
        let vocab = logits.len() / tokens.len();
        for (row, pos) in logits.chunks(vocab).zip(case["positions"].as_array().unwrap()) {
            let lp = log_softmax(row);
            let top = pos["top"].as_array().unwrap();
            let ours_top1 = (0..vocab)
                .max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)))
                .unwrap();
            if ours_top1 as u64 == top[0][0].as_u64().unwrap() {
                same_top1 += 1;
            }
            for e in top {
                let (id, hf) = (e[0].as_u64().unwrap() as usize, e[1].as_f64().unwrap());
                worst = worst.max((lp[id] - hf).abs());
            }
            n_pos += 1;
        }
    }
    (worst, same_top1, n_pos)
}

#[test]
fn smollm2_reference_matches_hf_fp32() {
    let (worst, same, n) = compare(smollm2(), "hf-smollm2.json");
    eprintln!("SmolLM2 vs HF fp32: worst |dlogprob| {worst:.2e} over top-50, top-1 {same}/{n}");
    assert_eq!(same, n, "top-1 agreement");
    assert!(worst <= 2e-3, "worst |dlogprob| {worst}");
}

/// A tiny DeepSeek-V3 (MLA + MoE, sigmoid gating, groups, shared expert) built with transformers
/// and converted by llama.cpp's convert_hf_to_gguf.py (tests/peers/deepseek_v3_tiny.py).
#[test]
fn deepseek_v3_tiny_reference_matches_hf_fp32() {
    let (worst, same, n) = compare(&golden("deepseek-v3-tiny.f32.gguf"), "hf-deepseek-v3-tiny.json");
    eprintln!("DeepSeek-V3 tiny vs HF fp32: worst |dlogprob| {worst:.2e} over top-50, top-1 {same}/{n}");
    assert_eq!(same, n, "top-1 agreement");
    assert!(worst <= 2e-3, "worst |dlogprob| {worst}");
}

/// The same DeepSeek-V3 with YaRN RoPE as its releases declare it (mscale = mscale_all_dim; base
/// 100, factor 4, original context 64 so the ramp acts within the prompts;
/// `deepseek_v3_tiny.py --yarn`): HF's frequencies on q and k_pe, the softmax scale from the log
/// multiplier. Control: without YaRN it is far off.
#[test]
fn deepseek_v3_yarn_tiny_reference_matches_hf_fp32() {
    let path = golden("deepseek-v3-yarn-tiny.f32.gguf");
    let (worst, same, n) = compare(&path, "hf-deepseek-v3-yarn-tiny.json");
    eprintln!("DeepSeek-V3 YaRN tiny vs HF fp32: worst |dlogprob| {worst:.2e} over top-50, top-1 {same}/{n}");
    assert_eq!(same, n, "top-1 agreement");
    assert!(worst <= 2e-3, "worst |dlogprob| {worst}");
    let (plain, _, _) = compare_edited(&path, "hf-deepseek-v3-yarn-tiny.json", |c| c.yarn = None);
    eprintln!("DeepSeek-V3 YaRN tiny without YaRN: worst |dlogprob| {plain:.2e}");
    assert!(plain > 0.05, "{plain}");
}

/// The TP engine runs the YaRN file (its MLA RoPE takes YaRN's per-pair divisors, its softmax
/// the log-multiplier scale) and agrees with the reference at every tap, prefill and decode, at
/// TP 1 and 2. Control: the ramp is not a no-op on this file (the divisors differ from 1 on the
/// pairs it interpolates), so an engine without it would rotate differently.
#[test]
fn the_engine_runs_yarn_and_agrees_with_the_reference() {
    use harness::diff::run_diff;
    use llmdiff_tests::models::{plan, tokens};
    let f = GgufFile::open(golden("deepseek-v3-yarn-tiny.f32.gguf")).unwrap();
    let c = references::ModelConfig::from_header(&f.header).unwrap();
    let y = c.yarn.clone().expect("the file declares YaRN");
    let plain: Vec<f64> = (0..c.rope_dim / 2)
        .map(|i| (c.rope_base as f64).powf(-((2 * i) as f64) / c.rope_dim as f64))
        .collect();
    let ramped = y.inv_freq(c.rope_base as f64, c.rope_dim);
    let scaled = plain
        .iter()
        .zip(&ramped)
        .filter(|(p, r)| (*p / *r - 1.0).abs() > 1e-3)
        .count();
    assert!(scaled > 0, "YaRN scales no pair on this fixture");
    for tp in [1, 2] {
        for decode_steps in [0, 2] {
            let run = run_diff(&plan(&f, tokens(c.vocab, 20), tp, vec![], decode_steps)).unwrap();
            assert!(
                run.first_divergence.is_none(),
                "tp {tp} decode {decode_steps}: diverged at {:?} ({})",
                run.first_divergence.as_ref().map(|d| &d.tap),
                run.verdict
            );
            assert!(run.taps.iter().any(|t| t.tap == "logits"));
        }
    }
}
