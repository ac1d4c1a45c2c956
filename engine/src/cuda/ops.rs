//! Launch helpers of the element-wise, norm, RoPE, KV-cache, routing and gather ops the
//! [`Backend`] impl in `mod.rs` calls: launch shapes, the RoPE angle table memo, KV cache growth.

use super::*;

/// Threads per attention block (one block per token and head): 256, or 1024 when there are
/// fewer blocks than SMs (a decode step), so each block's walk over the positions is split
/// over more thread groups (`attn_weighted_sum`) instead of leaving SMs idle.
pub(super) fn attn_threads(blocks: usize, sms: u32) -> u32 {
    if blocks < sms as usize {
        1024
    } else {
        256
    }
}

/// Floats of shared memory for the attention kernels' G partial output rows of `width`
/// (`attn_weighted_sum` in kernels/attention.cu), with `threads` per block.
pub(super) fn attn_part(width: usize, threads: u32) -> usize {
    let t = threads as usize;
    let g = if t >= width { t / width.max(1) } else { 1 };
    g * width
}

/// The blocks a one-row norm is split over by default (1 = one block). On the H200 8 took the 8B decode step from 1.915 to 1.901 ms, 4 to 1.909.
pub(super) const NORM_SPLIT_DEFAULT: usize = 8;

/// What a RoPE angle table holds: rows at `pos0` (None: the position word of a recorded step,
/// recomputed at every replay) .. + n, `rope_dim`, `base` (bits), and the frequency scaling: the
/// linear `divisor` (bits) and the per-pair factors (the host slice's address and length, as the
/// weight map keys the device copy the kernel reads; None: all 1). A table's values are a
/// function of its key alone, so a key match is always a valid reuse, except for the recorded
/// form, which `graph_begin` forgets so that each recording computes its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct RopeKey {
    pub(super) pos0: Option<usize>,
    pub(super) n: usize,
    pub(super) rope_dim: usize,
    pub(super) base: u32,
    pub(super) divisor: u32,
    pub(super) factors: Option<(usize, usize)>,
}

impl CudaBackend {
    /// The device weight, launch shape and split of `rms_norm`/`add_rms_norm` over `len` values
    /// of rows of `weight.len()`; None when there is nothing to do. One thread per float4 of the
    /// row (per value when d % 4 != 0), whole warps, at most 1024: a one-row decode norm is
    /// spread over the block, and over `norm_split` blocks where each takes whole warps of
    /// float4s (d % (128·split) == 0; else 1). Both kernels get the same block, so their sums
    /// agree bit for bit, split or not.
    pub(super) fn norm_setup(
        &self,
        len: usize,
        weight: &[f32],
        out_len: usize,
    ) -> Option<(Arc<DevWeight>, LaunchConfig, i32)> {
        let d = weight.len();
        assert!(d > 0 && len % d == 0 && len == out_len, "rms_norm: x is not [n, d]");
        if len == 0 {
            return None;
        }
        let per_thread = if d % 4 == 0 { 4 } else { 1 };
        let threads = (d.div_ceil(per_thread).div_ceil(32) * 32).clamp(32, 1024) as u32;
        let s = self.norm_split.load(Ordering::Relaxed);
        let split = if len == d && d <= 4096 && d % (128 * s) == 0 {
            s
        } else {
            1
        };
        let cfg = LaunchConfig {
            grid_dim: (if split > 1 { split } else { len / d } as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        Some((self.param(weight), cfg, split as i32))
    }

    /// The RoPE angle table for rows `pos0 .. pos0 + n` (the position word when recording): the
    /// memo's when its key matches, else computed now by `rope_table` into the memo.
    pub(super) fn rope_table_for<'m>(
        &self,
        memo: &'m mut Option<(RopeKey, Buf)>,
        n: usize,
        rope_dim: usize,
        pos0: usize,
        base: f32,
        freqs: RopeFreqs<'_>,
    ) -> &'m Buf {
        let capturing = self.capturing();
        let half = rope_dim / 2;
        if let Some(f) = freqs.factors {
            assert_eq!(f.len(), half, "cuda rope: one frequency factor per rotated pair");
        }
        let key = RopeKey {
            pos0: (!capturing).then_some(pos0),
            n,
            rope_dim,
            base: base.to_bits(),
            divisor: freqs.divisor.to_bits(),
            factors: freqs.factors.map(|f| (f.as_ptr() as usize, f.len())),
        };
        if memo.as_ref().is_none_or(|(k, _)| *k != key) {
            // The factors' device copy (uploaded once per model, by the first, unrecorded step; the
            // weight map keeps it alive for the recorded graphs that read it).
            let ff = freqs.factors.filter(|f| !f.is_empty()).map(|f| self.param(f));
            let null = 0u64;
            let mut cs = self.new_buf(n * half * 2);
            let (n_i, dim, p) = (n as i32, rope_dim as i32, pos0 as i32);
            let mut b = self
                .stream
                .launch_builder(self.func(if capturing { "rope_table_dpos" } else { "rope_table" }));
            b.arg(dev_mut(&mut cs)).arg(&n_i).arg(&dim);
            if capturing {
                b.arg(&*self.pos_dev);
            } else {
                b.arg(&p);
            }
            b.arg(&base);
            match &ff {
                Some(d) => b.arg(&d.data),
                None => b.arg(&null),
            };
            b.arg(&freqs.divisor);
            // SAFETY: matches rope_table in kernels/ops.cu; cs holds n·half float2s; ff is null or
            // half f32s (asserted above).
            ok(unsafe { b.launch(Self::elementwise_cfg(n * half)) });
            *memo = Some((key, cs));
        }
        &memo.as_ref().expect("just set").1
    }

