//! `reports`: the versioned report schema (serde types) that harness fills, and the pure
//! rendering of a report into one self-contained HTML string with inline SVG charts.
//! Data in, a string out: no file I/O, no CLI.

pub mod schema;

pub use schema::*;

/// Renders a diff run as one self-contained HTML page (a plain summary until the chart work lands).
pub fn render_diff(run: &DiffRun) -> String {
    let esc = |s: &str| s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut rows = String::new();
    for t in &run.taps {
        rows.push_str(&format!(
            "<tr{}><td>{}</td><td>{:.3e}</td><td>{:.6}</td><td>{:.0}%</td></tr>",
            if t.over { " class=over" } else { "" },
            esc(&t.tap),
            t.metrics.rel_l2,
            t.metrics.cosine,
            t.metrics.canary_left * 100.0
        ));
    }
    let diag = match &run.diagnosis {
        Some(d) => format!("<p><b>{}</b>: {}</p>", esc(&d.class), esc(&d.explanation)),
        None => "<p>every tap within tolerance</p>".to_string(),
    };
    format!(
        "<!doctype html><html><head><meta charset=utf-8><title>llmdiff: {}</title><style>.over{{color:#b00}}td{{padding:0 8px}}</style></head><body><h1>{}</h1><div id=diagnosis>{}</div><pre>{}</pre><table><tr><th>tap</th><th>rel_l2</th><th>cosine</th><th>canary</th></tr>{}</table></body></html>",
        esc(&run.model),
        esc(&run.verdict),
        diag,
        esc(&run.repro),
        rows
    )
}
