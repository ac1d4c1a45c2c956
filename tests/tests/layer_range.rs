//! `diff-layers --layers A..B` (issue 49): both sides run layers A..B from one residual. A fault
//! inside the range is found at the same tap and class as the whole-model run; a fault before
//! the range agrees with the reference's residual (the range itself is healthy) and diverges at
//! the range's entry tap `blk.{A-1}.resid_out` with `--residual-from engine` (the engine's own
//! hidden state carries it); with a dump's residual the reference reads no weight outside the range; bad ranges are
//! one-line errors (exit 2). On synth llama, qwen3 (GQA) and deepseek2 (MLA) at TP 1 and 2, and
//! the real SmolLM2 with its committed HF dumps.

use clap::Parser;
use engine::FaultSpec;
use harness::diff::{run_diff, run_diff_candidate, run_diff_candidate_range, run_diff_range, DiffPlan};
use harness::dump::Dump;
use harness::layer_range::{LayerRange, ResidualFrom};
use llmdiff_tests::fixtures::{golden, smollm2};
use llmdiff_tests::models::{plan, spec, synth, tokens};
use references::tap::{Site, TapKey};
use references::{GgufFile, ModelConfig};
use reports::DiffRun;
use std::path::PathBuf;

const N_TOKENS: usize = 8;
const N_LAYERS: usize = 8;

/// The reference's count of weight bytes read is per process: the tests of this file that run
/// a diff hold this lock, so one test's count never includes another's reads.
static COUNTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    COUNTER.lock().unwrap_or_else(|e| e.into_inner())
}

fn range(file: &GgufFile, layers: std::ops::Range<usize>, from: ResidualFrom) -> LayerRange {
    let total = ModelConfig::from_header(&file.header).unwrap().n_layers;
    LayerRange { layers, total, from }
}

fn fault(s: &str) -> Vec<FaultSpec> {
    vec![s.parse().unwrap()]
}

fn whole(file: &GgufFile, tp: usize, faults: Vec<FaultSpec>) -> DiffRun {
    let vocab = ModelConfig::from_header(&file.header).unwrap().vocab;
    run_diff(&plan(file, tokens(vocab, N_TOKENS), tp, faults, 0)).unwrap()
}

fn ranged(file: &GgufFile, tp: usize, faults: Vec<FaultSpec>, r: &LayerRange) -> DiffRun {
    let vocab = ModelConfig::from_header(&file.header).unwrap().vocab;
    run_diff_range(&plan(file, tokens(vocab, N_TOKENS), tp, faults, 0), r).unwrap()
}

/// Every compared tap lies in the range (no embedding, no output taps before the last layer),
/// but for `--residual-from engine`'s entry tap `blk.{A-1}.resid_out`.
fn only_range_taps(run: &DiffRun, layers: &std::ops::Range<usize>) {
    assert!(!run.taps.is_empty());
    for t in &run.taps {
        let k: TapKey = t.tap.parse().unwrap();
        if run.layer_range.as_ref().is_some_and(|r| r.residual_from == "engine")
            && k == TapKey::layer(layers.start - 1, Site::ResidOut)
        {
            // The entry tap: the two sides' own residuals at the range's start.
            continue;
        }
        assert!(
            k.layer.is_some_and(|l| layers.contains(&(l as usize))),
            "{} outside {layers:?}",
            t.tap
        );
    }
    let info = run.layer_range.as_ref().expect("the run document records the range");
    assert_eq!((info.start, info.end, info.head), (layers.start, layers.end, false));
}

/// The model-family cases: (name, file, TP degrees).
fn models(dir: &std::path::Path) -> Vec<(&'static str, GgufFile, Vec<usize>)> {
    vec![
        (
            "llama-tiny",
            synth(dir, "llama", &spec("llama-tiny", Some(N_LAYERS), None)),
            vec![1, 2],
        ),
        (
            "qwen3-mini",
            synth(dir, "qwen3", &spec("qwen3-mini", Some(N_LAYERS), None)),
            vec![2],
        ),
        (
            "deepseek-v3-mini",
            synth(dir, "ds", &spec("deepseek-v3-mini", Some(N_LAYERS), None)),
            vec![2],
        ),
    ]
}

