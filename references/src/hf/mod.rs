//! Hugging Face checkpoint folders (`config.json` + `model.safetensors`, or
//! `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`) as a model source.
//!
//! A folder opens ([`open`], or [`crate::source::open`] for either kind of model) as the GGUF llama.cpp's convert_hf_to_gguf.py would write for it — the same
//! metadata ([`config`]), the same tensor names, layouts and values ([`weights`]) — so the
//! reference, the engine and every command run on it unchanged, and a tap from a folder and from
//! its GGUF conversion are the same tensor (see `tap.rs`).
//!
//! Tensors the converter only renames are served zero-copy from the safetensors maps (F32, F16
//! and BF16 are GGML types). Tensors it transforms — llama/mistral q/k rows permuted from HF's
//! rotate-half order to llama.cpp's interleaved pairs, per-expert tensors stacked, MLA's kv_b split
//! into k_b (transposed per head) and v_b, FP8 weights (DeepSeek 128×128 blocks, compressed-tensors
//! per tensor/channel/block) dequantized to f32, gpt-oss's MXFP4 experts repacked into GGML MXFP4
//! (f32(value) × scale, bit-exact), Llama 3.1's `rope_freqs` computed — are written once, one
//! tensor (one expert) at a time, to an unlinked temporary file that is then memory-mapped like the
//! others. Peak memory stays about one layer; the temporary file costs disk (for an FP8 model, 4
//! bytes per quantized weight).

pub mod config;
pub mod safetensors;
pub mod weights;

use crate::gguf::{GgufError, GgufFile, GgufHeader, ModelSource, TensorInfo};
use memmap2::Mmap;
use std::path::{Path, PathBuf};

type JsonMap = serde_json::Map<String, serde_json::Value>;

/// The largest config.json / index read (they are a few KB).
const MAX_JSON: u64 = 64 << 20;

fn read_json(path: &Path) -> Result<JsonMap, GgufError> {
    let err = |msg: String| GgufError {
        file: path.display().to_string(),
        offset: 0,
        msg,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() || meta.len() > MAX_JSON {
        return Err(err(format!("not a regular file of at most {MAX_JSON} bytes")));
    }
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    match serde_json::from_str(&text).map_err(|e| err(format!("not valid JSON: {e}")))? {
        serde_json::Value::Object(m) => Ok(m),
        _ => Err(err("not a JSON object".into())),
    }
}

/// The safetensors files of `dir`: those the index names (each must exist), else
/// `model.safetensors`.
fn shard_files(dir: &Path) -> Result<(Vec<PathBuf>, Option<JsonMap>), GgufError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let idx = read_json(&index)?;
        let map = idx
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| GgufError {
                file: index.display().to_string(),
                offset: 0,
                msg: "no weight_map object".into(),
            })?;
        let mut files: Vec<String> = Vec::new();
        for v in map.values() {
            let f = v
                .as_str()
                .filter(|f| !f.contains('/') && !f.contains('\\') && *f != "..");
            let f = f.ok_or_else(|| GgufError {
                file: index.display().to_string(),
                offset: 0,
                msg: format!("weight_map entry {v} is not a file name in the folder"),
            })?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        let paths: Vec<PathBuf> = files.iter().map(|f| dir.join(f)).collect();
        for p in &paths {
            if !p.is_file() {
                return Err(GgufError {
                    file: p.display().to_string(),
                    offset: 0,
                    msg: format!("missing: the shard is named in {}", index.display()),
                });
            }
        }
        return Ok((paths, Some(map.clone())));
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single], None));
    }
    Err(GgufError {
        file: dir.display().to_string(),
        offset: 0,
        msg: "no model.safetensors and no model.safetensors.index.json".into(),
    })
}

/// Opens `dir` (a folder with config.json) as the GGUF its conversion would be.
pub fn open(dir: &Path) -> Result<GgufFile, GgufError> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(GgufError {
            file: dir.display().to_string(),
            offset: 0,
            msg: "a folder without config.json (a model folder holds config.json and its safetensors; a GGUF model is a file)".into(),
        });
    }
    let cfg = read_json(&cfg_path)?;
    let tr = config::translate(&cfg).map_err(|msg| GgufError {
        file: cfg_path.display().to_string(),
        offset: 0,
        msg,
    })?;
    let (paths, index) = shard_files(dir)?;
    let mut files = Vec::with_capacity(paths.len());
    for (i, p) in paths.iter().enumerate() {
        files.push(safetensors::open(p, i)?);
    }
    if let Some(index) = &index {
        // Each tensor the index names is in the file it names, and no file holds another.
        for f in &files {
            for t in &f.tensors {
                let named = index.get(&t.name).and_then(|v| v.as_str());
                let here = paths[t.file].file_name().and_then(|n| n.to_str());
                if named != here {
                    return Err(GgufError {
                        file: paths[t.file].display().to_string(),
                        offset: 0,
                        msg: format!("tensor {} is here, the index says {named:?}", t.name),
                    });
                }
            }
        }
        let have: std::collections::HashSet<&str> = files
            .iter()
            .flat_map(|f| f.tensors.iter().map(|t| t.name.as_str()))
            .collect();
        if let Some(missing) = index.keys().find(|k| !have.contains(k.as_str())) {
            return Err(GgufError {
                file: dir.join("model.safetensors.index.json").display().to_string(),
                offset: 0,
                msg: format!("tensor {missing} is named in the index but in none of the shards"),
            });
        }
    }
    let plan = weights::plan(&tr.hp, &files, &paths)?;
    let mut maps: Vec<Mmap> = Vec::new();
    let mut data_offsets: Vec<u64> = Vec::new();
    let derived_file = files.len();
    let derived = weights::write_derived(&plan, &tr.hp, &files, &paths)?;
    let mut tensors: Vec<TensorInfo> = Vec::with_capacity(plan.len());
    let mut derived_offsets = derived.offsets.into_iter();
    for p in &plan {
        match &p.recipe {
            weights::Recipe::Direct(src) => {
                let t = &files[src.0].tensors[src.1];
                tensors.push(TensorInfo {
                    name: p.name.clone(),
                    ty: p.ty,
                    ne: p.ne.clone(),
                    offset: t.begin,
                    n_bytes: t.n_bytes,
                    shard: t.file,
                });
            }
            _ => {
                let (offset, n_bytes) = derived_offsets.next().expect("one offset per derived tensor");
                tensors.push(TensorInfo {
                    name: p.name.clone(),
                    ty: p.ty,
                    ne: p.ne.clone(),
                    offset,
                    n_bytes,
                    shard: derived_file,
                });
            }
        }
    }
    for f in files {
        data_offsets.push(f.data_offset);
        maps.push(f.map);
    }
    if let Some(m) = derived.map {
        maps.push(m);
        data_offsets.push(0);
    }
    let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    let header = GgufHeader {
        version: 3,
        metadata: tr.metadata,
        tensors,
        alignment: 32,
        data_offset: 0,
        allow_unknown: Vec::new(),
    };
    Ok(GgufFile::from_parts(
        dir.to_path_buf(),
        header,
        maps,
        data_offsets,
        ModelSource::HfFolder { tokenizer_json },
    ))
}
