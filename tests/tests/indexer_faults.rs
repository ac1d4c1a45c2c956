//! The DSA indexer faults (issue 50) on golden/glm-dsa-tiny (glm-dsa: layers 0 and 2 run their
//! own indexer, 1 and 3 are `shared`; indexer top_k 3) at TP 2 over 20 tokens, more than top_k so
//! the selection matters: each fault is localized at its (layer, site, rank) and classified, on a
//! copy of the fixture with `indexer.proj` in Q8_0 and `indexer.attn_k` in F16 (the fixture is
//! all F32, and those faults act on those types). The faults that do not apply are refused with
//! one line, and the catalog's older faults that reach the DSA layers keep their classes there.

use engine::{ComputeDtype, EngineError, Fault, FaultSpec};
use harness::diff::run_diff;
use llmdiff_tests::fixtures::golden;
use llmdiff_tests::models::{plan, with_types};
use references::{GgmlType, GgufFile};

const N_TOKENS: usize = 20;

fn tokens() -> Vec<u32> {
    (0..N_TOKENS).map(|i| ((i * 37 + 5) % 400) as u32).collect()
}

/// The fixture with every indexer's `proj` in Q8_0 and `attn_k` in F16.
fn typed(dir: &std::path::Path) -> GgufFile {
    let src = GgufFile::open(golden("glm-dsa-tiny.f32.gguf")).unwrap();
    with_types(&src, &dir.join("glm-dsa-tiny-typed.gguf"), |name| {
        if name.ends_with(".indexer.proj.weight") {
            Some(GgmlType::Q8_0)
        } else if name.ends_with(".indexer.attn_k.weight") {
            Some(GgmlType::F16)
        } else {
            None
        }
    })
}

/// Runs `spec` at TP 2 and checks the first divergence and its class (at f32).
fn check(file: &GgufFile, spec: &str, decode_steps: usize, site: &str, rank: u32, classes: &[&str]) {
    check_at(file, spec, decode_steps, site, rank, classes, ComputeDtype::F32)
}

/// [`check`] with the engine computing in `dtype`.
fn check_at(
    file: &GgufFile,
    spec: &str,
    decode_steps: usize,
    site: &str,
    rank: u32,
    classes: &[&str],
    dtype: ComputeDtype,
) {
    let s: FaultSpec = spec.parse().unwrap();
    let mut p = plan(file, tokens(), 2, vec![s], decode_steps);
    p.engine.compute_dtype = dtype;
    let run = run_diff(&p).unwrap_or_else(|e| panic!("{spec}: {e:#}"));
    let (Some(first), Some(diag)) = (&run.first_divergence, &run.diagnosis) else {
        panic!("{spec}: no divergence found (verdict {})", run.verdict);
    };
    let what = format!(
        "{spec} {dtype:?}: at {} class {} ({}): {}",
        first.tap, diag.class, diag.confidence, diag.explanation
    );
    eprintln!("{what}");
    assert_eq!(first.layer, s.layer, "{what}");
    assert_eq!(first.site, site, "{what}");
    assert_eq!(first.rank, Some(rank), "{what}");
    assert!(classes.contains(&diag.class.as_str()), "{what}");
}

#[test]
fn each_indexer_fault_is_localized_and_classified_at_tp2() {
    let dir = tempfile::tempdir().unwrap();
    let f = typed(dir.path());
    // At bf16 too: the loader rounds the other layer's weights, and the scores carry bf16 noise.
    for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
        let check = |spec, decode_steps, site, rank, classes: &[&str]| {
            check_at(&f, spec, decode_steps, site, rank, classes, dtype)
        };
        check("indexer-raw-quant@2:1", 0, "w.idx_proj", 1, &["dequantization"]);
        check("indexer-wrong-dtype@0", 0, "w.idx_k", 0, &["dequantization"]);
        check("indexer-wrong-layer@2:1", 0, "w.idx_q_b", 1, &["wrong-layer"]);
        check("indexer-topk-drift@2:1", 0, "indexer_topk", 1, &["config-drift"]);
        check("indexer-rope-drift@0", 0, "indexer_score", 0, &["config-drift"]);
        check("indexer-stale-cache@2:1", 3, "indexer_score", 1, &["kv-cache"]);
    }
}

#[test]
fn the_older_faults_keep_their_classes_on_the_dsa_layers() {
    let f = GgufFile::open(golden("glm-dsa-tiny.f32.gguf")).unwrap();
    check(&f, "phantom-attn-out@2:1", 0, "attn_out", 1, &["unwritten-output"]);
    check(&f, "kv-b-unsharded@0:1", 0, "w.kv_b", 1, &["head-permutation"]);
    check(&f, "k-b-untransposed@2", 0, "w.kv_b", 0, &["transposed-weight"]);
}

