//! HF checkpoint folders as models: tiny random checkpoints saved by transformers 5.25 (bf16 and
//! fp32: llama (sharded over four files with an index), qwen3, qwen3moe, glm4moe, gemma2, gemma3, gpt-oss,
//! deepseek-v3, glm-dsa; an FP8 block-scaled DeepSeek-V3), written with
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
    "glm4moe-bf16",
    "gemma2-f32",
    "gemma3-f32",
    "gpt-oss-bf16",
    "deepseek-v3-fp8",
    "qwen3-fp8-channel",
    "gpt-oss-mxfp4",
];

fn doc(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(golden(&format!("hf/{name}.json"))).unwrap()).unwrap()
}

fn open(name: &str) -> GgufFile {
    references::source::open(golden(&format!("hf/{name}"))).unwrap_or_else(|e| panic!("{name}: {e}"))
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
    for name in FOLDERS.iter().filter(|n| !n.contains("fp8")) {
        let hf = open(name);
        let gguf = GgufFile::open(golden(&format!("hf/{name}.gguf"))).unwrap();
        let arch = gguf.get("general.architecture").unwrap().as_str().unwrap().to_string();
        assert_eq!(
            hf.get("general.architecture").unwrap().as_str(),
            Some(arch.as_str()),
            "{name}"
        );
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
    // DeepSeek-style 128×128 blocks (weight_scale_inv), and compressed-tensors' per-channel scales.
    for (folder, min) in [("deepseek-v3-fp8", 10), ("qwen3-fp8-channel", 14)] {
        let file = open(folder);
        let d = doc(folder);
        let digests = d["dequantized_sha256"].as_object().unwrap();
        // The HF names of the quantized weights → the GGUF tensors made from them.
        let mut checked = 0;
        for (hf_name, want) in digests {
            let rest = hf_name.strip_prefix("model.layers.").unwrap();
            let (l, rest) = rest.split_once('.').unwrap();
            let gguf = match rest {
                "self_attn.q_a_proj.weight" => "attn_q_a",
                "self_attn.q_b_proj.weight" => "attn_q_b",
                "self_attn.q_proj.weight" => "attn_q",
                "self_attn.k_proj.weight" => "attn_k",
                "self_attn.v_proj.weight" => "attn_v",
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
            assert_eq!(&got, want.as_str().unwrap(), "{folder}: {hf_name}");
            checked += 1;
        }
        eprintln!("{folder}: {checked} dequantized weights equal torch's bit for bit");
        assert!(checked >= min, "{folder}: {checked} checked");
    }
    // gpt-oss's MXFP4 experts, repacked into GGML MXFP4: the reference's dequantization of them
    // equals transformers' (convert_moe_packed_tensors) bit for bit.
    let file = open("gpt-oss-mxfp4");
    let d = doc("gpt-oss-mxfp4");
    let digests = d["dequantized_sha256"].as_object().unwrap();
    assert_eq!(digests.len(), 6, "gate, up and down of 2 layers");
    for (hf_name, want) in digests {
        let rest = hf_name.strip_prefix("model.layers.").unwrap();
        let (l, rest) = rest.split_once('.').unwrap();
        let which = rest.strip_prefix("mlp.experts.").unwrap().trim_end_matches("_proj");
        let t = file.tensor(&format!("blk.{l}.ffn_{which}_exps.weight")).unwrap();
        assert_eq!(t.ty, references::GgmlType::MXFP4);
        let f = references::dequant::dequantize_to_vec(t.ty, file.tensor_data(t)).unwrap();
        let bytes: Vec<u8> = f.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(
            &format!("{:x}", Sha256::digest(&bytes)),
            want.as_str().unwrap(),
            "{hf_name}"
        );
    }
    // A partial block: ffn_gate of the dense layer is 160 rows (128 + 32).
    let t = open("deepseek-v3-fp8").tensor("blk.0.ffn_gate.weight").unwrap().clone();
    assert_eq!(t.ne, [64, 160]);
}

/// The folder's tokenizer.json gives HF's ids on the prompts the goldens were made from.
#[test]
fn tokenizer_json_gives_hf_ids() {
    for name in FOLDERS {
        let file = open(name);
        let tok = references::tokenizer::Tokenizer::for_model(&file).unwrap();
        for case in doc(name)["cases"].as_array().unwrap() {
            let want: Vec<u32> = case["tokens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            let got = tok.encode(case["prompt"].as_str().unwrap(), true).unwrap();
            assert_eq!(got, want, "{name}: {}", case["prompt"]);
            assert_eq!(tok.decode(&got).unwrap(), case["prompt"].as_str().unwrap(), "{name}");
        }
        // The special token written in the text is its id (as transformers splits added tokens).
        let eot = tok.token_id("<|endoftext|>").unwrap();
        let ids = tok.encode("Paris<|endoftext|>", true).unwrap();
        assert_eq!(ids.last(), Some(&eot), "{name}");
        assert!(
            !tok.encode("Paris<|endoftext|>", false).unwrap().contains(&eot),
            "{name}"
        );
    }
}

fn run(args: &[&str]) -> anyhow::Result<std::process::ExitCode> {
    let cli =
        <harness::cli::Cli as clap::Parser>::try_parse_from(std::iter::once("llmdiff").chain(args.iter().copied()))?;
    harness::commands::run(cli)
}

fn tokens_of(name: &str) -> Vec<u32> {
    doc(name)["cases"][1]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect()
}

fn csv(t: &[u32]) -> String {
    t.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(",")
}

/// `logits FOLDER` gives the reference's logits on the folder's GGUF conversion, bit for bit, and
/// `diff-layers FOLDER` (the CPU engine loading the folder at TP 2, for the families it runs)
/// agrees with the reference.
#[test]
fn commands_take_a_folder() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["llama31-bf16", "qwen3moe-bf16", "deepseek-v3-bf16"] {
        let folder = golden(&format!("hf/{name}")).display().to_string();
        let tokens = tokens_of(name);
        let out = dir.path().join(format!("{name}.f32"));
        let code = run(&[
            "logits",
            &folder,
            "--tokens",
            &csv(&tokens),
            "--dump-f32",
            out.to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(format!("{code:?}"), format!("{:?}", std::process::ExitCode::SUCCESS));
        let got = std::fs::read(&out).unwrap();
        let gguf = GgufFile::open(golden(&format!("hf/{name}.gguf"))).unwrap();
        let want: Vec<u8> = Reference::new(&gguf)
            .unwrap()
            .forward(&tokens, &mut NoTap)
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        assert!(got == want, "{name}: logits differ from the conversion's");
        for args in [
            vec!["inspect", folder.as_str()],
            vec!["inspect", folder.as_str(), "--json"],
            vec![
                "tokenize",
                folder.as_str(),
                "--prompt",
                "The capital of France is Paris.",
            ],
        ] {
            let code = run(&args).unwrap();
            assert_eq!(
                format!("{code:?}"),
                format!("{:?}", std::process::ExitCode::SUCCESS),
                "{args:?}"
            );
        }
        if name.starts_with("qwen3moe") {
            continue; // the engine does not run qwen3moe (yet): the reference does
        }
        let code = run(&["diff-layers", &folder, "--tokens", &csv(&tokens), "--tp", "2"]).unwrap();
        assert_eq!(
            format!("{code:?}"),
            format!("{:?}", std::process::ExitCode::SUCCESS),
            "{name}: diff-layers on the folder"
        );
    }
}

/// Records every reference tap.
struct All(Vec<(String, [usize; 2], Vec<f32>)>);
impl references::tap::Tap for All {
    fn wants(&self, key: &references::TapKey) -> bool {
        key.rank.is_none() && !matches!(key.site, references::Site::Weight(_))
    }
    fn record(&mut self, key: &references::TapKey, data: &[f32], shape: [usize; 2]) {
        self.0.push((key.to_string(), shape, data.to_vec()));
    }
}

/// The same model from two sources: the reference's taps on the folder, written as a dump, are
/// diffed by `diff-layers GGUF --candidate` against the reference on llama.cpp's conversion, with
/// no layout declared: every tap agrees at the default thresholds.
#[test]
fn folder_and_conversion_agree_at_every_tap() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["llama31-bf16", "deepseek-v3-bf16", "glm-dsa-bf16"] {
        let tokens = tokens_of(name);
        let mut all = All(Vec::new());
        Reference::new(&open(name)).unwrap().forward(&tokens, &mut all).unwrap();
        assert!(all.0.len() > 10, "{name}: {} taps", all.0.len());
        let mut header = serde_json::Map::new();
        header.insert(
            "__metadata__".into(),
            serde_json::json!({"llmdiff.format": "1", "tokens": serde_json::to_string(&tokens).unwrap(),
                               "model": name, "tp": "1", "mapping": "{}"}),
        );
        let mut data = Vec::new();
        for (key, shape, values) in &all.0 {
            let start = data.len();
            values.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes()));
            header.insert(
                key.clone(),
                serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        let h = serde_json::to_vec(&header).unwrap();
        let path = dir.path().join(format!("{name}.safetensors"));
        std::fs::write(&path, [&(h.len() as u64).to_le_bytes()[..], &h, &data].concat()).unwrap();
        let gguf = golden(&format!("hf/{name}.gguf")).display().to_string();
        let json = dir.path().join(format!("{name}.json"));
        let code = run(&[
            "diff-layers",
            &gguf,
            "--candidate",
            path.to_str().unwrap(),
            "--json-out",
            json.to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(
            format!("{code:?}"),
            format!("{:?}", std::process::ExitCode::SUCCESS),
            "{name}"
        );
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let n = doc["taps"].as_array().map(|t| t.len()).unwrap_or(0);
        eprintln!("{name}: {n} taps compared, the folder's against the conversion's");
        assert!(n >= all.0.len() / 2, "{name}: {n} taps compared of {}", all.0.len());
    }
}

/// A copy of a golden folder, edited, in `dir`.
fn copy_folder(name: &str, dir: &std::path::Path) -> std::path::PathBuf {
    let to = dir.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(golden(&format!("hf/{name}"))).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

fn exit2(args: &[&str]) -> String {
    let e = run(args).expect_err("bad input must be an error (exit 2)");
    let msg = format!("{e:#}");
    assert!(!msg.contains('\n'), "one line: {msg}");
    msg
}

fn edit_json(path: &std::path::Path, f: impl FnOnce(&mut serde_json::Map<String, Value>)) {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    f(v.as_object_mut().unwrap());
    std::fs::write(path, serde_json::to_string(&v).unwrap()).unwrap();
}

/// Bad folders are one-line errors naming the file and the tensor or key.
#[test]
fn bad_folders_are_one_line_errors_naming_what() {
    let dir = tempfile::tempdir().unwrap();
    let logits = |f: &std::path::Path| exit2(&["logits", f.to_str().unwrap(), "--tokens", "1,2"]);
    // No config.json.
    let f = copy_folder("qwen3-f32", &dir.path().join("a"));
    std::fs::remove_file(f.join("config.json")).unwrap();
    let e = logits(&f);
    assert!(e.contains("without config.json"), "{e}");
    // A shard the index names is missing.
    let f = copy_folder("llama31-bf16", &dir.path().join("b"));
    std::fs::remove_file(f.join("model-00002-of-00004.safetensors")).unwrap();
    let e = logits(&f);
    assert!(
        e.contains("model-00002-of-00004.safetensors") && e.contains("missing"),
        "{e}"
    );
    // A tensor whose shape disagrees with config.json.
    let f = copy_folder("qwen3-f32", &dir.path().join("c"));
    edit_json(&f.join("config.json"), |c| {
        c.insert("intermediate_size".into(), 96.into());
    });
    let e = logits(&f);
    assert!(
        e.contains("model.layers.0.mlp.") && e.contains("config.json implies"),
        "{e}"
    );
    // A key that may change the math.
    let f = copy_folder("qwen3-f32", &dir.path().join("d"));
    edit_json(&f.join("config.json"), |c| {
        c.insert("attn_logit_softcapping".into(), 30.into());
    });
    let e = logits(&f);
    assert!(e.contains("key attn_logit_softcapping"), "{e}");
    // Rope scaling the reference does not compute.
    let f = copy_folder("qwen3-f32", &dir.path().join("e"));
    edit_json(&f.join("config.json"), |c| {
        c.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
        );
    });
    let e = logits(&f);
    assert!(e.contains("\"dynamic\""), "{e}");
    // An unsupported dtype and a malformed header.
    let f = copy_folder("qwen3-f32", &dir.path().join("f"));
    let st = f.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(bytes[8..8 + n].to_vec()).unwrap();
    let i64_header = header.replacen("\"F32\"", "\"I32\"", 1);
    std::fs::write(&st, [&bytes[..8], i64_header.as_bytes(), &bytes[8 + n..]].concat()).unwrap();
    let e = logits(&f);
    assert!(
        e.contains("model.safetensors") && e.contains("dtype I32 is not supported"),
        "{e}"
    );
    std::fs::write(&st, &bytes[..8 + n / 2]).unwrap();
    let e = logits(&f);
    assert!(e.contains("model.safetensors") && e.contains("header length"), "{e}");
    // FP8 weights without their scales.
    let f = copy_folder("deepseek-v3-fp8", &dir.path().join("g"));
    edit_json(&f.join("config.json"), |c| {
        c.remove("quantization_config");
    });
    let e = logits(&f);
    assert!(e.contains("F8_E4M3") && e.contains("quantization_config"), "{e}");
    // A model type the folder reader does not take names itself.
    let f = copy_folder("qwen3-f32", &dir.path().join("h"));
    edit_json(&f.join("config.json"), |c| {
        c.insert("model_type".into(), "mamba".into());
    });
    let e = logits(&f);
    assert!(e.contains("model_type mamba"), "{e}");
}

/// `diff-layers FOLDER --candidate DUMP` with HF transformers' fp32 dump made from the same folder
/// (tests/peers/hf_folder_dump.py, the adapter's own layout declaration only): every tap agrees.
#[test]
fn hf_dump_of_the_same_folder_agrees() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["llama31-bf16", "deepseek-v3-bf16"] {
        let folder = golden(&format!("hf/{name}")).display().to_string();
        let dump = golden(&format!("hf/{name}.dump.safetensors")).display().to_string();
        let json = dir.path().join(format!("{name}.json"));
        let code = run(&[
            "diff-layers",
            &folder,
            "--candidate",
            &dump,
            "--json-out",
            json.to_str().unwrap(),
        ])
        .unwrap();
        assert_eq!(
            format!("{code:?}"),
            format!("{:?}", std::process::ExitCode::SUCCESS),
            "{name}"
        );
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let n = doc["taps"].as_array().map(|t| t.len()).unwrap_or(0);
        eprintln!("{name}: {n} taps of HF's dump agree with the reference on the folder");
        assert!(n >= 20, "{name}: {n} taps compared");
    }
}

/// Opt-in (`cargo test -p llmdiff-tests --test hf_folders -- --ignored peak_rss`): peak RSS of
/// `logits` on an HF folder of a synthetic bf16 llama (d 4096, 32/8 heads, ffn 14336, vocab 32000,
/// one safetensors shard per layer with an index) of `LLMDIFF_HF_RSS_LAYERS` layers (default 32:
/// about 14 GB, more than half this machine's RAM), written here a chunk at a time. The folder is
/// streamed a layer at a time, as a GGUF is: the peak stays about one layer (436 MB of bf16) plus
/// the f32 logits and the embeddings' rows, whatever the layer count. The figure is in
/// docs/models.md.
#[test]
#[ignore]
fn peak_rss_of_logits_on_a_large_folder() {
    use std::io::Write;
    let n_layers: usize = std::env::var("LLMDIFF_HF_RSS_LAYERS")
        .ok()
        .map(|v| v.parse().unwrap())
        .unwrap_or(32);
    let (d, nh, nkv, hd, ffn, vocab) = (4096usize, 32usize, 8usize, 128usize, 14336usize, 32000usize);
    let dir = tempfile::tempdir_in(std::env::var("LLMDIFF_HF_RSS_DIR").unwrap_or_else(|_| "/tmp".into())).unwrap();
    let folder = dir.path().join("llama-big");
    std::fs::create_dir(&folder).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd, "intermediate_size": ffn,
        "num_hidden_layers": n_layers, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
        "tie_word_embeddings": false, "hidden_act": "silu", "attention_bias": false, "mlp_bias": false,
        "dtype": "bfloat16"});
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    // Shard 0: embeddings, final norm, output; shard l + 1: layer l.
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![vec![
        ("model.embed_tokens.weight".into(), vec![vocab, d]),
        ("model.norm.weight".into(), vec![d]),
        ("lm_head.weight".into(), vec![vocab, d]),
    ]];
    for l in 0..n_layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        shards.push(vec![
            (p("input_layernorm.weight"), vec![d]),
            (p("self_attn.q_proj.weight"), vec![nh * hd, d]),
            (p("self_attn.k_proj.weight"), vec![nkv * hd, d]),
            (p("self_attn.v_proj.weight"), vec![nkv * hd, d]),
            (p("self_attn.o_proj.weight"), vec![d, nh * hd]),
            (p("post_attention_layernorm.weight"), vec![d]),
            (p("mlp.gate_proj.weight"), vec![ffn, d]),
            (p("mlp.up_proj.weight"), vec![ffn, d]),
            (p("mlp.down_proj.weight"), vec![d, ffn]),
        ]);
    }
    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut seed = 0x9E3779B97F4A7C15u64;
    let mut total = 0u64;
    for (i, tensors) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n_shards:05}.safetensors", i + 1);
        let mut header = serde_json::Map::new();
        let mut off = 0usize;
        for (name, shape) in tensors {
            let n: usize = shape.iter().product();
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [off, off + 2 * n]}),
            );
            off += 2 * n;
            weight_map.insert(name.clone(), file.clone().into());
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut w = std::io::BufWriter::new(std::fs::File::create(folder.join(&file)).unwrap());
        w.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
        w.write_all(&h).unwrap();
        for (name, shape) in tensors {
            let n: usize = shape.iter().product();
            let norm = shape.len() == 1;
            let scale = 1.0 / (*shape.last().unwrap() as f32).sqrt();
            let mut chunk = Vec::with_capacity(1 << 20);
            for j in 0..n {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let u = (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5; // uniform in [-0.5, 0.5)
                let v = if norm { 1.0 + 0.1 * u } else { u * 3.46 * scale };
                let b = v.to_bits();
                let bf = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) as u16; // round to nearest even
                chunk.extend_from_slice(&bf.to_le_bytes());
                if chunk.len() == 1 << 20 || j + 1 == n {
                    w.write_all(&chunk).unwrap();
                    chunk.clear();
                }
            }
            let _ = name;
        }
        w.flush().unwrap();
        total += (8 + h.len() + off) as u64;
    }
    std::fs::write(
        folder.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    let before = peak_rss_kib();
    let out = dir.path().join("logits.f32");
    let code = run(&[
        "logits",
        folder.to_str().unwrap(),
        "--tokens",
        "1,2,3,4",
        "--dump-f32",
        out.to_str().unwrap(),
    ])
    .unwrap();
    assert_eq!(format!("{code:?}"), format!("{:?}", std::process::ExitCode::SUCCESS));
    let peak = peak_rss_kib();
    let layer_mib = (2 * (2 * d * nh * hd + 2 * d * nkv * hd + 3 * d * ffn)) as f64 / (1 << 20) as f64;
    eprintln!(
        "HF folder of {:.2} GB ({n_layers} layers of {layer_mib:.0} MiB bf16): peak RSS {:.0} MiB (before the run {:.0} MiB)",
        total as f64 / 1e9,
        peak as f64 / 1024.0,
        before as f64 / 1024.0
    );
    // About one layer plus the output matrix's rows in flight, never the model.
    assert!((peak as f64 / 1024.0) < 4.0 * layer_mib + 1024.0, "peak RSS {peak} KiB");
}

/// Peak resident set size of this process in KiB (VmHWM).
fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}
