//! Comparing a top-k selection (the DSA indexer's keys per query, or MoE expert ids) against the
//! reference's scores, when the candidate scored in lower precision: production indexers score in
//! fp8 (q quantized in groups of 128, k from an fp8 cache), so near the cut-off, near-ties may
//! legitimately flip.
//!
//! The rule, per query row with reference scores `s` (its causal keys) and cut-off `c` (midway
//! between the reference's k-th and (k+1)-th best score):
//! - a key whose score is above `c` by more than `sigmas × noise` must be selected;
//! - a key below `c` by more than `sigmas × noise` must not be;
//! - the keys inside that band are judged by overlap: the fraction of the reference's top-k the
//!   candidate also chose, over all rows, must reach `min_overlap`.
//!
//! `noise` is the candidate's score noise for the row, `abs + rel × max|s|`. A row with at most
//! top_k keys selects them all (no freedom). Malformed rows (wrong count, duplicates, keys after
//! the query) diverge. The attention after the selection is judged separately, by local error
//! on the candidate's own indices (the reference replays it on them).
//!
//! Pure functions only. `diff-layers` (diff.rs) judges every `indexer_topk` tap with
//! [`compare_taps`] against the indexer's scores re-run on the candidate's own `attn_norm` and
//! `q_a` (the reference's end-to-end scores where the dump lacks them; a `shared` layer reads its
//! `full` layer's), with fp8 noise: production indexers score in fp8 whatever the activations'
//! dtype. A `moe_topk` tap whose op cannot be re-run on the candidate's router logits is judged
//! by [`compare_rows`] on the reference's routing scores, with the candidate's noise (its
//! `moe_logits` error where dumped, else a few unit roundoffs of its dtype).

/// The candidate's score noise per row: `abs + rel × max|score|` of the row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Noise {
    pub abs: f64,
    pub rel: f64,
}

impl Noise {
    /// fp8 (e4m3) scoring as vLLM does it: q and k each rounded to 3 mantissa bits (relative
    /// 2⁻⁴ each), so a score carries about 2·2⁻⁴ of the row's scale.
    pub const FP8: Noise = Noise { abs: 0.0, rel: 0.125 };
    /// f32/bf16 scoring: bf16 inputs (2⁻⁸ each).
    pub const BF16: Noise = Noise {
        abs: 0.0,
        rel: 1.0 / 128.0,
    };

    fn of_row(&self, scores: &[f64]) -> f64 {
        self.abs + self.rel * scores.iter().fold(0f64, |m, &s| m.max(s.abs()))
    }
}

/// How strict the rule is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    pub noise: Noise,
    /// A key is "clearly" in or out when its margin over the cut-off exceeds this many noises.
    pub sigmas: f64,
    /// The least acceptable overall overlap with the reference's selection.
    pub min_overlap: f64,
}

impl Default for Rule {
    fn default() -> Self {
        Rule {
            noise: Noise::FP8,
            sigmas: 2.0,
            min_overlap: 0.75,
        }
    }
}

/// One broken constraint.
#[derive(Clone, Debug, PartialEq)]
pub enum Violation {
    /// A key clearly above the cut-off was not selected.
    Missed {
        row: usize,
        key: usize,
        margin_in_noise: f64,
    },
    /// A key clearly below the cut-off was selected.
    Intruded {
        row: usize,
        key: usize,
        margin_in_noise: f64,
    },
    /// The row is not a valid selection.
    Malformed { row: usize, why: String },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::Missed {
                row,
                key,
                margin_in_noise,
            } => write!(
                f,
                "query {row}: key {key} scores {margin_in_noise:.1} noises above the cut-off but was not selected"
            ),
            Violation::Intruded {
                row,
                key,
                margin_in_noise,
            } => write!(
                f,
                "query {row}: key {key} scores {margin_in_noise:.1} noises below the cut-off but was selected"
            ),
            Violation::Malformed { row, why } => write!(f, "query {row}: {why}"),
        }
    }
}

