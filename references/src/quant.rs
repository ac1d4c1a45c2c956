//! Round-to-nearest quantizers for every supported type, used to synthesize quantized test models.
//!
//! The 32-element types follow ggml's `quantize_row_*_ref` (ggml-quants.c) step for step. The
//! k-quants use a simpler scheme than ggml's scale searches (`make_qkx2_quants`, `make_q3_quants`,
//! `make_qx_quants`): per sub-block min/max (or max-abs) round-to-nearest, then the sub-block scales
//! quantized against the super-block's largest one, and finally every value re-rounded against the
//! scale it will really be decoded with (f16 d times the integer sub-scale). The output is valid
//! ggml data (any dequantizer reads it), but not byte-identical to ggml's.
//!
//! Error bounds (tested below) are llama.cpp's tests/test-quantize-fns.cpp ones, on its data
//! `0.1 + 2 cos(i)` and with its metric `sqrt(sum of squared errors) / n`.

use crate::dequant::KVALUES_IQ4NL;
use crate::ggml_type::{GgmlType, QK_K};
use half::f16;

/// Why a buffer could not be quantized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QuantError {
    /// The element count is not a multiple of the type's block size.
    #[error("{ty}: {n_elems} elements is not a whole number of {block_elems}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n_elems: usize,
        block_elems: usize,
    },
    /// A type llmdiff reads but cannot write (the IQ and TQ types).
    #[error("{0}: llmdiff can read this type but has no quantizer for it")]
    Unsupported(GgmlType),
}

/// True for the types [`quantize`] can write (all but the lattice IQ1_S … IQ3_S).
pub fn can_quantize(ty: GgmlType) -> bool {
    quantize(ty, &vec![0.0; ty.block_elems()]).is_ok()
}

/// Quantizes `src` (a whole number of blocks) to `ty`.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let be = ty.block_elems();
    if !src.len().is_multiple_of(be) {
        return Err(QuantError::PartialBlock {
            ty,
            n_elems: src.len(),
            block_elems: be,
        });
    }
    let mut out = vec![0u8; src.len() / be * ty.block_bytes()];
    let block: fn(&[f32], &mut [u8]) = match ty {
        GgmlType::IQ1S
        | GgmlType::IQ1M
        | GgmlType::IQ2XXS
        | GgmlType::IQ2XS
        | GgmlType::IQ2S
        | GgmlType::IQ3XXS
        | GgmlType::IQ3S => return Err(QuantError::Unsupported(ty)),
        GgmlType::IQ4NL => quant_iq4_nl,
        GgmlType::IQ4XS => quant_iq4_xs,
        GgmlType::TQ1_0 => quant_tq1_0,
        GgmlType::TQ2_0 => quant_tq2_0,
        GgmlType::MXFP4 => quant_mxfp4,
        GgmlType::F32 => |x, y| y.copy_from_slice(&x[0].to_le_bytes()),
        GgmlType::F16 => |x, y| y.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()),
        GgmlType::BF16 => |x, y| y.copy_from_slice(&f32_to_bf16(x[0]).to_le_bytes()),
        GgmlType::Q4_0 => quant_q4_0,
        GgmlType::Q4_1 => quant_q4_1,
        GgmlType::Q5_0 => quant_q5_0,
        GgmlType::Q5_1 => quant_q5_1,
        GgmlType::Q8_0 => quant_q8_0,
        GgmlType::Q2K => quant_q2_k,
        GgmlType::Q3K => quant_q3_k,
        GgmlType::Q4K => quant_q4_k,
        GgmlType::Q5K => quant_q5_k,
        GgmlType::Q6K => quant_q6_k,
    };
    for (x, y) in src.chunks_exact(be).zip(out.chunks_exact_mut(ty.block_bytes())) {
        block(x, y);
    }
    Ok(out)
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even; NaN forced quiet.
fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if u & 0x7FFF_FFFF > 0x7F80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u as u64 + (0x7FFF + ((u >> 16) & 1)) as u64) >> 16) as u16
}

