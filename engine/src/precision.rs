//! The engine at production precision (`--compute-dtype bf16|f16`): what it rounds, where, and
//! how the CPU and CUDA backends do it with one piece of code, [`DtypeBackend`].
//!
//! # What a bf16/f16 engine computes, and what this one does
//!
//! Production engines at bf16 or f16 store weights and activations in the 16-bit type and run
//! GEMMs, norms and attention with f32 accumulation (tensor-core GEMMs accumulate in f32; norms,
//! softmax and RoPE compute in f32 from the 16-bit inputs), converting each op's result to the
//! 16-bit type when it is stored. Numerically that is: every op reads dtype-representable inputs,
//! computes in f32, and its output is rounded once to the dtype (round to nearest, ties to even).
//! This engine does exactly that:
//!
//! - **Weights.** Float tensors (GGUF F32, F16, BF16) are rounded to the dtype at load, norm
//!   weights and the MoE router included (what `model.to(bfloat16)` does). Two small tensors stay
//!   f32, as HF transformers and vLLM keep them: Llama 3.1's RoPE frequency factors and the
//!   DeepSeek router's score-correction bias (`exp_probs_b`). **Quantized weights (Q8_0, Q4_K,
//!   ...) keep their exact dequantized values**: production quantized kernels (llama.cpp's MMQ
//!   and MMVQ, Marlin-style dequant-GEMMs) multiply with the block's scale and quants exactly, in
//!   f32 or integer arithmetic, and never round the dequantized weight to bf16 first. An F16
//!   tensor at f16 (or BF16 at bf16) is already representable and keeps its blocks; at the other
//!   16-bit dtype it is stored rounded, as f32.
//! - **Activations.** Every op's output is rounded to the dtype: the embedding gather, each
//!   projection (q, k, v, o, gate, up, down, router, lm_head), RMSNorm, RoPE, SwiGLU, attention,
//!   the all-reduce's sum, the MoE mix after each expert's weighted add. So the KV cache (written
//!   from rounded k and v) and the logits are in the dtype too.
//! - **Residual stream: kept in the compute dtype**, as production engines keep it (HF
//!   transformers' hidden states at bf16; vLLM's fused add-RMSNorm stores the residual in the model
//!   dtype and normalizes the stored value): `x += attn_proj` is computed in f32 and rounded; the
//!   next RMSNorm reads the rounded x.
//! - **Inside an op, f32.** Dot products, the norm's mean square, softmax and the attention's
//!   P·V, the all-reduce's sum over ranks (as vLLM's custom all-reduce upcasts to f32 to add) and
//!   SwiGLU are computed in f32 from the rounded inputs. Flash-attention kernels also round the
//!   softmax probabilities P to the dtype before P·V; this engine keeps P in f32 (one rounding
//!   fewer; its effect is below the output's own rounding).
//!
//! # Emulated storage
//!
//! Buffers stay f32 containers ([`crate::backend::Buf`]) holding dtype-representable values: a
//! rounding pass ([`Backend::round_to`]: a host loop on the CPU, the `round_dtype` kernel of
//! `kernels/ops.cu` on CUDA) after each op gives the values a 16-bit store would, bit for bit
//! after widening. What it does not give is 16-bit memory traffic: timings at bf16/f16 are not
//! production timings (they are the f32 engine's plus one elementwise pass per op). The f32
//! engine is untouched: at [`ComputeDtype::F32`] no wrapper is made and no value is rounded.
//!
//! Fused backend paths that compute two ops in one launch (CUDA's q/k/v GEMV with RoPE and the
//! KV append in its store, the residual add fused with the next RMSNorm) would round once where
//! a production engine rounds twice; [`DtypeBackend`] runs their parts one by one (each rounded)
//! instead. Fusions with no stored intermediate (`linear_many`, `rope_qk`) keep their one launch.
//!
//! # The canary at bf16/f16
//!
//! A custom op's output buffer is filled with the canary before the op runs when a tap wants it.
//! The f32 canary's payload does not survive a 16-bit store, so at bf16/f16 the buffer holds the
//! dtype's own canary ([`ComputeDtype::canary`]: the f32 canary narrowed with its top payload bits
//! kept, bf16 `0x7FC1`, f16 `0x7E0E`), which [`ComputeDtype::round`] leaves bit for bit as it is (a NaN keeps its
//! top payload bits and is made quiet; the canary is already quiet and fits). The wrapper's
//! [`Backend::fill`] rounds the value it is given, so `fill(canary())` stores the dtype's canary,
//! and the rounding after the op keeps it where the op wrote nothing. `references::tap::is_canary`
//! recognises all three forms, so the harness needs no dtype to find an unwritten element.

