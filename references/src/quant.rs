//! Round-to-nearest quantizers for every supported type, used by `synth`.
//! (Placeholder: F32/F16/BF16 only until the quantizer work lands.)

use crate::ggml_type::GgmlType;

#[derive(Debug, thiserror::Error)]
#[error("quantize {ty}: {msg}")]
pub struct QuantError {
    pub ty: GgmlType,
    pub msg: String,
}

/// Quantizes `src` (a whole number of blocks) to `ty`.
pub fn quantize(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    match ty {
        GgmlType::F32 => Ok(src.iter().flat_map(|x| x.to_le_bytes()).collect()),
        GgmlType::F16 => Ok(src.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect()),
        GgmlType::Q8_0 => Ok(src
            .chunks(32)
            .flat_map(|b| {
                let amax = b.iter().fold(0f32, |m, x| m.max(x.abs()));
                let d = amax / 127.0;
                let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                let mut out = half::f16::from_f32(d).to_le_bytes().to_vec();
                out.extend(b.iter().map(|x| (x * id).round() as i8 as u8));
                out
            })
            .collect()),
        _ => Err(QuantError {
            ty,
            msg: "not yet".into(),
        }),
    }
}
