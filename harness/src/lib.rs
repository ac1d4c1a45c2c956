//! `harness`: the llmdiff command line and everything it drives: capture, compare, localize,
//! classify, entropy/KLD, gate and golden files. Only this crate does CLI and result file I/O.

pub mod capture;
pub mod chat;
pub mod cli;
pub mod commands;
pub mod compare;
pub mod diagnose;
pub mod diff;
pub mod dump;
pub mod entropy;
pub mod fingerprint;
pub mod golden;
pub mod isolate;
pub mod junit;
pub mod kernel_trace;
pub mod kld_verdict;
pub mod layer_range;
pub mod layout;
pub mod local_rows;
pub mod logprobs;
pub mod noise;
pub mod output;
pub mod runner;
pub mod selection;
pub mod server;
pub mod server_view;
pub mod slice;
pub mod topk;
pub mod tp_meta;
pub mod weight_rows;
