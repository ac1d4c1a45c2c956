//! Format 2 dumps with expert parallelism and a vocab-parallel embedding and logits, on the
//! tiny Qwen3-MoE model (golden/qwen3moe-tiny.f32.gguf: 4 experts, top-2, vocabulary 320).
//! The candidate is synthetic: the reference's own taps, written as a TP 2 per-rank dump where
//! rank r holds experts {2r, 2r+1} (`ffn_out@rR#partial`, `experts(ids)`: the sum over its
//! experts of each routed token's weight × the expert's output), looks up vocabulary rows
//! 160r:160(r+1) (`embed@rR#partial`, `partial(A:B)`) and computes that slice of the logits
//! (`logits@rR`, `sharded(1,A:B)`). The rank partials are built here from the reference's
//! routing and expert outputs, and checked to sum to the reference's reduced taps before use.
//! Healthy agrees with every tensor compared; a rank computing with the wrong expert, a
//! shifted vocabulary slice and a logits slice at the wrong columns are each found at their
//! rank; expert ids that do not partition the experts are refused.
//! The same EP layout from HF transformers' own expert parallelism (tests/peers/hf_ep_dump.py,
//! golden/candidate-qwen3moe-ep2/) agrees, and a rank holding the wrong expert's weights is named.

use harness::dump::Dump;
use llmdiff_tests::fixtures::golden;
use references::forward::Reference;
use references::tap::{Site, Tap, TapKey};
use references::GgufFile;
use reports::DiffRun;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const MODEL: &str = "qwen3moe-tiny.f32.gguf";
const TP: usize = 2;

/// One rank file's tensors: name, shape, values.
type Tensors = Vec<(String, [usize; 2], Vec<f32>)>;

#[derive(Default)]
struct Collect(Vec<(TapKey, [usize; 2], Vec<f32>)>);

impl Tap for Collect {
    fn wants(&self, key: &TapKey) -> bool {
        !matches!(key.site, Site::Weight(_)) && key.rank.is_none()
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        self.0.push((*key, shape, data.to_vec()));
    }
}

/// What to plant in the per-rank dump.
#[derive(Clone, Copy, Debug, Default)]
struct Fault {
    /// (rank, layer, slot e, weights x): the rank computes expert e's tokens with x's weights.
    expert_weights: Option<(usize, usize, usize, usize)>,
    /// (rank, layer, declared e, computed x): the rank computes expert x (tokens and weights)
    /// in place of its declared expert e.
    expert_held: Option<(usize, usize, usize, usize)>,
    /// (rank, shift): the rank's embedding table holds its slice shifted by `shift` rows.
    embed_shift: Option<(usize, i64)>,
    /// The rank whose logits tensor holds the other rank's columns.
    logits_swapped: Option<usize>,
    /// Rank 1's declared expert ids instead of {2, 3}.
    ids_r1: Option<&'static [u32]>,
}

fn slice(r: usize, vocab: usize) -> std::ops::Range<usize> {
    r * vocab / TP..(r + 1) * vocab / TP
}

fn ids(r: usize, f: &Fault) -> Vec<u32> {
    match (r, f.ids_r1) {
        (1, Some(ids)) => ids.to_vec(),
        _ => vec![2 * r as u32, 2 * r as u32 + 1],
    }
}

fn write(path: &Path, meta: serde_json::Value, tensors: &Tensors) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), meta);
    let mut data = Vec::new();
    for (name, shape, v) in tensors {
        let start = data.len();
        for x in v {
            data.extend_from_slice(&x.to_le_bytes());
        }
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    let num: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    assert!(
        num.sqrt() <= 1e-5 * den.sqrt(),
        "{what}: rel_l2 {:.2e}",
        (num / den).sqrt()
    );
}

