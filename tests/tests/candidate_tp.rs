//! `diff-layers --candidate` on format 2 (tensor-parallel) dumps: HF transformers' own tensor
//! parallelism (`tp_plan="auto"`, CPU, gloo, fp32) dumped by tests/peers/hf_tp_dump.py, committed
//! in golden/candidate-smollm2-tp3/ (real SmolLM2, TP 3, layer 1, 4 tokens) and
//! golden/candidate-llama31-tp2/ (the tiny Llama 3.1 model, TP 2, both layers and the logits).
//! The healthy dumps agree with every tensor compared (none skipped); each planted fault is
//! found at its tap and rank with its class named; a dump whose layouts do not explain a ranked
//! tensor is refused.

use harness::dump::Dump;
use llmdiff_tests::fixtures::{golden, smollm2};
use references::GgufFile;
use reports::DiffRun;
use std::path::{Path, PathBuf};

struct Case {
    model: PathBuf,
    dir: &'static str,
    tp: usize,
    n_heads: usize,
    /// The healthy dump's worst end-to-end rel_l2 is below this (f32: 1e-4; bf16: its rounding).
    worst: f64,
}

fn tp3() -> Case {
    Case {
        model: smollm2().to_path_buf(),
        dir: "candidate-smollm2-tp3",
        tp: 3,
        n_heads: 9,
        worst: 1e-4,
    }
}

fn tp2() -> Case {
    Case {
        model: golden("llama31-tiny.f32.gguf"),
        dir: "candidate-llama31-tp2",
        tp: 2,
        n_heads: 4,
        worst: 1e-4,
    }
}

fn files(c: &Case, name: &str) -> Vec<PathBuf> {
    (0..c.tp)
        .map(|r| golden(c.dir).join(format!("{name}.rank{r}.safetensors")))
        .collect()
}

fn diff_paths(model: &Path, paths: &[PathBuf]) -> anyhow::Result<DiffRun> {
    let file = GgufFile::open(model)?;
    let dump = Dump::open(paths)?;
    llmdiff_tests::models::diff_dump(&file, &dump)
}

fn diff(c: &Case, name: &str) -> DiffRun {
    diff_paths(&c.model, &files(c, name)).unwrap()
}

/// The divergence's tap and class; the explanation must name every needle.
fn found(run: &DiffRun, tap: &str, class: &str, needles: &[&str]) {
    let first = run.first_divergence.as_ref().expect("diverged");
    let d = run.diagnosis.as_ref().expect("diagnosis");
    assert_eq!((first.tap.as_str(), d.class.as_str()), (tap, class), "{d:?}");
    for n in needles {
        assert!(d.explanation.contains(n), "{n:?} not in {}", d.explanation);
    }
}

fn healthy_agrees_with_every_tensor_compared(c: &Case) {
    let run = diff(c, "healthy");
    assert_eq!(run.verdict, "agree", "{:?} {:?}", run.first_divergence, run.diagnosis);
    let t = run.tp_layout.as_ref().expect("format 2 report");
    assert_eq!(t.tp, c.tp);
    assert!(t.config_drift.is_empty(), "{:?}", t.config_drift);
    assert!(t.config_keys > 0);
    // None skipped: every tensor of the files is a compared row or a replica checked against
    // the lowest rank's copy.
    let replicas = t.compared.get("replica").copied().unwrap_or(0);
    // (weights are fingerprints in the metadata, not tensors)
    assert_eq!(run.taps.len() + replicas, t.tensors, "{:?}", t.compared);
    assert!(!t.compared.contains_key("partial-unchecked"), "{:?}", t.compared);
    // Every weight fingerprint matches the reference's slice, bit for bit.
    assert!(t.weight_findings.is_empty(), "{:?}", t.weight_findings);
    let weights = t.compared.get("weight").copied().unwrap_or(0);
    assert!(weights >= 7 * c.tp, "{weights}");
    assert_eq!(t.weight_hashes_equal, weights);
    for kind in ["replicated", "replica", "sharded", "partial"] {
        assert!(
            t.compared.get(kind).copied().unwrap_or(0) > 0,
            "{kind}: {:?}",
            t.compared
        );
    }
    // Every rank's partial is compared with the reference's per-rank partial.
    let partials = run
        .taps
        .iter()
        .filter(|r| r.site == "attn_proj" && r.rank.is_some())
        .count();
    assert!(partials >= c.tp, "{partials}");
    let worst = run.taps.iter().map(|t| t.metrics.rel_l2).fold(0f64, f64::max);
    assert!(worst < c.worst, "worst rel_l2 {worst:e}");
    // The HTML report says what was compared.
    let html = reports::render_diff(&run);
    assert!(html.contains(&format!("TP {} dump: {} tensors", c.tp, t.tensors)));
}

