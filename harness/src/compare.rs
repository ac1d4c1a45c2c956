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

const LANES: usize = 8;

/// [`Sums::over`]'s running sums, one per lane.
#[derive(Default)]
struct Lanes {
    dot: [f64; LANES],
    aa: [f64; LANES],
    bb: [f64; LANES],
    dd: [f64; LANES],
    mx: [f64; LANES],
}

impl Lanes {
    #[inline(always)]
    fn add(&mut self, j: usize, x: f32, y: f32) {
        let (x, y) = (x as f64, y as f64);
        let d = x - y;
        self.dot[j] += x * y;
        self.aa[j] += x * x;
        self.bb[j] += y * y;
        self.dd[j] += d * d;
        self.mx[j] = self.mx[j].max(d.abs());
    }
}

impl Sums {
    /// The sums over one part, in eight lanes (element i in lane i mod 8, the lanes added in
    /// order at the end) so the loop has no serial dependency; a non-finite `a` value counts and
    /// contributes nothing, its `b` value included.
    fn over(a: &[f32], b: &[f32]) -> Sums {
        let mut l = Lanes::default();
        let (mut nonfinite, mut canary) = (0u64, 0u64);
        let mut odd = |l: &mut Lanes, j: usize, x: f32, y: f32| {
            if x.is_finite() {
                l.add(j, x, y);
            } else {
                // Every canary is a NaN: only a non-finite value needs the canary test.
                nonfinite += 1;
                canary += is_canary(x) as u64;
            }
        };
        let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
        let (ra, rb) = (ca.remainder(), cb.remainder());
        for (xa, xb) in ca.zip(cb) {
            if xa.iter().all(|x| x.is_finite()) {
                // The common case, without a branch per value.
                for j in 0..LANES {
                    l.add(j, xa[j], xb[j]);
                }
            } else {
                for j in 0..LANES {
                    odd(&mut l, j, xa[j], xb[j]);
                }
            }
        }
        for (j, (&x, &y)) in ra.iter().zip(rb).enumerate() {
            odd(&mut l, j, x, y);
        }
        let sum = |v: [f64; LANES]| v.iter().sum::<f64>();
        Sums {
            dot: sum(l.dot),
            aa: sum(l.aa),
            bb: sum(l.bb),
            dd: sum(l.dd),
            max_abs: l.mx.iter().fold(0f64, |m, &v| m.max(v)),
            nonfinite,
            canary,
        }
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

/// The rel_l2 thresholds, keyed by site kind and activation dtype, with the user's overrides.
///
/// Defaults come from measured healthy runs (engine cpu against the reference over the presets ×
/// quant types × valid TP and the real SmolLM2; `tests/tests/healthy.rs` re-measures and asserts a ≥ 10× margin):
/// the worst healthy rel_l2 was 1e-6 on the synthetic presets and 2.25e-6 on the real SmolLM2 (30
/// layers), since both sides dequantize the same bytes bit-exactly and differ only in
/// accumulation order and precision. The f32 default sits 25× above that and below f16 rounding
/// (≈ 2e-4), so a tensor silently kept in f16 is caught.
///
/// These are the *end-to-end* thresholds. Where a tap's op can be re-run on the candidate's own
/// inputs, the verdict is its local error against the noise model's bound instead (see
/// [`crate::noise`]); the end-to-end threshold then only applies to taps without captured inputs,
/// and the f32 column stays the floor below which no tap is ever over.
///
/// Overrides, most specific first: an exact tap key (`blk.3.q@r1`), then glob patterns over the
/// printed key (`blk.*.q`, `blk.1?.attn_out`; `*` any run of characters, `?` one; a pattern
/// without a rank also matches every rank's key), more literal characters first and, at equal
/// count, the one given last; then a site name (`attn_out`); then the bare `*`.
#[derive(Clone, Debug)]
pub struct Tolerances {
    default_f32: f64,
    overrides: HashMap<String, f64>,
    /// (pattern, value) in the order given.
    patterns: Vec<(String, f64)>,
    /// Per-tap local-error bounds from a healthy baseline (`--baseline`), by printed key.
    baseline: HashMap<String, Baseline>,
    /// Where the baselines came from (file names), for the run document.
    baseline_names: Vec<String>,
    /// Per-head local errors of a healthy baseline, by (unranked printed key, head).
    head_baseline: HashMap<(String, usize), f64>,
}

/// What a healthy baseline run says about one tap.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Baseline {
    /// The healthy run's local error at this tap (None where it had none).
    pub local: Option<f64>,
    /// The healthy run's end-to-end rel_l2.
    pub end_to_end: f64,
}

/// The margin a baseline's observed error is multiplied by to give a bound.
pub const BASELINE_MARGIN: f64 = 3.0;

/// Activation dtype of a capture, which selects the threshold column and the unit roundoff of
/// the noise model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActDtype {
    F32,
    Bf16,
    F16,
    /// FP8 E4M3 storage (accumulation still wider).
    Fp8E4m3,
    /// 16-bit storage of an unnamed kind (the old half-precision column): judged as bf16, the
    /// coarser of the two, so nothing healthy is flagged.
    Half,
}

