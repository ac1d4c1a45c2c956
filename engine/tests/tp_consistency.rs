//! The engine against itself: every valid TP degree gives the same logits as TP 1, decode over
//! the KV cache (`decode` and `decode_into`) matches a longer prefill, and invalid TP degrees
//! are refused with the constraint.

mod common;

use common::*;
use engine::{Engine, EngineOptions, WeightStorage};
use references::tap::NoTap;
use references::GgmlType;

fn logits(m: &Model, tp: usize, toks: &[u32]) -> Vec<f32> {
    let mut e = Engine::load(
        &m.file,
        EngineOptions {
            tp,
            ..Default::default()
        },
    )
    .expect("load");
    e.prefill(toks, &mut NoTap).expect("prefill")
}

#[test]
fn llama_tiny_tp_degrees_agree() {
    let m = synth(&spec("llama-tiny", GgmlType::Q8_0, |_| {}), 1);
    let toks = tokens(7, 512, 1);
    let base = logits(&m, 1, &toks);
    for tp in [2, 4] {
        let l = logits(&m, tp, &toks);
        let e = rel_l2(&l, &base);
        assert!(e < 1e-5, "tp {tp}: rel_l2 {e}");
        assert_eq!(argmax_rows(&l, 512), argmax_rows(&base, 512));
    }
}

#[test]
fn deepseek_mini_tp_degrees_agree() {
    let m = synth(&spec("deepseek-v3-mini", GgmlType::Q8_0, |_| {}), 2);
    let toks = tokens(6, 512, 2);
    let base = logits(&m, 1, &toks);
    for tp in [2, 4, 8] {
        let l = logits(&m, tp, &toks);
        let e = rel_l2(&l, &base);
        assert!(e < 1e-5, "tp {tp}: rel_l2 {e}");
    }
}

#[test]
fn decode_matches_prefill() {
    for name in ["llama-tiny", "deepseek-v3-mini"] {
        let m = synth(&spec(name, GgmlType::Q8_0, |_| {}), 3);
        let v = 512;
        let toks = tokens(6, v, 3);
        let full = logits(&m, 2, &toks);
        for storage in [WeightStorage::F32, WeightStorage::Quantized] {
            let opts = EngineOptions {
                tp: 2,
                storage,
                ..Default::default()
            };
            let mut e = Engine::load(&m.file, opts).unwrap();
            e.prefill(&toks[..3], &mut NoTap).unwrap();
            // decode and decode_into by turns, the latter into a reused buffer (replaced whole).
            let mut reused = vec![f32::NAN; 3];
            for (i, &t) in toks[3..].iter().enumerate() {
                let row = if i % 2 == 0 {
                    e.decode(t, &mut NoTap).unwrap()
                } else {
                    e.decode_into(t, &mut NoTap, &mut reused).unwrap();
                    reused.clone()
                };
                let want = &full[(3 + i) * v..(4 + i) * v];
                let err = rel_l2(&row, want);
                assert!(err < 1e-5, "{name} {storage:?}: decode step {i}: rel_l2 {err}");
            }
            assert_eq!(e.n_past(), 6);
        }
    }
}

#[test]
fn prefill_last_is_the_last_row_of_prefill() {
    for (name, tp) in [("llama-tiny", 2), ("deepseek-v3-mini", 1)] {
        let m = synth(&spec(name, GgmlType::Q8_0, |_| {}), 5);
        let v = 512;
        let toks = tokens(7, v, 5);
        let full = logits(&m, tp, &toks);
        let mut e = Engine::load(
            &m.file,
            EngineOptions {
                tp,
                ..Default::default()
            },
        )
        .unwrap();
        let last = e.prefill_last(&toks).unwrap();
        assert_eq!(last.len(), v);
        let err = rel_l2(&last, &full[6 * v..]);
        assert!(err < 1e-6, "{name}: rel_l2 {err}");
        // The cache holds the whole prompt: decoding goes on from it.
        assert_eq!(e.n_past(), 7);
    }
}

#[test]
fn generate_is_greedy_and_stops() {
    let m = synth(&spec("llama-tiny", GgmlType::Q8_0, |_| {}), 4);
    let mut e = Engine::load(&m.file, EngineOptions::default()).unwrap();
    let prompt = tokens(4, 512, 4);
    let out = e.generate(&prompt, 5, None).unwrap();
    assert_eq!(out.len(), 5);
    // Greedy: each token is the argmax of a full prefill of everything before it.
    let mut seq = prompt.clone();
    for &t in &out {
        let l = e.prefill(&seq, &mut NoTap).unwrap();
        assert_eq!(argmax_rows(&l[(seq.len() - 1) * 512..], 512)[0] as u32, t);
        seq.push(t);
    }
    let stopped = e.generate(&prompt, 5, Some(out[1])).unwrap();
    assert_eq!(stopped, out[..2].to_vec());
}

#[test]
fn bad_tp_and_bad_input_are_errors() {
    let m = synth(
        &spec("llama-tiny", GgmlType::Q8_0, |s| {
            s.config.n_heads = 9;
            s.config.n_kv_heads = 3;
            s.config.d_model = 288;
            s.config.head_dim = 32;
            s.config.rope_dim = 32;
            s.config.n_layers = 1;
            s.config.ffn_dim = 576;
        }),
        5,
    );
    let err = Engine::load(
        &m.file,
        EngineOptions {
            tp: 2,
            ..Default::default()
        },
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        err.contains("9 attention heads") && err.contains("3 KV heads") && err.contains("1, 3"),
        "{err}"
    );
    let mut e = Engine::load(
        &m.file,
        EngineOptions {
            tp: 3,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(e.prefill(&[], &mut NoTap).is_err());
    assert!(e
        .prefill(&[100_000], &mut NoTap)
        .unwrap_err()
        .to_string()
        .contains("outside the vocabulary"));
    assert!(e.decode(1, &mut NoTap).is_err());
    assert!(Engine::load(
        &m.file,
        EngineOptions {
            tp: 0,
            ..Default::default()
        }
    )
    .is_err());
}
