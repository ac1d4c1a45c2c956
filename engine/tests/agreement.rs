//! The engine (cpu) against the reference forward pass, tap by tap: every preset × quant type
//! (those `synth` can quantize today) × every valid TP degree in {1, 2, 3, 4, 8} × both weight
//! storages (f32 shards, quantized shards). Logits top-1
//! must agree at every position, and every tap (unranked, rank-local slices, weight shards) must
//! be within a small rel_l2 of the reference's matching tensor. Run with `--nocapture` to print
//! the worst rel_l2 per site kind.

mod common;

use common::*;
use engine::{valid_tp_degrees, Engine, EngineOptions, WeightStorage};
use references::forward::Reference;
use references::quant::quantize;
use references::synth::SynthSpec;
use references::tap::{rank_columns, weight_in_columns, CollectTap, Recorded, Site, TapKey, WeightKind};
use references::GgmlType;
use std::collections::BTreeMap;

/// rel_l2 allowed at any tap: the engine accumulates in f32, the reference in f64.
const TOL: f64 = 2e-4;

const QUANTS: [GgmlType; 6] = [
    GgmlType::F16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4K,
    GgmlType::Q6K,
];

/// The quant types `references::quant` can write now (the others are skipped, and named).
fn quantizable() -> Vec<GgmlType> {
    QUANTS
        .into_iter()
        .filter(|&t| quantize(t, &[0.5f32; 256]).is_ok())
        .collect()
}

fn weight_rows_or_cols(kind: WeightKind) -> bool {
    // true: the rank holds rows (column-parallel); false: input columns (row-parallel).
    !matches!(kind, WeightKind::O | WeightKind::Down)
}

fn slice_cols(data: &[f32], shape: [usize; 2], cols: std::ops::Range<usize>) -> Vec<f32> {
    data.chunks(shape[1]).flat_map(|r| r[cols.clone()].to_vec()).collect()
}

/// Compares one engine run's taps with the reference's; returns (key kind, rel_l2) pairs.
fn compare(spec: &SynthSpec, tp: usize, eng: &[Recorded], reference: &[Recorded]) -> Vec<(String, f64)> {
    let c = &spec.config;
    let refs: BTreeMap<TapKey, &Recorded> = reference.iter().map(|r| (r.key, r)).collect();
    let mut out = Vec::new();
    for e in eng {
        let Some(r) = refs.get(&e.key.unranked()) else {
            continue;
        };
        let (kind, want): (String, Vec<f32>) = match (e.key.site, e.key.rank) {
            (Site::AttnProj | Site::FfnOut | Site::Embed, Some(_)) => continue, // partial sums
            (Site::Logits, Some(rank)) => {
                let v = engine::weights::vocab_range(c.vocab, tp, rank as usize);
                ("logits@r".into(), slice_cols(&r.data, r.shape, v))
            }
            (Site::Weight(kind), Some(rank)) => {
                let rank = rank as usize;
                let name = format!("w.{}@r", kind.name());
                if weight_rows_or_cols(kind) {
                    match rank_columns(e.key.site, c, tp, rank) {
                        Some(rows) => (name, r.data[rows.start * r.shape[1]..rows.end * r.shape[1]].to_vec()),
                        None => (name, r.data.clone()),
                    }
                } else {
                    let cols = weight_in_columns(kind, c, tp, rank).expect("row-parallel slice");
                    (name, slice_cols(&r.data, r.shape, cols))
                }
            }
            (site, Some(rank)) => match rank_columns(site, c, tp, rank as usize) {
                Some(cols) => (format!("{}@r", site.name()), slice_cols(&r.data, r.shape, cols)),
                None => (format!("{}@r", site.name()), r.data.clone()),
            },
            (site, None) => (site.name(), r.data.clone()),
        };
        assert_eq!(
            e.data.len(),
            want.len(),
            "{}: {tp}: engine {:?} vs reference slice of {:?}",
            e.key,
            e.shape,
            r.shape
        );
        let err = if e.key.site == Site::MoeTopk {
            if e.data == want {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            rel_l2(&e.data, &want)
        };
        assert!(
            err < TOL,
            "{} {} tp {tp}: {} rel_l2 {err:.3e}",
            spec.name,
            spec.weight_type,
            e.key
        );
        out.push((kind, err));
    }
    out
}

fn all_taps(key: &TapKey) -> bool {
    // Weight taps for layer 0 only (they are large); every activation.
    !matches!(key.site, Site::Weight(_)) || key.layer == Some(0)
}

fn run_case(spec: &SynthSpec, seed: u64, n_tokens: usize, worst: &mut BTreeMap<String, f64>) {
    let m = synth(spec, seed);
    let c = &spec.config;
    let toks = tokens(n_tokens, c.vocab, seed);
    let mut rt = CollectTap::new(all_taps);
    let ref_logits = Reference::new(&m.file)
        .unwrap()
        .forward(&toks, &mut rt)
        .expect("reference");
    let tps = valid_tp_degrees(c).into_iter().filter(|t| [1, 2, 3, 4, 8].contains(t));
    for (tp, storage) in tps.flat_map(|tp| [(tp, WeightStorage::F32), (tp, WeightStorage::Quantized)]) {
        let opts = EngineOptions {
            tp,
            storage,
            ..Default::default()
        };
        let mut e = Engine::load(&m.file, opts).expect("engine load");
        let mut et = CollectTap::new(all_taps);
        let logits = e.prefill(&toks, &mut et).expect("prefill");
        assert_eq!(
            argmax_rows(&logits, c.vocab),
            argmax_rows(&ref_logits, c.vocab),
            "{} {} tp {tp} {storage:?}: top-1 differs",
            spec.name,
            spec.weight_type
        );
        for (kind, err) in compare(spec, tp, &et.recorded, &rt.recorded) {
            let w = worst.entry(kind).or_insert(0.0);
            *w = w.max(err);
        }
        // Every rank-local site the engine emits must have been compared at least once.
        assert!(et.recorded.iter().any(|r| r.key.rank.is_some()));
    }
}

fn report(name: &str, worst: &BTreeMap<String, f64>) {
    eprintln!("worst rel_l2 per site kind, {name}:");
    for (k, v) in worst {
        eprintln!("  {k:<14} {v:.2e}");
    }
}

fn preset_all_quants(name: &str, edit: impl Fn(&mut SynthSpec), n_tokens: usize) {
    let mut worst = BTreeMap::new();
    let types = quantizable();
    eprintln!(
        "{name}: quant types {:?} (not yet quantizable: {:?})",
        types,
        QUANTS.iter().filter(|t| !types.contains(t)).collect::<Vec<_>>()
    );
    for (i, ty) in types.into_iter().enumerate() {
        let s = spec(name, ty, &edit);
        run_case(&s, 10 + i as u64, n_tokens, &mut worst);
    }
    report(name, &worst);
}

#[test]
fn llama_tiny_agrees() {
    preset_all_quants("llama-tiny", |_| {}, 6);
}

#[test]
fn deepseek_v3_mini_agrees() {
    preset_all_quants("deepseek-v3-mini", |_| {}, 5);
}

#[test]
fn glm5_mini_agrees() {
    preset_all_quants("glm5-mini", |_| {}, 3);
}

#[test]
fn smollm2_shaped_agrees() {
    // SmolLM2-135M's shapes (9/3 heads: TP 1 and 3), two layers.
    preset_all_quants("smollm2-135m", |s| s.config.n_layers = 2, 4);
}

mod prop {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 4, failure_persistence: None, ..ProptestConfig::default() })]
        #[test]
        fn random_llama_shapes_agree(seed in 0u64..1000, kv in 1usize..3, group in 1usize..3, n_tokens in 1usize..5) {
            let s = spec("llama-tiny", GgmlType::Q8_0, |s| {
                s.config.n_layers = 1;
                s.config.n_kv_heads = kv;
                s.config.n_heads = kv * group * 2;
                s.config.head_dim = 32;
                s.config.rope_dim = 32;
                s.config.d_model = kv * group * 2 * 32;
                s.config.ffn_dim = 384;
                s.config.vocab = 300;
            });
            let mut worst = BTreeMap::new();
            run_case(&s, seed, n_tokens, &mut worst);
        }
    }
}

