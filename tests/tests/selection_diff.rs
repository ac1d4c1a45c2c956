//! The selection rule in `diff-layers --candidate` on the DSA fixtures (golden/glm-dsa-tiny and
//! golden/deepseek32-tiny, indexer top_k 3 and 4 on 20 tokens): candidate dumps are the
//! reference's own taps, (a) with the indexer scored in fp8 as vLLM does (q and the key cache in
//! e4m3, groups of 128): near-ties flip, the attention runs on those keys, and the run agrees,
//! the indexer judged by the rule and the attention by its local error on the candidate's own
//! keys; (b) with one layer's selection replaced by the keys the reference scores lowest: the run
//! diverges at that `indexer_topk`, classified `selection-mismatch`. Also the MoE rule: a near-tie
//! expert flip is not a divergence where the candidate's router logits cannot be re-run (no
//! `moe_logits` in the dump; qwen3moe softmax, glm4moe sigmoid + bias), a clear-margin wrong
//! expert is. (DeepSeek-V3's grouped routing is not a plain top-k: its `moe_topk` keeps the
//! replay on the candidate's own logits, or exact comparison without them.)

use harness::compare::{ActDtype, Tolerances};
use harness::diff::{run_diff_candidate, DiffPlan};
use harness::dump::Dump;
use llmdiff_tests::fixtures::golden;
use references::forward::Reference;
use references::tap::{CollectTap, Site, TapKey};
use references::GgufFile;
use reports::DiffRun;
use std::path::Path;

fn tokens(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + 5) % 400).collect()
}

/// Every activation tap of the reference's forward (fp8-scored indexer when `fp8`), in order.
fn taps(file: &GgufFile, toks: &[u32], fp8: bool) -> Vec<(TapKey, [usize; 2], Vec<f32>)> {
    let mut r = Reference::new(file).unwrap();
    r.indexer_fp8 = fp8;
    let mut tap = CollectTap::new(|k: &TapKey| !matches!(k.site, Site::Weight(_)));
    r.forward(toks, &mut tap).unwrap();
    tap.recorded.into_iter().map(|c| (c.key, c.shape, c.data)).collect()
}

