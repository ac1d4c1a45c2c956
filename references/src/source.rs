//! The model source: one entry point for a `MODEL` argument, whatever it is. A GGUF file (or the
//! first shard of a split one) opens with [`GgufFile::open`]; a folder is an HF checkpoint
//! (`config.json` + safetensors) and opens with [`crate::hf::open`] as the GGUF
//! convert_hf_to_gguf.py would write for it. Either way the result is a [`GgufFile`]: the config
//! (`ModelConfig::from_header`) and the tensors by GGUF name with their type and dims,
//! memory-mapped, released a layer at a time; [`GgufFile::source`] says which it was.

use crate::gguf::{GgufError, GgufFile};
use std::path::Path;

/// Opens `path`: an HF checkpoint folder, or a GGUF file.
pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
    let path = path.as_ref();
    if path.is_dir() {
        crate::hf::open(path)
    } else {
        GgufFile::open(path)
    }
}
