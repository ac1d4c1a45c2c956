//! Reference dequantization: scalar code written straight from ggml's block layouts.
//! (Filled in by the dequant work.)

use crate::ggml_type::GgmlType;

/// Dequantizes `dst.len()` elements of type `ty` from `src`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) {
    let _ = (ty, src, dst);
    unimplemented!("dequantize")
}
