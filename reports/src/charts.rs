//! The report's charts, drawn with plotters' SVG backend into strings: error per layer (log
//! axis, threshold and first divergence marked), the per-head cosine heatmap, per-rank bars,
//! canary coverage, MoE routing agreement, and the entropy run's entropy-per-position and KLD
//! histogram. Each function takes plain data and returns one `<svg>` element; none reads files
//! or fonts (the SVG backend writes text as `<text>` elements the browser lays out).

use plotters::coord::Shift;
use plotters::prelude::*;

/// Series colors, in order (Tableau 10 plus two): distinguishable and print-safe.
pub const PALETTE: [RGBColor; 12] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(57, 59, 121),
    RGBColor(99, 121, 57),
    RGBColor(214, 97, 107),
];

const RED: RGBColor = RGBColor(200, 30, 30);
const GREEN_OK: RGBColor = RGBColor(90, 170, 90);
const GRID: RGBColor = RGBColor(225, 225, 225);
const NONFINITE: RGBColor = RGBColor(120, 0, 160);
const FONT: &str = "sans-serif";

/// `#rrggbb` of a palette color, for HTML legends.
pub fn css_color(c: RGBColor) -> String {
    format!("#{:02x}{:02x}{:02x}", c.0, c.1, c.2)
}

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Runs `draw` on a fresh `w`×`h` SVG and returns the SVG text; a drawing error becomes a small
/// SVG that says so, so one bad chart never takes the page down.
fn svg(w: u32, h: u32, draw: impl FnOnce(&Area) -> DrawResult) -> String {
    let mut buf = String::new();
    let outcome = {
        let root = SVGBackend::with_string(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE)
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error>)
            .and_then(|_| draw(&root))
            .and_then(|_| root.present().map_err(|e| Box::new(e) as Box<dyn std::error::Error>))
    };
    match outcome {
        // SVG's defaults (opacity 1, no stroke, stroke width 1) need not be spelled out on
        // every element: dropping them takes about a third off a large heatmap.
        Ok(()) => buf
            .replace(" opacity=\"1\"", "")
            .replace(" stroke=\"none\" stroke-width=\"1\"", "")
            .replace(" stroke=\"none\"", ""),
        Err(e) => format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"60\"><text x=\"8\" y=\"30\">chart failed: {}</text></svg>",
            crate::html::escape(&e.to_string())
        ),
    }
}

use plotters::style::text_anchor::{HPos, Pos, VPos};

/// Writes a label at a pixel position of the whole SVG (outside any chart's plotting area).
fn put(
    root: &Area,
    text: &str,
    at: (i32, i32),
    size: f64,
    color: RGBColor,
    anchor: (HPos, VPos),
    bold: bool,
) -> DrawResult {
    let font = (FONT, size).into_font();
    let font = if bold { font.style(FontStyle::Bold) } else { font };
    root.draw(&Text::new(
        text.to_string(),
        at,
        font.color(&color).pos(Pos::new(anchor.0, anchor.1)),
    ))?;
    Ok(())
}

