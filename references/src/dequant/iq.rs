//! Reference dequantization of the lattice (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S)
//! and ternary (TQ1_0, TQ2_0) types: one scalar function per type, from ggml's block layouts
//! (ggml-common.h), with the float operations in the order gguf-py's numpy `dequantize` does them
//! (`(db * grid) * sign`; IQ1's `dl * (grid + delta)`; TQ's `d * q`), so the bits match it. The
//! grids and the sign table are data generated from gguf-py's (see [`crate::iq_grids`]).

use super::f16_at;
use crate::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS_IQ2XS};
use half::f16;

/// Element `k` of a grid row (byte k, unsigned: the IQ2 and IQ3 grids).
fn g_u8(row: u64, k: usize) -> f32 {
    ((row >> (8 * k)) & 0xFF) as f32
}

/// Element `k` of an IQ1 grid row (byte k as i8: −1, 0 or +1).
fn g_i8(row: u64, k: usize) -> f32 {
    ((row >> (8 * k)) as u8 as i8) as f32
}

/// +1 or −1: bit `k` of `bits` set means negative.
fn sign(bits: u8, k: usize) -> f32 {
    if (bits >> k) & 1 == 0 {
        1.0
    } else {
        -1.0
    }
}

fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

/// The 4-bit scale `s` of a packed scale array (low nibble first).
fn nibble(scales: &[u8], s: usize) -> u8 {
    (scales[s / 2] >> (4 * (s % 2))) & 0x0F
}

/// IQ2_XXS: d, then 8 × (u32 grid indices, u32 aux). aux: 4 × 7-bit sign-pattern indices, a
/// 4-bit scale in bits 28..32; db = d·(0.5 + s)·0.25. Rows of 8 from the 256-entry grid.
pub(super) fn block_iq2_xxs(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for ib in 0..8 {
        let q0 = u32_at(x, 2 + 8 * ib);
        let q1 = u32_at(x, 2 + 8 * ib + 4);
        let db = d * (0.5 + (q1 >> 28) as f32) * 0.25;
        for l in 0..4 {
            let row = IQ2XXS_GRID[((q0 >> (8 * l)) & 0xFF) as usize];
            let signs = KSIGNS_IQ2XS[((q1 >> (7 * l)) & 0x7F) as usize];
            for k in 0..8 {
                y[32 * ib + 8 * l + k] = db * g_u8(row, k) * sign(signs, k);
            }
        }
    }
}

/// IQ2_XS: d, qs[32] (u16: 9-bit grid index, 7-bit sign-pattern index), scales[8] (4 bits per
/// 16 elements); db = d·(0.5 + s)·0.25. Rows of 8 from the 512-entry grid.
pub(super) fn block_iq2_xs(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let scales = &x[66..74];
    for g in 0..32 {
        let q = u16_at(x, 2 + 2 * g);
        let db = d * (0.5 + nibble(scales, g / 2) as f32) * 0.25;
        let row = IQ2XS_GRID[(q & 511) as usize];
        let signs = KSIGNS_IQ2XS[(q >> 9) as usize];
        for k in 0..8 {
            y[8 * g + k] = db * g_u8(row, k) * sign(signs, k);
        }
    }
}

/// IQ2_S: d, qs[32] (low 8 bits of the grid index), signs[32] (one byte per row of 8), qh[8]
/// (2 high index bits per row), scales[8] (4 bits per 16); db = d·(0.5 + s)·0.25. 1024-entry grid.
pub(super) fn block_iq2_s(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let (qs, signs, qh, scales) = (&x[2..34], &x[34..66], &x[66..74], &x[74..82]);
    for g in 0..32 {
        let idx = qs[g] as usize | ((((qh[g / 4] >> (2 * (g % 4))) & 3) as usize) << 8);
        let db = d * (0.5 + nibble(scales, g / 2) as f32) * 0.25;
        let row = IQ2S_GRID[idx];
        for k in 0..8 {
            y[8 * g + k] = db * g_u8(row, k) * sign(signs[g], k);
        }
    }
}

