//! The fused decode layer on CUDA (`layer_q4k` in `kernels/quant.cu`), opt-in:
//! `Backend::decode_layer` for a one-token step of a dense GQA layer whose seven products are
//! Q4_K, in one persistent launch (a block a SM). A copy warp streams every product's rows
//! through one ring of bulk copies (TMA) in shared memory from the block's start, while the
//! compute warps run the layer's phases between grid barriers: RMSNorm and q/k/v (RoPE and the KV
//! append in its store), the split attention's chunks, their combine, o (added into x), RMSNorm
//! and gate/up (SwiGLU in its store), down (added into x). The kernel's comment has the scheme.
//!
//! Why: round 23's fused FFN streamed its gate/up half at 87 % of copy bandwidth with the ring
//! full when its wait returned, but lost more in the kernels around it (their early placement
//! beside a grid that holds every SM). A whole layer has no kernels around it but the next layer.
//!
//! What it measured (H200, 8B shape at depth 512, `tests/gpu/h200-results/round24`): exact
//! (`kernels --check` within 3.8e-6 of the CPU engine's ops; the bench's decode check 5.1e-6), but
//! the step takes 2.61 ms against 1.95 op by op. The ring streams gate/up at 3.8 TB/s once it
//! runs; what loses is everything serial inside a block between the products: each block makes
//! every product's limbs itself (`x_limbs4`, one ~1.3 µs latency chain a call, 2 to 7 calls a
//! thread), five grid barriers of 2–3.5 µs, and a first stage that is ready ~2.5 µs after the
//! limbs although its copy was issued long before. The kernel's comment has the phase figures.
//!
//! Selection: off unless `LLMDIFF_LAYER=1`. Layers it does not take (other types, head widths
//! other than 64 and 128, NEOX RoPE, shapes whose rows its warps do not cover or whose attention
//! scratch leaves too little shared memory for the ring) go op by op. `kernels --check` runs it
//! against the CPU engine's ops whatever the setting.

use super::{compare, dev, dev_mut, limbs_words, noise, test_bytes, test_weight, CudaBackend, KernelCheck};
use crate::backend::{ffn_swiglu_ops, Backend, Buf, CpuBackend, DecodeLayer};
use crate::kernels::{GqaShape, QkRope, RopeLayout, RopeStyle, WeightRef};
use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use references::GgmlType;

/// Compute warps a block (`FFN_WARPS`), plus the copy warp.
const WARPS: usize = 16;
/// Rows a stage of q/k/v and of o (`LY_R`), gate and up rows a stage (`LY_P`), down rows a stage
/// (`LY_RB`), positions an attention item (`LY_L`).
const R: usize = 8;
const P: usize = 4;
const RB: usize = 2;
const L: usize = WARPS * 4;
/// Most ring stages a block keeps.
const MAX_STAGES: usize = 32;

/// `LayerArgs` in kernels/quant.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct LayerArgs {
    /// q, k, v, o, gate, up, down (Q4_K, device layout).
    w: [u64; 7],
    /// attn_norm, ffn_norm.
    norms: [u64; 2],
    x: u64,
    q: u64,
    k: u64,
    v: u64,
    kc: u64,
    vc: u64,
    cs: u64,
    pos_dev: u64,
    part: u64,
    attn: u64,
    act: u64,
    bar: u64,
    /// pos, d, f, n_heads, n_kv, hd, rope_dim, s_cap, ns.
    ints: [i32; 9],
    eps: f32,
    scale: f32,
}

// SAFETY: #[repr(C)] plain integers laid out as the kernel's struct (21 eight-byte pointers,
// nine ints, two floats; 216 bytes with the tail padding, 8-byte aligned).
unsafe impl cudarc::driver::DeviceRepr for LayerArgs {}

/// Bytes of one Q4_K row of `cols` values in the device layout (144 per super-block).
fn row_bytes(cols: usize) -> usize {
    cols / 256 * 144
}

/// The layer's widths: d (model), w (the heads' H·hd), f (FFN), kvw (KV·hd), g (heads a KV head).
#[derive(Clone, Copy, Debug)]
struct Dims {
    d: usize,
    w: usize,
    f: usize,
    kvw: usize,
    g: usize,
    hd: usize,
}