/// A real DeepSeek-V3 file: an HF transformers model converted by llama.cpp's convert_hf_to_gguf
/// (attn_k_b/attn_v_b as the converter writes them), committed in golden/.
#[test]
fn deepseek_v3_tiny_from_llama_cpp_converter_agrees() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/deepseek-v3-tiny.f32.gguf");
    let file = references::GgufFile::open(&path).expect("golden/deepseek-v3-tiny.f32.gguf");
    let c = references::ModelConfig::from_header(&file.header).unwrap();
    let toks = tokens(6, c.vocab, 1);
    let mut rt = CollectTap::new(all_taps);
    let ref_logits = Reference::new(&file).unwrap().forward(&toks, &mut rt).unwrap();
    let spec = SynthSpec {
        name: "deepseek-v3-tiny (converted)".into(),
        config: c.clone(),
        weight_type: GgmlType::F32,
        embd_type: GgmlType::F32,
        more_bits: None,
    };
    let mut worst: BTreeMap<String, f64> = BTreeMap::new();
    let tps: Vec<usize> = valid_tp_degrees(&c)
        .into_iter()
        .filter(|t| [1, 2, 3, 4, 8].contains(t))
        .collect();
    assert!(tps.len() > 1, "valid TP degrees {tps:?}");
    for tp in tps {
        let opts = EngineOptions {
            tp,
            ..Default::default()
        };
        let mut e = Engine::load(&file, opts).expect("engine load");
        let mut et = CollectTap::new(all_taps);
        let logits = e.prefill(&toks, &mut et).unwrap();
        assert_eq!(
            argmax_rows(&logits, c.vocab),
            argmax_rows(&ref_logits, c.vocab),
            "tp {tp}"
        );
        for (kind, err) in compare(&spec, tp, &et.recorded, &rt.recorded) {
            let w = worst.entry(kind).or_insert(0.0);
            *w = w.max(err);
        }
    }
    report("deepseek-v3-tiny (llama.cpp converter)", &worst);
}
