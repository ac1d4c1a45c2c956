//! Tap comparison: the error metrics of one tap, engine a against reference b (cosine;
//! rel_l2 = |a−b|/|b|; max_abs; nmse = Σ(a−b)²/Σb²; sqnr_db = 20·log10(|b|/|a−b|); the count of
//! non-finite values in a; the fraction of a still holding the canary), per-head cosines, and the
//! tolerance table (a tap is over when its rel_l2 is NaN or above its tolerance, or a canary is left).

use rayon::prelude::*;
use references::tap::{is_canary, Site, TapKey};
use reports::Metrics;
use std::collections::HashMap;

/// Values per part of a long comparison: parts are summed on rayon, then added in part order, so
/// the result does not depend on the thread count (one part: the plain sequential sums).
const METRIC_PART: usize = 1 << 16;

/// The sums behind [`Metrics`], over one part.
#[derive(Clone, Copy, Default)]
struct Sums {
    dot: f64,
    aa: f64,
    bb: f64,
    dd: f64,
    max_abs: f64,
    nonfinite: u64,
    canary: u64,
}

impl Sums {
    fn over(a: &[f32], b: &[f32]) -> Sums {
        let mut s = Sums::default();
        for (&x, &y) in a.iter().zip(b) {
            if is_canary(x) {
                s.canary += 1;
            }
            if !x.is_finite() {
                s.nonfinite += 1;
                continue;
            }
            let (x, y) = (x as f64, y as f64);
            s.dot += x * y;
            s.aa += x * x;
            s.bb += y * y;
            s.dd += (x - y) * (x - y);
            s.max_abs = s.max_abs.max((x - y).abs());
        }
        s
    }

    fn then(self, o: Sums) -> Sums {
        Sums {
            dot: self.dot + o.dot,
            aa: self.aa + o.aa,
            bb: self.bb + o.bb,
            dd: self.dd + o.dd,
            max_abs: self.max_abs.max(o.max_abs),
            nonfinite: self.nonfinite + o.nonfinite,
            canary: self.canary + o.canary,
        }
    }
}

/// Metrics of `a` (engine) against `b` (reference), in f64. Long tensors (weights of a real-sized
/// model) are summed in parts on rayon (see [`METRIC_PART`]).
pub fn metrics(a: &[f32], b: &[f32]) -> Metrics {
    assert_eq!(a.len(), b.len(), "compared tensors differ in length");
    let s = if a.len() <= METRIC_PART {
        Sums::over(a, b)
    } else {
        let parts: Vec<Sums> = a
            .par_chunks(METRIC_PART)
            .zip(b.par_chunks(METRIC_PART))
            .map(|(x, y)| Sums::over(x, y))
            .collect();
        parts.into_iter().fold(Sums::default(), Sums::then)
    };
    let Sums {
        dot,
        aa,
        bb,
        dd,
        max_abs,
        nonfinite,
        canary,
    } = s;
    let n = a.len().max(1) as f64;
    let mut m = Metrics {
        cosine: if aa > 0.0 && bb > 0.0 {
            dot / (aa.sqrt() * bb.sqrt())
        } else if aa == bb {
            1.0
        } else {
            0.0
        },
        rel_l2: if bb > 0.0 {
            (dd / bb).sqrt()
        } else if dd == 0.0 {
            0.0
        } else {
            f64::INFINITY
        },
        max_abs,
        nmse: if bb > 0.0 {
            dd / bb
        } else if dd == 0.0 {
            0.0
        } else {
            f64::INFINITY
        },
        sqnr_db: if dd > 0.0 {
            10.0 * (bb / dd).log10()
        } else {
            f64::INFINITY
        },
        nonfinite,
        canary_left: canary as f64 / n,
    };
    if nonfinite > 0 {
        // A non-finite value is an infinite error, whatever the finite part says; the cosine of
        // a tensor holding NaN is NaN (shown as NaN, never as the finite part's cosine).
        m.cosine = f64::NAN;
        m.rel_l2 = f64::INFINITY;
        m.nmse = f64::INFINITY;
        m.sqnr_db = f64::NEG_INFINITY;
        m.max_abs = f64::INFINITY;
    }
    m
}

/// Cosine of two f32 slices (0 when either is all zero or non-finite).
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let (x, y) = (x as f64, y as f64);
        dot += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa > 0.0 && bb > 0.0 && dot.is_finite() {
        dot / (aa.sqrt() * bb.sqrt())
    } else {
        0.0
    }
}

/// Column `cols` of every row of a `[rows, width]` tensor, gathered contiguously.
pub fn columns(data: &[f32], width: usize, cols: std::ops::Range<usize>) -> Vec<f32> {
    data.chunks(width)
        .flat_map(|row| row[cols.clone()].iter().copied())
        .collect()
}

/// Per-head cosine matrix between `[n, heads_a·hd]` and `[n, heads_b·hd]` tensors.
pub fn head_cosines(a: &[f32], heads_a: usize, b: &[f32], heads_b: usize, hd: usize) -> Vec<f64> {
    let head = |t: &[f32], n_heads: usize, h: usize| columns(t, n_heads * hd, h * hd..(h + 1) * hd);
    let bs: Vec<Vec<f32>> = (0..heads_b).map(|h| head(b, heads_b, h)).collect();
    let mut out = Vec::with_capacity(heads_a * heads_b);
    for ha in 0..heads_a {
        let av = head(a, heads_a, ha);
        for bv in &bs {
            out.push(cosine(&av, bv));
        }
    }
    out
}

