//! One glm4moe block (GLM-4.5 / 4.6), as HF's modeling_glm4_moe.py computes it: the qwen GQA
//! block ([`super::qwen::gqa_block`]) with q/k/v biases, partial NeoX rotary (the first
//! `rope.dimension_count` values of each head), optional q/k norms, and an FFN that is dense for
//! the `leading_dense_block_count` first layers, then sigmoid-routed experts (top-k chosen on
//! score + `exp_probs_b`, weighted by the scores, renormalised, times `expert_weights_scale`)
//! plus the shared expert. Its pre-FFN norm is stored as `post_attention_norm`.

use super::{ForwardError, Reference};
use crate::tap::Tap;

pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    super::qwen::gqa_block(r, l, x, n, tap, "post_attention_norm")
}
