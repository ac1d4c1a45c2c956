//! The calibrated verdict of a black-box comparison (`entropy --server --against-reference`,
//! `gate --server`): one rule, one threshold set, both stored with their calibration data in
//! `golden/kld-calibration.json`.
//!
//! The inputs are the per-position top-k KLDs of the server against the reference (both
//! renormalized over the server's top-k set), with each position's prompt and index. The rule reads
//! the distribution, never one position's maximum: the mean with its standard error, and the
//! 95th and 99th percentiles, each as a multiple of a *healthy floor*, the same statistic measured
//! on real engines with healthy numerics (llama.cpp on the CPU with its default settings, and with
//! an f32 KV cache) on held-out prompts. Bands:
//!
//! - **within numeric noise**: the mean's lower bound (mean − z·SE) within `noise_mean` × the
//!   floor's mean and the p99 within `noise_p99` × the floor's p99;
//! - **broken**: the mean's lower bound over `broken_mean` × the floor's mean, or the p95 over
//!   `broken_p95` × the floor's p95, or a structural cause below (BOS shift, KLD growing with
//!   position, flat or degenerate distributions) while out of the noise band;
//! - **precision loss** otherwise: a uniform, moderate rise, the signature of a quantized KV cache
//!   or weights of fewer bits: a trade-off, reported as such (exit code configurable).
//!
//! Named causes ([`Cause`]) come from the profile: a one-token shift in the server's
//! `usage.prompt_tokens` with disagreement from position 0 (BOS added or dropped), KLD growing
//! with position, or raised on the repeats of a repeated-span probe ([`RepeatProbe`]) while the
//! prompts still rise (RoPE base or scale, context handling) or rise evenly (the KV cache), flat or degenerate
//! distributions (norm or numeric faults), a uniform rise across positions (a weight or layer
//! fault, or precision). Each carries its evidence; [`Cause::Unknown`] is allowed.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// The committed calibration: floors and thresholds.
pub const DEFAULT_CALIBRATION: &str = include_str!("../../golden/kld-calibration.json");

/// Multiples of the healthy floor that bound the bands.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BandThresholds {
    /// Standard errors taken off the mean before it is compared (a one-sided bound).
    pub z: f64,
    pub noise_mean: f64,
    pub noise_p99: f64,
    pub broken_mean: f64,
    pub broken_p95: f64,
    /// Late/early mean KLD ratio (positions in the last third of each prompt against those in the
    /// first third, past the first two) over which KLD "grows with position".
    pub growth_ratio: f64,
    /// Repeated-span probe: mean KLD on the repeats over that on the first copy, at or over which
    /// the fault is named position-dependent ([`RepeatProbe`]).
    #[serde(default = "default_repeat_ratio")]
    pub repeat_ratio: f64,
    /// With the probe over `repeat_ratio`: the prompts' late/early ratio at or over which the
    /// cause is RoPE (position-dependent); under it, the prompts rise evenly while the repeats
    /// degrade: the KV cache ([`Cause::KvCache`]).
    #[serde(default = "default_rope_growth")]
    pub rope_growth: f64,
}

fn default_repeat_ratio() -> f64 {
    2.0
}

fn default_rope_growth() -> f64 {
    1.25
}

/// The repeated-span probe, sent by the client besides the prompts: random word tokens, one span
/// repeated. A correct model predicts the repeats from the first copy (induction, which needs
/// the right relative positions: attend to the token after the earlier occurrence), so a RoPE
/// base or scale fault raises KLD on the repeats more than on the first copy; a weight or KV
/// cache fault raises both alike. Measured on a real llama.cpp server (docs/entropy.md).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RepeatProbe {
    pub sequences: usize,
    pub span: usize,
    pub copies: usize,
    /// Mean top-k KLD on the first copy's positions (past the first) and on the repeats'.
    pub first_mean: f64,
    pub repeat_mean: f64,
    pub first_n: usize,
    pub repeat_n: usize,
    /// `repeat_mean / first_mean`.
    pub ratio: f64,
}