/// Decade-rounded log-axis bounds covering every finite positive value and the extras, with
/// a floor for zeros and a decade of headroom on top for non-finite markers.
fn log_bounds(values: impl Iterator<Item = f64>, extra: &[f64]) -> (f64, f64) {
    let mut lo = f64::INFINITY;
    let mut hi = 0f64;
    for v in values.chain(extra.iter().copied()) {
        if v.is_finite() && v > 0.0 {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    if !lo.is_finite() {
        return (1e-8, 10.0);
    }
    let lo = 10f64.powf((lo.log10() - 0.5).floor()).max(1e-14);
    let hi = 10f64.powf((hi.log10() + 0.3).ceil() + 0.6);
    (lo, hi.max(lo * 1e3))
}

/// Where a value sits on a log axis `[lo, hi]`: zero at the floor, non-finite at the top.
fn clamp_log(v: f64, lo: f64, hi: f64) -> f64 {
    if !v.is_finite() {
        hi / 2.0
    } else if v <= lo {
        lo
    } else {
        v.min(hi / 2.0)
    }
}

fn sci(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else {
        let e = v.log10().round() as i32;
        if (10f64.powi(e) - v).abs() <= v * 1e-6 {
            format!("1e{e}")
        } else {
            format!("{v:.0e}")
        }
    }
}

/// One line of [`layer_error_chart`]: a site's error at each x (layer index; -1 is the
/// embedding, n_layers the output norm and n_layers+1 the logits).
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub color: RGBColor,
    pub points: Vec<(i32, f64)>,
    /// Drawn thicker: the series that holds the first divergence.
    pub emphasis: bool,
    /// Joined by a line (false: markers only, for the embedding/output points).
    pub line: bool,
}

/// Input of [`layer_error_chart`].
#[derive(Clone, Debug)]
pub struct LayerChart<'a> {
    pub series: &'a [Series],
    pub n_layers: u32,
    /// Distinct thresholds to draw as dashed lines.
    pub thresholds: &'a [f64],
    /// x of the first divergence, and its label.
    pub first: Option<(i32, String)>,
    pub y_desc: &'a str,
    pub width: u32,
    pub height: u32,
}

/// Error per layer on a log axis: one line per site, dashed red threshold lines, a red band from
/// the first divergence on, non-finite values as purple crosses along the top.
pub fn layer_error_chart(c: &LayerChart) -> String {
    let all = c.series.iter().flat_map(|s| s.points.iter().map(|p| p.1));
    let thresholds: Vec<f64> = c.thresholds.iter().copied().filter(|t| *t > 0.0).collect();
    let (lo, hi) = log_bounds(all, &thresholds);
    let n = c.n_layers as i32;
    let x_label = move |x: &i32| match *x {
        -1 => "embed".to_string(),
        x if x == n => "out".to_string(),
        x if x == n + 1 => "logits".to_string(),
        x if x < -1 || x > n + 1 => String::new(),
        x => x.to_string(),
    };
    svg(c.width, c.height, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .margin_right(24)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(-2i32..n + 2, (lo..hi).log_scale())?;
        // Red band: everything from the first divergence on is suspect.
        if let Some((x, _)) = &c.first {
            chart.draw_series(std::iter::once(Rectangle::new(
                [(*x, lo), (n + 2, hi)],
                RGBColor(252, 228, 228).filled(),
            )))?;
        }
        chart
            .configure_mesh()
            .light_line_style(GRID.mix(0.6))
            .bold_line_style(GRID)
            .x_labels((n as usize + 5).min(32))
            .x_label_formatter(&x_label)
            .y_label_formatter(&|v| sci(*v))
            .x_desc("layer")
            .y_desc(c.y_desc)
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()?;
        for &t in &thresholds {
            chart.draw_series(DashedLineSeries::new(
                vec![(-2, t), (n + 2, t)],
                8,
                5,
                RED.stroke_width(2),
            ))?;
            let (px, py) = chart.backend_coord(&(n + 2, t));
            put(
                root,
                &format!("threshold {}", sci(t)),
                (px - 4, py - 3),
                12.0,
                RED,
                (HPos::Right, VPos::Bottom),
                false,
            )?;
        }
        for s in c.series {
            let width = if s.emphasis { 3 } else { 1 };
            let pts: Vec<(i32, f64)> = s.points.iter().map(|&(x, v)| (x, clamp_log(v, lo, hi))).collect();
            if s.line {
                chart.draw_series(LineSeries::new(pts.clone(), s.color.stroke_width(width)))?;
            }
            // Markers only where they help: few layers, or the unjoined embed/out points.
            if !s.line || pts.len() <= 24 {
                let r = if s.line { 2 } else { 4 };
                chart.draw_series(pts.iter().map(|&p| Circle::new(p, r, s.color.filled())))?;
            }
            chart.draw_series(
                s.points
                    .iter()
                    .filter(|p| !p.1.is_finite())
                    .map(|&(x, _)| Cross::new((x, hi / 2.0), 6, NONFINITE.stroke_width(3))),
            )?;
        }
        if let Some((x, label)) = &c.first {
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(*x, lo), (*x, hi)],
                RED.stroke_width(2),
            )))?;
            // At the top of the plot, on the side of the line with more room.
            let (px, py) = chart.backend_coord(&(*x, hi));
            let (dx, h) = if *x as f64 > n as f64 * 0.65 {
                (-6, HPos::Right)
            } else {
                (6, HPos::Left)
            };
            put(
                root,
                &format!("first divergence: {label}"),
                (px + dx, py + 24),
                14.0,
                RED,
                (h, VPos::Top),
                true,
            )?;
        }
        Ok(())
    })
}

