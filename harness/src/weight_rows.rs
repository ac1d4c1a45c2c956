//! Weight taps on a sample of rows: which rows of a `blk.L.w.*` weight `diff-layers` asks both
//! sides for ([`WeightSampling::rows`]), so neither decodes a whole layer of weights to f32 for
//! its taps.
//!
//! The faults a weight tap is there for (loading, sharding, transposition, dequantization,
//! re-rounding) reach every block of the weight, so a deterministic sample of rows finds them:
//! [`SAMPLE_ROWS`] rows spread over each TP shard's range (one per stratum, at an offset that
//! varies from stratum to stratum so that it does not line up with heads), always the shard's
//! first and last row; a shard of at most `2 × SAMPLE_ROWS` rows is taken whole. The engine's
//! rank asks for the sample of its own shard (local row indices); the reference, which holds the
//! whole weight, for the union over the ranks of each shard's sample, so every rank's rows are
//! there to compare with, and with another rank's (a swapped shard). Shapes are still checked
//! whole: a rank reports its shard's whole shape with the rows.
//!
//! What the sample cannot see: a fault confined to rows outside it (one head's rows rescaled
//! where the sample misses that head, a single corrupted block). Such a fault still changes the
//! activations that read those rows and shows there, one tap later; `--full-weights` compares
//! every row and names the weight.

use references::config::ModelConfig;
use references::tap::{rank_columns, Site, TapKey};

/// Rows sampled per shard range (plus the range's first and last row).
pub const SAMPLE_ROWS: usize = 32;

/// The sample of a range of `n` rows, as offsets `0..n`, ascending: every row when `n` is at most
/// `2 × SAMPLE_ROWS`, else the first and last row and one row in each of [`SAMPLE_ROWS`] equal
/// strata, at a golden-ratio offset within the stratum.
pub fn spread(n: usize) -> Vec<usize> {
    if n <= 2 * SAMPLE_ROWS {
        return (0..n).collect();
    }
    const PHI: f64 = 0.618_033_988_749_894_8;
    let mut rows = vec![0, n - 1];
    for i in 0..SAMPLE_ROWS {
        let (lo, hi) = (i * n / SAMPLE_ROWS, (i + 1) * n / SAMPLE_ROWS);
        let off = ((i as f64 * PHI).fract() * (hi - lo) as f64) as usize;
        rows.push((lo + off).min(hi - 1));
    }
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Which rows of a weight the diff asks for: a sample ([`spread`] per shard range), or every
/// row (`--full-weights`).
#[derive(Clone, Debug)]
pub struct WeightSampling {
    /// Every row: the whole comparison.
    pub full: bool,
    pub tp: usize,
    pub config: ModelConfig,
}

impl WeightSampling {
    /// The rows of weight `key` (whole shape `shape`) to hand over, or `None` for every row
    /// (`--full-weights`, or a weight small enough that its sample is every row).
    pub fn rows(&self, key: &TapKey, shape: [usize; 2]) -> Option<Vec<usize>> {
        if self.full || !matches!(key.site, Site::Weight(_)) {
            return None;
        }
        let n = shape[0];
        let rows: Vec<usize> = match key.rank {
            // A rank's own shard (or its whole replicated / row-parallel weight).
            Some(_) => spread(n),
            // The whole weight: each column-parallel shard's sample, at its offset.
            None => {
                let ranges: Option<Vec<_>> = (self.tp > 1)
                    .then(|| {
                        (0..self.tp)
                            .map(|r| rank_columns(key.site, &self.config, self.tp, r).filter(|r| r.end <= n))
                            .collect()
                    })
                    .flatten();
                match ranges {
                    Some(ranges) => ranges
                        .into_iter()
                        .flat_map(|r| spread(r.len()).into_iter().map(move |i| r.start + i))
                        .collect(),
                    None => spread(n),
                }
            }
        };
        (rows.len() < n).then_some(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::tap::WeightKind;

    #[test]
    fn a_sample_keeps_the_ends_is_spread_and_small_ranges_are_whole() {
        assert_eq!(spread(5), vec![0, 1, 2, 3, 4]);
        assert_eq!(spread(64).len(), 64);
        for n in [65, 128, 576, 4096, 14336] {
            let s = spread(n);
            assert!(s.len() <= SAMPLE_ROWS + 2 && s.len() >= SAMPLE_ROWS, "{n}: {}", s.len());
            assert_eq!((s[0], *s.last().unwrap()), (0, n - 1));
            assert!(s.windows(2).all(|w| w[0] < w[1]));
            // One row in every stratum.
            for i in 0..SAMPLE_ROWS {
                let (lo, hi) = (i * n / SAMPLE_ROWS, (i + 1) * n / SAMPLE_ROWS);
                assert!(s.iter().any(|&r| (lo..hi).contains(&r)), "{n}: stratum {i}");
            }
        }
        // 32 heads of 128 rows: not the same row of every head.
        let offs: std::collections::BTreeSet<usize> = spread(4096).iter().map(|r| r % 128).collect();
        assert!(offs.len() > 16, "{offs:?}");
    }

    #[test]
    fn the_whole_weight_holds_every_ranks_sample_at_its_offset() {
        let mut c = references::synth::preset("smollm2-135m").unwrap().config;
        c.n_heads = 8;
        c.n_kv_heads = 4;
        c.head_dim = 72;
        let s = WeightSampling {
            full: false,
            tp: 2,
            config: c.clone(),
        };
        let q = Site::Weight(WeightKind::Q);
        let whole = s.rows(&TapKey::layer(0, q), [576, 576]).unwrap();
        let r1 = s.rows(&TapKey::ranked(0, q, 1), [288, 576]).unwrap();
        assert!(r1.iter().all(|i| whole.contains(&(288 + i))));
        assert!(whole.contains(&0) && whole.contains(&287) && whole.contains(&288) && whole.contains(&575));
        // Row-parallel o: the same rows on both sides.
        let o = Site::Weight(WeightKind::O);
        assert_eq!(
            s.rows(&TapKey::layer(0, o), [576, 576]),
            s.rows(&TapKey::ranked(0, o, 0), [576, 288])
        );
        // --full-weights, and a weight no bigger than its sample: every row.
        let full = WeightSampling {
            full: true,
            ..s.clone()
        };
        assert_eq!(full.rows(&TapKey::layer(0, q), [576, 576]), None);
        assert_eq!(s.rows(&TapKey::layer(0, o), [64, 576]), None);
        assert_eq!(s.rows(&TapKey::layer(0, Site::Q), [576, 576]), None);
    }
}
