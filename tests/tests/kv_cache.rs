//! The decode steps' K/V cache taps (issue 44, item 8): `kv_cache_k`/`kv_cache_v` hold the cache
//! rows each decode step's attention read. Under `kv-slot-off-by-one` (decode writes the new
//! token's K/V one slot early) the first divergence is the cache tap of the first decode step,
//! classed `kv-cache` with the slot and the position whose K it holds, and `attn_out` — replayed
//! on the cache it read — is locally fine. A healthy decode agrees at f32 and bf16 with the cache
//! taps compared. On the synth llama-tiny preset and the qwen3 fixture, at TP 1 and 2.

use engine::{ComputeDtype, Fault, FaultSpec};
use harness::diff::run_diff;
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::GgufFile;
use std::path::PathBuf;

const N_TOKENS: usize = 8;
const DECODE_STEPS: usize = 2;

fn models(dir: &std::path::Path) -> Vec<(&'static str, GgufFile)> {
    let qwen3 = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/qwen3-tiny.f32.gguf");
    vec![
        ("llama-tiny", synth(dir, "llama-tiny", &spec("llama-tiny", None, None))),
        ("qwen3-tiny", GgufFile::open(&qwen3).expect("qwen3 fixture")),
    ]
}

fn run(file: &GgufFile, tp: usize, faults: Vec<FaultSpec>, dtype: ComputeDtype) -> reports::DiffRun {
    let vocab = references::ModelConfig::from_header(&file.header).unwrap().vocab;
    let mut p = plan(file, tokens(vocab, N_TOKENS), tp, faults, DECODE_STEPS);
    p.engine.compute_dtype = dtype;
    run_diff(&p).unwrap_or_else(|e| panic!("{}: {e:#}", file.path.display()))
}

#[test]
fn slot_off_by_one_is_found_at_the_cache_tap_with_the_slot_named() {
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in models(dir.path()) {
        for tp in [1, 2] {
            for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
                let case = format!("{name} tp {tp} {dtype:?}");
                let fault = FaultSpec {
                    fault: Fault::KvSlotOffByOne,
                    layer: Some(0),
                    rank: None,
                };
                let r = run(&file, tp, vec![fault], dtype);
                let first = r
                    .first_divergence
                    .as_ref()
                    .unwrap_or_else(|| panic!("{case}: no divergence"));
                let diag = r.diagnosis.as_ref().unwrap();
                assert_eq!(first.tap, "blk.0.kv_cache_k@r0", "{case}: {}", diag.explanation);
                assert_eq!(diag.class, "kv-cache", "{case}: {}", diag.explanation);
                // The first decode step (position 6) wrote position 6's K into slot 5 and left
                // its own slot 6 empty.
                let p = N_TOKENS - DECODE_STEPS;
                for want in [
                    format!("decode step of position {p},"),
                    format!("slot {} holds the K of position {p}", p - 1),
                    format!("slot {p} is empty (zeros)"),
                ] {
                    assert!(diag.explanation.contains(&want), "{case}: {}", diag.explanation);
                }
                if dtype == ComputeDtype::Bf16 {
                    // Every tap's local error is computed below f32: attn_out, replayed on the
                    // cache its steps read, is within its bound though its end-to-end error
                    // is not; the cache tap's own local error (against its k) is over.
                    let row = |t: &str| {
                        r.taps
                            .iter()
                            .find(|x| x.tap == t)
                            .unwrap_or_else(|| panic!("{case}: no {t}"))
                    };
                    let attn = row("blk.0.attn_out");
                    let local = attn.local.as_ref().expect("attn_out local error");
                    assert!(
                        attn.metrics.rel_l2 > 1e-2,
                        "{case}: attn_out rel_l2 {}",
                        attn.metrics.rel_l2
                    );
                    assert!(local.rel_l2 <= local.bound, "{case}: attn_out local {local:?}");
                    let cache = row("blk.0.kv_cache_k").local.as_ref().expect("cache local error");
                    assert!(cache.rel_l2 > cache.bound, "{case}: cache local {cache:?}");
                }
            }
        }
    }
}

#[test]
fn healthy_decode_agrees_with_the_cache_compared() {
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in models(dir.path()) {
        for tp in [1, 2] {
            for dtype in [ComputeDtype::F32, ComputeDtype::Bf16] {
                let case = format!("{name} tp {tp} {dtype:?}");
                let r = run(&file, tp, vec![], dtype);
                assert!(r.first_divergence.is_none(), "{case}: {}", r.verdict);
                assert!(r.unmatched.is_empty(), "{case}: unmatched {:?}", r.unmatched);
                // Positions 6 and 7 read 7 + 8 rows.
                let rows = (N_TOKENS - DECODE_STEPS + 1..=N_TOKENS).sum::<usize>();
                for t in ["blk.0.kv_cache_k", "blk.1.kv_cache_v", "blk.0.kv_cache_v@r0"] {
                    let row = r
                        .taps
                        .iter()
                        .find(|x| x.tap == t)
                        .unwrap_or_else(|| panic!("{case}: no {t}"));
                    assert_eq!(row.shape[0], rows, "{case}: {t}");
                    assert!(!row.over, "{case}: {t} over");
                    if dtype == ComputeDtype::F32 {
                        assert!(row.metrics.rel_l2 < 1e-5, "{case}: {t} {}", row.metrics.rel_l2);
                    }
                }
            }
        }
    }
}
