//! The engine's scalar dequantizers for the codebook and lattice types (IQ4_NL, IQ4_XS, MXFP4,
//! IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, TQ1_0, TQ2_0): one plain function per
//! type, a block at a time, with no SIMD kernel yet. Each element is the same f32 expression, in
//! the same order, as gguf-py's numpy `dequantize` (`(db * grid) * sign`, IQ1's
//! `dl * (grid + delta)`, `d * q`), so the bits match it and the reference. The grid tables are
//! shared data (`references::iq_grids`, generated from gguf-py's); the decoding code is the
//! engine's own.

use references::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use references::GgmlType;

/// Dequantizes whole blocks of a type this module handles; `dst.len()` is a whole number of
/// blocks and `src.len()` matches (checked by the caller).
pub(super) fn run(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let block: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::IQ4NL => iq4_nl,
        GgmlType::IQ4XS => iq4_xs,
        GgmlType::MXFP4 => mxfp4,
        GgmlType::IQ1S => iq1_s,
        GgmlType::IQ1M => iq1_m,
        GgmlType::IQ2XXS => iq2_xxs,
        GgmlType::IQ2XS => iq2_xs,
        GgmlType::IQ2S => iq2_s,
        GgmlType::IQ3XXS => iq3_xxs,
        GgmlType::IQ3S => iq3_s,
        GgmlType::TQ1_0 => tq1_0,
        GgmlType::TQ2_0 => tq2_0,
        _ => unreachable!("{ty} has a vectorized path"),
    };
    for (x, y) in src
        .chunks_exact(ty.block_bytes())
        .zip(dst.chunks_exact_mut(ty.block_elems()))
    {
        block(x, y);
    }
}

fn half(x: &[u8], i: usize) -> f32 {
    half::f16::from_le_bytes([x[i], x[i + 1]]).to_f32()
}

fn le16(x: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([x[i], x[i + 1]])
}

fn le32(x: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([x[i], x[i + 1], x[i + 2], x[i + 3]])
}

/// The 8 sign factors of a sign byte (bit k set: element k negative).
fn signs8(bits: u8) -> [f32; 8] {
    std::array::from_fn(|k| if (bits >> k) & 1 == 0 { 1.0 } else { -1.0 })
}

/// A grid row's unsigned bytes as f32 (`n` of them: 8 or 4).
fn row_u8<const N: usize>(row: u64) -> [f32; N] {
    std::array::from_fn(|k| (row >> (8 * k)) as u8 as f32)
}

/// An IQ1 grid row's bytes as signed values (−1, 0, +1).
fn row_i8(row: u64) -> [f32; 8] {
    std::array::from_fn(|k| (row >> (8 * k)) as u8 as i8 as f32)
}

const KVALUES_IQ4NL: [i8; 16] = [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113];
const KVALUES_MXFP4: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// 16 bytes of nibbles through a codebook, scaled: low nibbles to y[0..16], high to y[16..32].
fn nibbles_32(d: f32, qs: &[u8], kv: &[i8; 16], y: &mut [f32]) {
    for (j, &q) in qs[..16].iter().enumerate() {
        y[j] = d * kv[(q & 0x0F) as usize] as f32;
        y[j + 16] = d * kv[(q >> 4) as usize] as f32;
    }
}

fn iq4_nl(x: &[u8], y: &mut [f32]) {
    nibbles_32(half(x, 0), &x[2..18], &KVALUES_IQ4NL, y);
}

