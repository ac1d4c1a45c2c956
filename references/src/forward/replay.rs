//! Op isolation: re-run one reference op on inputs taken from elsewhere (the candidate's own
//! captured taps), to tell an op that introduced an error from one that only propagated it, and
//! the op's *noise scale* on those inputs: how large a rounding error the op's condition lets a
//! correct low-precision implementation make (see [`Replayed::rho`]).
//!
//! The noise scale of an output element y = Σⱼ wⱼxⱼ is a = c·√(Σⱼ (wⱼxⱼ)²) + |y|: every product
//! carries about one relative rounding (of the stored weight, or of an input the candidate
//! rounded on its way in) with independent signs, so their errors add in quadrature, and the
//! stored output is rounded once more. `rho` is the rms of a over the tap relative to the rms of
//! y, so a correct implementation with unit roundoff u has a local error of order u·rho. The sum
//! of squared products is computed exactly, in f64, on a fixed sample of output elements (a
//! second full pass would cost as much as the matmul itself).

use super::{deepseek2, linear, ops, swiglu_ffn, ForwardError, Mat, Reference};
use crate::config::Arch;
use crate::tap::{Site, TapKey};

/// Inputs by (unranked) tap key; `None` when the capture does not have that tap.
pub type Inputs<'a> = dyn Fn(&TapKey) -> Option<Vec<f32>> + 'a;

/// Output elements sampled per matmul tap for the noise scale.
pub const NOISE_SAMPLES: usize = 256;

/// A replayed op: its output on the given inputs and its noise scale there.
#[derive(Clone, Debug)]
pub struct Replayed {
    pub out: Vec<f32>,
    /// rms(a)/rms(y) over the tap (see the module doc): a correct implementation at unit
    /// roundoff u has a local rel_l2 of order u·rho.
    pub rho: f64,
    /// The part of `rho` due to the sum of products alone (0 for ops that are not sums), which
    /// a TP all-reduce of partial sums adds once more.
    pub rho_sum: f64,
    /// Per head, for attention outputs: rho over that head's columns (empty elsewhere).
    pub rho_heads: Vec<f64>,
    /// The token rows `out` holds, ascending (`None`: every row). See [`Reference::replay_rows`].
    pub rows: Option<Vec<usize>>,
    /// The reduction length K of the op's last sum of products (0 for ops that are not one):
    /// the noise model's accumulator term, for narrow accumulators, grows with it.
    pub reduction: usize,
}

impl Replayed {
    fn plain(out: Vec<f32>, rho: f64) -> Replayed {
        Replayed {
            out,
            rho,
            rho_sum: 0.0,
            rho_heads: Vec::new(),
            rows: None,
            reduction: 0,
        }
    }
}

/// Rows `rows` of `x [n, width]` (width = x.len() / n).
pub fn select_rows(x: &[f32], n: usize, rows: &[usize]) -> Vec<f32> {
    if n == 0 || x.len() % n != 0 {
        return Vec::new();
    }
    let w = x.len() / n;
    rows.iter()
        .filter(|&&t| t < n)
        .flat_map(|&t| x[t * w..(t + 1) * w].iter().copied())
        .collect()
}

/// Whether `site`'s op treats each token row on its own (no position, no other row), so that a
/// replay on a subset of rows is the full replay's rows, in every family this module replays.
fn row_local(site: Site) -> bool {
    matches!(
        site,
        Site::AttnNorm
            | Site::FfnNorm
            | Site::ResidAttn
            | Site::ResidOut
            | Site::AttnProj
            | Site::FfnGate
            | Site::FfnUp
            | Site::FfnOut
            | Site::MoeLogits
            | Site::MoeTopk
            | Site::OutputNorm
            | Site::Logits
    )
}

/// Causal attention for the query positions `pos` only (`q [pos.len(), H·dk]`; `kv(t)` gives the
/// key and value rows position t reads, at least `0..=t`), computed exactly as
/// [`ops::causal_attention`] computes those rows, with the per-head noise scale of
/// [`attention_rho`] on them.
#[allow(clippy::too_many_arguments)]
fn attention_rows<'a>(
    q: &[f32],
    kv: impl Fn(usize) -> (&'a [f32], &'a [f32]),
    pos: &[usize],
    n_heads: usize,
    n_kv_heads: usize,
    dk: usize,
    dv: usize,
    scale: f64,
) -> (Vec<f32>, f64, Vec<f64>) {
    let group = (n_heads / n_kv_heads.max(1)).max(1);
    let mut out = vec![0f32; pos.len() * n_heads * dv];
    let mut num = vec![0f64; n_heads];
    let mut den = vec![0f64; n_heads];
    let mut acc = vec![0f64; dv];
    let mut sq = vec![0f64; dv];
    for (i, &t) in pos.iter().enumerate() {
        let mut scores = vec![0f64; t + 1];
        let (k, v) = kv(t);
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[(i * n_heads + h) * dk..(i * n_heads + h + 1) * dk];
            for (s, score) in scores.iter_mut().enumerate() {
                let kh = &k[(s * n_kv_heads + kvh) * dk..(s * n_kv_heads + kvh + 1) * dk];
                *score = ops::dot64(qh, kh) * scale;
            }
            ops::softmax(&mut scores);
            acc.iter_mut().for_each(|a| *a = 0.0);
            sq.iter_mut().for_each(|a| *a = 0.0);
            for (s, &p) in scores.iter().enumerate() {
                let vh = &v[(s * n_kv_heads + kvh) * dv..(s * n_kv_heads + kvh + 1) * dv];
                for ((a, b), &x) in acc.iter_mut().zip(sq.iter_mut()).zip(vh) {
                    let pv = p * x as f64;
                    *a += pv;
                    *b += pv * pv;
                }
            }
            let o = &mut out[(i * n_heads + h) * dv..(i * n_heads + h + 1) * dv];
            for ((o, &a), &b) in o.iter_mut().zip(&acc).zip(&sq) {
                *o = a as f32;
                let y = (a as f32).abs() as f64;
                num[h] += (b.sqrt() + y).powi(2);
                den[h] += y * y;
            }
        }
    }
    let ratio = |a: f64, b: f64| if b == 0.0 { 1.0 } else { (a / b).sqrt() };
    let heads = num.iter().zip(&den).map(|(&a, &b)| ratio(a, b)).collect();
    (out, ratio(num.iter().sum(), den.iter().sum()), heads)
}