/// A stage's bytes: the largest of R rows of q/k/v or o, P gate and P up rows, RB down rows.
fn stage_bytes(m: Dims) -> usize {
    (R * row_bytes(m.d))
        .max(R * row_bytes(m.w))
        .max(2 * P * row_bytes(m.d))
        .max(RB * row_bytes(m.f))
}

/// Dynamic shared memory with `ns` stages (kernels/quant.cu's layout comment).
fn smem(m: Dims, ns: usize) -> usize {
    let limbs = 4 * limbs_words(m.d.max(m.w).max(m.f));
    let attn = 4 * (m.g * m.hd + m.g * L + WARPS * m.g * m.hd);
    ns * (stage_bytes(m) + 16) + 4 * 2 * WARPS * R + 8 * 32 + limbs.max(attn)
}

/// Teams of a product whose rows are `units` pair units, S warp groups a team (the kernel's
/// `ffn_teams`); 0 when one team does not fit the compute warps.
fn teams(units: usize, s: usize) -> usize {
    let fit = WARPS / (units.div_ceil(32).max(2) * s);
    [8, 4, 2, 1, 0].into_iter().find(|&t| t <= fit).unwrap_or(0)
}

/// True when `LLMDIFF_LAYER=1`.
pub(super) fn from_env() -> bool {
    std::env::var("LLMDIFF_LAYER").is_ok_and(|v| v == "1")
}

/// The layer's widths when the kernel takes it: every product Q4_K of consistent shape, rows of
/// whole super-blocks its warps cover, head width 64 or 128, NORM RoPE from each head's start.
fn dims_of(x: &Buf, l: &DecodeLayer<'_>) -> Option<Dims> {
    let [q, k, v] = l.qkv;
    let [gate, up, down] = l.ffn;
    let (s, r) = (l.shape, l.rope);
    let (d, hd) = (x.len(), s.head_dim);
    let m = Dims {
        d,
        w: s.n_heads * hd,
        f: gate.rows(),
        kvw: s.n_kv_heads * hd,
        g: s.n_heads / s.n_kv_heads.max(1),
        hd,
    };
    let q4k = [q, k, v, l.o, gate, up, down]
        .iter()
        .all(|w| matches!(w, WeightRef::Quant(qm) if qm.ty == GgmlType::Q4K));
    let shapes = [
        (q, m.w, d),
        (k, m.kvw, d),
        (v, m.kvw, d),
        (l.o, d, m.w),
        (gate, m.f, d),
        (up, m.f, d),
        (down, d, m.f),
    ]
    .iter()
    .all(|(w, rows, cols)| w.rows() == *rows && w.cols() == *cols);
    let rope_ok = |rl: RopeLayout| rl.head_stride == hd && rl.offset == 0 && rl.rope_dim == r.q.rope_dim;
    let ok = q4k
        && shapes
        && [64, 128].contains(&hd)
        && s.n_kv_heads > 0
        && s.n_heads % s.n_kv_heads == 0
        && [d, m.w, m.f].iter().all(|c| c % 256 == 0 && *c > 0)
        && teams(d / 64, 4) > 0
        && teams(m.w / 64, 4) > 0
        && teams(m.f / 64, 1) > 0
        && r.style == RopeStyle::Norm
        && rope_ok(r.q)
        && rope_ok(r.k)
        && r.q.rope_dim % 2 == 0
        && (1..=hd).contains(&r.q.rope_dim)
        && l.attn_norm.len() == d
        && l.ffn_norm.len() == d;
    ok.then_some(m)
}