impl ActDtype {
    /// Unit roundoff of round-to-nearest in this format: 2^-p for p significand bits
    /// (bf16 8 → 2^-8, f16 11 → 2^-11, f32 24 → 2^-24, fp8 e4m3 4 → 2^-4).
    pub fn unit_roundoff(self) -> f64 {
        match self {
            ActDtype::F32 => 2f64.powi(-24),
            ActDtype::Bf16 => 2f64.powi(-8),
            ActDtype::F16 => 2f64.powi(-11),
            ActDtype::Fp8E4m3 => 2f64.powi(-4),
            ActDtype::Half => 2f64.powi(-8),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ActDtype::F32 => "f32",
            ActDtype::Bf16 => "bf16",
            ActDtype::F16 => "f16",
            ActDtype::Fp8E4m3 => "fp8-e4m3",
            ActDtype::Half => "half (judged as bf16)",
        }
    }

    pub fn parse(s: &str) -> Option<ActDtype> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "fp32" | "float32" => Some(ActDtype::F32),
            "bf16" | "bfloat16" => Some(ActDtype::Bf16),
            "f16" | "fp16" | "float16" | "half" => Some(ActDtype::F16),
            "fp8" | "fp8-e4m3" | "f8e4m3" | "float8_e4m3fn" => Some(ActDtype::Fp8E4m3),
            _ => None,
        }
    }

    /// The narrowest of bf16 and f16 that holds every value exactly, else f32. bf16 is tried
    /// first: a bf16 value inside f16's range is also f16-representable (8 significand bits fit
    /// in 11), so "f16-representable" alone would misname a bf16 tensor.
    pub fn detect<'a>(values: impl Iterator<Item = &'a [f32]> + Clone) -> ActDtype {
        let all = |f: fn(f32) -> bool| values.clone().all(|v| v.iter().all(|&x| !x.is_finite() || f(x)));
        if all(|x| half::bf16::from_f32(x).to_f32() == x) {
            ActDtype::Bf16
        } else if all(|x| half::f16::from_f32(x).to_f32() == x) {
            ActDtype::F16
        } else {
            ActDtype::F32
        }
    }
}

impl Default for Tolerances {
    fn default() -> Self {
        Tolerances {
            default_f32: 5e-5,
            overrides: HashMap::new(),
            patterns: Vec::new(),
            baseline: HashMap::new(),
            baseline_names: Vec::new(),
            head_baseline: HashMap::new(),
        }
    }
}

/// `*` (any run) and `?` (one character) glob match.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let (p, t): (Vec<char>, Vec<char>) = (pattern.chars().collect(), text.chars().collect());
    let (mut pi, mut ti, mut star, mut mark) = (0, 0, None, 0);
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == t[ti]) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ti;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ti = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