impl RepeatProbe {
    /// From the probe's per-position KLDs (`pos`: the index in the sequence of the last token
    /// seen): the first copy's positions 1..span−1 (predicting random tokens) against the repeats'
    /// span..copies·span−1 (predicting a repeat from its second token on).
    pub fn from_positions(pos: &[PosKld], sequences: usize, span: usize, copies: usize) -> RepeatProbe {
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let first: Vec<f64> = pos
            .iter()
            .filter(|p| p.pos >= 1 && p.pos + 1 < span)
            .map(|p| p.kld)
            .collect();
        let repeat: Vec<f64> = pos
            .iter()
            .filter(|p| p.pos >= span && p.pos + 1 < copies * span)
            .map(|p| p.kld)
            .collect();
        let (f, r) = (mean(&first), mean(&repeat));
        RepeatProbe {
            sequences,
            span,
            copies,
            first_mean: f,
            repeat_mean: r,
            first_n: first.len(),
            repeat_n: repeat.len(),
            ratio: if first.is_empty() || repeat.is_empty() {
                f64::NAN
            } else {
                r / f.max(1e-12)
            },
        }
    }
}

/// A healthy floor: the statistics of per-position top-k KLD on healthy numerics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Floor {
    pub mean: f64,
    pub p95: f64,
    pub p99: f64,
}

/// One calibration measurement (kept with the figures it gave).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FloorRun {
    pub model: String,
    pub numerics: String,
    pub prompts: String,
    pub n_positions: usize,
    pub mean: f64,
    pub mean_se: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

/// `golden/kld-calibration.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub format: u32,
    #[serde(default)]
    pub what: String,
    pub thresholds: BandThresholds,
    /// The floor the verdict divides by: per statistic, the largest of the healthy runs.
    pub floor: Floor,
    #[serde(default)]
    pub runs: Vec<FloorRun>,
}

impl Calibration {
    /// The committed calibration.
    pub fn committed() -> Calibration {
        serde_json::from_str(DEFAULT_CALIBRATION).expect("golden/kld-calibration.json parses (checked by a unit test)")
    }

    /// A calibration file, checked: every threshold and floor finite and > 0, the bands ordered.
    pub fn load(path: &Path) -> anyhow::Result<Calibration> {
        let text = crate::output::read_text(path)?;
        let c: Calibration = serde_json::from_str(&text)
            .map_err(|e| anyhow::anyhow!("{}: not a KLD calibration file ({e})", path.display()))?;
        c.check().map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(c)
    }

    pub fn check(&self) -> Result<(), String> {
        let t = &self.thresholds;
        let f = &self.floor;
        for (name, v) in [
            ("noise_mean", t.noise_mean),
            ("noise_p99", t.noise_p99),
            ("broken_mean", t.broken_mean),
            ("broken_p95", t.broken_p95),
            ("growth_ratio", t.growth_ratio),
            ("repeat_ratio", t.repeat_ratio),
            ("rope_growth", t.rope_growth),
            ("floor.mean", f.mean),
            ("floor.p95", f.p95),
            ("floor.p99", f.p99),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{name} is {v}: expected a finite number > 0"));
            }
        }
        if !(t.z.is_finite() && t.z >= 0.0) {
            return Err(format!("z is {}: expected a finite number >= 0", t.z));
        }
        if t.broken_mean < t.noise_mean {
            return Err("broken_mean is below noise_mean".into());
        }
        Ok(())
    }
}

/// One compared position.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PosKld {
    /// 0-based prompt index.
    pub prompt: usize,
    /// The position's index in its prompt's sequence (0: the distribution after the first token).
    pub pos: usize,
    /// Positions in this prompt's compared sequence (to place `pos` in its first or last third).
    pub len: usize,
    pub kld: f64,
    pub same_top1: bool,
}

/// What else the verdict reads besides the KLDs.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// Per prompt: the server's `usage.prompt_tokens` minus the count the model's own tokenizer
    /// gives (with its BOS when `add_bos_token`); `None` where either is unknown.
    pub prompt_token_shift: Vec<Option<i64>>,
    /// Per prompt: the entropy verdict ("healthy", "flat", "degenerate") of the server's side.
    pub entropy_verdicts: Vec<String>,
    /// The reference given is the deployed file itself: metadata faults are on both sides.
    pub reference_is_deployed_file: bool,
    /// The repeated-span probe, when it was sent (`entropy --server --against-reference`).
    pub repeat_probe: Option<RepeatProbe>,
}

