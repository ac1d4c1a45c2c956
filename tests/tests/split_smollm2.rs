//! A split SmolLM2 (gguf-split's layout, written by `references::writer::write_split`, the code
//! behind `llmdiff synth --split-max-tensors`) gives bit-identical logits and the same token
//! ids as the unsplit file: the first shard opens all of them.

use llmdiff_tests::fixtures::smollm2;
use references::forward::Reference;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::writer::{write_split, SplitLimit};
use references::GgufFile;

#[test]
fn split_smollm2_logits_are_bit_identical() {
    let whole = GgufFile::open(smollm2()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let paths = write_split(&whole, SplitLimit::Tensors(100), &dir.path().join("smollm2")).unwrap();
    assert_eq!(paths.len(), whole.tensors().len().div_ceil(100));
    let split = GgufFile::open(&paths[0]).unwrap();
    assert_eq!(split.n_shards(), paths.len());
    let prompt = "The capital of France is";
    let tokens = Tokenizer::from_gguf(&whole.header)
        .unwrap()
        .encode(prompt, true)
        .unwrap();
    assert_eq!(
        Tokenizer::from_gguf(&split.header)
            .unwrap()
            .encode(prompt, true)
            .unwrap(),
        tokens
    );
    let a = Reference::new(&whole).unwrap().forward(&tokens, &mut NoTap).unwrap();
    let b = Reference::new(&split).unwrap().forward(&tokens, &mut NoTap).unwrap();
    assert_eq!(a.len(), b.len());
    assert!(
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
        "split logits differ"
    );
}
