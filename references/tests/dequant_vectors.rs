//! Bit-exactness of the reference dequantizer against gguf-py's numpy `dequantize`, on the committed
//! vectors in `golden/dequant/<TYPE>.bin` (made by `tests/peers/gen_dequant_vectors.py`): random
//! blocks plus d/m = ±0, ±inf, NaN, ±65504, subnormal halves with 0x00/0xFF/random quant bytes.
//! Bits are compared exactly; NaN matches NaN (payloads may differ between numpy and `half`).
//! The codebook types (IQ4_NL, IQ4_XS, MXFP4, the IQ1/IQ2/IQ3 lattice types, TQ1_0 and TQ2_0;
//! `GgmlType::DEQUANT_ONLY`) are checked the same way.

use std::path::PathBuf;

use references::dequant::{dequantize, dequantize_to_vec};
use references::GgmlType;

struct Vectors {
    ty: GgmlType,
    n_blocks: usize,
    src: Vec<u8>,
    expected: Vec<u32>,
}

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../golden/dequant")
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
}

fn load(ty: GgmlType) -> Vectors {
    let path = golden_dir().join(format!("{}.bin", ty.name()));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    assert_eq!(&bytes[..4], b"LDQV", "{}: bad magic", path.display());
    assert_eq!(u32_at(&bytes, 4), 1, "version");
    assert_eq!(u32_at(&bytes, 8), ty.id(), "{}: type id", path.display());
    let n_blocks = u32_at(&bytes, 12) as usize;
    let src_len = n_blocks * ty.block_bytes();
    let n_elems = n_blocks * ty.block_elems();
    assert_eq!(bytes.len(), 16 + src_len + 4 * n_elems, "{}: file size", path.display());
    let src = bytes[16..16 + src_len].to_vec();
    let expected = bytes[16 + src_len..]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Vectors {
        ty,
        n_blocks,
        src,
        expected,
    }
}

/// Same bits, or both NaN.
fn same(got: u32, want: u32) -> bool {
    got == want || (f32::from_bits(got).is_nan() && f32::from_bits(want).is_nan())
}

#[test]
fn reference_dequant_is_bit_exact_against_gguf_py() {
    let mut report = Vec::new();
    let mut total_blocks = 0;
    for ty in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
        let v = load(ty);
        assert!(v.n_blocks > 0);
        let got = dequantize_to_vec(v.ty, &v.src).unwrap();
        assert_eq!(got.len(), v.expected.len());
        let mismatches: Vec<usize> = (0..got.len())
            .filter(|&i| !same(got[i].to_bits(), v.expected[i]))
            .collect();
        if let Some(&i) = mismatches.first() {
            report.push(format!(
                "{ty}: {} of {} elements differ; first at element {i} (block {}): got {:#010x} ({}), want {:#010x} ({})",
                mismatches.len(),
                got.len(),
                i / ty.block_elems(),
                got[i].to_bits(),
                got[i],
                v.expected[i],
                f32::from_bits(v.expected[i]),
            ));
        }
        let payload_only = (0..got.len()).filter(|&i| got[i].to_bits() != v.expected[i]).count() - mismatches.len();
        eprintln!(
            "{ty:5}: {} blocks, {} elements, {payload_only} NaNs with other payload bits",
            v.n_blocks,
            got.len()
        );
        total_blocks += v.n_blocks;
    }
    assert!(report.is_empty(), "mismatches:\n{}", report.join("\n"));
    assert!(total_blocks > 10_000, "vectors look truncated: {total_blocks} blocks");
}

#[test]
fn vectors_cover_the_edge_cases() {
    // The quantized vectors must actually exercise inf and NaN outputs, or the edge cases were lost.
    // The codebook types with an f16 d too (MXFP4's e8m0 scale makes no NaN).
    let f16_scaled = GgmlType::DEQUANT_ONLY.into_iter().filter(|&t| t != GgmlType::MXFP4);
    for ty in GgmlType::ALL.into_iter().filter(|t| t.is_quantized()).chain(f16_scaled) {
        let v = load(ty);
        let vals: Vec<f32> = v.expected.iter().map(|&b| f32::from_bits(b)).collect();
        assert!(vals.iter().any(|x| x.is_nan()), "{ty}: no NaN outputs");
        assert!(vals.iter().any(|x| x.is_infinite()), "{ty}: no inf outputs");
        assert!(
            vals.iter().any(|x| x.is_finite() && *x != 0.0),
            "{ty}: no finite outputs"
        );
    }
}

#[test]
fn dequantize_into_slices_matches_whole_buffer() {
    // Dequantizing block by block through `dequantize` gives what the whole buffer gives.
    for ty in [GgmlType::Q4_1, GgmlType::Q6K, GgmlType::F16] {
        let v = load(ty);
        let whole = dequantize_to_vec(ty, &v.src).unwrap();
        let mut parts = vec![0.0f32; whole.len()];
        for (x, y) in v
            .src
            .chunks(7 * ty.block_bytes())
            .zip(parts.chunks_mut(7 * ty.block_elems()))
        {
            dequantize(ty, x, y).unwrap();
        }
        assert!(
            whole.iter().zip(&parts).all(|(a, b)| same(a.to_bits(), b.to_bits())),
            "{ty}"
        );
    }
}