    /// RoPE on q and, when given, k (same rows and rope_dim) in one `rope_qk` launch.
    pub(super) fn launch_rope(
        &self,
        q: &mut CudaSlice<f32>,
        ql: RopeLayout,
        k: Option<(&mut CudaSlice<f32>, RopeLayout)>,
        pos0: usize,
        base: f32,
        style: RopeStyle,
        freqs: RopeFreqs<'_>,
        append: Option<KvAppend<'_>>,
    ) {
        let q_width = ql.n_heads * ql.head_stride;
        let half = ql.rope_dim / 2;
        if q_width == 0 || half == 0 || q.is_empty() {
            return;
        }
        let n = q.len() / q_width;
        let kl = k.as_ref().map(|(_, l)| *l);
        if let Some(kl) = kl {
            assert_eq!(kl.rope_dim, ql.rope_dim, "rope_qk: q and k rotate the same dims");
        }
        let (kh, ks, ko) = kl.map_or((0, 0, 0), |l| (l.n_heads, l.head_stride, l.offset));
        let q_args = [ql.n_heads as i32, ql.head_stride as i32, ql.offset as i32];
        let k_args = [kh as i32, ks as i32, ko as i32];
        let (n_i, dim) = (n as i32, ql.rope_dim as i32);
        let st = match style {
            RopeStyle::Norm => 0i32,
            RopeStyle::Neox => 1,
        };
        let null = 0u64;
        let mut memo = self.rope_table.lock().expect("rope table");
        let cs = self.rope_table_for(&mut memo, n, ql.rope_dim, pos0, base, freqs);
        let mut b = self.stream.launch_builder(self.func("rope_qk"));
        b.arg(q);
        for a in &q_args {
            b.arg(a);
        }
        match k {
            Some((k, _)) => b.arg(k),
            // kh = 0: the kernel never reads k.
            None => b.arg(&null),
        };
        for a in &k_args {
            b.arg(a);
        }
        b.arg(&n_i).arg(&dim).arg(dev(cs)).arg(&st);
        let (vw, slot) = append.as_ref().map_or((0, 0), |a| (a.v_width as i32, a.slot as i32));
        let copies = append.as_ref().map_or(0, |a| n * (kh * ks + a.v_width));
        match append {
            Some(a) => {
                b.arg(a.kc).arg(a.v).arg(a.vc).arg(&vw).arg(&slot);
                match a.dpos {
                    true => b.arg(&*self.pos_dev),
                    false => b.arg(&null),
                }
            }
            // kc null: no copies, the rest unread.
            None => b.arg(&null).arg(&null).arg(&null).arg(&vw).arg(&slot).arg(&null),
        };
        let chunks = (ql.n_heads + kh).div_ceil(ROPE_HEADS);
        // SAFETY: matches rope_qk in kernels/ops.cu; one thread per (row, chunk of ROPE_HEADS
        // heads, pair), then (with a cache append) one per k and v value copied; q holds
        // n·q_width floats, k n·kh·ks, cs n·rope_dim/2 float2s; the caches were reserved for the
        // n rows at `slot` (or at the position word, within the recording's capacity).
        ok(unsafe { b.launch(Self::elementwise_cfg(n * chunks * half + copies)) });
    }

