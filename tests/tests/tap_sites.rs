//! The family tap sites beyond the common set: gpt-oss's `attn_sink` (the probability each head's
//! sink takes) and Gemma's `logits_pre_cap` (before the final soft-cap), on the tiny HF-converted
//! fixtures: the reference emits them consistently with the taps around them, dumps carry them
//! (and are refused them on models without them), and a candidate that drops its sinks diverges
//! first at `attn_sink`.

use harness::compare::{ActDtype, Tolerances};
use harness::diff::{run_diff_candidate, DiffPlan};
use harness::dump::Dump;
use llmdiff_tests::fixtures::golden;
use references::forward::{ops, Reference};
use references::tap::{CollectTap, Site, TapKey};
use references::GgufFile;
use reports::DiffRun;
use std::path::Path;

type Taps = Vec<(TapKey, [usize; 2], Vec<f32>)>;

fn run(file: &GgufFile, toks: &[u32]) -> Taps {
    let r = Reference::new(file).unwrap();
    let mut tap = CollectTap::new(|k: &TapKey| !matches!(k.site, Site::Weight(_)));
    r.forward(toks, &mut tap).unwrap();
    tap.recorded.into_iter().map(|c| (c.key, c.shape, c.data)).collect()
}

fn get(t: &Taps, key: TapKey) -> Option<&Vec<f32>> {
    t.iter().find(|(k, _, _)| *k == key).map(|(_, _, d)| d)
}

fn tokens(vocab: usize) -> Vec<u32> {
    (0..20u32).map(|i| (i * 37 + 5) % vocab as u32).collect()
}

