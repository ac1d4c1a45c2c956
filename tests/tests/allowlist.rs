//! Nothing silently ignored: every tensor and every `{arch}.*` metadata key of every supported
//! fixture (the synth presets, the real SmolLM2, the DeepSeek-V3, Llama 3.1, qwen2, qwen3,
//! qwen3moe, glm4moe, gemma2, gemma3 and gpt-oss conversions by llama.cpp's converter) is either used or knowingly skipped; an unknown one is refused, naming
//! it, unless `--allow-unknown` names it.

use llmdiff_tests::fixtures::{golden, smollm2};
use references::allowlist::{audit, Role};
use references::gguf::GgufHeader;
use references::synth::{metadata, preset, PRESETS};
use references::writer::{GgufWriter, TensorSpec};
use references::{GgufFile, MetaValue, ModelConfig};
use serde_json::Value;

/// The unknown entries of a header (keys only under `{arch}.`), as "key NAME" / "tensor NAME".
fn unknowns(h: &GgufHeader) -> Vec<String> {
    let a = audit(h).expect("a supported architecture");
    let prefix = format!("{}.", a.arch.name());
    let mut out: Vec<String> = a
        .keys
        .iter()
        .filter(|(k, r)| matches!(r, Role::Unknown(_)) && k.starts_with(&prefix))
        .map(|(k, _)| format!("key {k}"))
        .collect();
    out.extend(
        a.tensors
            .iter()
            .filter(|(_, r)| matches!(r, Role::Unknown(_)))
            .map(|(t, _)| format!("tensor {t}")),
    );
    out
}