/// Writes a format-1 f32 dump of `taps`, declaring `dtype` as the compute dtype when given.
fn write_dump(path: &Path, toks: &[u32], taps: &[(TapKey, [usize; 2], Vec<f32>)], dtype: Option<&str>) {
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("llmdiff.format".into(), "1".into());
    meta.insert("tokens".into(), serde_json::to_string(toks).unwrap().into());
    meta.insert("model".into(), "simulated candidate".into());
    meta.insert("tp".into(), "1".into());
    meta.insert("mapping".into(), "{}".into());
    if let Some(d) = dtype {
        meta.insert("llmdiff.compute_dtype".into(), d.into());
    }
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut data = Vec::new();
    for (k, shape, v) in taps {
        let start = data.len();
        v.iter().for_each(|x| data.extend_from_slice(&x.to_le_bytes()));
        header.insert(
            k.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

fn diff(file: &GgufFile, toks: &[u32], taps: &[(TapKey, [usize; 2], Vec<f32>)]) -> DiffRun {
    diff_as(file, toks, taps, None)
}

fn diff_as(file: &GgufFile, toks: &[u32], taps: &[(TapKey, [usize; 2], Vec<f32>)], dtype: Option<&str>) -> DiffRun {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cand.safetensors");
    write_dump(&path, toks, taps, dtype);
    let dump = Dump::open(&[path]).unwrap();
    let plan = DiffPlan {
        file,
        model_name: "tiny".into(),
        tokens: dump.tokens.clone(),
        engine: engine::EngineOptions::default(),
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro: String::new(),
    };
    run_diff_candidate(&plan, &dump).unwrap()
}

fn row<'a>(run: &'a DiffRun, tap: &str) -> &'a reports::TapRow {
    run.taps
        .iter()
        .find(|t| t.tap == tap)
        .unwrap_or_else(|| panic!("no row {tap}"))
}

fn check_dsa(gguf: &str) {
    let file = GgufFile::open(golden(gguf)).unwrap();
    let toks = tokens(20);
    let n = toks.len();
    let top_k = Reference::new(&file).unwrap().config.indexer.unwrap().top_k;

    // (a) A healthy fp8-scored candidate.
    let healthy = taps(&file, &toks, true);
    let exact = taps(&file, &toks, false);
    let sel = |t: &[(TapKey, [usize; 2], Vec<f32>)], l| {
        t.iter()
            .find(|(k, _, _)| *k == TapKey::layer(l, Site::IndexerTopk))
            .map(|(_, _, d)| d.clone())
    };
    let flipped: Vec<usize> = (0..8)
        .filter(|&l| sel(&healthy, l).is_some() && sel(&healthy, l) != sel(&exact, l))
        .collect();
    assert!(
        !flipped.is_empty(),
        "fp8 scoring flips no selection: the test would show nothing"
    );
    let run = diff(&file, &toks, &healthy);
    assert_eq!(
        run.verdict, "agree",
        "{gguf}: {:?} {:?}",
        run.first_divergence, run.diagnosis
    );
    let l = flipped[0];
    let s = row(&run, &format!("blk.{l}.indexer_topk"));
    let v = s.selection.as_ref().expect("indexer_topk judged by the selection rule");
    eprintln!(
        "{gguf}: fp8 candidate, blk.{l}.indexer_topk overlap {:.3}, near-ties {}, scores {}, rel_l2 on ids {:.2e}",
        v.overlap, v.near_ties, v.scores, s.metrics.rel_l2
    );
    assert!(v.agrees && v.overlap < 1.0 && v.scores == "replayed", "{v:?}");
    // The attention after the flipped selection: far off end to end, right on its own keys.
    let a = row(&run, &format!("blk.{l}.attn_out"));
    let local = a.local.as_ref().expect("attn_out judged locally");
    eprintln!(
        "{gguf}: blk.{l}.attn_out end-to-end rel_l2 {:.2e}, local {:.2e} (bound {:.2e})",
        a.metrics.rel_l2, local.rel_l2, local.bound
    );
    assert!(a.over_end_to_end && !a.over && local.rel_l2 < local.bound, "{a:?}");
    // The fp8 scores themselves: local error under the fp8 bound.
    let sc = row(&run, &format!("blk.{l}.indexer_score"));
    let scl = sc.local.as_ref().expect("indexer_score replayed");
    eprintln!(
        "{gguf}: blk.{l}.indexer_score local rel_l2 {:.2e}, bound {:.2e} (rho {:.2})",
        scl.rel_l2, scl.bound, scl.rho
    );
    assert!(!sc.over && scl.rel_l2 > 1e-3, "{sc:?}");

    // (b) One layer picks the keys the reference scores lowest.
    let scores = exact
        .iter()
        .find(|(k, _, _)| *k == TapKey::layer(l, Site::IndexerScore))
        .map(|(_, _, d)| d.clone())
        .unwrap();
    let mut bad = exact.clone();
    let entry = bad
        .iter_mut()
        .find(|(k, _, _)| *k == TapKey::layer(l, Site::IndexerTopk))
        .unwrap();
    for t in top_k..n {
        let row: Vec<f64> = (0..=t).map(|s| -(scores[t * n + s] as f64)).collect();
        let worst = harness::selection::reference_top_k(&row, top_k);
        for (j, &s) in worst.iter().enumerate() {
            entry.2[t * top_k + j] = s as f32;
        }
    }
    let run = diff(&file, &toks, &bad);
    let first = run.first_divergence.as_ref().expect("diverged");
    assert_eq!(first.tap, format!("blk.{l}.indexer_topk"), "{gguf}");
    let d = run.diagnosis.as_ref().unwrap();
    eprintln!("{gguf}: {}: {}", d.class, d.explanation);
    assert_eq!(d.class, "selection-mismatch", "{d:?}");
    assert!(!row(&run, &first.tap).selection.as_ref().unwrap().agrees);
}

#[test]
fn glm_dsa_fp8_indexer_agrees_and_wrong_keys_diverge_at_the_indexer() {
    check_dsa("glm-dsa-tiny.f32.gguf");
}

#[test]
fn deepseek32_fp8_indexer_agrees_and_wrong_keys_diverge_at_the_indexer() {
    check_dsa("deepseek32-tiny.f32.gguf");
}

/// A bf16 candidate without `moe_logits` in its dump (its router cannot be re-run): one token's
/// k-th and (k+1)-th experts swapped where they nearly tie agrees; one token's best expert
/// replaced by its worst diverges at that `moe_topk` (`routing-flip`).
fn check_moe(gguf: &str) {
    let file = GgufFile::open(golden(gguf)).unwrap();
    let r = Reference::new(&file).unwrap();
    let c = r.config.clone();
    let toks: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % c.vocab as u32).collect();
    let exact = taps(&file, &toks, false);
    let l = (0..c.n_layers).find(|&l| c.is_moe_layer(l)).unwrap();
    let get = |s: Site| {
        exact
            .iter()
            .find(|(k, _, _)| *k == TapKey::layer(l, s))
            .map(|(_, _, d)| d.clone())
            .unwrap()
    };
    let scores = r
        .routing_choice_scores(l, &get(Site::MoeLogits))
        .unwrap()
        .expect("plain top-k routing");
    let k = c.moe.as_ref().unwrap().n_used;
    // Per token: the experts by descending score and the k-th/(k+1)-th gap over max |score|.
    let ranked: Vec<(Vec<usize>, f64)> = scores
        .iter()
        .map(|row| {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            let max = row.iter().fold(0f64, |m, v| m.max(v.abs()));
            let gap = (row[order[k - 1]] - row[order[k]]) / max;
            (order, gap)
        })
        .collect();
    let (t, (order, gap)) = ranked
        .iter()
        .enumerate()
        .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .unwrap();
    // The band: 2 noises of 4 bf16 unit roundoffs on each side of the cut-off.
    assert!(
        *gap < 4.0 * 4.0 / 256.0,
        "{gguf}: no near-tie among 20 tokens (closest gap {gap:.3})"
    );
    let without_logits: Vec<_> = exact
        .iter()
        .filter(|(k, _, _)| k.site != Site::MoeLogits)
        .cloned()
        .collect();
    let with_topk = |ids: Vec<usize>, t: usize| {
        let mut v = without_logits.clone();
        let e = v
            .iter_mut()
            .find(|(key, _, _)| *key == TapKey::layer(l, Site::MoeTopk))
            .unwrap();
        let mut ids = ids;
        ids.sort_unstable();
        for (j, id) in ids.into_iter().enumerate() {
            e.2[t * k + j] = id as f32;
        }
        v
    };
    let mut near: Vec<usize> = order[..k].to_vec();
    near[k - 1] = order[k];
    let run = diff_as(&file, &toks, &with_topk(near, t), Some("bf16"));
    let tap = format!("blk.{l}.moe_topk");
    let sel = row(&run, &tap)
        .selection
        .clone()
        .expect("moe_topk judged by the selection rule");
    eprintln!(
        "{gguf}: near-tie flip at token {t} (gap {gap:.4}): {} {sel:?}",
        run.verdict
    );
    assert_eq!(run.verdict, "agree", "{:?} {:?}", run.first_divergence, run.diagnosis);
    assert!(sel.agrees && sel.overlap < 1.0 && row(&run, &tap).over_end_to_end);

    // The token with the clearest choice routes to its worst expert instead of its best.
    let (t, (order, _)) = ranked
        .iter()
        .enumerate()
        .max_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
        .unwrap();
    let mut wrong: Vec<usize> = order[1..k].to_vec();
    wrong.push(*order.last().unwrap());
    let run = diff_as(&file, &toks, &with_topk(wrong, t), Some("bf16"));
    let first = run.first_divergence.as_ref().expect("diverged");
    assert_eq!(first.tap, tap, "{gguf}");
    let d = run.diagnosis.as_ref().unwrap();
    eprintln!("{gguf}: {}: {}", d.class, d.explanation);
    assert_eq!(d.class, "routing-flip");
    assert!(d.explanation.contains("beyond a near-tie"), "{}", d.explanation);
}

#[test]
fn qwen3moe_near_tie_expert_flip_agrees_and_a_clear_wrong_expert_diverges() {
    check_moe("qwen3moe-tiny.f32.gguf");
}

#[test]
fn glm4moe_near_tie_expert_flip_agrees_and_a_clear_wrong_expert_diverges() {
    check_moe("glm4moe-tiny.f32.gguf");
}
