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
    // The reference frees and reallocates each layer's dequantized weights (megabytes each). By
    // default glibc hands such blocks back to the kernel on free, so every layer pays page faults
    // to zero fresh pages again (12 % of a SmolLM2 prefill). Keep them in the heap for reuse:
    // blocks under 64 MiB come from the heap, and it is trimmed only past 512 MiB free at its top.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; no thread has started yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 512 << 20);
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
