//! Weight taps on a sample of rows (issue 49): what the sample cannot see. A change confined to
//! rows of `blk.0.attn_q` outside the sample agrees at the `w.q` tap and first shows at the `q`
//! activation that reads those rows; `full_weights` (`--full-weights`) names the weight. A change
//! to every block (what loading and dequantization faults do) is found at the weight either way;
//! the catalog's weight faults are checked under sampling by `fault_matrix.rs`.

use harness::diff::run_diff_against;
use harness::weight_rows::spread;
use llmdiff_tests::models::{plan, spec, synth, tokens, with_rows_changed};
use references::{GgmlType, GgufFile};
use std::path::Path;

const TARGET: &str = "blk.0.attn_q.weight";

/// `src` written to `path` with rows `rows` of [`TARGET`] (F32) scaled by `scale`.
fn perturbed(src: &GgufFile, path: &Path, rows: &[usize], scale: f32) -> GgufFile {
    with_rows_changed(src, path, TARGET, |r| rows.contains(&r), |x| x * scale)
}

/// (the first divergence's site in layer 0, else its tap; the `blk.0.w.q@r0` row's rel_l2) of
/// the diff of `eng` against `orig` at TP 1.
fn first(orig: &GgufFile, eng: &GgufFile, full_weights: bool) -> (String, f64) {
    let c = references::ModelConfig::from_header(&orig.header).unwrap();
    let mut p = plan(orig, tokens(c.vocab, 8), 1, Vec::new(), 0);
    p.full_weights = full_weights;
    let run = run_diff_against(&p, eng).unwrap();
    let wq = run.taps.iter().find(|t| t.tap == "blk.0.w.q@r0").expect("w.q compared");
    let at = match run.first_divergence {
        Some(f) if f.layer == Some(0) => f.site,
        Some(f) => f.tap,
        None => "agree".into(),
    };
    (at, wq.metrics.rel_l2)
}

#[test]
fn a_change_outside_the_sampled_rows_is_named_only_with_full_weights() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec("llama-tiny", Some(1), Some(GgmlType::F32));
    let orig = synth(dir.path(), "llama-tiny-f32", &s);
    let n_rows = s.config.n_heads * s.config.head_dim;
    let sample = spread(n_rows);
    assert!(sample.len() < n_rows, "the weight must be sampled ({n_rows} rows)");
    // Two rows the sample skips, and two it holds.
    let outside: Vec<usize> = (0..n_rows).filter(|r| !sample.contains(r)).take(2).collect();
    let inside = [sample[1], sample[2]];

    let eng = perturbed(&orig, &dir.path().join("outside.gguf"), &outside, 1.5);
    let (at, wq) = first(&orig, &eng, false);
    assert_eq!(
        (at.as_str(), wq),
        ("q", 0.0),
        "sampled: w.q agrees on its sample, q diverges"
    );
    let (at, wq) = first(&orig, &eng, true);
    assert_eq!(at, "w.q", "--full-weights names the weight");
    assert!(wq > 1e-3, "w.q rel_l2 {wq}");

    let eng = perturbed(&orig, &dir.path().join("inside.gguf"), &inside, 1.5);
    for full_weights in [false, true] {
        assert_eq!(first(&orig, &eng, full_weights).0, "w.q", "full_weights {full_weights}");
    }
}
