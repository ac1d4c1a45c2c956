//! Next-token distributions from logits: f64 log-softmax, entropy and top-k.

/// log-softmax of one row of logits, in f64.
pub fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
    let lse = max + logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
    logits.iter().map(|&x| x as f64 - lse).collect()
}

/// Entropy in nats of a distribution given as log-probabilities.
pub fn entropy(logp: &[f64]) -> f64 {
    -logp.iter().filter(|l| l.is_finite()).map(|&l| l.exp() * l).sum::<f64>()
}

/// The `k` most likely token ids with their log-probabilities, descending (ties: lower id first).
pub fn top_k(logp: &[f64], k: usize) -> Vec<(u32, f64)> {
    let mut idx: Vec<u32> = (0..logp.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| logp[*b as usize].total_cmp(&logp[*a as usize]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx.into_iter().map(|i| (i, logp[i as usize])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_has_entropy_ln_v() {
        let lp = log_softmax(&[0.5; 10]);
        assert!((entropy(&lp) - 10f64.ln()).abs() < 1e-12);
        assert!((lp.iter().map(|l| l.exp()).sum::<f64>() - 1.0).abs() < 1e-12);
    }

    #[test]
    fn top_k_sorts_descending() {
        let lp = log_softmax(&[0.0, 3.0, 1.0, 3.0, -1.0]);
        let top: Vec<u32> = top_k(&lp, 3).into_iter().map(|(i, _)| i).collect();
        assert_eq!(top, vec![1, 3, 2]);
    }
}
