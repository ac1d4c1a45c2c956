//! The `llmdiff` binary: parse the command line, run one command, map the outcome to an exit
//! code (0 agree/pass/healthy, 1 divergence/failure, 2 bad input or usage).

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    // Die quietly on a closed pipe (`llmdiff inspect x.gguf | head`), as Unix tools do.
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
