//! The ggml tensor element types that llmdiff knows: ids, names and block geometry.

use std::fmt;

/// A ggml tensor type. Only the types llmdiff can dequantize are variants; other ids are
/// reported by [`GgmlType::from_id`] as errors carrying the id and, where known, its ggml name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    BF16,
    /// 4-bit non-linear (a 16-value codebook), blocks of 32 with an f16 scale.
    IQ4NL,
    /// IQ4_NL's codebook in super-blocks of 256 with 6-bit sub-block scales.
    IQ4XS,
    /// OCP microscaling FP4 (e2m1 values, an e8m0 power-of-two scale per 32): gpt-oss's experts.
    MXFP4,
    /// 1.5625 bpw: rows of 8 from the 2048-entry ±1/0 grid plus a ±1/8 shift, a 3-bit scale per 32.
    IQ1S,
    /// IQ1_S's grid with 3-bit scales per 16 and the f16 super-scale spread over the scale bits.
    IQ1M,
    /// 2.06 bpw: rows of 8 from a 256-entry grid, 7-bit sign patterns, a 4-bit scale per 32.
    IQ2XXS,
    /// 2.31 bpw: a 512-entry grid, sign pattern per row, 4-bit scales per 16.
    IQ2XS,
    /// 2.5 bpw: a 1024-entry grid, explicit sign bytes, 4-bit scales per 16.
    IQ2S,
    /// 3.06 bpw: rows of 4 from a 256-entry grid, 7-bit sign patterns, a 4-bit scale per 32.
    IQ3XXS,
    /// 3.44 bpw: a 512-entry grid of rows of 4, explicit sign bytes, 4-bit scales per 32.
    IQ3S,
    /// Ternary, 1.69 bpw: five base-3 digits per byte, an f16 scale per 256.
    TQ1_0,
    /// Ternary, 2.06 bpw: 2-bit values per element, an f16 scale per 256.
    TQ2_0,
}

/// Elements per super-block of the k-quants.
pub const QK_K: usize = 256;

