//! The safetensors format, read as hostile input: an 8-byte little-endian header length, a JSON
//! header `{NAME: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then
//! the data section. Every length, offset and shape product is checked against the file before
//! use; errors name the file.

use crate::gguf::GgufError;
use memmap2::Mmap;
use std::path::Path;

/// The element types llmdiff reads from a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StDtype {
    F32,
    F16,
    BF16,
    /// float8_e4m3fn (DeepSeek-V3 / GLM-5 block-scaled FP8 checkpoints).
    F8E4M3,
    /// Bytes: only gpt-oss's MXFP4 `_blocks` / `_scales` are read as such.
    U8,
}

impl StDtype {
    fn parse(s: &str) -> Option<StDtype> {
        Some(match s {
            "F32" => StDtype::F32,
            "F16" => StDtype::F16,
            "BF16" => StDtype::BF16,
            "F8_E4M3" => StDtype::F8E4M3,
            "U8" => StDtype::U8,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            StDtype::F32 => 4,
            StDtype::F16 | StDtype::BF16 => 2,
            StDtype::F8E4M3 | StDtype::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            StDtype::F32 => "F32",
            StDtype::F16 => "F16",
            StDtype::BF16 => "BF16",
            StDtype::F8E4M3 => "F8_E4M3",
            StDtype::U8 => "U8",
        }
    }
}

/// One tensor of a safetensors file.
#[derive(Clone, Debug)]
pub struct StTensor {
    pub name: String,
    pub dtype: StDtype,
    /// torch order (the last axis is contiguous).
    pub shape: Vec<usize>,
    /// Offset in the data section.
    pub begin: u64,
    pub n_bytes: u64,
    /// Which file of the folder.
    pub file: usize,
}

impl StTensor {
    pub fn n_elems(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A mapped safetensors file: the map, its data-section offset and its tensors.
pub struct StFile {
    pub map: Mmap,
    pub data_offset: u64,
    pub tensors: Vec<StTensor>,
}

/// The largest JSON header accepted (the format's own limit is 100 MB).
const MAX_HEADER: u64 = 100 << 20;

/// Maps and validates `path` (file number `file` of its folder).
pub fn open(path: &Path, file: usize) -> Result<StFile, GgufError> {
    let name = path.display().to_string();
    let err = |offset: u64, msg: String| GgufError {
        file: name.clone(),
        offset,
        msg,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(0, e.to_string()))?;
    if !meta.is_file() {
        return Err(err(0, "not a regular file".into()));
    }
    let f = std::fs::File::open(path).map_err(|e| err(0, e.to_string()))?;
    if meta.len() < 8 {
        return Err(err(
            0,
            format!("{} bytes: too short for a safetensors header", meta.len()),
        ));
    }
    // SAFETY: read-only map; a file truncated by another process while mapped would fault, the
    // usual caveat of mmap-based loaders.
    let map = unsafe { Mmap::map(&f) }.map_err(|e| err(0, e.to_string()))?;
    let len = map.len() as u64;
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER || n > len - 8 {
        return Err(err(0, format!("header length {n} exceeds the file ({len} bytes)")));
    }
    let text =
        std::str::from_utf8(&map[8..8 + n as usize]).map_err(|e| err(8, format!("the header is not UTF-8: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(text).map_err(|e| err(8, format!("the header is not valid JSON: {e}")))?;
    let obj = json
        .as_object()
        .ok_or_else(|| err(8, "the header is not a JSON object".into()))?;
    let data_offset = 8 + n;
    let data_len = len - data_offset;
    let mut tensors = Vec::with_capacity(obj.len());
    for (tname, v) in obj {
        if tname == "__metadata__" {
            continue;
        }
        let bad = |msg: String| err(8, format!("tensor {tname}: {msg}"));
        let dtype_s = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("no dtype".into()))?;
        let dtype = StDtype::parse(dtype_s).ok_or_else(|| {
            bad(format!(
                "dtype {dtype_s} is not supported (llmdiff reads F32, F16, BF16, scaled F8_E4M3 and gpt-oss's MXFP4 U8 blocks)"
            ))
        })?;
        let shape: Vec<usize> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no shape".into()))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("shape is not a list of counts".into()))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("no data_offsets".into()))?
            .iter()
            .map(|d| d.as_u64())
            .collect::<Option<_>>()
            .ok_or_else(|| bad("data_offsets are not offsets".into()))?;
        let [begin, end] = offs[..] else {
            return Err(bad(format!("data_offsets has {} entries, expected 2", offs.len())));
        };
        let n_elems = shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d as u64))
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        let want = n_elems
            .checked_mul(dtype.size() as u64)
            .ok_or_else(|| bad(format!("shape {shape:?} overflows")))?;
        if begin > end || end > data_len || end - begin != want {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] do not hold {shape:?} {dtype_s} ({want} bytes) within the {data_len}-byte data section"
            )));
        }
        tensors.push(StTensor {
            name: tname.clone(),
            dtype,
            shape,
            begin,
            n_bytes: want,
            file,
        });
    }
    Ok(StFile {
        map,
        data_offset,
        tensors,
    })
}