/// Color of a cosine in [-1, 1]: white at 0, deep red at 1, deep blue at -1; NaN is gray.
fn cosine_color(v: f64) -> RGBColor {
    if !v.is_finite() {
        return RGBColor(160, 160, 160);
    }
    let v = v.clamp(-1.0, 1.0);
    let (target, t) = if v >= 0.0 {
        ((178.0, 24.0, 43.0), v)
    } else {
        ((33.0, 102.0, 172.0), -v)
    };
    let mix = |a: f64| (255.0 + (a - 255.0) * t).round() as u8;
    RGBColor(mix(target.0), mix(target.1), mix(target.2))
}

/// The per-head cosine heatmap: engine heads down, reference heads across, rank blocks outlined.
/// A healthy tap is a red diagonal; a permutation or an unsharded kv_b moves it off the diagonal,
/// an unwritten or zero head is a white row.
pub fn head_heatmap(n_heads: usize, cosine: &[f64], tp: usize) -> String {
    let n = n_heads.max(1);
    let cell = (560 / n).clamp(6, 56) as i32;
    let side = cell * n as i32;
    let (left, top) = (70i32, 40i32);
    let (w, h) = ((side + left + 150) as u32, (side + top + 60) as u32);
    let value = |e: usize, r: usize| cosine.get(e * n + r).copied().unwrap_or(f64::NAN);
    let step = n.div_ceil(16);
    svg(w, h, |root| {
        for e in 0..n {
            for r in 0..n {
                let (x, y) = (left + r as i32 * cell, top + e as i32 * cell);
                root.draw(&Rectangle::new(
                    [(x, y), (x + cell, y + cell)],
                    cosine_color(value(e, r)).filled(),
                ))?;
            }
        }
        if n <= 16 {
            for e in 0..n {
                for r in 0..n {
                    let v = value(e, r);
                    let color = if v.abs() > 0.55 { WHITE } else { BLACK };
                    let text = if v.is_finite() { format!("{v:.2}") } else { "NaN".into() };
                    let at = (left + r as i32 * cell + cell / 2, top + e as i32 * cell + cell / 2);
                    let size = (cell as f64 * 0.27).clamp(8.0, 13.0);
                    put(root, &text, at, size, color, (HPos::Center, VPos::Center), false)?;
                }
            }
        }
        // Head numbers at cell centers, engine down the left, reference along the top.
        for i in (0..n).step_by(step) {
            let c = i as i32 * cell + cell / 2;
            put(
                root,
                &i.to_string(),
                (left - 6, top + c),
                12.0,
                BLACK,
                (HPos::Right, VPos::Center),
                false,
            )?;
            put(
                root,
                &i.to_string(),
                (left + c, top - 6),
                12.0,
                BLACK,
                (HPos::Center, VPos::Bottom),
                false,
            )?;
        }
        put(
            root,
            "reference head →",
            (left + side / 2, 12),
            13.0,
            BLACK,
            (HPos::Center, VPos::Top),
            true,
        )?;
        put(
            root,
            "engine head ↓",
            (left + side / 2, top + side + 12),
            13.0,
            BLACK,
            (HPos::Center, VPos::Top),
            true,
        )?;
        root.draw(&Rectangle::new(
            [(left, top), (left + side, top + side)],
            BLACK.stroke_width(2),
        ))?;
        // Rank blocks: heads per rank along both axes.
        if tp > 1 && n % tp == 0 {
            let per = (n / tp) as i32;
            for b in 1..tp as i32 {
                let at = b * per * cell;
                root.draw(&PathElement::new(
                    vec![(left + at, top), (left + at, top + side)],
                    BLACK.stroke_width(2),
                ))?;
                root.draw(&PathElement::new(
                    vec![(left, top + at), (left + side, top + at)],
                    BLACK.stroke_width(2),
                ))?;
            }
            for b in 0..tp as i32 {
                let mid = top + b * per * cell + per * cell / 2;
                put(
                    root,
                    &format!("rank {b}"),
                    (left + side + 10, mid),
                    13.0,
                    BLACK,
                    (HPos::Left, VPos::Center),
                    true,
                )?;
            }
        }
        // Color key.
        let kx = left + side + 80;
        for i in 0..=20 {
            let v = 1.0 - i as f64 / 10.0;
            let y = top + i * 8;
            root.draw(&Rectangle::new([(kx, y), (kx + 14, y + 8)], cosine_color(v).filled()))?;
        }
        put(root, "+1", (kx + 18, top), 11.0, BLACK, (HPos::Left, VPos::Top), false)?;
        put(
            root,
            "0",
            (kx + 18, top + 84),
            11.0,
            BLACK,
            (HPos::Left, VPos::Center),
            false,
        )?;
        put(
            root,
            "−1",
            (kx + 18, top + 168),
            11.0,
            BLACK,
            (HPos::Left, VPos::Bottom),
            false,
        )?;
        Ok(())
    })
}