/// The severity band.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Band {
    WithinNoise,
    PrecisionLoss,
    Broken,
}

impl Band {
    pub fn name(self) -> &'static str {
        match self {
            Band::WithinNoise => "within numeric noise",
            Band::PrecisionLoss => "precision loss",
            Band::Broken => "broken",
        }
    }
}

/// What the profile points to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    None,
    BosAdded,
    BosDropped,
    GrowsWithPosition,
    KvCache,
    FlatOrDegenerate,
    UniformShift,
    Unknown,
}

impl Cause {
    pub fn name(self) -> &'static str {
        match self {
            Cause::None => "none",
            Cause::BosAdded => "BOS added (the server prepends a BOS token the model does not expect)",
            Cause::BosDropped => "BOS dropped (the server omits the BOS token the model expects)",
            Cause::GrowsWithPosition => {
                "position-dependent (KLD clean at position 0, growing with position, or raised on a repeated span): RoPE frequency base or scale, the KV cache, or context handling"
            }
            Cause::KvCache => {
                "the recall of earlier tokens degraded while the prompts rise evenly: the KV cache (a quantized or faulty cache)"
            }
            Cause::FlatOrDegenerate => "flat or degenerate distributions: a norm (epsilon) or numeric fault",
            Cause::UniformShift => {
                "a uniform rise across positions: a weight or layer fault, or weights/KV cache of fewer bits"
            }
            Cause::Unknown => "unknown",
        }
    }
}

/// The verdict with its figures and evidence.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub band: Band,
    pub band_name: String,
    pub cause: Cause,
    pub cause_name: String,
    pub evidence: Vec<String>,
    pub n_positions: usize,
    pub mean: f64,
    pub mean_se: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
    /// Where the largest single KLD is: 1-based prompt, position (reported, never decisive).
    pub max_at: (usize, usize),
    /// mean (less z·SE), p95 and p99 as multiples of the floor.
    pub mean_x_floor: f64,
    pub p95_x_floor: f64,
    pub p99_x_floor: f64,
    /// Late/early mean KLD ratio (NaN where a prompt is too short to have both thirds).
    pub growth: f64,
    pub floor: Floor,
    pub thresholds: BandThresholds,
    /// One line: band, cause and the key figures.
    pub headline: String,
    /// What the check cannot see in this setup (a reference that is the deployed file itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blind_spot: Option<String>,
    /// The repeated-span probe's figures, when it was sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repeat_probe: Option<RepeatProbe>,
}

/// The `q` quantile of sorted values (linear interpolation).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let x = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (x - lo as f64)
}

