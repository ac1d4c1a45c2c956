//! The fault catalog: every fault changes the output of the runs it applies to, leaves the
//! signature the harness diagnoses by (canary left, full-size shard, swapped shard, stale buffer,
//! unreduced partial, ...), respects its layer/rank scope, and is refused where it cannot apply.

mod common;

use common::*;
use engine::{Engine, EngineOptions, Fault, FaultSpec};
use references::gguf::GgufFile;
use references::tap::{is_canary, CollectTap, NoTap, Recorded, TapKey};
use references::writer::{GgufWriter, TensorSpec};
use references::GgmlType;

fn engine(m: &Model, tp: usize, faults: &[&str]) -> Result<Engine, engine::EngineError> {
    let faults = faults
        .iter()
        .map(|s| s.parse::<FaultSpec>())
        .collect::<Result<Vec<_>, _>>()?;
    Engine::load(
        &m.file,
        EngineOptions {
            tp,
            faults,
            ..Default::default()
        },
    )
}

fn run(m: &Model, tp: usize, faults: &[&str], toks: &[u32]) -> Vec<f32> {
    engine(m, tp, faults)
        .expect("load")
        .prefill(toks, &mut NoTap)
        .expect("prefill")
}

/// Runs with a tap collecting `keys` (printed forms).
fn taps(m: &Model, tp: usize, faults: &[&str], toks: &[u32], keys: &[&str]) -> Vec<Recorded> {
    let keys: Vec<TapKey> = keys.iter().map(|k| k.parse().unwrap()).collect();
    let mut t = CollectTap::new(move |k: &TapKey| keys.contains(k));
    engine(m, tp, faults)
        .expect("load")
        .prefill(toks, &mut t)
        .expect("prefill");
    t.recorded
}

fn get<'a>(rs: &'a [Recorded], key: &str) -> &'a Recorded {
    let k: TapKey = key.parse().unwrap();
    rs.iter().find(|r| r.key == k).unwrap_or_else(|| panic!("no tap {key}"))
}

fn differs(a: &[f32], b: &[f32]) -> bool {
    let e = rel_l2(a, b);
    e.is_nan() || e > 1e-6
}

fn llama() -> Model {
    synth(&spec("llama-tiny", GgmlType::Q8_0, |_| {}), 21)
}

fn deepseek() -> Model {
    synth(&spec("deepseek-v3-mini", GgmlType::Q8_0, |_| {}), 22)
}

/// llama-tiny with blk.0.attn_q and blk.1.ffn_gate rewritten as (random, finite) Q4_K.
fn llama_q4k() -> Model {
    let src = llama();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q4k.gguf");
    let to_q4k = ["blk.0.attn_q.weight", "blk.1.ffn_gate.weight"];
    let specs: Vec<TensorSpec> = src
        .file
        .tensors()
        .iter()
        .map(|t| {
            let ty = if to_q4k.contains(&t.name.as_str()) {
                GgmlType::Q4K
            } else {
                t.ty
            };
            TensorSpec::new(t.name.clone(), ty, &t.ne)
        })
        .collect();
    let f = std::fs::File::create(&path).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(f), src.file.metadata(), specs).unwrap();
    let mut s = 99u64;
    for t in src.file.tensors() {
        if to_q4k.contains(&t.name.as_str()) {
            let n_blocks = t.n_elems() as usize / 256;
            let mut bytes = Vec::with_capacity(n_blocks * 144);
            for _ in 0..n_blocks {
                bytes.extend_from_slice(&half::f16::from_f32(0.002).to_le_bytes());
                bytes.extend_from_slice(&half::f16::from_f32(0.001).to_le_bytes());
                for _ in 0..140 {
                    s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    bytes.push((s >> 33) as u8);
                }
            }
            w.write_tensor(&bytes).unwrap();
        } else {
            w.write_tensor(src.file.tensor_data(t)).unwrap();
        }
    }
    w.finish().unwrap();
    let file = GgufFile::open(&path).unwrap();
    Model::from_parts(dir, file)
}

#[test]
fn every_fault_changes_the_output() {
    let (ll, ds, q4) = (llama(), deepseek(), llama_q4k());
    let toks = tokens(5, 512, 7);
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
        if fault == Fault::KvSlotOffByOne {
            // Decode-only: the prefill is untouched, the decode steps diverge.
            let healthy = run(m, tp, &[], &toks);
            assert!(
                !differs(&run(m, tp, &[name], &toks), &healthy),
                "{name} changed the prefill"
            );
            let decode = |faults: &[&str]| {
                let mut e = engine(m, tp, faults).unwrap();
                e.prefill(&toks[..3], &mut NoTap).unwrap();
                e.decode(toks[3], &mut NoTap).unwrap();
                e.decode(toks[4], &mut NoTap).unwrap()
            };
            assert!(differs(&decode(&[name]), &decode(&[])), "{name} did not change decode");
            continue;
        }
        let healthy = run(m, tp, &[], &toks);
        let faulty = run(m, tp, &[name], &toks);
        assert!(differs(&faulty, &healthy), "{name} did not change the output");
    }
    // config-drift also applies to the MoE model (expert scale).
    assert!(differs(
        &run(&ds, 1, &["config-drift"], &toks),
        &run(&ds, 1, &[], &toks)
    ));
}