fn write_dump(path: &Path, toks: &[u32], taps: &Taps) {
    let mut header = serde_json::Map::new();
    let meta = serde_json::json!({
        "llmdiff.format": "1",
        "tokens": serde_json::to_string(toks).unwrap(),
        "model": "simulated candidate",
        "tp": "1",
        "mapping": "{}",
    });
    header.insert("__metadata__".into(), meta);
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

fn diff(file: &GgufFile, toks: &[u32], taps: &Taps) -> anyhow::Result<DiffRun> {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cand.safetensors");
    write_dump(&path, toks, taps);
    let dump = Dump::open(&[path])?;
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
    run_diff_candidate(&plan, &dump)
}

/// attn_out with sinks = (1 − sink mass) × attention without them, per query and head, on every
/// layer (windowed and global).
#[test]
fn gpt_oss_sink_mass_is_what_the_attention_leaves_out() {
    let file = GgufFile::open(golden("gpt-oss-tiny.f32.gguf")).unwrap();
    let c = Reference::new(&file).unwrap().config;
    let toks = tokens(c.vocab);
    let n = toks.len();
    let t = run(&file, &toks);
    let (nh, nkv, hd) = (c.n_heads, c.n_kv_heads, c.head_dim);
    let mut worst = 0f64;
    let mut mass_range = (1f64, 0f64);
    for l in 0..c.n_layers {
        let at = |s| get(&t, TapKey::layer(l, s)).unwrap();
        let p = at(Site::AttnSink);
        assert_eq!(p.len(), n * nh);
        let mask = ops::AttnMask {
            window: if c.family.is_swa(l) {
                c.family.sliding_window
            } else {
                None
            },
            ..Default::default()
        };
        let plain = ops::causal_attention_masked(
            at(Site::Q),
            at(Site::K),
            at(Site::V),
            n,
            nh,
            nkv,
            hd,
            hd,
            1.0 / (hd as f64).sqrt(),
            mask,
        );
        let out = at(Site::AttnOut);
        for tt in 0..n {
            for h in 0..nh {
                let m = p[tt * nh + h] as f64;
                mass_range = (mass_range.0.min(m), mass_range.1.max(m));
                for i in 0..hd {
                    let j = (tt * nh + h) * hd + i;
                    worst = worst.max((out[j] as f64 - (1.0 - m) * plain[j] as f64).abs());
                }
            }
        }
    }
    eprintln!(
        "gpt-oss sink mass in [{:.3}, {:.3}], worst |Δ| {worst:.2e}",
        mass_range.0, mass_range.1
    );
    assert!(worst < 1e-5, "worst {worst:e}");
    assert!(
        mass_range.0 > 0.0 && mass_range.1 < 1.0 && mass_range.1 > 1e-3,
        "{mass_range:?}"
    );
}

/// The capped logits are the cap of the pre-cap tap; a file without a final cap has no such tap.
#[test]
fn gemma2_logits_pre_cap_and_no_tap_without_a_cap() {
    let file = GgufFile::open(golden("gemma2-tiny.f32.gguf")).unwrap();
    let c = Reference::new(&file).unwrap().config;
    let cap = c.family.final_softcap.expect("gemma2 caps its logits") as f64;
    let t = run(&file, &tokens(c.vocab));
    let pre = get(&t, TapKey::global(Site::LogitsPreCap)).unwrap();
    let post = get(&t, TapKey::global(Site::Logits)).unwrap();
    let worst = pre
        .iter()
        .zip(post)
        .map(|(&a, &b)| (ops::softcap(a as f64, cap) - b as f64).abs())
        .fold(0f64, f64::max);
    assert!(worst < 1e-6, "{worst:e}");
    assert!(
        pre.iter().zip(post).any(|(a, b)| a != b),
        "the cap changes nothing: the test shows nothing"
    );
    let qwen = GgufFile::open(golden("qwen2-tiny.f32.gguf")).unwrap();
    let qc = Reference::new(&qwen).unwrap().config;
    let qt = run(&qwen, &tokens(qc.vocab));
    assert!(get(&qt, TapKey::global(Site::LogitsPreCap)).is_none());
    assert!(qt.iter().all(|(k, _, _)| k.site != Site::AttnSink));
}

/// A full gpt-oss dump with its sinks agrees; one whose attention drops the sinks diverges first
/// at `attn_sink`; a dump that carries `attn_sink` for a model without sinks is refused.
#[test]
fn dumps_carry_the_new_taps_and_dropped_sinks_diverge_there() {
    let file = GgufFile::open(golden("gpt-oss-tiny.f32.gguf")).unwrap();
    let c = Reference::new(&file).unwrap().config;
    let toks = tokens(c.vocab);
    let t = run(&file, &toks);
    let healthy = diff(&file, &toks, &t).unwrap();
    assert_eq!(healthy.verdict, "agree", "{:?}", healthy.first_divergence);
    assert!(healthy.taps.iter().any(|r| r.tap == "blk.0.attn_sink"));
    // No sinks: mass 0, and the attention normalized over the keys alone (layer 1 on).
    let mut bad = t.clone();
    let (nh, nkv, hd, n) = (c.n_heads, c.n_kv_heads, c.head_dim, toks.len());
    let l = 1;
    let at = |s| get(&t, TapKey::layer(l, s)).unwrap().clone();
    let mask = ops::AttnMask {
        window: if c.family.is_swa(l) {
            c.family.sliding_window
        } else {
            None
        },
        ..Default::default()
    };
    let plain = ops::causal_attention_masked(
        &at(Site::Q),
        &at(Site::K),
        &at(Site::V),
        n,
        nh,
        nkv,
        hd,
        hd,
        1.0 / (hd as f64).sqrt(),
        mask,
    );
    for (k, _, d) in bad.iter_mut() {
        if *k == TapKey::layer(l, Site::AttnSink) {
            d.iter_mut().for_each(|v| *v = 0.0);
        } else if *k == TapKey::layer(l, Site::AttnOut) {
            *d = plain.clone();
        }
    }
    let run_bad = diff(&file, &toks, &bad).unwrap();
    let first = run_bad.first_divergence.as_ref().expect("diverged");
    assert_eq!(first.tap, "blk.1.attn_sink");

    let gemma = GgufFile::open(golden("gemma2-tiny.f32.gguf")).unwrap();
    let gc = Reference::new(&gemma).unwrap().config;
    let gt = tokens(gc.vocab);
    let mut g = run(&gemma, &gt);
    let ok = diff(&gemma, &gt, &g).unwrap();
    assert!(ok.taps.iter().any(|r| r.tap == "logits_pre_cap") && ok.verdict == "agree");
    g.push((
        TapKey::layer(0, Site::AttnSink),
        [gt.len(), gc.n_heads],
        vec![0.0; gt.len() * gc.n_heads],
    ));
    let err = diff(&gemma, &gt, &g).unwrap_err().to_string();
    assert!(err.contains("blk.0.attn_sink") && err.contains("no such tap"), "{err}");
}