#[test]
fn a_fault_in_the_range_is_found_where_the_whole_run_finds_it() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for (name, file, tps) in models(dir.path()) {
        for tp in tps {
            let case = format!("{name} tp {tp}");
            let w = whole(&file, tp, fault("rope-neox@5"));
            let wf = w
                .first_divergence
                .as_ref()
                .unwrap_or_else(|| panic!("{case}: whole run agreed"));
            assert_eq!(wf.layer, Some(5), "{case}: {}", wf.tap);
            for from in [ResidualFrom::Reference, ResidualFrom::Engine] {
                let r = range(&file, 4..7, from.clone());
                let got = ranged(&file, tp, fault("rope-neox@5"), &r);
                let gf = got
                    .first_divergence
                    .as_ref()
                    .unwrap_or_else(|| panic!("{case} {from:?}: agreed"));
                assert_eq!(gf.tap, wf.tap, "{case} {from:?}");
                assert_eq!(
                    got.diagnosis.as_ref().unwrap().class,
                    w.diagnosis.as_ref().unwrap().class,
                    "{case} {from:?}"
                );
                only_range_taps(&got, &(4..7));
            }
            // Healthy over the range: agreement.
            let healthy = ranged(&file, tp, Vec::new(), &range(&file, 4..7, ResidualFrom::Reference));
            assert_eq!(healthy.verdict, "agree", "{case}: {:?}", healthy.first_divergence);
        }
    }
}

#[test]
fn a_fault_before_the_range_agrees_from_the_reference_and_shows_first_from_the_engine() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    for (name, file, tps) in models(dir.path()) {
        for tp in tps {
            let case = format!("{name} tp {tp}");
            let honest = ranged(
                &file,
                tp,
                fault("rope-neox@2"),
                &range(&file, 4..7, ResidualFrom::Reference),
            );
            assert_eq!(honest.verdict, "agree", "{case}: {:?}", honest.first_divergence);
            let own = ranged(
                &file,
                tp,
                fault("rope-neox@2"),
                &range(&file, 4..7, ResidualFrom::Engine),
            );
            let first = own
                .first_divergence
                .as_ref()
                .unwrap_or_else(|| panic!("{case}: agreed"));
            // Named at the range's entry, the sides' own residuals at layer 4, not inside it.
            assert_eq!(first.tap, "blk.3.resid_out", "{case}");
            assert_eq!(first.layer, Some(3), "{case}");
            assert_eq!(own.layer_range.as_ref().unwrap().residual_from, "engine");
        }
    }
}

#[test]
fn a_range_to_the_last_layer_runs_the_head() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let file = synth(dir.path(), "llama", &spec("llama-tiny", Some(N_LAYERS), None));
    let run = ranged(&file, 1, Vec::new(), &range(&file, 6..8, ResidualFrom::Reference));
    assert_eq!(run.verdict, "agree");
    assert!(run.taps.iter().any(|t| t.tap == "logits"));
    assert!(!run.taps.iter().any(|t| t.tap == "embed" || t.tap.starts_with("blk.5.")));
    assert!(run.layer_range.as_ref().unwrap().head);
    // The head's fault is seen there.
    let run = ranged(
        &file,
        1,
        fault("rope-neox@7"),
        &range(&file, 6..8, ResidualFrom::Reference),
    );
    assert_eq!(run.first_divergence.as_ref().unwrap().layer, Some(7));
}

fn smollm2_plan<'a>(file: &'a GgufFile, dump: &Dump) -> DiffPlan<'a> {
    let mut p = plan(file, dump.tokens.clone(), dump.tp, Vec::new(), 0);
    p.model_name = "smollm2".into();
    p
}

fn dump_path(name: &str) -> PathBuf {
    golden("candidate-smollm2").join(format!("{name}.safetensors"))
}

/// Stored bytes of the tensors of layers `layers`.
fn layer_bytes(file: &GgufFile, layers: std::ops::Range<usize>) -> u64 {
    file.tensors()
        .iter()
        .filter(|t| layers.clone().any(|l| t.name.starts_with(&format!("blk.{l}."))))
        .map(|t| file.tensor_data(t).len() as u64)
        .sum()
}