#[test]
fn phantom_attn_out_leaves_the_canary() {
    let m = llama();
    let toks = tokens(4, 512, 1);
    let keys = ["blk.0.attn_out@r0", "blk.0.attn_out@r1", "blk.1.attn_out@r1"];
    let bad = taps(&m, 2, &["phantom-attn-out@0:1"], &toks, &keys);
    assert!(get(&bad, "blk.0.attn_out@r1").data.iter().all(|&x| is_canary(x)));
    assert!(!get(&bad, "blk.0.attn_out@r0").data.iter().any(|&x| is_canary(x)));
    let good = taps(&m, 2, &[], &toks, &keys);
    for r in &good {
        assert!(!r.data.iter().any(|&x| is_canary(x)), "{}", r.key);
    }
}

#[test]
fn kv_b_unsharded_hands_every_rank_the_full_tensor_and_rank_0s_heads() {
    let m = deepseek();
    let toks = tokens(3, 512, 2);
    let keys = [
        "blk.0.w.kv_b@r0",
        "blk.0.w.kv_b@r3",
        "blk.0.k@r0",
        "blk.0.k@r3",
        "blk.0.v@r3",
    ];
    let good = taps(&m, 4, &[], &toks, &keys);
    let bad = taps(&m, 4, &["kv-b-unsharded"], &toks, &keys);
    // 8 heads · (32 + 32) rows of kv_lora 256: full [512, 256] against the shard [128, 256].
    assert_eq!(get(&good, "blk.0.w.kv_b@r3").shape, [128, 256]);
    assert_eq!(get(&bad, "blk.0.w.kv_b@r3").shape, [512, 256]);
    assert_eq!(get(&bad, "blk.0.k@r3").data, get(&bad, "blk.0.k@r0").data);
    assert_ne!(get(&bad, "blk.0.v@r3").data, get(&good, "blk.0.v@r3").data);
    assert_eq!(get(&bad, "blk.0.k@r0").data, get(&good, "blk.0.k@r0").data);
}

#[test]
fn kv_b_shard_swap_exchanges_two_ranks() {
    let m = deepseek();
    let toks = tokens(3, 512, 3);
    let keys = [
        "blk.1.w.kv_b@r1",
        "blk.1.w.kv_b@r2",
        "blk.1.w.kv_b@r0",
        "blk.0.w.kv_b@r1",
    ];
    let good = taps(&m, 4, &[], &toks, &keys);
    let bad = taps(&m, 4, &["kv-b-shard-swap@1:1"], &toks, &keys);
    assert_eq!(get(&bad, "blk.1.w.kv_b@r1").data, get(&good, "blk.1.w.kv_b@r2").data);
    assert_eq!(get(&bad, "blk.1.w.kv_b@r2").data, get(&good, "blk.1.w.kv_b@r1").data);
    assert_eq!(get(&bad, "blk.1.w.kv_b@r0").data, get(&good, "blk.1.w.kv_b@r0").data);
    assert_eq!(get(&bad, "blk.0.w.kv_b@r1").data, get(&good, "blk.0.w.kv_b@r1").data);
}

#[test]
fn k_b_untransposed_changes_only_the_k_rows() {
    let m = deepseek();
    let toks = tokens(2, 512, 4);
    let good = taps(&m, 1, &[], &toks, &["blk.0.w.kv_b@r0"]);
    let bad = taps(&m, 1, &["k-b-untransposed"], &toks, &["blk.0.w.kv_b@r0"]);
    let (g, b) = (&get(&good, "blk.0.w.kv_b@r0").data, &get(&bad, "blk.0.w.kv_b@r0").data);
    let (nope, v, kvl) = (32, 32, 256);
    for head in 0..8 {
        let at = head * (nope + v) * kvl;
        assert_ne!(g[at..at + nope * kvl], b[at..at + nope * kvl]);
        assert_eq!(
            g[at + nope * kvl..at + (nope + v) * kvl],
            b[at + nope * kvl..at + (nope + v) * kvl]
        );
    }
}

