//! The GQA/MoE families (qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3, gpt-oss): the reference against
//! HF transformers fp32 on tiny random models converted by llama.cpp's convert_hf_to_gguf.py
//! (llama-cpp-python 0.3.36). Fixtures and expectations (full-vocabulary log-probs at every
//! position of two prompts, 81 positions) were committed in golden/ by
//! `tests/peers/family_tiny.py FAMILY`. Each fixture reaches its family's branches (see that
//! script); each family also has a control: the same comparison with one of its features or
//! llama.cpp's fixed constants switched off is far from HF, so the conformance test can fail.

use engine::{BackendKind, Engine, EngineOptions};
use harness::logprobs::log_softmax;
use llmdiff_tests::fixtures::golden;
use references::config::{Arch, ModelConfig};
use references::forward::Reference;
use references::tap::NoTap;
use references::GgufFile;
use serde_json::Value;

/// The HF golden's cases for `family`: each one's token ids and its `logprobs` rows.
fn hf_cases(family: &str) -> Vec<(Vec<u32>, Value)> {
    let path = golden(&format!("hf-{family}-tiny.json"));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    doc["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|case| {
            let tokens = case["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            (tokens, case["logprobs"].clone())
        })
        .collect()
}

fn open(family: &str) -> GgufFile {
    GgufFile::open(golden(&format!("{family}-tiny.f32.gguf"))).unwrap()
}

/// Worst |Δlogprob| over the whole vocabulary, top-1 agreement and positions of the reference
/// on `family`'s fixture, its config first changed by `edit`.
fn compare(family: &str, edit: impl FnOnce(&mut ModelConfig)) -> (f64, usize, usize) {
    let file = open(family);
    let mut r = Reference::new(&file).unwrap();
    edit(&mut r.config);
    let (mut worst, mut same_top1, mut n_pos) = (0f64, 0, 0);
    let argmax = |v: &[f64]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .unwrap()
            .0
    };
    for (tokens, hf_rows) in hf_cases(family) {
        let logits = r.forward(&tokens, &mut NoTap).unwrap();
        let vocab = logits.len() / tokens.len();
        for (row, hf) in logits.chunks(vocab).zip(hf_rows.as_array().unwrap()) {
            let lp = log_softmax(row);
            let hf: Vec<f64> = hf.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(hf.len(), vocab, "HF rows cover the whole vocabulary");
            same_top1 += usize::from(argmax(&lp) == argmax(&hf));
            worst = lp.iter().zip(&hf).fold(worst, |w, (a, b)| w.max((a - b).abs()));
            n_pos += 1;
        }
    }
    (worst, same_top1, n_pos)
}

/// The conformance bound: ≥ 16 positions, top-1 100 %, full-vocabulary max |Δ logprob| ≤ 2e-3.
fn assert_matches_hf(family: &str, arch: Arch) {
    let file = open(family);
    assert_eq!(Reference::new(&file).unwrap().config.arch, arch);
    let size = std::fs::metadata(golden(&format!("{family}-tiny.f32.gguf")))
        .unwrap()
        .len();
    let (worst, same, n) = compare(family, |_| {});
    eprintln!(
        "{family} tiny ({size} bytes) vs HF fp32: worst |dlogprob| {worst:.2e} over the full vocabulary, top-1 {same}/{n}"
    );
    assert!(size < 1 << 20, "{family}: fixture of {size} bytes");
    assert!(n >= 16, "{family}: {n} positions");
    assert_eq!(same, n, "{family}: top-1 agreement");
    assert!(worst <= 2e-3, "{family}: worst |dlogprob| {worst}");
}

/// The control: with `edit` applied the reference is far from HF.
fn assert_far(family: &str, what: &str, edit: impl FnOnce(&mut ModelConfig)) {
    let (worst, _, _) = compare(family, edit);
    eprintln!("{family}, {what}: worst |dlogprob| {worst:.2e}");
    assert!(worst > 0.05, "{family}, {what}: worst |dlogprob| {worst}");
}