impl CudaBackend {
    /// `Backend::decode_layer` by `layer_q4k`; false (nothing enqueued) when the layer's shape or
    /// types are not the kernel's.
    pub(super) fn layer_fused(&self, x: &mut Buf, l: &DecodeLayer<'_>, caches: [&mut Buf; 2]) -> bool {
        let Some(m) = dims_of(x, l) else {
            return false;
        };
        let name = "layer_q4k";
        let cap = self
            .func(name)
            .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .map_or(0, |b| b.max(0) as usize);
        // A multiple of 8, so of every product's team count (the kernel's `ffn_teams`).
        let ns = (cap.saturating_sub(smem(m, 0)) / (stage_bytes(m) + 16)).min(MAX_STAGES) / 8 * 8;
        if ns == 0 {
            return false;
        }
        let s = &self.stream;
        let [q, k, v] = l.qkv;
        let [gate, up, down] = l.ffn;
        let dws = [q, k, v, l.o, gate, up, down].map(|w| self.weight(w, s));
        if dws.iter().any(|w| w.ty != GgmlType::Q4K) {
            return false;
        }
        let [kc, vc] = caches;
        let pos = l.rope.pos0;
        let dpos = self.kv_reserve(kc, m.kvw, m.kvw, pos, pos);
        self.kv_reserve(vc, m.kvw, m.kvw, pos, pos);
        // Splits for every position the caches (and so a replay of this recording) can hold.
        let s_cap = (kc.capacity() / m.kvw).div_ceil(L).max(1);
        let n_part = s_cap * (m.kvw / m.hd) * m.g;
        let mut part = self.new_buf((3 * n_part).next_multiple_of(4) + n_part * m.hd);
        let (mut qs, mut ks, mut vs) = (self.new_buf(m.w), self.new_buf(m.kvw), self.new_buf(m.kvw));
        let (mut attn, mut act) = (self.new_buf(m.w), self.new_buf(m.f));
        let norms = [l.attn_norm, l.ffn_norm].map(|w| self.param(w));
        let mut memo = self.rope_table.lock().expect("rope table");
        let cs = self.rope_table_for(&mut memo, 1, l.rope.q.rope_dim, pos, l.rope.base);

        let mut a = LayerArgs::default();
        let mut guards = Vec::new();
        for (i, w) in dws.iter().enumerate() {
            let (p, g) = w.data.device_ptr(s);
            a.w[i] = p;
            guards.push(g);
        }
        for (i, w) in norms.iter().enumerate() {
            let (p, g) = w.data.device_ptr(s);
            a.norms[i] = p;
            guards.push(g);
        }
        let outs = [x, &mut qs, &mut ks, &mut vs, kc, vc, &mut part, &mut attn, &mut act];
        let slots = [
            &mut a.x,
            &mut a.q,
            &mut a.k,
            &mut a.v,
            &mut a.kc,
            &mut a.vc,
            &mut a.part,
            &mut a.attn,
            &mut a.act,
        ];
        for (b, slot) in outs.into_iter().zip(slots) {
            let (p, g) = dev_mut(b).device_ptr_mut(s);
            *slot = p;
            guards.push(g);
        }
        let (p, g) = dev(cs).device_ptr(s);
        a.cs = p;
        guards.push(g);
        if dpos {
            a.pos_dev = self.pos_ptr();
        }
        let (p, g) = self.ffn_bar.device_ptr(s);
        a.bar = p;
        guards.push(g);
        let ints = [
            pos,
            m.d,
            m.f,
            l.shape.n_heads,
            l.shape.n_kv_heads,
            m.hd,
            l.rope.q.rope_dim,
            s_cap,
            ns,
        ];
        a.ints = ints.map(|v| v as i32);
        (a.eps, a.scale) = (l.eps, l.shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (self.sms, 1, 1),
            block_dim: (((WARPS + 1) * 32) as u32, 1, 1),
            shared_mem_bytes: smem(m, ns) as u32,
        };
        let mut params: Vec<*mut std::ffi::c_void> = vec![(&mut a as *mut LayerArgs).cast()];
        // SAFETY: matches layer_q4k in kernels/quant.cu (whose compute warps wait before reading
        // x or writing anything; the copy warp reads only weights): the seven weights of the
        // shapes dims_of checked, Q4_K in the device layout; the norms d floats; x d; the q/k/v
        // scratch W, KV·hd, KV·hd; the caches reserved for the position's row (or the position
        // word's, within the recording's rows); the table rope_dim/2 float2s; part sized for
        // s_cap splits of every KV head's G heads, s_cap covering every row the caches hold;
        // attn W, act f; the barrier's count, which every launch of this backend's grid size
        // draws on. A grid of as many blocks as SMs, each SM able to hold one (launch bounds and
        // shared memory sized for it), all of this device's work on one stream: every block is
        // resident at once for the grid barriers. `params` and `guards` outlive the call.
        unsafe { self.launch_ex(s, name, cfg, &mut params, self.pdl_chain) };
        drop(guards);
        true
    }

