//! The engine at `--compute-dtype bf16` and `f16` (issue 44 item 6): the logits stay near the f32
//! engine's but are not its; every activation tap holds values the dtype can store; float weights
//! are rounded at load and quantized ones keep their exact values; every fault of the catalog
//! still changes the output; an unwritten custom-op output holds the dtype's canary.

mod common;

use common::*;
use engine::{ComputeDtype, Engine, EngineOptions, Fault, FaultSpec};
use references::tap::{canary_bf16, canary_f16, is_canary, CollectTap, NoTap, Recorded, Site, TapKey, WeightKind};
use references::GgmlType;

const HALF: [ComputeDtype; 2] = [ComputeDtype::Bf16, ComputeDtype::F16];

fn engine(m: &Model, tp: usize, faults: &[&str], dtype: ComputeDtype) -> Result<Engine, engine::EngineError> {
    let faults = faults
        .iter()
        .map(|s| s.parse::<FaultSpec>())
        .collect::<Result<Vec<_>, _>>()?;
    Engine::load(
        &m.file,
        EngineOptions {
            tp,
            faults,
            compute_dtype: dtype,
            ..Default::default()
        },
    )
}

fn run(m: &Model, tp: usize, faults: &[&str], toks: &[u32], dtype: ComputeDtype) -> Vec<f32> {
    engine(m, tp, faults, dtype)
        .expect("load")
        .prefill(toks, &mut NoTap)
        .expect("prefill")
}

/// A prefill with every tap (weights included) collected.
fn all_taps(m: &Model, tp: usize, faults: &[&str], toks: &[u32], dtype: ComputeDtype) -> Vec<Recorded> {
    let mut t = CollectTap::new(|_: &TapKey| true);
    engine(m, tp, faults, dtype)
        .expect("load")
        .prefill(toks, &mut t)
        .expect("prefill");
    t.recorded
}

fn get<'a>(rs: &'a [Recorded], key: &str) -> &'a Recorded {
    let k: TapKey = key.parse().unwrap();
    rs.iter().find(|r| r.key == k).unwrap_or_else(|| panic!("no tap {key}"))
}