/// One bar of [`rank_bars`].
#[derive(Clone, Debug)]
pub struct Bar {
    pub rank: u32,
    pub value: f64,
    pub over: bool,
    /// The first divergence itself: outlined.
    pub first: bool,
}

/// Grouped per-rank bars on a log axis: one group per site, one bar per rank; red when over its
/// threshold, purple and full height when non-finite, the first divergence outlined in black.
pub fn rank_bars(groups: &[(String, Vec<Bar>)], thresholds: &[f64], width: u32) -> String {
    let thresholds: Vec<f64> = thresholds.iter().copied().filter(|t| *t > 0.0).collect();
    let all = groups.iter().flat_map(|g| g.1.iter().map(|b| b.value));
    let (lo, hi) = log_bounds(all, &thresholds);
    let n_bars: usize = groups.iter().map(|g| g.1.len() + 1).sum::<usize>().max(1);
    svg(width, 340, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .margin_right(100)
            .x_label_area_size(52)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n_bars as f64, (lo..hi).log_scale())?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .light_line_style(GRID.mix(0.6))
            .bold_line_style(GRID)
            .y_label_formatter(&|v| sci(*v))
            .y_desc("rel_l2 (log)")
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()?;
        let bar_px = (chart.backend_coord(&(1.0, lo)).0 - chart.backend_coord(&(0.0, lo)).0).max(1);
        let mut x = 0.5;
        for (site, bars) in groups {
            let start = x;
            let mut group_nonfinite = None;
            for b in bars {
                let top = clamp_log(b.value, lo, hi);
                let color = if !b.value.is_finite() {
                    NONFINITE
                } else if b.over {
                    RED
                } else {
                    GREEN_OK
                };
                let rect = [(x + 0.08, lo), (x + 0.92, top)];
                chart.draw_series(std::iter::once(Rectangle::new(rect, color.filled())))?;
                if b.first {
                    chart.draw_series(std::iter::once(Rectangle::new(rect, BLACK.stroke_width(3))))?;
                }
                let (px, py) = chart.backend_coord(&(x + 0.5, lo));
                if bar_px >= 18 {
                    put(
                        root,
                        &format!("r{}", b.rank),
                        (px, py + 3),
                        10.0,
                        BLACK,
                        (HPos::Center, VPos::Top),
                        false,
                    )?;
                }
                if !b.value.is_finite() && bar_px < 24 {
                    group_nonfinite = Some(if b.value.is_nan() { "NaN" } else { "inf" });
                } else if !b.value.is_finite() {
                    let (px, py) = chart.backend_coord(&(x + 0.5, top));
                    let what = if b.value.is_nan() { "NaN" } else { "inf" };
                    put(
                        root,
                        what,
                        (px, py - 2),
                        11.0,
                        NONFINITE,
                        (HPos::Center, VPos::Bottom),
                        true,
                    )?;
                }
                x += 1.0;
            }
            let (px, py) = chart.backend_coord(&((start + x) / 2.0, lo));
            let below = if bar_px >= 18 { 18 } else { 6 };
            put(
                root,
                site,
                (px, py + below),
                12.0,
                BLACK,
                (HPos::Center, VPos::Top),
                true,
            )?;
            if let Some(what) = group_nonfinite {
                let (px, py) = chart.backend_coord(&((start + x) / 2.0, hi / 2.0));
                put(
                    root,
                    what,
                    (px, py - 2),
                    11.0,
                    NONFINITE,
                    (HPos::Center, VPos::Bottom),
                    true,
                )?;
            }
            x += 1.0;
        }
        for &t in &thresholds {
            chart.draw_series(DashedLineSeries::new(
                vec![(0.0, t), (n_bars as f64, t)],
                8,
                5,
                RED.stroke_width(2),
            ))?;
            let (px, py) = chart.backend_coord(&(n_bars as f64, t));
            put(
                root,
                &format!("threshold {}", sci(t)),
                (px + 4, py),
                12.0,
                RED,
                (HPos::Left, VPos::Center),
                false,
            )?;
        }
        Ok(())
    })
}