/// Writes the TP 2 dump of the reference's taps with `f` planted; returns the rank files.
fn dump(dir: &Path, name: &str, f: &Fault) -> Vec<PathBuf> {
    let file = GgufFile::open(golden(MODEL)).unwrap();
    let reference = Reference::new(&file).unwrap();
    let c = &reference.config;
    let (vocab, d) = (c.vocab, c.d_model);
    let n = 12;
    let tokens: Vec<u32> = (0..n).map(|i| ((5 + 53 * i) % vocab) as u32).collect();
    let mut taps = Collect::default();
    reference.forward(&tokens, &mut taps).unwrap();
    let taps: BTreeMap<TapKey, ([usize; 2], Vec<f32>)> = taps.0.into_iter().map(|(k, s, v)| (k, (s, v))).collect();
    let mut files: Vec<Tensors> = vec![Vec::new(); TP];
    let ranked = [Site::Embed, Site::FfnNorm, Site::MoeLogits, Site::FfnOut, Site::Logits];
    for (key, (shape, v)) in &taps {
        if !ranked.contains(&key.site) {
            files[0].push((key.to_string(), *shape, v.clone()));
        }
    }
    let at = |k: TapKey| taps[&k].1.clone();
    let sum = |parts: &[Vec<f32>]| -> Vec<f32> {
        (0..parts[0].len())
            .map(|i| parts.iter().map(|p| p[i] as f64).sum::<f64>() as f32)
            .collect()
    };
    let put = |files: &mut Vec<Tensors>, r: usize, k: TapKey, suffix: &str, v: Vec<f32>| {
        let w = v.len() / n;
        let key = TapKey {
            rank: Some(r as u32),
            ..k
        };
        files[r].push((format!("{key}{suffix}"), [n, w], v));
    };
    // The vocab-parallel embedding: rank r looks up its slice's tokens (shifted where planted).
    let embed_partial = |r: usize, shift: i64| -> Vec<f32> {
        let ids: Vec<u32> = tokens
            .iter()
            .map(|&t| (t as i64 + shift).clamp(0, vocab as i64 - 1) as u32)
            .collect();
        let mut x = reference.embedding(&ids).unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            if !slice(r, vocab).contains(&(t as usize)) {
                x[i * d..(i + 1) * d].iter_mut().for_each(|v| *v = 0.0);
            }
        }
        x
    };
    let healthy: Vec<Vec<f32>> = (0..TP).map(|r| embed_partial(r, 0)).collect();
    assert_close(&sum(&healthy), &at(TapKey::global(Site::Embed)), "embed partials' sum");
    let parts: Vec<Vec<f32>> = (0..TP)
        .map(|r| embed_partial(r, f.embed_shift.filter(|s| s.0 == r).map_or(0, |s| s.1)))
        .collect();
    let embed = sum(&parts);
    for (r, p) in parts.into_iter().enumerate() {
        put(&mut files, r, TapKey::global(Site::Embed), "#partial", p);
        put(&mut files, r, TapKey::global(Site::Embed), "", embed.clone());
    }
    // Expert parallelism: rank r's partial over the experts it holds.
    for l in 0..c.n_layers {
        let h = at(TapKey::layer(l, Site::FfnNorm));
        let z = at(TapKey::layer(l, Site::MoeLogits));
        let routes = reference.expert_routes(l, &z, n).unwrap().unwrap().routes;
        let partial = |r: usize| -> Vec<f32> {
            let mut acc = vec![0f64; n * d];
            for e in [2 * r, 2 * r + 1] {
                // (slot whose tokens are taken, expert whose weights run them)
                let (slot, weights) = match (f.expert_weights, f.expert_held) {
                    (Some((fr, fl, fe, fx)), _) if (fr, fl, fe) == (r, l, e) => (e, fx),
                    (_, Some((fr, fl, fe, fx))) if (fr, fl, fe) == (r, l, e) => (fx, fx),
                    _ => (e, e),
                };
                let y = reference.expert_ffn(l, weights, &h, n).unwrap();
                for (t, rt) in routes.iter().enumerate() {
                    if let Some(i) = rt.experts.iter().position(|&v| v == slot) {
                        for j in 0..d {
                            acc[t * d + j] += rt.weights[i] * y[t * d + j] as f64;
                        }
                    }
                }
            }
            acc.into_iter().map(|v| v as f32).collect()
        };
        let parts: Vec<Vec<f32>> = (0..TP).map(partial).collect();
        let reduced = sum(&parts);
        if f.expert_weights.is_none() && f.expert_held.is_none() {
            assert_close(&reduced, &at(TapKey::layer(l, Site::FfnOut)), "expert partials' sum");
        }
        for (r, p) in parts.into_iter().enumerate() {
            put(&mut files, r, TapKey::layer(l, Site::FfnNorm), "", h.clone());
            put(&mut files, r, TapKey::layer(l, Site::MoeLogits), "", z.clone());
            put(&mut files, r, TapKey::layer(l, Site::FfnOut), "#partial", p);
            put(&mut files, r, TapKey::layer(l, Site::FfnOut), "", reduced.clone());
        }
    }
    // Vocab-parallel logits: rank r's columns (the other rank's where planted).
    let logits = at(TapKey::global(Site::Logits));
    for r in 0..TP {
        let cols = slice(if f.logits_swapped == Some(r) { 1 - r } else { r }, vocab);
        let v: Vec<f32> = logits
            .chunks(vocab)
            .flat_map(|row| row[cols.clone()].to_vec())
            .collect();
        put(&mut files, r, TapKey::global(Site::Logits), "", v);
    }
    (0..TP)
        .map(|r| {
            let s = slice(r, vocab);
            let ids: Vec<String> = ids(r, f).iter().map(|e| e.to_string()).collect();
            let layout = serde_json::json!({
                "embed": "replicated",
                "embed#partial": format!("partial({}:{})", s.start, s.end),
                "ffn_norm": "replicated",
                "moe_logits": "replicated",
                "ffn_out": "replicated",
                "ffn_out#partial": format!("experts({})", ids.join(",")),
                "logits": format!("sharded(1,{}:{})", s.start, s.end),
            });
            let meta = serde_json::json!({
                "llmdiff.format": "2",
                "tokens": serde_json::to_string(&tokens).unwrap(),
                "model": MODEL,
                "tp": TP.to_string(),
                "rank": r.to_string(),
                "mapping": "{}",
                "layout": layout.to_string(),
                "normalize": "{}",
                "config": "{}",
                "tp_plan": "{\"experts\": \"ep\", \"embed\": \"vocab\", \"lm_head\": \"colwise\"}",
                "llmdiff.compute_dtype": "f32",
            });
            let p = dir.join(format!("{name}.rank{r}.safetensors"));
            write(&p, meta, &files[r]);
            p
        })
        .collect()
}