use crate::backend::{Backend, BlockTrace, Buf, CommStats, StepGraph};
use crate::cpu_ops::{GqaShape, MlaShape, QkRope, RopeFreqs, RopeLayout, RopeStyle, WeightRef};
use crate::dsa::IndexShape;
use crate::moe_route::Route;
use crate::options::ComputeDtype;
#[cfg(test)]
use crate::options::{round_bf16, round_f16};
use references::config::MoeConfig;

/// A backend computing at a 16-bit dtype: each op runs on `inner` (in f32), then its outputs are
/// rounded to `dtype` on `inner` ([`Backend::round_to`]). Data movement (copies, gathers, KV
/// writes) moves values that are representable already and is passed through. See the module
/// documentation for the rules.
pub struct DtypeBackend {
    inner: Box<dyn Backend>,
    dtype: ComputeDtype,
}

impl DtypeBackend {
    /// `inner` at `dtype` (not f32: the f32 engine runs `inner` itself).
    pub fn new(inner: Box<dyn Backend>, dtype: ComputeDtype) -> DtypeBackend {
        debug_assert_ne!(dtype, ComputeDtype::F32, "the f32 engine needs no rounding");
        DtypeBackend { inner, dtype }
    }

    fn r(&self, b: &mut Buf) {
        self.inner.round_to(b, self.dtype);
    }
}