/// The verdict over every row.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectionReport {
    /// Rows with more keys than top_k (where the selection had a choice).
    pub rows_with_choice: usize,
    /// Selected keys shared with the reference's top-k / all reference selections (1.0 when no
    /// row had a choice).
    pub overlap: f64,
    /// Keys in the near-tie band (reference margin within `sigmas` noises), over all rows.
    pub near_ties: usize,
    pub violations: Vec<Violation>,
    /// True when no constraint is broken and the overlap reaches the rule's minimum.
    pub agrees: bool,
}

impl SelectionReport {
    /// The report's form in the run document.
    pub fn verdict(&self, rule: &Rule, scores: &str) -> reports::SelectionVerdict {
        reports::SelectionVerdict {
            scores: scores.to_string(),
            noise_rel: rule.noise.rel,
            sigmas: rule.sigmas,
            rows_with_choice: self.rows_with_choice,
            overlap: self.overlap,
            min_overlap: rule.min_overlap,
            near_ties: self.near_ties,
            violations: self.violations.len(),
            first_violation: self.violations.first().map(|v| v.to_string()),
            agrees: self.agrees,
        }
    }
}

/// The reference's top-k of one row (descending score, earlier key on ties), ascending.
pub fn reference_top_k(scores: &[f64], top_k: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(top_k);
    order.sort_unstable();
    order
}

/// Judges one row: `scores` are the reference's for the row's candidates (keys 0..len),
/// `chosen` the candidate's selection. Returns (violations, shared with the reference's top-k,
/// reference top-k size, near-tie keys).
fn judge_row(
    row: usize,
    scores: &[f64],
    chosen: &[usize],
    top_k: usize,
    rule: &Rule,
) -> (Vec<Violation>, usize, usize, usize) {
    let want = top_k.min(scores.len());
    let mut v = Vec::new();
    let mut sorted = chosen.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    if sorted.len() != chosen.len() {
        v.push(Violation::Malformed {
            row,
            why: "a key is selected twice".into(),
        });
    }
    if let Some(&bad) = sorted.iter().find(|&&k| k >= scores.len()) {
        v.push(Violation::Malformed {
            row,
            why: format!("key {bad} is not among its {} causal keys", scores.len()),
        });
    }
    if chosen.len() != want {
        v.push(Violation::Malformed {
            row,
            why: format!("{} keys selected, expected {want}", chosen.len()),
        });
    }
    let reference = reference_top_k(scores, top_k);
    let shared = sorted.iter().filter(|k| reference.binary_search(k).is_ok()).count();
    if !v.is_empty() || scores.len() <= top_k {
        return (v, shared, reference.len(), 0);
    }
    let mut desc = scores.to_vec();
    desc.sort_by(|a, b| b.total_cmp(a));
    let cut = 0.5 * (desc[top_k - 1] + desc[top_k]);
    let noise = rule.noise.of_row(scores).max(f64::MIN_POSITIVE);
    let mut near = 0;
    for (key, &s) in scores.iter().enumerate() {
        let margin = (s - cut) / noise;
        let selected = sorted.binary_search(&key).is_ok();
        if margin > rule.sigmas && !selected {
            v.push(Violation::Missed {
                row,
                key,
                margin_in_noise: margin,
            });
        } else if margin < -rule.sigmas && selected {
            v.push(Violation::Intruded {
                row,
                key,
                margin_in_noise: -margin,
            });
        } else if margin.abs() <= rule.sigmas {
            near += 1;
        }
    }
    (v, shared, reference.len(), near)
}

