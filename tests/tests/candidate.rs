//! `diff-layers --candidate`: HF transformers dumps of SmolLM2 (layers 0-2, 4 tokens, fp32, from
//! tests/peers/hf_dump_smollm2.py, committed in golden/candidate-smollm2/) against the reference:
//! the healthy dump agrees, the planted faults are localized and classified, and malformed dumps
//! fail with one clean error while NaNs are reported as data.

use clap::Parser;
use harness::dump::Dump;
use llmdiff_tests::fixtures::{golden, smollm2};
use references::GgufFile;
use reports::DiffRun;
use std::path::{Path, PathBuf};

fn dump_path(name: &str) -> PathBuf {
    golden("candidate-smollm2").join(format!("{name}.safetensors"))
}

fn diff(paths: &[PathBuf]) -> anyhow::Result<DiffRun> {
    let file = GgufFile::open(smollm2())?;
    let dump = Dump::open(paths)?;
    llmdiff_tests::models::diff_dump(&file, &dump)
}

#[test]
fn healthy_hf_dump_agrees() {
    let run = diff(&[dump_path("healthy")]).unwrap();
    assert_eq!(run.backend, "candidate");
    assert_eq!(run.verdict, "agree", "first divergence {:?}", run.first_divergence);
    // 37 taps: embed + 3 layers × 12 sites (q/k normalized from HF's rotate_half layout).
    assert_eq!(run.taps.len(), 37);
    let worst = run.taps.iter().map(|t| t.metrics.rel_l2).fold(0f64, f64::max);
    assert!(worst < 5e-5, "worst rel_l2 {worst:e}");
    assert!(run.unmatched.is_empty(), "{:?}", run.unmatched);
    // Layers 3.. and the output are not in the small dump: listed, not guessed.
    assert!(run.missing.contains(&"blk.3.attn_norm".to_string()));
    assert!(run.missing.contains(&"logits".to_string()));
    assert!(!run.missing.iter().any(|k| k.starts_with("blk.0.")));
}

#[test]
fn zeroed_attention_output_is_localized() {
    let run = diff(&[dump_path("attn-zero")]).unwrap();
    let first = run.first_divergence.as_ref().expect("diverged");
    assert_eq!(first.tap, "blk.1.attn_out");
    let d = run.diagnosis.as_ref().unwrap();
    assert_eq!(d.class, "stale-output", "{d:?}");
    assert!(d.explanation.contains("no canary"), "{}", d.explanation);
    let iso = run
        .isolation
        .iter()
        .find(|i| i.tap == "blk.1.attn_out")
        .expect("isolated");
    assert_eq!(iso.verdict, "introduced");
}

#[test]
fn swapped_heads_are_a_head_permutation() {
    let run = diff(&[dump_path("head-swap")]).unwrap();
    let first = run.first_divergence.as_ref().expect("diverged");
    assert_eq!(first.tap, "blk.1.attn_out");
    let d = run.diagnosis.as_ref().unwrap();
    assert_eq!(d.class, "head-permutation", "{d:?}");
    let heads = run.heads.as_ref().expect("head matrix");
    assert_eq!(heads.tap, "blk.1.attn_out");
}

/// A safetensors file by hand: `tensors` are (name, shape, f32 data).
fn write_dump(path: &Path, meta: Option<serde_json::Value>, tensors: &[(&str, [usize; 2], Vec<f32>)]) {
    let mut header = serde_json::Map::new();
    if let Some(m) = meta {
        header.insert("__metadata__".into(), m);
    }
    let mut data = Vec::new();
    for (name, shape, values) in tensors {
        let start = data.len();
        for v in values {
            data.extend_from_slice(&v.to_le_bytes());
        }
        header.insert(
            (*name).into(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_vec(&header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

fn meta(tokens: &[u32]) -> serde_json::Value {
    serde_json::json!({
        "llmdiff.format": "1",
        "tokens": serde_json::to_string(tokens).unwrap(),
        "model": "test",
        "tp": "1",
        "mapping": "{}",
    })
}

/// Runs the CLI as `main` does; returns the one-line error.
fn cli_error(args: &[&str]) -> String {
    let model = smollm2().display().to_string();
    let mut argv = vec!["llmdiff", "diff-layers", model.as_str()];
    argv.extend_from_slice(args);
    let cli = harness::cli::Cli::try_parse_from(argv).unwrap();
    let e = harness::commands::run(cli).expect_err("must fail");
    let msg = format!("{e:#}");
    assert!(!msg.contains('\n'), "{msg}");
    msg
}

#[test]
fn malformed_dumps_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n);
    let s = |p: PathBuf| p.display().to_string();

    write_dump(&p("nometa.st"), None, &[("embed", [2, 576], vec![0.0; 1152])]);
    let e = cli_error(&["--candidate", &s(p("nometa.st"))]);
    assert!(e.contains("llmdiff.format"), "{e}");

    write_dump(
        &p("rows.st"),
        Some(meta(&[1, 2])),
        &[("embed", [3, 576], vec![0.0; 1728])],
    );
    let e = cli_error(&["--candidate", &s(p("rows.st"))]);
    assert!(e.contains("3 rows"), "{e}");

    write_dump(
        &p("width.st"),
        Some(meta(&[1, 2])),
        &[("embed", [2, 100], vec![0.0; 200])],
    );
    let e = cli_error(&["--candidate", &s(p("width.st"))]);
    assert!(e.contains("wrong shape"), "{e}");

    write_dump(
        &p("name.st"),
        Some(meta(&[1, 2])),
        &[("blk.0.nope", [2, 4], vec![0.0; 8])],
    );
    let e = cli_error(&["--candidate", &s(p("name.st"))]);
    assert!(e.contains("bad tap key"), "{e}");

    let healthy = std::fs::read(dump_path("healthy")).unwrap();
    std::fs::write(p("trunc.st"), &healthy[..healthy.len() / 2]).unwrap();
    let e = cli_error(&["--candidate", &s(p("trunc.st"))]);
    assert!(e.contains("truncated") || e.contains("not a readable"), "{e}");

    let e = cli_error(&["--candidate", &s(dump_path("healthy")), "--tokens", "1,2,3"]);
    assert!(e.contains("the dump was run on"), "{e}");
}

#[test]
fn nans_in_a_dump_are_a_nonfinite_divergence() {
    let mut bytes = std::fs::read(dump_path("healthy")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let start = header["blk.1.ffn_up"]["data_offsets"][0].as_u64().unwrap() as usize;
    let at = 8 + n + start + 4 * 7;
    bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes());
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("nan.safetensors");
    std::fs::write(&p, bytes).unwrap();
    let run = diff(&[p]).unwrap();
    assert_eq!(run.first_divergence.as_ref().unwrap().tap, "blk.1.ffn_up");
    let d = run.diagnosis.unwrap();
    assert_eq!(d.class, "nonfinite", "{d:?}");
}
