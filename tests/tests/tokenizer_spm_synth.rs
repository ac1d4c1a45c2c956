//! SentencePiece ("llama" tokenizer model) conformance on a synthetic vocab-only GGUF: for every
//! prompt in golden/tokenizer-spm-synth.json (written with the GGUF by
//! tests/peers/tokenize_spm_llamacpp.py), our ids equal llama.cpp's, with special parsing on and off.

use llmdiff_tests::fixtures;
use references::gguf::GgufFile;
use references::tokenizer::Tokenizer;

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("token array")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token id")).expect("u32 id"))
        .collect()
}

#[test]
fn spm_synth_matches_llama_cpp() {
    let f = GgufFile::open(fixtures::golden("tokenizer-spm-synth.gguf")).expect("open synthetic SPM GGUF");
    let tk = Tokenizer::from_gguf(&f.header).expect("tokenizer");
    assert_eq!(tk.model_kind(), "llama");
    assert!(tk.add_bos());
    assert_eq!(tk.bos_id(), Some(1));

    let path = fixtures::golden("tokenizer-spm-synth.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden JSON");
    let cases = v["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10);
    let mut diffs = Vec::new();
    for c in cases {
        let prompt = c["prompt"].as_str().expect("prompt");
        for (parse_special, key) in [(true, "tokens"), (false, "tokens_nospecial")] {
            let want = ids(&c[key]);
            let got = tk.encode(prompt, parse_special).expect("encode");
            if got != want {
                diffs.push(format!(
                    "{prompt:?} (special={parse_special})\n  ours:      {got:?}\n  llama.cpp: {want:?}"
                ));
            }
        }
        if !prompt.contains("<s>") && !prompt.contains("</s>") {
            assert_eq!(tk.decode(&ids(&c["tokens"])).expect("decode"), prompt);
        }
    }
    eprintln!(
        "SPM conformance vs {}: {}/{} identical",
        v["peer"],
        2 * cases.len() - diffs.len(),
        2 * cases.len()
    );
    assert!(
        diffs.is_empty(),
        "{} encodings differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}
