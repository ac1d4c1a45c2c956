//! The DSA families (`deepseek32` = DeepSeek-V3.2, `glm-dsa` = GLM-5) in the reference against HF
//! transformers fp32 on tiny random models converted by llama.cpp's convert_hf_to_gguf.py
//! (llama-cpp-python 0.3.36; tests/peers/deepseek32_tiny.py and glm_dsa_tiny.py). Prompts of
//! 17+ tokens against indexer top_k 4 (deepseek32) and 3 (glm-dsa, with `shared` indexer layers),
//! so the sparse selection decides the attention; HF on the same weights with top_k above the
//! sequence (`dense_positions`) shows the difference is the selection. Also: the indexer taps,
//! the selection rule on the reference's own taps, and the TP engine (CPU, TP 2) against HF too.

use harness::logprobs::log_softmax;
use harness::selection::{compare_taps, Rule};
use llmdiff_tests::fixtures::golden;
use references::forward::Reference;
use references::tap::{CollectTap, NoTap, Site, TapKey};
use references::GgufFile;
use serde_json::Value;

/// Worst |Δlogprob| over HF's top-50 and top-1 agreement, against `field` of the golden file,
/// with the indexer's top_k replaced by `top_k` when given.
fn compare(model: &str, golden_file: &str, field: &str, top_k: Option<usize>) -> (f64, usize, usize) {
    let file = GgufFile::open(golden(model)).unwrap();
    let mut r = Reference::new(&file).unwrap();
    if let Some(k) = top_k {
        r.config.indexer.as_mut().unwrap().top_k = k;
    }
    compare_with(golden_file, field, |tokens| r.forward(tokens, &mut NoTap).unwrap())
}

