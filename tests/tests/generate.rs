//! `generate` end to end on the real SmolLM2: the cpu engine at TP 1 and 3 continues a prompt as
//! the reference does ("Paris"), an injected unwritten attention output turns it into garbage,
//! and bad input is an error.

use harness::cli::{Cli, Command, GenerateArgs};
use harness::commands::generate::generate;
use llmdiff_tests::fixtures::smollm2;

fn args(extra: &[&str]) -> GenerateArgs {
    let model = smollm2().to_str().unwrap();
    let base = [
        "llmdiff",
        "generate",
        model,
        "--prompt",
        "The capital of France is",
        "--max-new-tokens",
        "6",
    ];
    let cli = <Cli as clap::Parser>::try_parse_from(base.iter().chain(extra.iter()).copied()).expect("args parse");
    match cli.command {
        Command::Generate(a) => a,
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn smollm2_generates_as_the_reference_and_a_fault_breaks_it() {
    let reference = generate(&args(&["--backend", "reference"])).unwrap();
    let text = reference.text.clone().unwrap();
    assert!(text.contains("Paris"), "reference continuation: {text:?}");
    assert_eq!(reference.backend, "reference");
    for tp in ["1", "3"] {
        let e = generate(&args(&["--backend", "cpu", "--tp", tp])).unwrap();
        assert_eq!(e.backend, "cpu");
        assert_eq!(e.tokens, reference.tokens, "cpu TP {tp}: {:?}", e.text);
    }
    let broken = generate(&args(&["--backend", "cpu", "--inject", "phantom-attn-out"])).unwrap();
    assert_eq!(broken.injected, vec!["phantom-attn-out".to_string()]);
    assert_ne!(broken.tokens, reference.tokens);
    assert!(!broken.text.unwrap().contains("Paris"));
}

#[test]
fn generate_bad_input_is_an_error() {
    // An unknown fault is refused where the arguments are parsed (clap: exit 2).
    let parsed = <Cli as clap::Parser>::try_parse_from([
        "llmdiff",
        "generate",
        "m.gguf",
        "--prompt",
        "x",
        "--inject",
        "no-such-fault",
    ]);
    assert!(parsed.is_err());
    let mut a = args(&["--backend", "reference", "--tp", "2"]);
    assert!(generate(&a).is_err(), "--tp with the reference");
    a.model = "/nonexistent.gguf".into();
    assert!(generate(&a).is_err());
}