/// Mean, its standard error, p95, p99 and max of the KLDs.
pub fn summary(ks: &[f64]) -> (f64, f64, f64, f64, f64) {
    let n = ks.len();
    let mean = ks.iter().sum::<f64>() / n.max(1) as f64;
    let var = if n > 1 {
        ks.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    let mut s = ks.to_vec();
    s.sort_by(f64::total_cmp);
    (
        mean,
        (var / n.max(1) as f64).sqrt(),
        quantile(&s, 0.95),
        quantile(&s, 0.99),
        s.last().copied().unwrap_or(f64::NAN),
    )
}

/// Late/early mean KLD: positions in the last third of their prompt against those in the first
/// third, skipping each prompt's first two positions (the distribution after one or two tokens is
/// the least determined and the noisiest on every engine).
pub fn growth(pos: &[PosKld]) -> f64 {
    let (mut e, mut ne, mut l, mut nl) = (0.0, 0usize, 0.0, 0usize);
    for p in pos.iter().filter(|p| p.pos >= 2 && p.len >= 6) {
        let span = p.len - 2;
        let at = p.pos - 2;
        if at * 3 < span {
            e += p.kld;
            ne += 1;
        } else if at * 3 >= 2 * span {
            l += p.kld;
            nl += 1;
        }
    }
    if ne == 0 || nl == 0 {
        return f64::NAN;
    }
    (l / nl as f64) / (e / ne as f64).max(1e-12)
}

/// Gives the verdict.
pub fn judge(pos: &[PosKld], profile: &Profile, cal: &Calibration) -> Verdict {
    let t = &cal.thresholds;
    let f = &cal.floor;
    let ks: Vec<f64> = pos.iter().map(|p| p.kld).collect();
    let (mean, se, p95, p99, max) = summary(&ks);
    let mean_lo = (mean - t.z * se).max(0.0);
    let (mx, p95x, p99x) = (mean_lo / f.mean, p95 / f.p95, p99 / f.p99);
    let g = growth(pos);
    // Position 0 (the distribution after the first token) is the one RoPE leaves unrotated at
    // any base or scale; a weight, norm or V-cache fault reaches it like every other position.
    let mean_of = |f: &dyn Fn(&PosKld) -> bool| {
        let v: Vec<f64> = pos.iter().filter(|p| f(p)).map(|p| p.kld).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    };
    let (m0, m_rest) = (mean_of(&|p| p.pos == 0), mean_of(&|p| p.pos > 0));
    let pos0_clean = match (m0, m_rest) {
        (Some(a), Some(b)) => a * 5.0 <= b && a <= f.p95,
        _ => false,
    };
    let noise = mx <= t.noise_mean && p99x <= t.noise_p99;
    let mut evidence = Vec::new();
    let worst = pos.iter().max_by(|a, b| a.kld.total_cmp(&b.kld));
    let max_at = worst.map_or((0, 0), |w| (w.prompt + 1, w.pos));

    // The causes, strongest evidence first.
    let shifts: Vec<i64> = profile.prompt_token_shift.iter().flatten().copied().collect();
    let n_prompts = pos.iter().map(|p| p.prompt + 1).max().unwrap_or(0);
    let pos0: Vec<&PosKld> = pos.iter().filter(|p| p.pos == 0).collect();
    let pos0_high = pos0.iter().filter(|p| p.kld > f.p99 || !p.same_top1).count();
    let bos_shift = [1i64, -1]
        .into_iter()
        .find(|&s| !shifts.is_empty() && shifts.iter().filter(|&&x| x == s).count() * 10 >= shifts.len() * 8);
    let degenerate = profile.entropy_verdicts.iter().filter(|v| *v != "healthy").count();
    let probe = profile.repeat_probe.as_ref();
    let mut cause = Cause::None;
    if let Some(s) = bos_shift {
        cause = if s > 0 { Cause::BosAdded } else { Cause::BosDropped };
        evidence.push(format!(
            "the server counted {} prompt token{} than the model's tokenizer on {} of {} prompts (usage.prompt_tokens); position 0 over the floor's p99 or a different top-1 on {} of {} prompts",
            s.abs(),
            if s > 0 { " more" } else { " fewer" },
            shifts.iter().filter(|&&x| x == s).count(),
            shifts.len(),
            pos0_high,
            pos0.len()
        ));
    } else if !noise {
        if pos0_clean {
            cause = Cause::GrowsWithPosition;
            let (a0, rest) = (m0.unwrap_or(0.0), m_rest.unwrap_or(0.0));
            let ratio = rest / a0.max(1e-12);
            evidence.push(format!(
                "position 0, which RoPE leaves unrotated at any base or scale, is at the noise level (mean KLD {a0:.2e}, within the floor's p95) while the later positions average {rest:.4}: {}",
                if ratio > 1e3 { "over 1000× higher".to_string() } else { format!("{ratio:.0}× higher") }
            ));
        } else if g.is_finite() && g >= t.growth_ratio {
            cause = Cause::GrowsWithPosition;
            evidence.push(format!(
                "mean KLD in the last third of the prompts' positions is {g:.1}× that in the first third (over {:.1}× points to position)",
                t.growth_ratio
            ));
        } else if degenerate > 0 {
            cause = Cause::FlatOrDegenerate;
            evidence.push(format!(
                "{degenerate} of {} prompts flat or degenerate on the server (entropy check)",
                profile.entropy_verdicts.len()
            ));
        } else if let Some(r) = probe.filter(|r| r.ratio.is_finite() && r.ratio >= t.repeat_ratio) {
            // The repeats degrade more than the first copy: attention's recall of earlier tokens
            // is hit (RoPE's relative positions, or the cached keys and values). Prompts whose KLD
            // still rises with position point to RoPE; prompts raised evenly to the cache.
            let rope = g.is_finite() && g >= t.rope_growth;
            cause = if rope { Cause::GrowsWithPosition } else { Cause::KvCache };
            evidence.push(format!(
                "on the repeated-span probe ({} sequences of a {}-token random span × {}) mean KLD on the repeats is {:.1}× that on the first copy ({:.4} vs {:.4}; {:.1}× or more: the recall of earlier tokens is hit, which a weight fault does not single out), and on the prompts the last third is {g:.1}× the first ({} {:.2}×: {})",
                r.sequences,
                r.span,
                r.copies,
                r.ratio,
                r.repeat_mean,
                r.first_mean,
                t.repeat_ratio,
                if rope { "at or over" } else { "under" },
                t.rope_growth,
                if rope { "rising with position, RoPE" } else { "even, the KV cache" }
            ));
        } else if g.is_finite() {
            cause = Cause::UniformShift;
            evidence.push(format!(
                "KLD raised evenly across positions: last third {g:.1}× the first (under {:.1}×){}",
                t.growth_ratio,
                probe.map_or(String::new(), |r| format!(
                    "; repeated-span probe: repeats {:.1}× the first copy (under {:.1}×)",
                    r.ratio, t.repeat_ratio
                ))
            ));
        } else {
            cause = Cause::Unknown;
        }
    }
    if cause == Cause::None && degenerate > 0 {
        // Within noise against the reference, yet flat or degenerate: the reference shares it.
        evidence.push(format!(
            "{degenerate} of {} prompts flat or degenerate, yet within noise of the reference: the reference shows it too",
            profile.entropy_verdicts.len()
        ));
    }
    let structural = matches!(
        cause,
        Cause::BosAdded | Cause::BosDropped | Cause::GrowsWithPosition | Cause::FlatOrDegenerate
    );
    let band = if noise && !matches!(cause, Cause::BosAdded | Cause::BosDropped) {
        Band::WithinNoise
    } else if mx > t.broken_mean || p95x > t.broken_p95 || structural {
        Band::Broken
    } else {
        Band::PrecisionLoss
    };
    evidence.insert(
        0,
        format!(
            "mean KLD {mean:.5} ± {se:.5} ({mx:.1}× the floor {:.5} after −{}·SE), p95 {p95:.4} ({p95x:.1}× floor {:.4}), p99 {p99:.4} ({p99x:.1}× floor {:.4}) over {} positions of {n_prompts} prompts",
            f.mean,
            t.z,
            f.p95,
            f.p99,
            pos.len()
        ),
    );
    let blind_spot = profile.reference_is_deployed_file.then(|| {
        "the reference is the deployed file itself: a fault in its metadata (RoPE base or scale, norm epsilon, add_bos_token, chat template) is on both sides and invisible here; give the original model as --trusted-model".to_string()
    });
    let headline = format!(
        "{}{}: mean KLD {:.1}× the healthy floor, p99 {:.1}×",
        band.name().to_uppercase(),
        match cause {
            Cause::None => String::new(),
            c => format!(" ({})", c.name()),
        },
        mx,
        p99x
    );
    Verdict {
        band,
        band_name: band.name().to_string(),
        cause,
        cause_name: cause.name().to_string(),
        evidence,
        n_positions: pos.len(),
        mean,
        mean_se: se,
        p95,
        p99,
        max,
        max_at,
        mean_x_floor: mx,
        p95_x_floor: p95x,
        p99_x_floor: p99x,
        growth: g,
        floor: f.clone(),
        thresholds: t.clone(),
        headline,
        blind_spot,
        repeat_probe: profile.repeat_probe.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cal() -> Calibration {
        Calibration::committed()
    }

    /// `n` prompts of `len` positions, KLD `f(prompt, pos)`.
    fn make(n: usize, len: usize, f: impl Fn(usize, usize) -> f64) -> Vec<PosKld> {
        (0..n)
            .flat_map(|p| {
                let f = &f;
                (0..len).map(move |i| PosKld {
                    prompt: p,
                    pos: i,
                    len,
                    kld: f(p, i),
                    same_top1: true,
                })
            })
            .collect()
    }

    /// A deterministic spread around `m` (mean `m`, a tail to 3m).
    fn spread(m: f64, p: usize, i: usize) -> f64 {
        let u = ((p * 31 + i * 17) % 20) as f64 / 19.0;
        m * (0.5 + u * u * 1.5)
    }

    #[test]
    fn committed_calibration_is_valid() {
        let c = cal();
        c.check().unwrap();
        assert!(c.runs.len() >= 2, "at least two healthy runs");
    }

    #[test]
    fn healthy_floor_is_noise_and_outliers_do_not_decide() {
        let c = cal();
        let m = c.floor.mean;
        let mut pos = make(20, 20, |p, i| spread(m, p, i));
        // One position far out, as the healthy server had: still noise.
        pos[37].kld = 50.0 * c.floor.p99;
        let v = judge(&pos, &Profile::default(), &c);
        assert_eq!(v.band, Band::WithinNoise, "{}", v.headline);
        assert_eq!(v.cause, Cause::None);
    }

    #[test]
    fn uniform_moderate_rise_is_precision_loss() {
        let c = cal();
        let k = (c.thresholds.noise_mean + c.thresholds.broken_mean) / 2.0;
        let m = c.floor.mean * k;
        let v = judge(&make(20, 20, |p, i| spread(m, p, i)), &Profile::default(), &c);
        assert_eq!(v.band, Band::PrecisionLoss, "{}", v.headline);
        assert_eq!(v.cause, Cause::UniformShift);
        // Far above: broken, same cause.
        let m = c.floor.mean * c.thresholds.broken_mean * 3.0;
        let v = judge(&make(20, 20, |p, i| spread(m, p, i)), &Profile::default(), &c);
        assert_eq!(v.band, Band::Broken, "{}", v.headline);
    }

    #[test]
    fn growth_with_position_is_named_and_broken() {
        let c = cal();
        let m = c.floor.mean;
        let v = judge(
            &make(20, 30, |p, i| spread(m, p, i) * (1.0 + i as f64 * i as f64 / 20.0)),
            &Profile::default(),
            &c,
        );
        assert_eq!(v.cause, Cause::GrowsWithPosition, "{:?}", v.evidence);
        assert_eq!(v.band, Band::Broken);
    }

    #[test]
    fn clean_position_0_points_to_rope() {
        let c = cal();
        let m = c.floor.mean;
        let v = judge(
            &make(20, 20, |p, i| {
                if i == 0 {
                    spread(m, p, i)
                } else {
                    50.0 * spread(m, p, i)
                }
            }),
            &Profile::default(),
            &c,
        );
        assert_eq!(v.cause, Cause::GrowsWithPosition, "{:?}", v.evidence);
        assert!(v.evidence[1].contains("position 0"), "{:?}", v.evidence);
        assert_eq!(v.band, Band::Broken);
    }

    #[test]
    fn bos_shift_is_named_from_the_token_count() {
        let c = cal();
        let m = c.floor.mean;
        let mut pos = make(10, 20, |p, i| spread(m, p, i) * if i == 0 { 100.0 } else { 3.0 });
        for p in pos.iter_mut().filter(|p| p.pos == 0) {
            p.same_top1 = false;
        }
        let prof = Profile {
            prompt_token_shift: vec![Some(1); 10],
            ..Profile::default()
        };
        let v = judge(&pos, &prof, &c);
        assert_eq!(v.cause, Cause::BosAdded, "{:?}", v.evidence);
        assert_eq!(v.band, Band::Broken);
        assert!(v.evidence[1].contains("10 of 10 prompts"), "{:?}", v.evidence);
        let prof = Profile {
            prompt_token_shift: vec![Some(-1); 10],
            ..Profile::default()
        };
        assert_eq!(judge(&pos, &prof, &c).cause, Cause::BosDropped);
    }

    #[test]
    fn degenerate_prompts_name_norm_or_numerics() {
        let c = cal();
        let m = c.floor.mean * c.thresholds.noise_mean * 2.0;
        let prof = Profile {
            entropy_verdicts: vec!["degenerate".into(), "healthy".into()],
            ..Profile::default()
        };
        let v = judge(&make(2, 20, |p, i| spread(m, p, i)), &prof, &c);
        assert_eq!(v.cause, Cause::FlatOrDegenerate, "{:?}", v.evidence);
        assert_eq!(v.band, Band::Broken);
    }

    /// The probe's positions: `seqs` sequences of `copies` × `span`, KLD `first` on the first
    /// copy and `repeat` on the repeats.
    fn probe(seqs: usize, span: usize, copies: usize, first: f64, repeat: f64) -> RepeatProbe {
        let pos: Vec<PosKld> = (0..seqs)
            .flat_map(|s| {
                (1..span * copies).map(move |i| PosKld {
                    prompt: s,
                    pos: i,
                    len: span * copies,
                    kld: if i + 1 < span { first } else { repeat },
                    same_top1: true,
                })
            })
            .collect();
        RepeatProbe::from_positions(&pos, seqs, span, copies)
    }

    #[test]
    fn repeat_probe_ratio_names_position_or_uniform() {
        let p = probe(4, 12, 3, 0.01, 0.03);
        assert_eq!((p.first_n, p.repeat_n), (4 * 10, 4 * 23));
        assert!((p.ratio - 3.0).abs() < 1e-9, "{p:?}");
        let c = cal();
        let m = c.floor.mean * c.thresholds.noise_mean * 4.0;
        // Even prompts (no growth), a probe whose repeats are raised: position-dependent, broken.
        let mut prof = Profile {
            repeat_probe: Some(probe(4, 12, 3, 0.01, 0.01 * (c.thresholds.repeat_ratio + 0.5))),
            ..Profile::default()
        };
        let pos = make(20, 20, |p, i| spread(m, p, i));
        // Even prompts, repeats degraded: the KV cache, a trade-off by size (precision loss).
        let v = judge(&pos, &prof, &c);
        assert_eq!(v.cause, Cause::KvCache, "{:?}", v.evidence);
        assert_eq!(v.band, Band::PrecisionLoss);
        assert!(v.evidence[1].contains("repeated-span probe"), "{:?}", v.evidence);
        assert!(v.repeat_probe.is_some());
        // Prompts rising (under growth_ratio, over rope_growth), repeats degraded: RoPE, broken.
        let k = (c.thresholds.rope_growth + c.thresholds.growth_ratio) / 2.0;
        let rising = make(20, 20, |p, i| spread(m, p, i) * if i >= 14 { k } else { 1.0 });
        let v = judge(&rising, &prof, &c);
        assert!(
            v.growth < c.thresholds.growth_ratio && v.growth >= c.thresholds.rope_growth,
            "{}",
            v.growth
        );
        assert_eq!(v.cause, Cause::GrowsWithPosition, "{:?}", v.evidence);
        assert_eq!(v.band, Band::Broken);
        // Repeats raised like the first copy: a uniform shift, the probe's ratio in the evidence.
        prof.repeat_probe = Some(probe(4, 12, 3, 0.01, 0.012));
        let v = judge(&pos, &prof, &c);
        assert_eq!(v.cause, Cause::UniformShift, "{:?}", v.evidence);
        assert!(v.evidence[1].contains("repeats 1.2×"), "{:?}", v.evidence);
        // Within noise: the probe is not read.
        prof.repeat_probe = Some(probe(4, 12, 3, 0.001, 0.01));
        let v = judge(&make(20, 20, |p, i| spread(c.floor.mean * 0.5, p, i)), &prof, &c);
        assert_eq!((v.band, v.cause), (Band::WithinNoise, Cause::None));
    }

    #[test]
    fn quantile_interpolates() {
        assert_eq!(quantile(&[0.0, 1.0, 2.0], 0.5), 1.0);
        assert!((quantile(&[0.0, 10.0], 0.95) - 9.5).abs() < 1e-12);
        assert!(quantile(&[], 0.5).is_nan());
    }
}
