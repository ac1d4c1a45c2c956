//! Llama 3.1+ RoPE scaling: the reference against HF transformers fp32 on a tiny random
//! Llama-3.1-style model (rope_type "llama3", factor 8, low/high frequency factors 1 and 4,
//! original context 64) converted by llama.cpp's convert_hf_to_gguf.py, which turns the rope
//! parameters into the `rope_freqs.weight` tensor. Expectations (full-vocabulary log-probs at every
//! position) were committed in golden/ by tests/peers/llama31_tiny.py. The engine's CPU backend
//! applies the same factors (TP 1 and 2: `diff-layers` agrees and its logits match HF); its CUDA
//! backend refuses the model by name.

use engine::{BackendKind, Engine, EngineOptions};
use harness::diff::run_diff;
use harness::logprobs::log_softmax;
use llmdiff_tests::fixtures::golden;
use llmdiff_tests::models::plan;
use references::dequant::dequantize_to_vec;
use references::forward::Reference;
use references::tap::NoTap;
use references::writer::{GgufWriter, TensorSpec};
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

/// The HF golden's cases: each one's token ids and its `logprobs` rows.
fn hf_cases() -> Vec<(Vec<u32>, Value)> {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(golden("hf-llama31-tiny.json")).unwrap()).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let tokens = case["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            (tokens, case["logprobs"].clone())
        })
        .collect()
}

/// Worst |Δlogprob| over the whole vocabulary, top-1 agreement and positions, with or without
/// the frequency factors applied.
fn compare(apply_factors: bool) -> (f64, usize, usize) {
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let mut r = Reference::new(&file).unwrap();
    r.config.rope_scaling.freq_factors = apply_factors;
    compare_logits(|tokens| r.forward(tokens, &mut NoTap).unwrap())
}

/// [`compare`] for any forward pass: `forward` maps token ids to logits `[n, vocab]`.
fn compare_logits(mut forward: impl FnMut(&[u32]) -> Vec<f32>) -> (f64, usize, usize) {
    let (mut worst, mut same_top1, mut n_pos) = (0f64, 0, 0);
    for (tokens, hf_rows) in hf_cases() {
        let logits = forward(&tokens);
        let vocab = logits.len() / tokens.len();
        let argmax = |v: &mut dyn Iterator<Item = f64>| {
            v.enumerate()
                .max_by(|a, b| a.1.total_cmp(&b.1).then(b.0.cmp(&a.0)))
                .unwrap()
                .0
        };
        for (row, hf) in logits.chunks(vocab).zip(hf_rows.as_array().unwrap()) {
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

/// The engine on `file` (CPU backend, `tp` ranks) against HF fp32, as [`compare`].
fn compare_engine(file: &GgufFile, tp: usize) -> (f64, usize, usize) {
    let opts = EngineOptions {
        tp,
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let mut e = Engine::load(file, opts).unwrap();
    compare_logits(|tokens| e.prefill(tokens, &mut NoTap).unwrap())
}

/// The engine's CPU backend applies `rope_freqs.weight`: at TP 1 and 2 its logits match HF fp32
/// as the reference's do, and `diff-layers` (prefill and two decode steps) agrees at every tap.
#[test]
fn engine_cpu_applies_rope_freqs_at_tp_1_and_2() {
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let tokens = hf_cases().swap_remove(1).0;
    for tp in [1, 2] {
        let (worst, same, n) = compare_engine(&file, tp);
        eprintln!("engine cpu TP {tp} vs HF fp32: worst |dlogprob| {worst:.2e}, top-1 {same}/{n}");
        assert!(n >= 16, "{n} positions");
        assert_eq!(same, n, "TP {tp}: top-1 agreement");
        assert!(worst <= 2e-3, "TP {tp}: worst |dlogprob| {worst}");
        let run = run_diff(&plan(&file, tokens.clone(), tp, Vec::new(), 2)).unwrap();
        assert_eq!(
            run.verdict, "agree",
            "TP {tp}: diff-layers on the Llama 3.1 fixture: {:?}",
            run.first_divergence
        );
    }
}

/// A copy of the fixture without `rope_freqs.weight` (what a reader that ignored the tensor would
/// run): the engine's logits are then far from HF, so the test above can fail.
#[test]
fn engine_without_rope_freqs_is_far_from_hf() {
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("no-rope-freqs.gguf");
    let kept: Vec<_> = file
        .tensors()
        .iter()
        .filter(|t| t.name != "rope_freqs.weight")
        .collect();
    assert_eq!(
        kept.len() + 1,
        file.tensors().len(),
        "the fixture has rope_freqs.weight"
    );
    let specs = kept.iter().map(|t| TensorSpec::new(&t.name, t.ty, &t.ne)).collect();
    let out = std::fs::File::create(&path).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(out), file.metadata(), specs).unwrap();
    for t in &kept {
        w.write_tensor(file.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
    let stripped = GgufFile::open(&path).unwrap();
    let (worst, _, _) = compare_engine(&stripped, 1);
    eprintln!("engine cpu, rope_freqs removed: worst |dlogprob| {worst:.2e}");
    assert!(worst > 0.05, "worst |dlogprob| {worst}");
}
