//! Synthetic models and diff plans for the fault matrix, healthy and sensitivity tests:
//! synthesize a preset (optionally cut to fewer layers, in another weight type) into a
//! directory once, and build the [`DiffPlan`] the way `llmdiff diff-layers` does.

use engine::FaultSpec;
use harness::compare::{ActDtype, Tolerances};
use harness::diff::{run_diff_candidate, DiffPlan};
use harness::dump::Dump;
use references::synth::{preset, write_model, SynthSpec};
use references::writer::{GgufWriter, TensorSpec};
use references::{GgmlType, GgufFile};
use reports::DiffRun;
use std::path::Path;

/// The spec of `preset_name`, cut to `n_layers` (when given) and with its 2-D weights in
/// `weight_type` (when given, replacing a preset's per-tensor mix as `synth --quant` does; rows
/// that do not fit the type's blocks fall back as in `synth`).
pub fn spec(preset_name: &str, n_layers: Option<usize>, weight_type: Option<GgmlType>) -> SynthSpec {
    let mut s = preset(preset_name).unwrap_or_else(|| panic!("no preset {preset_name}"));
    if let Some(n) = n_layers {
        s.config.n_layers = n;
    }
    if let Some(t) = weight_type {
        s.weight_type = t;
        s.more_bits = None;
    }
    s
}

/// Writes `spec` (seed 0) to `dir/NAME.gguf` and opens it.
pub fn synth(dir: &Path, name: &str, spec: &SynthSpec) -> GgufFile {
    let path = dir.join(format!("{name}.gguf"));
    let f = std::fs::File::create(&path).expect("create model file");
    write_model(spec, 0, std::io::BufWriter::new(f), |_, _| {}).expect("synthesize model");
    GgufFile::open(&path).expect("open synthesized model")
}

/// Deterministic token ids below `vocab`, spread over the vocabulary.
pub fn tokens(vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|i| ((3 + i * 97 + i * i * 31) % vocab) as u32).collect()
}

/// The plan `diff-layers` builds, with default tolerances and f32 activations.
pub fn plan<'a>(
    file: &'a GgufFile,
    tokens: Vec<u32>,
    tp: usize,
    faults: Vec<FaultSpec>,
    decode_steps: usize,
) -> DiffPlan<'a> {
    DiffPlan {
        file,
        model_name: file.path.display().to_string(),
        tokens,
        engine: engine::EngineOptions {
            tp,
            faults,
            backend: engine::BackendKind::Cpu,
            ..engine::EngineOptions::default()
        },
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps,
        repro: String::new(),
    }
}

/// `diff-layers MODEL --candidate DUMP` with the defaults: the dump's tokens and TP degree,
/// default tolerances, f32 activations.
pub fn diff_dump(file: &GgufFile, dump: &Dump) -> anyhow::Result<DiffRun> {
    let plan = DiffPlan {
        file,
        model_name: file.path.display().to_string(),
        tokens: dump.tokens.clone(),
        engine: engine::EngineOptions {
            tp: dump.tp,
            ..engine::EngineOptions::default()
        },
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro: String::new(),
    };
    run_diff_candidate(&plan, dump)
}

/// `src` written to `path` with the rows `rows` selects of the F32 tensor `name` mapped through
/// `f` (every other tensor copied byte for byte): an engine's copy with a planted weight change.
pub fn with_rows_changed(
    src: &GgufFile,
    path: &Path,
    name: &str,
    rows: impl Fn(usize) -> bool,
    f: impl Fn(f32) -> f32,
) -> GgufFile {
    let specs = src
        .tensors()
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.ty, &t.ne))
        .collect();
    let w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut gw = GgufWriter::new(w, src.metadata(), specs).unwrap();
    for t in src.tensors() {
        let bytes = src.tensor_data(t);
        if t.name != name {
            gw.write_tensor(bytes).unwrap();
            continue;
        }
        assert_eq!(t.ty, GgmlType::F32, "{name} must be F32 to change it exactly");
        let d = t.ne[0] as usize;
        let mut out = bytes.to_vec();
        for (i, chunk) in out.chunks_exact_mut(4).enumerate() {
            if rows(i / d) {
                let x = f32::from_le_bytes(chunk.try_into().unwrap());
                chunk.copy_from_slice(&f(x).to_le_bytes());
            }
        }
        gw.write_tensor(&out).unwrap();
    }
    gw.finish().unwrap();
    GgufFile::open(path).unwrap()
}

/// `src` written to `path` with the F32 tensors `retype` names re-encoded in the type it gives
/// (`references::quant::quantize`; every other tensor copied byte for byte): an engine's copy
/// with, say, a Q8_0 or F16 weight where the fixture has F32.
pub fn with_types(src: &GgufFile, path: &Path, retype: impl Fn(&str) -> Option<GgmlType>) -> GgufFile {
    let new_ty = |t: &references::TensorInfo| retype(&t.name).filter(|_| t.ty == GgmlType::F32);
    let specs = src
        .tensors()
        .iter()
        .map(|t| TensorSpec::new(&t.name, new_ty(t).unwrap_or(t.ty), &t.ne))
        .collect();
    let w = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut gw = GgufWriter::new(w, src.metadata(), specs).unwrap();
    for t in src.tensors() {
        let bytes = src.tensor_data(t);
        match new_ty(t) {
            Some(ty) => {
                let x: Vec<f32> = bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect();
                gw.write_tensor(&references::quant::quantize(ty, &x).unwrap()).unwrap();
            }
            None => gw.write_tensor(bytes).unwrap(),
        }
    }
    gw.finish().unwrap();
    GgufFile::open(path).unwrap()
}
