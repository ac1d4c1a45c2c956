//! The TP engine on the GQA/MoE families (qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3): on
//! each committed tiny fixture, `diff-layers` on the CPU backend agrees with the reference at TP
//! 1 and 2 (prefill, and decode steps through the KV cache), and the faults of the catalog that
//! apply to a GQA model are localized at the same tap as on llama (and classified). TP 4 splits
//! the fixtures' 2 KV heads and is refused in one line naming the valid degrees; gpt-oss is
//! refused in one line naming what works (the DSA families run: tests/tests/engine_dsa.rs).

use engine::{Engine, EngineError, EngineOptions, Fault, FaultSpec};
use harness::diff::run_diff;
use llmdiff_tests::models::{plan, synth, tokens};
use references::GgufFile;
use std::path::PathBuf;

const FAMILIES: [&str; 6] = ["qwen2", "qwen3", "qwen3moe", "glm4moe", "gemma2", "gemma3"];
/// Longer than the gemma fixtures' sliding window (4), so the local layers mask keys.
const N_TOKENS: usize = 12;

fn fixture(name: &str) -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../golden/{name}-tiny.f32.gguf"));
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fault_spec(fault: Fault, layer: u32, rank: Option<u32>) -> FaultSpec {
    FaultSpec {
        fault,
        layer: Some(layer),
        rank,
    }
}

#[test]
fn healthy_engine_agrees_with_the_reference_at_tp_1_and_2() {
    for name in FAMILIES {
        let file = fixture(name);
        let vocab = references::ModelConfig::from_header(&file.header).unwrap().vocab;
        for tp in [1, 2] {
            for decode_steps in [0, 3] {
                let run = run_diff(&plan(&file, tokens(vocab, N_TOKENS), tp, vec![], decode_steps))
                    .unwrap_or_else(|e| panic!("{name} tp {tp}: {e:#}"));
                assert!(
                    run.first_divergence.is_none(),
                    "{name} tp {tp} decode {decode_steps}: diverged at {:?} ({})",
                    run.first_divergence.as_ref().map(|f| &f.tap),
                    run.verdict
                );
                // Every tap the engine emitted met its reference tap (the same sites), and every
                // layer's taps were compared, the logits among them.
                assert!(run.unmatched.is_empty(), "{name}: unmatched taps {:?}", run.unmatched);
                assert!(run.taps.iter().any(|t| t.tap == "logits"), "{name}: no logits tap");
                let last = file.header.get(&format!("{name}.block_count")).and_then(|v| v.as_u64());
                let last = last.expect("block_count") - 1;
                assert!(
                    run.taps.iter().any(|t| t.tap == format!("blk.{last}.resid_out")),
                    "{name}: the last layer's residual was not compared"
                );
            }
        }
    }
}

/// (fault, layer, rank, TP, decode steps, the site it must first show at, its rank, classes).
type Case = (
    Fault,
    u32,
    Option<u32>,
    usize,
    usize,
    &'static str,
    Option<u32>,
    &'static [&'static str],
);

/// The classes an `allreduce-skip` may get. Gemma norms the reduced sum (its post-attention
/// norm) before the `attn_proj` tap, so the tap is never equal to a rank's partial sum and the
/// missing-reduction check, which looks for that equality, cannot name it: localized, "unknown".
fn reduction_classes(name: &str) -> &'static [&'static str] {
    if name.starts_with("gemma") {
        &["missing-reduction", "unknown"]
    } else {
        &["missing-reduction"]
    }
}