fn faults_are_found_at_their_tap_and_rank(c: &Case) {
    let last = c.tp - 1;
    found(
        &diff(c, "skip-oproj-reduce"),
        "blk.1.attn_proj@r0",
        "missing-reduction",
        &["pre-reduce partial", "all-reduce did not run"],
    );
    found(
        &diff(c, "skip-down-reduce"),
        "blk.1.ffn_out@r0",
        "missing-reduction",
        &["pre-reduce partial"],
    );
    // Ranks 0 and 1 swapped o_proj shards: the weight fingerprints name it first, and the
    // per-rank partials name it from the activations alone.
    let swap = diff(c, "oproj-swap-r01");
    found(
        &swap,
        "blk.1.w.o@r0",
        "head-permutation",
        &["weight fingerprint", "rank 1's shard", "not its declared"],
    );
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
    assert_eq!(t.weight_findings.len(), 2, "{:?}", t.weight_findings);
    // The last rank computes with rank 0's q_proj shard: its weight holds rank 0's rows and its
    // q heads are the reference's heads 0.. (the activations' head-permutation).
    let heads = last * c.n_heads / c.tp;
    found(
        &diff(c, "qproj-rank0"),
        &format!("blk.1.w.q@r{last}"),
        "head-permutation",
        &[
            "rank 0's shard",
            &format!("head-permutation at blk.1.q@r{last}"),
            &format!("engine heads {heads}.."),
            "match reference heads 0..",
        ],
    );
    found(
        &diff(c, "attn-zero-r1"),
        "blk.1.attn_out@r1",
        "stale-output",
        &["no canary"],
    );
    let rope = diff(c, "rope-base-last");
    let d = rope.diagnosis.as_ref().unwrap();
    assert_eq!(d.class, "config-drift", "{d:?}");
    assert!(
        d.explanation
            .contains(&format!("rope_theta differs across ranks: rank {last} ")),
        "{}",
        d.explanation
    );
    assert!(
        d.explanation.contains(&format!("rope_theta: rank {last} ")) && d.explanation.contains("GGUF metadata"),
        "{}",
        d.explanation
    );
}

#[test]
fn tp3_smollm2_healthy_agrees_with_every_tensor_compared() {
    healthy_agrees_with_every_tensor_compared(&tp3());
}

#[test]
fn tp3_smollm2_faults_are_found_at_their_tap_and_rank() {
    faults_are_found_at_their_tap_and_rank(&tp3());
}

/// The same HF TP 3 run with the model in bf16 (`hf_tp_dump.py --dtype bf16`): judged by the
/// local-error rule at bf16's unit roundoff, the weight fingerprints against the reference's
/// values rounded to bf16.
fn tp3_bf16() -> Case {
    Case {
        dir: "candidate-smollm2-tp3-bf16",
        worst: 5e-2,
        ..tp3()
    }
}

#[test]
fn tp3_smollm2_bf16_healthy_agrees_with_every_tensor_compared() {
    let c = tp3_bf16();
    healthy_agrees_with_every_tensor_compared(&c);
    assert_eq!(diff(&c, "healthy").dtype.unwrap().name, "bf16");
}

#[test]
fn tp3_smollm2_bf16_faults_are_found_at_their_tap_and_rank() {
    faults_are_found_at_their_tap_and_rank(&tp3_bf16());
}

#[test]
fn tp2_llama31_healthy_agrees_with_every_tensor_compared() {
    let c = tp2();
    healthy_agrees_with_every_tensor_compared(&c);
    // The gathered logits are compared as a replicated tap.
    let run = diff(&c, "healthy");
    let t = run.tp_layout.unwrap();
    assert_eq!(t.layouts["logits"], vec!["gathered", "gathered"]);
    assert!(run.taps.iter().any(|r| r.tap == "logits"));
}

#[test]
fn tp2_llama31_faults_are_found_at_their_tap_and_rank() {
    faults_are_found_at_their_tap_and_rank(&tp2());
}

/// A copy of `src` with its metadata changed by `f`.
fn with_meta(src: &Path, dst: &Path, f: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>)) {
    let bytes = std::fs::read(src).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    f(header["__metadata__"].as_object_mut().unwrap());
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    std::fs::write(dst, out).unwrap();
}

fn edit_layout(m: &mut serde_json::Map<String, serde_json::Value>, f: impl FnOnce(&mut serde_json::Value)) {
    let mut l: serde_json::Value = serde_json::from_str(m["layout"].as_str().unwrap()).unwrap();
    f(&mut l);
    m.insert("layout".into(), serde_json::Value::String(l.to_string()));
}

