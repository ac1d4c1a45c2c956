//! One module per subcommand; `run` dispatches.

use crate::cli::{Cli, Command};
use std::process::ExitCode;

pub mod bench;
pub mod demo;
pub mod diff_layers;
pub mod entropy;
pub mod gate;
pub mod generate;
pub mod golden;
pub mod inspect;
pub mod kernels;
pub mod logits;
pub mod report;
pub mod synth;
pub mod tokenize;

pub fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    crate::output::set_allow_unknown(cli.allow_unknown);
    match cli.command {
        Command::Inspect(a) => inspect::run(&a),
        Command::Synth(a) => synth::run(&a),
        Command::Logits(a) => logits::run(&a),
        Command::Tokenize(a) => tokenize::run(&a),
        Command::DiffLayers(a) => diff_layers::run(&a),
        Command::Generate(a) => generate::run(&a),
        Command::Bench(a) => bench::run(&a),
        Command::Kernels(a) => kernels::run(&a),
        Command::Entropy(a) => entropy::run(&a),
        Command::Gate(a) => gate::run(&a),
        Command::Golden(a) => golden::run(&a),
        Command::Report(a) => report::run(&a),
        Command::Demo(a) => demo::run(&a),
    }
}