#[test]
fn qwen2_matches_hf_fp32() {
    assert_matches_hf("qwen2", Arch::Qwen2);
    // NORM-pair RoPE is what a llama reader would apply: the rope_dim trick below rotates a
    // different subset of dims, standing in for a wrong rotation.
    assert_far("qwen2", "RoPE on half the head", |c| c.rope_dim = c.head_dim / 2);
}

#[test]
fn qwen3_matches_hf_fp32() {
    assert_matches_hf("qwen3", Arch::Qwen3);
    assert_far("qwen3", "RMS eps 1e-1 (q/k norms and block norms)", |c| c.rms_eps = 0.1);
}

/// A copy of `family`'s fixture without the tensors `drop` names, opened.
fn without(family: &str, drop: impl Fn(&str) -> bool, dir: &std::path::Path) -> GgufFile {
    use references::writer::{GgufWriter, TensorSpec};
    let file = open(family);
    let path = dir.join(format!("{family}-stripped.gguf"));
    let kept: Vec<_> = file.tensors().iter().filter(|t| !drop(&t.name)).collect();
    assert!(kept.len() < file.tensors().len(), "{family}: nothing dropped");
    let specs = kept.iter().map(|t| TensorSpec::new(&t.name, t.ty, &t.ne)).collect();
    let out = std::fs::File::create(&path).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(out), file.metadata(), specs).unwrap();
    for t in &kept {
        w.write_tensor(file.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();
    GgufFile::open(&path).unwrap()
}

/// qwen3's and gemma3's q/k norms are required (as llama.cpp's loader requires them): a file
/// without them is an error naming the tensor, not a silently different model.
#[test]
fn missing_qk_norms_are_an_error_naming_the_tensor() {
    let dir = tempfile::tempdir().unwrap();
    for family in ["qwen3", "qwen3moe", "gemma3"] {
        let file = without(family, |n| n.ends_with("attn_q_norm.weight"), dir.path());
        let e = Reference::new(&file)
            .unwrap()
            .forward(&[1, 2], &mut NoTap)
            .unwrap_err()
            .to_string();
        assert!(e.contains("blk.0.attn_q_norm.weight"), "{family}: {e}");
    }
    // qwen2 without its biases is far from HF (they are used when present).
    let file = without("qwen2", |n| n.ends_with(".bias"), dir.path());
    let r = Reference::new(&file).unwrap();
    let (tokens, hf) = hf_cases("qwen2").swap_remove(1);
    let logits = r.forward(&tokens, &mut NoTap).unwrap();
    let vocab = logits.len() / tokens.len();
    let worst = logits
        .chunks(vocab)
        .zip(hf.as_array().unwrap())
        .flat_map(|(row, hf)| {
            let lp = log_softmax(row);
            let hf: Vec<f64> = hf.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            lp.into_iter().zip(hf).map(|(a, b)| (a - b).abs()).collect::<Vec<_>>()
        })
        .fold(0f64, f64::max);
    eprintln!("qwen2 without q/k/v biases: worst |dlogprob| {worst:.2e}");
    assert!(worst > 0.05, "{worst}");
}

#[test]
fn qwen3moe_matches_hf_fp32() {
    assert_matches_hf("qwen3moe", Arch::Qwen3Moe);
    let file = open("qwen3moe");
    let c = Reference::new(&file).unwrap().config;
    let moe = c.moe.as_ref().expect("qwen3moe routes through experts");
    assert!(moe.weights_norm && moe.n_used < moe.n_experts && c.is_moe_layer(0));
    // llama.cpp renormalises qwen3moe's top-k weights whatever the file says (no key for it).
    assert_far("qwen3moe", "top-k weights not renormalised", |c| {
        c.moe.as_mut().unwrap().weights_norm = false
    });
}

#[test]
fn glm4moe_matches_hf_fp32() {
    assert_matches_hf("glm4moe", Arch::Glm4Moe);
    let file = open("glm4moe");
    let c = Reference::new(&file).unwrap().config;
    let moe = c.moe.as_ref().unwrap();
    assert!(
        !c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(2),
        "dense lead, then MoE"
    );
    assert!(moe.n_shared == 1 && moe.weights_scale == 2.5);
    assert_eq!(c.rope_dim * 2, c.head_dim, "partial rotary");
    assert_far("glm4moe", "full rotary", |c| c.rope_dim = c.head_dim);
    assert_far("glm4moe", "softmax gating", |c| {
        c.moe.as_mut().unwrap().gating = references::config::Gating::Softmax
    });
}

#[test]
fn gemma2_matches_hf_fp32() {
    assert_matches_hf("gemma2", Arch::Gemma2);
    let file = open("gemma2");
    let f = Reference::new(&file).unwrap().config.family;
    assert_eq!(f.sliding_window, Some(4));
    assert_eq!(f.swa_layers, [true, false, true, false], "llama.cpp's gemma2 pattern");
    assert!(f.attn_softcap == Some(5.0) && f.final_softcap == Some(30.0) && f.attn_scale.is_none());
    assert_far("gemma2", "no sliding window", |c| c.family.sliding_window = None);
    assert_far("gemma2", "no attention soft-capping", |c| c.family.attn_softcap = None);
    assert_far("gemma2", "no final soft-capping", |c| c.family.final_softcap = None);
    assert_far("gemma2", "27B's attention scale", |c| {
        c.family.attn_scale = Some(1.0 / 4.0f64.sqrt())
    });
}

#[test]
fn gemma3_matches_hf_fp32() {
    assert_matches_hf("gemma3", Arch::Gemma3);
    let file = open("gemma3");
    let c = Reference::new(&file).unwrap().config;
    let f = &c.family;
    assert_eq!(
        f.swa_layers,
        [true, true, true, true, true, false, true],
        "llama.cpp's gemma3 pattern"
    );
    assert!(f.rope_base_swa == 10000.0 && c.rope_base == 1e6);
    assert_far("gemma3", "global RoPE base on the local layers", |c| {
        c.family.rope_base_swa = c.rope_base
    });
    assert_far("gemma3", "every layer local", |c| c.family.swa_layers = vec![true; 7]);
}

#[test]
fn gpt_oss_matches_hf_fp32() {
    assert_matches_hf("gpt-oss", Arch::GptOss);
    let file = open("gpt-oss");
    let c = Reference::new(&file).unwrap().config;
    assert_eq!(c.family.swa_layers, [true, false], "llama.cpp's gpt-oss pattern");
    assert_eq!(c.family.sliding_window, Some(4));
    assert_far("gpt-oss", "no sliding window", |c| c.family.sliding_window = None);
}

/// gpt-oss with YaRN as its released configs declare it (truncate false; base 100, factor 4,
/// original context 64 so the ramp and the cos/sin factor act within the prompts): llama.cpp's
/// converter writes the yarn keys, the reference takes HF's frequencies. Controls: no YaRN at
/// all, and llama.cpp's truncated ramp, are both visibly off.
#[test]
fn gpt_oss_yarn_matches_hf_fp32() {
    assert_matches_hf("gpt-oss-yarn", Arch::GptOss);
    let file = open("gpt-oss-yarn");
    let y = Reference::new(&file)
        .unwrap()
        .config
        .yarn
        .expect("the file declares YaRN");
    assert_eq!((y.factor, y.original_context, y.truncate), (4.0, 64, false));
    assert_far("gpt-oss-yarn", "no YaRN", |c| c.yarn = None);
    let (trunc, _, _) = compare("gpt-oss-yarn", |c| c.yarn.as_mut().unwrap().truncate = true);
    eprintln!("gpt-oss-yarn with llama.cpp's truncated ramp: worst |dlogprob| {trunc:.2e}");
    assert!(trunc > 2e-3, "the truncated ramp should be visible: {trunc:e}");
}

/// The TP engine does not run gpt-oss yet: it refuses it in one line naming what works (the
/// engine's runs of the other families: `engine_families.rs`).
#[test]
fn engine_refuses_gpt_oss_naming_what_works() {
    let file = open("gpt-oss");
    let opts = EngineOptions {
        tp: 1,
        backend: BackendKind::Cpu,
        ..EngineOptions::default()
    };
    let e = Engine::load(&file, opts).err().expect("refused").to_string();
    assert!(!e.contains('\n') && e.contains("gpt-oss"), "{e}");
    assert!(
        e.contains("--backend reference") && e.contains("--candidate") && e.contains("entropy --server"),
        "{e}"
    );
}

/// gpt-oss ships its experts in MXFP4: the fixture's expert tensors quantized to MXFP4 run
/// through the same reference (the stacked 3-D tensors sliced per expert, each row decoded by the
/// reference dequantizer) and give bit for bit the logits of the same weights stored as their
/// exact f32 decoding.
#[test]
fn gpt_oss_mxfp4_experts_run_as_their_f32_decoding() {
    use references::dequant::dequantize_to_vec;
    use references::quant::quantize;
    use references::writer::{GgufWriter, TensorSpec};
    use references::GgmlType;
    let file = open("gpt-oss");
    let dir = tempfile::tempdir().unwrap();
    let write = |path: &std::path::Path, mxfp4: bool| {
        let mut specs = Vec::new();
        let mut blobs = Vec::new();
        for t in file.tensors() {
            let data = file.tensor_data(t);
            if t.name.ends_with("_exps.weight") {
                assert_eq!(t.ty, GgmlType::F32);
                let f: Vec<f32> = dequantize_to_vec(t.ty, data).unwrap();
                let q = quantize(GgmlType::MXFP4, &f).unwrap();
                if mxfp4 {
                    specs.push(TensorSpec::new(&t.name, GgmlType::MXFP4, &t.ne));
                    blobs.push(q);
                } else {
                    let back = dequantize_to_vec(GgmlType::MXFP4, &q).unwrap();
                    specs.push(TensorSpec::new(&t.name, GgmlType::F32, &t.ne));
                    blobs.push(back.iter().flat_map(|v| v.to_le_bytes()).collect());
                }
            } else {
                specs.push(TensorSpec::new(&t.name, t.ty, &t.ne));
                blobs.push(data.to_vec());
            }
        }
        let out = std::fs::File::create(path).unwrap();
        let mut w = GgufWriter::new(std::io::BufWriter::new(out), file.metadata(), specs).unwrap();
        for b in &blobs {
            w.write_tensor(b).unwrap();
        }
        w.finish().unwrap();
        GgufFile::open(path).unwrap()
    };
    let q = write(&dir.path().join("mxfp4.gguf"), true);
    let f = write(&dir.path().join("decoded.gguf"), false);
    assert!(q.tensors().iter().any(|t| t.ty == GgmlType::MXFP4));
    let tokens = hf_cases("gpt-oss").swap_remove(0).0;
    let lq = Reference::new(&q).unwrap().forward(&tokens, &mut NoTap).unwrap();
    let lf = Reference::new(&f).unwrap().forward(&tokens, &mut NoTap).unwrap();
    assert_eq!(lq, lf, "MXFP4 experts and their f32 decoding");
    let orig = Reference::new(&file).unwrap().forward(&tokens, &mut NoTap).unwrap();
    assert_ne!(lq, orig, "the MXFP4 rounding changed some weight");
}

/// A run that cannot exercise a path says so: the fixtures' 81 positions pass their windows,
/// 4 tokens do not; a model whose layers are all leading dense ones never reaches an expert.
#[test]
fn coverage_warnings_name_the_unexercised_paths() {
    for family in ["gemma2", "gemma3", "gpt-oss"] {
        let c = Reference::new(&open(family)).unwrap().config;
        assert!(c.coverage_warnings(16).is_empty(), "{family}");
        let w = c.coverage_warnings(4);
        assert!(w.len() == 1 && w[0].contains("sliding window of 4"), "{family}: {w:?}");
    }
    let mut c = Reference::new(&open("glm4moe")).unwrap().config;
    assert!(c.coverage_warnings(16).is_empty());
    c.moe.as_mut().unwrap().n_dense_lead = c.n_layers;
    assert!(c.coverage_warnings(16)[0].contains("no MoE layer"));
}
