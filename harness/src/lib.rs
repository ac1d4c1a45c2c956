//! `harness`: the llmdiff command line and everything it drives: capture, compare, localize,
//! classify, entropy/KLD, gate and golden files. Only this crate does CLI and result file I/O.

pub mod cli;
pub mod commands;
pub mod logprobs;
pub mod output;
