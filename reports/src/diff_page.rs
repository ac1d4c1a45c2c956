//! The `diff-layers` report: a [`DiffRun`] rendered as one page. The diagnosis box comes first
//! (verdict, fault class, evidence, a copyable reproduction command), then the charts that make
//! the divergence visible (error per layer, per-head heatmap, per-rank bars, canary coverage,
//! MoE routing), then the sortable tap table.

use crate::charts::{self, Bar, LayerChart, Series, PALETTE};
use crate::html::{escape, page, sci};
use crate::schema::{DiffRun, TapRow};
use plotters::style::RGBColor;
use std::collections::BTreeMap;
use std::fmt::Write;

const CHART_W: u32 = 1100;
/// At most this many rows in the always-visible "over threshold" table.
const MAX_OVER_ROWS: usize = 200;

/// Renders a diff run as one self-contained HTML page.
pub fn render_diff(run: &DiffRun) -> String {
    let mut body = String::new();
    header(run, &mut body);
    diagnosis(run, &mut body);
    let n_layers = run
        .taps
        .iter()
        .filter_map(|t| t.layer)
        .max()
        .map_or(0, |l| l.saturating_add(1));
    layer_charts(run, n_layers, &mut body);
    heads(run, &mut body);
    ranks(run, &mut body);
    canary(run, n_layers, &mut body);
    routing(run, &mut body);
    tables(run, &mut body);
    footer(run, &mut body);
    let title = match &run.first_divergence {
        Some(f) => format!("llmdiff: diverged at {} ({})", f.tap, run.model),
        None => format!("llmdiff: agree ({})", run.model),
    };
    page(&title, &body)
}

fn header(run: &DiffRun, out: &mut String) {
    let injected = if run.injected.is_empty() {
        String::new()
    } else {
        format!(" · injected <code>{}</code>", escape(&run.injected.join(" ")))
    };
    let _ = writeln!(
        out,
        "<header><h1>llmdiff divergence report</h1><div class=meta><code>{}</code> · engine {} TP {} against the reference · {} tokens{}</div></header>",
        escape(&run.model),
        escape(&run.backend),
        run.tp,
        run.tokens.len(),
        injected
    );
}

fn diagnosis(run: &DiffRun, out: &mut String) {
    let n_over = run.taps.iter().filter(|t| t.over).count();
    match (&run.first_divergence, &run.diagnosis) {
        (Some(f), d) => {
            let mut place = Vec::new();
            if let Some(l) = f.layer {
                place.push(format!("layer {l}"));
            }
            place.push(format!("site {}", escape(&f.site)));
            if let Some(r) = f.rank {
                place.push(format!("rank {r}"));
            }
            let _ = write!(
                out,
                "<section id=diagnosis class=diag><div class=verdict>DIVERGED</div><div class=where>first divergence at <code>{}</code> — {}</div>",
                escape(&f.tap),
                place.join(" · ")
            );
            if let Some(d) = d {
                let _ = write!(
                    out,
                    "<div>fault class <span class=chip id=fault-class>{}</span><span class=conf>{} confidence</span></div><p class=evidence id=evidence>{}</p>",
                    escape(&d.class),
                    escape(&d.confidence),
                    escape(&d.explanation)
                );
            }
            if !run.isolation.is_empty() {
                out.push_str(
                    "<div>Op isolation (the reference op re-run on the engine's own inputs):</div><ul class=iso>",
                );
                for iso in &run.isolation {
                    let _ = write!(
                        out,
                        "<li><code>{}</code>: end to end rel_l2 {}, isolated {} → <b>{}</b></li>",
                        escape(&iso.tap),
                        sci(iso.end_to_end_rel_l2),
                        sci(iso.isolated_rel_l2),
                        escape(&iso.verdict)
                    );
                }
                out.push_str("</ul>");
            }
        }
        (None, _) => {
            let _ = write!(
                out,
                "<section id=diagnosis class=\"diag agree\"><div class=verdict>AGREE</div><p class=evidence id=evidence>Every one of the {} compared taps is within its threshold.</p>",
                run.taps.len()
            );
        }
    }
    let _ = write!(
        out,
        "<div>Reproduce:</div><div class=repro><pre id=repro>{}</pre><button id=copy type=button>copy</button></div>",
        escape(&run.repro)
    );
    let _ = writeln!(
        out,
        "<div class=stats><span><b>{}</b> taps compared</span><span><b>{}</b> over threshold</span><span>TP <b>{}</b></span>{}<span>engine {:.2} s · reference {:.2} s · total {:.2} s</span>{}{}</div></section>",
        run.taps.len(),
        n_over,
        run.tp,
        run.dtype.as_ref().map_or(String::new(), |d| format!(
            "<span>compute dtype <b>{}</b> ({})</span>",
            escape(&d.name),
            escape(&d.source)
        )),
        run.timings_s.engine,
        run.timings_s.reference,
        run.timings_s.total,
        if run.unmatched.is_empty() {
            String::new()
        } else {
            format!("<span>unmatched: <code>{}</code></span>", escape(&run.unmatched.join(", ")))
        },
        if run.missing.is_empty() {
            String::new()
        } else {
            format!(
                "<span>missing from the candidate ({}): <code>{}</code></span>",
                run.missing.len(),
                escape(&run.missing.join(", "))
            )
        }
    );
    for w in &run.coverage_warnings {
        let _ = writeln!(out, "<p class=warn>warning: {}</p>", escape(w));
    }
    if let Some(t) = &run.tp_layout {
        let counts: Vec<String> = t.compared.iter().map(|(k, v)| format!("{v} {k}")).collect();
        let _ = writeln!(
            out,
            "<p>TP {} dump: {} tensors, compared as {}; {} config values compared; {} weight fingerprints hash equal</p>",
            t.tp,
            t.tensors,
            escape(&counts.join(", ")),
            t.config_keys,
            t.weight_hashes_equal
        );
        for line in t
            .config_drift
            .iter()
            .chain(&t.replica_disagreements)
            .chain(&t.partial_findings)
            .chain(&t.weight_findings)
        {
            let _ = writeln!(out, "<p class=warn>{}</p>", escape(line));
        }
    }
}

