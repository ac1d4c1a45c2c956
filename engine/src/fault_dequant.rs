//! The engine's private Q4_K decoder with a fault switch, for the `dequant-q4k-scale-min` fault:
//! the same block walk as the normal path, but `get_scale_min_k4`'s scale and min can be read
//! swapped, as a kernel that unpacks the 6-bit fields in the wrong order would. Only tensors the
//! fault is scoped to go through here; everything else uses [`crate::dequant`].
//!
//! Also the `indexer-raw-quant` path: Q8_0 blocks read as their integers without the block
//! scales ([`q8_0_raw_ints`]), what a layer built for float weights (vLLM's indexer `weights_proj`,
//! `quant_config=None`) computes with when a loader hands it the GGUF's blocks un-dequantized.

use half::f16;

/// Bytes per Q4_K block (d, dmin, scales[12], qs[128]) and elements per block.
pub const Q4K_BLOCK_BYTES: usize = 144;
pub const QK_K: usize = 256;

/// How the 6-bit scale/min pairs are unpacked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaleMinOrder {
    /// ggml's `get_scale_min_k4`.
    Correct,
    /// Scale and min exchanged (the fault).
    Swapped,
}

fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Decodes whole Q4_K blocks of `src` into `dst` (`dst.len()` = 256 · blocks). Returns `false`
/// when the lengths do not match whole blocks.
pub fn dequantize_q4k(src: &[u8], dst: &mut [f32], order: ScaleMinOrder) -> bool {
    if !dst.len().is_multiple_of(QK_K) || src.len() != dst.len() / QK_K * Q4K_BLOCK_BYTES {
        return false;
    }
    for (b, y) in src.chunks_exact(Q4K_BLOCK_BYTES).zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
        let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
        let scales = &b[4..16];
        let qs = &b[16..144];
        for c in 0..4 {
            let (mut sc0, mut m0) = scale_min_k4(2 * c, scales);
            let (mut sc1, mut m1) = scale_min_k4(2 * c + 1, scales);
            if order == ScaleMinOrder::Swapped {
                std::mem::swap(&mut sc0, &mut m0);
                std::mem::swap(&mut sc1, &mut m1);
            }
            let (d0, mn0) = (d * sc0 as f32, dmin * m0 as f32);
            let (d1, mn1) = (d * sc1 as f32, dmin * m1 as f32);
            let q = &qs[32 * c..32 * c + 32];
            for l in 0..32 {
                y[64 * c + l] = d0 * (q[l] & 0xF) as f32 - mn0;
                y[64 * c + 32 + l] = d1 * (q[l] >> 4) as f32 - mn1;
            }
        }
    }
    true
}

/// Bytes per Q8_0 block (f16 d, 32 × i8) and elements per block.
pub const Q8_0_BLOCK_BYTES: usize = 34;
pub const QK8_0: usize = 32;

/// The int8 values of whole Q8_0 blocks of `src` as f32, their scales `d` ignored. Returns
/// `false` when the lengths do not match whole blocks.
pub fn q8_0_raw_ints(src: &[u8], dst: &mut [f32]) -> bool {
    if !dst.len().is_multiple_of(QK8_0) || src.len() != dst.len() / QK8_0 * Q8_0_BLOCK_BYTES {
        return false;
    }
    for (b, y) in src.chunks_exact(Q8_0_BLOCK_BYTES).zip(dst.chunks_exact_mut(QK8_0)) {
        for (o, &q) in y.iter_mut().zip(&b[2..]) {
            *o = q as i8 as f32;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::GgmlType;

    /// Random but finite Q4_K blocks.
    fn blocks(n_blocks: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 33) as u8
        };
        let mut out = Vec::new();
        for _ in 0..n_blocks {
            out.extend_from_slice(&f16::from_f32(0.01).to_le_bytes());
            out.extend_from_slice(&f16::from_f32(0.003).to_le_bytes());
            for _ in 0..140 {
                out.push(next());
            }
        }
        out
    }

    #[test]
    fn correct_order_matches_the_engine_dequant_and_swapped_differs() {
        let src = blocks(3, 7);
        let mut fast = vec![0f32; 3 * QK_K];
        crate::dequant::dequantize(GgmlType::Q4K, &src, &mut fast).unwrap();
        let mut mine = vec![0f32; 3 * QK_K];
        assert!(dequantize_q4k(&src, &mut mine, ScaleMinOrder::Correct));
        assert_eq!(mine, fast);
        assert!(dequantize_q4k(&src, &mut mine, ScaleMinOrder::Swapped));
        assert_ne!(mine, fast);
        assert!(!dequantize_q4k(&src[1..], &mut mine, ScaleMinOrder::Swapped));
    }

    #[test]
    fn q8_0_raw_ints_drop_the_block_scale() {
        let src = references::quant::quantize(GgmlType::Q8_0, &[0.5f32, -1.0].repeat(32)).unwrap();
        let mut raw = vec![0f32; 64];
        assert!(q8_0_raw_ints(&src, &mut raw));
        let mut fast = vec![0f32; 64];
        crate::dequant::dequantize(GgmlType::Q8_0, &src, &mut fast).unwrap();
        // Each block's values are its integers times its scale d = amax / 127.
        assert_eq!(&raw[..2], &[64.0, -127.0]);
        assert!(raw.iter().zip(&fast).all(|(r, f)| (r / 127.0 - f).abs() < 1e-2));
        assert!(!q8_0_raw_ints(&src[1..], &mut raw));
    }
}
