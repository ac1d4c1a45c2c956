//! SGLang's own tensor dumper (`sglang.srt.debug_utils.dumper`, unmodified) writing per-rank
//! files of real SmolLM2 under HF transformers TP 3 (CPU, gloo, fp32; tests/peers/sglang_tp_dump.py:
//! its non-intrusive module hooks, explicit dims-annotated dumps of q/k after RoPE and of the
//! row-parallel partials, SGLang's rank context), converted to format 2 by
//! harness/adapters/llmdiff_sglang.py, committed in golden/sglang-smollm2-tp3/ (layer 1, 4 tokens;
//! `raw-healthy/` holds the dumper's own `.pt` files of the healthy run). The healthy dump
//! agrees with every tensor compared; rank 1's attention output zeroed is found at its tap and
//! rank; ranks 0 and 1 swapping o_proj shards is named from the partials SGLang's dims
//! annotation declared (`t h[tp:partial]`).

use harness::dump::Dump;
use llmdiff_tests::fixtures::{golden, smollm2};
use references::GgufFile;
use reports::DiffRun;
use std::path::PathBuf;

const TP: usize = 3;

fn diff(name: &str) -> DiffRun {
    let paths: Vec<PathBuf> = (0..TP)
        .map(|r| golden("sglang-smollm2-tp3").join(format!("{name}.rank{r}.safetensors")))
        .collect();
    let file = GgufFile::open(smollm2()).unwrap();
    let dump = Dump::open(&paths).unwrap();
    llmdiff_tests::models::diff_dump(&file, &dump).unwrap()
}

#[test]
fn sglang_dumper_healthy_agrees_with_every_tensor_compared() {
    let run = diff("healthy");
    assert_eq!(run.verdict, "agree", "{:?} {:?}", run.first_divergence, run.diagnosis);
    let t = run.tp_layout.as_ref().expect("format 2 report");
    assert_eq!(t.tp, TP);
    // The engine's config.json (--config) is compared with the GGUF's: no drift.
    assert!(t.config_drift.is_empty(), "{:?}", t.config_drift);
    assert!(t.config_keys > 0);
    let replicas = t.compared.get("replica").copied().unwrap_or(0);
    assert_eq!(run.taps.len() + replicas, t.tensors, "{:?}", t.compared);
    // 15 tensors a rank: embed and layer 1's attn_norm, q, k, v, attn_out, attn_proj and its
    // partial, resid_attn, ffn_norm, ffn_gate, ffn_up, ffn_out and its partial, resid_out.
    assert_eq!(t.tensors, 15 * TP);
    assert!(!t.compared.contains_key("partial-unchecked"), "{:?}", t.compared);
    for kind in ["replicated", "replica", "sharded", "partial"] {
        assert!(
            t.compared.get(kind).copied().unwrap_or(0) > 0,
            "{kind}: {:?}",
            t.compared
        );
    }
    // The layouts come from SGLang's dims annotations and the module table, per rank.
    assert_eq!(
        t.layouts["q"],
        vec!["sharded(1,0:192)", "sharded(1,192:384)", "sharded(1,384:576)"]
    );
    assert_eq!(
        t.layouts["attn_proj#partial"],
        vec!["partial(0:192)", "partial(192:384)", "partial(384:576)"]
    );
    assert_eq!(t.layouts["attn_proj"], vec!["replicated"; 3]);
    let worst = run.taps.iter().map(|t| t.metrics.rel_l2).fold(0f64, f64::max);
    assert!(worst < 1e-4, "worst rel_l2 {worst:e}");
}

#[test]
fn sglang_dumper_faults_are_found_at_their_tap_and_rank() {
    let zero = diff("attn-zero-r1");
    let first = zero.first_divergence.as_ref().expect("diverged");
    let d = zero.diagnosis.as_ref().unwrap();
    assert_eq!(
        (first.tap.as_str(), d.class.as_str()),
        ("blk.1.attn_out@r1", "stale-output"),
        "{d:?}"
    );

    // Ranks 0 and 1 hold each other's o_proj shard: no weights in an SGLang dump, so the
    // per-rank partials name it from the activations alone.
    let swap = diff("oproj-swap-r01");
    let first = swap.first_divergence.as_ref().expect("diverged");
    let d = swap.diagnosis.as_ref().unwrap();
    assert_eq!(
        (first.tap.as_str(), d.class.as_str()),
        ("blk.1.attn_proj@r0", "head-permutation"),
        "{d:?}"
    );
    // Rank 2 computes its own shard: its partial agrees.
    let r2 = swap
        .taps
        .iter()
        .find(|r| r.tap == "blk.1.attn_proj@r2")
        .expect("rank 2's partial compared");
    assert!(r2.metrics.rel_l2 < 1e-4, "{:e}", r2.metrics.rel_l2);
    let t = swap.tp_layout.as_ref().unwrap();
    for line in [
        "rank 0 holds rank 1's o_proj shard",
        "rank 1 holds rank 0's o_proj shard",
    ] {
        assert!(
            t.partial_findings.iter().any(|l| l.contains(line)),
            "{line}: {:?}",
            t.partial_findings
        );
    }
}
