//! `reports`: the versioned report schema (serde types) that harness fills, and the pure
//! rendering of a report into one self-contained HTML string with inline SVG charts.
//! Data in, a string out: no file I/O, no CLI.

pub mod schema;

pub use schema::*;
