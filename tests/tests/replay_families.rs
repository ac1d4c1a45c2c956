//! The local rule on the qwen GQA block families (qwen2, qwen3, qwen3moe, glm4moe) and gemma2/3:
//! their ops (q/k/v biases, q/k norms, NeoX RoPE, partial rotary, routed experts with a shared
//! one; gemma's post-norms, GeGLU, sliding window and soft-capped scores; gpt-oss's biases,
//! sinks and routing) are replayed on a candidate's inputs (gemma's soft-capped logits and
//! gpt-oss's expert mix are not: end-to-end rule). The candidate is synthetic: the reference's own taps on the
//! committed tiny GGUFs, every tensor rounded to bf16 and written as a foreign dump. Healthy
//! agrees at default settings with every activation tap judged locally; one head of one layer's
//! attention output × 1.05 is localized at that tap.

use harness::compare::{ActDtype, Tolerances};
use harness::diff::{run_diff_candidate, DiffPlan};
use harness::dump::Dump;
use llmdiff_tests::fixtures::golden;
use references::forward::Reference;
use references::tap::{Site, Tap, TapKey};
use references::GgufFile;
use reports::DiffRun;
use std::path::Path;

/// The reference's activation taps, in execution order.
#[derive(Default)]
struct Collect(Vec<(TapKey, [usize; 2], Vec<f32>)>);

impl Tap for Collect {
    fn wants(&self, key: &TapKey) -> bool {
        !matches!(key.site, Site::Weight(_)) && key.rank.is_none()
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        self.0.push((*key, shape, data.to_vec()));
    }
}

fn bf16(x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    let b = x.to_bits();
    f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
}

/// A bf16 dump of the reference's taps on `tokens`, with head `head` of `layer`'s attention
/// output scaled by `scale`.
fn dump(path: &Path, file: &GgufFile, tokens: &[u32], fault: Option<(usize, usize, f32)>) {
    let reference = Reference::new(file).unwrap();
    let hd = reference.config.head_dim;
    let mut taps = Collect::default();
    reference.forward(tokens, &mut taps).unwrap();
    let mut header = serde_json::Map::new();
    let meta = serde_json::json!({
        "llmdiff.format": "1",
        "tokens": serde_json::to_string(tokens).unwrap(),
        "model": "tiny (simulated bf16 candidate)",
        "tp": "1",
        "mapping": "{}",
        "llmdiff.compute_dtype": "bf16",
    });
    header.insert("__metadata__".into(), meta);
    let mut data = Vec::new();
    for (key, shape, mut v) in taps.0 {
        if let Some((l, h, s)) = fault.filter(|f| key == TapKey::layer(f.0, Site::AttnOut)) {
            let _ = l;
            for row in v.chunks_mut(shape[1]) {
                row[h * hd..(h + 1) * hd].iter_mut().for_each(|x| *x *= s);
            }
        }
        let start = data.len();
        for x in v {
            data.extend_from_slice(&((bf16(x).to_bits() >> 16) as u16).to_le_bytes());
        }
        header.insert(
            key.to_string(),
            serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

fn diff(dir: &Path, model: &str, fault: Option<(usize, usize, f32)>) -> DiffRun {
    diff_n(dir, model, 12, fault)
}

fn diff_n(dir: &Path, model: &str, n: u32, fault: Option<(usize, usize, f32)>) -> DiffRun {
    let file = GgufFile::open(golden(model)).unwrap();
    let vocab = Reference::new(&file).unwrap().config.vocab as u32;
    let tokens: Vec<u32> = (0..n).map(|i| (3 + 7 * i) % vocab).collect();
    let path = dir.join(format!("{model}-{n}-{}.safetensors", fault.is_some()));
    dump(&path, &file, &tokens, fault);
    let dump = Dump::open(&[path]).unwrap();
    let plan = DiffPlan {
        file: &file,
        model_name: model.into(),
        tokens: dump.tokens.clone(),
        engine: engine::EngineOptions::default(),
        tolerances: Tolerances::default(),
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro: String::new(),
    };
    run_diff_candidate(&plan, &dump).unwrap()
}

#[test]
fn gqa_families_are_replayed_and_a_scaled_head_is_localized() {
    let dir = tempfile::tempdir().unwrap();
    for model in [
        "qwen2-tiny.f32.gguf",
        "qwen3-tiny.f32.gguf",
        "qwen3moe-tiny.f32.gguf",
        "glm4moe-tiny.f32.gguf",
        "gemma2-tiny.f32.gguf",
        "gemma3-tiny.f32.gguf",
        "gpt-oss-tiny.f32.gguf",
    ] {
        let healthy = diff(dir.path(), model, None);
        assert_eq!(
            healthy.verdict, "agree",
            "{model}: {:?} {:?}",
            healthy.first_divergence, healthy.diagnosis
        );
        // Every activation tap has a local error: the family's ops are replayed.
        let without: Vec<&str> = healthy
            .taps
            .iter()
            .filter(|t| t.local.is_none())
            .filter(|t| !(model.starts_with("gpt-oss") && t.site == "ffn_out"))
            .map(|t| t.tap.as_str())
            .collect();
        assert!(without.is_empty(), "{model}: no local error at {without:?}");
        let run = diff(dir.path(), model, Some((1, 1, 1.05)));
        let first = run.first_divergence.as_ref().map(|f| f.tap.as_str());
        assert_eq!(first, Some("blk.1.attn_out"), "{model}: {:?}", run.diagnosis);
        let p = run.head_profile.as_ref().expect("a head profile");
        let over: Vec<usize> = p.heads.iter().filter(|h| h.rel_l2 > h.bound).map(|h| h.head).collect();
        assert_eq!(over, vec![1], "{model}: {p:?}");
    }
}

/// On 50 tokens the local error is estimated on sampled rows (NeoX RoPE at the rows' positions,
/// attention over every earlier key, the routed experts per row): healthy agrees with most taps
/// sampled, and the scaled head is still localized, on the full replay.
#[test]
fn sampled_rows_in_the_qwen_block_families() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["qwen3moe-tiny.f32.gguf", "glm4moe-tiny.f32.gguf"] {
        let healthy = diff_n(dir.path(), model, 50, None);
        assert_eq!(healthy.verdict, "agree", "{model}: {:?}", healthy.first_divergence);
        let sampled = healthy
            .taps
            .iter()
            .filter(|t| t.local.as_ref().is_some_and(|l| l.rows.is_some()))
            .count();
        let attn = healthy
            .taps
            .iter()
            .filter(|t| t.site == "attn_out" && t.local.as_ref().is_some_and(|l| l.rows.is_some()))
            .count();
        assert!(
            sampled * 10 >= healthy.taps.len() * 8,
            "{model}: {sampled} of {}",
            healthy.taps.len()
        );
        assert!(attn > 0, "{model}: attention sampled");
        let run = diff_n(dir.path(), model, 50, Some((1, 1, 1.05)));
        assert_eq!(
            run.first_divergence.as_ref().map(|f| f.tap.as_str()),
            Some("blk.1.attn_out"),
            "{model}"
        );
        let at = run.taps.iter().find(|t| t.tap == "blk.1.attn_out").unwrap();
        assert!(at.local.as_ref().unwrap().rows.is_none(), "decided on every row");
    }
}