/// Stores `v` as an f16 at `y[i..i + 2]` and returns the value it will be decoded as.
fn put_f16(y: &mut [u8], i: usize, v: f32) -> f32 {
    let h = f16::from_f32(v);
    y[i..i + 2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

/// The f16 nearest `v` whose magnitude is at least |v| (as f32), so that a scale derived from it
/// never makes the largest value overflow its integer range.
fn f16_at_least(v: f32) -> f32 {
    let h = f16::from_f32(v);
    if h.to_f32().abs() < v.abs() && h.is_finite() {
        f16::from_bits(h.to_bits() + 1).to_f32()
    } else {
        h.to_f32()
    }
}

/// Reciprocal, or 0 for 0 (ggml's `d ? 1.0f/d : 0.0f`).
fn recip(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// The element with the largest magnitude, sign kept (ggml's `max` in the symmetric quantizers).
fn signed_absmax(x: &[f32]) -> f32 {
    let mut best = 0.0f32;
    for &v in x {
        if v.abs() > best.abs() {
            best = v;
        }
    }
    best
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
        (lo.min(v), hi.max(v))
    })
}

/// Rounds `v` and clamps it to `lo..=hi` (NaN goes to 0 by the saturating cast, then clamped).
fn rclamp(v: f32, lo: i32, hi: i32) -> i32 {
    (v.round() as i32).clamp(lo, hi)
}

/// ggml `quantize_row_q4_0_ref`: d = max / -8, q = min(15, trunc(x / d + 8.5)).
fn quant_q4_0(x: &[f32], y: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -8.0;
    let id = recip(d);
    put_f16(y, 0, d);
    for j in 0..16 {
        let q0 = ((x[j] * id + 8.5) as i32).clamp(0, 15) as u8;
        let q1 = ((x[j + 16] * id + 8.5) as i32).clamp(0, 15) as u8;
        y[2 + j] = q0 | q1 << 4;
    }
}

/// ggml `quantize_row_q4_1_ref`: d = (max - min) / 15, m = min, q = min(15, trunc((x - min) / d + 0.5)).
fn quant_q4_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = recip(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    for j in 0..16 {
        let q0 = (((x[j] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        let q1 = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 15) as u8;
        y[4 + j] = q0 | q1 << 4;
    }
}

/// ggml `quantize_row_q5_0_ref`: d = max / -16, q = min(31, trunc(x / d + 16.5)).
fn quant_q5_0(x: &[f32], y: &mut [u8]) {
    let max = signed_absmax(x);
    let d = max / -16.0;
    let id = recip(d);
    put_f16(y, 0, d);
    let mut qh = 0u32;
    for j in 0..16 {
        let q0 = ((x[j] * id + 16.5) as i32).clamp(0, 31) as u32;
        let q1 = ((x[j + 16] * id + 16.5) as i32).clamp(0, 31) as u32;
        y[6 + j] = (q0 & 0x0F) as u8 | ((q1 & 0x0F) as u8) << 4;
        qh |= (q0 >> 4) << j | (q1 >> 4) << (j + 16);
    }
    y[2..6].copy_from_slice(&qh.to_le_bytes());
}

/// ggml `quantize_row_q5_1_ref`: d = (max - min) / 31, m = min.
fn quant_q5_1(x: &[f32], y: &mut [u8]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = recip(d);
    put_f16(y, 0, d);
    put_f16(y, 2, min);
    let mut qh = 0u32;
    for j in 0..16 {
        let q0 = (((x[j] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
        let q1 = (((x[j + 16] - min) * id + 0.5) as i32).clamp(0, 31) as u32;
        y[8 + j] = (q0 & 0x0F) as u8 | ((q1 & 0x0F) as u8) << 4;
        qh |= (q0 >> 4) << j | (q1 >> 4) << (j + 16);
    }
    y[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// gguf-py's MXFP4 quantizer: the e8m0 scale e = floor(log2(amax)) − 2 + 127 (0 for an all-zero
/// block), d = 2^(e − 128), and each value the nearest of d·kv over the doubled e2m1 codebook
/// (the first on a tie), nibbles as in Q4_0.
fn quant_mxfp4(x: &[f32], y: &mut [u8]) {
    const KV: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let e = if amax > 0.0 {
        (amax.log2().floor() - 2.0 + 127.0).clamp(0.0, 255.0) as u8
    } else {
        0
    };
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e - 1) as u32) << 23
    };
    let d = f32::from_bits(bits);
    let nearest = |v: f32| {
        let mut best = (0usize, f32::INFINITY);
        for (k, &q) in KV.iter().enumerate() {
            let err = (d * q as f32 - v).abs();
            if err < best.1 {
                best = (k, err);
            }
        }
        best.0 as u8
    };
    y[0] = e;
    for j in 0..16 {
        y[1 + j] = nearest(x[j]) | (nearest(x[j + 16]) << 4);
    }
}

/// The index of the codebook entry nearest `v` (the first on a tie).
fn nearest_code(codes: &[i8; 16], v: f32) -> u8 {
    let mut best = (0usize, f32::INFINITY);
    for (k, &c) in codes.iter().enumerate() {
        let err = (c as f32 - v).abs();
        if err < best.1 {
            best = (k, err);
        }
    }
    best.0 as u8
}

/// Nibble indexes of `x` (32 values) on the IQ4 codebook at scale `d`, packed as Q4_0 packs
/// them, and the block's squared error.
fn iq4_nibbles(x: &[f32], d: f32, qs: &mut [u8]) -> f32 {
    let id = recip(d);
    let mut err = 0.0;
    for j in 0..16 {
        let (a, b) = (
            nearest_code(&KVALUES_IQ4NL, x[j] * id),
            nearest_code(&KVALUES_IQ4NL, x[j + 16] * id),
        );
        err += (x[j] - d * KVALUES_IQ4NL[a as usize] as f32).powi(2);
        err += (x[j + 16] - d * KVALUES_IQ4NL[b as usize] as f32).powi(2);
        qs[j] = a | (b << 4);
    }
    err
}

/// The IQ4 scale of one 32-value block: the codebook is asymmetric (−127 … 113), so ggml tries
/// the extreme value at either end (d = ±max/127) and keeps the one with less squared error.
fn iq4_scale(x: &[f32]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let mut scratch = [0u8; 16];
    [amax / 127.0, -amax / 127.0]
        .into_iter()
        .map(|d| f16::from_f32(d).to_f32())
        .min_by(|&a, &b| iq4_nibbles(x, a, &mut scratch).total_cmp(&iq4_nibbles(x, b, &mut scratch)))
        .unwrap()
}

/// IQ4_NL: d (f16), qs[16]; each value the nearest of d · kvalues_iq4nl, d as [`iq4_scale`].
/// Not ggml's weighted scale search (`quantize_row_iq4_nl_impl`), so valid but not byte-identical.
fn quant_iq4_nl(x: &[f32], y: &mut [u8]) {
    let d = put_f16(y, 0, iq4_scale(x));
    iq4_nibbles(x, d, &mut y[2..18]);
}

/// IQ4_XS: d (f16), scales_h (u16), scales_l[4], qs[128]. Each 32-value sub-block's own IQ4 scale
/// becomes a 6-bit integer ls against the super-block's d = max scale / −32 (ggml's choice), and
/// its values are rounded against the scale they decode with, d · (ls − 32).
fn quant_iq4_xs(x: &[f32], y: &mut [u8]) {
    let scales: Vec<f32> = x.chunks_exact(32).map(iq4_scale).collect();
    let max = signed_absmax(&scales);
    let d = put_f16(y, 0, max / -32.0);
    let id = recip(d);
    let mut scales_h = 0u16;
    for (ib, (xb, &s)) in x.chunks_exact(32).zip(&scales).enumerate() {
        let ls = rclamp(id * s, -32, 31) + 32;
        y[4 + ib / 2] |= ((ls & 0x0F) as u8) << (4 * (ib % 2));
        scales_h |= ((ls >> 4) as u16) << (2 * ib);
        iq4_nibbles(xb, d * (ls - 32) as f32, &mut y[8 + 16 * ib..8 + 16 * (ib + 1)]);
    }
    y[2..4].copy_from_slice(&scales_h.to_le_bytes());
}

/// The ternary digit of `v` at scale `id` (1/d): 0, 1 or 2 for −1, 0, +1.
fn ternary(v: f32, id: f32) -> u8 {
    (rclamp(v * id, -1, 1) + 1) as u8
}

/// ggml `quantize_row_tq1_0_ref`: d = amax; five base-3 digits per byte, the first element the
/// most significant, stored as ceil(q · 256 / 243) so that `(byte · 3^j mod 256) · 3 >> 8` reads
/// digit j back; the last 16 values four digits a byte (× 3 to fill five).
fn quant_tq1_0(x: &[f32], y: &mut [u8]) {
    let d = put_f16(y, 52, x.iter().fold(0f32, |m, v| m.max(v.abs())));
    let id = recip(d);
    let pack = |digits: &mut dyn Iterator<Item = u8>, fill: u32| {
        let q = digits.fold(0u32, |q, t| q * 3 + t as u32) * fill;
        (q * 256).div_ceil(243) as u8
    };
    for m in 0..32 {
        y[m] = pack(&mut (0..5).map(|j| ternary(x[32 * j + m], id)), 1);
    }
    for m in 0..16 {
        y[32 + m] = pack(&mut (0..5).map(|j| ternary(x[160 + 16 * j + m], id)), 1);
    }
    for m in 0..4 {
        y[48 + m] = pack(&mut (0..4).map(|j| ternary(x[240 + 4 * j + m], id)), 3);
    }
}

/// ggml `quantize_row_tq2_0_ref`: d = amax; element 128·c + 32·j + m is bits 2j of qs[32·c + m].
fn quant_tq2_0(x: &[f32], y: &mut [u8]) {
    let d = put_f16(y, 64, x.iter().fold(0f32, |m, v| m.max(v.abs())));
    let id = recip(d);
    for c in 0..2 {
        for m in 0..32 {
            y[32 * c + m] = (0..4).fold(0u8, |b, j| b | ternary(x[128 * c + 32 * j + m], id) << (2 * j));
        }
    }
}

/// ggml `quantize_row_q8_0_ref`: d = amax / 127, q = round(x / d).
fn quant_q8_0(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = recip(d);
    put_f16(y, 0, d);
    for j in 0..32 {
        y[2 + j] = rclamp(x[j] * id, -128, 127) as i8 as u8;
    }
}

/// Asymmetric sub-block quantization shared by Q2_K, Q4_K and Q5_K: each sub-block of `sub` elements
/// gets `x ≈ (d * sc) * q - dmin * m` with q in 0..=qmax, and sc, m in 0..=smax. Writes d and dmin
/// (f16) via the returned values and fills `sc`, `m` and `q`.
struct Asym {
    d: f32,
    dmin: f32,
}

fn quant_asym(x: &[f32], sub: usize, qmax: i32, smax: i32, sc: &mut [u8], m: &mut [u8], q: &mut [u8]) -> Asym {
    let n_sub = x.len() / sub;
    let mut scales = [0.0f32; 16];
    let mut mins = [0.0f32; 16];
    for i in 0..n_sub {
        let (lo, hi) = min_max(&x[i * sub..(i + 1) * sub]);
        // The offset can only be subtracted (m >= 0, dmin >= 0), so a positive minimum counts as 0.
        let lo = lo.min(0.0);
        scales[i] = (hi - lo) / qmax as f32;
        mins[i] = -lo;
    }
    let max_scale = scales[..n_sub].iter().fold(0.0f32, |a, &v| a.max(v));
    let max_min = mins[..n_sub].iter().fold(0.0f32, |a, &v| a.max(v));
    let d = f16_at_least(max_scale / smax as f32);
    let dmin = f16_at_least(max_min / smax as f32);
    for i in 0..n_sub {
        // Round the sub-scale up rather than down, so the sub-block's top value is not clipped.
        sc[i] = ((scales[i] * recip(d)).ceil() as i32).clamp(0, smax) as u8;
        m[i] = rclamp(mins[i] * recip(dmin), 0, smax) as u8;
        let dl = d * sc[i] as f32;
        let ml = dmin * m[i] as f32;
        let idl = recip(dl);
        for j in i * sub..(i + 1) * sub {
            q[j] = rclamp((x[j] + ml) * idl, 0, qmax) as u8;
        }
    }
    Asym { d, dmin }
}

/// Symmetric sub-block quantization shared by Q3_K and Q6_K: `x ≈ (d * sc) * q` with q in
/// -qhalf..=qhalf-1 and sc a signed integer in -shalf..=shalf-1. Returns d.
fn quant_sym(x: &[f32], sub: usize, qhalf: i32, shalf: i32, sc: &mut [i8], q: &mut [i8]) -> f32 {
    let n_sub = x.len() / sub;
    let mut scales = [0.0f32; 16];
    for i in 0..n_sub {
        // As ggml: the largest-magnitude value maps to -qhalf, which has no clipping on either side.
        scales[i] = signed_absmax(&x[i * sub..(i + 1) * sub]) / -(qhalf as f32);
    }
    let max_scale = signed_absmax(&scales[..n_sub]);
    // max_scale maps to sub-scale -shalf; d is rounded up in magnitude to an f16 and the
    // sub-scales are taken against that d, so tiny (subnormal-f16) scales stay accurate.
    let d = f16_at_least(max_scale / -(shalf as f32));
    let id = recip(d);
    for i in 0..n_sub {
        sc[i] = rclamp(scales[i] * id, -shalf, shalf - 1) as i8;
        let idl = recip(d * sc[i] as f32);
        for j in i * sub..(i + 1) * sub {
            q[j] = rclamp(x[j] * idl, -qhalf, qhalf - 1) as i8;
        }
    }
    d
}

/// Q2_K: 16 sub-blocks of 16, 4-bit scale and min per sub-block, 2-bit values.
fn quant_q2_k(x: &[f32], y: &mut [u8]) {
    let (mut sc, mut m, mut q) = ([0u8; 16], [0u8; 16], [0u8; QK_K]);
    let a = quant_asym(x, 16, 3, 15, &mut sc, &mut m, &mut q);
    for i in 0..16 {
        y[i] = sc[i] | m[i] << 4;
    }
    // Element 128h + 32s + l lives in bits 2s of qs[32h + l].
    for h in 0..2 {
        for l in 0..32 {
            let mut b = 0u8;
            for s in 0..4 {
                b |= q[128 * h + 32 * s + l] << (2 * s);
            }
            y[16 + 32 * h + l] = b;
        }
    }
    put_f16(y, 80, a.d);
    put_f16(y, 82, a.dmin);
}

/// Q3_K: 16 sub-blocks of 16, 6-bit signed scales (offset 32), 3-bit values (offset 4).
fn quant_q3_k(x: &[f32], y: &mut [u8]) {
    let (mut sc, mut q) = ([0i8; 16], [0i8; QK_K]);
    let d = quant_sym(x, 16, 4, 32, &mut sc, &mut q);
    y[..110].fill(0);
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let v = (q[128 * h + 32 * s + l] + 4) as u8; // 0..=7
                y[32 + 32 * h + l] |= (v & 3) << (2 * s);
                y[l] |= (v >> 2) << (4 * h + s); // hmask
            }
        }
    }
    for i in 0..16 {
        let u = (sc[i] + 32) as u8; // 0..=63
        if i < 8 {
            y[96 + i] |= u & 0x0F;
        } else {
            y[96 + i - 8] |= (u & 0x0F) << 4;
        }
        y[96 + 8 + i % 4] |= (u >> 4) << (2 * (i / 4));
    }
    put_f16(y, 108, d);
}

/// Packs eight 6-bit scales and mins the way ggml's `get_scale_min_k4` unpacks them.
fn pack_k4_scales(sc: &[u8], m: &[u8], s: &mut [u8]) {
    s[..12].fill(0);
    for j in 0..8 {
        if j < 4 {
            s[j] = sc[j];
            s[j + 4] = m[j];
        } else {
            s[j + 4] = (sc[j] & 0x0F) | (m[j] & 0x0F) << 4;
            s[j - 4] |= (sc[j] >> 4) << 6;
            s[j] |= (m[j] >> 4) << 6;
        }
    }
}

/// Q4_K: 8 sub-blocks of 32, 6-bit scales and mins, 4-bit values.
fn quant_q4_k(x: &[f32], y: &mut [u8]) {
    let (mut sc, mut m, mut q) = ([0u8; 16], [0u8; 16], [0u8; QK_K]);
    let a = quant_asym(x, 32, 15, 63, &mut sc, &mut m, &mut q);
    put_f16(y, 0, a.d);
    put_f16(y, 2, a.dmin);
    pack_k4_scales(&sc, &m, &mut y[4..16]);
    for c in 0..4 {
        for l in 0..32 {
            y[16 + 32 * c + l] = q[64 * c + l] | q[64 * c + 32 + l] << 4;
        }
    }
}

/// Q5_K: as Q4_K with a fifth bit per value in qh (bit sb of qh[l]).
fn quant_q5_k(x: &[f32], y: &mut [u8]) {
    let (mut sc, mut m, mut q) = ([0u8; 16], [0u8; 16], [0u8; QK_K]);
    let a = quant_asym(x, 32, 31, 63, &mut sc, &mut m, &mut q);
    put_f16(y, 0, a.d);
    put_f16(y, 2, a.dmin);
    pack_k4_scales(&sc, &m, &mut y[4..16]);
    y[16..48].fill(0);
    for sb in 0..8 {
        for l in 0..32 {
            y[16 + l] |= (q[32 * sb + l] >> 4) << sb;
        }
    }
    for c in 0..4 {
        for l in 0..32 {
            y[48 + 32 * c + l] = (q[64 * c + l] & 0x0F) | (q[64 * c + 32 + l] & 0x0F) << 4;
        }
    }
}

/// Q6_K: 16 sub-blocks of 16, i8 scales, 6-bit values (offset 32).
fn quant_q6_k(x: &[f32], y: &mut [u8]) {
    let (mut sc, mut q) = ([0i8; 16], [0i8; QK_K]);
    let d = quant_sym(x, 16, 32, 128, &mut sc, &mut q);
    y[..208].fill(0);
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                let v = (q[128 * h + 32 * k + l] + 32) as u8; // 0..=63
                y[64 * h + 32 * (k % 2) + l] |= (v & 0x0F) << (4 * (k / 2));
                y[128 + 32 * h + l] |= (v >> 4) << (2 * k);
            }
        }
    }
    for i in 0..16 {
        y[192 + i] = sc[i] as u8;
    }
    put_f16(y, 208, d);
}