#[test]
fn a_dump_residual_reads_no_weight_outside_the_range() {
    let _serial = serial();
    let file = GgufFile::open(smollm2()).unwrap();
    let dump = Dump::open(&[dump_path("head-swap")]).unwrap();
    let p = smollm2_plan(&file, &dump);
    // The dump holds layers 0-2; its own residual at layer 1 starts both sides.
    let whole = run_diff_candidate(&p, &dump).unwrap();
    let r = range(&file, 1..3, ResidualFrom::Candidate);
    let got = run_diff_candidate_range(&p, &dump, &r).unwrap();
    assert_eq!(got.first_divergence, whole.first_divergence);
    assert_eq!(got.first_divergence.as_ref().unwrap().tap, "blk.1.attn_out");
    assert_eq!(
        got.diagnosis.as_ref().unwrap().class,
        whole.diagnosis.as_ref().unwrap().class
    );
    only_range_taps(&got, &(1..3));
    assert_eq!(got.layer_range.as_ref().unwrap().residual_from, "candidate");
    // The reference reads a range's weights at most twice: its products once, and the local
    // error's replays once more (weight taps are sampled, so replays read the stored weight).
    // Layers are the same size here, so reading a layer before the range would not fit.
    let read = got.timings_s.reference_weight_bytes;
    let in_range = layer_bytes(&file, 1..3);
    assert!(
        read > 0 && read <= 2 * in_range,
        "read {read} B, layers 1..3 hold {in_range} B"
    );
    assert!(
        whole.timings_s.reference_weight_bytes > 5 * in_range,
        "whole {}",
        whole.timings_s.reference_weight_bytes
    );
    // Layer 2 from the dump's residual: the fault in layer 1 is outside, the range agrees.
    let after = run_diff_candidate_range(&p, &dump, &range(&file, 2..3, ResidualFrom::Candidate)).unwrap();
    assert_eq!(after.verdict, "agree", "{:?}", after.first_divergence);
    // One layer: twice its bytes at most, where reading layers 0 and 1 as well would be three.
    let (read, layer2) = (after.timings_s.reference_weight_bytes, layer_bytes(&file, 2..3));
    assert!(
        read > 0 && read <= 2 * layer2,
        "read {read} B, layer 2 holds {layer2} B"
    );

    // Our engine from the healthy dump's residual: the reference reads only layers 1..3 too.
    let healthy = Dump::open(&[dump_path("healthy")]).unwrap();
    let r = range(&file, 1..3, ResidualFrom::Dump(vec![dump_path("healthy")]));
    let ours = run_diff_range(&smollm2_plan(&file, &healthy), &r).unwrap();
    assert_eq!(ours.verdict, "agree", "{:?}", ours.first_divergence);
    let read = ours.timings_s.reference_weight_bytes;
    assert!(
        read > 0 && read <= 2 * in_range,
        "read {read} B, layers 1..3 hold {in_range} B"
    );
    // From the reference's residual, its pass over layer 0 is counted too.
    let from_ref = run_diff_range(
        &smollm2_plan(&file, &healthy),
        &range(&file, 1..3, ResidualFrom::Reference),
    )
    .unwrap();
    assert!(from_ref.timings_s.reference_weight_bytes > read);
}

/// Runs the CLI as `main` does (an error there exits 2); returns the one-line error.
fn cli_error(args: &[&str]) -> String {
    let model = smollm2().display().to_string();
    let mut argv = vec!["llmdiff", "diff-layers", model.as_str(), "--tokens", "1,2,3"];
    argv.extend_from_slice(args);
    let cli = harness::cli::Cli::try_parse_from(argv).unwrap();
    let e = harness::commands::run(cli).expect_err("must fail");
    let msg = format!("{e:#}");
    assert!(!msg.contains('\n'), "{msg}");
    msg
}

#[test]
fn bad_ranges_are_one_line_errors() {
    for (args, want) in [
        (vec!["--layers", "7..4"], "the range is empty"),
        (vec!["--layers", "4..4"], "the range is empty"),
        (vec!["--layers", "0..31"], "the model has 30 layers"),
        (vec!["--layers", "4"], "no '..'"),
        (vec!["--layers", "4..=6"], "'..=' is not taken"),
        (vec!["--layers", "x..6"], "not a layer number"),
        (
            vec!["--layers", "4..6", "--decode-steps", "1"],
            "--decode-steps with --layers",
        ),
        (
            vec!["--layers", "4..6", "--residual-from", "candidate"],
            "no --candidate",
        ),
        (
            vec!["--layers", "4..6", "--residual-from", "/nonexistent.safetensors"],
            "nonexistent",
        ),
    ] {
        let e = cli_error(&args);
        assert!(e.contains(want), "{args:?}: {e}");
    }
    // clap refuses --layers with --n-layers, and --residual-from without --layers.
    let model = smollm2().display().to_string();
    for extra in [
        vec!["--layers", "1..2", "--n-layers", "2"],
        vec!["--residual-from", "engine"],
    ] {
        let mut argv = vec!["llmdiff", "diff-layers", model.as_str()];
        argv.extend(extra);
        assert!(harness::cli::Cli::try_parse_from(argv).is_err());
    }
}