#[test]
fn faults_are_localized_as_on_llama() {
    let mut failures = Vec::new();
    let mut n = 0;
    for name in FAMILIES {
        let file = fixture(name);
        let config = references::ModelConfig::from_header(&file.header).unwrap();
        let mut cases: Vec<Case> = vec![
            (Fault::RopeNeox, 1, None, 2, 0, "q", Some(0), &["rope"]),
            (
                Fault::PhantomAttnOut,
                0,
                Some(1),
                2,
                0,
                "attn_out",
                Some(1),
                &["unwritten-output"],
            ),
            (
                Fault::StaleAttnOut,
                1,
                None,
                1,
                0,
                "attn_out",
                Some(0),
                &["stale-output"],
            ),
            (
                Fault::AllreduceSkip,
                1,
                None,
                2,
                0,
                "attn_proj",
                None,
                reduction_classes(name),
            ),
            (Fault::ConfigDrift, 1, None, 2, 0, "q", Some(0), &["config-drift"]),
            (
                Fault::KvSlotOffByOne,
                0,
                None,
                2,
                3,
                "kv_cache_k",
                Some(0),
                &["kv-cache"],
            ),
        ];
        if let Some(moe_layer) = (0..config.n_layers).find(|&l| config.is_moe_layer(l)) {
            cases.push((
                Fault::MoeGateRounded,
                moe_layer as u32,
                None,
                2,
                0,
                "w.router",
                Some(0),
                &["routing-flip", "precision"],
            ));
        }
        for (fault, layer, rank, tp, decode, site, want_rank, classes) in cases {
            n += 1;
            let s = fault_spec(fault, layer, rank);
            let case = format!("{name} {s} tp {tp}");
            let run = run_diff(&plan(&file, tokens(config.vocab, N_TOKENS), tp, vec![s], decode))
                .unwrap_or_else(|e| panic!("{case}: {e:#}"));
            let (Some(first), Some(diag)) = (&run.first_divergence, &run.diagnosis) else {
                failures.push(format!("{case}: no divergence ({})", run.verdict));
                continue;
            };
            let localized = first.layer == Some(layer) && first.site == site && first.rank == want_rank;
            if !localized || !classes.contains(&diag.class.as_str()) {
                failures.push(format!(
                    "{case}: first at {} class {}; want {site} rank {want_rank:?} class {classes:?}",
                    first.tap, diag.class
                ));
            }
        }
    }
    assert!(n >= 6 * 6 + 2, "ran {n} cases");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The synth presets (bigger, quantized): qwen3-mini and qwen3moe-mini, cut to 2 layers, in
/// Q4_K, agree at TP 4 (one KV head a rank) with decode steps.
#[test]
fn qwen3_presets_agree_at_tp_4_quantized() {
    let dir = tempfile::tempdir().unwrap();
    for preset in ["qwen3-mini", "qwen3moe-mini"] {
        let s = llmdiff_tests::models::spec(preset, Some(2), Some(references::GgmlType::Q4K));
        let file = synth(dir.path(), preset, &s);
        let run = run_diff(&plan(&file, tokens(s.config.vocab, 10), 4, vec![], 2))
            .unwrap_or_else(|e| panic!("{preset}: {e:#}"));
        assert!(
            run.first_divergence.is_none() && run.unmatched.is_empty(),
            "{preset} tp 4: {}",
            run.verdict
        );
        assert!(
            run.taps.iter().any(|t| t.tap == "blk.1.q@r3"),
            "{preset}: rank 3 not tapped"
        );
    }
}

#[test]
fn a_tp_splitting_the_kv_heads_is_refused_with_the_valid_degrees() {
    for name in FAMILIES {
        let file = fixture(name);
        let opts = EngineOptions {
            tp: 4,
            ..EngineOptions::default()
        };
        let err = Engine::load(&file, opts)
            .err()
            .expect("TP 4 over 2 KV heads must be refused");
        let msg = err.to_string();
        assert!(matches!(err, EngineError::TpDegree { .. }), "{name}: {msg}");
        assert!(
            msg.contains("2 KV heads") && msg.contains("valid TP degrees for this model: 1, 2") && !msg.contains('\n'),
            "{name}: {msg}"
        );
    }
}

#[test]
fn gpt_oss_is_refused_naming_what_works() {
    let file = fixture("gpt-oss");
    let err = Engine::load(&file, EngineOptions::default())
        .err()
        .expect("the engine must refuse gpt-oss");
    let msg = err.to_string();
    assert!(matches!(err, EngineError::Unsupported(_)), "{msg}");
    assert!(
        msg.contains("does not run gpt-oss") && msg.contains("--candidate") && !msg.contains('\n'),
        "{msg}"
    );
}
