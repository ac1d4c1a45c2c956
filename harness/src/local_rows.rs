//! Row sampling for the local rule: below f32 (or with a `--baseline`) every tap's op is re-run
//! on the candidate's inputs, which costs about one more reference pass, almost all of it in the
//! matmuls, whose cost grows with the token rows. A tap's local error is first estimated on a
//! few rows, and the whole tap is replayed only where that estimate is not clearly under its
//! bound.
//!
//! The rows: the [`TOP`] rows whose *end-to-end* error is largest (worst column block: a head
//! at an attention tap, else the row), each counted once, and [`STRIDED`] rows spread evenly
//! over the rest, each standing for `rest / STRIDED` rows. The estimate of the tap's squared
//! error (and of its squared norm) is that weighted sum: exact for the top rows, a stratified
//! sample for the rest.
//!
//! Why a fault confined to a few rows is not lost: the exact rule flags such a fault only when
//! its rows' error, spread over every row of the tap, is above the bound, so each faulty row
//! carries an error about √(rows / faulty rows) × the bound — far above the healthy drift of
//! the rows around it, which is of the order of the bound. Its end-to-end error (the candidate
//! against the reference's own value, which carries the fault plus the drift) is then among the
//! largest, so it is one of the top rows and counted exactly. A fault spread over every row
//! (a head scaled, a wrong weight) shows in the strided rows as it does in all of them.
//!
//! The estimate is accepted only when it is under [`ESCALATE`] × the bound, in total and for
//! every head; anything else is replayed on every row and decided exactly, so a tap that is
//! over is always decided (and reported at a divergence) on the full replay. At f32 without a
//! baseline the rule replays only the few taps above the f32 floor, on every row, as before.

use crate::compare::metrics;

/// Rows taken by end-to-end error.
pub const TOP: usize = 8;
/// Rows spread evenly over the others.
pub const STRIDED: usize = 16;
/// Below this many rows every row is replayed (the sample would save little).
pub const MIN_ROWS: usize = 2 * (TOP + STRIDED);
/// A sampled estimate under this share of its bound is accepted; above, the whole tap is replayed.
pub const ESCALATE: f64 = 0.5;

/// The rows to replay and the weight of each.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSample {
    /// Ascending row indices.
    pub rows: Vec<usize>,
    /// Per entry of `rows`: how many rows it stands for.
    pub weights: Vec<f64>,
}

/// The sample for a tap of `n` rows from its end-to-end view (`eng` and `reference`, both
/// `[n, width]`), judging rows by their worst block of `block` columns; `None` where every row
/// should be replayed (few rows, or shapes that do not match).
pub fn choose(eng: &[f32], reference: &[f32], n: usize, block: usize) -> Option<RowSample> {
    if n < MIN_ROWS || eng.len() != reference.len() || eng.is_empty() || eng.len() % n != 0 {
        return None;
    }
    let width = eng.len() / n;
    let block = if block == 0 || width % block != 0 { width } else { block };
    let score = |t: usize| -> f64 {
        let (e, r) = (&eng[t * width..(t + 1) * width], &reference[t * width..(t + 1) * width]);
        e.chunks(block)
            .zip(r.chunks(block))
            .map(|(a, b)| {
                let (mut d2, mut r2) = (0f64, 0f64);
                for (&x, &y) in a.iter().zip(b) {
                    d2 += (x as f64 - y as f64).powi(2);
                    r2 += (y as f64).powi(2);
                }
                // A non-finite row always counts as worst.
                if d2.is_finite() {
                    d2 / r2.max(f64::MIN_POSITIVE)
                } else {
                    f64::INFINITY
                }
            })
            .fold(0.0, f64::max)
    };
    let mut by_error: Vec<(f64, usize)> = (0..n).map(|t| (score(t), t)).collect();
    by_error.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut top: Vec<usize> = by_error[..TOP].iter().map(|&(_, t)| t).collect();
    top.sort_unstable();
    let rest: Vec<usize> = (0..n).filter(|t| top.binary_search(t).is_err()).collect();
    let stride_weight = rest.len() as f64 / STRIDED as f64;
    let mut picked: Vec<(usize, f64)> = top.iter().map(|&t| (t, 1.0)).collect();
    picked.extend((0..STRIDED).map(|j| (rest[(2 * j + 1) * rest.len() / (2 * STRIDED)], stride_weight)));
    picked.sort_by_key(|p| p.0);
    Some(RowSample {
        rows: picked.iter().map(|p| p.0).collect(),
        weights: picked.iter().map(|p| p.1).collect(),
    })
}