/// The rel_l2 thresholds, keyed by site kind and activation dtype.
///
/// Defaults come from measured healthy runs (engine cpu against the reference over the presets ×
/// quant types × valid TP and the real SmolLM2; `tests/tests/healthy.rs` re-measures and asserts a ≥ 10× margin):
/// the worst healthy rel_l2 was 1e-6 on the synthetic presets and 2.25e-6 on the real SmolLM2 (30
/// layers), since both sides dequantize the same bytes bit-exactly and differ only in
/// accumulation order and precision. The f32 default sits 25× above that and below f16 rounding
/// (≈ 2e-4), so a tensor silently kept in f16 is caught.
#[derive(Clone, Debug)]
pub struct Tolerances {
    default_f32: f64,
    default_half: f64,
    overrides: HashMap<String, f64>,
}

/// Activation dtype of a capture, which selects the threshold column.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActDtype {
    F32,
    /// f16/bf16 activations (GPU backends that keep half precision).
    Half,
}

impl Default for Tolerances {
    fn default() -> Self {
        Tolerances {
            default_f32: 5e-5,
            default_half: 2e-2,
            overrides: HashMap::new(),
        }
    }
}

impl Tolerances {
    /// Base threshold for a site, before overrides.
    fn base(&self, site: Site, dtype: ActDtype) -> f64 {
        let base = match dtype {
            ActDtype::F32 => self.default_f32,
            ActDtype::Half => self.default_half,
        };
        match site {
            // Expert ids are compared exactly; any flip shows as a large rel_l2.
            Site::MoeTopk => 0.0,
            // Weights are dequantized from the same bytes on both sides: any difference is a fault.
            Site::Weight(_) => 1e-6,
            // Logits sum the errors of every layer and are large in magnitude.
            Site::Logits => base * 5.0,
            _ => base,
        }
    }

    pub fn threshold(&self, key: &TapKey, dtype: ActDtype) -> f64 {
        let site = key.site.name();
        let full = key.to_string();
        self.overrides
            .get(&full)
            .or_else(|| self.overrides.get(&site))
            .copied()
            .unwrap_or(self.base(key.site, dtype))
    }

    /// `SITE=VALUE` (e.g. `attn_out=1e-2`, `logits=0.05`, or a full key `blk.3.q=1e-2`).
    pub fn set(&mut self, spec: &str) -> anyhow::Result<()> {
        let (k, v) = spec
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--tolerance {spec:?}: expected SITE=VALUE"))?;
        let v: f64 = v
            .parse()
            .map_err(|_| anyhow::anyhow!("--tolerance {spec:?}: {v:?} is not a number"))?;
        if !(v >= 0.0 && v.is_finite()) {
            anyhow::bail!("--tolerance {spec:?}: the threshold must be a finite number >= 0");
        }
        if Site::parse(k).is_none() && k.parse::<TapKey>().is_err() {
            anyhow::bail!("--tolerance {spec:?}: {k:?} is neither a site (e.g. attn_out) nor a tap key (blk.3.q)");
        }
        self.overrides.insert(k.to_string(), v);
        Ok(())
    }

    /// Reads overrides from a JSON object `{"attn_out": 1e-2, ...}`.
    pub fn load_json(&mut self, text: &str) -> anyhow::Result<()> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow::anyhow!("tolerance file: expected a JSON object"))?;
        for (k, v) in obj {
            let v = v
                .as_f64()
                .ok_or_else(|| anyhow::anyhow!("tolerance file: {k} is not a number"))?;
            self.set(&format!("{k}={v}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::tap::canary;

    #[test]
    fn metric_definitions() {
        let b = [3.0f32, 4.0];
        let m = metrics(&b, &b);
        assert_eq!((m.rel_l2, m.max_abs, m.nmse, m.nonfinite), (0.0, 0.0, 0.0, 0));
        assert!((m.cosine - 1.0).abs() < 1e-12);
        let a = [3.0f32, 4.5];
        let m = metrics(&a, &b);
        assert!((m.rel_l2 - 0.1).abs() < 1e-12);
        assert!((m.nmse - 0.01).abs() < 1e-12);
        assert!((m.sqnr_db - 20.0).abs() < 1e-9);
        let m = metrics(&[canary(), 1.0], &[1.0, 1.0]);
        assert_eq!((m.canary_left, m.nonfinite), (0.5, 1));
        assert!(m.rel_l2.is_infinite());
    }

    #[test]
    fn tolerance_overrides() {
        let mut t = Tolerances::default();
        let key: TapKey = "blk.3.attn_out@r1".parse().unwrap();
        assert_eq!(t.threshold(&key, ActDtype::F32), 5e-5);
        t.set("attn_out=0.5").unwrap();
        assert_eq!(t.threshold(&key, ActDtype::F32), 0.5);
        t.set("blk.3.attn_out@r1=0.25").unwrap();
        assert_eq!(t.threshold(&key, ActDtype::F32), 0.25);
        assert!(t.set("nonsense=1").is_err());
        assert!(t.set("q=-1").is_err());
        t.load_json(r#"{"logits": 0.1}"#).unwrap();
        assert_eq!(t.threshold(&"logits".parse().unwrap(), ActDtype::F32), 0.1);
    }
}
