//! Shared helpers for the engine's integration tests: synthesize a preset (optionally edited)
//! into a temp file and open it.

#![allow(dead_code)]

use references::synth::{preset, write_model, SynthSpec};
use references::{GgmlType, GgufFile};

/// A synthesized model kept alive with its temp dir.
pub struct Model {
    _dir: tempfile::TempDir,
    pub file: GgufFile,
}

impl Model {
    pub fn from_parts(dir: tempfile::TempDir, file: GgufFile) -> Model {
        Model { _dir: dir, file }
    }
}

pub fn spec(name: &str, weight_type: GgmlType, edit: impl FnOnce(&mut SynthSpec)) -> SynthSpec {
    let mut s = preset(name).unwrap_or_else(|| panic!("no preset {name}"));
    // Every weight in `weight_type`, as `synth --quant` does (a preset's own mix dropped).
    s.more_bits = None;
    s.weight_type = weight_type;
    if weight_type != GgmlType::Q8_0 {
        s.embd_type = weight_type;
    }
    edit(&mut s);
    s
}

pub fn synth(spec: &SynthSpec, seed: u64) -> Model {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    let f = std::fs::File::create(&path).expect("create");
    write_model(spec, seed, std::io::BufWriter::new(f), |_, _| {}).expect("synth");
    let file = GgufFile::open(&path).expect("open");
    Model { _dir: dir, file }
}

pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

pub fn argmax_rows(logits: &[f32], vocab: usize) -> Vec<usize> {
    logits
        .chunks(vocab)
        .map(|r| {
            let mut best = 0;
            for (i, &x) in r.iter().enumerate() {
                if x > r[best] {
                    best = i;
                }
            }
            best
        })
        .collect()
}

pub fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    (0..n)
        .map(|i| ((i as u64 * 7919 + seed * 104729 + 3) % vocab as u64) as u32)
        .collect()
}
