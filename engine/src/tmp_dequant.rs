//! TEMPORARY: a minimal dequantizer so the engine runs before `engine/src/dequant.rs` (the fast
//! path, written elsewhere) is merged. Deleted once the merge lands; the loader then calls
//! `crate::dequant::dequantize` with the same signature.

use crate::fault_dequant::{dequantize_q4k, ScaleMinOrder};
use half::{bf16, f16};
use references::GgmlType;

#[derive(Debug, thiserror::Error)]
#[error("dequantize {ty}: {msg}")]
pub struct DequantError {
    pub ty: GgmlType,
    pub msg: String,
}

fn h(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Dequantizes `dst.len()` elements of type `ty` from `src`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    let err = |msg: String| DequantError { ty, msg };
    let n = dst.len();
    match ty.bytes_for(n as u64) {
        Some(b) if b == src.len() as u64 => {}
        _ => return Err(err(format!("{} bytes do not hold {n} elements", src.len()))),
    }
    let be = ty.block_elems();
    let bb = ty.block_bytes();
    match ty {
        GgmlType::F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::BF16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
                let d = h(b, 0);
                for (o, &q) in y.iter_mut().zip(&b[2..34]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
                let d = h(b, 0);
                let (m, qh, qs) = match ty {
                    GgmlType::Q4_0 => (0.0, 0u32, &b[2..18]),
                    GgmlType::Q4_1 => (h(b, 2), 0, &b[4..20]),
                    GgmlType::Q5_0 => (0.0, u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
                    _ => (h(b, 2), u32::from_le_bytes([b[4], b[5], b[6], b[7]]), &b[8..24]),
                };
                for j in 0..16 {
                    let (mut lo, mut hi) = ((qs[j] & 0xF) as i32, (qs[j] >> 4) as i32);
                    if matches!(ty, GgmlType::Q5_0 | GgmlType::Q5_1) {
                        lo |= (((qh >> j) & 1) << 4) as i32;
                        hi |= (((qh >> (j + 16)) & 1) << 4) as i32;
                    }
                    let (lo, hi) = match ty {
                        GgmlType::Q4_0 => ((lo - 8) as f32 * d, (hi - 8) as f32 * d),
                        GgmlType::Q5_0 => ((lo - 16) as f32 * d, (hi - 16) as f32 * d),
                        _ => (lo as f32 * d + m, hi as f32 * d + m),
                    };
                    y[j] = lo;
                    y[j + 16] = hi;
                }
            }
        }
        GgmlType::Q4K => {
            if !dequantize_q4k(src, dst, ScaleMinOrder::Correct) {
                return Err(err("not whole blocks".into()));
            }
        }
        GgmlType::Q6K => {
            for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
                let d = h(b, 208);
                for half_idx in 0..2 {
                    let ql = &b[64 * half_idx..64 * half_idx + 64];
                    let qh = &b[128 + 32 * half_idx..128 + 32 * half_idx + 32];
                    let sc = &b[192 + 8 * half_idx..192 + 8 * half_idx + 8];
                    let yy = &mut y[128 * half_idx..128 * half_idx + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0xF) | (qh[l] & 3) << 4) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
                        yy[l] = d * (sc[is] as i8 as f32) * q1 as f32;
                        yy[l + 32] = d * (sc[is + 2] as i8 as f32) * q2 as f32;
                        yy[l + 64] = d * (sc[is + 4] as i8 as f32) * q3 as f32;
                        yy[l + 96] = d * (sc[is + 6] as i8 as f32) * q4 as f32;
                    }
                }
            }
        }
        GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q5K => {
            return Err(err("not in the temporary dequantizer".into()));
        }
    }
    Ok(())
}
