//! Tokenizer conformance on the real SmolLM2 GGUF: for every prompt in
//! golden/tokenizer-smollm2.json (written by tests/peers/tokenize_llamacpp.py from llama.cpp), our
//! ids equal llama.cpp's exactly, and decoding them gives the prompt back.

use llmdiff_tests::fixtures;
use references::gguf::GgufFile;
use references::tokenizer::{TokenType, Tokenizer};

fn smollm2() -> Tokenizer {
    let f = GgufFile::open(fixtures::smollm2()).expect("open SmolLM2 GGUF");
    Tokenizer::from_gguf(&f.header).expect("tokenizer from SmolLM2 metadata")
}

/// One golden prompt: llama.cpp's ids with special parsing on and off.
struct Case {
    prompt: String,
    special: Vec<u32>,
    plain: Vec<u32>,
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("token array")
        .iter()
        .map(|t| u32::try_from(t.as_u64().expect("token id")).expect("u32 id"))
        .collect()
}

fn golden_cases() -> (String, Vec<Case>) {
    let path = fixtures::golden("tokenizer-smollm2.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let v: serde_json::Value = serde_json::from_str(&text).expect("golden JSON");
    let peer = v["peer"].as_str().expect("peer").to_string();
    let cases = v["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            prompt: c["prompt"].as_str().expect("prompt").to_string(),
            special: ids(&c["tokens"]),
            plain: ids(&c["tokens_nospecial"]),
        })
        .collect();
    (peer, cases)
}

#[test]
fn smollm2_metadata() {
    let tk = smollm2();
    assert_eq!(tk.vocab_size(), 49152);
    assert_eq!(tk.model_kind(), "gpt2");
    assert_eq!(tk.pre(), Some("smollm"));
    let bos = tk.bos_id().expect("bos");
    let eos = tk.eos_id().expect("eos");
    assert_eq!(tk.token_type(bos), Some(TokenType::Control));
    assert_eq!(tk.token_id("<|im_start|>"), Some(1));
    assert_eq!(tk.token_id("<|im_end|>"), Some(2));
    assert!(eos < 49152);
    assert!(tk.token_str(49152).is_err());
    assert!(tk.decode(&[49152]).is_err());
}

#[test]
fn smollm2_matches_llama_cpp() {
    let tk = smollm2();
    let (peer, cases) = golden_cases();
    assert!(cases.len() >= 50, "golden file has only {} cases", cases.len());
    let mut n_same = 0;
    let mut diffs = Vec::new();
    for c in &cases {
        for (parse_special, want) in [(true, &c.special), (false, &c.plain)] {
            let got = tk.encode(&c.prompt, parse_special).expect("encode");
            if &got == want {
                n_same += 1;
            } else {
                diffs.push(format!(
                    "{:?} (special={parse_special})\n  ours:      {got:?}\n  llama.cpp: {want:?}",
                    c.prompt
                ));
            }
        }
    }
    let n = 2 * cases.len();
    eprintln!(
        "tokenizer conformance vs {peer}: {n_same}/{n} identical ({} prompts, special on and off)",
        cases.len()
    );
    assert!(
        diffs.is_empty(),
        "{} of {n} encodings differ:\n{}",
        diffs.len(),
        diffs.join("\n")
    );
}

#[test]
fn smollm2_decode_round_trips() {
    let tk = smollm2();
    let (_, cases) = golden_cases();
    for c in &cases {
        assert_eq!(
            tk.decode(&c.special).expect("decode"),
            c.prompt,
            "decode of llama.cpp's ids"
        );
        assert_eq!(
            tk.decode(&c.plain).expect("decode"),
            c.prompt,
            "decode of llama.cpp's ids"
        );
        let ours = tk.encode(&c.prompt, true).expect("encode");
        assert_eq!(tk.decode(&ours).expect("decode"), c.prompt);
    }
}

#[test]
fn smollm2_special_parsing_switch() {
    let tk = smollm2();
    let text = "<|im_start|>user\nHi<|im_end|>\n";
    let special = tk.encode(text, true).unwrap();
    assert_eq!(special.first(), Some(&1));
    assert!(special.contains(&2));
    // Without special parsing the markers are spelled out in ordinary tokens.
    let plain = tk.encode(text, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2), "{plain:?}");
    assert!(plain.len() > special.len());
    assert_eq!(tk.decode(&plain).unwrap(), text);
    assert_eq!(tk.encode("", true).unwrap(), Vec::<u32>::new());
}