#[cfg(test)]
mod mxfp4_tests {
    use super::*;
    use crate::dequant::dequantize_to_vec;

    /// Values on the codebook come back exactly; others within a quarter of the block max; the
    /// scale byte is gguf-py's (amax 6 → floor(log2 6) − 2 + 127 = 127).
    #[test]
    fn mxfp4_round_trips() {
        let exact: Vec<f32> = (0..32)
            .map(|i| [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -4.0, 6.0][i % 8])
            .collect();
        let q = quantize(GgmlType::MXFP4, &exact).unwrap();
        assert_eq!(q[0], 127);
        assert_eq!(dequantize_to_vec(GgmlType::MXFP4, &q).unwrap(), exact);
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.013).collect();
        let y = dequantize_to_vec(GgmlType::MXFP4, &quantize(GgmlType::MXFP4, &x).unwrap()).unwrap();
        for (xb, yb) in x.chunks(32).zip(y.chunks(32)) {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(
                xb.iter().zip(yb).all(|(a, b)| (a - b).abs() <= 0.25 * amax),
                "{xb:?} {yb:?}"
            );
        }
        assert_eq!(quantize(GgmlType::MXFP4, &[0.0; 32]).unwrap(), vec![0u8; 17]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dequant::dequantize_to_vec;
    use proptest::prelude::*;

    /// llama.cpp test-quantize-fns.cpp: MAX_QUANTIZATION_TOTAL_ERROR (0.002) for everything but
    /// Q2_K (_2BITS, 0.0075) and Q3_K (_3BITS, 0.0040).
    fn llama_cpp_bound(ty: GgmlType) -> f64 {
        match ty {
            GgmlType::Q2K => 0.0075,
            GgmlType::Q3K => 0.0040,
            _ => 0.002,
        }
    }

    /// test-quantize-fns.cpp's `array_rmse`: sqrt(sum of squares) / n (sic).
    fn llama_cpp_error(a: &[f32], b: &[f32]) -> f64 {
        let sum: f64 = a.iter().zip(b).map(|(&x, &y)| (x as f64 - y as f64).powi(2)).sum();
        sum.sqrt() / a.len() as f64
    }

    /// Every type `quantize` writes: the 13 plain ones, IQ4_NL, IQ4_XS, MXFP4, TQ1_0, TQ2_0.
    fn writable() -> impl Iterator<Item = GgmlType> {
        GgmlType::ALL
            .into_iter()
            .chain(GgmlType::DEQUANT_ONLY)
            .filter(|&t| can_quantize(t))
    }

    #[test]
    fn writable_types() {
        assert_eq!(writable().count(), 18);
        assert!(!can_quantize(GgmlType::IQ2XXS));
        // Values on the IQ4 codebook come back exactly (d = 1/8 is exact in f16).
        let x: Vec<f32> = (0..32)
            .map(|i| [-127.0, -65.0, 1.0, 38.0, 113.0, -10.0, 89.0, 0.0][i % 8] / 8.0)
            .collect();
        let x: Vec<f32> = x.into_iter().map(|v| if v == 0.0 { 1.0 / 8.0 } else { v }).collect();
        assert_eq!(round_trip(GgmlType::IQ4NL, &x), x);
        // Ternary values come back exactly from both packings.
        let t: Vec<f32> = (0..256).map(|i| [0.5, -0.5, 0.0][(i * 7 + i / 5) % 3]).collect();
        assert_eq!(round_trip(GgmlType::TQ1_0, &t), t);
        assert_eq!(round_trip(GgmlType::TQ2_0, &t), t);
    }

    fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let q = quantize(ty, x).unwrap();
        assert_eq!(q.len() as u64, ty.bytes_for(x.len() as u64).unwrap());
        dequantize_to_vec(ty, &q).unwrap()
    }

