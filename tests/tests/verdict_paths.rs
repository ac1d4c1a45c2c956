//! The shorter paths to a verdict (issue 49): the reference's results do not depend on whether
//! its weights are tapped (a tapped weight is decoded once and its rows reused) or on the thread
//! count; `--n-layers N` truncates both sides to the first N layers; `--stop-at-first` ends both
//! sides after the first divergence; the run document's stage timings are filled in.

use engine::{Fault, FaultSpec};
use harness::diff::run_diff;
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::forward::Reference;
use references::tap::{CollectTap, NoTap, TapKey};
use references::{GgmlType, GgufFile};

fn model(dir: &std::path::Path, preset: &str, n_layers: usize) -> GgufFile {
    synth(dir, preset, &spec(preset, Some(n_layers), Some(GgmlType::Q4K)))
}

#[test]
fn reference_logits_do_not_depend_on_weight_taps_or_thread_count() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (preset, layers) in [("llama-tiny", 2), ("deepseek-v3-mini", 3)] {
        let file = model(dir.path(), preset, layers);
        let r = Reference::new(&file).expect("reference");
        let toks = tokens(r.config.vocab, 11);
        let plain = r.forward(&toks, &mut NoTap).expect("forward");
        let mut all = CollectTap::new(|_: &TapKey| true);
        let tapped = r.forward(&toks, &mut all).expect("forward, every tap");
        assert!(
            all.recorded.iter().any(|t| t.key.site.name().starts_with("w.")),
            "{preset}: the weights were tapped"
        );
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().expect("pool");
        let single = one.install(|| r.forward(&toks, &mut NoTap).expect("forward, 1 thread"));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&plain), bits(&tapped), "{preset}: logits with every tap");
        assert_eq!(bits(&plain), bits(&single), "{preset}: logits on one thread");
    }
}

#[test]
fn n_layers_truncates_both_sides_and_sees_only_their_faults() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = model(dir.path(), "llama-tiny", 3);
    let toks = tokens(512, 9);
    let fault = |layer: u32| FaultSpec {
        fault: Fault::RopeNeox,
        layer: Some(layer),
        rank: None,
    };

    let mut p = plan(&file, toks.clone(), 1, Vec::new(), 0);
    p.engine.n_layers = Some(2);
    let run = run_diff(&p).expect("truncated diff");
    assert_eq!(run.verdict, "agree");
    assert!(
        run.taps.iter().all(|t| t.layer.is_none_or(|l| l < 2)),
        "no tap past layer 1"
    );
    assert!(run.taps.iter().any(|t| t.layer == Some(1)), "layer 1 compared");
    assert!(
        run.taps.iter().any(|t| t.site == "logits"),
        "the head runs after the cut"
    );

    // A fault in a layer past the cut is refused (that layer does not run); one before it is
    // found there.
    let mut p = plan(&file, toks.clone(), 1, vec![fault(2)], 0);
    p.engine.n_layers = Some(2);
    let Err(e) = run_diff(&p) else {
        panic!("a fault past the cut is an error")
    };
    assert!(e.to_string().contains("layer 2"), "{e}");
    let mut p = plan(&file, toks.clone(), 1, vec![fault(1)], 0);
    p.engine.n_layers = Some(2);
    let run = run_diff(&p).expect("diff");
    assert_eq!(run.first_divergence.map(|f| f.layer), Some(Some(1)));

    // Out of range: an error, not a panic.
    let mut p = plan(&file, toks, 1, Vec::new(), 0);
    p.engine.n_layers = Some(4);
    assert!(run_diff(&p).is_err());
}

#[test]
fn stop_at_first_finds_the_same_divergence_and_compares_less() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = model(dir.path(), "llama-tiny", 4);
    let toks = tokens(512, 9);
    let f = vec![FaultSpec {
        fault: Fault::RopeNeox,
        layer: Some(0),
        rank: None,
    }];
    let full = run_diff(&plan(&file, toks.clone(), 1, f.clone(), 0)).expect("diff");
    let mut p = plan(&file, toks, 1, f, 0);
    p.stop_at_first = true;
    let short = run_diff(&p).expect("diff --stop-at-first");
    assert_eq!(full.verdict, "diverged");
    assert_eq!(short.first_divergence, full.first_divergence);
    assert!(
        short.taps.len() < full.taps.len(),
        "{} taps with --stop-at-first, {} without",
        short.taps.len(),
        full.taps.len()
    );
    let last = |r: &reports::DiffRun| r.taps.iter().filter_map(|t| t.layer).max();
    assert!(
        last(&short) < last(&full),
        "last layer compared: {:?} against {:?}",
        last(&short),
        last(&full)
    );
}

#[test]
fn run_document_times_each_stage() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = model(dir.path(), "llama-tiny", 2);
    let run = run_diff(&plan(&file, tokens(512, 9), 2, Vec::new(), 0)).expect("diff");
    let t = &run.timings_s;
    for (name, part, whole) in [
        ("engine load", t.engine_load, t.engine),
        ("engine capture", t.engine_capture, t.engine),
        ("engine wait", t.engine_wait, t.engine),
        ("reference capture", t.reference_capture, t.reference),
        ("reference wait", t.reference_wait, t.reference),
        ("replay", t.replay, t.compare),
    ] {
        assert!(part >= 0.0 && part <= whole + 1e-3, "{name} {part} s of {whole} s");
    }
    assert!(
        t.reference_capture > 0.0,
        "the reference decoded its weights for their taps"
    );
    assert!(
        t.compare_wait >= 0.0 && t.compare_wait <= t.total,
        "compare wait {}",
        t.compare_wait
    );
    let json = serde_json::to_value(&run).expect("serialize");
    assert!(json["timings_s"]["reference_capture"].is_number());
}

/// A tap that records keys and reports `stopped` once it has seen `stop_after`.
struct StopTap {
    keys: Vec<TapKey>,
    stop_after: TapKey,
}

impl references::tap::Tap for StopTap {
    fn wants(&self, _: &TapKey) -> bool {
        true
    }
    fn record(&mut self, key: &TapKey, _: &[f32], _: [usize; 2]) {
        self.keys.push(*key);
    }
    fn stopped(&self) -> bool {
        self.keys.contains(&self.stop_after)
    }
}

#[test]
fn a_stopped_tap_ends_both_passes_after_the_current_layer() {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = model(dir.path(), "llama-tiny", 4);
    let toks = tokens(512, 5);
    let stop_after = TapKey::layer(1, references::tap::Site::AttnOut);
    let r = Reference::new(&file).expect("reference");
    let mut tap = StopTap {
        keys: Vec::new(),
        stop_after,
    };
    let logits = r.forward(&toks, &mut tap).expect("forward");
    assert!(logits.is_empty(), "a stopped pass returns no logits");
    assert_eq!(
        tap.keys.iter().filter_map(|k| k.layer).max(),
        Some(1),
        "the reference ends after layer 1"
    );

    let mut e = engine::Engine::load(&file, engine::EngineOptions::default()).expect("engine");
    let mut tap = StopTap {
        keys: Vec::new(),
        stop_after,
    };
    e.prefill(&toks, &mut tap).expect("prefill");
    assert_eq!(
        tap.keys.iter().filter_map(|k| k.layer).max(),
        Some(1),
        "the engine ends after layer 1"
    );
}