#[test]
fn indexer_faults_that_do_not_apply_are_refused() {
    let f32_file = GgufFile::open(golden("glm-dsa-tiny.f32.gguf")).unwrap();
    let deepseek = GgufFile::open(golden("deepseek-v3-tiny.f32.gguf")).unwrap();
    let refused = |file: &GgufFile, spec: &str, why: &str| {
        let s: FaultSpec = spec.parse().unwrap();
        let err = run_diff(&plan(file, tokens(), 2, vec![s], 0)).expect_err(spec);
        let msg = format!("{err:#}");
        assert!(
            matches!(err.downcast_ref(), Some(EngineError::FaultNotApplicable { .. })) && msg.contains(why),
            "{spec}: {msg}"
        );
        assert!(!msg.contains('\n'), "{spec}: one line: {msg}");
    };
    // The fixture's indexer weights are F32: nothing quantized to hand over raw, no 16-bit float
    // to misread.
    refused(&f32_file, "indexer-raw-quant", "not Q8_0");
    refused(&f32_file, "indexer-wrong-dtype@2", "is F16 or BF16");
    // Layer 1 is a `shared` indexer layer.
    refused(&f32_file, "indexer-stale-cache@1", "shared");
    for fault in [Fault::IndexerTopkDrift, Fault::IndexerWrongLayer] {
        refused(&deepseek, fault.name(), "needs a DSA model");
    }
}

/// Healthy DSA runs agree with the engine's `indexer_score` held to its compute dtype's bound
/// (not fp8's): both fixtures at TP 1, 2 and 4, prefill and 3 decode steps, f32 and bf16, and
/// with the fp8 indexer (held to fp8's bound then).
#[test]
fn healthy_dsa_runs_agree_with_the_scores_held_to_the_engine_dtype() {
    for name in ["glm-dsa-tiny.f32.gguf", "deepseek32-tiny.f32.gguf"] {
        let f = GgufFile::open(golden(name)).unwrap();
        for (tp, dtype, fp8) in [
            (1, ComputeDtype::F32, false),
            (2, ComputeDtype::F32, false),
            (4, ComputeDtype::F32, false),
            (2, ComputeDtype::Bf16, false),
            (2, ComputeDtype::F32, true),
        ] {
            for decode_steps in [0, 3] {
                let mut p = plan(&f, tokens(), tp, vec![], decode_steps);
                p.engine.compute_dtype = dtype;
                p.engine.indexer_fp8 = fp8;
                let run = run_diff(&p).unwrap();
                let worst = run
                    .taps
                    .iter()
                    .filter(|t| t.site == "indexer_score")
                    .filter_map(|t| t.local.as_ref().map(|l| l.rel_l2 / l.bound))
                    .fold(0f64, f64::max);
                eprintln!("{name} tp{tp} {dtype:?} fp8 {fp8} decode {decode_steps}: {} (worst indexer_score local/bound {worst:.3})", run.verdict);
                assert!(
                    run.first_divergence.is_none(),
                    "{name} tp{tp} {dtype:?} fp8 {fp8} decode {decode_steps}: {:?}",
                    run.first_divergence.map(|f| f.tap)
                );
            }
        }
    }
}

/// glm5-mini (the synth's glm-dsa: indexer 32×128, top_k 16) healthy over 24 tokens, more than
/// top_k, at TP 1 and 8 (and 8 at bf16), prefill and 3 decode steps, with `indexer_score` held
/// to the compute dtype's bound.
#[test]
fn healthy_glm5_mini_agrees_over_more_tokens_than_top_k() {
    let dir = tempfile::tempdir().unwrap();
    let s = llmdiff_tests::models::spec("glm5-mini", None, None);
    let f = llmdiff_tests::models::synth(dir.path(), "glm5-mini", &s);
    let toks = llmdiff_tests::models::tokens(s.config.vocab, 24);
    for (tp, dtype) in [(1, ComputeDtype::F32), (8, ComputeDtype::F32), (8, ComputeDtype::Bf16)] {
        for decode_steps in [0, 3] {
            let mut p = plan(&f, toks.clone(), tp, vec![], decode_steps);
            p.engine.compute_dtype = dtype;
            let run = run_diff(&p).unwrap();
            let worst = run
                .taps
                .iter()
                .filter(|t| t.site == "indexer_score")
                .filter_map(|t| t.local.as_ref().map(|l| l.rel_l2 / l.bound))
                .fold(0f64, f64::max);
            eprintln!(
                "glm5-mini tp{tp} {dtype:?} decode {decode_steps}: {} (worst indexer_score local/bound {worst:.3})",
                run.verdict
            );
            assert!(
                run.first_divergence.is_none(),
                "glm5-mini tp{tp} {dtype:?} decode {decode_steps}: {:?}",
                run.first_divergence.map(|f| f.tap)
            );
        }
    }
}