impl GgmlType {
    /// Every supported type, in id order.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::BF16,
    ];

    /// Types added for reading (the reference and the engine's CPU path dequantize them);
    /// `quantize` writes MXFP4 but none of the IQ or TQ types.
    pub const DEQUANT_ONLY: [GgmlType; 12] = [
        GgmlType::IQ4NL,
        GgmlType::IQ4XS,
        GgmlType::MXFP4,
        GgmlType::IQ1S,
        GgmlType::IQ1M,
        GgmlType::IQ2XXS,
        GgmlType::IQ2XS,
        GgmlType::IQ2S,
        GgmlType::IQ3XXS,
        GgmlType::IQ3S,
        GgmlType::TQ1_0,
        GgmlType::TQ2_0,
    ];

    /// The type for a GGUF type id, or `Err(name)` naming an id llmdiff does not support.
    pub fn from_id(id: u32) -> Result<GgmlType, String> {
        Ok(match id {
            0 => GgmlType::F32,
            1 => GgmlType::F16,
            2 => GgmlType::Q4_0,
            3 => GgmlType::Q4_1,
            6 => GgmlType::Q5_0,
            7 => GgmlType::Q5_1,
            8 => GgmlType::Q8_0,
            10 => GgmlType::Q2K,
            11 => GgmlType::Q3K,
            12 => GgmlType::Q4K,
            13 => GgmlType::Q5K,
            14 => GgmlType::Q6K,
            30 => GgmlType::BF16,
            20 => GgmlType::IQ4NL,
            23 => GgmlType::IQ4XS,
            39 => GgmlType::MXFP4,
            19 => GgmlType::IQ1S,
            29 => GgmlType::IQ1M,
            16 => GgmlType::IQ2XXS,
            17 => GgmlType::IQ2XS,
            22 => GgmlType::IQ2S,
            18 => GgmlType::IQ3XXS,
            21 => GgmlType::IQ3S,
            34 => GgmlType::TQ1_0,
            35 => GgmlType::TQ2_0,
            other => return Err(unsupported_type_name(other).to_string()),
        })
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::BF16 => 30,
            GgmlType::IQ4NL => 20,
            GgmlType::IQ4XS => 23,
            GgmlType::MXFP4 => 39,
            GgmlType::IQ1S => 19,
            GgmlType::IQ1M => 29,
            GgmlType::IQ2XXS => 16,
            GgmlType::IQ2XS => 17,
            GgmlType::IQ2S => 22,
            GgmlType::IQ3XXS => 18,
            GgmlType::IQ3S => 21,
            GgmlType::TQ1_0 => 34,
            GgmlType::TQ2_0 => 35,
        }
    }

    /// ggml's name, as gguf-py and llama.cpp print it.
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "F32",
            GgmlType::F16 => "F16",
            GgmlType::Q4_0 => "Q4_0",
            GgmlType::Q4_1 => "Q4_1",
            GgmlType::Q5_0 => "Q5_0",
            GgmlType::Q5_1 => "Q5_1",
            GgmlType::Q8_0 => "Q8_0",
            GgmlType::Q2K => "Q2_K",
            GgmlType::Q3K => "Q3_K",
            GgmlType::Q4K => "Q4_K",
            GgmlType::Q5K => "Q5_K",
            GgmlType::Q6K => "Q6_K",
            GgmlType::BF16 => "BF16",
            GgmlType::IQ4NL => "IQ4_NL",
            GgmlType::IQ4XS => "IQ4_XS",
            GgmlType::MXFP4 => "MXFP4",
            GgmlType::IQ1S => "IQ1_S",
            GgmlType::IQ1M => "IQ1_M",
            GgmlType::IQ2XXS => "IQ2_XXS",
            GgmlType::IQ2XS => "IQ2_XS",
            GgmlType::IQ2S => "IQ2_S",
            GgmlType::IQ3XXS => "IQ3_XXS",
            GgmlType::IQ3S => "IQ3_S",
            GgmlType::TQ1_0 => "TQ1_0",
            GgmlType::TQ2_0 => "TQ2_0",
        }
    }

    /// Parses a name as printed by [`GgmlType::name`], case-insensitively.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        GgmlType::ALL
            .into_iter()
            .chain(GgmlType::DEQUANT_ONLY)
            .find(|t| t.name().eq_ignore_ascii_case(name) || t.name().replace('_', "").eq_ignore_ascii_case(name))
    }

    /// Elements per block.
    pub fn block_elems(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => 1,
            GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 | GgmlType::Q8_0 => 32,
            GgmlType::IQ4NL | GgmlType::MXFP4 => 32,
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => QK_K,
            GgmlType::IQ4XS => QK_K,
            GgmlType::IQ1S | GgmlType::IQ1M | GgmlType::IQ2XXS | GgmlType::IQ2XS | GgmlType::IQ2S => QK_K,
            GgmlType::IQ3XXS | GgmlType::IQ3S | GgmlType::TQ1_0 | GgmlType::TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::BF16 => 2,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q8_0 => 34,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
            GgmlType::IQ4NL => 18,
            GgmlType::IQ4XS => 136,
            GgmlType::MXFP4 => 17,
            GgmlType::IQ1S => 50,
            GgmlType::IQ1M => 56,
            GgmlType::IQ2XXS => 66,
            GgmlType::IQ2XS => 74,
            GgmlType::IQ2S => 82,
            GgmlType::IQ3XXS => 98,
            GgmlType::IQ3S => 110,
            GgmlType::TQ1_0 => 54,
            GgmlType::TQ2_0 => 66,
        }
    }

    /// Bytes needed for `n_elems` elements, or `None` when `n_elems` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elems: u64) -> Option<u64> {
        let be = self.block_elems() as u64;
        if !n_elems.is_multiple_of(be) {
            return None;
        }
        (n_elems / be).checked_mul(self.block_bytes() as u64)
    }

    /// True for the block-quantized types (everything but F32, F16 and BF16).
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// ggml's name for a type id llmdiff does not support (for error messages).
fn unsupported_type_name(id: u32) -> String {
    let name = match id {
        4 => "Q4_2 (removed)",
        5 => "Q4_3 (removed)",
        9 => "Q8_1",
        15 => "Q8_K",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        31..=33 => "Q4_0_4_4/4_8/8_8 (removed)",
        _ => "unknown",
    };
    format!("type id {id} ({name})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_names_parse() {
        for t in GgmlType::ALL.into_iter().chain(GgmlType::DEQUANT_ONLY) {
            assert_eq!(GgmlType::from_id(t.id()), Ok(t));
            assert_eq!(GgmlType::from_name(t.name()), Some(t));
        }
        assert_eq!(GgmlType::from_name("q4k"), Some(GgmlType::Q4K));
        assert!(GgmlType::from_id(15).unwrap_err().contains("Q8_K"));
        assert!(GgmlType::from_id(999).unwrap_err().contains("999"));
    }

    #[test]
    fn sizes() {
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(GgmlType::Q4K.bytes_for(100), None);
        assert_eq!(GgmlType::F32.bytes_for(u64::MAX), None);
    }
}