impl Tolerances {
    /// The end-to-end threshold of a site for a dtype, before overrides. The half-precision
    /// columns scale the f32 one by the ratio of unit roundoffs, capped: they are only used
    /// where a tap has no captured inputs (the local rule decides elsewhere).
    fn base(&self, site: Site, dtype: ActDtype) -> f64 {
        let base = match dtype {
            ActDtype::F32 => self.default_f32,
            ActDtype::F16 => 1e-2,
            ActDtype::Bf16 | ActDtype::Half => 5e-2,
            ActDtype::Fp8E4m3 => 0.25,
        };
        match site {
            // Expert ids are compared exactly; any flip shows as a large rel_l2.
            Site::MoeTopk => 0.0,
            // Weights are dequantized from the same bytes on both sides: any difference is a fault,
            // except, below f32, one rounding of a float weight to the compute dtype (rel_l2 ≤ u).
            Site::Weight(_) if dtype == ActDtype::F32 => 1e-6,
            Site::Weight(_) => dtype.unit_roundoff(),
            // Logits sum the errors of every layer and are large in magnitude.
            Site::Logits => base * 5.0,
            _ => base,
        }
    }

    /// The f32 column's threshold for a site (the floor of every rule).
    pub fn floor(&self, key: &TapKey) -> f64 {
        self.user(key).unwrap_or(self.base(key.site, ActDtype::F32))
    }

    /// The user's override for a key, by the precedence in the type's doc.
    pub fn user(&self, key: &TapKey) -> Option<f64> {
        let full = key.to_string();
        let unranked = key.unranked().to_string();
        if let Some(v) = self.overrides.get(&full) {
            return Some(*v);
        }
        let literal = |p: &str| p.chars().filter(|c| *c != '*' && *c != '?').count();
        let best = self
            .patterns
            .iter()
            .enumerate()
            .filter(|(_, (p, _))| p != "*" && (glob_match(p, &full) || glob_match(p, &unranked)))
            .max_by_key(|(i, (p, _))| (literal(p), *i));
        if let Some((_, (_, v))) = best {
            return Some(*v);
        }
        if let Some(v) = self.overrides.get(&key.site.name()) {
            return Some(*v);
        }
        self.patterns.iter().rev().find(|(p, _)| p == "*").map(|(_, v)| *v)
    }

    pub fn threshold(&self, key: &TapKey, dtype: ActDtype) -> f64 {
        self.user(key).unwrap_or(self.base(key.site, dtype))
    }

    /// The healthy baseline's figures at a key (exact key, else its unranked form).
    pub fn baseline(&self, key: &TapKey) -> Option<Baseline> {
        self.baseline
            .get(&key.to_string())
            .or_else(|| self.baseline.get(&key.unranked().to_string()))
            .copied()
    }

    /// The baselines' names, in the order given.
    pub fn baseline_names(&self) -> &[String] {
        &self.baseline_names
    }

    /// Names a baseline source (shown in the run document).
    pub fn name_baseline(&mut self, name: String) {
        self.baseline_names.push(name);
    }

    /// True when a baseline was loaded.
    pub fn has_baseline(&self) -> bool {
        !self.baseline.is_empty()
    }

    /// Records a healthy run's local error of `head` (the model's head index) at the attention
    /// tap `key` (ranked or not); several baselines keep the larger.
    pub fn add_head_baseline(&mut self, key: &str, head: usize, local: f64) {
        if !local.is_finite() {
            return;
        }
        let key = key
            .parse::<TapKey>()
            .map_or_else(|_| key.to_string(), |k| k.unranked().to_string());
        let e = self.head_baseline.entry((key, head)).or_insert(local);
        *e = e.max(local);
    }

    /// The healthy baseline's local error of `head` at `key` (its unranked form).
    pub fn head_baseline(&self, key: &TapKey, head: usize) -> Option<f64> {
        self.head_baseline.get(&(key.unranked().to_string(), head)).copied()
    }

