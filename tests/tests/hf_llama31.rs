//! Llama 3.1+ RoPE scaling: the reference against HF transformers fp32 on a tiny random
//! Llama-3.1-style model (rope_type "llama3", factor 8, low/high frequency factors 1 and 4,
//! original context 64) converted by llama.cpp's convert_hf_to_gguf.py, which turns the rope
//! parameters into the `rope_freqs.weight` tensor. Expectations (full-vocabulary log-probs at every
//! position) were committed in golden/ by tests/peers/llama31_tiny.py.

use harness::logprobs::log_softmax;
use llmdiff_tests::fixtures::golden;
use references::dequant::dequantize_to_vec;
use references::forward::Reference;
use references::tap::NoTap;
use references::GgufFile;
use serde_json::Value;

const MODEL: &str = "llama31-tiny.f32.gguf";

#[test]
fn fixture_crosses_all_three_rope_bands() {
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let t = file
        .tensor("rope_freqs.weight")
        .expect("the converter writes rope_freqs.weight");
    let f = dequantize_to_vec(t.ty, file.tensor_data(t)).unwrap();
    assert!(f.contains(&1.0), "a pair above the high-frequency band: {f:?}");
    assert!(f.contains(&8.0), "a pair below the low-frequency band: {f:?}");
    assert!(
        f.iter().any(|&x| x > 1.0 && x < 8.0),
        "a pair in the smoothed band: {f:?}"
    );
    let r = Reference::new(&file).unwrap();
    assert!(r.config.rope_scaling.freq_factors);
}

/// Worst |Δlogprob| over the whole vocabulary, top-1 agreement and positions, with or without
/// the frequency factors applied.
fn compare(apply_factors: bool) -> (f64, usize, usize) {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(golden("hf-llama31-tiny.json")).unwrap()).unwrap();
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let mut r = Reference::new(&file).unwrap();
    r.config.rope_scaling.freq_factors = apply_factors;
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
        let argmax = |v: &mut dyn Iterator<Item = f64>| {
            v.enumerate()
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .unwrap()
                .0
        };
        for (row, hf) in logits.chunks(vocab).zip(case["logprobs"].as_array().unwrap()) {
            let lp = log_softmax(row);
            let hf: Vec<f64> = hf.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(hf.len(), vocab, "HF rows cover the whole vocabulary");
            if argmax(&mut lp.iter().copied()) == argmax(&mut hf.iter().copied()) {
                same_top1 += 1;
            }
            worst = lp.iter().zip(&hf).fold(worst, |w, (a, b)| w.max((a - b).abs()));
            n_pos += 1;
        }
    }
    (worst, same_top1, n_pos)
}

#[test]
fn llama31_rope_scaling_matches_hf_fp32_over_the_full_vocabulary() {
    let (worst, same, n) = compare(true);
    eprintln!("Llama 3.1 tiny vs HF fp32: worst |dlogprob| {worst:.2e} over the full vocabulary, top-1 {same}/{n}");
    assert!(n >= 16, "{n} positions");
    assert_eq!(same, n, "top-1 agreement");
    assert!(worst <= 2e-3, "worst |dlogprob| {worst}");
}

/// The same comparison with `rope_freqs.weight` ignored (what llmdiff did before) is far off, so
/// the test above can fail.
#[test]
fn ignoring_rope_freqs_is_far_from_hf() {
    let (worst, _, _) = compare(false);
    eprintln!("Llama 3.1 tiny, rope_freqs ignored: worst |dlogprob| {worst:.2e}");
    assert!(worst > 0.05, "worst |dlogprob| {worst}");
}