/// True when the GGUF tensor behind weight tap `kind` of `layer` is a float type (F32/F16/BF16).
fn weight_is_float(m: &Model, layer: u32, kind: WeightKind) -> bool {
    let t = match kind {
        WeightKind::Q => "attn_q",
        WeightKind::K => "attn_k",
        WeightKind::V => "attn_v",
        WeightKind::O => "attn_output",
        WeightKind::QA => "attn_q_a",
        WeightKind::QB => "attn_q_b",
        WeightKind::KvA => "attn_kv_a_mqa",
        WeightKind::KvB => "attn_k_b",
        WeightKind::Gate => "ffn_gate",
        WeightKind::Up => "ffn_up",
        WeightKind::Down => "ffn_down",
        WeightKind::Router => "ffn_gate_inp",
        WeightKind::IdxQB => "indexer.attn_q_b",
        WeightKind::IdxK => "indexer.attn_k",
        WeightKind::IdxProj => "indexer.proj",
    };
    let ty = m
        .file
        .tensor(&format!("blk.{layer}.{t}.weight"))
        .expect("weight tensor")
        .ty;
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

fn llama() -> Model {
    synth(&spec("llama-tiny", GgmlType::Q8_0, |_| {}), 21)
}

fn deepseek() -> Model {
    synth(&spec("deepseek-v3-mini", GgmlType::Q8_0, |_| {}), 22)
}

/// The dtype-sized bound on the logits' rel_l2 from the f32 engine's: a few hundred roundings of
/// u each compound over the layers; 64·u (bf16 0.25, f16 0.03) is loose enough for the presets and
/// still an order of magnitude under what a fault does to them.
fn logits_bound(dtype: ComputeDtype) -> f64 {
    64.0 * dtype.unit_roundoff()
}

#[test]
fn logits_are_near_the_f32_engines_and_not_identical() {
    let toks = tokens(6, 512, 3);
    for (name, m, tp) in [("llama-tiny", llama(), 2), ("deepseek-v3-mini", deepseek(), 2)] {
        let f32_logits = run(&m, tp, &[], &toks, ComputeDtype::F32);
        for dtype in HALF {
            let logits = run(&m, tp, &[], &toks, dtype);
            let e = rel_l2(&logits, &f32_logits);
            eprintln!("{name} tp{tp} {dtype}: logits rel_l2 from f32 {e:.3e}");
            // Not the f32 engine: at least a rounding's worth away.
            assert!(
                e > 0.1 * dtype.unit_roundoff(),
                "{name} {dtype}: rel_l2 {e:e} (f32's logits?)"
            );
            assert!(e < logits_bound(dtype), "{name} {dtype}: rel_l2 {e:e}");
            // The logits are stored in the dtype too.
            assert!(logits.iter().all(|&x| dtype.round(x) == x), "{name} {dtype}");
        }
        // f16 keeps 3 more mantissa bits than bf16: closer to f32.
        let (b, h) = (
            rel_l2(&run(&m, tp, &[], &toks, ComputeDtype::Bf16), &f32_logits),
            rel_l2(&run(&m, tp, &[], &toks, ComputeDtype::F16), &f32_logits),
        );
        assert!(h < b, "{name}: f16 {h:e} not closer to f32 than bf16 {b:e}");
    }
}

#[test]
fn the_default_is_f32_and_bit_identical() {
    let m = llama();
    let toks = tokens(4, 512, 5);
    let e = Engine::load(&m.file, EngineOptions::default()).unwrap();
    assert_eq!(e.compute_dtype(), ComputeDtype::F32);
    assert_eq!(
        run(&m, 1, &[], &toks, ComputeDtype::F32),
        Engine::load(&m.file, EngineOptions::default())
            .unwrap()
            .prefill(&toks, &mut NoTap)
            .unwrap()
    );
}

#[test]
fn every_activation_tap_is_stored_in_the_dtype_and_weights_follow_the_rules() {
    // llama-tiny with F16 weights (float: rounded at bf16, exact at f16) and deepseek with Q8_0
    // (quantized: exact at both).
    let f16 = synth(&spec("llama-tiny", GgmlType::F16, |_| {}), 31);
    let (ds, toks) = (deepseek(), tokens(5, 512, 9));
    for dtype in HALF {
        for (name, m, tp) in [("llama-tiny F16", &f16, 2), ("deepseek-v3-mini", &ds, 2)] {
            let taps = all_taps(m, tp, &[], &toks, dtype);
            let reference = all_taps(m, tp, &[], &toks, ComputeDtype::F32);
            let mut n_act = 0;
            for r in &taps {
                if let Site::Weight(kind) = r.key.site {
                    let f = &get(&reference, &r.key.to_string()).data;
                    let layer = r.key.layer.expect("weights are per layer");
                    let float = weight_is_float(m, layer, kind);
                    if float && !(dtype == ComputeDtype::F16 && name.contains("F16")) {
                        // A float tensor the dtype cannot hold: rounded at load.
                        let rounded: Vec<f32> = f.iter().map(|&x| dtype.round(x)).collect();
                        assert!(r.data == rounded, "{name} {dtype} {}: not the rounded weight", r.key);
                        assert!(r.data != *f, "{name} {dtype} {}: not rounded", r.key);
                    } else {
                        // F16 at f16, and quantized weights: exactly the f32 engine's.
                        assert!(r.data == *f, "{name} {dtype} {} (float {float})", r.key);
                    }
                    continue;
                }
                n_act += 1;
                let bad = r.data.iter().filter(|&&x| dtype.round(x) != x).count();
                assert_eq!(bad, 0, "{name} {dtype} {}: {bad} values not in the dtype", r.key);
            }
            assert!(n_act > 50, "{name}: only {n_act} activation taps");
            // The quantized weights at deepseek are exact, yet the activations are not f32's.
            assert_ne!(
                get(&taps, "blk.0.attn_norm").data,
                get(&reference, "blk.0.attn_norm").data,
                "{name} {dtype}"
            );
        }
    }
}

#[test]
fn every_fault_changes_the_output_at_bf16_and_f16() {
    let (ll, ds) = (llama(), deepseek());
    // dequant-q4k-scale-min needs a Q4_K tensor: llama-tiny in Q4_K.
    let q4 = synth(&spec("llama-tiny", GgmlType::Q4K, |_| {}), 23);
    let toks = tokens(5, 512, 7);
    let differs = |a: &[f32], b: &[f32]| {
        let e = rel_l2(a, b);
        e.is_nan() || e > 1e-6
    };
    for dtype in HALF {
        for fault in Fault::ALL {
            if fault.is_indexer() {
                // The DSA indexer's: tests/tests/indexer_faults.rs (a DSA fixture, typed copies).
                continue;
            }
            let (m, tp) = match fault {
                Fault::KvBUnsharded | Fault::KvBShardSwap => (&ds, 2),
                Fault::KBUntransposed | Fault::MoeGateRounded => (&ds, 1),
                Fault::DequantQ4kScaleMin => (&q4, 1),
                Fault::AllreduceSkip | Fault::PhantomAttnOut => (&ll, 2),
                _ => (&ll, 1),
            };
            let name = fault.name();
            if fault == Fault::F16Residual && dtype == ComputeDtype::F16 {
                // Nothing to change: the residual is f16 already. Refused, saying why.
                let e = engine(m, tp, &[name], dtype).err().expect("f16-residual at f16");
                assert!(e.to_string().contains("f16"), "{e}");
                continue;
            }
            if fault == Fault::KvSlotOffByOne {
                let decode = |faults: &[&str]| {
                    let mut e = engine(m, tp, faults, dtype).unwrap();
                    e.prefill(&toks[..3], &mut NoTap).unwrap();
                    e.decode(toks[3], &mut NoTap).unwrap();
                    e.decode(toks[4], &mut NoTap).unwrap()
                };
                assert!(
                    differs(&decode(&[name]), &decode(&[])),
                    "{dtype} {name} did not change decode"
                );
                continue;
            }
            let healthy = run(m, tp, &[], &toks, dtype);
            let faulty = run(m, tp, &[name], &toks, dtype);
            let e = rel_l2(&faulty, &healthy);
            eprintln!("{dtype} {name}: logits rel_l2 from healthy {e:.3e}");
            assert!(differs(&faulty, &healthy), "{dtype} {name} did not change the output");
        }
    }
}

#[test]
fn the_canary_at_each_dtype_marks_an_unwritten_output() {
    let m = llama();
    let toks = tokens(4, 512, 1);
    for (dtype, want) in [(ComputeDtype::Bf16, canary_bf16()), (ComputeDtype::F16, canary_f16())] {
        assert_eq!(dtype.canary().to_bits(), want.to_bits());
        let bad = all_taps(&m, 2, &["phantom-attn-out@0:1"], &toks, dtype);
        let unwritten = &get(&bad, "blk.0.attn_out@r1").data;
        // Every element the dtype's canary, bit for bit (not the f32 one: a 16-bit store cannot
        // hold it), and recognised by is_canary.
        assert!(
            unwritten.iter().all(|&x| x.to_bits() == want.to_bits() && is_canary(x)),
            "{dtype}: {:#x}",
            unwritten[0].to_bits()
        );
        // Written outputs, and the whole healthy run, hold no canary.
        assert!(!get(&bad, "blk.0.attn_out@r0").data.iter().any(|&x| is_canary(x)));
        for r in all_taps(&m, 2, &[], &toks, dtype) {
            assert!(!r.data.iter().any(|&x| is_canary(x)), "{dtype} {}", r.key);
        }
        // stale-attn-out reads the other buffer: the previous layer's (rounded) values.
        let stale = all_taps(&m, 1, &["stale-attn-out@1"], &toks, dtype);
        assert_eq!(
            get(&stale, "blk.1.attn_out@r0").data,
            get(&stale, "blk.0.attn_out@r0").data,
            "{dtype}"
        );
    }
}

#[test]
fn decode_and_tp_run_at_bf16() {
    // A decode step after a prefill, at TP 1 and 2: the ranks' fixed-order all-reduce is rounded
    // once, so TP 2 is near TP 1 (not equal: the partial sums round differently).
    let m = llama();
    let toks = tokens(5, 512, 4);
    let dtype = ComputeDtype::Bf16;
    let step = |tp: usize| {
        let mut e = engine(&m, tp, &[], dtype).unwrap();
        e.prefill(&toks[..4], &mut NoTap).unwrap();
        e.decode(toks[4], &mut NoTap).unwrap()
    };
    let (a, b) = (step(1), step(2));
    assert!(a.iter().chain(&b).all(|&x| dtype.round(x) == x));
    let e = rel_l2(&b, &a);
    assert!(e < logits_bound(dtype), "TP 2 vs 1 at bf16: {e:e}");
    // The decode step's logits equal a prefill's last row of the same tokens within the noise.
    let full = run(&m, 1, &[], &toks, dtype);
    let last = &full[4 * a.len()..];
    assert!(rel_l2(&a, last) < logits_bound(dtype));
}
