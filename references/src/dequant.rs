//! Reference dequantization: scalar code written straight from ggml's block layouts
//! (ggml-common.h, `dequantize_row_*` in ggml-quants.c) and checked bit for bit against the oracle,
//! gguf-py's numpy `gguf.quants.dequantize`.
//!
//! Every float operation is done in `f32`, in the order gguf-py's numpy code does it (e.g. Q4_1 is
//! `(d * q) + m`, the k-quants `(d * sc) * q - (dmin * m)`), with no fused multiply-add. In fact, for
//! these formats the order cannot change a bit: d and dmin are f16 (11 significant bits) and the
//! integer factors are small, so `d * sc` and `d * sc * q` are exact in f32 for every type except
//! Q6_K, where `(d * sc) * q` rounds once whichever way it is grouped; each result then has at most
//! one rounding (the final add or subtract), so an FMA or another grouping gives the same bits, and
//! ggml's C (which evaluates `d * sc * q` left to right as well) agrees with gguf-py. inf/NaN
//! propagate identically too (`inf * 0` is NaN in every grouping). Only NaN payloads can differ
//! (the `half` crate may quiet a signalling NaN; numpy may not).
//!
//! This code is meant to be read, not to be fast: one function per type, one block at a time. The
//! engine has its own fast path (`engine::dequant`), tested against this one.

use crate::ggml_type::{GgmlType, QK_K};
use half::f16;
use rayon::prelude::*;

mod iq;

/// Why a buffer could not be dequantized.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DequantError {
    /// The element count is not a multiple of the type's block size.
    #[error("{ty}: {n_elems} elements is not a whole number of {block_elems}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        n_elems: usize,
        block_elems: usize,
    },
    /// The source has the wrong number of bytes for the requested element count.
    #[error("{ty}: {n_elems} elements need {expected} bytes of source, got {got}")]
    SourceLength {
        ty: GgmlType,
        n_elems: usize,
        expected: u64,
        got: usize,
    },
    /// The source is not a whole number of blocks (for [`dequantize_to_vec`]).
    #[error("{ty}: {got} bytes is not a whole number of {block_bytes}-byte blocks")]
    PartialSourceBlock {
        ty: GgmlType,
        got: usize,
        block_bytes: usize,
    },
}

/// Dequantizes `dst.len()` elements of type `ty` from `src` into `dst`.
///
/// `dst.len()` must be a whole number of blocks and `src.len()` must be exactly
/// `ty.bytes_for(dst.len())`; otherwise an error is returned and `dst` is left untouched.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    let n = dst.len();
    let expected = ty.bytes_for(n as u64).ok_or(DequantError::PartialBlock {
        ty,
        n_elems: n,
        block_elems: ty.block_elems(),
    })?;
    if expected != src.len() as u64 {
        return Err(DequantError::SourceLength {
            ty,
            n_elems: n,
            expected,
            got: src.len(),
        });
    }
    let block: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => block_f32,
        GgmlType::F16 => block_f16,
        GgmlType::BF16 => block_bf16,
        GgmlType::Q4_0 => block_q4_0,
        GgmlType::Q4_1 => block_q4_1,
        GgmlType::Q5_0 => block_q5_0,
        GgmlType::Q5_1 => block_q5_1,
        GgmlType::Q8_0 => block_q8_0,
        GgmlType::Q2K => block_q2_k,
        GgmlType::Q3K => block_q3_k,
        GgmlType::Q4K => block_q4_k,
        GgmlType::Q5K => block_q5_k,
        GgmlType::Q6K => block_q6_k,
        GgmlType::IQ4NL => block_iq4_nl,
        GgmlType::IQ4XS => block_iq4_xs,
        GgmlType::MXFP4 => block_mxfp4,
        GgmlType::IQ1S => iq::block_iq1_s,
        GgmlType::IQ1M => iq::block_iq1_m,
        GgmlType::IQ2XXS => iq::block_iq2_xxs,
        GgmlType::IQ2XS => iq::block_iq2_xs,
        GgmlType::IQ2S => iq::block_iq2_s,
        GgmlType::IQ3XXS => iq::block_iq3_xxs,
        GgmlType::IQ3S => iq::block_iq3_s,
        GgmlType::TQ1_0 => iq::block_tq1_0,
        GgmlType::TQ2_0 => iq::block_tq2_0,
    };
    for (x, y) in src
        .chunks_exact(ty.block_bytes())
        .zip(dst.chunks_exact_mut(ty.block_elems()))
    {
        block(x, y);
    }
    Ok(())
}