/// x position of a tap on the per-layer axis: layers as themselves, the embedding before them,
/// the output norm and logits after.
fn x_of(t: &TapRow, n_layers: u32) -> Option<i32> {
    match (t.layer, t.site.as_str()) {
        (Some(l), _) => Some(l as i32),
        (None, "embed") => Some(-1),
        (None, "output_norm") => Some(n_layers as i32),
        (None, "logits") => Some(n_layers as i32 + 1),
        _ => None,
    }
}

/// Worst value of a group, where any non-finite value wins.
fn worst(acc: f64, v: f64) -> f64 {
    if !acc.is_finite() || !v.is_finite() {
        if acc.is_nan() || v.is_nan() {
            f64::NAN
        } else {
            f64::INFINITY
        }
    } else {
        acc.max(v)
    }
}

fn color_of(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

fn layer_charts(run: &DiffRun, n_layers: u32, out: &mut String) {
    let first_site = run.first_divergence.as_ref().map(|f| f.site.clone());
    let first = run.first_divergence.as_ref().and_then(|f| {
        let row = run.taps.iter().find(|t| t.tap == f.tap)?;
        Some((x_of(row, n_layers)?, f.tap.clone()))
    });
    for weights in [false, true] {
        // Sites in execution order (first appearance), each reduced to its worst tap per x.
        let mut order: Vec<String> = Vec::new();
        let mut by_site: BTreeMap<String, BTreeMap<i32, f64>> = BTreeMap::new();
        let mut thresholds: Vec<f64> = Vec::new();
        for t in &run.taps {
            if t.site.starts_with("w.") != weights {
                continue;
            }
            let Some(x) = x_of(t, n_layers) else { continue };
            let site = if t.layer.is_none() {
                "embed/out/logits".to_string()
            } else {
                t.site.clone()
            };
            if !by_site.contains_key(&site) {
                order.push(site.clone());
            }
            let slot = by_site.entry(site).or_default().entry(x).or_insert(0.0);
            *slot = worst(*slot, t.metrics.rel_l2);
            if t.layer.is_some() && !thresholds.contains(&t.threshold) {
                thresholds.push(t.threshold);
            }
        }
        if order.is_empty() {
            continue;
        }
        thresholds.sort_by(f64::total_cmp);
        if thresholds.len() > 2 {
            thresholds = vec![thresholds[0], thresholds[thresholds.len() - 1]];
        }
        let series: Vec<Series> = order
            .iter()
            .enumerate()
            .map(|(i, site)| Series {
                name: site.clone(),
                color: if site == "embed/out/logits" {
                    RGBColor(0, 0, 0)
                } else {
                    color_of(i)
                },
                points: by_site[site].iter().map(|(&x, &v)| (x, v)).collect(),
                emphasis: first_site.as_deref() == Some(site.as_str()),
                line: site != "embed/out/logits",
            })
            .collect();
        let chart_first = first
            .clone()
            .filter(|_| first_site.as_deref().is_some_and(|s| s.starts_with("w.") == weights));
        let svg = charts::layer_error_chart(&LayerChart {
            series: &series,
            n_layers,
            thresholds: &thresholds,
            first: chart_first.or_else(|| first.clone().filter(|_| !weights)),
            y_desc: "rel_l2 (worst tap, log)",
            width: CHART_W,
            height: if weights { 340 } else { 440 },
        });
        let (id, title, how) = if weights {
            (
                "chart-weights",
                "Weight shards per layer",
                "Each rank's shard of each weight against the reference's slice for that rank. A loader fault (unsharded, swapped, untransposed) shows here before any activation moves; exact matches sit on the floor.",
            )
        } else {
            (
                "chart-layers",
                "Error per layer",
                "rel_l2 = |engine − reference| / |reference| of every activation site, worst rank per layer, on a log axis. Healthy taps stay under the dashed threshold; the red band starts at the first divergence and everything inside it is downstream. Purple crosses on top are NaN or inf.",
            )
        };
        let _ = write!(
            out,
            "<section class=chart id={id}><h2>{title}</h2><p class=how>{how}</p>{svg}<div class=legend>"
        );
        for s in &series {
            let _ = write!(
                out,
                "<span><i class='{}' style='background:{}'></i>{}</span>",
                if s.emphasis { "thick" } else { "" },
                charts::css_color(s.color),
                escape(&s.name)
            );
        }
        out.push_str("</div></section>\n");
    }
}

/// Reads a head matrix in words: which engine heads match which reference heads.
pub fn read_heads(n: usize, cosine: &[f64], tp: usize) -> String {
    let mut best: Vec<Option<usize>> = Vec::with_capacity(n);
    for e in 0..n {
        let row = cosine.get(e * n..((e + 1) * n).min(cosine.len())).unwrap_or(&[]);
        let b = row
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .max_by(|a, b| a.1.total_cmp(b.1))
            .filter(|(_, v)| **v > 0.98)
            .map(|(i, _)| i);
        best.push(b);
    }
    if best.iter().enumerate().all(|(e, b)| *b == Some(e)) {
        return "Diagonal: every engine head matches its own reference head, so heads are laid out correctly here."
            .into();
    }
    let per_rank = if tp > 1 && n % tp == 0 { n / tp } else { n };
    let rank_of = |h: usize| h / per_rank.max(1);
    // Runs of engine heads within one rank with the same offset (or no match), then runs that
    // land on the same reference heads merged (an unsharded kv_b: every rank has rank 0's heads).
    // (first engine head, last engine head, the reference heads they match).
    type Run = (usize, usize, Option<(usize, usize)>);
    let mut runs: Vec<Run> = Vec::new();
    let mut i = 0;
    while i < n {
        let key = best[i].map(|b| b as i64 - i as i64);
        let mut j = i + 1;
        while j < n && best[j].map(|b| b as i64 - j as i64) == key && rank_of(j) == rank_of(i) {
            j += 1;
        }
        if key != Some(0) {
            let target = key.map(|off| ((i as i64 + off) as usize, (j as i64 - 1 + off) as usize));
            match runs.last_mut() {
                Some(last) if last.2 == target && last.1 + 1 == i => last.1 = j - 1,
                _ => runs.push((i, j - 1, target)),
            }
        }
        i = j;
    }
    let span = |a: usize, b: usize| if a == b { format!("{a}") } else { format!("{a}–{b}") };
    let parts: Vec<String> = runs
        .iter()
        .map(|&(a, b, target)| {
            let (ra, rb) = (rank_of(a), rank_of(b));
            let ranks = match (per_rank < n, ra == rb) {
                (false, _) => String::new(),
                (true, true) => format!(" (rank {ra})"),
                (true, false) => format!(" (ranks {ra}–{rb}, each)"),
            };
            match target {
                Some((x, y)) => format!(
                    "engine heads {}{ranks} match reference heads {}",
                    span(a, b),
                    span(x, y)
                ),
                None => format!("engine heads {}{ranks} match no reference head", span(a, b)),
            }
        })
        .collect();
    format!("Off the diagonal: {}.", parts.join("; "))
}

fn heads(run: &DiffRun, out: &mut String) {
    let Some(h) = &run.heads else { return };
    let svg = charts::head_heatmap(h.n_heads, &h.cosine, run.tp);
    let _ = writeln!(
        out,
        "<section class=chart id=chart-heads><h2>Per-head cosine at <code>{}</code></h2><p class=how>Engine heads (rows) against reference heads (columns), rank blocks outlined. A healthy tap is a red diagonal; a head permutation or an unsharded kv_b moves it off the diagonal; a white row is a head the engine never produced.</p>{svg}<p class=reading id=heads-reading>{}</p></section>",
        escape(&h.tap),
        escape(&read_heads(h.n_heads, &h.cosine, run.tp))
    );
}

fn ranks(run: &DiffRun, out: &mut String) {
    let Some(f) = &run.first_divergence else { return };
    // Activation sites of the divergent layer; a divergent weight leads with its own group.
    let keep = |t: &TapRow| !t.site.starts_with("w.") || t.site == f.site;
    let mut taps: Vec<&TapRow> = run.taps.iter().filter(|t| t.layer == f.layer && keep(t)).collect();
    taps.sort_by_key(|t| !t.site.starts_with("w."));
    let mut groups: Vec<(String, Vec<Bar>)> = Vec::new();
    let mut thresholds = Vec::new();
    for t in taps {
        let Some(rank) = t.rank else { continue };
        if groups.last().is_none_or(|g| g.0 != t.site) {
            groups.push((t.site.clone(), Vec::new()));
        }
        groups.last_mut().expect("pushed").1.push(Bar {
            rank,
            value: t.metrics.rel_l2,
            over: t.over,
            first: t.tap == f.tap,
        });
        if !thresholds.contains(&t.threshold) {
            thresholds.push(t.threshold);
        }
    }
    if groups.is_empty() {
        return;
    }
    let svg = charts::rank_bars(&groups, &thresholds, CHART_W);
    let layer = f.layer.map_or("the global taps".to_string(), |l| format!("layer {l}"));
    let _ = writeln!(
        out,
        "<section class=chart id=chart-ranks><h2>Per rank in {layer}</h2><p class=how>rel_l2 of every rank-local tap in the divergent layer, one group per site. Green is under threshold, red over, purple non-finite; the first divergence is outlined. A fault on one rank stands alone; a fault on every rank is a shared cause.</p>{svg}</section>"
    );
}

fn canary(run: &DiffRun, n_layers: u32, out: &mut String) {
    let layers: Vec<u32> = (0..n_layers).collect();
    let mut rows: Vec<(String, Vec<Option<f64>>)> = Vec::new();
    for site in ["attn_out", "ffn_out"] {
        let mut labels: BTreeMap<Option<u32>, Vec<Option<f64>>> = BTreeMap::new();
        for t in run.taps.iter().filter(|t| t.site == site) {
            let Some(l) = t.layer else { continue };
            labels.entry(t.rank).or_insert_with(|| vec![None; layers.len()])[l as usize] = Some(t.metrics.canary_left);
        }
        for (rank, cells) in labels {
            let label = match rank {
                Some(r) => format!("{site}@r{r}"),
                None => site.to_string(),
            };
            rows.push((label, cells));
        }
    }
    if rows.is_empty() {
        return;
    }
    let any = rows.iter().flat_map(|r| r.1.iter()).any(|c| c.is_some_and(|v| v > 0.0));
    let svg = charts::canary_grid(&rows, &layers, CHART_W);
    let _ = writeln!(
        out,
        "<section class=chart id=chart-canary><h2>Canary coverage of the custom ops</h2><p class=how>Before a custom op runs, its output buffer is filled with a NaN canary; a cell is the share still holding it afterwards. Green everywhere means every op wrote its whole output.{}</p>{svg}</section>",
        if any {
            " The first red cell is the op that did not write; later red cells carry its canary downstream."
        } else {
            ""
        }
    );
}

fn routing(run: &DiffRun, out: &mut String) {
    if run.routing.is_empty() {
        return;
    }
    let layers: Vec<(u32, f64)> = run.routing.iter().map(|r| (r.layer, r.agree_frac)).collect();
    let svg = charts::routing_bars(&layers, CHART_W);
    let _ = writeln!(
        out,
        "<section class=chart id=chart-routing><h2>MoE routing agreement</h2><p class=how>Share of tokens whose set of experts is identical in engine and reference, per MoE layer. Below 100 % the two sides run different experts for some tokens.</p>{svg}</section>"
    );
}

fn tap_row(out: &mut String, idx: usize, t: &TapRow, first: bool) {
    let m = &t.metrics;
    let class = match (first, t.over) {
        (true, _) => " class=f",
        (false, true) => " class=o",
        _ => "",
    };
    let sqnr = if m.rel_l2 == 0.0 {
        "∞".to_string()
    } else {
        format!("{:.1}", m.sqnr_db)
    };
    let _ = writeln!(
        out,
        "<tr{class}><td>{idx}<td>{}<td>{}<td>{}x{}<td>{}<td>{:.6}<td>{}<td>{sqnr}<td>{}<td>{:.0}%<td>{}<td>{}<td>{}",
        escape(&t.tap),
        escape(&t.site),
        t.shape[0],
        t.shape[1],
        sci(m.rel_l2),
        m.cosine,
        sci(m.max_abs),
        m.nonfinite,
        m.canary_left * 100.0,
        short(t.threshold),
        match &t.selection {
            Some(s) => format!("overlap {:.0}%", 100.0 * s.overlap),
            None => t.local.as_ref().map_or("-".to_string(), |l| sci(l.rel_l2)),
        },
        match &t.selection {
            Some(s) => format!("{} violations", s.violations),
            None => t.local.as_ref().map_or("-".to_string(), |l| short(l.bound)),
        }
    );
}

/// A threshold in its shortest form (`5e-5`).
fn short(v: f64) -> String {
    if v.is_finite() && v != 0.0 {
        format!("{v:e}")
    } else {
        sci(v)
    }
}

// Rows are kept lean (no end tags, layer and rank only inside the tap key): a 60-layer TP-8 run
// has about 11 000 of them.
const THEAD: &str = "<thead><tr><th>#<th>tap<th>site<th>shape<th>rel_l2<th>cosine<th>max_abs<th>sqnr dB<th>nonfinite<th>canary<th>threshold<th>local<th>bound</tr></thead>";

fn tables(run: &DiffRun, out: &mut String) {
    let first = run.first_divergence.as_ref().map(|f| f.tap.as_str());
    let over: Vec<(usize, &TapRow)> = run.taps.iter().enumerate().filter(|(_, t)| t.over).collect();
    if !over.is_empty() {
        let _ = writeln!(
            out,
            "<section id=over-taps><h2>Taps over threshold ({}{})</h2><p class=how>In execution order; the first divergence is highlighted. Click a column to sort.</p><div class=scroll><table class=sort>{THEAD}<tbody>",
            over.len(),
            if over.len() > MAX_OVER_ROWS {
                format!(", first {MAX_OVER_ROWS} shown")
            } else {
                String::new()
            }
        );
        for (i, t) in over.iter().take(MAX_OVER_ROWS) {
            tap_row(out, *i, t, Some(t.tap.as_str()) == first);
        }
        out.push_str("</tbody></table></div></section>\n");
    }
    let _ = writeln!(
        out,
        "<section id=all-taps><details{}><summary>All {} taps</summary><p class=how>Click a column to sort.</p><div class=scroll><table class=sort>{THEAD}<tbody>",
        if over.is_empty() { " open" } else { "" },
        run.taps.len()
    );
    for (i, t) in run.taps.iter().enumerate() {
        tap_row(out, i, t, Some(t.tap.as_str()) == first);
    }
    out.push_str("</tbody></table></div></details></section>\n");
}

fn footer(run: &DiffRun, out: &mut String) {
    let _ = write!(
        out,
        "<footer>llmdiff {} · run document format {} · tokens <code>{}</code></footer>",
        escape(&run.llmdiff_version),
        run.format,
        run.tokens.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",")
    );
}
