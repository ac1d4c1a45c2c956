//! `llmdiff synth --preset glm5-mini` writes a glm-dsa model (GLM-5's attention, the DSA indexer,
//! the MTP block, a UD-style quant mix) that the reference runs, whole and split by size
//! (`--split-max-size`), with the same logits either way.

use references::forward::Reference;
use references::tap::{CollectTap, NoTap, Site};
use references::{GgufFile, ModelConfig};
use std::path::{Path, PathBuf};

/// Runs `llmdiff synth --preset glm5-mini --seed 3 -o DIR/NAME.gguf` with `extra` and returns
/// the path to open: the file, or the first shard when `extra` splits it.
fn synth(dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(format!("{name}.gguf"));
    let mut argv = vec![
        "llmdiff",
        "synth",
        "--preset",
        "glm5-mini",
        "--seed",
        "3",
        "-o",
        out.to_str().unwrap(),
    ];
    argv.extend_from_slice(extra);
    let cli = <harness::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
    let code = harness::commands::run(cli).unwrap();
    assert_eq!(code, std::process::ExitCode::SUCCESS, "{extra:?}");
    if out.exists() {
        return out;
    }
    let first = format!("{name}-00001-of-");
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&first))
        .expect("the first shard")
}

/// Entropy (nats) of the softmax of one row of logits.
fn entropy(row: &[f32]) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
    row.iter()
        .map(|&x| {
            let p = (x as f64 - max).exp() / z;
            if p > 0.0 {
                -p * p.ln()
            } else {
                0.0
            }
        })
        .sum()
}

#[test]
fn glm5_mini_runs_on_the_reference_whole_and_split() {
    let dir = tempfile::tempdir().unwrap();
    let whole = synth(dir.path(), "whole", &[]);
    let first = synth(dir.path(), "split", &["--split-max-size", "2M"]);

    let file = GgufFile::open(&whole).unwrap();
    let split = GgufFile::open(&first).unwrap();
    let bytes = std::fs::metadata(&whole).unwrap().len();
    assert!(
        split.n_shards() > 1,
        "{} shards of a {bytes}-byte model",
        split.n_shards()
    );
    let c = ModelConfig::from_header(&file.header).unwrap();
    assert_eq!(c.arch.name(), "glm-dsa");
    assert_eq!((c.n_layers, c.nextn_layers), (3, 1));
    assert_eq!(ModelConfig::from_header(&split.header).unwrap(), c);

    // 24 tokens: more than the indexer's top_k of 16, so the sparse selection runs.
    let toks: Vec<u32> = (0..24u32)
        .map(|i| 3 + (i * 97 + i * i * 31) % (c.vocab as u32 - 3))
        .collect();
    let mut taps = CollectTap::new(|k| matches!(k.site, Site::ResidOut | Site::IndexerTopk));
    let a = Reference::new(&file).unwrap().forward(&toks, &mut taps).unwrap();
    let b = Reference::new(&split).unwrap().forward(&toks, &mut NoTap).unwrap();
    assert_eq!(a.len(), toks.len() * c.vocab);
    assert!(a.iter().all(|x| x.is_finite()));
    assert_eq!(a, b, "split and whole files give different logits");
    let flat = (c.vocab as f64).ln();
    let mean: f64 = a.chunks(c.vocab).map(entropy).sum::<f64>() / toks.len() as f64;
    assert!(mean < 0.8 * flat, "mean entropy {mean:.2} nats vs flat {flat:.2}");
    // The residual stays near unit scale through the layers (the synth's weight scaling).
    let resid: Vec<f64> = taps
        .recorded
        .iter()
        .filter(|r| r.key.site == Site::ResidOut)
        .map(|r| (r.data.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / r.data.len() as f64).sqrt())
        .collect();
    assert_eq!(
        resid.len(),
        3,
        "one residual per model layer (the MTP block is not run)"
    );
    assert!(
        resid.iter().all(|&r| (0.5..8.0).contains(&r)),
        "residual RMS per layer {resid:?}"
    );
    // Each query past the 16th attends to 16 keys; layer 2 (`shared`) reuses layer 1's choice.
    let topk: Vec<_> = taps
        .recorded
        .iter()
        .filter(|r| r.key.site == Site::IndexerTopk)
        .collect();
    assert_eq!(topk.len(), 3);
    assert_eq!(topk[0].shape, [24, 16]);
    assert!(topk[0].data.iter().all(|&x| x >= -1.0 && x < 24.0));
    assert_ne!(topk[0].data, topk[1].data, "layers 0 and 1 have their own indexers");
    assert_eq!(topk[1].data, topk[2].data, "layer 2 reuses layer 1's selection");
}