fn iq4_xs(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    let sh = le16(x, 2);
    for (ib, yb) in y.chunks_exact_mut(32).enumerate() {
        let ls = ((x[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) | ((((sh >> (2 * ib)) & 3) as u8) << 4);
        nibbles_32(d * (ls as i32 - 32) as f32, &x[8 + 16 * ib..], &KVALUES_IQ4NL, yb);
    }
}

fn mxfp4(x: &[u8], y: &mut [f32]) {
    // 2^(e − 128) (ggml's E8M0_TO_FP32_HALF): subnormal below e = 2.
    let e = x[0];
    let d = f32::from_bits(if e < 2 {
        0x0020_0000u32 << e
    } else {
        ((e - 1) as u32) << 23
    });
    nibbles_32(d, &x[1..17], &KVALUES_MXFP4, y);
}

/// `(db * grid) * sign` for one row of 8.
fn put8(y: &mut [f32], db: f32, g: [f32; 8], s: [f32; 8]) {
    for k in 0..8 {
        y[k] = db * g[k] * s[k];
    }
}

fn iq2_xxs(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (ib, yb) in y.chunks_exact_mut(32).enumerate() {
        let (q0, q1) = (le32(x, 2 + 8 * ib), le32(x, 6 + 8 * ib));
        let db = d * (0.5 + (q1 >> 28) as f32) * 0.25;
        for (l, yr) in yb.chunks_exact_mut(8).enumerate() {
            let g = row_u8(IQ2XXS_GRID[(q0 >> (8 * l)) as u8 as usize]);
            put8(yr, db, g, signs8(KSIGNS_IQ2XS[(q1 >> (7 * l)) as usize & 0x7F]));
        }
    }
}

fn iq2_xs(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (g, yr) in y.chunks_exact_mut(8).enumerate() {
        let q = le16(x, 2 + 2 * g);
        let sc = (x[66 + g / 4] >> (4 * (g / 2 % 2))) & 0x0F;
        let db = d * (0.5 + sc as f32) * 0.25;
        put8(
            yr,
            db,
            row_u8(IQ2XS_GRID[(q & 511) as usize]),
            signs8(KSIGNS_IQ2XS[(q >> 9) as usize]),
        );
    }
}

fn iq2_s(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (g, yr) in y.chunks_exact_mut(8).enumerate() {
        let idx = x[2 + g] as usize | (((x[66 + g / 4] >> (2 * (g % 4))) & 3) as usize) << 8;
        let sc = (x[74 + g / 4] >> (4 * (g / 2 % 2))) & 0x0F;
        let db = d * (0.5 + sc as f32) * 0.25;
        put8(yr, db, row_u8(IQ2S_GRID[idx]), signs8(x[34 + g]));
    }
}

fn iq3_xxs(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (ib, yb) in y.chunks_exact_mut(32).enumerate() {
        let aux = le32(x, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for (l, yr) in yb.chunks_exact_mut(8).enumerate() {
            let a: [f32; 4] = row_u8(IQ3XXS_GRID[x[2 + 8 * ib + 2 * l] as usize] as u64);
            let b: [f32; 4] = row_u8(IQ3XXS_GRID[x[3 + 8 * ib + 2 * l] as usize] as u64);
            let g = [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]];
            put8(yr, db, g, signs8(KSIGNS_IQ2XS[(aux >> (7 * l)) as usize & 0x7F]));
        }
    }
}

fn iq3_s(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (r, yr) in y.chunks_exact_mut(8).enumerate() {
        // Row r of 8 is grid rows 2r and 2r + 1 (of 4) and sign byte r.
        let db = d * (1 + 2 * ((x[106 + r / 8] >> (4 * (r / 4 % 2))) & 0x0F)) as f32;
        let grid = |g: usize| -> [f32; 4] {
            let idx = x[2 + g] as usize | (((x[66 + g / 8] >> (g % 8)) & 1) as usize) << 8;
            row_u8(IQ3S_GRID[idx] as u64)
        };
        let (a, b) = (grid(2 * r), grid(2 * r + 1));
        put8(
            yr,
            db,
            [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]],
            signs8(x[74 + r]),
        );
    }
}

/// `dl * (grid + delta)` for one row of 8.
fn put8_shift(y: &mut [f32], dl: f32, g: [f32; 8], delta: f32) {
    for k in 0..8 {
        y[k] = dl * (g[k] + delta);
    }
}

fn iq1_s(x: &[u8], y: &mut [f32]) {
    let d = half(x, 0);
    for (ib, yb) in y.chunks_exact_mut(32).enumerate() {
        let h = le16(x, 34 + 2 * ib);
        let dl = d * (2 * ((h >> 12) & 7) + 1) as f32;
        let delta = if h & 0x8000 == 0 { 0.125 } else { -0.125 };
        for (l, yr) in yb.chunks_exact_mut(8).enumerate() {
            let idx = x[2 + 4 * ib + l] as usize | (((h >> (3 * l)) & 7) as usize) << 8;
            put8_shift(yr, dl, row_i8(IQ1S_GRID[idx]), delta);
        }
    }
}

fn iq1_m(x: &[u8], y: &mut [f32]) {
    let sc: [u16; 4] = std::array::from_fn(|i| le16(x, 48 + 2 * i));
    let d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000);
    let d = half::f16::from_bits(d_bits).to_f32();
    for (g, yr) in y.chunks_exact_mut(8).enumerate() {
        let s = g / 2;
        let dl = d * (2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1) as f32;
        let h = x[32 + g / 2] >> (4 * (g % 2));
        let delta = if h & 0x08 == 0 { 0.125 } else { -0.125 };
        put8_shift(
            yr,
            dl,
            row_i8(IQ1S_GRID[x[g] as usize | ((h & 7) as usize) << 8]),
            delta,
        );
    }
}

fn tq1_0(x: &[u8], y: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let d = half(x, 52);
    // Top base-3 digit of b·3^j (mod 256), minus 1.
    let digit = |b: u8, p: u8| (((b.wrapping_mul(p) as u16 * 3) >> 8) as i8 - 1) as f32;
    for (j, &p) in POW3.iter().enumerate() {
        for m in 0..32 {
            y[32 * j + m] = d * digit(x[m], p);
        }
        for m in 0..16 {
            y[160 + 16 * j + m] = d * digit(x[32 + m], p);
        }
        if j < 4 {
            for m in 0..4 {
                y[240 + 4 * j + m] = d * digit(x[48 + m], p);
            }
        }
    }
}

fn tq2_0(x: &[u8], y: &mut [f32]) {
    let d = half(x, 64);
    // Element 128·c + 32·j + m is bits 2j of byte 32·c + m.
    for (qs, yc) in x[..64].chunks_exact(32).zip(y.chunks_exact_mut(128)) {
        for (j, yj) in yc.chunks_exact_mut(32).enumerate() {
            for (y, &q) in yj.iter_mut().zip(qs) {
                *y = d * (((q >> (2 * j)) & 3) as i8 - 1) as f32;
            }
        }
    }
}
