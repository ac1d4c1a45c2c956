//! Sensitivity (issue 5): the smallest relative change of one attention head's weights in one
//! layer that diff-layers still localizes. The engine loads a copy of an F32 model whose
//! `blk.L.attn_q` rows of head H are scaled by (1+ε); the reference reads the original. Measured
//! twice: with every tap (the `w.q` weight tap sees any change of the bytes), and with the weight
//! taps switched off (`w.q=1e9`), so only the activations can localize it (at `blk.L.q@rR`).

use harness::diff::run_diff_against;
use llmdiff_tests::models::{plan, spec, synth, tokens, with_rows_changed};
use references::{GgmlType, GgufFile};
use std::path::Path;

const LAYER: usize = 1;
const HEAD: usize = 5;
const TP: usize = 2;

/// Writes `src` to `path` with head `HEAD`'s rows of `blk.LAYER.attn_q` scaled by (1+eps).
fn perturbed(src: &GgufFile, path: &Path, head_dim: usize, eps: f64) -> GgufFile {
    let rows = HEAD * head_dim..(HEAD + 1) * head_dim;
    let target = format!("blk.{LAYER}.attn_q.weight");
    with_rows_changed(
        src,
        path,
        &target,
        |r| rows.contains(&r),
        |x| (x as f64 * (1.0 + eps)) as f32,
    )
}

/// The divergence a perturbation of size `eps` gives: (first tap, localized right?).
fn probe(orig: &GgufFile, dir: &Path, head_dim: usize, eps: f64, activations_only: bool) -> (String, bool) {
    let eng = perturbed(orig, &dir.join("perturbed.gguf"), head_dim, eps);
    let c = references::ModelConfig::from_header(&orig.header).unwrap();
    let mut p = plan(orig, tokens(c.vocab, 8), TP, Vec::new(), 0);
    if activations_only {
        p.tolerances.set("w.q=1e9").unwrap();
    }
    let run = run_diff_against(&p, &eng).unwrap();
    let want_site = if activations_only { "q" } else { "w.q" };
    let want_rank = (HEAD / (c.n_heads / TP)) as u32;
    match &run.first_divergence {
        None => ("agree".into(), false),
        Some(f) => (
            f.tap.clone(),
            f.layer == Some(LAYER as u32) && f.site == want_site && f.rank == Some(want_rank),
        ),
    }
}

/// The smallest ε on a quarter-decade grid from 1e-1 down to 1e-8 that is localized right, with
/// every larger ε on the grid localized right too.
fn smallest_localized(orig: &GgufFile, dir: &Path, head_dim: usize, activations_only: bool) -> (f64, Vec<String>) {
    let mut smallest = f64::NAN;
    let mut log = Vec::new();
    for k in 4..=32 {
        let eps = 10f64.powf(-k as f64 / 4.0);
        let (tap, ok) = probe(orig, dir, head_dim, eps, activations_only);
        log.push(format!(
            "ε {eps:.2e}: {tap}{}",
            if ok { "" } else { " (not localized)" }
        ));
        if !ok {
            break;
        }
        smallest = eps;
    }
    (smallest, log)
}

#[test]
fn one_head_perturbation_is_localized_down_to_small_eps() {
    let dir = tempfile::tempdir().unwrap();
    let s = spec("llama-tiny", None, Some(GgmlType::F32));
    let orig = synth(dir.path(), "llama-tiny-f32", &s);
    let hd = s.config.head_dim;
    let (by_weights, log_w) = smallest_localized(&orig, dir.path(), hd, false);
    let (by_acts, log_a) = smallest_localized(&orig, dir.path(), hd, true);
    eprintln!("weight taps on:\n  {}", log_w.join("\n  "));
    eprintln!("activation taps only (w.q=1e9):\n  {}", log_a.join("\n  "));
    eprintln!(
        "llama-tiny F32, head {HEAD} of blk.{LAYER}.attn_q scaled by (1+ε), TP {TP}: smallest ε localized by weight taps {by_weights:.1e}, by activation taps only {by_acts:.1e}"
    );
    assert!(
        by_weights <= 1e-5,
        "weight taps localize only down to ε = {by_weights:.1e}"
    );
    assert!(
        by_acts <= 1e-3,
        "activation taps localize only down to ε = {by_acts:.1e}"
    );
}