    /// Makes `cache` hold rows up to `pos0 + new_len / width` (growing it and keeping its first
    /// `pos0` rows), its length set to that and its limbs dropped. True when the append is being
    /// recorded for replay (no slot shift, whole rows): the caller's write must then take its row
    /// from the position word (`pos_dev`), and the recording's replayable rows shrink to fit.
    pub(super) fn kv_reserve(&self, cache: &mut Buf, new_len: usize, width: usize, pos0: usize, slot0: usize) -> bool {
        let keep = pos0 * width;
        let total = keep + new_len;
        let cap = match &cache.repr {
            BufRepr::Dev(d) => d.data.len(),
            BufRepr::Host(v) => {
                assert!(v.is_empty(), "kv_write: a host cache");
                0
            }
        };
        if total > cap || cache.is_host() {
            let mut grown = self.new_buf(total.max(2 * cap).max(64 * width.max(1)));
            if keep > 0 {
                let kept = cache.len().min(keep);
                self.copy(cache, 0, &mut grown, 0, kept);
            }
            *cache = grown;
        }
        let capturing = self.capturing();
        if capturing && slot0 != pos0 {
            self.spoil("a shifted KV slot");
        }
        let BufRepr::Dev(d) = &mut cache.repr else {
            unreachable!("the cache is on the device here")
        };
        d.len = total;
        d.limbs = None;
        let dpos = capturing && slot0 == pos0 && width > 0 && new_len % width == 0;
        if dpos {
            self.limit_rows(d.data.len() / width + 1 - (new_len / width).max(1));
        }
        dpos
    }

    pub(super) fn moe_route_device(
        &self,
        logits: &Buf,
        n_exp: usize,
        m: &MoeConfig,
        bias: Option<&[f32]>,
        scale: f32,
    ) -> Vec<Route> {
        let n = logits.len() / n_exp.max(1);
        let grouped = m.n_groups > 1 && m.n_groups_used < m.n_groups;
        // The kernel's limits (a lane per group, k in shared memory); beyond them, the host.
        if n == 0 || m.n_used > 64 || (grouped && m.n_groups > 32) {
            return route(&self.download(logits), n_exp, m, bias, scale);
        }
        let k = m.n_used;
        let scratch = self.new_buf(n * 2 * n_exp);
        let mut ids = ok(self.stream.alloc_zeros::<i32>(n * k));
        let mut wts = self.new_buf(n * k);
        let bias_buf = bias.map(|b| self.upload(b));
        let null = 0u64;
        let args = [
            n_exp as i32,
            k as i32,
            matches!(m.gating, Gating::Softmax) as i32,
            m.n_groups as i32,
            m.n_groups_used as i32,
            m.weights_norm as i32,
        ];
        let mut b = self.stream.launch_builder(self.func("moe_route"));
        b.arg(dev(logits));
        match &bias_buf {
            Some(bb) => b.arg(dev(bb)),
            None => b.arg(&null),
        };
        b.arg(dev(&scratch)).arg(&mut ids).arg(dev_mut(&mut wts));
        for a in &args {
            b.arg(a);
        }
        b.arg(&scale);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches moe_route in kernels/ops.cu: logits n·n_exp, bias n_exp (or null),
        // scratch 2·n·n_exp, ids and wts n·k; k ≤ 64, n_groups ≤ 32 when grouped.
        ok(unsafe { b.launch(cfg) });
        let ids = ok(self.stream.clone_dtoh(&ids));
        let wts = self.download(&wts);
        ids.chunks_exact(k)
            .zip(wts.chunks_exact(k))
            .map(|(e, w)| Route {
                experts: e.iter().map(|&x| x as usize).collect(),
                weights: w.to_vec(),
            })
            .collect()
    }

    /// Launches `gather_<type>` (kernels/matmul.cu): the rows `ids[t] - start` of `w` (zeros where
    /// that is not one of its rows) into `out[t]`, t < n.
    pub(super) fn launch_gather(
        &self,
        w: WeightRef<'_>,
        ids: &cudarc::driver::CudaView<'_, i32>,
        n: usize,
        start: usize,
        out: &mut Buf,
    ) {
        let dw = self.weight(w, &self.stream);
        let (nn, c, rb) = (n as i32, w.cols() as i32, dw.row_bytes as i32);
        // Starts and row counts past i32 cannot occur (vocab sizes are checked on load); saturate.
        let (st, nr) = (
            start.min(i32::MAX as usize) as i32,
            w.rows().min(i32::MAX as usize) as i32,
        );
        let mut b = self.stream.launch_builder(self.func(&format!("gather_{}", dw.suffix)));
        b.arg(&dw.data)
            .arg(ids)
            .arg(dev_mut(out))
            .arg(&nn)
            .arg(&c)
            .arg(&rb)
            .arg(&st)
            .arg(&nr);
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches gather_* in kernels/matmul.cu: W holds rows() rows of row_bytes, ids n
        // ints, out n·cols floats.
        ok(unsafe { b.launch(cfg) });
    }
}
