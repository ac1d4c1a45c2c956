//! `diff-layers --candidate` on HF transformers bf16 and fp16 dumps of the real SmolLM2
//! (golden/candidate-smollm2-bf16/ and -f16/, from tests/peers/hf_dump_smollm2_lowp.py: the fp32
//! GGUF load cast with `model.to`, the 16-token chat prompt, embed + layers 0–1, faults planted in
//! layer 1 or in every layer; `manifest.json` beside the dumps says what each one holds).
//!
//! Two kinds of test:
//! - The data (run now): the files parse through `harness::dump::Dump`, every tensor is stored in
//!   the compute dtype and `llmdiff.compute_dtype` names it, the decoded values are representable
//!   in that dtype, the embedding is the fp32 dump's rounded to it, and each fault dump differs
//!   from the healthy one exactly where and how the fault was planted (bit-identical before it).
//! - The verdicts at default settings: healthy agrees, each fault is localized at its tap with
//!   its class named, and a head scaled by 1.02 is found in bf16 without a false positive on the
//!   healthy dump. The dtype comes from the dump's `llmdiff.compute_dtype` metadata key and each
//!   tensor's safetensors dtype (`harness/src/dump.rs`).

use llmdiff_tests::fixtures::{golden, smollm2};
use references::gguf::GgufFile;
use references::tap::TapKey;
use references::tokenizer::Tokenizer;
use serde_json::Value;
use std::path::PathBuf;

/// The chat prompt the dumps were run on, and its ids.
const CHAT: &str = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";
const TOKENS: [u32; 16] = [
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198,
];
const HEAD_DIM: usize = 64;
/// The layer the single-layer faults are planted in, and the head that is scaled.
const FAULT_LAYER: u32 = 1;
const HEAD: usize = 4;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    Bf16,
    F16,
}

impl Dt {
    fn dir(self) -> &'static str {
        match self {
            Dt::Bf16 => "candidate-smollm2-bf16",
            Dt::F16 => "candidate-smollm2-f16",
        }
    }
    fn name(self) -> &'static str {
        match self {
            Dt::Bf16 => "bf16",
            Dt::F16 => "f16",
        }
    }
    fn header_dtype(self) -> &'static str {
        match self {
            Dt::Bf16 => "BF16",
            Dt::F16 => "F16",
        }
    }
    /// Unit roundoff.
    fn u(self) -> f32 {
        match self {
            Dt::Bf16 => 2f32.powi(-8),
            Dt::F16 => 2f32.powi(-11),
        }
    }
    fn representable(self, x: f32) -> bool {
        match self {
            Dt::Bf16 => x.to_bits() & 0xffff == 0,
            Dt::F16 => f16_representable(x),
        }
    }
    /// The faults committed for this dtype (bf16 also holds a head scaled by 1.01).
    fn faults(self) -> Vec<&'static str> {
        let mut v = vec![
            "healthy",
            "attn-zero",
            "head-swap",
            "head-scale-1.05",
            "head-scale-1.02",
            "rope-theta-div10",
            "rms-eps-1e-2",
        ];
        if self == Dt::Bf16 {
            v.push("head-scale-1.01");
        }
        v
    }
}

const BOTH: [Dt; 2] = [Dt::Bf16, Dt::F16];

fn f16_representable(x: f32) -> bool {
    let a = x.abs();
    if a == 0.0 || !a.is_finite() {
        return a == 0.0;
    }
    if a > 65504.0 {
        return false;
    }
    if a < 2f32.powi(-14) {
        // Subnormal f16: a multiple of 2^-24.
        let m = a * 2f32.powi(24);
        return m == m.trunc();
    }
    x.to_bits() & 0x1fff == 0
}

fn path(dt: Dt, name: &str) -> PathBuf {
    golden(dt.dir()).join(format!("{name}.safetensors"))
}