/// The weighted rel_l2 of `eng` against `want` (both `[rows, width]`, one weight per row) over
/// the columns `cols`: √(Σ w‖e − r‖² / Σ w‖r‖²). NaN when any value is not finite.
pub fn weighted_rel_l2(eng: &[f32], want: &[f32], width: usize, cols: std::ops::Range<usize>, weights: &[f64]) -> f64 {
    let (mut d2, mut r2) = (0f64, 0f64);
    for ((e, r), &w) in eng.chunks(width).zip(want.chunks(width)).zip(weights) {
        for (&x, &y) in e[cols.clone()].iter().zip(&r[cols.clone()]) {
            d2 += w * (x as f64 - y as f64).powi(2);
            r2 += w * (y as f64).powi(2);
        }
    }
    if !d2.is_finite() {
        return f64::NAN;
    }
    if r2 == 0.0 {
        // As compare::metrics does for an all-zero reference.
        return metrics(&[d2.sqrt() as f32], &[0.0]).rel_l2;
    }
    (d2 / r2).sqrt()
}

/// The weighted least-squares scale s of `eng ≈ s · want` over the columns `cols` (NaN when
/// `want` is zero there).
pub fn weighted_scale(eng: &[f32], want: &[f32], width: usize, cols: std::ops::Range<usize>, weights: &[f64]) -> f64 {
    let (mut er, mut rr) = (0f64, 0f64);
    for ((e, r), &w) in eng.chunks(width).zip(want.chunks(width)).zip(weights) {
        for (&x, &y) in e[cols.clone()].iter().zip(&r[cols.clone()]) {
            er += w * x as f64 * y as f64;
            rr += w * y as f64 * y as f64;
        }
    }
    if rr > 0.0 {
        er / rr
    } else {
        f64::NAN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` rows of width 8 with a small spread error on every row and a large one on `bad`.
    fn pair(n: usize, bad: &[usize], small: f32, big: f32) -> (Vec<f32>, Vec<f32>) {
        let reference: Vec<f32> = (0..n * 8).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.3 + 0.1).collect();
        let eng = reference
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let t = i / 8;
                let e = if bad.contains(&t) { big } else { small };
                r * (1.0 + if i % 2 == 0 { e } else { -e })
            })
            .collect();
        (eng, reference)
    }

    #[test]
    fn few_rows_are_all_replayed() {
        let (e, r) = pair(MIN_ROWS - 1, &[], 1e-3, 0.0);
        assert_eq!(choose(&e, &r, MIN_ROWS - 1, 8), None);
    }

    #[test]
    fn the_worst_rows_are_taken_and_the_rest_strided_with_weights_summing_to_n() {
        let n = 140;
        let (e, r) = pair(n, &[3, 77, 139], 1e-3, 0.2);
        let s = choose(&e, &r, n, 4).unwrap();
        assert_eq!(s.rows.len(), TOP + STRIDED);
        assert!(s.rows.windows(2).all(|w| w[0] < w[1]));
        for bad in [3, 77, 139] {
            let i = s.rows.iter().position(|&t| t == bad).expect("a faulty row is sampled");
            assert_eq!(s.weights[i], 1.0);
        }
        let total: f64 = s.weights.iter().sum();
        assert!((total - n as f64).abs() < 1e-9, "{total}");
    }

    #[test]
    fn a_fault_in_one_row_weighs_as_in_the_exact_error() {
        let n = 100;
        let (e, r) = pair(n, &[41], 1e-3, 5e-2);
        let s = choose(&e, &r, n, 8).unwrap();
        let sub = |x: &[f32]| -> Vec<f32> { s.rows.iter().flat_map(|&t| x[t * 8..(t + 1) * 8].to_vec()).collect() };
        let est = weighted_rel_l2(&sub(&e), &sub(&r), 8, 0..8, &s.weights);
        let exact = metrics(&e, &r).rel_l2;
        assert!((est / exact - 1.0).abs() < 0.1, "estimate {est} against exact {exact}");
        // Without the end-to-end choice a strided sample alone would miss row 41.
        assert!(exact > 3.0 * 1e-3);
    }
}