fn diff(paths: &[PathBuf]) -> anyhow::Result<DiffRun> {
    let file = GgufFile::open(golden(MODEL))?;
    let dump = Dump::open(paths)?;
    llmdiff_tests::models::diff_dump(&file, &dump)
}

fn found(run: &DiffRun, tap: &str, class: &str, needles: &[&str]) {
    let first = run.first_divergence.as_ref().expect("diverged");
    let d = run.diagnosis.as_ref().expect("diagnosis");
    assert_eq!((first.tap.as_str(), d.class.as_str()), (tap, class), "{d:?}");
    for n in needles {
        assert!(d.explanation.contains(n), "{n:?} not in {:?}", d.explanation);
    }
}

#[test]
fn expert_and_vocab_parallel_healthy_agrees_with_every_tensor_compared() {
    let dir = tempfile::tempdir().unwrap();
    let run = diff(&dump(dir.path(), "healthy", &Fault::default())).unwrap();
    assert_eq!(run.verdict, "agree", "{:?}", run.diagnosis);
    let tl = run.tp_layout.as_ref().expect("tp_layout");
    // 2 ranks × (embed + 2 layers' ffn_out) partials; both ranks' logits slices.
    assert_eq!(tl.compared.get("partial"), Some(&6), "{:?}", tl.compared);
    assert_eq!(tl.compared.get("sharded"), Some(&2), "{:?}", tl.compared);
    assert_eq!(tl.compared.get("partial-unchecked"), None, "{:?}", tl.compared);
    assert!(tl.partial_findings.is_empty(), "{:?}", tl.partial_findings);
    assert_eq!(
        run.taps.len() + tl.compared.get("replica").copied().unwrap_or(0),
        tl.tensors,
        "none skipped: {:?}",
        tl.compared
    );
    assert_eq!(tl.layouts["ffn_out#partial"], ["experts(0,1)", "experts(2,3)"]);
}