    /// The fused layer against the CPU engine's ops (`kernels --check`): the x it adds and the k
    /// and v rows it appends, for the 8B shape, a narrower one at position 0, and head width 64
    /// at a context of more attention items than blocks.
    pub(super) fn layer_checks(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        // (d, f, heads, KV heads, head width, position)
        let shapes = [
            (4096, 14336, 32, 8, 128, 700),
            (2048, 5632, 16, 4, 128, 0),
            (1024, 2816, 16, 4, 64, 4500),
        ];
        for (i, &(d, f, nh, nkv, hd, pos)) in shapes.iter().enumerate() {
            let (w, kvw) = (nh * hd, nkv * hd);
            let seed = 1300 + 16 * i as u64;
            let shapes = [(w, d), (kvw, d), (kvw, d), (d, w), (f, d), (f, d), (d, f)];
            let mats: Vec<Vec<u8>> = (0..7)
                .map(|j| test_bytes(GgmlType::Q4K, shapes[j].0, shapes[j].1, seed + j as u64))
                .collect();
            let ws: Vec<WeightRef<'_>> = (0..7)
                .map(|j| test_weight(GgmlType::Q4K, &mats[j], shapes[j].0, shapes[j].1))
                .collect();
            let norm_w: Vec<f32> = noise(d, seed + 8).iter().map(|v| 1.0 + 0.5 * v).collect();
            let ffn_w: Vec<f32> = noise(d, seed + 9).iter().map(|v| 1.0 + 0.5 * v).collect();
            let layout = |heads| RopeLayout {
                n_heads: heads,
                head_stride: hd,
                offset: 0,
                rope_dim: hd,
            };
            let layer = DecodeLayer {
                attn_norm: &norm_w,
                ffn_norm: &ffn_w,
                eps: 1e-5,
                qkv: [ws[0], ws[1], ws[2]],
                o: ws[3],
                ffn: [ws[4], ws[5], ws[6]],
                rope: QkRope {
                    q: layout(nh),
                    k: layout(nkv),
                    pos0: pos,
                    base: 500000.0,
                    style: RopeStyle::Norm,
                },
                shape: GqaShape {
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    scale: 1.0 / (hd as f32).sqrt(),
                },
            };
            let x0: Vec<f32> = noise(d, seed + 10).iter().map(|v| 3.0 * v).collect();
            let k0 = noise(pos * kvw, seed + 11);
            let v0 = noise(pos * kvw, seed + 12);
            let run = |be: &dyn Backend, fused: bool| -> Option<Vec<f32>> {
                let (mut x, mut kc, mut vc) = (be.upload(&x0), be.upload(&k0), be.upload(&v0));
                if fused {
                    if !self.layer_fused(&mut x, &layer, [&mut kc, &mut vc]) {
                        return None;
                    }
                } else {
                    decode_layer_ops(be, &mut x, &layer, [&mut kc, &mut vc]);
                }
                let mut r: Vec<f32> = be.download(&x).iter().zip(&x0).map(|(a, b)| a - b).collect();
                let (kd, vd) = (be.download(&kc), be.download(&vc));
                r.extend_from_slice(&kd[pos * kvw..(pos + 1) * kvw]);
                r.extend_from_slice(&vd[pos * kvw..(pos + 1) * kvw]);
                Some(r)
            };
            // Weights are cached by host address and length: this case's may sit where an earlier
            // case's (or check's) were.
            self.weights.lock().expect("weight map").clear();
            let case = |what: &str| format!("{what}(type=q4_K,d={d},f={f},heads={nh}/{nkv},hd={hd},pos={pos})");
            let Some(gpu) = run(self, true) else {
                out.push(compare(case("LAYER_FUSED"), &[], &[0.0], 0.0));
                continue;
            };
            let cpu = run(&CpuBackend, false).expect("the ops always run");
            out.push(compare(case("LAYER_FUSED"), &gpu[..d], &cpu[..d], 1e-4));
            out.push(compare(case("LAYER_FUSED_KV"), &gpu[d..], &cpu[d..], 1e-5));
        }
        out
    }
}

