//! The engine against the reference on the real SmolLM2-135M-Instruct Q4_1 (the file the `tests`
//! crate fetches into `.cache/`, or `LLMDIFF_SMOLLM2`): logits and every unranked activation tap
//! at TP 1 and 3, both weight storages. Skipped (with a note) when the file is not present.

mod common;

use common::*;
use engine::{Engine, EngineOptions, WeightStorage};
use references::forward::Reference;
use references::tap::{CollectTap, Site, TapKey};
use references::GgufFile;
use std::path::PathBuf;

fn model_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("LLMDIFF_SMOLLM2") {
        return Some(PathBuf::from(p));
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.cache/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

fn activations(k: &TapKey) -> bool {
    k.rank.is_none() && !matches!(k.site, Site::Weight(_))
}

#[test]
fn real_smollm2_agrees_with_the_reference() {
    let Some(path) = model_path() else {
        eprintln!("SmolLM2 Q4_1 not in .cache/ (run the llmdiff-tests suite once, or set LLMDIFF_SMOLLM2): skipped");
        return;
    };
    let file = GgufFile::open(&path).expect("open SmolLM2");
    // "<|im_start|>user\nWhat is the capital of France?" as SmolLM2 tokenizes it.
    let toks: Vec<u32> = vec![1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47];
    let mut rt = CollectTap::new(activations);
    let ref_logits = Reference::new(&file).unwrap().forward(&toks, &mut rt).unwrap();
    let v = 49152;
    for storage in [WeightStorage::F32, WeightStorage::Quantized] {
        for tp in [1, 3] {
            let opts = EngineOptions {
                tp,
                storage,
                ..Default::default()
            };
            let mut e = Engine::load(&file, opts).expect("load");
            let mut et = CollectTap::new(activations);
            let logits = e.prefill(&toks, &mut et).unwrap();
            assert_eq!(
                argmax_rows(&logits, v),
                argmax_rows(&ref_logits, v),
                "tp {tp} {storage:?}"
            );
            assert!(rel_l2(&logits, &ref_logits) < 1e-4);
            let mut worst = (0.0, String::new());
            for r in &et.recorded {
                let want = rt.get(&r.key).unwrap_or_else(|| panic!("reference has no {}", r.key));
                let err = rel_l2(&r.data, &want.data);
                if err > worst.0 {
                    worst = (err, r.key.to_string());
                }
            }
            eprintln!("tp {tp} {storage:?}: worst tap {} rel_l2 {:.2e}", worst.1, worst.0);
            assert!(
                worst.0 < 1e-4,
                "tp {tp} {storage:?}: {} rel_l2 {:.2e}",
                worst.1,
                worst.0
            );
        }
    }
}
