//! The DSA (DeepSeek Sparse Attention: GLM-5's `glm-dsa`, `deepseek32`) ops on the device, the
//! CPU engine's [`crate::dsa`] ops as kernels: MLA attention over each query's selected keys
//! (`mla_attention_sparse` in `kernels/attention.cu`, the per-(token, head) MLA kernel given a key
//! list), and the lightning indexer's key LayerNorm, scores and fp8 group rounding
//! (`layer_norm`, `index_scores`, `fp8_groups` in `kernels/dsa.cu`, module `ops`): their launches
//! and their `kernels --check` cases (`ATTN_MLA_SPARSE`, `LAYER_NORM`, `INDEX_SCORES`,
//! `FP8_GROUPS`) against the CPU engine, at GLM-5's shapes (indexer 32 heads of 128; MLA 64 heads
//! at TP 8, so 8 a rank, nope 192, rope 64, v 256; top_k 16 and 2048; decode and 512-token
//! prefill) and odd ones.
//!
//! Nothing crosses to the host: the key table is a device buffer (the caller uploads the top-k it
//! took from the downloaded scores), the LayerNorm's weight and bias go up once and stay (the
//! weight cache, as the RMSNorm weights). A shape whose shared memory would pass the device's
//! opt-in limit (top_k over ~50k, indexer q rows over ~220 KB) or whose token count passes the
//! grid's y limit runs the CPU op on downloaded inputs instead. None of these ops has a
//! device-position form: a decode-graph recording that reaches the attention or the scores is
//! spoiled (run once, not kept); the LayerNorm and the fp8 rounding record as they are.