/// `Backend::decode_layer` op by op, as `Rank::attn_block` and `Rank::ffn_block` run a
/// one-token, one-rank layer: the check's expectation.
fn decode_layer_ops(be: &dyn Backend, x: &mut Buf, l: &DecodeLayer<'_>, caches: [&mut Buf; 2]) {
    let [kc, vc] = caches;
    let (d, [q, k, v]) = (x.len(), l.qkv);
    let mut h = be.alloc(d);
    be.rms_norm(x, l.attn_norm, l.eps, &mut h);
    let (mut qv, mut kv, mut vv) = (be.alloc(q.rows()), be.alloc(k.rows()), be.alloc(v.rows()));
    be.linear_qkv_rope(&h, 1, l.qkv, [&mut qv, &mut kv, &mut vv], l.rope, [&mut *kc, &mut *vc]);
    let mut att = be.alloc(q.rows());
    be.gqa_attention(&qv, kc, vc, l.rope.pos0, l.shape, &mut att);
    let mut y = be.alloc(d);
    be.linear(&att, 1, l.o, &mut y);
    be.add_assign(x, &y, false);
    be.rms_norm(x, l.ffn_norm, l.eps, &mut h);
    ffn_swiglu_ops(be, &h, 1, l.ffn, &mut y);
    be.add_assign(x, &y, false);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::QMat;

    fn q4k(rows: usize, cols: usize) -> WeightRef<'static> {
        WeightRef::Quant(QMat {
            ty: GgmlType::Q4K,
            bytes: &[],
            rows,
            cols,
            row_bytes: cols / 256 * 144,
        })
    }

    /// The 8B layer's weights with a RoPE `style` and head width `hd` (32 heads, 8 KV heads).
    fn layer(hd: usize, style: RopeStyle, norm: &[f32]) -> DecodeLayer<'_> {
        let (d, f, w, kvw) = (4096, 14336, 32 * hd, 8 * hd);
        let rl = |heads| RopeLayout {
            n_heads: heads,
            head_stride: hd,
            offset: 0,
            rope_dim: hd,
        };
        DecodeLayer {
            attn_norm: norm,
            ffn_norm: norm,
            eps: 1e-5,
            qkv: [q4k(w, d), q4k(kvw, d), q4k(kvw, d)],
            o: q4k(d, w),
            ffn: [q4k(f, d), q4k(f, d), q4k(d, f)],
            rope: QkRope {
                q: rl(32),
                k: rl(8),
                pos0: 0,
                base: 1e4,
                style,
            },
            shape: GqaShape {
                n_heads: 32,
                n_kv_heads: 8,
                head_dim: hd,
                scale: 1.0,
            },
        }
    }

    #[test]
    fn the_kernel_takes_the_8b_layer_and_not_what_it_cannot_do() {
        let norm = vec![1.0; 4096];
        let x = Buf::host(vec![0.0; 4096]);
        let m = dims_of(&x, &layer(128, RopeStyle::Norm, &norm)).expect("the 8B layer fits");
        assert_eq!((m.d, m.w, m.f, m.kvw, m.g), (4096, 4096, 14336, 1024, 4));
        // Shared memory: eight stages of 8 rows of 4096 values and SwiGLU's limbs fit the H200's
        // 227 KB; the attention's scratch is smaller than the limbs.
        assert!(smem(m, 8) <= 227 * 1024, "{}", smem(m, 8));
        assert!(dims_of(&x, &layer(128, RopeStyle::Neox, &norm)).is_none(), "NEOX pairs");
        assert!(
            dims_of(&x, &layer(96, RopeStyle::Norm, &norm)).is_none(),
            "head width 96"
        );
        assert!(
            dims_of(&Buf::host(vec![0.0; 2048]), &layer(128, RopeStyle::Norm, &norm)).is_none(),
            "x width"
        );
        let mut f16_o = layer(128, RopeStyle::Norm, &norm);
        f16_o.o = WeightRef::Quant(QMat {
            ty: GgmlType::F16,
            bytes: &[],
            rows: 4096,
            cols: 4096,
            row_bytes: 8192,
        });
        assert!(dims_of(&x, &f16_o).is_none(), "an F16 product");
    }
}
