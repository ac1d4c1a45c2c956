//! Dequantizes every tensor of the real SmolLM2-135M-Instruct Q4_1 GGUF with the reference
//! dequantizer (and with the engine's fast path) and checks the sha256 of the float32 little-endian
//! values against `golden/smollm2-dequant-sha256.json`, produced by gguf-py
//! (`tests/peers/gen_smollm2_digest.py`). The model is located by `fixtures::smollm2()`:
//! `$LLMDIFF_SMOLLM2`, else `<workspace>/.cache/SmolLM2-135M-Instruct.Q4_1.gguf`, else fetched.

use std::collections::BTreeMap;

use llmdiff_tests::fixtures;
use references::{GgmlType, GgufFile};
use sha2::{Digest, Sha256};

fn golden_digests() -> BTreeMap<String, (String, u64, String)> {
    let path = fixtures::golden("smollm2-dequant-sha256.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    let json: serde_json::Value = serde_json::from_str(&text).expect("golden digest is JSON");
    json["tensors"]
        .as_object()
        .expect("tensors object")
        .iter()
        .map(|(name, v)| {
            (
                name.clone(),
                (
                    v["type"].as_str().expect("type").to_string(),
                    v["n_elems"].as_u64().expect("n_elems"),
                    v["sha256"].as_str().expect("sha256").to_string(),
                ),
            )
        })
        .collect()
}

fn sha256_f32_le(values: &[f32]) -> String {
    let mut h = Sha256::new();
    for v in values {
        h.update(v.to_le_bytes());
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// Runs `dequant` over every tensor and compares with the gguf-py digests.
fn check_all(label: &str, dequant: impl Fn(GgmlType, &[u8], &mut [f32])) {
    let model = GgufFile::open(fixtures::smollm2()).expect("open SmolLM2");
    let golden = golden_digests();
    assert_eq!(model.tensors().len(), golden.len(), "tensor count");
    let mut bad = Vec::new();
    let mut types = BTreeMap::new();
    for t in model.tensors() {
        let (ty, n, want) = golden
            .get(&t.name)
            .unwrap_or_else(|| panic!("{} missing from golden", t.name));
        assert_eq!(ty, t.ty.name(), "{}: type", t.name);
        assert_eq!(*n, t.n_elems(), "{}: n_elems", t.name);
        let mut out = vec![0.0f32; t.n_elems() as usize];
        dequant(t.ty, model.tensor_data(t), &mut out);
        if sha256_f32_le(&out) != *want {
            bad.push(t.name.clone());
        }
        *types.entry(t.ty.name()).or_insert(0usize) += 1;
    }
    assert!(
        bad.is_empty(),
        "{label}: {} tensors differ from gguf-py: {bad:?}",
        bad.len()
    );
    // The file's mix: Q4_1 weights, F32 norms and a Q8_0 embedding.
    assert!(types.contains_key("Q4_1") && types.contains_key("F32"), "{types:?}");
}

#[test]
fn reference_dequant_matches_gguf_py_on_every_smollm2_tensor() {
    check_all("reference", |ty, src, dst| {
        references::dequant::dequantize(ty, src, dst).expect("reference dequantize")
    });
}

#[test]
fn engine_dequant_matches_gguf_py_on_every_smollm2_tensor() {
    check_all("engine", |ty, src, dst| {
        engine::dequant::dequantize_par(ty, src, dst).expect("engine dequantize")
    });
}