/// IQ3_XXS: d, qs[64] (grid indices, rows of 4), then 8 × u32 aux (4 × 7-bit sign-pattern
/// indices, a 4-bit scale in bits 28..32; db = d·(0.5 + s)·0.5). 256-entry grid.
pub(super) fn block_iq3_xxs(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let qs = &x[2..66];
    for ib in 0..8 {
        let aux = u32_at(x, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for l in 0..4 {
            let signs = KSIGNS_IQ2XS[((aux >> (7 * l)) & 0x7F) as usize];
            for e in 0..8 {
                let row = IQ3XXS_GRID[qs[8 * ib + 2 * l + e / 4] as usize] as u64;
                y[32 * ib + 8 * l + e] = db * g_u8(row, e % 4) * sign(signs, e);
            }
        }
    }
}

/// IQ3_S: d, qs[64] (low 8 bits of the grid index), qh[8] (the 9th bit), signs[32] (a bit per
/// element), scales[4] (4 bits per 32; db = d·(1 + 2s)). 512-entry grid of rows of 4.
pub(super) fn block_iq3_s(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    let (qs, qh, signs, scales) = (&x[2..66], &x[66..74], &x[74..106], &x[106..110]);
    for g in 0..64 {
        let idx = qs[g] as usize | ((((qh[g / 8] >> (g % 8)) & 1) as usize) << 8);
        let row = IQ3S_GRID[idx] as u64;
        let db = d * (1 + 2 * nibble(scales, g / 8)) as f32;
        for k in 0..4 {
            let e = 4 * g + k;
            y[e] = db * g_u8(row, k) * sign(signs[e / 8], e % 8);
        }
    }
}

/// IQ1_S: d, qs[32] (low 8 bits of the grid index), qh[8] (u16 per 32: 4 × 3 high index bits,
/// a 3-bit scale in bits 12..15, the delta's sign in bit 15). dl = d·(2s + 1); y = dl·(grid ± 1/8).
pub(super) fn block_iq1_s(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 0);
    for ib in 0..8 {
        let h = u16_at(x, 34 + 2 * ib);
        let dl = d * (2 * ((h >> 12) & 7) + 1) as f32;
        let delta = if h & 0x8000 == 0 { 0.125f32 } else { -0.125 };
        for l in 0..4 {
            let idx = x[2 + 4 * ib + l] as usize | ((((h >> (3 * l)) & 7) as usize) << 8);
            let row = IQ1S_GRID[idx];
            for k in 0..8 {
                y[32 * ib + 8 * l + k] = dl * (g_i8(row, k) + delta);
            }
        }
    }
}

/// IQ1_M: qs[32], qh[16] (per row of 8, a nibble: 3 high index bits and the delta's sign),
/// scales[4 × u16] (3 bits per 16 elements; their top nibbles together are the f16 d).
/// dl = d·(2s + 1); y = dl·(grid ± 1/8).
pub(super) fn block_iq1_m(x: &[u8], y: &mut [f32]) {
    let (qs, qh) = (&x[0..32], &x[32..48]);
    let sc = [u16_at(x, 48), u16_at(x, 50), u16_at(x, 52), u16_at(x, 54)];
    let d_bits = (sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) | ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000);
    let d = f16::from_bits(d_bits).to_f32();
    for g in 0..32 {
        let s = g / 2;
        let dl = d * (2 * ((sc[s / 4] >> (3 * (s % 4))) & 7) + 1) as f32;
        let h = qh[g / 2] >> (4 * (g % 2));
        let idx = qs[g] as usize | (((h & 7) as usize) << 8);
        let delta = if h & 0x08 == 0 { 0.125f32 } else { -0.125 };
        let row = IQ1S_GRID[idx];
        for k in 0..8 {
            y[8 * g + k] = dl * (g_i8(row, k) + delta);
        }
    }
}

/// A TQ1_0 value: a byte holding base-3 digits, times 3^j (mod 256), read as the top digit:
/// ((v·3) >> 8) − 1.
fn tq1_digit(b: u8, pow3: u8) -> f32 {
    let v = b.wrapping_mul(pow3);
    (((v as u16 * 3) >> 8) as i8 - 1) as f32
}

/// TQ1_0: qs[48] (5 digits per byte: elements j·32 + m of the first 32 bytes, 160 + j·16 + m of
/// the next 16), qh[4] (4 digits per byte: 240 + j·4 + m), d. y = d·(digit − 1).
pub(super) fn block_tq1_0(x: &[u8], y: &mut [f32]) {
    const POW3: [u8; 5] = [1, 3, 9, 27, 81];
    let d = f16_at(x, 52);
    for (j, &p) in POW3.iter().enumerate() {
        for m in 0..32 {
            y[32 * j + m] = d * tq1_digit(x[m], p);
        }
        for m in 0..16 {
            y[160 + 16 * j + m] = d * tq1_digit(x[32 + m], p);
        }
    }
    for (j, &p) in POW3[..4].iter().enumerate() {
        for m in 0..4 {
            y[240 + 4 * j + m] = d * tq1_digit(x[48 + m], p);
        }
    }
}

/// TQ2_0: qs[64] (2 bits per element: element 128·c + 32·j + m is bits 2j of qs[32·c + m]), d.
/// y = d·(q − 1).
pub(super) fn block_tq2_0(x: &[u8], y: &mut [f32]) {
    let d = f16_at(x, 64);
    for c in 0..2 {
        for j in 0..4 {
            for m in 0..32 {
                let q = ((x[32 * c + m] >> (2 * j)) & 3) as i8 - 1;
                y[128 * c + 32 * j + m] = d * q as f32;
            }
        }
    }
}
