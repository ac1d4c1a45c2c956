//! Rendering tests: the page renders for diverged and agreeing runs, escapes what it is given,
//! every chart is an SVG with a nonzero size, saved documents (with `null` for NaN) read back,
//! and a 60-layer × 15-site × 8-rank run renders under 2 MB in well under a second.

use reports::sample::diverged_run;
use reports::{render_diff, render_entropy_chart, render_kld_histogram, DiffRun};
use std::time::Instant;

/// `(width, height)` of the first `<svg` after `from` in `html`.
fn svg_size(html: &str, from: usize) -> Option<(f64, f64)> {
    let at = from + html[from..].find("<svg")?;
    let tag = &html[at..at + html[at..].find('>')?];
    let attr = |name: &str| -> Option<f64> {
        let i = tag.find(&format!(" {name}=\""))? + name.len() + 3;
        tag[i..i + tag[i..].find('"')?].parse().ok()
    };
    Some((attr("width")?, attr("height")?))
}

fn chart_size(html: &str, id: &str) -> (f64, f64) {
    let at = html
        .find(&format!("id={id}>"))
        .unwrap_or_else(|| panic!("no section {id}"));
    svg_size(html, at).unwrap_or_else(|| panic!("no svg in {id}"))
}

fn small_run() -> DiffRun {
    diverged_run(4, 2, 1)
}

#[test]
fn diverged_run_renders_diagnosis_and_every_chart() {
    let run = small_run();
    let html = render_diff(&run);
    assert!(html.starts_with("<!doctype html>"));
    assert!(html.contains("DIVERGED"));
    assert!(html.contains("unwritten-output"));
    assert!(html.contains("the custom op never wrote any of its output buffer"));
    assert!(html.contains("<pre id=repro>llmdiff diff-layers"));
    for id in [
        "chart-layers",
        "chart-weights",
        "chart-heads",
        "chart-ranks",
        "chart-canary",
        "chart-routing",
    ] {
        let (w, h) = chart_size(&html, id);
        assert!(w > 100.0 && h > 100.0, "{id}: {w}x{h}");
    }
    assert!(
        html.contains("engine heads 32–63 (rank 1) match no reference head"),
        "heads reading"
    );
    // Self-contained: nothing fetched from anywhere.
    for needle in ["http://", "https://", "src=", "<link"] {
        let hits: Vec<_> = html
            .match_indices(needle)
            .map(|(i, _)| &html[i.saturating_sub(30)..i + 40])
            .collect();
        assert!(
            hits.iter().all(|h| h.contains("xmlns")),
            "external reference {needle}: {hits:?}"
        );
    }
}

#[test]
fn agreeing_run_says_so() {
    let mut run = small_run();
    run.first_divergence = None;
    run.diagnosis = None;
    run.verdict = "agree".into();
    run.heads = None;
    for t in &mut run.taps {
        t.metrics.rel_l2 = 1e-7;
        t.metrics.canary_left = 0.0;
        t.over = false;
    }
    let html = render_diff(&run);
    assert!(html.contains("AGREE"));
    assert!(!html.contains("DIVERGED"));
    assert!(!html.contains("chart-heads"));
    let (w, h) = chart_size(&html, "chart-layers");
    assert!(w > 0.0 && h > 0.0);
}

#[test]
fn escapes_everything_it_is_given() {
    let mut run = small_run();
    run.model = "<script>alert(1)</script>&.gguf".into();
    run.repro = "llmdiff diff-layers '<x>' && rm".into();
    run.diagnosis.as_mut().unwrap().explanation = "a <b>bold</b> \"claim\"".into();
    run.taps[3].tap = "blk.<0>.q".into();
    let html = render_diff(&run);
    assert!(!html.contains("<script>alert"));
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;&amp;.gguf"));
    assert!(html.contains("a &lt;b&gt;bold&lt;/b&gt; &quot;claim&quot;"));
    assert!(html.contains("&#39;&lt;x&gt;&#39; &amp;&amp; rm"));
    assert!(html.contains("blk.&lt;0&gt;.q"));
    // The only scripts are the page's own.
    assert_eq!(html.matches("<script").count(), 1);
}

#[test]
fn saved_documents_with_null_floats_read_back() {
    let run = small_run();
    let text = serde_json::to_string(&run).unwrap();
    assert!(text.contains("\"rel_l2\":null"), "NaN is written as null");
    let back: DiffRun = serde_json::from_str(&text).unwrap();
    assert_eq!(back.taps.len(), run.taps.len());
    assert!(back.taps.iter().any(|t| t.metrics.rel_l2.is_nan()));
    // A document written before `routing` existed still reads.
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_object_mut().unwrap().remove("routing");
    let old: DiffRun = serde_json::from_value(v).unwrap();
    assert!(old.routing.is_empty());
    assert!(render_diff(&old).contains("DIVERGED"));
}

#[test]
fn entropy_charts_take_plain_slices() {
    let eng: Vec<f64> = (0..50).map(|i| 2.0 + (i as f64 * 0.3).sin()).collect();
    let reference: Vec<f64> = (0..50).map(|i| 2.1 + (i as f64 * 0.3).sin()).collect();
    let svg = render_entropy_chart(&eng, &reference);
    assert_eq!(svg_size(&svg, 0), Some((900.0, 300.0)));
    assert!(svg.contains("engine") && svg.contains("reference"));
    let kld: Vec<f64> = (1..=1000).map(|i| 1e-5 * (i as f64).powf(1.5)).chain([0.0]).collect();
    let svg = render_kld_histogram(&kld);
    assert_eq!(svg_size(&svg, 0), Some((900.0, 300.0)));
    for mark in ["median", "p90", "p99 ", "p99.9"] {
        assert!(svg.contains(mark), "{mark}");
    }
    // Degenerate inputs still give a chart.
    assert!(render_kld_histogram(&[]).starts_with("<svg"));
    assert!(render_entropy_chart(&[], &[]).starts_with("<svg"));
}

#[test]
fn sixty_layer_run_is_small_and_fast() {
    let run = diverged_run(60, 8, 37);
    let t0 = Instant::now();
    let html = render_diff(&run);
    let dt = t0.elapsed().as_secs_f64();
    println!(
        "60 layers x {} sites x 8 ranks: {} taps, report {:.2} MB, rendered in {:.3} s",
        reports::sample::SITES.len(),
        run.taps.len(),
        html.len() as f64 / 1e6,
        dt
    );
    assert!(run.taps.len() > 60 * 15 * 8);
    assert!(html.len() < 2_000_000, "{} bytes", html.len());
    // The goal is < 1 s; the bound is loose so a loaded CI machine does not flake.
    assert!(dt < 5.0, "{dt} s");
}