/// The safetensors header of a file (`__metadata__` and the tensor entries).
fn header(p: &PathBuf) -> Value {
    let bytes = std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

struct Opened {
    dump: harness::dump::Dump,
    config: references::config::ModelConfig,
}

fn open(dt: Dt, name: &str) -> Opened {
    let file = GgufFile::open(smollm2()).unwrap();
    let config = references::config::ModelConfig::from_header(&file.header).unwrap();
    let dump = harness::dump::Dump::open(&[path(dt, name)]).unwrap();
    dump.check_model(&config).unwrap();
    Opened { dump, config }
}

impl Opened {
    fn get(&self, key: &str) -> Vec<f32> {
        let k: TapKey = key.parse().unwrap();
        self.dump.tensor(&k, &self.config).unwrap().data
    }
    fn keys(&self) -> Vec<TapKey> {
        self.dump.keys().copied().collect()
    }
}

fn key(s: &str) -> TapKey {
    s.parse().unwrap()
}

#[test]
fn chat_prompt_ids_are_the_dumps_tokens() {
    let file = GgufFile::open(smollm2()).unwrap();
    let tk = Tokenizer::from_gguf(&file.header).unwrap();
    assert_eq!(tk.encode(CHAT, true).unwrap(), TOKENS);
}

#[test]
fn dumps_parse_with_their_dtype_recorded() {
    for dt in BOTH {
        let manifest: Value =
            serde_json::from_str(&std::fs::read_to_string(golden(dt.dir()).join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest["dtype"], dt.name());
        let listed: Vec<&str> = manifest["faults"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = dt.faults();
        want.sort();
        let mut got = listed.clone();
        got.sort();
        assert_eq!(got, want, "{dt:?}: manifest.json lists other dumps");
        for name in dt.faults() {
            let h = header(&path(dt, name));
            let meta = &h["__metadata__"];
            assert_eq!(meta["llmdiff.format"], "1", "{dt:?} {name}");
            assert_eq!(meta["llmdiff.compute_dtype"], dt.name(), "{dt:?} {name}");
            let mut n = 0;
            for (k, v) in h.as_object().unwrap() {
                if k == "__metadata__" {
                    continue;
                }
                assert_eq!(v["dtype"], dt.header_dtype(), "{dt:?} {name} {k}");
                n += 1;
            }
            // embed + 2 layers × 12 sites (q/k from the rotary wrapper).
            assert_eq!(n, 25, "{dt:?} {name}");
            let o = open(dt, name);
            assert_eq!(o.dump.tokens, TOKENS);
            assert_eq!(o.dump.tp, 1);
            for k in o.keys() {
                let v = o.get(&k.to_string());
                assert_eq!(v.len() % TOKENS.len(), 0);
                let bad = v.iter().find(|&&x| !dt.representable(x) || !x.is_finite());
                assert!(
                    bad.is_none(),
                    "{dt:?} {name} {k}: {bad:?} is not a finite {} value",
                    dt.name()
                );
            }
        }
    }
}

/// Round-to-nearest-even f32 → bf16 → f32.
fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
}

#[test]
fn embedding_is_the_fp32_dumps_rounded() {
    // golden/candidate-smollm2/ is the fp32 HF run on "The capital of France is"; its tokens
    // 3575, 282, 4649 and 314 are at positions 6, 7, 8 and 4 of the chat prompt.
    let f32_dump = harness::dump::Dump::open(&[golden("candidate-smollm2").join("healthy.safetensors")]).unwrap();
    let o32 = open(Dt::Bf16, "healthy");
    let e32 = f32_dump.tensor(&key("embed"), &o32.config).unwrap().data;
    let d = o32.config.d_model;
    for dt in BOTH {
        let e = open(dt, "healthy").get("embed");
        for (i, &t) in f32_dump.tokens.iter().enumerate() {
            let Some(j) = TOKENS.iter().position(|&x| x == t) else {
                continue;
            };
            let (src, got) = (&e32[i * d..(i + 1) * d], &e[j * d..(j + 1) * d]);
            for (c, (&x, &y)) in src.iter().zip(got).enumerate() {
                match dt {
                    Dt::Bf16 => assert_eq!(round_bf16(x), y, "token {t} column {c}"),
                    Dt::F16 => assert!(
                        (x - y).abs() <= x.abs() * dt.u() + 2f32.powi(-25),
                        "token {t} column {c}: {x} vs {y}"
                    ),
                }
            }
        }
    }
}

/// Taps strictly before `first` are bit-identical to the healthy dump's.
fn same_before(h: &Opened, f: &Opened, first: &str, what: &str) {
    let first = key(first);
    let mut n = 0;
    for k in h.keys().into_iter().filter(|k| *k < first) {
        assert_eq!(
            h.get(&k.to_string()),
            f.get(&k.to_string()),
            "{what}: {k} differs before {first}"
        );
        n += 1;
    }
    assert!(n > 0, "{what}: nothing before {first}");
    assert_ne!(
        h.get(&first.to_string()),
        f.get(&first.to_string()),
        "{what}: {first} is the healthy one"
    );
}

fn head(x: &[f32], width: usize, token: usize, h: usize) -> &[f32] {
    &x[token * width + h * HEAD_DIM..token * width + (h + 1) * HEAD_DIM]
}

#[test]
fn faults_are_planted_where_the_manifest_says() {
    let attn_out = format!("blk.{FAULT_LAYER}.attn_out");
    for dt in BOTH {
        let h = open(dt, "healthy");
        let healthy_ao = h.get(&attn_out);
        let width = healthy_ao.len() / TOKENS.len();
        assert_eq!(width, 9 * HEAD_DIM);

        let f = open(dt, "attn-zero");
        same_before(&h, &f, &attn_out, "attn-zero");
        assert!(f.get(&attn_out).iter().all(|&x| x == 0.0));

        let f = open(dt, "head-swap");
        same_before(&h, &f, &attn_out, "head-swap");
        let ao = f.get(&attn_out);
        for t in 0..TOKENS.len() {
            assert_eq!(head(&ao, width, t, 0), head(&healthy_ao, width, t, 1));
            assert_eq!(head(&ao, width, t, 1), head(&healthy_ao, width, t, 0));
            for hh in 2..9 {
                assert_eq!(head(&ao, width, t, hh), head(&healthy_ao, width, t, hh));
            }
        }

        for s in ["1.05", "1.02", "1.01"] {
            let name = format!("head-scale-{s}");
            if !dt.faults().contains(&name.as_str()) {
                continue;
            }
            let scale: f32 = s.parse().unwrap();
            let f = open(dt, &name);
            same_before(&h, &f, &attn_out, &name);
            let ao = f.get(&attn_out);
            let (mut num, mut den) = (0f64, 0f64);
            for t in 0..TOKENS.len() {
                for hh in 0..9 {
                    let (a, b) = (head(&ao, width, t, hh), head(&healthy_ao, width, t, hh));
                    if hh != HEAD {
                        assert_eq!(a, b, "{name}: head {hh} token {t}");
                        continue;
                    }
                    for (&y, &x) in a.iter().zip(b) {
                        // The product rounded once to the compute dtype.
                        let want = x * scale;
                        let bound = want.abs() * dt.u() + 2f32.powi(-25);
                        assert!((y - want).abs() <= bound, "{name}: {y} vs {x}·{s}");
                        num += f64::from(y) * f64::from(x);
                        den += f64::from(x) * f64::from(x);
                    }
                }
            }
            let fit = num / den;
            assert!(
                (fit - f64::from(scale)).abs() < 2e-3,
                "{dt:?} {name}: fitted scale {fit}"
            );
        }

        // RoPE base / 10 in every layer: layer 0's q is the first tap off, its first token
        // (position 0, angle 0) is untouched, and v (no RoPE) is the healthy one.
        let f = open(dt, "rope-theta-div10");
        same_before(&h, &f, "blk.0.q", "rope-theta-div10");
        let (q, hq) = (f.get("blk.0.q"), h.get("blk.0.q"));
        let w = q.len() / TOKENS.len();
        assert_eq!(q[..w], hq[..w], "position 0 is not rotated");
        assert_ne!(q[w..2 * w], hq[w..2 * w]);
        assert_eq!(f.get("blk.0.v"), h.get("blk.0.v"));

        // eps 1e-2 in every RMSNorm: the first norm is the first tap off.
        let f = open(dt, "rms-eps-1e-2");
        same_before(&h, &f, "blk.0.attn_norm", "rms-eps-1e-2");
    }
}

// ---- The verdicts at default settings (issue 44's targets). ----

/// `llmdiff diff-layers SMOLLM2 --candidate DUMP` with default settings, as a user runs it;
/// the run document (`--json-out`) as JSON.
fn diff_default(dt: Dt, name: &str) -> Value {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run.json");
    let model = smollm2().display().to_string();
    let dump = path(dt, name).display().to_string();
    let o = out.display().to_string();
    let argv = [
        "llmdiff",
        "diff-layers",
        model.as_str(),
        "--candidate",
        dump.as_str(),
        "--json-out",
        o.as_str(),
    ];
    let cli = <harness::cli::Cli as clap::Parser>::try_parse_from(argv).unwrap();
    harness::commands::run(cli).unwrap_or_else(|e| panic!("{dt:?} {name}: {e:#}"));
    serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap()
}

fn first_tap(run: &Value) -> &str {
    run["first_divergence"]["tap"].as_str().unwrap_or("-")
}

fn class(run: &Value) -> &str {
    run["diagnosis"]["class"].as_str().unwrap_or("-")
}

fn explanation(run: &Value) -> &str {
    run["diagnosis"]["explanation"].as_str().unwrap_or("")
}

#[test]
fn healthy_bf16_and_f16_agree_at_default_settings() {
    for dt in BOTH {
        let run = diff_default(dt, "healthy");
        assert_eq!(
            run["verdict"],
            "agree",
            "{dt:?}: first divergence {} ({}: {})",
            first_tap(&run),
            class(&run),
            explanation(&run)
        );
        assert_eq!(run["taps"].as_array().unwrap().len(), 25);
    }
}

/// A fault dump diverges first at `tap` with a diagnosis whose class is one of `classes`.
fn localized(dt: Dt, name: &str, tap: &str, classes: &[&str]) -> Value {
    let run = diff_default(dt, name);
    assert_eq!(run["verdict"], "diverged", "{dt:?} {name} missed");
    assert_eq!(
        first_tap(&run),
        tap,
        "{dt:?} {name}: {}: {}",
        class(&run),
        explanation(&run)
    );
    assert!(
        classes.contains(&class(&run)),
        "{dt:?} {name}: class {} ({}), want one of {classes:?}",
        class(&run),
        explanation(&run)
    );
    run
}

#[test]
fn zeroed_attention_output_is_localized_in_low_precision() {
    for dt in BOTH {
        localized(dt, "attn-zero", "blk.1.attn_out", &["stale-output"]);
    }
}

#[test]
fn swapped_heads_are_a_head_permutation_in_low_precision() {
    for dt in BOTH {
        localized(dt, "head-swap", "blk.1.attn_out", &["head-permutation"]);
    }
}

#[test]
fn one_head_scaled_is_a_per_head_scale_mismatch() {
    // 1.02 is the goal for the smallest scale detectable in bf16 without a false
    // positive (the healthy test above is the other half of that claim).
    for dt in BOTH {
        for name in ["head-scale-1.05", "head-scale-1.02"] {
            let run = localized(dt, name, "blk.1.attn_out", &["scale-mismatch"]);
            assert!(
                explanation(&run).contains(&format!("head {HEAD}")),
                "{dt:?} {name}: the explanation names no head: {}",
                explanation(&run)
            );
        }
    }
}

#[test]
fn rope_base_divided_by_ten_is_rope() {
    for dt in BOTH {
        localized(dt, "rope-theta-div10", "blk.0.q", &["rope"]);
    }
}

#[test]
fn rms_eps_drift_is_named_at_the_first_norm() {
    for dt in BOTH {
        let run = diff_default(dt, "rms-eps-1e-2");
        assert_eq!(run["verdict"], "diverged", "{dt:?} missed");
        assert_eq!(first_tap(&run), "blk.0.attn_norm", "{dt:?}: {}", explanation(&run));
        // A norm class, or config-drift wording that names the epsilon.
        let (c, e) = (class(&run), explanation(&run));
        assert!(
            c == "config-drift" || c.contains("norm") || e.contains("eps"),
            "{dt:?}: class {c} ({e})"
        );
    }
}