/// The key and value rows each query position of a `k`/`v` capture over `n` tokens read: the
/// stacked decode-step cache taps ([`Site::KvCacheK`]/[`Site::KvCacheV`], `width` wide) for the
/// positions that ran as decode steps, else `k`/`v` themselves. `None` without cache taps.
fn decode_kv<'a>(
    k: &'a [f32],
    v: &'a [f32],
    cache: Option<&'a (Vec<f32>, Vec<f32>)>,
    n: usize,
    width: usize,
) -> Option<impl Fn(usize) -> (&'a [f32], &'a [f32])> {
    let (ck, cv) = cache?;
    let d = crate::tap::cache_steps(ck.len().checked_div(width)?, n).filter(|_| ck.len() == cv.len())?;
    Some(move |t: usize| match t.checked_sub(n - d) {
        Some(i) if i < d => {
            let r = crate::tap::cache_step_rows(n, d, i);
            (&ck[r.start * width..r.end * width], &cv[r.start * width..r.end * width])
        }
        _ => (k, v),
    })
}

/// rho of `y = x · wᵀ` (`x [n, k]`, `w [m, k]`) from a fixed sample of output elements, the
/// products weighted by `c`; also returns the products' part alone.
fn linear_rho(x: &[f32], n: usize, w: &Mat, y: &[f32], c: f64) -> (f64, f64) {
    let (k, m) = (w.cols, w.rows);
    let total = n * m;
    if total == 0 || k == 0 {
        return (1.0, 0.0);
    }
    let samples = NOISE_SAMPLES.min(total);
    // A stride coprime with the width, so the sample spreads over tokens and columns.
    let mut stride = (total / samples).max(1) | 1;
    while gcd(stride, m) != 1 {
        stride += 2;
    }
    let mut row = vec![0f32; k];
    let (mut aa, mut ss, mut yy) = (0f64, 0f64, 0f64);
    for s in 0..samples {
        let idx = (s * stride + s / m.max(1)) % total;
        let (t, i) = (idx / m, idx % m);
        w.rows_into(i, &mut row);
        let xt = &x[t * k..(t + 1) * k];
        let q: f64 = xt
            .iter()
            .zip(&row)
            .map(|(&a, &b)| {
                let p = a as f64 * b as f64;
                p * p
            })
            .sum::<f64>()
            .sqrt();
        let yv = y[idx].abs() as f64;
        aa += (c * q + yv).powi(2);
        ss += (c * q).powi(2);
        yy += yv * yv;
    }
    if yy == 0.0 {
        return (1.0, 0.0);
    }
    ((aa / yy).sqrt(), (ss / yy).sqrt())
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A replayed projection `y` of `x [n, k]` through `w` (`y` = `x · wᵀ`, plus a bias where the
/// family has one), its rho from [`linear_rho`] with the products weighted by `c_in`.
fn projected(x: &[f32], n: usize, w: &Mat, y: Vec<f32>, c_in: f64) -> Replayed {
    let (rho, rho_sum) = linear_rho(x, n, w, &y, c_in);
    Replayed {
        out: y,
        rho,
        rho_sum,
        rho_heads: Vec::new(),
        rows: None,
        reduction: w.cols,
    }
}

/// The heads and weight name of a GQA q, k or v projection.
fn qkv_weight(site: Site, nh: usize, nkv: usize) -> (usize, &'static str) {
    match site {
        Site::Q => (nh, "attn_q"),
        Site::K => (nkv, "attn_k"),
        _ => (nkv, "attn_v"),
    }
}

/// NeoX RoPE on the first `rope_dim` values of every head of `r`'s token rows (`width` values
/// each, token `t` at `position(t)`); RoPE keeps the norm and rounds once: rho + 1.
fn rope_neox_rows(
    r: &mut Replayed,
    width: usize,
    hd: usize,
    position: &dyn Fn(usize) -> usize,
    rope_dim: usize,
    base: f32,
) {
    for (t, row) in r.out.chunks_mut(width).enumerate() {
        ops::rope_neox(row, hd, position(t), rope_dim, base);
    }
    r.rho += 1.0;
}

/// rho of an elementwise sum y = a + b: a = √(a² + b²) + |y|.
fn add_rho(a: &[f32], b: &[f32], y: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for ((&x, &p), &v) in a.iter().zip(b).zip(y) {
        let (x, p, v) = (x as f64, p as f64, v as f64);
        num += ((x * x + p * p).sqrt() + v.abs()).powi(2);
        den += v * v;
    }
    if den == 0.0 {
        1.0
    } else {
        (num / den).sqrt()
    }
}

/// Per-head rho of causal attention: for output element o = Σₛ pₛvₛ, the noise scale is
/// a = √(Σₛ (pₛvₛ)²) plus |o|: a rounding of pₛ (or of vₛ on its way in) moves the term by
/// u·pₛvₛ, and the output is rounded once. Scores and the softmax are taken to be held wider
/// (as fused attention kernels and PyTorch's bf16 attention do; a score rounded to bf16 would
/// add u·|sₛ|·pₛvₛ, which on the HF bf16 SmolLM2 dumps over-predicted the healthy error 14×):
/// an engine that rounds them takes a `--baseline`.
#[allow(clippy::too_many_arguments)]
fn attention_rho(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    n: usize,
    n_heads: usize,
    n_kv_heads: usize,
    dk: usize,
    dv: usize,
    scale: f64,
) -> (f64, Vec<f64>) {
    let group = (n_heads / n_kv_heads.max(1)).max(1);
    let mut num = vec![0f64; n_heads];
    let mut den = vec![0f64; n_heads];
    let mut scores = vec![0f64; n];
    let mut acc = vec![0f64; dv];
    for t in 0..n {
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[(t * n_heads + h) * dk..(t * n_heads + h + 1) * dk];
            for (s, score) in scores[..=t].iter_mut().enumerate() {
                let kh = &k[(s * n_kv_heads + kvh) * dk..(s * n_kv_heads + kvh + 1) * dk];
                *score = ops::dot64(qh, kh) * scale;
            }
            ops::softmax(&mut scores[..=t]);
            acc.iter_mut().for_each(|a| *a = 0.0);
            for s in 0..=t {
                let vh = &v[(s * n_kv_heads + kvh) * dv..(s * n_kv_heads + kvh + 1) * dv];
                let wgt = scores[s];
                for (a, &x) in acc.iter_mut().zip(vh) {
                    let p = wgt * x as f64;
                    *a += p * p;
                }
            }
            let o = &out[(t * n_heads + h) * dv..(t * n_heads + h + 1) * dv];
            for (a, &y) in acc.iter().zip(o) {
                let y = y as f64;
                num[h] += (a.sqrt() + y.abs()).powi(2);
                den[h] += y * y;
            }
        }
    }
    let ratio = |a: f64, b: f64| if b == 0.0 { 1.0 } else { (a / b).sqrt() };
    let heads = num.iter().zip(&den).map(|(&a, &b)| ratio(a, b)).collect();
    (ratio(num.iter().sum(), den.iter().sum()), heads)
}

impl Reference<'_> {
    /// The reference op that produces `key` (unranked), computed from `inputs` over `n` tokens.
    /// `Ok(None)` when the op is not replayable here or an input is missing.
    pub fn replay(&self, key: &TapKey, inputs: &Inputs, n: usize) -> Result<Option<Vec<f32>>, ForwardError> {
        Ok(self.replay_local(key, inputs, n)?.map(|r| r.out))
    }

    /// [`Reference::replay`] with the op's noise scale on those inputs. The sites: the embedding
    /// (no float inputs: the reference's own lookup), the norms, q/k (projection and RoPE) and v,
    /// attention, o_proj, the residual adds, the dense FFN's gate/up and its output (from the
    /// candidate's gate and up when captured, else the whole block from ffn_norm), the MoE
    /// router logits, the expert choice and the MoE mix made from them, the output norm and the
    /// logits; for MLA also q_a, q, the latent, the shared rope key and the per-head k/v.
    pub fn replay_local(&self, key: &TapKey, inputs: &Inputs, n: usize) -> Result<Option<Replayed>, ForwardError> {
        self.replay_inner(key, inputs, inputs, n, None)
    }

    /// [`Reference::replay_local`] on the token rows `rows` (ascending, below `n`) only: each
    /// input is cut to those rows, RoPE takes their positions, and attention reads every key and
    /// value row before them. The result's `rows` says which rows `out` holds: all of them where
    /// the op cannot be replayed on a subset here (the MLA families' attention-side ops), or
    /// where `rows` covers every row.
    pub fn replay_rows(
        &self,
        key: &TapKey,
        inputs: &Inputs,
        n: usize,
        rows: &[usize],
    ) -> Result<Option<Replayed>, ForwardError> {
        let subset = rows.len() < n
            && !matches!(key.site, Site::KvCacheK | Site::KvCacheV)
            && rows.windows(2).all(|w| w[0] < w[1])
            && rows.last().is_some_and(|&t| t < n)
            && (row_local(key.site) || self.config.arch == Arch::Llama || qwen_block(self.config.arch));
        if !subset {
            return self.replay_local(key, inputs, n);
        }
        let sub = |k: &TapKey| inputs(k).map(|v| select_rows(&v, n, rows));
        let mut r = self.replay_inner(key, &sub, inputs, rows.len(), Some(rows))?;
        if let Some(r) = r.as_mut() {
            r.rows = Some(rows.to_vec());
        }
        Ok(r)
    }

    /// The replay over `n` rows of `inputs` (the rows at positions `pos`, or 0..n), with `all`
    /// giving every row (the keys and values attention reads).
    fn replay_inner(
        &self,
        key: &TapKey,
        inputs: &Inputs,
        all: &Inputs,
        n: usize,
        pos: Option<&[usize]>,
    ) -> Result<Option<Replayed>, ForwardError> {
        let position = |t: usize| pos.map_or(t, |p| p[t]);
        let c = &self.config;
        let d = c.d_model;
        let Some(l) = key.layer.map(|l| l as usize) else {
            let gemma = matches!(c.arch, Arch::Gemma2 | Arch::Gemma3);
            if !llama_or_mla(c.arch) && !qwen_block(c.arch) && c.arch != Arch::GptOss && !gemma {
                return Ok(None);
            }
            // Gemma's final soft-cap, on the candidate's own uncapped logits: elementwise, an
            // input error passes at most as is (tanh' ≤ 1), and the output is rounded once.
            if let (Site::Logits, Some(cap)) = (key.site, c.family.final_softcap) {
                return Ok(inputs(&TapKey::global(Site::LogitsPreCap)).map(|z| {
                    let capped = z.iter().map(|&v| ops::softcap(v as f64, cap as f64) as f32);
                    Replayed::plain(capped.collect(), 2.0)
                }));
            }
            return Ok(match key.site {
                Site::OutputNorm => match inputs(&TapKey::layer(c.n_layers - 1, Site::ResidOut)) {
                    Some(x) => Some(Replayed::plain(
                        ops::rms_norm(&x, d, &self.vector("output_norm.weight", d)?, c.rms_eps),
                        2.0,
                    )),
                    None => None,
                },
                Site::Logits | Site::LogitsPreCap => match inputs(&TapKey::global(Site::OutputNorm)) {
                    Some(h) if h.len() == n * d => {
                        let name = if c.tied_embeddings {
                            "token_embd.weight"
                        } else {
                            "output.weight"
                        };
                        let t = self.tensor(name)?;
                        if t.ne.len() != 2 || t.ne[0] as usize != d || (t.ne[1] as usize) < c.vocab {
                            return Ok(None);
                        }
                        let w = self.stored_rows(t, 0, c.vocab)?;
                        let y = linear(&h, n, &w);
                        let (rho, rho_sum) = linear_rho(&h, n, &w, &y, 1.0);
                        Some(Replayed {
                            out: y,
                            rho,
                            rho_sum,
                            rho_heads: Vec::new(),
                            rows: None,
                            reduction: w.cols,
                        })
                    }
                    _ => None,
                },
                _ => None,
            });
        };
        // The GQA/MoE families share only the residual adds and the attention norm with the
        // llama/MLA ops below (their FFN norm, post-norms, biases and RoPE differ).
        let gemma = matches!(c.arch, Arch::Gemma2 | Arch::Gemma3);
        let gpt_oss = c.arch == Arch::GptOss;
        if !llama_or_mla(c.arch)
            && !qwen_block(c.arch)
            && !gemma
            && !gpt_oss
            && !matches!(key.site, Site::AttnNorm | Site::ResidAttn | Site::ResidOut)
        {
            return Ok(None);
        }
        let at = |s: Site| inputs(&TapKey::layer(l, s));
        let resid_in = || {
            if l == 0 {
                inputs(&TapKey::global(Site::Embed))
            } else {
                inputs(&TapKey::layer(l - 1, Site::ResidOut))
            }
        };
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let lin = |x: &[f32], w: &Mat, c_in: f64| projected(x, n, w, linear(x, n, w), c_in);
        if matches!(key.site, Site::KvCacheK | Site::KvCacheV) {
            // A correct cache holds, at each decode step, the k/v rows of every position so
            // far: the candidate's cache is judged against its own k/v (a copy: rho 1).
            let src = if key.site == Site::KvCacheK { Site::K } else { Site::V };
            let width = c.n_kv_heads * c.head_dim;
            return Ok(match (c.mla.is_none(), all(&TapKey::layer(l, src)), all(key)) {
                (true, Some(x), Some(cached)) if x.len() == n * width && width > 0 => {
                    crate::tap::cache_steps(cached.len() / width, n)
                        .map(|d| Replayed::plain(crate::tap::cache_rows(&x, n, n - d), 1.0))
                }
                _ => None,
            });
        }
        let norm = match key.site {
            Site::AttnNorm => resid_in().map(|x| (x, "attn_norm")),
            // glm4moe and gpt-oss store their pre-FFN norm as post_attention_norm.
            Site::FfnNorm if matches!(c.arch, Arch::Glm4Moe | Arch::GptOss) => {
                at(Site::ResidAttn).map(|x| (x, "post_attention_norm"))
            }
            Site::FfnNorm => at(Site::ResidAttn).map(|x| (x, "ffn_norm")),
            _ => None,
        };
        if let Some((x, norm)) = norm {
            // RMSNorm is well conditioned (its output's relative error is its input's); a
            // candidate rounds once after normalizing and once after the weight: rho 2.
            return Ok(Some(Replayed::plain(
                ops::rms_norm(&x, d, &self.vector(&name(norm), d)?, c.rms_eps),
                2.0,
            )));
        }
        if gemma
            && matches!(
                key.site,
                Site::Q | Site::K | Site::V | Site::AttnOut | Site::AttnProj | Site::FfnOut
            )
        {
            return self.replay_gemma(key.site, l, &at, n, &position);
        }
        if gpt_oss && !matches!(key.site, Site::ResidAttn | Site::ResidOut) {
            return self.replay_gpt_oss(key.site, l, &at, n, &position);
        }
        let llama = c.arch == Arch::Llama;
        let qwen = qwen_block(c.arch);
        let (hd, nh, nkv) = (c.head_dim, c.n_heads, c.n_kv_heads);
        // A run with decode steps: the K/V cache rows each step's attention read.
        let cache = (key.site == Site::AttnOut)
            .then(|| {
                Some((
                    all(&TapKey::layer(l, Site::KvCacheK))?,
                    all(&TapKey::layer(l, Site::KvCacheV))?,
                ))
            })
            .flatten();
        Ok(match key.site {
            Site::ResidAttn => match (resid_in(), at(Site::AttnProj)) {
                (Some(x), Some(p)) if x.len() == p.len() => {
                    let y = ops::add(&x, &p);
                    let rho = add_rho(&x, &p, &y);
                    Some(Replayed::plain(y, rho))
                }
                _ => None,
            },
            Site::ResidOut => match (at(Site::ResidAttn), at(Site::FfnOut)) {
                (Some(x), Some(f)) if x.len() == f.len() => {
                    let y = ops::add(&x, &f);
                    let rho = add_rho(&x, &f, &y);
                    Some(Replayed::plain(y, rho))
                }
                _ => None,
            },
            Site::AttnProj => match at(Site::AttnOut) {
                Some(a) if a.len() % n == 0 => {
                    let width = a.len() / n;
                    Some(lin(&a, &self.matrix(&name("attn_output"), d, width)?, 1.0))
                }
                _ => None,
            },
            Site::Q | Site::K if llama => match at(Site::AttnNorm) {
                Some(h) if h.len() == n * d => {
                    let (rows, wname) = qkv_weight(key.site, nh, nkv);
                    let w = self.matrix(&name(wname), rows * hd, d)?;
                    let mut r = lin(&h, &w, 1.0);
                    let freq_factors = if c.rope_scaling.freq_factors {
                        Some(self.vector("rope_freqs.weight", c.rope_dim / 2)?)
                    } else {
                        None
                    };
                    let divisor = c.rope_scaling.linear_factor.map_or(1.0, |f| f as f64);
                    for (t, row) in r.out.chunks_mut(rows * hd).enumerate() {
                        ops::rope_norm_scaled(
                            row,
                            hd,
                            0,
                            position(t),
                            c.rope_dim,
                            c.rope_base,
                            divisor,
                            freq_factors.as_deref(),
                        );
                    }
                    // RoPE keeps the norm and adds one rounding (of its output; the angle table's
                    // rounding is of the same order).
                    r.rho += 1.0;
                    Some(r)
                }
                _ => None,
            },
            // The DSA indexer's scores on the candidate's attn_norm and q_a (dsa.rs), with the
            // noise scale of fp8 scoring.
            Site::IndexerScore
                if c.indexer
                    .as_ref()
                    .is_some_and(|ix| ix.full.get(l).copied().unwrap_or(true)) =>
            {
                match (
                    at(Site::AttnNorm),
                    at(Site::QA),
                    c.mla.as_ref().and_then(|m| m.q_lora_rank),
                ) {
                    (Some(x), Some(qa), Some(ql)) if x.len() == n * d && qa.len() == n * ql => {
                        let (out, rho) = super::dsa::replay_scores(self, l, &x, &qa, n)?;
                        Some(Replayed::plain(out, rho))
                    }
                    _ => None,
                }
            }
            // The qwen GQA block (qwen2/3, qwen3moe, glm4moe; see `super::qwen`): q/k/v with
            // their biases where the file has them, per-head q/k RMSNorm (qwen3, qwen3moe), then
            // NeoX RoPE on the first rope_dim values of each head.
            Site::Q | Site::K | Site::V if qwen => match at(Site::AttnNorm) {
                Some(h) if h.len() == n * d => {
                    let (heads, wname) = qkv_weight(key.site, nh, nkv);
                    let mut r = lin(&h, &self.matrix(&name(wname), heads * hd, d)?, 1.0);
                    super::qwen::add_bias(self, &format!("blk.{l}.{wname}.bias"), &mut r.out, heads * hd)?;
                    if key.site != Site::V {
                        let norm = format!("{wname}_norm");
                        r.out = super::qwen::head_norm(self, &name(&norm), std::mem::take(&mut r.out), hd)?;
                        if self.file.tensor(&name(&norm)).is_some() {
                            // The head norm rounds once more (its input's error passes at most
                            // as is, as RMSNorm's does).
                            r.rho += 1.0;
                        }
                        rope_neox_rows(&mut r, heads * hd, hd, &position, c.rope_dim, c.rope_base);
                    }
                    Some(r)
                }
                _ => None,
            },
            Site::QA if !llama => match (at(Site::AttnNorm), c.mla.as_ref().and_then(|m| m.q_lora_rank)) {
                (Some(h), Some(ql)) if h.len() == n * d => Some(lin(&h, &self.matrix(&name("attn_q_a"), ql, d)?, 1.0)),
                _ => None,
            },
            // MLA queries: from the candidate's q_a (normed, then q_b) or attn_norm, then RoPE on
            // each head's rope part.
            Site::Q if !llama => {
                let Some(m) = c.mla.as_ref() else { return Ok(None) };
                let dq = m.qk_nope + m.qk_rope;
                let mut r = match (m.q_lora_rank, at(Site::QA), at(Site::AttnNorm)) {
                    (Some(ql), Some(qa), _) if qa.len() == n * ql => {
                        let qa = ops::rms_norm(&qa, ql, &self.vector(&name("attn_q_a_norm"), ql)?, c.rms_eps);
                        let mut r = lin(&qa, &self.matrix(&name("attn_q_b"), nh * dq, ql)?, 1.0);
                        // The norm inside rounds once more.
                        r.rho += 1.0;
                        r
                    }
                    (None, _, Some(h)) if h.len() == n * d => lin(&h, &self.matrix(&name("attn_q"), nh * dq, d)?, 1.0),
                    _ => return Ok(None),
                };
                for (t, q_t) in r.out.chunks_mut(nh * dq).enumerate() {
                    super::yarn::mla_rope(c, q_t, dq, m.qk_nope, t, m.qk_rope, false);
                }
                r.rho += 1.0;
                Some(r)
            }
            // MLA latent (normed) and shared rope key, from attn_norm through kv_a.
            Site::KvLatent | Site::KPe if !llama => match (at(Site::AttnNorm), c.mla.as_ref()) {
                (Some(h), Some(m)) if h.len() == n * d => {
                    let (kvl, rope) = (m.kv_lora_rank, m.qk_rope);
                    let mut r = lin(&h, &self.matrix(&name("attn_kv_a_mqa"), kvl + rope, d)?, 1.0);
                    let mut latent = Vec::with_capacity(n * kvl);
                    let mut k_pe = Vec::with_capacity(n * rope);
                    for (t, row) in r.out.chunks(kvl + rope).enumerate() {
                        latent.extend_from_slice(&row[..kvl]);
                        let mut pe = row[kvl..].to_vec();
                        super::yarn::mla_rope(c, &mut pe, rope, 0, t, rope, false);
                        k_pe.extend(pe);
                    }
                    r.out = if key.site == Site::KvLatent {
                        ops::rms_norm(&latent, kvl, &self.vector(&name("attn_kv_a_norm"), kvl)?, c.rms_eps)
                    } else {
                        k_pe
                    };
                    r.rho += 1.0;
                    Some(r)
                }
                _ => None,
            },
            // MLA per-head keys (nope part) and values from the candidate's latent through kv_b.
            Site::K | Site::V if !llama => match (at(Site::KvLatent), c.mla.as_ref()) {
                (Some(latent), Some(m)) if latent.len() == n * m.kv_lora_rank => {
                    let (nope, dv, kvl) = (m.qk_nope, m.v_head_dim, m.kv_lora_rank);
                    let k_b = self.load(&name("attn_k_b"), &[nope, kvl, nh])?;
                    let v_b = self.load(&name("attn_v_b"), &[kvl, dv, nh])?;
                    let kv_b = deepseek2::reassemble_kv_b(&k_b, &v_b, nh, nope, dv, kvl);
                    let mut r = lin(&latent, &kv_b, 1.0);
                    let (lo, width) = if key.site == Site::K { (0, nope) } else { (nope, dv) };
                    r.out = r
                        .out
                        .chunks(nope + dv)
                        .flat_map(|head| head[lo..lo + width].to_vec())
                        .collect();
                    Some(r)
                }
                _ => None,
            },
            Site::V if llama => match at(Site::AttnNorm) {
                Some(h) if h.len() == n * d => Some(lin(&h, &self.matrix(&name("attn_v"), nkv * hd, d)?, 1.0)),
                _ => None,
            },
            Site::FfnGate | Site::FfnUp if !c.is_moe_layer(l) => match at(Site::FfnNorm) {
                Some(h) if h.len() == n * d => {
                    let wname = if key.site == Site::FfnGate {
                        "ffn_gate"
                    } else {
                        "ffn_up"
                    };
                    Some(lin(&h, &self.matrix(&name(wname), c.ffn_dim, d)?, 1.0))
                }
                _ => None,
            },
            Site::MoeLogits if c.is_moe_layer(l) => match (at(Site::FfnNorm), c.moe.as_ref()) {
                (Some(h), Some(m)) if h.len() == n * d => {
                    Some(lin(&h, &self.matrix(&name("ffn_gate_inp"), m.n_experts, d)?, 1.0))
                }
                _ => None,
            },
            // The expert choice from the candidate's own router logits: a flip that those
            // logits (a near-tie moved by rounding) explain is not a fault; exact (rho 0).
            Site::MoeTopk if c.is_moe_layer(l) => match (at(Site::MoeLogits), c.moe.as_ref()) {
                (Some(z), Some(m)) if m.n_experts > 0 && z.len() == n * m.n_experts => {
                    let bias_name = format!("blk.{l}.exp_probs_b.bias");
                    let bias = match self.file.tensor(&bias_name) {
                        Some(_) => Some(self.load(&bias_name, &[m.n_experts])?),
                        None => None,
                    };
                    let out = z
                        .chunks(m.n_experts)
                        .flat_map(|zt| deepseek2::route(zt, m, bias.as_deref()).experts)
                        .map(|e| e as f32)
                        .collect();
                    Some(Replayed::plain(out, 0.0))
                }
                _ => None,
            },
            // The MoE mix on the candidate's ffn_norm, routed by the candidate's own router
            // logits (so a near-tie flipped by rounding is followed, not flagged). rho 3: a
            // chain of three matmuls and a weighted sum, each rounding once.
            Site::FfnOut if c.is_moe_layer(l) => match (at(Site::FfnNorm), at(Site::MoeLogits), c.moe.as_ref()) {
                (Some(h), Some(z), Some(m)) if h.len() == n * d && m.n_experts > 0 && z.len() == n * m.n_experts => {
                    let bias_name = format!("blk.{l}.exp_probs_b.bias");
                    let bias = match self.file.tensor(&bias_name) {
                        Some(_) => Some(self.load(&bias_name, &[m.n_experts])?),
                        None => None,
                    };
                    let routes: Vec<deepseek2::Routing> = z
                        .chunks(m.n_experts)
                        .map(|zt| deepseek2::route(zt, m, bias.as_deref()))
                        .collect();
                    Some(Replayed::plain(deepseek2::moe_mix(self, l, m, &h, n, &routes)?, 3.0))
                }
                _ => None,
            },
            Site::FfnOut if !c.is_moe_layer(l) => {
                let f = c.ffn_dim;
                let down = self.matrix(&name("ffn_down"), d, f)?;
                match (at(Site::FfnGate), at(Site::FfnUp), at(Site::FfnNorm)) {
                    // From the candidate's own gate and up: silu and the product each round once
                    // more on top of the stored weight's rounding.
                    (Some(g), Some(u), _) if g.len() == n * f && u.len() == n * f => {
                        Some(lin(&ops::swiglu(&g, &u), &down, 3f64.sqrt()))
                    }
                    (_, _, Some(h)) if h.len() == n * d => {
                        let gate = self.matrix(&name("ffn_gate"), f, d)?;
                        let up = self.matrix(&name("ffn_up"), f, d)?;
                        let (_, _, out) = swiglu_ffn(&h, n, &gate, &up, &down);
                        // The whole block: gate and up's own roundings pass through down too.
                        let hh = {
                            let g = linear(&h, n, &gate);
                            let u = linear(&h, n, &up);
                            ops::swiglu(&g, &u)
                        };
                        let (rho, rho_sum) = linear_rho(&hh, n, &down, &out, 2.0);
                        Some(Replayed {
                            out,
                            rho,
                            rho_sum,
                            rho_heads: Vec::new(),
                            rows: None,
                            reduction: down.cols,
                        })
                    }
                    _ => None,
                }
            }
            Site::AttnOut if pos.is_some() || cache.is_some() => {
                // Sampled query rows: every key and value row up to the last one; or every row
                // of a run with decode steps, each reading the cache its step read.
                let every: Vec<usize> = (0..n).collect();
                let (Some(p), Some(q)) = (pos.or(cache.as_ref().map(|_| every.as_slice())), at(Site::Q)) else {
                    return Ok(None);
                };
                let last = p.last().map_or(0, |&t| t + 1);
                let full = |s: Site| all(&TapKey::layer(l, s)).filter(|x| x.len() >= last * nkv * hd);
                match (c.arch, full(Site::K), full(Site::V)) {
                    (arch, Some(k), Some(v)) if (arch == Arch::Llama || qwen) && q.len() == n * nh * hd => {
                        let scale = 1.0 / (hd as f64).sqrt();
                        let n_all = k.len() / (nkv * hd);
                        let (out, rho, rho_heads) = match decode_kv(&k, &v, cache.as_ref(), n_all, nkv * hd) {
                            Some(kv) => attention_rows(&q, kv, p, nh, nkv, hd, hd, scale),
                            None => attention_rows(&q, |_| (&k[..], &v[..]), p, nh, nkv, hd, hd, scale),
                        };
                        Some(Replayed {
                            out,
                            rho,
                            rho_sum: 0.0,
                            rho_heads,
                            rows: None,
                            reduction: 0,
                        })
                    }
                    _ => None,
                }
            }
            Site::AttnOut => match (c.arch, at(Site::Q), at(Site::K), at(Site::V)) {
                (arch, Some(q), Some(k), Some(v))
                    if (arch == Arch::Llama || qwen)
                        && q.len() == n * nh * hd
                        && k.len() == n * nkv * hd
                        && v.len() == n * nkv * hd =>
                {
                    let scale = 1.0 / (hd as f64).sqrt();
                    let out = ops::causal_attention(&q, &k, &v, n, nh, nkv, hd, hd, scale);
                    let (rho, rho_heads) = attention_rho(&q, &k, &v, &out, n, nh, nkv, hd, hd, scale);
                    Some(Replayed {
                        out,
                        rho,
                        rho_sum: 0.0,
                        rho_heads,
                        rows: None,
                        reduction: 0,
                    })
                }
                (Arch::Deepseek2, Some(q), Some(k_nope), Some(v)) => at(Site::KPe)
                    .map(|k_pe| Replayed::plain(deepseek2::mla_attention(c, &q, &k_nope, &k_pe, &v, n, None), 3.0)),
                // DSA: the attention is replayed on the recorded selection (the candidate's own
                // indices), so it is judged apart from the indexer.
                (Arch::Deepseek32 | Arch::GlmDsa, Some(q), Some(k_nope), Some(v)) => {
                    match (at(Site::KPe), at(Site::IndexerTopk)) {
                        (Some(k_pe), Some(sel)) => super::dsa::selection_from_tap(&sel, n).map(|keys| {
                            Replayed::plain(deepseek2::mla_attention(c, &q, &k_nope, &k_pe, &v, n, Some(&keys)), 3.0)
                        }),
                        _ => None,
                    }
                }
                _ => None,
            },
            _ => None,
        })
    }
}