#[test]
fn stale_attn_out_shows_the_previous_layers_values() {
    let m = llama();
    let toks = tokens(4, 512, 5);
    let keys = ["blk.0.attn_out@r0", "blk.1.attn_out@r0"];
    let bad = taps(&m, 1, &["stale-attn-out@1"], &toks, &keys);
    assert_eq!(get(&bad, "blk.1.attn_out@r0").data, get(&bad, "blk.0.attn_out@r0").data);
    let good = taps(&m, 1, &[], &toks, &keys);
    assert_ne!(
        get(&good, "blk.1.attn_out@r0").data,
        get(&good, "blk.0.attn_out@r0").data
    );
}

#[test]
fn allreduce_skip_leaves_a_ranks_partial() {
    let m = llama();
    let toks = tokens(4, 512, 6);
    let keys = [
        "blk.0.attn_proj",
        "blk.0.attn_proj@r0",
        "blk.0.ffn_out",
        "blk.0.ffn_out@r0",
        "blk.0.resid_attn@r1",
    ];
    let bad = taps(&m, 2, &["allreduce-skip@0"], &toks, &keys);
    assert_eq!(get(&bad, "blk.0.attn_proj").data, get(&bad, "blk.0.attn_proj@r0").data);
    assert_eq!(get(&bad, "blk.0.ffn_out").data, get(&bad, "blk.0.ffn_out@r0").data);
    let good = taps(&m, 2, &[], &toks, &keys);
    assert_ne!(
        get(&good, "blk.0.attn_proj").data,
        get(&good, "blk.0.attn_proj@r0").data
    );
}

#[test]
fn faults_respect_their_scope() {
    let m = llama();
    let toks = tokens(4, 512, 8);
    let keys = ["blk.0.q@r0", "blk.0.q@r1", "blk.1.q@r0", "blk.1.q@r1"];
    let good = taps(&m, 2, &[], &toks, &keys);
    let bad = taps(&m, 2, &["rope-neox@1:1"], &toks, &keys);
    for k in ["blk.0.q@r0", "blk.0.q@r1", "blk.1.q@r0"] {
        assert_eq!(get(&bad, k).data, get(&good, k).data, "{k}");
    }
    assert_ne!(get(&bad, "blk.1.q@r1").data, get(&good, "blk.1.q@r1").data);
}

#[test]
fn moe_gate_rounded_router_is_fp8() {
    let m = deepseek();
    let toks = tokens(2, 512, 9);
    let bad = taps(
        &m,
        1,
        &["moe-gate-rounded@1"],
        &toks,
        &["blk.1.w.router@r0", "blk.2.w.router@r0"],
    );
    let r1 = &get(&bad, "blk.1.w.router@r0").data;
    assert!(r1.iter().all(|&x| engine::weights::round_fp8_e4m3(x) == x));
    let r2 = &get(&bad, "blk.2.w.router@r0").data;
    assert!(r2.iter().any(|&x| engine::weights::round_fp8_e4m3(x) != x));
}

#[test]
fn faults_that_cannot_apply_are_refused() {
    let (ll, ds) = (llama(), deepseek());
    let err = |m: &Model, tp: usize, f: &str| engine(m, tp, &[f]).err().expect(f).to_string();
    assert!(err(&ll, 2, "kv-b-unsharded").contains("MLA"));
    assert!(err(&ll, 2, "k-b-untransposed").contains("MLA"));
    assert!(err(&ds, 1, "kv-b-shard-swap").contains("TP ≥ 2"));
    assert!(err(&ll, 1, "allreduce-skip").contains("TP ≥ 2"));
    assert!(err(&ll, 1, "moe-gate-rounded").contains("MoE"));
    assert!(err(&ds, 1, "moe-gate-rounded@0").contains("MoE"));
    assert!(err(&ll, 1, "dequant-q4k-scale-min").contains("Q4_K"));
    assert!(err(&ll, 1, "rope-neox@9").contains("layer 9"));
    assert!(err(&ll, 2, "rope-neox@0:2").contains("rank 2"));
    assert!(err(&ll, 1, "no-such-fault").contains("unknown fault"));
}

#[test]
fn kv_b_unsharded_seed_story_shapes_on_glm5_mini() {
    // The seed story: at TP 8 every rank should hold [3584, 512] of kv_b; unsharded, [28672, 512].
    let m = synth(&spec("glm5-mini", GgmlType::Q8_0, |s| s.config.n_layers = 1), 23);
    let toks = [5u32];
    let keys = ["blk.0.w.kv_b@r0", "blk.0.w.kv_b@r7"];
    let bad = taps(&m, 8, &["kv-b-unsharded@0:0"], &toks, &keys);
    assert_eq!(get(&bad, "blk.0.w.kv_b@r7").shape, [3584, 512]);
    assert_eq!(get(&bad, "blk.0.w.kv_b@r0").shape, [28672, 512]);
}
