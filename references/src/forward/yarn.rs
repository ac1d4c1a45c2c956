//! RoPE with YaRN frequencies ([`crate::config::YarnConfig`]): the same rotations as
//! `ops::rope_neox` / `ops::rope_norm`, but by per-pair inverse frequencies given explicitly
//! (HF's `_compute_yarn_parameters`) and with cos and sin multiplied by the attention factor, as
//! HF's rotary embeddings do.

/// NeoX halves: in each `head_dim` chunk, pair (i, i + n/2) rotates by pos·inv_freq[i], where
/// n = 2·inv_freq.len(); the result is scaled by `scale`.
pub fn rope_neox(row: &mut [f32], head_dim: usize, pos: usize, inv_freq: &[f64], scale: f64) {
    let half = inv_freq.len();
    let angles: Vec<(f64, f64)> = inv_freq.iter().map(|f| (pos as f64 * f).sin_cos()).collect();
    for head in row.chunks_mut(head_dim) {
        for (i, &(sin, cos)) in angles.iter().enumerate() {
            let (x0, x1) = (head[i] as f64, head[i + half] as f64);
            head[i] = (scale * (x0 * cos - x1 * sin)) as f32;
            head[i + half] = (scale * (x0 * sin + x1 * cos)) as f32;
        }
    }
}

/// NORM pairs (2i, 2i+1) at `offset` in each `head_dim` chunk, rotated by pos·inv_freq[i] and
/// scaled by `scale`.
pub fn rope_norm(row: &mut [f32], head_dim: usize, offset: usize, pos: usize, inv_freq: &[f64], scale: f64) {
    let angles: Vec<(f64, f64)> = inv_freq.iter().map(|f| (pos as f64 * f).sin_cos()).collect();
    let n_dims = 2 * inv_freq.len();
    for head in row.chunks_mut(head_dim) {
        for (pair, &(sin, cos)) in head[offset..offset + n_dims].chunks_exact_mut(2).zip(&angles) {
            let (x0, x1) = (pair[0] as f64, pair[1] as f64);
            pair[0] = (scale * (x0 * cos - x1 * sin)) as f32;
            pair[1] = (scale * (x0 * sin + x1 * cos)) as f32;
        }
    }
}

/// The MLA families' RoPE (deepseek2's q and k_pe, the DSA indexer's q and k): `ops::rope_norm`
/// (or NeoX halves when `neox`), by YaRN frequencies when the file declares YaRN (cos/sin
/// factor 1 there: see [`crate::config::YarnConfig::attention_factor`]).
#[allow(clippy::too_many_arguments)]
pub fn mla_rope(
    c: &crate::config::ModelConfig,
    row: &mut [f32],
    head_dim: usize,
    offset: usize,
    pos: usize,
    n_dims: usize,
    neox: bool,
) {
    match (&c.yarn, neox) {
        (Some(y), false) => rope_norm(
            row,
            head_dim,
            offset,
            pos,
            &y.inv_freq(c.rope_base as f64, n_dims),
            y.attention_factor(true),
        ),
        (Some(y), true) => {
            debug_assert_eq!(offset, 0, "NeoX indexer RoPE starts each head");
            rope_neox(
                row,
                head_dim,
                pos,
                &y.inv_freq(c.rope_base as f64, n_dims),
                y.attention_factor(true),
            )
        }
        (None, false) => super::ops::rope_norm(row, head_dim, offset, pos, n_dims, c.rope_base),
        (None, true) => super::ops::rope_neox(row, head_dim, pos, n_dims, c.rope_base),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::YarnConfig;

    fn yarn(truncate: bool) -> YarnConfig {
        YarnConfig {
            factor: 4.0,
            original_context: 64,
            log_multiplier: 0.0,
            beta_fast: 8.0,
            beta_slow: 1.0,
            attn_factor: None,
            truncate,
        }
    }

    #[test]
    fn plain_frequencies_and_unit_scale_are_ops_rope_neox() {
        let inv: Vec<f64> = (0..4).map(|i| 100f64.powf(-(2.0 * i as f64) / 8.0)).collect();
        let mut a: Vec<f32> = (0..16).map(|i| (i as f32 * 0.3).sin()).collect();
        let mut b = a.clone();
        rope_neox(&mut a, 8, 5, &inv, 1.0);
        crate::forward::ops::rope_neox(&mut b, 8, 5, 8, 100.0);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
    }

    /// Base 100, dim 16, factor 4, beta 8/1, original context 64: HF's correction dims are
    /// 16·ln(64/(β·2π))/(2·ln 100) = 0.4196 (β 8) and 4.0320 (β 1).
    #[test]
    fn the_ramp_interpolates_low_frequencies_and_keeps_high_ones() {
        let y = yarn(false);
        let f = y.inv_freq(100.0, 16);
        let extrap = |i: usize| 100f64.powf(-(2.0 * i as f64) / 16.0);
        let mix = |i: usize, r: f64| extrap(i) / 4.0 * r + extrap(i) * (1.0 - r);
        let (low, high) = (0.419_640_474_535_314_2, 4.032_000_422_503_088_5);
        // Pair 0 is below the ramp: extrapolated (unchanged); pairs 5.. above it: ÷ factor.
        assert!((f[0] - extrap(0)).abs() < 1e-12);
        assert!((f[5] - extrap(5) / 4.0).abs() < 1e-12 && (f[7] - extrap(7) / 4.0).abs() < 1e-12);
        // Pairs 1..=4 mix by (i − low)/(high − low).
        for i in 1..=4 {
            assert!(
                (f[i] - mix(i, (i as f64 - low) / (high - low))).abs() < 1e-9,
                "pair {i}"
            );
        }
        // Truncation rounds the bounds out to 0 and 5: pair 3's ramp is 3/5.
        let t = yarn(true).inv_freq(100.0, 16);
        assert!((t[3] - mix(3, 0.6)).abs() < 1e-12);
        assert!((y.attention_factor(false) - (1.0 + 0.1 * 4f64.ln())).abs() < 1e-12);
        assert_eq!(y.attention_factor(true), 1.0);
    }
}