impl Reference<'_> {
    /// The gemma2/gemma3 ops that differ from llama's (see `super::gemma`): q/k/v with gemma3's
    /// q/k norms and NeoX RoPE at the layer's base, attention with the family's scale, sliding
    /// window and score soft-cap, and o_proj / the GeGLU FFN's down each followed by its post-norm
    /// (ffn_gate and ffn_up are plain projections, replayed as llama's). The attention's rho is
    /// taken as 3 (as MLA's: the mask and soft-cap are not in [`attention_rho`]); a post-norm
    /// adds 2 (it passes its input's relative error and rounds twice).
    fn replay_gemma(
        &self,
        site: Site,
        l: usize,
        at: &dyn Fn(Site) -> Option<Vec<f32>>,
        n: usize,
        position: &dyn Fn(usize) -> usize,
    ) -> Result<Option<Replayed>, ForwardError> {
        let c = &self.config;
        let fam = &c.family;
        let (d, hd, nh, nkv, f) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_dim);
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let lin = |x: &[f32], w: &Mat, c_in: f64| projected(x, n, w, linear(x, n, w), c_in);
        let post_norm = |mut r: Replayed, norm: &str| -> Result<Replayed, ForwardError> {
            r.out = ops::rms_norm(&r.out, d, &self.vector(&name(norm), d)?, c.rms_eps);
            r.rho += 2.0;
            Ok(r)
        };
        let swa = fam.is_swa(l);
        Ok(match site {
            Site::Q | Site::K | Site::V => match at(Site::AttnNorm) {
                Some(h) if h.len() == n * d => {
                    let (heads, wname) = qkv_weight(site, nh, nkv);
                    let mut r = lin(&h, &self.matrix(&name(wname), heads * hd, d)?, 1.0);
                    if site != Site::V {
                        let norm = name(&format!("{wname}_norm"));
                        // gemma3 requires its q/k norms (as the forward does); gemma2 has none.
                        if c.arch == Arch::Gemma3 || self.file.tensor(&norm).is_some() {
                            r.out = ops::rms_norm(&r.out, hd, &self.vector(&norm, hd)?, c.rms_eps);
                            r.rho += 1.0;
                        }
                        let base = if swa { fam.rope_base_swa } else { c.rope_base };
                        rope_neox_rows(&mut r, heads * hd, hd, position, c.rope_dim, base);
                    }
                    Some(r)
                }
                _ => None,
            },
            Site::AttnOut => match (at(Site::Q), at(Site::K), at(Site::V)) {
                (Some(q), Some(k), Some(v))
                    if q.len() == n * nh * hd && k.len() == n * nkv * hd && v.len() == n * nkv * hd =>
                {
                    let mask = ops::AttnMask {
                        window: if swa { fam.sliding_window } else { None },
                        softcap: fam.attn_softcap.map(|s| s as f64),
                        sinks: None,
                    };
                    let scale = fam.attn_scale.unwrap_or(1.0 / (hd as f64).sqrt());
                    let out = ops::causal_attention_masked(&q, &k, &v, n, nh, nkv, hd, hd, scale, mask);
                    Some(Replayed::plain(out, 3.0))
                }
                _ => None,
            },
            Site::AttnProj => match at(Site::AttnOut) {
                Some(a) if a.len() == n * nh * hd => Some(post_norm(
                    lin(&a, &self.matrix(&name("attn_output"), d, nh * hd)?, 1.0),
                    "post_attention_norm",
                )?),
                _ => None,
            },
            Site::FfnOut => match (at(Site::FfnGate), at(Site::FfnUp)) {
                (Some(g), Some(u)) if g.len() == n * f && u.len() == n * f => Some(post_norm(
                    lin(&ops::geglu(&g, &u), &self.matrix(&name("ffn_down"), d, f)?, 3f64.sqrt()),
                    "post_ffw_norm",
                )?),
                _ => None,
            },
            _ => None,
        })
    }
}