/// Dequantizes a whole buffer of type `ty`: `src.len() / block_bytes * block_elems` elements.
/// `src.len()` must be a whole number of blocks.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8]) -> Result<Vec<f32>, DequantError> {
    if !src.len().is_multiple_of(ty.block_bytes()) {
        return Err(DequantError::PartialSourceBlock {
            ty,
            got: src.len(),
            block_bytes: ty.block_bytes(),
        });
    }
    let mut out = vec![0.0f32; src.len() / ty.block_bytes() * ty.block_elems()];
    // Blocks are independent: runs of them go to rayon tasks.
    const BLOCKS_PER_TASK: usize = 64;
    src.par_chunks(BLOCKS_PER_TASK * ty.block_bytes())
        .zip(out.par_chunks_mut(BLOCKS_PER_TASK * ty.block_elems()))
        .try_for_each(|(src, dst)| dequantize(ty, src, dst))?;
    Ok(out)
}

/// The little-endian f16 at `b[i..i + 2]`, widened to f32 (exactly; NaN stays NaN).
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

fn block_f32(x: &[u8], y: &mut [f32]) {
    // gguf-py: `data.view(np.float32)`: the bits as they are.
    y[0] = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
}

fn block_f16(x: &[u8], y: &mut [f32]) {
    // gguf-py: `data.view(np.float16).astype(np.float32)`.
    y[0] = f16_at(x, 0);
}

fn block_bf16(x: &[u8], y: &mut [f32]) {
    // gguf-py: `(int16 -> int32) << 16` viewed as f32: the bf16 bits are the high half.
    y[0] = f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16);
}

/// Q4_0: d, qs[16]. Element j < 16 is the low nibble of qs[j], j + 16 the high one. y = d * (q - 8).
/// IQ4_NL's (and IQ4_XS's) 16-value codebook (ggml's `kvalues_iq4nl`).
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];

/// IQ4_NL: d, qs[16]. y[j] = d · kv[low nibble of qs[j]], y[j+16] = d · kv[high nibble].
fn block_iq4_nl(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

/// IQ4_XS: d, scales_h (u16), scales_l[4], qs[128]; 8 sub-blocks of 32 with 6-bit scales
/// ls = low nibble of scales_l[ib/2] (by ib%2) | 2 bits of scales_h << 4; dl = d·(ls − 32)
/// (gguf-py: `(d * scales) * kv`, two f32 roundings).
fn block_iq4_xs(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let scales_h = u16::from_le_bytes([x[2], x[3]]);
    let scales_l = &x[4..8];
    for ib in 0..QK_K / 32 {
        let lo = (scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F;
        let hi = ((scales_h >> (2 * ib)) & 3) as u8;
        let dl = d * ((lo | (hi << 4)) as i32 - 32) as f32;
        let qs = &x[8 + 16 * ib..8 + 16 * (ib + 1)];
        let yb = &mut y[32 * ib..32 * (ib + 1)];
        for j in 0..16 {
            yb[j] = dl * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
            yb[j + 16] = dl * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
        }
    }
}

/// MXFP4's e2m1 values, doubled (ggml's `kvalues_mxfp4`); the scale is halved to match.
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e − 128) as f32 bits (subnormal for e < 2).
fn e8m0_to_fp32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e - 1) as u32) << 23
    };
    f32::from_bits(bits)
}