/// [`compare`] for any forward pass `forward` (every position's logits).
fn compare_with(golden_file: &str, field: &str, mut forward: impl FnMut(&[u32]) -> Vec<f32>) -> (f64, usize, usize) {
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(golden(golden_file)).unwrap()).unwrap();
    let (mut worst, mut same_top1, mut n_pos) = (0f64, 0, 0);
    for case in doc["cases"].as_array().unwrap() {
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let logits = forward(&tokens);
        let vocab = logits.len() / tokens.len();
        for (row, pos) in logits.chunks(vocab).zip(case[field].as_array().unwrap()) {
            let lp = log_softmax(row);
            let top = pos["top"].as_array().unwrap();
            let ours = (0..vocab)
                .max_by(|&a, &b| lp[a].total_cmp(&lp[b]).then(b.cmp(&a)))
                .unwrap();
            if ours as u64 == top[0][0].as_u64().unwrap() {
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

fn check_family(name: &str) {
    let model = format!("{name}-tiny.f32.gguf");
    let json = format!("hf-{name}-tiny.json");
    let (worst, same, n) = compare(&model, &json, "positions", None);
    eprintln!("{name} tiny (sparse) vs HF fp32: worst |dlogprob| {worst:.2e} over top-50, top-1 {same}/{n}");
    assert!(n >= 16, "{n} positions");
    assert_eq!(same, n, "top-1 agreement");
    assert!(worst <= 2e-3, "worst |dlogprob| {worst}");
    // Dense: the reference with top_k above the sequence against HF's dense run.
    let (worst_d, same_d, n_d) = compare(&model, &json, "dense_positions", Some(1 << 20));
    eprintln!("{name} tiny (dense) vs HF fp32 dense: worst |dlogprob| {worst_d:.2e}, top-1 {same_d}/{n_d}");
    assert_eq!(same_d, n_d, "dense top-1 agreement");
    assert!(worst_d <= 2e-3, "dense worst |dlogprob| {worst_d}");
    // The selection matters: the sparse reference is far from HF dense.
    let (gap, _, _) = compare(&model, &json, "dense_positions", None);
    eprintln!("{name} tiny: sparse reference vs HF dense: worst |dlogprob| {gap:.2}");
    assert!(
        gap > 0.5,
        "sparse vs dense differ by only {gap}: the fixture does not exercise the selection"
    );
}

#[test]
fn deepseek32_tiny_reference_matches_hf_fp32_sparse_and_dense() {
    check_family("deepseek32");
}

#[test]
fn glm_dsa_tiny_reference_matches_hf_fp32_sparse_and_dense() {
    check_family("glm-dsa");
}

#[test]
fn dsa_configs_read_the_indexer_and_its_layer_types() {
    let f = GgufFile::open(golden("glm-dsa-tiny.f32.gguf")).unwrap();
    let ix = Reference::new(&f).unwrap().config.indexer.unwrap();
    assert_eq!((ix.n_heads, ix.head_dim, ix.top_k), (8, 32, 3));
    assert_eq!(ix.full, vec![true, false, true, false]);
    assert!(!ix.rope_neox, "glm-dsa's indexer RoPE is interleaved");
    let f = GgufFile::open(golden("deepseek32-tiny.f32.gguf")).unwrap();
    let c = Reference::new(&f).unwrap().config;
    let ix = c.indexer.clone().unwrap();
    assert_eq!(ix.top_k, 4);
    assert!(ix.full.iter().all(|&x| x) && ix.rope_neox);
    // A prompt no longer than top_k never exercises the selection: the run says so.
    let w = c.coverage_warnings(4);
    assert!(
        w.iter().any(|w| w.contains("top_k (4)") && w.contains("not exercised")),
        "{w:?}"
    );
    assert!(c.coverage_warnings(5).is_empty());
}

/// The indexer taps: scores on full layers only, a selection on every layer (a shared layer's
/// equal to the previous full layer's), and the selection rule on them: the reference's own
/// selection agrees, one shifted by a key diverges.
#[test]
fn indexer_taps_and_the_selection_rule_on_them() {
    let f = GgufFile::open(golden("glm-dsa-tiny.f32.gguf")).unwrap();
    let r = Reference::new(&f).unwrap();
    let tokens: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 400).collect();
    let n = tokens.len();
    let mut tap = CollectTap::new(|k: &TapKey| matches!(k.site, Site::IndexerScore | Site::IndexerTopk));
    r.forward(&tokens, &mut tap).unwrap();
    let get = |l: usize, s: Site| tap.get(&TapKey::layer(l, s));
    assert!(get(1, Site::IndexerScore).is_none() && get(3, Site::IndexerScore).is_none());
    let (scores, sel) = (get(2, Site::IndexerScore).unwrap(), get(2, Site::IndexerTopk).unwrap());
    assert_eq!((scores.shape, sel.shape), ([n, n], [n, 3]));
    assert_eq!(
        get(3, Site::IndexerTopk).unwrap().data,
        sel.data,
        "shared layer 3 reuses layer 2"
    );
    assert_ne!(get(0, Site::IndexerTopk).unwrap().data, sel.data);
    let rule = Rule::default();
    let own = compare_taps(&scores.data, &sel.data, n, 3, &rule);
    assert!(own.agrees && own.overlap == 1.0, "{:?}", own.violations);
    // A candidate that keeps the earliest keys (a selection that ignores the scores).
    let first: Vec<f32> = (0..n)
        .flat_map(|t| (0..3).map(move |j| if j <= t { j as f32 } else { -1.0 }))
        .collect();
    let wrong = compare_taps(&scores.data, &first, n, 3, &rule);
    assert!(!wrong.agrees, "overlap {}", wrong.overlap);
}

#[test]
fn the_tp_engine_matches_hf_on_both_families() {
    for name in ["glm-dsa", "deepseek32"] {
        let f = GgufFile::open(golden(&format!("{name}-tiny.f32.gguf"))).unwrap();
        let opts = engine::EngineOptions {
            tp: 2,
            ..engine::EngineOptions::default()
        };
        let mut e = engine::Engine::load(&f, opts).unwrap();
        let json = format!("hf-{name}-tiny.json");
        let (worst, same, n) = compare_with(&json, "positions", |t| e.prefill(t, &mut NoTap).unwrap());
        eprintln!(
            "{name} tiny, engine cpu TP 2 vs HF fp32: worst |dlogprob| {worst:.2e} over top-50, top-1 {same}/{n}"
        );
        assert!(n >= 16, "{n} positions");
        assert_eq!(same, n, "{name}: top-1 agreement");
        assert!(worst <= 2e-3, "{name}: worst |dlogprob| {worst}");
    }
}
