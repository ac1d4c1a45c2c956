//! The engine's fast dequantization path: its own code, never the reference's
//! (`references::dequant` is only used by the tests below, as the oracle).
//!
//! Every type is decoded one whole block at a time by a small `#[inline(always)]` kernel over
//! fixed-size arrays, whose inner loops are branch-free so that LLVM auto-vectorizes them. The block
//! loop is compiled three times: for AVX-512 (F/BW/VL), for AVX2, and portable; the widest the CPU
//! supports is picked at run time with `is_x86_feature_detected!`.
//!
//! The results are bit-identical to the reference (and so to gguf-py): each element is computed
//! with the same f32 operations in the same order (e.g. `(d * sc) * q - dmin * m`). Rust never
//! contracts `a * b + c` into a fused multiply-add, even with FMA enabled, so vectorizing changes
//! nothing. Only NaN payloads may differ.
//!
//! The codebook, lattice and ternary types (IQ4_NL, IQ4_XS, MXFP4, IQ1_S/M, IQ2_XXS/XS/S,
//! IQ3_XXS/S, TQ1_0, TQ2_0) have no SIMD kernels yet: the plain per-type functions in `scalar`.
//!
//! Also here: [`dequantize_par`] (rayon, chunks of whole blocks) and [`dot_row`], a dot product of a
//! quantized row with an f32 vector that dequantizes on the fly, for the engine's quantized matmul.

use rayon::prelude::*;
pub use references::dequant::DequantError;

mod scalar;
use references::GgmlType;

/// Dequantizes `dst.len()` elements of type `ty` from `src` (single thread).
///
/// `dst.len()` must be a whole number of blocks and `src.len()` exactly `ty.bytes_for(dst.len())`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    check_lengths(ty, src.len(), dst.len())?;
    run(ty, src, dst);
    Ok(())
}

/// As [`dequantize`], spread over rayon's thread pool in chunks of whole blocks.
pub fn dequantize_par(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), DequantError> {
    check_lengths(ty, src.len(), dst.len())?;
    // About 64 Ki elements per task: big enough to amortize the dispatch, small enough to balance.
    let blocks_per_chunk = (1usize << 16) / ty.block_elems();
    dst.par_chunks_mut(blocks_per_chunk * ty.block_elems())
        .zip(src.par_chunks(blocks_per_chunk * ty.block_bytes()))
        .for_each(|(y, x)| run(ty, x, y));
    Ok(())
}

/// The dot product of one quantized row (`row_bytes`, type `ty`) with `x`, dequantizing block by
/// block on the fly. `x.len()` must be a whole number of blocks and `row_bytes` exactly its size.
/// Accumulates in f32 over 16 lanes, so it differs from an exact dot by normal f32 rounding.
pub fn dot_row(ty: GgmlType, row_bytes: &[u8], x: &[f32]) -> Result<f32, DequantError> {
    check_lengths(ty, row_bytes.len(), x.len())?;
    Ok(dot(ty, row_bytes, x))
}

fn check_lengths(ty: GgmlType, src_len: usize, n: usize) -> Result<(), DequantError> {
    let expected = ty.bytes_for(n as u64).ok_or(DequantError::PartialBlock {
        ty,
        n_elems: n,
        block_elems: ty.block_elems(),
    })?;
    if expected != src_len as u64 {
        return Err(DequantError::SourceLength {
            ty,
            n_elems: n,
            expected,
            got: src_len,
        });
    }
    Ok(())
}

/// Which instruction set the block loops were compiled for and picked at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Portable,
}

/// The instruction set the fast path uses on this CPU.
pub fn isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Isa::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            return Isa::Avx2;
        }
    }
    Isa::Portable
}

