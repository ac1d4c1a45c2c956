//! The `llmdiff` binary: parse the command line, run one command, map the outcome to an exit
//! code (0 agree/pass/healthy, 1 divergence/failure, 2 bad input or usage).

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = harness::cli::Cli::parse();
    match harness::commands::run(cli) {
        Ok(code) => code,
        Err(e) => {
            // One line: the chain of causes joined with ": ".
            let msg = format!("{e:#}").replace('\n', " ");
            eprintln!("error: {msg}");
            ExitCode::from(2)
        }
    }
}