impl StFile {
    pub fn data(&self, t: &StTensor) -> &[u8] {
        let s = (self.data_offset + t.begin) as usize;
        &self.map[s..s + t.n_bytes as usize]
    }

    /// Drops this process's pages of `t` (they read back from the file).
    pub fn release(&self, t: &StTensor) {
        const PAGE: u64 = 4096;
        let start = (self.data_offset + t.begin).div_ceil(PAGE) * PAGE;
        let end = (self.data_offset + t.begin + t.n_bytes) / PAGE * PAGE;
        if end > start {
            // SAFETY: a private read-only file mapping; MADV_DONTNEED drops this process's copies
            // of the pages, which read back identically from the file.
            let _ = unsafe {
                self.map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start as usize,
                    (end - start) as usize,
                )
            };
        }
    }
}

/// float8_e4m3fn → f32, exactly (1 sign, 4 exponent bits with bias 7, 3 mantissa bits; no
/// infinities; S.1111.111 is NaN).
pub fn fp8_e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 0xF && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 8.0 * (2f32).powi(-6)
    } else {
        sign * (1.0 + m / 8.0) * (2f32).powi(e - 7)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_decodes_the_format_table() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0); // e = 7, m = 0
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0); // the largest finite
        assert_eq!(fp8_e4m3_to_f32(0xFE), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9)); // the smallest subnormal
        assert_eq!(fp8_e4m3_to_f32(0x08), 2f32.powi(-6)); // the smallest normal
        assert!(fp8_e4m3_to_f32(0x7F).is_nan() && fp8_e4m3_to_f32(0xFF).is_nan());
    }

    #[test]
    fn hostile_headers_are_errors_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.safetensors");
        let cases: Vec<Vec<u8>> = vec![
            vec![1, 2, 3],
            u64::MAX.to_le_bytes().to_vec(),
            [&10u64.to_le_bytes()[..], b"not json!!"].concat(),
            [&2u64.to_le_bytes()[..], b"[]"].concat(),
            {
                let h = br#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}}"#;
                [&(h.len() as u64).to_le_bytes()[..], h, &[0u8; 8]].concat()
            },
            {
                let h = br#"{"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}}"#;
                [&(h.len() as u64).to_le_bytes()[..], h, &[0u8; 8]].concat()
            },
            {
                let h = br#"{"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,8]}}"#;
                [&(h.len() as u64).to_le_bytes()[..], h, &[0u8; 8]].concat()
            },
        ];
        for bytes in cases {
            std::fs::write(&p, &bytes).unwrap();
            let e = open(&p, 0).err().expect("refused").to_string();
            assert!(e.contains("m.safetensors"), "{e}");
        }
    }
}
