//! `llmdiff tokenize`: token ids from the GGUF's own tokenizer (no BOS added).

use crate::cli::TokenizeArgs;
use crate::output::open_model;
use references::tokenizer::Tokenizer;
use serde_json::json;
use std::process::ExitCode;

pub fn run(a: &TokenizeArgs) -> anyhow::Result<ExitCode> {
    let file = open_model(&a.model)?;
    let tok = Tokenizer::for_model(&file)?;
    let ids = tok.encode(&a.prompt, !a.no_special)?;
    if a.json {
        println!("{}", json!({"tokens": ids}));
    } else {
        for id in &ids {
            println!("{id:>7}  {:?}", tok.token_str(*id)?);
        }
    }
    Ok(ExitCode::SUCCESS)
}