/// Dequantizes with the widest ISA available. Lengths are already checked.
fn run(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` checked that the CPU has every feature `run_avx512` is compiled for.
        Isa::Avx512 => unsafe { x86::run_avx512(ty, src, dst) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2 => unsafe { x86::run_avx2(ty, src, dst) },
        _ => run_generic(ty, src, dst),
    }
}

/// The dot product with the widest ISA available. Lengths are already checked.
fn dot(ty: GgmlType, src: &[u8], x: &[f32]) -> f32 {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` checked that the CPU has every feature `dot_avx512` is compiled for.
        Isa::Avx512 => unsafe { x86::dot_avx512(ty, src, x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2 => unsafe { x86::dot_avx2(ty, src, x) },
        _ => dot_generic(ty, src, x),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// AVX-512: explicit kernels for every quantized type and F16; F32/BF16 auto-vectorized.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi1,bmi2")]
    pub(super) unsafe fn run_avx512(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
        match ty {
            GgmlType::F16 => {
                blocks(src, dst, |x, y| f16_x16_avx512(x, y));
                // The tail of fewer than 16 elements.
                let n = dst.len() - dst.len() % 16;
                run_generic(ty, &src[2 * n..], &mut dst[n..]);
            }
            GgmlType::Q4_0 => blocks(src, dst, |x, y| q4_0_avx512(x, y)),
            GgmlType::Q4_1 => blocks(src, dst, |x, y| q4_1_avx512(x, y)),
            GgmlType::Q5_0 => blocks(src, dst, |x, y| q5_0_avx512(x, y)),
            GgmlType::Q5_1 => blocks(src, dst, |x, y| q5_1_avx512(x, y)),
            GgmlType::Q8_0 => blocks(src, dst, |x, y| q8_0_avx512(x, y)),
            GgmlType::Q2K => blocks(src, dst, |x, y| q2_k_avx512(x, y)),
            GgmlType::Q3K => blocks(src, dst, |x, y| q3_k_avx512(x, y)),
            GgmlType::Q4K => blocks(src, dst, |x, y| q4_k_avx512(x, y)),
            GgmlType::Q5K => blocks(src, dst, |x, y| q5_k_avx512(x, y)),
            GgmlType::Q6K => blocks(src, dst, |x, y| q6_k_avx512(x, y)),
            GgmlType::F32 | GgmlType::BF16 => run_generic(ty, src, dst),
            GgmlType::IQ4NL
            | GgmlType::IQ4XS
            | GgmlType::MXFP4
            | GgmlType::IQ1S
            | GgmlType::IQ1M
            | GgmlType::IQ2XXS
            | GgmlType::IQ2XS
            | GgmlType::IQ2S
            | GgmlType::IQ3XXS
            | GgmlType::IQ3S
            | GgmlType::TQ1_0
            | GgmlType::TQ2_0 => scalar::run(ty, src, dst),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,bmi1,bmi2")]
    pub(super) unsafe fn run_avx2(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
        run_generic(ty, src, dst)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c,bmi1,bmi2")]
    pub(super) unsafe fn dot_avx512(ty: GgmlType, src: &[u8], x: &[f32]) -> f32 {
        dot_with(ty, src, x, |ty, q, y| {
            // SAFETY: this function only runs where the AVX-512 features were detected.
            unsafe { run_avx512(ty, q, y) }
        })
    }

    #[target_feature(enable = "avx2,fma,f16c,bmi1,bmi2")]
    pub(super) unsafe fn dot_avx2(ty: GgmlType, src: &[u8], x: &[f32]) -> f32 {
        dot_with(ty, src, x, run_generic)
    }

    // The kernels below compute exactly the reference's f32 operations, in its order: integer
    // decode, exact int -> f32 conversion, then mul / add / sub as separate instructions (never FMA).

    /// 16 bytes at `p` widened to 16 u32 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn u8x16(p: &[u8; 16]) -> __m512i {
        // SAFETY: `p` is exactly 16 readable bytes.
        _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(p.as_ptr() as *const __m128i) })
    }

    #[inline]
    fn bytes16(x: &[u8], at: usize) -> &[u8; 16] {
        match <&[u8; 16]>::try_from(&x[at..at + 16]) {
            Ok(a) => a,
            Err(_) => unreachable!("a 16-byte range is 16 bytes"),
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn store16(y: &mut [f32], at: usize, v: __m512) {
        let y = &mut y[at..at + 16];
        // SAFETY: `y` is exactly 16 writable f32s.
        unsafe { _mm512_storeu_ps(y.as_mut_ptr(), v) }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn f16_x16_avx512(x: &[u8; 32], y: &mut [f32; 16]) {
        // SAFETY: 32 readable bytes = 16 halves.
        let h = unsafe { _mm256_loadu_si256(x.as_ptr() as *const __m256i) };
        store16(y, 0, _mm512_cvtph_ps(h));
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q4_0_avx512(x: &[u8; 18], y: &mut [f32; 32]) {
        let d = _mm512_set1_ps(half_at(x, 0));
        let q = u8x16(bytes16(x, 2));
        let eight = _mm512_set1_epi32(8);
        let lo = _mm512_sub_epi32(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), eight);
        let hi = _mm512_sub_epi32(_mm512_srli_epi32::<4>(q), eight);
        store16(y, 0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
        store16(y, 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q4_1_avx512(x: &[u8; 20], y: &mut [f32; 32]) {
        let d = _mm512_set1_ps(half_at(x, 0));
        let m = _mm512_set1_ps(half_at(x, 2));
        let q = u8x16(bytes16(x, 4));
        let lo = _mm512_and_si512(q, _mm512_set1_epi32(0x0F));
        let hi = _mm512_srli_epi32::<4>(q);
        store16(y, 0, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        store16(y, 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }

    /// Bit 4 of elements j = 0..16 (lo) and j + 16 (hi) of a Q5 block, from its u32 qh.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q5_high(qh: u32) -> (__m512i, __m512i) {
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let one = _mm512_set1_epi32(1);
        let lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(qh as i32), lanes), one);
        let hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32((qh >> 16) as i32), lanes), one);
        (_mm512_slli_epi32::<4>(lo), _mm512_slli_epi32::<4>(hi))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q5_0_avx512(x: &[u8; 22], y: &mut [f32; 32]) {
        let d = _mm512_set1_ps(half_at(x, 0));
        let (hlo, hhi) = q5_high(u32::from_le_bytes([x[2], x[3], x[4], x[5]]));
        let q = u8x16(bytes16(x, 6));
        let sixteen = _mm512_set1_epi32(16);
        let lo = _mm512_sub_epi32(
            _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), hlo),
            sixteen,
        );
        let hi = _mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32::<4>(q), hhi), sixteen);
        store16(y, 0, _mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)));
        store16(y, 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)));
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q5_1_avx512(x: &[u8; 24], y: &mut [f32; 32]) {
        let d = _mm512_set1_ps(half_at(x, 0));
        let m = _mm512_set1_ps(half_at(x, 2));
        let (hlo, hhi) = q5_high(u32::from_le_bytes([x[4], x[5], x[6], x[7]]));
        let q = u8x16(bytes16(x, 8));
        let lo = _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(0x0F)), hlo);
        let hi = _mm512_or_si512(_mm512_srli_epi32::<4>(q), hhi);
        store16(y, 0, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(lo)), m));
        store16(y, 16, _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(hi)), m));
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q8_0_avx512(x: &[u8; 34], y: &mut [f32; 32]) {
        let d = _mm512_set1_ps(half_at(x, 0));
        for h in 0..2 {
            let b = bytes16(x, 2 + 16 * h);
            // SAFETY: `b` is exactly 16 readable bytes.
            let q = _mm512_cvtepi8_epi32(unsafe { _mm_loadu_si128(b.as_ptr() as *const __m128i) });
            store16(y, 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(q), d));
        }
    }

    /// `(v >> shift) & mask` in every lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn bits(v: __m512i, shift: usize, mask: i32) -> __m512i {
        _mm512_and_si512(
            _mm512_srl_epi32(v, _mm_cvtsi32_si128(shift as i32)),
            _mm512_set1_epi32(mask),
        )
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q2_k_avx512(x: &[u8; 84], y: &mut [f32; 256]) {
        let d = half_at(x, 80);
        let dmin = half_at(x, 82);
        for i in 0..16 {
            let sc = x[i];
            let dl = _mm512_set1_ps(d * (sc & 0x0F) as f32);
            let ml = _mm512_set1_ps(dmin * (sc >> 4) as f32);
            let q = bits(
                u8x16(bytes16(x, 16 + 32 * (i / 8) + 16 * (i % 2))),
                2 * ((i % 8) / 2),
                3,
            );
            store16(y, 16 * i, _mm512_sub_ps(_mm512_mul_ps(dl, _mm512_cvtepi32_ps(q)), ml));
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q3_k_avx512(x: &[u8; 110], y: &mut [f32; 256]) {
        let d = half_at(x, 108);
        let s = &x[96..108];
        let four = _mm512_set1_epi32(4);
        for i in 0..16 {
            let low4 = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
            let high2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
            let dl = _mm512_set1_ps(d * ((low4 | high2 << 4) as i8 - 32) as f32);
            let (h, sh, l0) = (i / 8, (i % 8) / 2, 16 * (i % 2));
            let low = bits(u8x16(bytes16(x, 32 + 32 * h + l0)), 2 * sh, 3);
            let high = bits(u8x16(bytes16(x, l0)), 4 * h + sh, 1);
            // low + 4 * high - 4
            let q = _mm512_sub_epi32(_mm512_add_epi32(low, _mm512_slli_epi32::<2>(high)), four);
            store16(y, 16 * i, _mm512_mul_ps(dl, _mm512_cvtepi32_ps(q)));
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q4_k_avx512(x: &[u8; 144], y: &mut [f32; 256]) {
        let d = half_at(x, 0);
        let dmin = half_at(x, 2);
        let s = &x[4..16];
        for sb in 0..8 {
            let (sc, m) = k4_scale_min(s, sb);
            let d1 = _mm512_set1_ps(d * sc);
            let m1 = _mm512_set1_ps(dmin * m);
            let shift = 4 * (sb % 2);
            for half in 0..2 {
                let q = bits(u8x16(bytes16(x, 16 + 32 * (sb / 2) + 16 * half)), shift, 0x0F);
                store16(
                    y,
                    32 * sb + 16 * half,
                    _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(q)), m1),
                );
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q5_k_avx512(x: &[u8; 176], y: &mut [f32; 256]) {
        let d = half_at(x, 0);
        let dmin = half_at(x, 2);
        let s = &x[4..16];
        for sb in 0..8 {
            let (sc, m) = k4_scale_min(s, sb);
            let d1 = _mm512_set1_ps(d * sc);
            let m1 = _mm512_set1_ps(dmin * m);
            let shift = 4 * (sb % 2);
            for half in 0..2 {
                let low = bits(u8x16(bytes16(x, 48 + 32 * (sb / 2) + 16 * half)), shift, 0x0F);
                let high = bits(u8x16(bytes16(x, 16 + 16 * half)), sb, 1);
                let q = _mm512_or_si512(low, _mm512_slli_epi32::<4>(high));
                store16(
                    y,
                    32 * sb + 16 * half,
                    _mm512_sub_ps(_mm512_mul_ps(d1, _mm512_cvtepi32_ps(q)), m1),
                );
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn q6_k_avx512(x: &[u8; 210], y: &mut [f32; 256]) {
        let d = half_at(x, 208);
        let thirty_two = _mm512_set1_epi32(32);
        for i in 0..16 {
            let (h, k, l0) = (i / 8, (i % 8) / 2, 16 * (i % 2));
            let dl = _mm512_set1_ps(d * (x[192 + i] as i8) as f32);
            let low = bits(u8x16(bytes16(x, 64 * h + 32 * (k % 2) + l0)), 4 * (k / 2), 0x0F);
            let high = bits(u8x16(bytes16(x, 128 + 32 * h + l0)), 2 * k, 3);
            let q = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32::<4>(high)), thirty_two);
            store16(y, 16 * i, _mm512_mul_ps(dl, _mm512_cvtepi32_ps(q)));
        }
    }
}

/// Applies `kernel` to every block. Inlined into each ISA-specific caller, so that the kernels are
/// compiled (and vectorized) for that ISA.
#[inline(always)]
fn blocks<const BB: usize, const BE: usize>(src: &[u8], dst: &mut [f32], kernel: impl Fn(&[u8; BB], &mut [f32; BE])) {
    for (x, y) in src.chunks_exact(BB).zip(dst.chunks_exact_mut(BE)) {
        if let (Ok(x), Ok(y)) = (<&[u8; BB]>::try_from(x), <&mut [f32; BE]>::try_from(y)) {
            kernel(x, y);
        }
    }
}

#[inline(always)]
fn run_generic(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    #[cfg(target_endian = "little")]
    if ty == GgmlType::F32 {
        // Little-endian f32s are their own storage format: one memcpy (which picks streaming
        // stores for big buffers).
        let n = dst.len().min(src.len() / 4);
        // SAFETY: `src` has at least 4n readable bytes and `dst` n writable f32s (4n bytes); they
        // cannot overlap (one is borrowed shared, the other exclusively); every bit pattern is a
        // valid f32.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr() as *mut u8, 4 * n) };
        return;
    }
    match ty {
        GgmlType::F32 => blocks::<64, 16>(src, dst, f32_x16),
        GgmlType::F16 => blocks::<32, 16>(src, dst, f16_x16),
        GgmlType::BF16 => blocks::<32, 16>(src, dst, bf16_x16),
        GgmlType::Q4_0 => blocks(src, dst, q4_0),
        GgmlType::Q4_1 => blocks(src, dst, q4_1),
        GgmlType::Q5_0 => blocks(src, dst, q5_0),
        GgmlType::Q5_1 => blocks(src, dst, q5_1),
        GgmlType::Q8_0 => blocks(src, dst, q8_0),
        GgmlType::Q2K => blocks(src, dst, q2_k),
        GgmlType::Q3K => blocks(src, dst, q3_k),
        GgmlType::Q4K => blocks(src, dst, q4_k),
        GgmlType::Q5K => blocks(src, dst, q5_k),
        GgmlType::Q6K => blocks(src, dst, q6_k),
        GgmlType::IQ4NL
        | GgmlType::IQ4XS
        | GgmlType::MXFP4
        | GgmlType::IQ1S
        | GgmlType::IQ1M
        | GgmlType::IQ2XXS
        | GgmlType::IQ2XS
        | GgmlType::IQ2S
        | GgmlType::IQ3XXS
        | GgmlType::IQ3S
        | GgmlType::TQ1_0
        | GgmlType::TQ2_0 => scalar::run(ty, src, dst),
    }
    // The unblocked float types: the tail of fewer than 16 elements.
    let tail = dst.len() % 16;
    if tail != 0 && !ty.is_quantized() {
        let n = dst.len() - tail;
        let bb = ty.block_bytes();
        let (x, y) = (&src[n * bb..], &mut dst[n..]);
        for (x, y) in x.chunks_exact(bb).zip(y) {
            *y = match ty {
                GgmlType::F32 => f32::from_le_bytes([x[0], x[1], x[2], x[3]]),
                GgmlType::F16 => f16_to_f32(u16::from_le_bytes([x[0], x[1]])),
                _ => f32::from_bits((u16::from_le_bytes([x[0], x[1]]) as u32) << 16),
            };
        }
    }
}

#[inline(always)]
fn dot_generic(ty: GgmlType, src: &[u8], x: &[f32]) -> f32 {
    dot_with(ty, src, x, run_generic)
}

#[inline(always)]
fn dot_with(ty: GgmlType, src: &[u8], x: &[f32], run: impl Fn(GgmlType, &[u8], &mut [f32])) -> f32 {
    // Dequantize up to 256 elements at a time into a stack buffer, then multiply-accumulate into
    // 16 independent lanes.
    let chunk = if ty.is_quantized() { ty.block_elems() } else { 256 };
    let chunk_bytes = chunk / ty.block_elems() * ty.block_bytes();
    let mut buf = [0.0f32; 256];
    let mut acc = [0.0f32; 16];
    for (xs, q) in x.chunks(chunk).zip(src.chunks(chunk_bytes)) {
        let y = &mut buf[..xs.len()];
        run(ty, q, y);
        for (ys, xs) in y.chunks_exact(16).zip(xs.chunks_exact(16)) {
            for l in 0..16 {
                acc[l] += ys[l] * xs[l];
            }
        }
        let rem = xs.len() % 16;
        for (a, (y, x)) in acc.iter_mut().zip(y[y.len() - rem..].iter().zip(&xs[xs.len() - rem..])) {
            *a += y * x;
        }
    }
    // Pairwise reduction of the lanes.
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// Exact f16 -> f32, branch-free: normals and subnormals by rescaling the shifted bits by 2^112,
/// inf/NaN by setting the f32 exponent to all ones (keeping the payload).
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let abs = h & 0x7FFF;
    let finite = (f32::from_bits(abs << 13) * f32::from_bits(0x7780_0000)).to_bits();
    let special = 0x7F80_0000 | (abs & 0x03FF) << 13;
    f32::from_bits(if abs >= 0x7C00 { special } else { finite } | sign)
}

#[inline(always)]
fn half_at<const N: usize>(x: &[u8; N], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([x[i], x[i + 1]]))
}

#[inline(always)]
fn f32_x16(x: &[u8; 64], y: &mut [f32; 16]) {
    for l in 0..16 {
        y[l] = f32::from_le_bytes([x[4 * l], x[4 * l + 1], x[4 * l + 2], x[4 * l + 3]]);
    }
}

#[inline(always)]
fn f16_x16(x: &[u8; 32], y: &mut [f32; 16]) {
    for l in 0..16 {
        y[l] = f16_to_f32(u16::from_le_bytes([x[2 * l], x[2 * l + 1]]));
    }
}

#[inline(always)]
fn bf16_x16(x: &[u8; 32], y: &mut [f32; 16]) {
    for l in 0..16 {
        y[l] = f32::from_bits((u16::from_le_bytes([x[2 * l], x[2 * l + 1]]) as u32) << 16);
    }
}

/// Splits a 32-element block into its first and second 16 elements.
#[inline(always)]
fn halves(y: &mut [f32; 32]) -> (&mut [f32; 16], &mut [f32; 16]) {
    let (a, b) = y.split_at_mut(16);
    match (<&mut [f32; 16]>::try_from(a), <&mut [f32; 16]>::try_from(b)) {
        (Ok(a), Ok(b)) => (a, b),
        _ => unreachable!("32 = 16 + 16"),
    }
}

#[inline(always)]
fn q4_0(x: &[u8; 18], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let (lo, hi) = halves(y);
    for j in 0..16 {
        lo[j] = d * ((x[2 + j] & 0x0F) as i32 - 8) as f32;
    }
    for j in 0..16 {
        hi[j] = d * ((x[2 + j] >> 4) as i32 - 8) as f32;
    }
}

#[inline(always)]
fn q4_1(x: &[u8; 20], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let m = half_at(x, 2);
    let (lo, hi) = halves(y);
    for j in 0..16 {
        lo[j] = d * (x[4 + j] & 0x0F) as f32 + m;
    }
    for j in 0..16 {
        hi[j] = d * (x[4 + j] >> 4) as f32 + m;
    }
}

#[inline(always)]
fn q5_0(x: &[u8; 22], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let qh = u32::from_le_bytes([x[2], x[3], x[4], x[5]]);
    let (lo, hi) = halves(y);
    for j in 0..16 {
        let q = (x[6 + j] & 0x0F) as i32 | (((qh >> j) & 1) << 4) as i32;
        lo[j] = d * (q - 16) as f32;
    }
    for j in 0..16 {
        let q = (x[6 + j] >> 4) as i32 | (((qh >> (j + 16)) & 1) << 4) as i32;
        hi[j] = d * (q - 16) as f32;
    }
}

#[inline(always)]
fn q5_1(x: &[u8; 24], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    let m = half_at(x, 2);
    let qh = u32::from_le_bytes([x[4], x[5], x[6], x[7]]);
    let (lo, hi) = halves(y);
    for j in 0..16 {
        let q = (x[8 + j] & 0x0F) as u32 | ((qh >> j) & 1) << 4;
        lo[j] = d * q as f32 + m;
    }
    for j in 0..16 {
        let q = (x[8 + j] >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
        hi[j] = d * q as f32 + m;
    }
}

#[inline(always)]
fn q8_0(x: &[u8; 34], y: &mut [f32; 32]) {
    let d = half_at(x, 0);
    for j in 0..32 {
        y[j] = (x[2 + j] as i8) as f32 * d;
    }
}

#[inline(always)]
fn q2_k(x: &[u8; 84], y: &mut [f32; 256]) {
    let d = half_at(x, 80);
    let dmin = half_at(x, 82);
    // Sub-block i (16 elements): half h = i / 8, shift 2 * ((i % 8) / 2), qs offset 32h + 16(i % 2).
    for (i, y) in y.chunks_exact_mut(16).enumerate() {
        let sc = x[i];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        let shift = 2 * ((i % 8) / 2);
        let q = &x[16 + 32 * (i / 8) + 16 * (i % 2)..][..16];
        for l in 0..16 {
            y[l] = dl * ((q[l] >> shift) & 3) as f32 - ml;
        }
    }
}

#[inline(always)]
fn q3_k(x: &[u8; 110], y: &mut [f32; 256]) {
    let d = half_at(x, 108);
    let s = &x[96..108];
    for (i, y) in y.chunks_exact_mut(16).enumerate() {
        let low4 = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
        let high2 = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        let dl = d * ((low4 | high2 << 4) as i8 - 32) as f32;
        let (h, sh) = (i / 8, (i % 8) / 2);
        let l0 = 16 * (i % 2);
        let q = &x[32 + 32 * h + l0..][..16];
        let hm = &x[l0..][..16];
        let bit = 4 * h + sh;
        for l in 0..16 {
            let low = ((q[l] >> (2 * sh)) & 3) as i32;
            let high = ((hm[l] >> bit) & 1) as i32;
            y[l] = dl * (low + 4 * high - 4) as f32;
        }
    }
}

#[inline(always)]
fn k4_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    if j < 4 {
        ((s[j] & 63) as f32, (s[j + 4] & 63) as f32)
    } else {
        (
            ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4)) as f32,
            ((s[j + 4] >> 4) | ((s[j] >> 6) << 4)) as f32,
        )
    }
}

#[inline(always)]
fn q4_k(x: &[u8; 144], y: &mut [f32; 256]) {
    let d = half_at(x, 0);
    let dmin = half_at(x, 2);
    let s = &x[4..16];
    for (sb, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k4_scale_min(s, sb);
        let d1 = d * sc;
        let m1 = dmin * m;
        let q = &x[16 + 32 * (sb / 2)..][..32];
        let shift = 4 * (sb % 2);
        for l in 0..32 {
            y[l] = d1 * ((q[l] >> shift) & 0x0F) as f32 - m1;
        }
    }
}

#[inline(always)]
fn q5_k(x: &[u8; 176], y: &mut [f32; 256]) {
    let d = half_at(x, 0);
    let dmin = half_at(x, 2);
    let s = &x[4..16];
    let qh = &x[16..48];
    for (sb, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k4_scale_min(s, sb);
        let d1 = d * sc;
        let m1 = dmin * m;
        let q = &x[48 + 32 * (sb / 2)..][..32];
        let shift = 4 * (sb % 2);
        for l in 0..32 {
            let v = ((q[l] >> shift) & 0x0F) | ((qh[l] >> sb) & 1) << 4;
            y[l] = d1 * v as f32 - m1;
        }
    }
}

#[inline(always)]
fn q6_k(x: &[u8; 210], y: &mut [f32; 256]) {
    let d = half_at(x, 208);
    // Sub-block i (16 elements): half h = i / 8, quarter k = (i % 8) / 2, offset l0 = 16 (i % 2).
    for (i, y) in y.chunks_exact_mut(16).enumerate() {
        let (h, k, l0) = (i / 8, (i % 8) / 2, 16 * (i % 2));
        let dl = d * (x[192 + i] as i8) as f32;
        let ql = &x[64 * h + 32 * (k % 2) + l0..][..16];
        let qh = &x[128 + 32 * h + l0..][..16];
        let (lshift, hshift) = (4 * (k / 2), 2 * k);
        for l in 0..16 {
            let q = (((ql[l] >> lshift) & 0x0F) | ((qh[l] >> hshift) & 3) << 4) as i32 - 32;
            y[l] = dl * q as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::dequant as oracle;

    /// splitmix64: a tiny deterministic generator for test data.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
        fn uniform(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 24) as f32
        }
    }

    /// Offsets of the f16 d / m fields of each quantized type.
    fn half_fields(ty: GgmlType) -> &'static [usize] {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
            GgmlType::Q2K => &[80, 82],
            GgmlType::Q3K => &[108],
            GgmlType::Q6K => &[208],
            GgmlType::IQ4NL | GgmlType::IQ4XS | GgmlType::IQ1S | GgmlType::IQ2XXS | GgmlType::IQ2XS => &[0],
            GgmlType::IQ2S | GgmlType::IQ3XXS | GgmlType::IQ3S => &[0],
            GgmlType::TQ1_0 => &[52],
            GgmlType::TQ2_0 => &[64],
            _ => &[],
        }
    }

    /// Random blocks: some with sane f16 scales, some fully random bytes (so inf/NaN/subnormal
    /// scales turn up), plus all-0x00 and all-0xFF blocks.
    fn random_src(ty: GgmlType, n_blocks: usize, rng: &mut Rng) -> Vec<u8> {
        let bb = ty.block_bytes();
        let mut src = rng.bytes(n_blocks * bb);
        for (b, block) in src.chunks_exact_mut(bb).enumerate() {
            match b % 8 {
                0 => block.fill(0),
                1 => block.fill(0xFF),
                2 | 3 => {}
                _ => {
                    for &off in half_fields(ty) {
                        let v = half::f16::from_f32((rng.uniform() - 0.5) * 0.1);
                        block[off..off + 2].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
        src
    }

    fn assert_same_bits(ty: GgmlType, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{ty}: element {i} (block {}): fast {g:e} ({:#010x}) != reference {w:e} ({:#010x})",
                i / ty.block_elems(),
                g.to_bits(),
                w.to_bits()
            );
        }
    }

    #[test]
    fn fast_path_is_bit_exact_against_reference_for_every_type() {
        let mut rng = Rng(0xDE0A);
        for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
            // Odd counts, so the float types exercise their unrolled tail.
            let n_blocks = if ty.is_quantized() { 203 } else { 4099 };
            let src = random_src(ty, n_blocks, &mut rng);
            let want = oracle::dequantize_to_vec(ty, &src).unwrap();
            let mut got = vec![f32::NAN; want.len()];
            dequantize(ty, &src, &mut got).unwrap();
            assert_same_bits(ty, &got, &want);
            let mut par = vec![f32::NAN; want.len()];
            dequantize_par(ty, &src, &mut par).unwrap();
            assert_same_bits(ty, &par, &want);
            // Every ISA variant this CPU can run, not just the widest.
            let mut portable = vec![f32::NAN; want.len()];
            run_generic(ty, &src, &mut portable);
            assert_same_bits(ty, &portable, &want);
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                let mut avx2 = vec![f32::NAN; want.len()];
                // SAFETY: the features were just detected.
                unsafe { x86::run_avx2(ty, &src, &mut avx2) };
                assert_same_bits(ty, &avx2, &want);
            }
        }
    }

    #[test]
    fn fast_path_is_bit_exact_against_gguf_py_vectors() {
        // golden/dequant/<TYPE>.bin (tests/peers/gen_dequant_vectors.py): "LDQV", version, type id,
        // n_blocks, the blocks, then gguf-py's f32 bits.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/dequant");
        let mut n_checked = 0;
        for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
            let bytes = std::fs::read(dir.join(format!("{}.bin", ty.name()))).expect("golden vectors");
            let word = |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
            assert_eq!((&bytes[..4], word(8)), (&b"LDQV"[..], ty.id()));
            let n_blocks = word(12) as usize;
            let src = &bytes[16..16 + n_blocks * ty.block_bytes()];
            let want: Vec<f32> = bytes[16 + src.len()..]
                .chunks_exact(4)
                .map(|c| f32::from_bits(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                .collect();
            let mut got = vec![0.0; n_blocks * ty.block_elems()];
            dequantize(ty, src, &mut got).unwrap();
            assert_same_bits(ty, &got, &want);
            n_checked += got.len();
        }
        assert!(n_checked > 100_000);
    }

    #[test]
    fn every_f16_bit_pattern_converts_like_the_reference() {
        let src: Vec<u8> = (0..=u16::MAX).flat_map(|h| h.to_le_bytes()).collect();
        let want = oracle::dequantize_to_vec(GgmlType::F16, &src).unwrap();
        let mut got = vec![0.0; want.len()];
        dequantize(GgmlType::F16, &src, &mut got).unwrap();
        assert_same_bits(GgmlType::F16, &got, &want);
    }

    #[test]
    fn parallel_path_splits_large_buffers() {
        // Several rayon chunks plus a partial one.
        let mut rng = Rng(7);
        let ty = GgmlType::Q4K;
        let n_blocks = 3 * (1 << 16) / 256 + 5;
        let src = random_src(ty, n_blocks, &mut rng);
        let want = oracle::dequantize_to_vec(ty, &src).unwrap();
        let mut got = vec![0.0; want.len()];
        dequantize_par(ty, &src, &mut got).unwrap();
        assert_same_bits(ty, &got, &want);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut dst = vec![0.0; 33];
        assert!(matches!(
            dequantize(GgmlType::Q8_0, &[0; 34], &mut dst),
            Err(DequantError::PartialBlock { .. })
        ));
        let mut dst = vec![0.0; 256];
        assert!(matches!(
            dequantize_par(GgmlType::Q6K, &[0; 209], &mut dst),
            Err(DequantError::SourceLength { .. })
        ));
        assert!(dot_row(GgmlType::Q4_1, &[0; 20], &[0.0; 64]).is_err());
        assert!(dot_row(GgmlType::F32, &[0; 8], &[0.0; 3]).is_err());
    }

    #[test]
    fn dot_row_matches_reference_dequant_and_f64_dot() {
        let mut rng = Rng(99);
        for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
            let n = if ty.is_quantized() { 8 * ty.block_elems() } else { 1000 };
            // Sane scales only: fully random bytes would give inf/NaN dots.
            let mut src = rng.bytes(ty.bytes_for(n as u64).unwrap() as usize);
            match ty {
                GgmlType::F32 => {
                    for c in src.chunks_exact_mut(4) {
                        c.copy_from_slice(&(rng.uniform() - 0.5).to_le_bytes());
                    }
                }
                GgmlType::F16 | GgmlType::BF16 => {
                    for c in src.chunks_exact_mut(2) {
                        c[1] &= 0x3F; // keep the exponent small (|v| < 2)
                    }
                }
                _ => {
                    for block in src.chunks_exact_mut(ty.block_bytes()) {
                        for &off in half_fields(ty) {
                            let v = half::f16::from_f32((rng.uniform() - 0.5) * 0.1);
                            block[off..off + 2].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
            }
            let x: Vec<f32> = (0..n).map(|_| rng.uniform() * 2.0 - 1.0).collect();
            let w = oracle::dequantize_to_vec(ty, &src).unwrap();
            let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
            let scale: f64 = w.iter().zip(&x).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
            let got = dot_row(ty, &src, &x).unwrap() as f64;
            assert!(scale > 0.0, "{ty}: degenerate test data");
            assert!(
                (got - exact).abs() <= 1e-5 * scale,
                "{ty}: dot {got} vs exact {exact} (sum |terms| {scale})"
            );
        }
    }

    #[test]
    fn isa_is_reported() {
        // On x86_64 with AVX2 the fast path must not fall back to portable code.
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            assert_ne!(isa(), Isa::Portable);
        }
    }
}