impl Reference<'_> {
    /// The gpt-oss ops (see `super::gpt_oss`): q/k/v with their biases and NeoX RoPE at the
    /// layer's base, attention with the sinks and the sliding window (rho 3, as gemma's), o_proj
    /// with its bias, the router logits with theirs and the expert choice from the candidate's own
    /// logits (exact). The expert mix (`ffn_out`) keeps the end-to-end rule.
    fn replay_gpt_oss(
        &self,
        site: Site,
        l: usize,
        at: &dyn Fn(Site) -> Option<Vec<f32>>,
        n: usize,
        position: &dyn Fn(usize) -> usize,
    ) -> Result<Option<Replayed>, ForwardError> {
        use super::gpt_oss::{add_rows, route};
        let c = &self.config;
        let fam = &c.family;
        let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let biased = |x: &[f32], w: &Mat, b: &str| -> Result<Replayed, ForwardError> {
            let y = add_rows(linear(x, n, w), &self.vector(&format!("blk.{l}.{b}.bias"), w.rows)?);
            Ok(projected(x, n, w, y, 1.0))
        };
        let swa = fam.is_swa(l);
        Ok(match site {
            Site::Q | Site::K | Site::V => match at(Site::AttnNorm) {
                Some(h) if h.len() == n * d => {
                    let (heads, wname) = qkv_weight(site, nh, nkv);
                    let mut r = biased(&h, &self.matrix(&name(wname), heads * hd, d)?, wname)?;
                    if site != Site::V {
                        let base = if swa { fam.rope_base_swa } else { c.rope_base };
                        rope_neox_rows(&mut r, heads * hd, hd, position, c.rope_dim, base);
                    }
                    Some(r)
                }
                _ => None,
            },
            Site::AttnOut => match (at(Site::Q), at(Site::K), at(Site::V)) {
                (Some(q), Some(k), Some(v))
                    if q.len() == n * nh * hd && k.len() == n * nkv * hd && v.len() == n * nkv * hd =>
                {
                    let sinks = self.vector(&name("attn_sinks"), nh)?;
                    let mask = ops::AttnMask {
                        window: if swa { fam.sliding_window } else { None },
                        softcap: None,
                        sinks: Some(&sinks),
                    };
                    let scale = 1.0 / (hd as f64).sqrt();
                    let out = ops::causal_attention_masked(&q, &k, &v, n, nh, nkv, hd, hd, scale, mask);
                    Some(Replayed::plain(out, 3.0))
                }
                _ => None,
            },
            // The sink's probability on the candidate's q and k (a softmax: rho as attention's).
            Site::AttnSink => match (at(Site::Q), at(Site::K)) {
                (Some(q), Some(k)) if q.len() == n * nh * hd && k.len() == n * nkv * hd => {
                    let sinks = self.vector(&name("attn_sinks"), nh)?;
                    let window = if swa { fam.sliding_window } else { None };
                    let mass = super::gpt_oss::sink_mass(&q, &k, n, nh, nkv, hd, window, &sinks);
                    Some(Replayed::plain(mass, 3.0))
                }
                _ => None,
            },
            Site::AttnProj => match at(Site::AttnOut) {
                Some(a) if a.len() == n * nh * hd => Some(biased(
                    &a,
                    &self.matrix(&name("attn_output"), d, nh * hd)?,
                    "attn_output",
                )?),
                _ => None,
            },
            Site::MoeLogits => match (at(Site::FfnNorm), c.moe.as_ref()) {
                (Some(h), Some(m)) if h.len() == n * d => Some(biased(
                    &h,
                    &self.matrix(&name("ffn_gate_inp"), m.n_experts, d)?,
                    "ffn_gate_inp",
                )?),
                _ => None,
            },
            Site::MoeTopk => match (at(Site::MoeLogits), c.moe.as_ref()) {
                (Some(z), Some(m)) if m.n_experts > 0 && z.len() == n * m.n_experts => {
                    let out = z
                        .chunks(m.n_experts)
                        .flat_map(|zt| route(zt, m.n_used).0)
                        .map(|e| e as f32)
                        .collect();
                    Some(Replayed::plain(out, 0.0))
                }
                _ => None,
            },
            _ => None,
        })
    }
}

/// The families whose ops the replay below implements beyond the norms and residual adds: llama
/// and the MLA ones (deepseek2, deepseek32, glm-dsa); see also [`qwen_block`].
fn llama_or_mla(arch: Arch) -> bool {
    arch == Arch::Llama || arch.is_mla()
}

/// The families built on the qwen GQA block (`super::qwen::gqa_block`), replayed with it: q/k/v
/// biases, q/k norms, NeoX RoPE (partial for glm4moe), dense or routed FFN with a shared expert.
fn qwen_block(arch: Arch) -> bool {
    matches!(arch, Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm4Moe)
}
