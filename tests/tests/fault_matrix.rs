//! The fault matrix (issue 5): every fault of the catalog × the presets × the valid TP degrees
//! × the first and last layer, each in every rank (`@L`) and rank-local (`@L:R`, R ≥ 1). Each
//! case runs `run_diff` in-process and must localize exactly (layer, site, rank) and classify
//! right; no case may be classified wrong with high confidence. Combinations the engine refuses
//! (the fault does not apply) are skipped and counted.

use engine::{valid_tp_degrees, EngineError, Fault, FaultSpec};
use harness::diff::run_diff;
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::{GgmlType, GgufFile, ModelConfig};
use std::collections::BTreeMap;
use std::time::Instant;

const N_TOKENS: usize = 8;
/// kv-slot-off-by-one only acts in decode: the last tokens go through the decode path.
const DECODE_STEPS: usize = 3;

struct Model {
    preset: &'static str,
    file: GgufFile,
    q4k: GgufFile,
    config: ModelConfig,
    /// TP degrees to run (valid ones, fewer for the big preset).
    tps: Vec<usize>,
}

/// Where a fault must first show: the sites it may show at, and the rank.
struct Expect {
    sites: Vec<String>,
    rank: Option<u32>,
    classes: Vec<&'static str>,
}

/// Tapped weights in tap order (the `WeightKind` order) with the GGUF tensors behind each.
fn weight_tensors(c: &ModelConfig, layer: usize) -> Vec<(&'static str, Vec<String>)> {
    let b = |s: &str| format!("blk.{layer}.{s}.weight");
    let mut v: Vec<(&'static str, Vec<String>)> = Vec::new();
    match &c.mla {
        None => v.extend([
            ("w.q", vec![b("attn_q")]),
            ("w.k", vec![b("attn_k")]),
            ("w.v", vec![b("attn_v")]),
        ]),
        Some(m) if m.q_lora_rank.is_none() => v.push(("w.q", vec![b("attn_q")])),
        Some(_) => {}
    }
    v.push(("w.o", vec![b("attn_output")]));
    if let Some(m) = &c.mla {
        if m.q_lora_rank.is_some() {
            v.push(("w.q_a", vec![b("attn_q_a")]));
            v.push(("w.q_b", vec![b("attn_q_b")]));
        }
        v.push(("w.kv_a", vec![b("attn_kv_a_mqa")]));
        v.push(("w.kv_b", vec![b("attn_k_b"), b("attn_v_b")]));
    }
    if c.is_moe_layer(layer) {
        v.push(("w.router", vec![b("ffn_gate_inp")]));
    } else {
        v.extend([
            ("w.gate", vec![b("ffn_gate")]),
            ("w.up", vec![b("ffn_up")]),
            ("w.down", vec![b("ffn_down")]),
        ]);
    }
    if c.indexer
        .as_ref()
        .is_some_and(|ix| ix.full.get(layer).copied().unwrap_or(true))
    {
        let ix = |s: &str| format!("blk.{layer}.indexer.{s}.weight");
        v.extend([
            ("w.idx_q_b", vec![ix("attn_q_b")]),
            ("w.idx_k", vec![ix("attn_k")]),
            ("w.idx_proj", vec![ix("proj")]),
        ]);
    }
    v
}

/// The first tapped weight of `layer` that holds a Q4_K tensor.
fn first_q4k_weight(file: &GgufFile, c: &ModelConfig, layer: usize) -> Option<String> {
    weight_tensors(c, layer)
        .into_iter()
        .find(|(_, names)| {
            names
                .iter()
                .any(|n| file.tensor(n).is_some_and(|t| t.ty == GgmlType::Q4K))
        })
        .map(|(site, _)| site.to_string())
}

fn expect(m: &Model, s: &FaultSpec, tp: usize) -> Expect {
    let layer = s.layer.expect("matrix specs name a layer") as usize;
    let one = |site: &str| vec![site.to_string()];
    // The first rank that shows a fault in every rank is rank 0; a rank-local one shows on its rank.
    let rank = Some(s.rank.unwrap_or(0));
    let (sites, rank, classes) = match s.fault {
        Fault::PhantomAttnOut => (one("attn_out"), rank, vec!["unwritten-output"]),
        Fault::KvBUnsharded => (one("w.kv_b"), rank, vec!["head-permutation"]),
        // `:R` swaps ranks R and R+1 (mod TP): the lower of the two shows it first.
        Fault::KvBShardSwap => {
            let a = s.rank.unwrap_or(0) % tp as u32;
            let b = (a + 1) % tp as u32;
            (one("w.kv_b"), Some(a.min(b)), vec!["head-permutation"])
        }
        Fault::KBUntransposed => (one("w.kv_b"), rank, vec!["transposed-weight"]),
        Fault::DequantQ4kScaleMin => (
            one(&first_q4k_weight(&m.q4k, &m.config, layer).expect("a Q4_K weight in the layer")),
            rank,
            vec!["dequantization"],
        ),
        Fault::F16Residual => (one("resid_attn"), rank, vec!["precision", "nonfinite"]),
        // The reduced attn_proj tap is rank 0's; another rank's unreduced sum first shows in
        // its residual.
        Fault::AllreduceSkip => match s.rank {
            None | Some(0) => (one("attn_proj"), None, vec!["missing-reduction"]),
            Some(r) => (one("resid_attn"), Some(r), vec!["missing-reduction"]),
        },
        Fault::RopeNeox => (vec!["q".into(), "k".into(), "k_pe".into()], rank, vec!["rope"]),
        // Classified routing-flip when an expert choice flipped, else precision (checked below).
        Fault::MoeGateRounded => (one("w.router"), rank, vec!["routing-flip", "precision"]),
        Fault::StaleAttnOut => (one("attn_out"), rank, vec!["stale-output"]),
        // On a DSA layer the drifted rope base reaches the indexer's scores before q.
        Fault::ConfigDrift => (
            vec!["attn_norm".into(), "q_a".into(), "indexer_score".into(), "q".into()],
            rank,
            vec!["config-drift"],
        ),
        // GQA: the decode step's cache tap names the slot (kv-cache). MLA caches are not
        // tapped: "unknown" at attn_out, with the decode-only evidence.
        Fault::KvSlotOffByOne if m.config.mla.is_none() => (one("kv_cache_k"), rank, vec!["kv-cache"]),
        Fault::KvSlotOffByOne => (one("attn_out"), rank, vec!["unknown"]),
        // The DSA indexer's loader faults show at its weight taps on the rank they hit; its
        // config drifts at the rank's first indexer tap, named by the engine's config; the stale
        // key cache at a decode step's scores.
        Fault::IndexerRawQuant => (one("w.idx_proj"), rank, vec!["dequantization"]),
        Fault::IndexerWrongDtype => {
            let w = engine::indexer_float_weight(&m.file, layer).expect("an F16/BF16 indexer weight");
            let site = match w {
                "attn_k" => "w.idx_k",
                "proj" => "w.idx_proj",
                _ => "w.idx_q_b",
            };
            (one(site), rank, vec!["dequantization"])
        }
        Fault::IndexerWrongLayer => (one("w.idx_q_b"), rank, vec!["wrong-layer"]),
        Fault::IndexerTopkDrift => (one("indexer_topk"), rank, vec!["config-drift"]),
        Fault::IndexerRopeDrift => (one("indexer_score"), rank, vec!["config-drift"]),
        Fault::IndexerStaleCache => (one("indexer_score"), rank, vec!["kv-cache"]),
    };
    Expect { sites, rank, classes }
}

fn load(dir: &std::path::Path, preset: &'static str, n_layers: Option<usize>, tps: Option<Vec<usize>>) -> Model {
    let s = spec(preset, n_layers, None);
    let file = synth(dir, preset, &s);
    let q4k = synth(
        dir,
        &format!("{preset}-q4k"),
        &spec(preset, n_layers, Some(GgmlType::Q4K)),
    );
    let valid = valid_tp_degrees(&s.config);
    let tps = tps
        .unwrap_or_else(|| vec![1, 2, 3, 4, 8])
        .into_iter()
        .filter(|t| valid.contains(t))
        .collect();
    Model {
        preset,
        file,
        q4k,
        config: s.config,
        tps,
    }
}

#[derive(Default)]
struct Tally {
    n: usize,
    localized: usize,
    class_ok: usize,
    skipped: usize,
    seconds: f64,
    classes: std::collections::BTreeSet<String>,
}

#[test]
fn every_fault_is_localized_and_classified() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let models = [
        load(dir.path(), "llama-tiny", None, None),
        load(dir.path(), "deepseek-v3-mini", None, None),
        load(dir.path(), "smollm2-135m", Some(3), None),
        // The seed story's shapes: few cases (TP 8 only).
        load(dir.path(), "glm5-mini", None, Some(vec![8])),
    ];
    eprintln!(
        "synthesized {} presets in {:.1}s",
        models.len(),
        t0.elapsed().as_secs_f64()
    );
    let mut table: BTreeMap<(usize, &str), Tally> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut high_wrong = Vec::new();
    for (fault_idx, fault) in Fault::ALL.into_iter().enumerate() {
        for m in &models {
            let tally = table.entry((fault_idx, m.preset)).or_default();
            let file = if fault == Fault::DequantQ4kScaleMin {
                &m.q4k
            } else {
                &m.file
            };
            let decode_steps = if matches!(fault, Fault::KvSlotOffByOne | Fault::IndexerStaleCache) {
                DECODE_STEPS
            } else {
                0
            };
            let toks = tokens(m.config.vocab, N_TOKENS);
            let last = m.config.n_layers - 1;
            for &tp in &m.tps {
                for layer in [0, last] {
                    // Every rank, and rank-local on the last rank (plus rank 1 at TP 4, so a swap
                    // that does not wrap to rank 0 is covered too).
                    let mut ranks = vec![None];
                    ranks.extend(
                        [1, tp - 1]
                            .into_iter()
                            .filter(|&r| r >= 1 && (tp == 4 || r == tp - 1))
                            .map(Some),
                    );
                    ranks.dedup();
                    for rank in ranks {
                        let s = FaultSpec {
                            fault,
                            layer: Some(layer as u32),
                            rank: rank.map(|r| r as u32),
                        };
                        let case = format!("{} {} tp{tp}", m.preset, s);
                        let t_case = Instant::now();
                        let result = run_diff(&plan(file, toks.clone(), tp, vec![s], decode_steps));
                        tally.seconds += t_case.elapsed().as_secs_f64();
                        let run = match result {
                            Ok(r) => r,
                            Err(e) if matches!(e.downcast_ref(), Some(EngineError::FaultNotApplicable { .. })) => {
                                tally.skipped += 1;
                                continue;
                            }
                            Err(e) => panic!("{case}: {e:#}"),
                        };
                        tally.n += 1;
                        let want = expect(m, &s, tp);
                        let (Some(first), Some(diag)) = (&run.first_divergence, &run.diagnosis) else {
                            failures.push(format!("{case}: verdict {} (no divergence found)", run.verdict));
                            continue;
                        };
                        let localized = first.layer == Some(layer as u32)
                            && want.sites.contains(&first.site)
                            && first.rank == want.rank;
                        let mut classes = want.classes.clone();
                        if fault == Fault::MoeGateRounded {
                            // routing-flip exactly when the layer's expert choice changed.
                            let flipped = run
                                .taps
                                .iter()
                                .any(|t| t.tap == format!("blk.{layer}.moe_topk") && t.metrics.rel_l2 > 0.0);
                            classes = vec![if flipped { "routing-flip" } else { "precision" }];
                        }
                        let mut class_ok = classes.contains(&diag.class.as_str());
                        if matches!(fault, Fault::KvSlotOffByOne | Fault::IndexerStaleCache) {
                            class_ok &= diag.explanation.contains("decode");
                        }
                        tally.classes.insert(diag.class.clone());
                        tally.localized += localized as usize;
                        tally.class_ok += class_ok as usize;
                        let what = format!(
                            "{case}: at {} class {} ({}): {}; want sites {:?} rank {:?} class {:?}",
                            first.tap, diag.class, diag.confidence, diag.explanation, want.sites, want.rank, classes
                        );
                        if !localized || !class_ok {
                            failures.push(what.clone());
                        }
                        if !class_ok && diag.confidence == "high" {
                            high_wrong.push(what);
                        }
                    }
                }
            }
        }
    }
    let mut total = Tally::default();
    eprintln!(
        "\n{:<22} {:<17} {:>5} {:>9} {:>9} {:>7} {:>7}  classes",
        "fault", "preset", "cases", "localized", "class ok", "skipped", "time s"
    );
    for ((fault_idx, preset), t) in &table {
        eprintln!(
            "{:<22} {:<17} {:>5} {:>9} {:>9} {:>7} {:>7.1}  {}",
            Fault::ALL[*fault_idx].name(),
            preset,
            t.n,
            t.localized,
            t.class_ok,
            t.skipped,
            t.seconds,
            t.classes.iter().cloned().collect::<Vec<_>>().join(" ")
        );
        total.n += t.n;
        total.localized += t.localized;
        total.class_ok += t.class_ok;
        total.skipped += t.skipped;
    }
    let pct = |x: usize| 100.0 * x as f64 / total.n.max(1) as f64;
    eprintln!(
        "total: {} cases, localized {:.1} %, class right {:.1} %, {} skipped (not applicable), {:.1}s",
        total.n,
        pct(total.localized),
        pct(total.class_ok),
        total.skipped,
        t0.elapsed().as_secs_f64()
    );
    for f in &failures {
        eprintln!("  FAIL {f}");
    }
    assert!(
        high_wrong.is_empty(),
        "classified wrong with high confidence:\n{}",
        high_wrong.join("\n")
    );
    assert_eq!(total.localized, total.n, "mislocalized cases (see FAIL lines)");
    assert!(
        pct(total.class_ok) >= 95.0,
        "class right in only {:.1} % of cases",
        pct(total.class_ok)
    );
}
