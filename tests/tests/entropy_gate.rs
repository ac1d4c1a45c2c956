//! `entropy` and `gate` end to end: SmolLM2 healthy vs an injected fault, golden files blessed and
//! gated (pass on a clean run, a precise failure with a fault injected), the committed golden
//! files, JUnit checked with a real XML parser (tests/peers/check_junit.py), bad input.

use harness::cli::Cli;
use llmdiff_tests::fixtures::{golden, repo_root, smollm2};
use std::process::{Command, ExitCode};

fn run(args: &[&str]) -> anyhow::Result<ExitCode> {
    let cli = <Cli as clap::Parser>::try_parse_from(std::iter::once("llmdiff").chain(args.iter().copied()))?;
    harness::commands::run(cli)
}

fn code(args: &[&str]) -> u8 {
    match run(args) {
        Ok(c) if c == ExitCode::SUCCESS => 0,
        Ok(c) if c == ExitCode::from(1) => 1,
        Ok(c) => panic!("unexpected exit code {c:?}"),
        Err(_) => 2,
    }
}

fn check_junit(path: &std::path::Path, expect: &str) {
    let script = repo_root().join("tests/peers/check_junit.py");
    let Ok(out) = Command::new("python3").arg(&script).arg(path).arg(expect).output() else {
        eprintln!("python3 not found: JUnit parser check skipped");
        return;
    };
    assert!(
        out.status.success(),
        "check_junit.py: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn smollm2_entropy_healthy_and_phantom_fault_degenerate() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(
        &prompts,
        "The capital of France is\ndef fibonacci(n):\nMonday, Tuesday, Wednesday, Thursday,\n",
    )
    .unwrap();
    let model = smollm2().to_str().unwrap();
    let p = prompts.to_str().unwrap();
    let out = dir.path().join("e.json");
    let o = out.to_str().unwrap();
    let base = [
        "entropy",
        model,
        "--prompts",
        p,
        "--backend",
        "cpu",
        "--max-new-tokens",
        "16",
        "--json-out",
        o,
    ];
    assert_eq!(code(&[&base[..], &["--tp", "3", "--against-reference"]].concat()), 0);
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "healthy");
    assert!(doc["kld"]["max"].as_f64().unwrap() < 1e-6, "{}", doc["kld"]);
    // The calibrated verdict decides locally too: f32 sits far under the healthy floor.
    let v = &doc["kld_verdict"];
    assert_eq!(v["band_name"], "within numeric noise", "{v}");
    assert!(v["mean"].as_f64().unwrap() < 1e-6, "{v}");
    eprintln!("f32: {}", v["headline"]);
    assert_eq!(doc["agreement"], "within numeric noise");
    // bf16 numerics: within noise at the default calibration.
    assert_eq!(
        code(
            &[
                &base[..],
                &["--tp", "3", "--against-reference", "--compute-dtype", "bf16"]
            ]
            .concat()
        ),
        0
    );
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let v = &doc["kld_verdict"];
    assert_eq!(v["band_name"], "within numeric noise", "{v}");
    assert!(v["mean"].as_f64().unwrap() > 1e-8, "bf16 rounding shows: {v}");
    eprintln!("bf16: {} (mean {})", v["headline"], v["mean"]);
    // A fault that leaves the distributions plausible is judged broken against the reference.
    assert_eq!(
        code(
            &[
                &base[..],
                &["--tp", "3", "--against-reference", "--inject", "rope-neox"]
            ]
            .concat()
        ),
        1
    );
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["kld_verdict"]["band_name"], "broken", "{}", doc["kld_verdict"]);
    eprintln!("rope-neox: {}", doc["kld_verdict"]["headline"]);
    let h = doc["prompts"][0]["norm_entropy"].as_f64().unwrap();
    assert!(h > 0.05 && h < 0.5, "H/ln V {h}");
    assert_eq!(
        code(&[&base[..], &["--tp", "3", "--inject", "phantom-attn-out"]].concat()),
        1
    );
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc["verdict"], "degenerate", "{}", doc["prompts"][0]);
}

#[test]
fn entropy_bad_input_is_exit_2_naming_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let model = smollm2().to_str().unwrap();
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "\n\n").unwrap();
    assert_eq!(code(&["entropy", model, "--prompts", empty.to_str().unwrap()]), 2);
    let bad = dir.path().join("bad.jsonl");
    std::fs::write(&bad, "{\"prompt\": \"hi\"}\n{\"tokens\": \"x\"}\n").unwrap();
    let err = run(&["entropy", model, "--prompts", bad.to_str().unwrap()]).unwrap_err();
    assert!(format!("{err:#}").contains("line 2"), "{err:#}");
}

#[test]
fn bless_then_gate_synth_passes_and_fails_with_a_fault() {
    let root = tempfile::tempdir().unwrap();
    std::fs::create_dir(root.path().join("golden")).unwrap();
    let g = root.path().join("golden/gate-ds.json");
    let gs = g.to_str().unwrap();
    let bless = [
        "golden",
        "bless",
        "--synth",
        "deepseek-v3-mini",
        "--quant",
        "Q8_0",
        "--tokens",
        "1,5,9,20,33,47",
    ];
    assert_eq!(
        code(&[&bless[..], &["--backend", "cpu", "--tp", "2", "-o", gs]].concat()),
        0
    );
    let text = std::fs::read_to_string(&g).unwrap();
    assert!(text.contains("\"magic\": \"llmdiff-golden\"") && text.contains("\"synth\""));
    let junit = root.path().join("j.xml");
    let j = junit.to_str().unwrap();
    assert_eq!(code(&["gate", "--golden", gs, "--junit", j]), 0);
    check_junit(&junit, "--expect-pass");
    assert_eq!(
        code(&["gate", "--golden", gs, "--inject", "allreduce-skip@1:1", "--junit", j]),
        1
    );
    check_junit(&junit, "--expect-failures");
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(xml.contains("blk.1.resid_attn@r1"), "{xml}");
    // A golden file of another format is bad input with the bless hint.
    let current = format!("\"format\": {}", harness::golden::GOLDEN_FORMAT);
    assert!(text.contains(&current), "blessed as the current format");
    std::fs::write(&g, text.replace(&current, "\"format\": 99")).unwrap();
    let err = run(&["gate", "--golden", gs]).unwrap_err();
    assert!(format!("{err:#}").contains("golden bless --update"), "{err:#}");
}

#[test]
fn committed_smollm2_golden_gates_pass() {
    smollm2();
    for name in ["gate-smollm2-cpu-tp3.json", "gate-deepseek-v3-mini-cpu-tp2.json"] {
        let g = golden(name);
        assert_eq!(code(&["gate", "--golden", g.to_str().unwrap()]), 0, "{name}");
    }
}