#[test]
fn a_ranked_tensor_the_layouts_do_not_explain_is_refused() {
    let c = tp2();
    let dir = tempfile::tempdir().unwrap();
    let mut paths = files(&c, "healthy");
    let err = |paths: &[PathBuf]| format!("{:#}", diff_paths(&c.model, paths).expect_err("must be refused"));

    // A class without a declared layout.
    let p = dir.path().join("nolayout.rank1.safetensors");
    with_meta(&paths[1], &p, |m| {
        edit_layout(m, |l| {
            l.as_object_mut().unwrap().remove("attn_out");
        })
    });
    let e = err(&[paths[0].clone(), p]);
    assert!(e.contains("layout is not declared") && e.contains("attn_out"), "{e}");

    // A declared range that does not match the tensor's width.
    let p = dir.path().join("range.rank1.safetensors");
    with_meta(&paths[1], &p, |m| {
        edit_layout(m, |l| l["attn_out"] = "sharded(1,0:8)".into())
    });
    let e = err(&[paths[0].clone(), p]);
    assert!(e.contains("declared range 0:8"), "{e}");

    // An expert-parallel layout anywhere but a MoE block's partial (`ffn_out#partial`): refused.
    let p = dir.path().join("experts.rank1.safetensors");
    with_meta(&paths[1], &p, |m| {
        edit_layout(m, |l| l["attn_out"] = "experts(0,1)".into())
    });
    let e = err(&[paths[0].clone(), p]);
    assert!(e.contains("experts(ids) at ffn_out#partial only"), "{e}");

    // A rank's file missing.
    paths.pop();
    let e = err(&paths);
    assert!(e.contains("lacks rank 1's file"), "{e}");
}

/// A kv_b loaded whole on one rank (tests/peers/kv_b_sharded_load.py: the synthetic DeepSeek-V3's
/// kv_b sharded by heads for TP 2 in PyTorch, rank 1 keeping the whole tensor) is named by its
/// fingerprint; rank 0's shard matches the reference's reassembled kv_b bit for bit.
#[test]
fn weight_fingerprints_name_a_kv_b_loaded_whole() {
    let file = GgufFile::open(golden("deepseek-v3-tiny.f32.gguf")).unwrap();
    let config = references::forward::Reference::new(&file).unwrap().config;
    let doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(golden("kv-b-fingerprints-tp2.json")).unwrap()).unwrap();
    let mut prints = Vec::new();
    for (k, v) in doc["weights"].as_object().unwrap() {
        let key: references::TapKey = k.parse().unwrap();
        let fp: harness::fingerprint::Fingerprint = serde_json::from_value(v.clone()).unwrap();
        prints.push((key.rank.unwrap() as usize, key, fp));
    }
    let checked = harness::fingerprint::check(&file, &config, &prints).unwrap();
    assert_eq!(checked.len(), 2);
    let r0 = checked.iter().find(|c| c.key.rank == Some(0)).unwrap();
    assert!(r0.finding.is_none(), "{:?}", r0.finding);
    assert!(r0.hash_equal);
    let r1 = checked.iter().find(|c| c.key.rank == Some(1)).unwrap();
    let f = r1.finding.as_deref().expect("rank 1 loaded kv_b whole");
    assert!(f.contains("blk.0.w.kv_b@r1: loaded whole ([256, 64])"), "{f}");
    assert!(f.contains("sharded(0,128:256)"), "{f}");
}

/// Decode steps (tests/peers/hf_tp_dump.py --decode-steps 2: a 4-token prefill, then two tokens
/// decoded one at a time with HF's KV cache, every step in the dump as `KEY#stepK`): the healthy
/// run agrees on all six rows of every tap; rank 1's attention output zeroed in decode step 2
/// only is found at its tap and rank, localized to that step.
#[test]
fn tp2_decode_steps_localize_a_decode_only_fault_to_its_step() {
    let c = Case {
        model: golden("llama31-tiny.f32.gguf"),
        dir: "candidate-llama31-tp2-decode",
        tp: 2,
        n_heads: 4,
        worst: 1e-4,
    };
    let run = diff(&c, "healthy");
    assert_eq!(run.verdict, "agree", "{:?} {:?}", run.first_divergence, run.diagnosis);
    assert_eq!(run.tokens.len(), 6);
    assert!(
        run.taps.iter().all(|t| t.shape[0] == 6),
        "every tap stitched to 4 + 2 rows"
    );
    let t = run.tp_layout.as_ref().unwrap();
    assert_eq!(run.taps.len() + t.compared["replica"], t.tensors);
    found(
        &diff(&c, "decode-attn-zero-r1"),
        "blk.1.attn_out@r1",
        "unknown",
        &[
            "only decode diverges",
            "the 4 prefill rows agree",
            "first over at decode step 2 (token 5)",
        ],
    );

    // A "prefill" that does not match the tensors' rows is refused.
    let dir = tempfile::tempdir().unwrap();
    let paths = files(&c, "healthy");
    let p = dir.path().join("prefill.rank1.safetensors");
    with_meta(&paths[1], &p, |m| {
        m.insert("prefill".into(), "3".into());
    });
    let e = format!(
        "{:#}",
        diff_paths(&c.model, &[paths[0].clone(), p]).expect_err("refused")
    );
    assert!(e.contains("differs from the other files'"), "{e}");
}