/// MXFP4: e (e8m0), qs[16]. y[j] = d · kv[low nibble], y[j+16] = d · kv[high nibble].
fn block_mxfp4(x: &[u8], y: &mut [f32]) {
    let d = e8m0_to_fp32_half(x[0]);
    let qs = &x[1..17];
    for j in 0..16 {
        y[j] = d * KVALUES_MXFP4[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_MXFP4[(qs[j] >> 4) as usize] as f32;
    }
}

fn block_q4_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..18];
    for j in 0..16 {
        y[j] = d * ((qs[j] & 0x0F) as i32 - 8) as f32;
        y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// Q4_1: d, m, qs[16]. y = d * q + m (gguf-py: `(d * qs) + m`, two f32 roundings).
fn block_q4_1(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let m = f16_at(x, 2);
    let qs = &x[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0x0F) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

/// Q5_0: d, qh[4] (a little-endian u32; bit j is bit 4 of element j), qs[16]. y = d * (q - 16).
fn block_q5_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let qs = &x[6..22];
    for j in 0..16 {
        let lo = (qs[j] & 0x0F) as u32 | ((qh >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (lo as i32 - 16) as f32;
        y[j + 16] = d * (hi as i32 - 16) as f32;
    }
}

/// Q5_1: d, m, qh[4], qs[16]. y = d * q + m.
fn block_q5_1(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let m = f16_at(x, 2);
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    let qs = &x[8..24];
    for j in 0..16 {
        let lo = (qs[j] & 0x0F) as u32 | ((qh >> j) & 1) << 4;
        let hi = (qs[j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * lo as f32 + m;
        y[j + 16] = d * hi as f32 + m;
    }
}

/// Q8_0: d, i8 qs[32]. y = q * d.
fn block_q8_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for j in 0..32 {
        y[j] = (x[2 + j] as i8) as f32 * d;
    }
}

/// Q2_K: scales[16] (low nibble: scale, high nibble: min), qs[64], d, dmin.
/// Two halves of 128; in half h, shift s (0, 2, 4, 6) gives elements 128h + 32(s/2) + l from
/// qs[32h + l]. Sub-block (16 elements) i uses scales[i].
/// y = (d * sc) * q - (dmin * m), as gguf-py (`dl * qs - ml`) and ggml C.
fn block_q2_k(x: &[u8], y: &mut [f32]) {
    let scales = &x[0..16];
    let qs = &x[16..80];
    let d = f16_at(x, 80);
    let dmin = f16_at(x, 82);
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * s + l;
                let sc = scales[e / 16];
                let dl = d * (sc & 0x0F) as f32;
                let ml = dmin * (sc >> 4) as f32;
                let q = (qs[32 * h + l] >> (2 * s)) & 3;
                y[e] = dl * q as f32 - ml;
            }
        }
    }
}

/// The 16 six-bit Q3_K scales, unbiased (-32..=31). Bytes 0..8 hold the low nibbles (scale i < 8
/// in the low nibble of byte i, scale i >= 8 in the high nibble of byte i - 8); bytes 8..12 hold the
/// top two bits (scale i in bits 2(i/4).. of byte 8 + i%4).
fn q3_k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for i in 0..16 {
        let low = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        out[i] = (low | high << 4) as i8 - 32;
    }
    out
}

/// Q3_K: hmask[32], qs[64], scales[12], d. Element e = 128h + 32s + l takes its low two bits from
/// qs[32h + l] >> 2s and its high bit from hmask[l] bit (4h + s); the value is low - 4 when that
/// bit is clear, else low. y = (d * sc) * q (gguf-py `dl * q`).
fn block_q3_k(x: &[u8], y: &mut [f32]) {
    let hmask = &x[0..32];
    let qs = &x[32..96];
    let scales = q3_k_scales(&x[96..108]);
    let d = f16_at(x, 108);
    for h in 0..2 {
        for s in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * s + l;
                let dl = d * scales[e / 16] as f32;
                let low = ((qs[32 * h + l] >> (2 * s)) & 3) as i32;
                let high_set = (hmask[l] >> (4 * h + s)) & 1 == 1;
                let q = if high_set { low } else { low - 4 };
                y[e] = dl * q as f32;
            }
        }
    }
}