/// Canary coverage: one row per custom-op tap (site or site@rank), one column per layer; green
/// where the op wrote its whole output, shading to red by the share of canary left, gray where
/// no tap was compared.
pub fn canary_grid(rows: &[(String, Vec<Option<f64>>)], layers: &[u32], width: u32) -> String {
    let n_cols = layers.len().max(1) as i32;
    let n_rows = rows.len().max(1) as i32;
    let (left, top, row_h) = (120i32, 10i32, 22i32);
    let cell_w = ((width as i32 - left - 20) / n_cols).clamp(4, 120);
    let h = (top + row_h * n_rows + 50) as u32;
    let step = (n_cols as usize).div_ceil(40);
    svg(width, h, |root| {
        for (ri, (label, cells)) in rows.iter().enumerate() {
            let y = top + ri as i32 * row_h;
            put(
                root,
                label,
                (left - 8, y + row_h / 2),
                12.0,
                BLACK,
                (HPos::Right, VPos::Center),
                false,
            )?;
            for (ci, c) in cells.iter().enumerate() {
                let color = match c {
                    None => RGBColor(235, 235, 235),
                    Some(v) if !v.is_finite() => RGBColor(160, 160, 160),
                    Some(v) if *v <= 0.0 => RGBColor(166, 219, 160),
                    Some(v) => {
                        let t = v.clamp(0.0, 1.0);
                        RGBColor(
                            (250.0 - 30.0 * t) as u8,
                            (160.0 - 140.0 * t) as u8,
                            (140.0 - 120.0 * t) as u8,
                        )
                    }
                };
                let x = left + ci as i32 * cell_w;
                root.draw(&Rectangle::new(
                    [(x + 1, y + 1), (x + cell_w - 1, y + row_h - 1)],
                    color.filled(),
                ))?;
                if let Some(v) = c.filter(|v| *v > 0.0 && cell_w >= 34) {
                    let at = (x + cell_w / 2, y + row_h / 2);
                    put(
                        root,
                        &format!("{:.0}%", v * 100.0),
                        at,
                        11.0,
                        WHITE,
                        (HPos::Center, VPos::Center),
                        true,
                    )?;
                }
            }
        }
        let base = top + n_rows * row_h + 4;
        for (ci, l) in layers.iter().enumerate().step_by(step) {
            let x = left + ci as i32 * cell_w + cell_w / 2;
            put(
                root,
                &l.to_string(),
                (x, base),
                11.0,
                BLACK,
                (HPos::Center, VPos::Top),
                false,
            )?;
        }
        put(
            root,
            "layer",
            (left + n_cols * cell_w / 2, base + 18),
            13.0,
            BLACK,
            (HPos::Center, VPos::Top),
            false,
        )?;
        Ok(())
    })
}