    /// Records a healthy run's errors at `key`; several baselines keep the larger.
    pub fn add_baseline(&mut self, key: &str, b: Baseline) {
        let e = self.baseline.entry(key.to_string()).or_insert(b);
        e.end_to_end = e.end_to_end.max(b.end_to_end);
        e.local = match (e.local, b.local) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
    }

    /// `SITE=VALUE` (e.g. `attn_out=1e-2`, `logits=0.05`), a full key `blk.3.q=1e-2`, or a glob
    /// pattern over the printed key (`blk.*.q=1e-2`, `*=0.1`).
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
        if k.contains('*') || k.contains('?') {
            if !k.chars().all(|c| c.is_ascii_alphanumeric() || "._@*?".contains(c)) {
                anyhow::bail!("--tolerance {spec:?}: a pattern holds tap-key characters, '*' and '?' only");
            }
            self.patterns.push((k.to_string(), v));
            return Ok(());
        }
        if Site::parse(k).is_none() && k.parse::<TapKey>().is_err() {
            anyhow::bail!(
                "--tolerance {spec:?}: {k:?} is neither a site (e.g. attn_out), a tap key (blk.3.q) nor a pattern (blk.*.q)"
            );
        }
        self.overrides.insert(k.to_string(), v);
        Ok(())
    }

    /// Reads overrides from a JSON object `{"attn_out": 1e-2, "blk.*.q": 0.1, ...}`.
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

    #[test]
    fn tolerance_patterns_most_specific_wins() {
        let mut t = Tolerances::default();
        let q3: TapKey = "blk.3.q@r1".parse().unwrap();
        let k3: TapKey = "blk.3.k".parse().unwrap();
        t.set("*=0.1").unwrap();
        assert_eq!(t.threshold(&q3, ActDtype::F32), 0.1);
        t.set("k=0.2").unwrap();
        // A site name beats the bare '*'.
        assert_eq!(t.threshold(&k3, ActDtype::F32), 0.2);
        t.set("blk.*.q=0.3").unwrap();
        // A pattern without a rank matches every rank's key.
        assert_eq!(t.threshold(&q3, ActDtype::F32), 0.3);
        t.set("blk.3.*=0.4").unwrap();
        // Equal literal count: the later one.
        assert_eq!(t.threshold(&q3, ActDtype::F32), 0.4);
        t.set("blk.?.k=0.5").unwrap();
        assert_eq!(t.threshold(&k3, ActDtype::F32), 0.5);
        t.set("blk.3.q@r1=0.6").unwrap();
        assert_eq!(t.threshold(&q3, ActDtype::F32), 0.6);
        assert!(t.set("blk.*.q;rm=1").is_err());
        t.load_json(r#"{"blk.1*.attn_out": 0.7}"#).unwrap();
        assert_eq!(t.threshold(&"blk.12.attn_out".parse().unwrap(), ActDtype::F32), 0.7);
        assert_eq!(t.threshold(&"blk.2.attn_out".parse().unwrap(), ActDtype::F32), 0.1);
        assert!(glob_match("a*b?c", "axxbyc") && !glob_match("a*b?c", "axxbc"));
    }

    #[test]
    fn dtype_detection_names_bf16_before_f16() {
        let bf: Vec<f32> = [0.5f32, -3.25, 1.0e-3, 7.0e4]
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_f32())
            .collect();
        assert_eq!(ActDtype::detect([bf.as_slice()].into_iter()), ActDtype::Bf16);
        let f: Vec<f32> = [0.1f32, 1.3].iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
        assert_eq!(ActDtype::detect([f.as_slice()].into_iter()), ActDtype::F16);
        assert_eq!(ActDtype::detect([&[0.1f32][..]].into_iter()), ActDtype::F32);
        assert_eq!(ActDtype::Bf16.unit_roundoff(), 1.0 / 256.0);
    }
}