fn assert_all_listed(file: &GgufFile, what: &str) {
    let u = unknowns(&file.header);
    assert!(u.is_empty(), "{what}: neither used nor listed: {u:?}");
    let a = audit(&file.header).unwrap();
    assert!(
        a.tensors.iter().any(|(_, r)| *r == Role::Used),
        "{what}: the audit saw no used tensor"
    );
    ModelConfig::from_header(&file.header).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn synth_presets_are_fully_listed() {
    let dir = tempfile::tempdir().unwrap();
    for (name, _) in PRESETS {
        let mut spec = preset(name).unwrap();
        // The tensor and key sets do not depend on depth or width; keep the files small
        // (glm5-1layer, at GLM-5's width with 256 experts, would be 6 GB).
        spec.config.n_layers = spec.config.n_layers.min(2);
        spec.config.d_model = spec.config.d_model.min(1024);
        spec.config.vocab = spec.config.vocab.min(4096);
        if let Some(m) = spec.config.moe.as_mut() {
            m.n_experts = m.n_experts.min(8);
            m.n_used = m.n_used.min(2);
        }
        let path = dir.path().join(format!("{name}.gguf"));
        let f = std::fs::File::create(&path).unwrap();
        references::synth::write_model(&spec, 0, std::io::BufWriter::new(f), |_, _| {}).unwrap();
        assert_all_listed(&GgufFile::open(&path).unwrap(), name);
        assert!(!metadata(&spec).is_empty());
    }
}

#[test]
fn smollm2_is_fully_listed() {
    assert_all_listed(&GgufFile::open(smollm2()).unwrap(), "SmolLM2");
}

#[test]
fn converted_fixtures_are_fully_listed() {
    for f in [
        "deepseek-v3-tiny.f32.gguf",
        "llama31-tiny.f32.gguf",
        "qwen2-tiny.f32.gguf",
        "qwen3-tiny.f32.gguf",
        "qwen3moe-tiny.f32.gguf",
        "glm4moe-tiny.f32.gguf",
        "gemma2-tiny.f32.gguf",
        "gemma3-tiny.f32.gguf",
        "gpt-oss-tiny.f32.gguf",
        "gpt-oss-yarn-tiny.f32.gguf",
        "deepseek-v3-yarn-tiny.f32.gguf",
    ] {
        assert_all_listed(&GgufFile::open(golden(f)).unwrap(), f);
    }
}

/// A header with one extra `{arch}.*` key (or a renamed tensor) is refused naming it, and
/// accepted once allowed.
#[test]
fn an_unknown_key_or_tensor_is_refused_by_name() {
    let file = GgufFile::open(golden("llama31-tiny.f32.gguf")).unwrap();
    let mut h = file.header.clone();
    h.metadata
        .push(("llama.attention.sliding_window".into(), MetaValue::U32(4096)));
    let e = ModelConfig::from_header(&h).unwrap_err().to_string();
    assert!(
        e.contains("\"llama.attention.sliding_window\"") && e.contains("--allow-unknown"),
        "{e}"
    );
    h.allow_unknown = vec!["llama.attention.sliding_window".into()];
    ModelConfig::from_header(&h).unwrap();

    let mut h = file.header.clone();
    h.tensors[3].name = "blk.0.attn_q.bias".into();
    let e = ModelConfig::from_header(&h).unwrap_err().to_string();
    assert!(e.contains("tensor \"blk.0.attn_q.bias\""), "{e}");

    // A key outside {arch}.* is shown as unknown but not refused.
    let mut h = file.header.clone();
    h.metadata.push(("vendor.custom".into(), MetaValue::U32(1)));
    assert_eq!(audit(&h).unwrap().keys.last().unwrap().1, Role::Unknown(""));
    ModelConfig::from_header(&h).unwrap();
}

/// An unsupported architecture is one sentence, said once, naming what runs.
#[test]
fn unsupported_architecture_is_said_once() {
    let file = GgufFile::open(golden("llama31-tiny.f32.gguf")).unwrap();
    let mut h = file.header.clone();
    h.metadata[0] = ("general.architecture".into(), MetaValue::String("falcon".into()));
    assert_eq!(h.metadata[0].0, "general.architecture");
    let e = references::forward::ForwardError::from(ModelConfig::from_header(&h).unwrap_err());
    let chain = format!("{:#}", anyhow::Error::from(e));
    assert_eq!(chain.matches("unsupported architecture").count(), 1, "{chain}");
    assert!(chain.contains("llama") && chain.contains("deepseek2"), "{chain}");
}

/// deepseek2's MTP/nextn block (appended after the model's layers) is skipped, not run.
#[test]
fn nextn_blocks_are_skipped() {
    let file = GgufFile::open(golden("deepseek-v3-tiny.f32.gguf")).unwrap();
    let mut h = file.header.clone();
    let blocks = h.get("deepseek2.block_count").unwrap().as_u64().unwrap();
    let i = h
        .metadata
        .iter()
        .position(|(k, _)| k == "deepseek2.block_count")
        .unwrap();
    h.metadata[i].1 = MetaValue::U32(blocks as u32 + 1);
    h.metadata
        .push(("deepseek2.nextn_predict_layers".into(), MetaValue::U32(1)));
    let mut t = h.tensor("blk.0.attn_norm.weight").unwrap().clone();
    t.name = format!("blk.{blocks}.nextn.eh_proj.weight");
    h.tensors.push(t);
    let c = ModelConfig::from_header(&h).unwrap();
    assert_eq!(c.n_layers as u64, blocks);
    let a = audit(&h).unwrap();
    assert!(matches!(a.tensors.last().unwrap().1, Role::Skipped(_)));
}

/// deepseek2 YaRN (real DeepSeek-V3 files: factor 40) is read whole (frequencies and softmax
/// scale; `golden/deepseek-v3-yarn-tiny` pins it against HF); a scaling key outside YaRN's is
/// refused by name, and an extrapolation factor other than HF's 1 is an error naming the key.
#[test]
fn deepseek2_yarn_is_read_and_other_scaling_keys_are_refused() {
    let file = GgufFile::open(golden("deepseek-v3-tiny.f32.gguf")).unwrap();
    let mut h = file.header.clone();
    h.metadata.extend([
        (
            "deepseek2.rope.scaling.type".to_string(),
            MetaValue::String("yarn".into()),
        ),
        ("deepseek2.rope.scaling.factor".to_string(), MetaValue::F32(40.0)),
        (
            "deepseek2.rope.scaling.original_context_length".to_string(),
            MetaValue::U32(4096),
        ),
        (
            "deepseek2.rope.scaling.yarn_log_multiplier".to_string(),
            MetaValue::F32(0.1),
        ),
    ]);
    let y = ModelConfig::from_header(&h).unwrap().yarn.unwrap();
    assert_eq!(
        (y.factor, y.original_context, y.beta_fast, y.beta_slow, y.truncate),
        (40.0, 4096, 32.0, 1.0, true)
    );
    let mut ext = h.clone();
    ext.metadata
        .push(("deepseek2.rope.scaling.yarn_ext_factor".into(), MetaValue::F32(0.5)));
    let e = ModelConfig::from_header(&ext).unwrap_err().to_string();
    assert!(e.contains("yarn_ext_factor"), "{e}");
    h.metadata
        .push(("deepseek2.rope.scaling.long_factor".into(), MetaValue::F32(2.0)));
    let e = ModelConfig::from_header(&h).unwrap_err().to_string();
    assert!(e.contains("\"deepseek2.rope.scaling.long_factor\""), "{e}");
}

/// `--allow-unknown KEY` on `diff-layers` is recorded in the run document (`allow_unknown`) and in
/// its repro command; a run without it has no such field.
#[test]
fn allow_unknown_is_recorded_in_the_diff_layers_run_document() {
    let file = GgufFile::open(golden("llama31-tiny.f32.gguf")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = "llama.attention.sliding_window";
    let model = dir.path().join("unknown-key.gguf");
    let mut metadata = file.metadata().to_vec();
    metadata.push((key.into(), MetaValue::U32(4096)));
    let specs = file
        .tensors()
        .iter()
        .map(|t| TensorSpec::new(&t.name, t.ty, &t.ne))
        .collect();
    let out = std::fs::File::create(&model).unwrap();
    let mut w = GgufWriter::new(std::io::BufWriter::new(out), &metadata, specs).unwrap();
    for t in file.tensors() {
        w.write_tensor(file.tensor_data(t)).unwrap();
    }
    w.finish().unwrap();

    let run = |model: &std::path::Path, extra: &[&str]| -> Value {
        let doc = dir.path().join("run.json");
        let _ = std::fs::remove_file(&doc);
        let m = model.to_str().unwrap();
        let doc_s = doc.to_str().unwrap();
        let mut argv = vec!["llmdiff", "diff-layers", m, "--tokens", "1,2,3,4", "--json-out", doc_s];
        argv.extend_from_slice(extra);
        let cli = <harness::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
        let code = harness::commands::run(cli).unwrap();
        assert_eq!(code, std::process::ExitCode::SUCCESS, "{m} {extra:?}");
        serde_json::from_str(&std::fs::read_to_string(&doc).unwrap()).unwrap()
    };
    // Refused without the flag (the reader's check), accepted and recorded with it.
    let mut h = GgufFile::open(&model).unwrap().header;
    assert!(ModelConfig::from_header(&h).is_err());
    h.allow_unknown = vec![key.into()];
    ModelConfig::from_header(&h).unwrap();
    let doc = run(&model, &["--allow-unknown", key]);
    assert_eq!(
        doc["allow_unknown"],
        serde_json::json!([key]),
        "{}",
        doc["allow_unknown"]
    );
    let repro = doc["repro"].as_str().unwrap();
    assert!(repro.contains(&format!("--allow-unknown {key}")), "{repro}");
    // The document of a run that needed no flag has no allow_unknown field: the library path.
    let plain = GgufFile::open(golden("llama31-tiny.f32.gguf")).unwrap();
    let r = harness::diff::run_diff(&llmdiff_tests::models::plan(&plain, vec![1, 2, 3], 1, Vec::new(), 0)).unwrap();
    let v = serde_json::to_value(&r).unwrap();
    assert!(v.get("allow_unknown").is_none(), "{v}");
}