/// Compares per-row selections: `scores[t]` are the reference's scores of row t's candidates,
/// `chosen[t]` the candidate's picks (any order).
pub fn compare_rows(scores: &[Vec<f64>], chosen: &[Vec<usize>], top_k: usize, rule: &Rule) -> SelectionReport {
    let (mut violations, mut shared, mut total, mut near, mut with_choice) = (Vec::new(), 0, 0, 0, 0);
    for (t, (s, c)) in scores.iter().zip(chosen).enumerate() {
        let (v, sh, tot, nt) = judge_row(t, s, c, top_k, rule);
        violations.extend(v);
        shared += sh;
        total += tot;
        near += nt;
        with_choice += usize::from(s.len() > top_k);
    }
    if chosen.len() != scores.len() {
        violations.push(Violation::Malformed {
            row: chosen.len().min(scores.len()),
            why: format!("{} rows selected, {} queries", chosen.len(), scores.len()),
        });
    }
    let overlap = if total == 0 { 1.0 } else { shared as f64 / total as f64 };
    SelectionReport {
        rows_with_choice: with_choice,
        overlap,
        near_ties: near,
        agrees: violations.is_empty() && overlap >= rule.min_overlap,
        violations,
    }
}

/// Compares the taps themselves: the reference's `indexer_score` (`[n, n]`, row t's keys 0..=t)
/// and the candidate's `indexer_topk` (`[n, top_k]` f32 key positions, −1 padding).
pub fn compare_taps(ref_scores: &[f32], cand_topk: &[f32], n: usize, top_k: usize, rule: &Rule) -> SelectionReport {
    let scores: Vec<Vec<f64>> = (0..n)
        .map(|t| ref_scores[t * n..t * n + t + 1].iter().map(|&v| v as f64).collect())
        .collect();
    let chosen: Vec<Vec<usize>> = cand_topk
        .chunks(top_k.max(1))
        .take(n)
        .map(|row| {
            row.iter()
                .filter(|&&v| v >= 0.0)
                // A non-integer or huge entry becomes an out-of-range key (Malformed).
                .map(|&v| {
                    if v.fract() == 0.0 && v < n as f32 {
                        v as usize
                    } else {
                        usize::MAX
                    }
                })
                .collect()
        })
        .collect();
    compare_rows(&scores, &chosen, top_k, rule)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small deterministic generator (tests must not depend on a crate's RNG stream).
    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f64 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 11) as f64) / ((1u64 << 53) as f64)
        }
        fn normal(&mut self) -> f64 {
            let (u, v) = (self.next().max(1e-12), self.next());
            (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        }
    }

    /// Reference index scores of a causal `[n][t+1]` layout, relu-sum-like (mostly positive).
    fn scores(n: usize, rng: &mut Lcg) -> Vec<Vec<f64>> {
        (0..n)
            .map(|t| {
                (0..=t)
                    .map(|_| (rng.normal() + 0.5).max(0.0) * 3.0 + 0.1 * rng.normal())
                    .collect()
            })
            .collect()
    }

    /// Rounds to 3 mantissa bits (e4m3's precision; its range is not reached here).
    fn fp8(x: f64) -> f64 {
        if x == 0.0 {
            return 0.0;
        }
        let e = x.abs().log2().floor();
        let q = 2f64.powf(e - 3.0);
        (x / q).round() * q
    }

    const N: usize = 48;
    const K: usize = 4;

    #[test]
    fn a_healthy_fp8_scored_candidate_agrees() {
        let mut rng = Lcg(7);
        let s = scores(N, &mut rng);
        // The candidate scores in fp8: every score rounded (≈ 6 % relative), then top-k.
        let cand: Vec<Vec<usize>> = s
            .iter()
            .map(|row| reference_top_k(&row.iter().map(|&v| fp8(v)).collect::<Vec<_>>(), K))
            .collect();
        let exact: Vec<Vec<usize>> = s.iter().map(|row| reference_top_k(row, K)).collect();
        assert_ne!(
            cand, exact,
            "the fp8 noise should flip some near-ties, or the test shows nothing"
        );
        let rep = compare_rows(&s, &cand, K, &Rule::default());
        assert!(rep.agrees, "{:?}", rep.violations);
        assert!(rep.overlap < 1.0 && rep.overlap >= 0.75, "overlap {}", rep.overlap);
        assert_eq!(rep.rows_with_choice, N - K);
    }

    #[test]
    fn a_candidate_picking_wrong_keys_by_a_clear_margin_diverges() {
        let mut rng = Lcg(11);
        let s = scores(N, &mut rng);
        // An indexer that reads the key one position early (an off-by-one in its cache).
        let shifted: Vec<Vec<usize>> = s
            .iter()
            .enumerate()
            .map(|(t, row)| {
                if t < K {
                    (0..=t).collect()
                } else {
                    let mut sh: Vec<f64> = row.clone();
                    sh.rotate_left(1);
                    reference_top_k(&sh, K)
                }
            })
            .collect();
        let rep = compare_rows(&s, &shifted, K, &Rule::default());
        assert!(!rep.agrees);
        assert!(rep.violations.iter().any(|v| matches!(v, Violation::Missed { .. })));
        // The worst keys instead of the best.
        let worst: Vec<Vec<usize>> = s
            .iter()
            .map(|row| reference_top_k(&row.iter().map(|v| -v).collect::<Vec<_>>(), K))
            .collect();
        let rep = compare_rows(&s, &worst, K, &Rule::default());
        assert!(!rep.agrees && rep.overlap < 0.2);
        assert!(rep.violations.iter().any(|v| matches!(v, Violation::Intruded { .. })));
    }

    #[test]
    fn one_clear_miss_diverges_even_with_high_overlap() {
        let s = vec![vec![10.0, 9.0, 1.0, 0.9, 0.8], vec![5.0, 0.0, 0.0, 0.0, 4.0]];
        // Row 0 right; row 1 drops key 4 (4.0, far above the cut-off 2.0) for key 1 (0.0).
        let rep = compare_rows(&s, &[vec![0, 1], vec![0, 1]], 2, &Rule::default());
        assert!(!rep.agrees);
        assert_eq!(rep.overlap, 0.75);
        assert!(rep
            .violations
            .iter()
            .any(|v| matches!(v, Violation::Missed { row: 1, key: 4, .. })));
        assert!(rep
            .violations
            .iter()
            .all(|v| !matches!(v, Violation::Missed { row: 0, .. } | Violation::Intruded { row: 0, .. })));
    }

    #[test]
    fn malformed_rows_diverge_and_short_rows_take_every_key() {
        let s = vec![vec![1.0], vec![1.0, 2.0], vec![3.0, 1.0, 2.0]];
        let good = compare_rows(&s, &[vec![0], vec![1, 0], vec![0, 2]], 2, &Rule::default());
        assert!(good.agrees && good.overlap == 1.0 && good.rows_with_choice == 1);
        let dup = compare_rows(&s, &[vec![0], vec![0, 0], vec![0, 2]], 2, &Rule::default());
        assert!(!dup.agrees);
        let short = compare_rows(&s, &[vec![0], vec![1], vec![0, 2]], 2, &Rule::default());
        assert!(!short.agrees);
        let future = compare_rows(&s, &[vec![1], vec![0, 1], vec![0, 2]], 2, &Rule::default());
        assert!(!future.agrees);
    }

    #[test]
    fn taps_parse_with_padding() {
        // n = 3, top_k 2: scores [3, 3] row-major with zeros past the query.
        // Row 2: key 2 (2.9) is far above the cut-off 1.45, key 1 (0.0) far below.
        let sc = [1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 3.0, 0.0, 2.9];
        let ok = compare_taps(&sc, &[0.0, -1.0, 0.0, 1.0, 0.0, 2.0], 3, 2, &Rule::default());
        assert!(ok.agrees);
        let bad = compare_taps(&sc, &[0.0, -1.0, 0.0, 1.0, 0.0, 1.0], 3, 2, &Rule::default());
        assert!(!bad.agrees);
        let nan = compare_taps(&sc, &[0.5, -1.0, 0.0, 1.0, 0.0, 2.0], 3, 2, &Rule::default());
        assert!(!nan.agrees);
    }
}
