//! The TP engine on the DSA families (glm-dsa, GLM-5; deepseek32, DeepSeek-V3.2): the lightning
//! indexer replicated on every rank, its top-k selection, sparse MLA attention over the selected
//! keys, `shared` indexer layers and the indexer's key cache in decode. On the committed tiny
//! fixtures (indexer top_k 3 and 4, 20 tokens, so selection matters) and the `glm5-mini` preset
//! (GLM-5's per-head shapes, top_k 16, 24 tokens) `diff-layers` agrees with the reference at every
//! TP degree the heads allow, in prefill and through decode steps, at f32 and bf16 compute, and
//! with the indexer's q and key cache in fp8 (near-tie key flips judged by the selection rule).

use engine::{Engine, EngineError, EngineOptions};
use harness::compare::ActDtype;
use harness::diff::{run_diff, DiffPlan};
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::{GgufFile, ModelConfig};
use reports::DiffRun;
use std::path::PathBuf;

fn fixture(name: &str) -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../golden/{name}-tiny.f32.gguf"));
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Runs the plan and asserts agreement with every layer's selection compared.
fn agrees(what: &str, p: &DiffPlan, c: &ModelConfig) -> DiffRun {
    let run = run_diff(p).unwrap_or_else(|e| panic!("{what}: {e:#}"));
    assert!(
        run.first_divergence.is_none(),
        "{what}: diverged at {:?} ({:?})",
        run.first_divergence.as_ref().map(|f| &f.tap),
        run.diagnosis.as_ref().map(|d| &d.explanation)
    );
    assert!(run.unmatched.is_empty(), "{what}: unmatched taps {:?}", run.unmatched);
    for l in 0..c.n_layers {
        for r in 0..p.engine.tp {
            let key = format!("blk.{l}.indexer_topk@r{r}");
            assert!(run.taps.iter().any(|t| t.tap == key), "{what}: {key} was not compared");
        }
    }
    run
}

#[test]
fn tiny_dsa_fixtures_agree_at_every_tp_in_prefill_and_decode() {
    for name in ["glm-dsa", "deepseek32"] {
        let file = fixture(name);
        let c = ModelConfig::from_header(&file.header).unwrap();
        let top_k = c.indexer.as_ref().unwrap().top_k;
        let toks = tokens(c.vocab, 20);
        assert!(toks.len() > 4 * top_k, "{name}: the selection must matter");
        for tp in [1, 2, 4] {
            for decode_steps in [0, 3] {
                let p = plan(&file, toks.clone(), tp, vec![], decode_steps);
                agrees(&format!("{name} tp {tp} decode {decode_steps}"), &p, &c);
            }
        }
    }
}

#[test]
fn bf16_compute_and_an_fp8_indexer_agree_with_near_tie_flips_judged_by_the_rule() {
    let file = fixture("glm-dsa");
    let c = ModelConfig::from_header(&file.header).unwrap();
    let toks = tokens(c.vocab, 20);
    let mut p = plan(&file, toks, 2, vec![], 2);
    p.engine.indexer_fp8 = true;
    let run = agrees("fp8 indexer", &p, &c);
    // fp8 scoring flips near-ties: the selections differ from the reference's, within the rule.
    let sel = run
        .taps
        .iter()
        .find(|t| t.tap == "blk.0.indexer_topk")
        .and_then(|t| t.selection.clone())
        .expect("layer 0's selection judged by the rule");
    assert!(sel.agrees && sel.overlap < 1.0 && sel.violations == 0, "{sel:?}");
    p.engine.compute_dtype = engine::ComputeDtype::Bf16;
    p.dtype = ActDtype::Bf16;
    agrees("bf16 + fp8 indexer", &p, &c);
}

#[test]
fn a_layer_range_starting_at_a_shared_indexer_layer_is_refused() {
    let file = fixture("glm-dsa");
    let c = ModelConfig::from_header(&file.header).unwrap();
    let shared = c
        .indexer
        .as_ref()
        .unwrap()
        .full
        .iter()
        .position(|f| !f)
        .expect("a shared layer");
    let opts = EngineOptions {
        layers: Some(shared..c.n_layers),
        ..EngineOptions::default()
    };
    let err = Engine::load(&file, opts).err().expect("refused");
    assert!(matches!(err, EngineError::Options(_)), "{err}");
    assert!(err.to_string().contains("`shared` DSA indexer layer"), "{err}");
}

#[test]
fn glm5_mini_agrees_at_tp_1_2_4_8() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec("glm5-mini", None, None);
    let file = synth(dir.path(), "glm5-mini", &s);
    let c = ModelConfig::from_header(&file.header).unwrap();
    let top_k = c.indexer.as_ref().map(|ix| ix.top_k).unwrap_or(0);
    let toks = tokens(c.vocab, 24);
    assert!(toks.len() > top_k, "the selection must matter");
    for tp in [1, 2, 4, 8] {
        agrees(
            &format!("glm5-mini tp {tp}"),
            &plan(&file, toks.clone(), tp, vec![], 0),
            &c,
        );
    }
    let mut p = plan(&file, toks, 8, vec![], 2);
    p.engine.compute_dtype = engine::ComputeDtype::Bf16;
    p.dtype = ActDtype::Bf16;
    agrees("glm5-mini tp 8 bf16 decode 2", &p, &c);
}