use super::{
    attn_part, attn_threads, both, compare, compare_nonfinite, dev, dev_mut, noise, ok, Case, CudaBackend, KernelCheck,
};
use crate::backend::{Backend, Buf};
use crate::cpu_ops::MlaShape;
use crate::dsa::{self, IndexShape};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Bytes of static shared memory the DSA kernels keep beside the dynamic (the sparse attention's
/// reduction scratch, 512 bytes; the kernel trace's word where compiled in), held back from the
/// opt-in limit.
const STATIC_SMEM_MARGIN: usize = 1024;

/// `index_scores`' threads per block (8 warps) and keys per warp step (`IX_KG` in kernels/dsa.cu).
const IX_THREADS: u32 = 256;
const IX_KG: usize = 4;

/// Floats per staged q row of `index_scores` (`qs` in the kernel): head_dim rounded up to 4, plus
/// 4 when that is an even number of float4s (conflict-free float4 reads of 8 heads' rows).
fn index_q_stride(hd: usize) -> usize {
    let hd4 = hd.div_ceil(4);
    hd4 * 4 + if hd4 % 2 == 0 { 4 } else { 0 }
}

/// The number of fp8 groups of `len` values in rows of `width`: 128 a group, each row's last
/// (and a short last row's) shorter.
fn fp8_group_count(len: usize, width: usize) -> usize {
    (len / width) * width.div_ceil(128) + (len % width).div_ceil(128)
}

impl CudaBackend {
    /// Whether `bytes` of dynamic shared memory fit a DSA kernel (allowed at load up to the
    /// opt-in limit, `compile.rs`).
    fn dsa_smem_fits(&self, bytes: usize) -> bool {
        bytes + STATIC_SMEM_MARGIN <= self.attn.smem_max
    }

    /// [`Backend::mla_attention_sparse`]: a block per (token, head) as `mla_attention`, over the
    /// keys row t of `keys` lists (the kernel drops padding and positions past the caches).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn dsa_mla_sparse(
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
        let slots = out.len() / shape.v_dim.max(1);
        if slots == 0 {
            return;
        }
        let qw = shape.nope + shape.rope;
        let n = slots / shape.n_heads.max(1);
        assert!(
            slots == n * shape.n_heads && q.len() == slots * qw && keys.len() >= n * top_k,
            "mla_attention_sparse: q, out and keys are not of one token count"
        );
        // No device-position form, and the key table is the host's of this step.
        self.spoil("MLA sparse attention");
        let threads = attn_threads(slots, self.sms);
        let smem = (qw + 2 * top_k + attn_part(shape.v_dim, threads)) * 4;
        if !self.dsa_smem_fits(smem) || top_k > i32::MAX as usize {
            let [qh, kn, kp, vh, kh] = [q, k_nope, k_pe, v, keys].map(|b| self.download(b));
            let mut o = vec![0f32; out.len()];
            dsa::mla_attention_sparse(&qh, &kn, &kp, &vh, shape, &kh, top_k, &mut o);
            let u = self.upload(&o);
            self.copy(&u, 0, out, 0, o.len());
            return;
        }
        // The rows every cache holds: a listed position past them is dropped as padding is.
        let widths = [
            (k_nope, shape.n_heads * shape.nope),
            (k_pe, shape.rope),
            (v, shape.n_heads * shape.v_dim),
        ];
        let rows = widths
            .iter()
            .filter(|(_, w)| *w > 0)
            .map(|(b, w)| b.len() / w)
            .min()
            .unwrap_or(0)
            .min(i32::MAX as usize);
        let args = [
            top_k as i32,
            rows as i32,
            shape.n_heads as i32,
            shape.nope as i32,
            shape.rope as i32,
            shape.v_dim as i32,
        ];
        let mut b = self.stream.launch_builder(self.func("mla_attention_sparse"));
        b.arg(dev(q))
            .arg(dev(k_nope))
            .arg(dev(k_pe))
            .arg(dev(v))
            .arg(dev(keys))
            .arg(dev_mut(out));
        for a in &args {
            b.arg(a);
        }
        b.arg(&shape.scale);
        let cfg = LaunchConfig {
            grid_dim: (slots as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: matches mla_attention_sparse in kernels/attention.cu: q [n, H·(nope+rope)], out
        // [n, H·v], keys at least n·top_k floats; the kernel reads cache rows below `rows` only,
        // which every cache holds; shared memory (q width + 2·top_k + G·v) floats, within the
        // limit the function was given at load.
        ok(unsafe { b.launch(cfg) });
    }

    /// [`Backend::layer_norm`]: a block per row (up to 256 threads), the weight and bias from the
    /// weight cache.
    pub(super) fn dsa_layer_norm(&self, x: &Buf, weight: &[f32], bias: &[f32], eps: f32, out: &mut Buf) {
        let d = weight.len();
        assert!(
            d > 0 && x.len().is_multiple_of(d) && out.len() == x.len() && bias.len() == d,
            "layer_norm: x is not [n, d] (d = weight.len()), or out or the bias does not match"
        );
        let rows = x.len() / d;
        if rows == 0 {
            return;
        }
        let (wd, bd) = (self.param(weight), self.param(bias));
        let threads = (d.div_ceil(32).clamp(1, 8) * 32) as u32;
        let di = d as i32;
        let mut b = self.stream.launch_builder(self.func("layer_norm"));
        b.arg(dev(x))
            .arg(&wd.data)
            .arg(&bd.data)
            .arg(dev_mut(out))
            .arg(&di)
            .arg(&eps);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches layer_norm in kernels/dsa.cu: x and out [rows, d], weight and bias d
        // floats, a multiple of 32 threads.
        ok(unsafe { b.launch(cfg) });
    }

    /// [`Backend::index_scores`]: a block per (token, tile of 128 keys, or 32 where that grid
    /// would have fewer than two blocks an SM: decode).
    pub(super) fn dsa_index_scores(&self, q: &Buf, k: &Buf, w: &Buf, pos0: usize, s: IndexShape, out: &mut Buf) {
        let (h, hd) = (s.n_heads, s.head_dim);
        let n = w.len() / h.max(1);
        let width = pos0 + n;
        assert!(
            q.len() == n * h * hd && out.len() == n * width && k.len() >= width * hd,
            "index_scores: q is not [n, H·D], out not [n, pos0 + n], or the key cache is short"
        );
        if out.is_empty() {
            return;
        }
        // The position is an argument: no device-position form.
        self.spoil("DSA index scores");
        if h == 0 || hd == 0 {
            ok(self.stream.memset_zeros(dev_mut(out)));
            return;
        }
        let qs = index_q_stride(hd);
        let smem = (h * qs + h) * 4;
        if !self.dsa_smem_fits(smem) || n > 65535 || width > i32::MAX as usize {
            let [qh, kh, wh] = [q, k, w].map(|b| self.download(b));
            let mut o = vec![0f32; out.len()];
            dsa::index_scores(&qh, &kh, &wh, pos0, s, &mut o);
            let u = self.upload(&o);
            self.copy(&u, 0, out, 0, o.len());
            return;
        }
        let kpb = if n * width.div_ceil(128) >= 2 * self.sms as usize {
            128
        } else {
            32
        };
        debug_assert!(kpb % IX_KG == 0);
        let args = [pos0 as i32, h as i32, hd as i32, width as i32, kpb as i32];
        let mut b = self.stream.launch_builder(self.func("index_scores"));
        b.arg(dev(q)).arg(dev(k)).arg(dev(w)).arg(dev_mut(out));
        for a in &args {
            b.arg(a);
        }
        let cfg = LaunchConfig {
            grid_dim: (width.div_ceil(kpb) as u32, n as u32, 1),
            block_dim: (IX_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        // SAFETY: matches index_scores in kernels/dsa.cu: q [n, H·D], w [n, H], out [n, width],
        // k at least width rows of D (only keys ≤ pos0 + t < width are read), kpb a multiple of
        // 4, shared memory (H·QS + H) floats within the limit the function was given at load.
        ok(unsafe { b.launch(cfg) });
    }

    /// [`Backend::fp8_groups`]: a warp per group of 128, in place.
    pub(super) fn dsa_fp8_groups(&self, x: &mut Buf, width: usize) {
        let len = x.len();
        let width = width.max(1);
        let groups = fp8_group_count(len, width);
        if groups == 0 {
            return;
        }
        let (len, width_i, groups_i) = (len as i64, width.min(i32::MAX as usize) as i32, groups as i64);
        let mut b = self.stream.launch_builder(self.func("fp8_groups"));
        b.arg(dev_mut(x)).arg(&len).arg(&width_i).arg(&groups_i);
        let warps = (IX_THREADS / 32) as usize;
        let cfg = LaunchConfig {
            grid_dim: (groups.div_ceil(warps) as u32, 1, 1),
            block_dim: (IX_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: matches fp8_groups in kernels/dsa.cu: x len floats, `groups` groups of its rows
        // of `width` (fp8_group_count), a multiple of 32 threads.
        ok(unsafe { b.launch(cfg) });
    }
}

/// A GLM-5-like MLA shape of `h` heads a rank (nope 192, rope 64, v 256, scale 1/sqrt(256)).
fn glm5_mla(h: usize) -> MlaShape {
    MlaShape {
        n_heads: h,
        nope: 192,
        rope: 64,
        v_dim: 256,
        scale: 1.0 / 16.0,
    }
}

impl CudaBackend {
    /// Sparse MLA attention against the CPU engine (`ATTN_MLA_SPARSE` cases): GLM-5's shape at TP
    /// 8 (8 heads) with the indexer's top-k of random scores (ascending, −1 padding where a row
    /// has fewer keys) for decode at a long position and prefill from 0 (every row padded at
    /// top_k 2048) and after a cache; an odd shape with padding anywhere, a repeated key and a row
    /// with no key (zeros).
    pub(super) fn check_mla_sparse(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        let cases: [(MlaShape, usize, usize, usize); 7] = [
            (glm5_mla(8), 16, 1, 2999),
            (glm5_mla(8), 2048, 1, 2999),
            (glm5_mla(8), 16, 512, 0),
            (glm5_mla(8), 2048, 512, 0),
            (glm5_mla(8), 2048, 512, 2560),
            (glm5_mla(8), 16, 512, 2560),
            (
                MlaShape {
                    n_heads: 3,
                    nope: 24,
                    rope: 8,
                    v_dim: 20,
                    scale: 0.2,
                },
                7,
                5,
                37,
            ),
        ];
        for (i, (m, top_k, n, pos0)) in cases.into_iter().enumerate() {
            let seed = 200 + 10 * i as u64;
            let t = pos0 + n;
            let (qw, kw, vw) = (m.nope + m.rope, m.n_heads * m.nope, m.n_heads * m.v_dim);
            let q = noise(n * m.n_heads * qw, seed);
            let kn = noise(t * kw, seed + 1);
            let kp = noise(t * m.rope, seed + 2);
            let v = noise(t * vw, seed + 3);
            let keys = if m.n_heads == 3 {
                // Padding first, between and last; key 3 twice; row 2 has no key (the CPU's
                // empty sum: zeros).
                let rows: [[f32; 7]; 5] = [
                    [-1.0, 0.0, 5.0, -1.0, 37.0, -1.0, 2.0],
                    [3.0, 3.0, 40.0, 38.0, -1.0, -1.0, -1.0],
                    [-1.0; 7],
                    [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 41.0],
                    [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0, 10.0],
                ];
                rows.concat()
            } else {
                let scores = noise(n * t, seed + 4);
                dsa::key_table(&dsa::select_top_k(&scores, n, pos0, top_k), top_k)
            };
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * vw);
                let [qd, knd, kpd, vd, kd] = [&q, &kn, &kp, &v, &keys].map(|x| be.upload(x));
                be.mla_attention_sparse(&qd, &knd, &kpd, &vd, m, &kd, top_k, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("ATTN_MLA_SPARSE")
                    .p("H", m.n_heads)
                    .p("nope", m.nope)
                    .p("rope", m.rope)
                    .p("v", m.v_dim)
                    .p("top_k", top_k)
                    .p("pos0", pos0)
                    .p("n", n)
                    .to_string(),
                &g,
                &c,
                1e-5,
            ));
        }
        out
    }

    /// The indexer's key LayerNorm against the CPU engine (`LAYER_NORM` cases): GLM-5's key rows
    /// (128) for decode and prefill, odd widths, rows far from zero mean.
    pub(super) fn check_layer_norm(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        for (n, d, offset) in [
            (1usize, 128usize, 0.0f32),
            (512, 128, 0.0),
            (7, 1000, 0.0),
            (3, 33, 0.0),
            (5, 128, 100.0),
        ] {
            let x: Vec<f32> = noise(n * d, 90 + d as u64).iter().map(|v| v + offset).collect();
            let (w, bias) = (noise(d, 91), noise(d, 92));
            let (g, c) = both(self, |be| {
                let mut o = be.alloc(n * d);
                be.layer_norm(&be.upload(&x), &w, &bias, 1e-6, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("LAYER_NORM")
                    .p("ne", format!("[{d},{n}]"))
                    .p("mean", offset)
                    .to_string(),
                &g,
                &c,
                1e-6,
            ));
        }
        // The weights die here; later ones may reuse their address and length.
        self.weights.lock().expect("weight map").clear();
        out
    }

    /// The indexer's scores against the CPU engine (`INDEX_SCORES` cases): GLM-5's 32 heads of 128
    /// for decode (pos0 > 0, and 0) and 512-token prefill from 0 and after a cache, over a key
    /// cache longer than the scores' width; odd shapes: head_dim not a multiple of 4, 40 heads
    /// (a second, partial chunk of 32), an odd number of float4s.
    pub(super) fn check_index_scores(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        for (i, (h, hd, n, pos0)) in [
            (32usize, 128usize, 1usize, 2999usize),
            (32, 128, 1, 0),
            (32, 128, 512, 0),
            (32, 128, 512, 1536),
            (3, 37, 5, 7),
            (40, 20, 9, 100),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 300 + 10 * i as u64;
            let s = IndexShape {
                n_heads: h,
                head_dim: hd,
            };
            let t = pos0 + n + 3;
            let q = noise(n * h * hd, seed);
            let k = noise(t * hd, seed + 1);
            let w: Vec<f32> = noise(n * h, seed + 2).iter().map(|v| v / (h as f32).sqrt()).collect();
            let (g, c) = both(self, |be| {
                let mut o = be.upload(&vec![7f32; n * (pos0 + n)]);
                let [qd, kd, wd] = [&q, &k, &w].map(|x| be.upload(x));
                be.index_scores(&qd, &kd, &wd, pos0, s, &mut o);
                be.download(&o)
            });
            out.push(compare(
                Case::new("INDEX_SCORES")
                    .p("H", h)
                    .p("D", hd)
                    .p("pos0", pos0)
                    .p("n", n)
                    .p("T", t)
                    .to_string(),
                &g,
                &c,
                1e-5,
            ));
        }
        out
    }

    /// fp8 e4m3 group rounding against the CPU engine, bit for bit (`FP8_GROUPS` cases): GLM-5's
    /// indexer q rows (32 heads of 128) and key cache rows, a width of partial groups with a short
    /// last row, values ×1e4 and ×1e-38 (subnormal scales), and groups of zeros, with an inf
    /// (left as is), with a NaN (ignored by amax, kept), and of scale 1 with a tie.
    pub(super) fn check_fp8_groups(&self) -> Vec<KernelCheck> {
        let mut out = Vec::new();
        for (len, width, kind) in [
            (4096usize, 4096usize, ""),
            (512 * 4096, 4096, ""),
            (3000 * 128, 128, ""),
            (2 * 300 + 170, 300, ""),
            (2 * 300 + 170, 300, "x1e4"),
            (2 * 300 + 170, 300, "x1e-38"),
            (640, 128, "special"),
        ] {
            let mut x = noise(len, 400 + len as u64);
            match kind {
                "x1e4" => x.iter_mut().for_each(|v| *v *= 1e4),
                "x1e-38" => x.iter_mut().for_each(|v| *v *= 1e-38),
                "special" => {
                    x[128..256].fill(0.0);
                    x[256 + 5] = f32::INFINITY;
                    x[384 + 7] = f32::NAN;
                    x[512 + 9] = -0.0;
                    x[512 + 10] = 448.0;
                    // Scale 1: a tie (17 between 16 and 18: to even, 16) and a plain value.
                    x[512 + 11] = -17.0;
                    x[512 + 12] = 0.3;
                }
                _ => {}
            }
            let (g, c) = both(self, |be| {
                let mut b = be.upload(&x);
                be.fp8_groups(&mut b, width);
                be.download(&b)
            });
            let case = Case::new("FP8_GROUPS")
                .p("ne", format!("[{width},{}]", len.div_ceil(width)))
                .p("len", len)
                .p("values", if kind.is_empty() { "noise" } else { kind })
                .to_string();
            // Bit for bit, NaN for NaN (the device's NaN payload is its canonical one, not the input's).
            let same = |a: &f32, b: &f32| a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan());
            let bits_ok = g.len() == c.len() && g.iter().zip(&c).all(|(a, b)| same(a, b));
            let r = if kind == "special" {
                compare_nonfinite(case, &g, &c, 0.0)
            } else {
                compare(case, &g, &c, 0.0)
            };
            out.push(KernelCheck {
                pass: r.pass && bits_ok,
                ..r
            });
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::{fp8_group_count, index_q_stride};
    use crate::dsa;

    #[test]
    fn fp8_groups_cover_each_row_and_a_short_last_row() {
        assert_eq!(fp8_group_count(4096, 4096), 32);
        assert_eq!(fp8_group_count(2 * 300 + 170, 300), 2 * 3 + 2);
        assert_eq!(fp8_group_count(100, 128), 1);
        assert_eq!(fp8_group_count(0, 128), 0);
        // The CPU engine's grouping agrees: 300 + 129 values are rows [300] then [129], groups
        // 128, 128, 44, 128, 1; the lone last value is its group's amax, so it keeps its sign and
        // (within the scale's rounding) its magnitude, where in a group with 448 it would not.
        assert_eq!(fp8_group_count(429, 300), 5);
        let mut x = vec![448.0f32; 429];
        x[428] = -0.01;
        dsa::fp8_groups(&mut x, 300);
        assert!((x[428] + 0.01).abs() < 1e-8, "{}", x[428]);
        let mut y = vec![448.0f32; 429];
        y[427] = -0.0005;
        dsa::fp8_groups(&mut y, 300);
        assert_eq!(
            y[427], 0.0,
            "0.0005 rounds to 0 beside 448 (e4m3's smallest step is 2^-9)"
        );
    }

    /// The kernel's e4m3 rounding (`round_fp8_e4m3` in kernels/dsa.cu: floor(log2 |x|) from the
    /// exponent bits), written on the host.
    fn kernel_round_fp8(x: f32) -> f32 {
        if x == 0.0 || !x.is_finite() {
            return x;
        }
        let a = x.abs().min(448.0);
        let e = (((a.to_bits() >> 23) & 0xff) as i32 - 127).max(-6);
        let quantum = f32::from_bits(((e - 3 + 127) as u32) << 23);
        ((a / quantum).round() * quantum).min(448.0).copysign(x)
    }

    #[test]
    fn the_kernels_e4m3_exponent_gives_the_hosts_rounding() {
        use crate::weights::round_fp8_e4m3;
        let same = |x: f32| {
            for v in [x, -x] {
                assert_eq!(kernel_round_fp8(v).to_bits(), round_fp8_e4m3(v).to_bits(), "{v:e}");
            }
        };
        // The floats next to every power of two from 2^-140 to 2^130 (where the host's log2 may
        // round up to the next integer), then every 97th float from 2^-20 to 2^10, subnormals,
        // and past 448.
        for k in -140..=130 {
            let p = 2f32.powi(k).to_bits() as i64;
            for d in -70i64..=70 {
                same(f32::from_bits((p + d).clamp(1, 0x7F7F_FFFF) as u32));
            }
        }
        let (lo, hi) = (2f32.powi(-20).to_bits(), 2f32.powi(10).to_bits());
        (lo..hi).step_by(97).for_each(|b| same(f32::from_bits(b)));
        (1..0x0080_0000u32).step_by(4099).for_each(|b| same(f32::from_bits(b)));
        [448.0f32, 449.0, 464.0, 1e30, f32::MAX, 0.0].into_iter().for_each(same);
    }

    #[test]
    fn staged_q_rows_are_an_odd_number_of_float4s() {
        for hd in [1usize, 4, 20, 37, 64, 128, 192] {
            let qs = index_q_stride(hd);
            assert!(qs >= hd && qs % 4 == 0 && (qs / 4) % 2 == 1, "hd {hd}: {qs}");
        }
        assert_eq!(index_q_stride(128), 132);
    }
}
