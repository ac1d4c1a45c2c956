//! HF checkpoint folders as models: tiny random checkpoints saved by transformers 5.25 (bf16 and
//! fp32; llama sharded over four files with an index; an FP8 block-scaled DeepSeek-V3), written with
//! HF fp32 full-vocabulary log-probs and llama.cpp's GGUF conversion of each folder by
//! `tests/peers/hf_folders.py` into golden/hf/.
//!
//! - the folder is read as its GGUF conversion: the same metadata under `{arch}.*` and the same
//!   tensors (names, types, dims, bytes), so the reference on either is the same computation;
//! - the reference on the folder matches HF fp32: ≥ 16 positions, top-1 100 %, full-vocabulary
//!   max |Δ logprob| ≤ 2e-3;
//! - FP8: every dequantized weight equals torch's explicit `q.float() * scale` bit for bit (sha256
//!   of the f32 bytes), and the logits match HF fp32 on those weights.

use harness::logprobs::log_softmax;
use llmdiff_tests::fixtures::golden;
use references::forward::Reference;
use references::tap::NoTap;
use references::{GgufFile, ModelSource};
use serde_json::Value;
use sha2::{Digest, Sha256};

const FOLDERS: &[&str] = &[
    "llama31-bf16",
    "qwen3-f32",
    "qwen3moe-bf16",
    "deepseek-v3-bf16",
    "glm-dsa-bf16",
    "deepseek-v3-fp8",
];

fn doc(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(golden(&format!("hf/{name}.json"))).unwrap()).unwrap()
}

fn open(name: &str) -> GgufFile {
    GgufFile::open(golden(&format!("hf/{name}"))).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// (worst |Δ logprob| over the full vocabulary, top-1 agreements, positions).
fn compare(file: &GgufFile, doc: &Value) -> (f64, usize, usize) {
    let r = Reference::new(file).unwrap();
    let argmax = |v: &[f64]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0)))
            .unwrap()
            .0
    };
    let (mut worst, mut same, mut n) = (0f64, 0, 0);
    for case in doc["cases"].as_array().unwrap() {
        let tokens: Vec<u32> = case["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let logits = r.forward(&tokens, &mut NoTap).unwrap();
        let vocab = logits.len() / tokens.len();
        for (row, hf) in logits.chunks(vocab).zip(case["logprobs"].as_array().unwrap()) {
            let lp = log_softmax(row);
            let hf: Vec<f64> = hf.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            assert_eq!(hf.len(), vocab, "HF rows cover the whole vocabulary");
            same += usize::from(argmax(&lp) == argmax(&hf));
            worst = lp.iter().zip(&hf).fold(worst, |w, (a, b)| w.max((a - b).abs()));
            n += 1;
        }
    }
    (worst, same, n)
}

#[test]
fn every_folder_matches_hf_fp32() {
    for name in FOLDERS {
        let file = open(name);
        assert!(matches!(file.source, ModelSource::HfFolder { .. }));
        let (worst, same, n) = compare(&file, &doc(name));
        eprintln!("{name}: worst |dlogprob| {worst:.2e} over the full vocabulary, top-1 {same}/{n}");
        assert!(n >= 16, "{name}: {n} positions");
        assert_eq!(same, n, "{name}: top-1");
        assert!(worst <= 2e-3, "{name}: worst |dlogprob| {worst}");
    }
}

/// The folder and llama.cpp's conversion of it: the same `{arch}.*` metadata and the same tensors,
/// value for value (the conversion is bf16 or f32 as the folder is stored, norms upcast to f32).
#[test]
fn a_folder_reads_as_its_gguf_conversion() {
    for name in FOLDERS.iter().filter(|n| !n.ends_with("fp8")) {
        let hf = open(name);
        let gguf = GgufFile::open(golden(&format!("hf/{name}.gguf"))).unwrap();
        let arch = gguf.get("general.architecture").unwrap().as_str().unwrap().to_string();
        assert_eq!(hf.get("general.architecture").unwrap().as_str(), Some(arch.as_str()), "{name}");
        let prefix = format!("{arch}.");
        for (k, v) in gguf.metadata().iter().filter(|(k, _)| k.starts_with(&prefix)) {
            let mine = hf.get(k).unwrap_or_else(|| panic!("{name}: {k} missing"));
            let (a, b) = (mine.as_f64(), v.as_f64());
            let same = match (a, b) {
                (Some(a), Some(b)) => a == b,
                _ => mine.to_string() == v.to_string(),
            };
            assert!(same, "{name}: {k} = {mine}, the converter's {v}");
        }
        for (k, _) in hf.metadata().iter().filter(|(k, _)| k.starts_with(&prefix)) {
            assert!(gguf.get(k).is_some(), "{name}: {k} is not in the conversion");
        }
        let mut names: Vec<_> = gguf.tensors().iter().map(|t| t.name.clone()).collect();
        let mut mine: Vec<_> = hf.tensors().iter().map(|t| t.name.clone()).collect();
        names.sort();
        mine.sort();
        assert_eq!(mine, names, "{name}: tensor names");
        for t in gguf.tensors() {
            let m = hf.tensor(&t.name).unwrap();
            assert_eq!(m.ne, t.ne, "{name}: {} dims", t.name);
            let a = references::dequant::dequantize_to_vec(m.ty, hf.tensor_data(m)).unwrap();
            let b = references::dequant::dequantize_to_vec(t.ty, gguf.tensor_data(t)).unwrap();
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{name}: {} values differ",
                t.name
            );
        }
    }
}

#[test]
fn fp8_weights_equal_torch_dequantization_bit_for_bit() {
    let file = open("deepseek-v3-fp8");
    let d = doc("deepseek-v3-fp8");
    let digests = d["dequantized_sha256"].as_object().unwrap();
    assert!(digests.len() >= 20, "{} quantized weights", digests.len());
    // The HF names of the quantized weights → the GGUF tensors made from them.
    let mut checked = 0;
    for (hf_name, want) in digests {
        let rest = hf_name.strip_prefix("model.layers.").unwrap();
        let (l, rest) = rest.split_once('.').unwrap();
        let gguf = match rest {
            "self_attn.q_a_proj.weight" => "attn_q_a",
            "self_attn.q_b_proj.weight" => "attn_q_b",
            "self_attn.o_proj.weight" => "attn_output",
            "self_attn.kv_a_proj_with_mqa.weight" => "attn_kv_a_mqa",
            "mlp.gate_proj.weight" => "ffn_gate",
            "mlp.up_proj.weight" => "ffn_up",
            "mlp.down_proj.weight" => "ffn_down",
            "mlp.shared_experts.gate_proj.weight" => "ffn_gate_shexp",
            "mlp.shared_experts.up_proj.weight" => "ffn_up_shexp",
            "mlp.shared_experts.down_proj.weight" => "ffn_down_shexp",
            _ => continue, // kv_b is split and experts are stacked: their bytes are rearranged
        };
        let t = file.tensor(&format!("blk.{l}.{gguf}.weight")).unwrap();
        assert_eq!(t.ty, references::GgmlType::F32);
        let got = format!("{:x}", Sha256::digest(file.tensor_data(t)));
        assert_eq!(&got, want.as_str().unwrap(), "{hf_name}");
        checked += 1;
    }
    assert!(checked >= 10, "{checked} checked");
    // A partial block: ffn_gate of the dense layer is 160 rows (128 + 32).
    let t = file.tensor("blk.0.ffn_gate.weight").unwrap();
    assert_eq!(t.ne, [64, 160]);
}