/// ggml's `get_scale_min_k4`: the 6-bit scale and min of sub-block j (0..8) of a Q4_K/Q5_K block.
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K: d, dmin, scales[12], qs[128]. Chunk c (64 elements): the first 32 are the low nibbles of
/// qs[32c..32c + 32] (sub-block 2c), the next 32 the high nibbles (sub-block 2c + 1).
/// y = (d * sc) * q - (dmin * m).
fn block_q4_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let dmin = f16_at(x, 2);
    let scales = &x[4..16];
    let qs = &x[16..144];
    for sb in 0..8 {
        let (sc, m) = scale_min_k4(sb, scales);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let (c, shift) = (sb / 2, 4 * (sb % 2));
        for l in 0..32 {
            let q = (qs[32 * c + l] >> shift) & 0x0F;
            y[32 * sb + l] = d1 * q as f32 - m1;
        }
    }
}

/// Q5_K: d, dmin, scales[12], qh[32], qs[128]. As Q4_K, plus 16 when bit sb of qh[l] is set.
fn block_q5_k(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let dmin = f16_at(x, 2);
    let scales = &x[4..16];
    let qh = &x[16..48];
    let qs = &x[48..176];
    for sb in 0..8 {
        let (sc, m) = scale_min_k4(sb, scales);
        let d1 = d * sc as f32;
        let m1 = dmin * m as f32;
        let (c, shift) = (sb / 2, 4 * (sb % 2));
        for l in 0..32 {
            let q = ((qs[32 * c + l] >> shift) & 0x0F) | ((qh[l] >> sb) & 1) << 4;
            y[32 * sb + l] = d1 * q as f32 - m1;
        }
    }
}

/// Q6_K: ql[128], qh[64], i8 scales[16], d. Two halves of 128 (h); within a half, for l in 0..32:
/// element 32k + l (k = 0..4) takes its low nibble from ql[64h + 32(k % 2) + l] (low nibble for
/// k < 2, high for k >= 2) and its top two bits from qh[32h + l] >> 2k. q is that 6-bit value - 32.
/// y = (d * sc) * q (gguf-py `d * scales` first).
fn block_q6_k(x: &[u8], y: &mut [f32]) {
    let ql = &x[0..128];
    let qh = &x[128..192];
    let scales = &x[192..208];
    let d = f16_at(x, 208);
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                let e = 128 * h + 32 * k + l;
                let low = (ql[64 * h + 32 * (k % 2) + l] >> (4 * (k / 2))) & 0x0F;
                let high = (qh[32 * h + l] >> (2 * k)) & 3;
                let q = (low | high << 4) as i32 - 32;
                let dl = d * (scales[e / 16] as i8) as f32;
                y[e] = dl * q as f32;
            }
        }
    }
}