/// MoE routing agreement: share of tokens with identical expert sets, one bar per MoE layer;
/// green at 100 %, red below.
pub fn routing_bars(layers: &[(u32, f64)], width: u32) -> String {
    let n = layers.len().max(1);
    let step = n.div_ceil(40);
    svg(width, 270, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(0f64..n as f64, 0f64..1.08f64)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .light_line_style(GRID.mix(0.6))
            .bold_line_style(GRID)
            .y_label_formatter(&|v| format!("{:.0}%", v * 100.0))
            .y_desc("same experts")
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()?;
        let bar_w = if n <= 4 { 0.25 } else { 0.38 };
        for (i, &(layer, f)) in layers.iter().enumerate() {
            let f = if f.is_finite() { f.clamp(0.0, 1.0) } else { 0.0 };
            let color = if f >= 1.0 { GREEN_OK } else { RED };
            let c = i as f64 + 0.5;
            chart.draw_series(std::iter::once(Rectangle::new(
                [(c - bar_w, 0.0), (c + bar_w, f)],
                color.filled(),
            )))?;
            let (px, py) = chart.backend_coord(&(c, 0.0));
            if i % step == 0 {
                put(
                    root,
                    &layer.to_string(),
                    (px, py + 4),
                    11.0,
                    BLACK,
                    (HPos::Center, VPos::Top),
                    false,
                )?;
            }
            if f < 1.0 && n <= 40 {
                let (px, py) = chart.backend_coord(&(c, f));
                put(
                    root,
                    &format!("{:.0}%", f * 100.0),
                    (px, py - 3),
                    12.0,
                    RED,
                    (HPos::Center, VPos::Bottom),
                    true,
                )?;
            }
        }
        let (px, py) = chart.backend_coord(&(n as f64 / 2.0, 0.0));
        put(
            root,
            "MoE layer",
            (px, py + 20),
            13.0,
            BLACK,
            (HPos::Center, VPos::Top),
            false,
        )?;
        Ok(())
    })
}

/// Entropy (nats) per position, engine against reference: two lines, the engine's orange.
/// For the `entropy --against-reference` report.
pub fn render_entropy_chart(engine: &[f64], reference: &[f64]) -> String {
    let n = engine.len().max(reference.len()).max(2);
    let top = engine
        .iter()
        .chain(reference)
        .copied()
        .filter(|v| v.is_finite())
        .fold(0f64, f64::max)
        .max(1e-3)
        * 1.1;
    svg(900, 300, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(0f64..(n - 1) as f64, 0f64..top)?;
        chart
            .configure_mesh()
            .light_line_style(GRID.mix(0.6))
            .bold_line_style(GRID)
            .x_desc("position")
            .y_desc("entropy (nats)")
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()?;
        let line = |v: &[f64]| -> Vec<(f64, f64)> {
            v.iter()
                .enumerate()
                .filter(|p| p.1.is_finite())
                .map(|(i, &y)| (i as f64, y))
                .collect()
        };
        chart
            .draw_series(LineSeries::new(line(reference), PALETTE[0].stroke_width(2)))?
            .label("reference")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], PALETTE[0].stroke_width(2)));
        chart
            .draw_series(LineSeries::new(line(engine), PALETTE[1].stroke_width(2)))?
            .label("engine")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], PALETTE[1].stroke_width(2)));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(GRID)
            .label_font((FONT, 13))
            .draw()?;
        Ok(())
    })
}

