//! MoE routing on the host: DeepSeek-V3's gating, bias, group-limited top-k and weights
//! ([`route`]). Below the backends: the CPU backend routes with it, a device backend falls back
//! to it where its kernel's limits are passed, and the model code reads the [`Route`]s.

use references::config::{Gating, MoeConfig};

/// One token's routing: chosen experts (in selection order) and their mixing weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// DeepSeek-V3 routing from router logits `[n, n_exp]`: gating scores, bias for the choice,
/// group-limited top-k (ties: lower index wins), weights from the unbiased scores, normalized if
/// configured, times `scale`.
pub fn route(logits: &[f32], n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route> {
    logits
        .chunks_exact(n_exp)
        .map(|lg| {
            let scores: Vec<f32> = match m.gating {
                Gating::Sigmoid => lg.iter().map(|&x| 1.0 / (1.0 + (-x).exp())).collect(),
                Gating::Softmax => {
                    let mut s = lg.to_vec();
                    crate::cpu_ops::softmax(&mut s);
                    s
                }
            };
            let mut choice: Vec<f32> = match bias {
                Some(b) => scores.iter().zip(b).map(|(s, b)| s + b).collect(),
                None => scores.clone(),
            };
            if m.n_groups > 1 && m.n_groups_used < m.n_groups {
                let gs = n_exp / m.n_groups;
                let group_scores: Vec<f32> = choice
                    .chunks_exact(gs)
                    .map(|g| {
                        let mut v = g.to_vec();
                        v.sort_by(|a, b| b.total_cmp(a));
                        v.iter().take(2).sum()
                    })
                    .collect();
                let kept = top_k(&group_scores, m.n_groups_used);
                for (g_idx, group) in choice.chunks_exact_mut(gs).enumerate() {
                    if !kept.contains(&g_idx) {
                        group.fill(f32::NEG_INFINITY);
                    }
                }
            }
            let experts = top_k(&choice, m.n_used);
            let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
            if m.weights_norm {
                let sum: f32 = weights.iter().sum();
                if sum > 0.0 {
                    weights.iter_mut().for_each(|w| *w /= sum);
                }
            }
            weights.iter_mut().for_each(|w| *w *= scale);
            Route { experts, weights }
        })
        .collect()
}

/// Indices of the k largest values, largest first; ties go to the lower index.
fn top_k(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| v[b].total_cmp(&v[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe_cfg(n_exp: usize, n_used: usize, groups: (usize, usize)) -> MoeConfig {
        MoeConfig {
            n_experts: n_exp,
            n_used,
            n_shared: 0,
            expert_ffn: 4,
            n_dense_lead: 0,
            weights_scale: 2.0,
            weights_norm: true,
            gating: Gating::Sigmoid,
            n_groups: groups.0,
            n_groups_used: groups.1,
        }
    }

    #[test]
    fn top_k_ties_go_to_the_lower_index() {
        assert_eq!(top_k(&[1.0, 3.0, 3.0, 2.0], 2), vec![1, 2]);
        assert_eq!(top_k(&[0.5, 0.5, 0.5], 1), vec![0]);
    }

    #[test]
    fn group_limited_routing_masks_other_groups() {
        // Groups {0,1}, {2,3}: group 1 has the best top-2 sum though expert 0 is the best single.
        let logits = [3.0, -3.0, 1.0, 1.0];
        let m = moe_cfg(4, 2, (2, 1));
        let r = &route(&logits, 4, &m, None, 2.0)[0];
        assert_eq!(r.experts, vec![2, 3]);
        assert!((r.weights.iter().sum::<f32>() - 2.0).abs() < 1e-6);
        let ungrouped = &route(&logits, 4, &moe_cfg(4, 2, (1, 1)), None, 1.0)[0];
        assert_eq!(ungrouped.experts, vec![0, 2]);
    }

    #[test]
    fn bias_moves_the_choice_but_not_the_weights() {
        let logits = [0.0, 0.1];
        let m = MoeConfig {
            weights_norm: false,
            ..moe_cfg(2, 1, (1, 1))
        };
        let r = &route(&logits, 2, &m, Some(&[0.5, 0.0]), 1.0)[0];
        assert_eq!(r.experts, vec![0]);
        assert!((r.weights[0] - 0.5).abs() < 1e-6);
    }
}