impl Backend for DtypeBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn describe(&self) -> String {
        format!(
            "{}; computing in {} (every op's output rounded to it, f32 accumulation)",
            self.inner.describe(),
            self.dtype
        )
    }
    fn alloc(&self, len: usize) -> Buf {
        self.inner.alloc(len)
    }
    fn zeros(&self, len: usize) -> Buf {
        self.inner.zeros(len)
    }
    fn parallel_ranks(&self) -> bool {
        self.inner.parallel_ranks()
    }
    fn upload(&self, data: &[f32]) -> Buf {
        let mut v = data.to_vec();
        self.dtype.round_slice(&mut v);
        self.inner.upload(&v)
    }
    fn download(&self, b: &Buf) -> Vec<f32> {
        self.inner.download(b)
    }
    fn download_into(&self, b: &Buf, out: &mut Vec<f32>) {
        self.inner.download_into(b, out)
    }
    fn fill(&self, b: &mut Buf, value: f32) {
        // The canary becomes the dtype's (a value the dtype stores), zeros stay zeros.
        self.inner.fill(b, self.dtype.round(value))
    }
    fn round_to(&self, b: &mut Buf, dtype: ComputeDtype) {
        self.inner.round_to(b, dtype)
    }
    fn copy(&self, src: &Buf, src_off: usize, dst: &mut Buf, dst_off: usize, len: usize) {
        self.inner.copy(src, src_off, dst, dst_off, len)
    }
    fn copy_cols(&self, src: &Buf, src_width: usize, col0: usize, n_cols: usize, dst: &mut Buf) {
        self.inner.copy_cols(src, src_width, col0, n_cols, dst)
    }
    fn add_assign(&self, x: &mut Buf, a: &Buf, f16_round: bool) {
        self.inner.add_assign(x, a, f16_round);
        self.r(x);
    }
    fn gather_rows(&self, x: &Buf, width: usize, rows: &[usize]) -> Buf {
        self.inner.gather_rows(x, width, rows)
    }
    fn add_rows_scaled(&self, out: &mut Buf, y: &Buf, width: usize, rows: &[usize], weights: &[f32]) {
        self.inner.add_rows_scaled(out, y, width, rows, weights);
        self.r(out);
    }
    fn kv_write(&self, cache: &mut Buf, new: &Buf, width: usize, pos0: usize, slot0: usize) {
        self.inner.kv_write(cache, new, width, pos0, slot0)
    }
    fn linear(&self, x: &Buf, n: usize, w: WeightRef<'_>, out: &mut Buf) {
        self.inner.linear(x, n, w, out);
        self.r(out);
    }
    fn linear_many(&self, x: &Buf, n: usize, ws: &[WeightRef<'_>], outs: &mut [&mut Buf]) {
        self.inner.linear_many(x, n, ws, outs);
        for o in outs.iter_mut() {
            self.r(o);
        }
    }
    fn rms_norm(&self, x: &Buf, weight: &[f32], eps: f32, out: &mut Buf) {
        self.inner.rms_norm(x, weight, eps, out);
        self.r(out);
    }
    // add_rms_norm: the trait's default, add_assign (rounded) then rms_norm (rounded), so the norm
    // reads the stored residual.
    fn moe_route(&self, logits: &Buf, n_exp: usize, m: &MoeConfig, bias: Option<&[f32]>, scale: f32) -> Vec<Route> {
        self.inner.moe_route(logits, n_exp, m, bias, scale)
    }
    fn rope(&self, x: &mut Buf, layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs<'_>) {
        self.inner.rope(x, layout, pos0, base, style, freqs);
        self.r(x);
    }
    fn rope_qk(
        &self,
        q: &mut Buf,
        q_layout: RopeLayout,
        k: &mut Buf,
        k_layout: RopeLayout,
        pos0: usize,
        base: f32,
        style: RopeStyle,
        freqs: RopeFreqs<'_>,
    ) {
        self.inner.rope_qk(q, q_layout, k, k_layout, pos0, base, style, freqs);
        self.r(q);
        self.r(k);
    }
    fn rope_qk_cache(
        &self,
        q: &mut Buf,
        k: &mut Buf,
        v: &Buf,
        v_width: usize,
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        // RoPE (rounded), then the rounded k and v appended.
        crate::backend::rope_qk_then_append(self, q, k, v, v_width, rope, caches)
    }
    fn linear_qkv_rope(
        &self,
        x: &Buf,
        n: usize,
        ws: [WeightRef<'_>; 3],
        outs: [&mut Buf; 3],
        rope: QkRope<'_>,
        caches: [&mut Buf; 2],
    ) {
        // The products (rounded), then RoPE (rounded) and the appends: what is stored between.
        let [q, k, v] = outs;
        self.linear_many(x, n, &ws, &mut [&mut *q, &mut *k, &mut *v]);
        self.rope_qk_cache(q, k, v, ws[2].rows(), rope, caches);
    }
    fn swiglu(&self, gate: &mut Buf, up: &Buf) {
        self.inner.swiglu(gate, up);
        self.r(gate);
    }
    fn geglu(&self, gate: &mut Buf, up: &Buf) {
        self.inner.geglu(gate, up);
        self.r(gate);
    }
    fn add_bias(&self, y: &mut Buf, bias: &[f32]) {
        self.inner.add_bias(y, bias);
        self.r(y);
    }
    fn scale(&self, x: &mut Buf, s: f32) {
        self.inner.scale(x, s);
        self.r(x);
    }
    fn softcap(&self, x: &mut Buf, cap: f32) {
        self.inner.softcap(x, cap);
        self.r(x);
    }
    fn gqa_attention(&self, q: &Buf, k: &Buf, v: &Buf, pos0: usize, shape: GqaShape, out: &mut Buf) {
        self.inner.gqa_attention(q, k, v, pos0, shape, out);
        self.r(out);
    }
    fn mla_attention(&self, q: &Buf, k_nope: &Buf, k_pe: &Buf, v: &Buf, pos0: usize, shape: MlaShape, out: &mut Buf) {
        self.inner.mla_attention(q, k_nope, k_pe, v, pos0, shape, out);
        self.r(out);
    }
    fn mla_attention_sparse(
        &self,
        q: &Buf,
        k_nope: &Buf,
        k_pe: &Buf,
        v: &Buf,
        shape: MlaShape,
        keys: &Buf,
        top_k: usize,
        out: &mut Buf,
    ) {
        self.inner
            .mla_attention_sparse(q, k_nope, k_pe, v, shape, keys, top_k, out);
        self.r(out);
    }
    fn layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf) {
        self.inner.layer_norm(x, weight, bias, eps, out);
        self.r(out);
    }
    // The indexer's scores stay f32 (production scores fp8 or bf16 inputs into f32 sums).
    fn index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, shape: IndexShape, out: &mut Buf) {
        self.inner.index_scores(q, k, w, pos0, shape, out);
    }
    fn fp8_groups(&self, x: &mut Buf, width: usize) {
        self.inner.fp8_groups(x, width);
    }
    fn all_reduce(&self, partials: &[&Buf]) -> Vec<Buf> {
        let mut sums = self.inner.all_reduce(partials);
        for (i, s) in sums.iter_mut().enumerate() {
            // Each sum on the device of the rank that reads it (one per GPU with real ranks).
            crate::backend::as_rank(i, || self.r(s));
        }
        sums
    }
    fn embed_rows(&self, w: WeightRef<'_>, rows: &[Option<usize>], out: &mut Buf) {
        self.inner.embed_rows(w, rows, out);
        self.r(out);
    }
    fn embed_token(&self, w: WeightRef<'_>, token: u32, vocab_start: usize, out: &mut Buf) {
        self.inner.embed_token(w, token, vocab_start, out);
        self.r(out);
    }
    fn graph_begin(&self, pos0: usize, token: u32) -> bool {
        self.inner.graph_begin(pos0, token)
    }
    fn graph_end(&self) -> Option<Box<dyn StepGraph>> {
        self.inner.graph_end()
    }
    fn comm_stats(&self) -> Option<CommStats> {
        self.inner.comm_stats()
    }
    fn reset_comm_stats(&self) {
        self.inner.reset_comm_stats()
    }
    fn kernel_trace_reset(&self) -> bool {
        self.inner.kernel_trace_reset()
    }
    fn kernel_trace_take(&self) -> Option<(Vec<BlockTrace>, usize)> {
        self.inner.kernel_trace_take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::tap::{canary, is_canary};

    #[test]
    fn bf16_rounds_to_nearest_even_and_overflows_to_inf() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1).
        assert_eq!(round_bf16(1.0 + (-8f32).exp2()), 1.0);
        // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(round_bf16(1.0 + 3.0 * (-8f32).exp2()), 1.0 + (-6f32).exp2());
        assert_eq!(round_bf16(1.0 + 1.5 * (-8f32).exp2()), 1.0 + (-7f32).exp2());
        assert_eq!(round_bf16(-1.0 - 1.5 * (-8f32).exp2()), -1.0 - (-7f32).exp2());
        assert_eq!(round_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
        // Agrees with the half crate on ordinary values.
        for x in [0.1f32, -3.7, 1e-30, 6.0e4, 123456.7, 1e38] {
            assert_eq!(round_bf16(x), half::bf16::from_f32(x).to_f32(), "{x}");
        }
    }

    #[test]
    fn f16_rounds_with_subnormals_and_overflow() {
        assert_eq!(round_f16(1.0 + (-11f32).exp2()), 1.0);
        assert_eq!(round_f16(70000.0), f32::INFINITY);
        assert_eq!(round_f16(1e-8), 0.0);
        assert_eq!(round_f16(3.0 * (-24f32).exp2()), 3.0 * (-24f32).exp2());
        assert_eq!(round_f16(0.1), half::f16::from_f32(0.1).to_f32());
    }

    #[test]
    fn rounding_is_idempotent_and_keeps_each_dtype_canary() {
        for dtype in ComputeDtype::ALL {
            let c = dtype.canary();
            assert_eq!(dtype.round(canary()).to_bits(), c.to_bits(), "{dtype}");
            assert_eq!(dtype.round(c).to_bits(), c.to_bits(), "{dtype}");
            assert!(is_canary(c));
            // A canonical NaN stays a NaN that is not a canary.
            let n = dtype.round(f32::NAN);
            assert!(n.is_nan() && !is_canary(n), "{dtype}");
            for x in [0.3f32, -17.25, 1e-3, 3e4] {
                let r = dtype.round(x);
                assert_eq!(dtype.round(r), r);
                assert!(((r - x) / x).abs() as f64 <= dtype.unit_roundoff(), "{dtype} {x}");
            }
        }
        assert_eq!(ComputeDtype::F32.round(0.1), 0.1);
    }

    #[test]
    fn dtypes_parse_by_name() {
        for d in ComputeDtype::ALL {
            assert_eq!(d.name().parse::<ComputeDtype>().unwrap(), d);
        }
        assert!("fp8".parse::<ComputeDtype>().is_err());
    }
}