/// Percentile `p` (0..=100) of sorted finite values, nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Histogram of per-token KL divergences (nats) on a log10 x axis, with the median, p90, p99 and
/// p99.9 marked. Zeros (and values under 1e-12) land in the first bin.
pub fn render_kld_histogram(kld: &[f64]) -> String {
    let mut v: Vec<f64> = kld
        .iter()
        .copied()
        .filter(|x| x.is_finite())
        .map(|x| x.max(1e-12))
        .collect();
    v.sort_by(f64::total_cmp);
    let (lo, hi) = match (v.first(), v.last()) {
        (Some(a), Some(b)) => ((a.log10() - 0.1).floor(), (b.log10() + 0.1).ceil()),
        _ => (-6.0, 0.0),
    };
    let hi = if hi <= lo { lo + 1.0 } else { hi };
    let n_bins = 40usize;
    let bin_w = (hi - lo) / n_bins as f64;
    let mut counts = vec![0u32; n_bins];
    for x in &v {
        let b = (((x.log10() - lo) / bin_w) as usize).min(n_bins - 1);
        counts[b] += 1;
    }
    let top = counts.iter().copied().max().unwrap_or(1).max(1) as f64 * 1.2;
    let marks = [("median", 50.0), ("p90", 90.0), ("p99", 99.0), ("p99.9", 99.9)];
    svg(900, 300, |root| {
        let mut chart = ChartBuilder::on(root)
            .margin(12)
            .margin_right(24)
            .x_label_area_size(36)
            .y_label_area_size(56)
            .build_cartesian_2d(lo..hi, 0f64..top)?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .light_line_style(GRID.mix(0.6))
            .bold_line_style(GRID)
            .x_label_formatter(&|x| format!("1e{}", x.round() as i32))
            .x_desc("KL divergence per token (nats, log scale)")
            .y_desc("tokens")
            .label_style((FONT, 13))
            .axis_desc_style((FONT, 14))
            .draw()?;
        chart.draw_series(counts.iter().enumerate().filter(|c| *c.1 > 0).map(|(i, &c)| {
            let x0 = lo + i as f64 * bin_w;
            Rectangle::new(
                [(x0 + bin_w * 0.05, 0.0), (x0 + bin_w * 0.95, c as f64)],
                PALETTE[0].filled(),
            )
        }))?;
        if !v.is_empty() {
            for (i, (name, p)) in marks.iter().enumerate() {
                let q = percentile(&v, *p);
                let x = q.log10().clamp(lo, hi);
                let color = [PALETTE[2], PALETTE[1], RED, NONFINITE][i];
                chart.draw_series(DashedLineSeries::new(
                    vec![(x, 0.0), (x, top)],
                    6,
                    4,
                    color.stroke_width(2),
                ))?;
                chart.draw_series(std::iter::once(Text::new(
                    format!("{name} {q:.2e}"),
                    (x, top * (0.97 - 0.08 * i as f64)),
                    (FONT, 12).into_font().color(&color),
                )))?;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_bounds_cover_values_with_headroom() {
        let (lo, hi) = log_bounds([1e-7, 0.0, 3e-2, f64::NAN].into_iter(), &[5e-5]);
        assert!((1e-9..=1e-7).contains(&lo), "{lo}");
        assert!(hi >= 3e-2 * 10.0, "{hi}");
    }

    #[test]
    fn percentiles_nearest_rank() {
        let v: Vec<f64> = (0..=100).map(|i| i as f64).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
    }

    #[test]
    fn cosine_colors_span_blue_white_red() {
        assert_eq!(cosine_color(0.0), RGBColor(255, 255, 255));
        assert_eq!(cosine_color(1.0), RGBColor(178, 24, 43));
        assert_eq!(cosine_color(-1.0), RGBColor(33, 102, 172));
    }
}
