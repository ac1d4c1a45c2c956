//! The real SmolLM2-135M-Instruct Q4_1 file: its directory and config, and a byte-identical
//! read-write cycle through llmdiff's GGUF writer.

use llmdiff_tests::fixtures::smollm2;
use references::config::Arch;
use references::{GgmlType, GgufFile, ModelConfig};

#[test]
fn smollm2_reads_with_its_config() {
    let f = GgufFile::open(smollm2()).unwrap();
    assert_eq!(f.tensors().len(), 272);
    let c = ModelConfig::from_header(&f.header).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!(
        (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.vocab),
        (30, 576, 9, 3, 49152)
    );
    assert!(c.tied_embeddings);
    assert_eq!(f.tensor("token_embd.weight").unwrap().ty, GgmlType::Q8_0);
    assert_eq!(f.tensor("blk.0.attn_q.weight").unwrap().ty, GgmlType::Q4_1);
    assert_eq!(f.tensor("blk.0.attn_norm.weight").unwrap().ty, GgmlType::F32);
}

#[test]
fn smollm2_rewrites_byte_identically() {
    let f = GgufFile::open(smollm2()).unwrap();
    let out = references::writer::rewrite(&f, Vec::new()).unwrap();
    assert_eq!(out.len(), f.bytes().len());
    assert!(out == f.bytes(), "rewrite differs from the original bytes");
}