    #[test]
    fn round_trip_error_within_llama_cpp_bounds() {
        // test-quantize-fns.cpp: test_size = 32 * 128, data 0.1 + 2 cos(i + offset), offset 0.
        // The ternary types are not held to it (llama.cpp's test skips them too).
        let x: Vec<f32> = (0..32 * 128).map(|i| 0.1 + 2.0 * (i as f32).cos()).collect();
        for ty in writable().filter(|t| !matches!(t, GgmlType::TQ1_0 | GgmlType::TQ2_0)) {
            let err = llama_cpp_error(&x, &round_trip(ty, &x));
            eprintln!("{ty:5} error {err:.6} (bound {})", llama_cpp_bound(ty));
            assert!(
                err < llama_cpp_bound(ty),
                "{ty}: error {err} >= {}",
                llama_cpp_bound(ty)
            );
        }
    }

    #[test]
    fn more_bits_means_less_error() {
        let x: Vec<f32> = (0..4096).map(|i| 0.1 + 2.0 * (i as f32 * 0.37).sin()).collect();
        let e = |ty| llama_cpp_error(&x, &round_trip(ty, &x));
        let order = [
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
        ];
        for w in order.windows(2) {
            assert!(
                e(w[0]) > e(w[1]),
                "{} ({}) should be worse than {} ({})",
                w[0],
                e(w[0]),
                w[1],
                e(w[1])
            );
        }
        assert!(e(GgmlType::Q4_0) > e(GgmlType::Q5_0) && e(GgmlType::Q4_1) > e(GgmlType::Q5_1));
        assert_eq!(e(GgmlType::F32), 0.0);
    }