// QK_K is the super-block size every k-quant function above assumes.
const _: () = assert!(QK_K == 256);

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_le_bytes()
    }

    #[test]
    fn rejects_bad_lengths() {
        let mut dst = vec![0.0; 31];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 18], &mut dst),
            Err(DequantError::PartialBlock { .. })
        ));
        let mut dst = vec![0.0; 32];
        assert!(matches!(
            dequantize(GgmlType::Q4_0, &[0; 17], &mut dst),
            Err(DequantError::SourceLength {
                expected: 18,
                got: 17,
                ..
            })
        ));
        assert!(matches!(
            dequantize_to_vec(GgmlType::Q6K, &[0; 211]),
            Err(DequantError::PartialSourceBlock { .. })
        ));
        assert_eq!(dequantize_to_vec(GgmlType::Q6K, &[]).unwrap(), Vec::<f32>::new());
    }

    #[test]
    fn q4_0_nibble_order() {
        let mut b = vec![0u8; 18];
        b[..2].copy_from_slice(&f16_bytes(0.5));
        b[2] = 0x1F; // element 0 = 15, element 16 = 1
        let y = dequantize_to_vec(GgmlType::Q4_0, &b).unwrap();
        assert_eq!(y[0], 0.5 * 7.0);
        assert_eq!(y[16], 0.5 * -7.0);
        assert_eq!(y[1], 0.5 * -8.0);
    }

    #[test]
    fn q4_1_and_q8_0_formulas() {
        let mut b = vec![0u8; 20];
        b[..2].copy_from_slice(&f16_bytes(2.0));
        b[2..4].copy_from_slice(&f16_bytes(-1.0));
        b[4 + 3] = 0xA5;
        let y = dequantize_to_vec(GgmlType::Q4_1, &b).unwrap();
        assert_eq!((y[3], y[19], y[0]), (2.0 * 5.0 - 1.0, 2.0 * 10.0 - 1.0, -1.0));

        let mut b = vec![0u8; 34];
        b[..2].copy_from_slice(&f16_bytes(0.25));
        b[2] = (-128i8) as u8;
        b[33] = 127;
        let y = dequantize_to_vec(GgmlType::Q8_0, &b).unwrap();
        assert_eq!((y[0], y[31], y[5]), (-32.0, 31.75, 0.0));
    }

    #[test]
    fn q5_high_bits() {
        let mut b = vec![0u8; 22];
        b[..2].copy_from_slice(&f16_bytes(1.0));
        b[2..6].copy_from_slice(&(1u32 << 3 | 1u32 << 20).to_le_bytes());
        let y = dequantize_to_vec(GgmlType::Q5_0, &b).unwrap();
        assert_eq!((y[3], y[20], y[0]), (0.0, 0.0, -16.0));
    }

    #[test]
    fn bf16_and_f16() {
        let y = dequantize_to_vec(GgmlType::BF16, &[0x80, 0x3F, 0x00, 0xC0]).unwrap();
        assert_eq!(y, vec![1.0, -2.0]);
        let y = dequantize_to_vec(GgmlType::F16, &[0x00, 0x3C, 0x01, 0x00]).unwrap();
        assert_eq!(y, vec![1.0, 2f32.powi(-24)]);
    }

    #[test]
    fn q3_k_scales_unpack() {
        // Scale 0 = low nibble 0x5 of byte 0 | (byte 8 bits 0..2 = 2) << 4 = 0x25 = 37 -> 5.
        // Scale 9 = high nibble of byte 1 (0xA) | (byte 9 bits 4..6 = 3) << 4 = 0x3A = 58 -> 26.
        let mut s = [0u8; 12];
        s[0] = 0x05;
        s[8] = 0x02;
        s[1] = 0xA0;
        s[9] = 0x30;
        let sc = q3_k_scales(&s);
        assert_eq!(sc[0], 5);
        assert_eq!(sc[9], 26);
        assert_eq!(sc[1], -32);
    }

    #[test]
    fn q4_k_scale_min_high_subblocks() {
        let mut s = [0u8; 12];
        s[0] = 0b11_000001; // scale 0 = 1; its top two bits are scale 4's bits 4..6
        s[4] = 0b10_000010; // min 0 = 2; its top two bits are min 4's bits 4..6
        s[8] = 0x7C; // scale 4 low nibble 0xC, min 4 low nibble 0x7
        assert_eq!(scale_min_k4(0, &s), (1, 2));
        assert_eq!(scale_min_k4(4, &s), (0xC | 3 << 4, 0x7 | 2 << 4));
    }
}