#[test]
fn a_rank_computing_with_the_wrong_expert_is_found_at_that_rank() {
    let dir = tempfile::tempdir().unwrap();
    // Rank 1 runs expert 3's tokens through expert 0's weights in layer 1.
    let f = Fault {
        expert_weights: Some((1, 1, 3, 0)),
        ..Fault::default()
    };
    let run = diff(&dump(dir.path(), "weights", &f)).unwrap();
    found(
        &run,
        "blk.1.ffn_out@r1",
        "expert-misplaced",
        &["expert 3's", "expert 0's weights", "rank 1"],
    );
    // Rank 0 declares experts 0,1 but computes expert 2 in expert 1's place in layer 0.
    let f = Fault {
        expert_held: Some((0, 0, 1, 2)),
        ..Fault::default()
    };
    let run = diff(&dump(dir.path(), "held", &f)).unwrap();
    found(
        &run,
        "blk.0.ffn_out@r0",
        "expert-misplaced",
        &["computes expert 2", "not expert 1", "experts(0,1)"],
    );
}

#[test]
fn a_shifted_vocab_slice_is_found_at_its_rank() {
    let dir = tempfile::tempdir().unwrap();
    let f = Fault {
        embed_shift: Some((1, 3)),
        ..Fault::default()
    };
    let run = diff(&dump(dir.path(), "shift", &f)).unwrap();
    found(&run, "embed@r1", "head-permutation", &["shifted by 3", "160:320"]);
    // Rank 0 holding rank 1's slice.
    let f = Fault {
        embed_shift: Some((0, 160)),
        ..Fault::default()
    };
    let run = diff(&dump(dir.path(), "swap", &f)).unwrap();
    found(&run, "embed@r0", "head-permutation", &["rank 1's slice", "160:320"]);
}

#[test]
fn vocab_parallel_logits_are_compared_by_their_declared_range() {
    let dir = tempfile::tempdir().unwrap();
    let f = Fault {
        logits_swapped: Some(1),
        ..Fault::default()
    };
    let run = diff(&dump(dir.path(), "logits", &f)).unwrap();
    assert_eq!(run.verdict, "diverged");
    let first = run.first_divergence.as_ref().unwrap();
    assert_eq!(first.tap, "logits@r1", "{:?}", run.diagnosis);
    let row = run
        .taps
        .iter()
        .find(|t| t.tap == "logits@r0")
        .expect("rank 0's slice compared");
    assert!(!row.over, "{row:?}");
}

#[test]
fn expert_ids_that_do_not_partition_the_experts_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for (ids, needle) in [
        (&[1u32, 2, 3][..], "expert 1 is declared on ranks [0, 1]"),
        (&[3u32][..], "experts [2] on none"),
        (&[2u32, 7][..], "expert id 7 is outside"),
    ] {
        let f = Fault {
            ids_r1: Some(ids),
            ..Fault::default()
        };
        let e = format!("{:#}", diff(&dump(dir.path(), "ids", &f)).expect_err("refused"));
        assert!(e.contains(needle), "{ids:?}: {e}");
    }
}

/// The real thing: HF transformers' own expert parallelism (TP 2 / EP 2, `AllReduceEP`, CPU,
/// gloo, fp32 compute) on the bf16 tiny Qwen3-MoE, dumped by tests/peers/hf_ep_dump.py
/// (golden/candidate-qwen3moe-ep2/): each rank's pre-reduce MoE output, `experts(ids)`.
fn hf_ep(name: &str) -> DiffRun {
    let dir = golden("candidate-qwen3moe-ep2");
    let file = GgufFile::open(golden("hf/qwen3moe-bf16.gguf")).unwrap();
    let paths: Vec<PathBuf> = (0..TP)
        .map(|r| dir.join(format!("{name}.rank{r}.safetensors")))
        .collect();
    let dump = Dump::open(&paths).unwrap();
    llmdiff_tests::models::diff_dump(&file, &dump).unwrap()
}

#[test]
fn hf_expert_parallel_partials_agree_and_a_misplaced_expert_is_named() {
    let run = hf_ep("healthy");
    assert_eq!(run.verdict, "agree", "{:?}", run.diagnosis);
    let tl = run.tp_layout.as_ref().expect("tp_layout");
    assert_eq!(tl.compared.get("partial"), Some(&4), "{:?}", tl.compared);
    assert_eq!(
        run.taps.len() + tl.compared.get("replica").copied().unwrap_or(0),
        tl.tensors,
        "none skipped: {:?}",
        tl.compared
    );
    assert_eq!(tl.layouts["ffn_out#partial"], ["experts(0,1)", "experts(2,3)"]);
    let run = hf_ep("expert-slot-r1");
    found(
        &run,
        "blk.0.ffn_out@r1",
        "expert-misplaced",
        &["expert 3's", "expert 2's weights", "rank 1"],
    );
}