    #[test]
    fn exact_values_survive() {
        // Values on the quantization grid come back exactly.
        let x: Vec<f32> = (0..32).map(|i| (i as f32 - 16.0) * 0.25).collect();
        let x8: Vec<f32> = (0..32).map(|i| (i as f32 * 8.0 - 127.0) * 0.25).collect(); // d = 127 * 0.25 / 127
        assert_eq!(round_trip(GgmlType::Q8_0, &x8), x8);
        assert_eq!(round_trip(GgmlType::Q5_0, &x), x); // d = -4 / -16 = 0.25 exactly
        assert_eq!(round_trip(GgmlType::F16, &x), x);
        assert_eq!(round_trip(GgmlType::BF16, &x), x);
        let zeros = vec![0.0f32; 256];
        for ty in writable() {
            assert!(round_trip(ty, &zeros).iter().all(|&v| v == 0.0), "{ty}");
        }
    }

    #[test]
    fn bad_length_is_an_error_and_odd_inputs_do_not_panic() {
        assert!(matches!(
            quantize(GgmlType::Q4K, &[0.0; 255]),
            Err(QuantError::PartialBlock { .. })
        ));
        assert_eq!(quantize(GgmlType::Q4_0, &[]).unwrap(), Vec::<u8>::new());
        let nasty = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::MIN_POSITIVE,
            -0.0,
            1e-45,
            3.0,
        ];
        let x: Vec<f32> = (0..256).map(|i| nasty[i % nasty.len()]).collect();
        for ty in writable() {
            let q = quantize(ty, &x).unwrap();
            assert_eq!(q.len() as u64, ty.bytes_for(256).unwrap(), "{ty}");
        }
        assert_eq!(
            f32_to_bf16(f32::from_bits(0x7F80_0001)) & 0x7FC0,
            0x7FC0,
            "NaN stays NaN, quiet"
        );
        assert_eq!(f32_to_bf16(1.0 + 2f32.powi(-8)), 0x3F80, "ties to even");
    }

    /// Largest allowed |error| per element, as a fraction of the block's largest |value|.
    fn max_err_frac(ty: GgmlType) -> f32 {
        match ty {
            GgmlType::F32 => 0.0,
            GgmlType::F16 => 1.0 / 1024.0,
            GgmlType::BF16 => 1.0 / 128.0,
            GgmlType::Q8_0 => 1.0 / 127.0,
            // max maps to -8; +max clips to 7, one step (max / 8) away.
            GgmlType::Q4_0 => 1.0 / 8.0 + 1e-3,
            GgmlType::Q5_0 => 1.0 / 16.0 + 1e-3,
            // Half a step of range / 15 (range <= 2 max), plus the f16 rounding (relative 2^-11) of
            // m (|m| <= max) and of d times q (d * 15 <= 2 max): 3 * 2^-11 in all.
            GgmlType::Q4_1 => 1.0 / 15.0 + 3.0 / 2048.0,
            GgmlType::Q5_1 => 1.0 / 31.0 + 3.0 / 2048.0,
            // k-quants, asymmetric: half a sub-block step (range / qmax, range <= 2 max) plus the
            // error of the quantized sub-scale and min.
            GgmlType::Q2K => 0.5,
            GgmlType::Q4K => 0.12,
            GgmlType::Q5K => 0.06,
            // Symmetric (as Q4_0): the largest |value| maps to -qhalf, so its opposite clips to
            // qhalf - 1, one step (max / qhalf) away; plus sub-scale rounding.
            GgmlType::Q3K => 0.3,
            GgmlType::Q6K => 1.0 / 32.0 + 0.01,
            // The top step of the e2m1 codebook (8 → 12, doubled) is a quarter of the block's
            // scale range: half of it, relative to amax ≥ 2^k, is at most 1/4.
            GgmlType::MXFP4 => 0.25,
            // The codebook's widest gap (89 → 113) halved, or the far end's shortfall (113 against
            // 127) when the extreme value sits at the other end; plus the f16 scale.
            GgmlType::IQ4NL => 14.0 / 127.0 + 1.0 / 1024.0,
            // As IQ4_NL per sub-block, with a sub-scale that may fall short by a step of
            // d = max scale / −32: the 6-bit range is −32 … 31, so a sub-block whose scale has
            // the opposite sign gets at most 31/32 of it. Worst: 1 − (113/127)(31/32).
            GgmlType::IQ4XS => 1.0 - (113.0 / 127.0) * (31.0 / 32.0) + 1.0 / 1024.0,
            // Ternary at d = amax: a value halfway between 0 and d is half the block max away.
            GgmlType::TQ1_0 | GgmlType::TQ2_0 => 0.5 + 1.0 / 1024.0,
            GgmlType::IQ1S
            | GgmlType::IQ1M
            | GgmlType::IQ2XXS
            | GgmlType::IQ2XS
            | GgmlType::IQ2S
            | GgmlType::IQ3XXS
            | GgmlType::IQ3S => unreachable!("{ty} has no quantizer"),
        }
    }

    /// Largest allowed |error| per element, absolute, from storing the block scale as f16 after
    /// quantizing with the unrounded one (as ggml's Q4_0..Q8_0 do; F16 rounds each value). Below
    /// f16's normal range (6.1e-5: a Q8_0 block max under ~8e-3) the scale's rounding error is not
    /// relative but up to half the subnormal spacing, 2^-25, times |q| (up to 128 for Q8_0), which
    /// can exceed the half step of slack left in the relative bound. The k-quants re-quantize with
    /// the stored scale, so theirs is a relative error already in `max_err_frac`.
    fn max_err_f16_scale(ty: GgmlType) -> f32 {
        let q_max = match ty {
            GgmlType::F16 => 1.0,
            GgmlType::Q4_0 => 8.0,
            GgmlType::Q4_1 | GgmlType::Q5_0 => 16.0,
            GgmlType::Q5_1 => 32.0,
            GgmlType::Q8_0 => 128.0,
            // The scale times the codebook's 127 (IQ4_XS: times its sub-scale's 32 too), or the
            // ternary types' 1.
            GgmlType::IQ4NL => 127.0,
            GgmlType::IQ4XS => 32.0 * 127.0,
            GgmlType::TQ1_0 | GgmlType::TQ2_0 => 1.0,
            _ => 0.0,
        };
        q_max * 2f32.powi(-25)
    }

    /// The Q8_0 block proptest found on CI (seed in proptest-regressions/quant.txt): block max
    /// 8.287e-4, so d = 6.525e-6 is an f16 subnormal, stored as 109 · 2^-24 = 6.497e-6; -8.254e-4
    /// quantizes to q = -126 and comes back as -8.186e-4, 6.8e-6 away: more than d (the relative
    /// bound), less than d + 128 · 2^-25.
    #[test]
    fn q8_0_subnormal_scale_error_is_within_the_f16_allowance() {
        let amax = 8.287101e-4f32;
        let mut x = vec![0.0f32; 32];
        x[0] = amax;
        x[1] = -8.253985e-4;
        let y = round_trip(GgmlType::Q8_0, &x);
        let err = (y[1] - x[1]).abs();
        assert!(err > max_err_frac(GgmlType::Q8_0) * amax, "{err}");
        assert!(
            err <= max_err_frac(GgmlType::Q8_0) * amax + max_err_f16_scale(GgmlType::Q8_0),
            "{err}"
        );
    }

    proptest! {
        #[test]
        fn prop_round_trip_error_is_bounded(
            ty_idx in 0usize..18,
            scale in prop_oneof![Just(1e-3f32), Just(1.0f32), Just(100.0f32)],
            raw in prop::collection::vec(-1.0f32..1.0, 512),
        ) {
            let ty = writable().nth(ty_idx).unwrap();
            let x: Vec<f32> = raw.iter().map(|v| v * scale).collect();
            let y = round_trip(ty, &x);
            let be = ty.block_elems().max(32);
            for (xb, yb) in x.chunks(be).zip(y.chunks(be)) {
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                for (a, b) in xb.iter().zip(yb) {
                    prop_assert!(
                        (a - b).abs() <= max_err_frac(ty) * amax + max_err_f16_scale(ty) + 1e-7 * scale,
                        "{}: {} -> {} (block max {})", ty, a, b, amax
                    );
                }
            }
        }
    }
}
