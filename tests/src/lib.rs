//! Shared fixtures for llmdiff's integration tests: the real SmolLM2 model (fetched once from
//! PyPI into an ignored cache), paths into `golden/`, and synthetic models with diff plans.

pub mod fixtures;
pub mod models;
