//! `reports`: the versioned report schema (serde types) that harness fills, and the pure
//! rendering of a report into one self-contained HTML string with inline SVG charts.
//! Data in, a string out: no file I/O, no CLI.
//!
//! - [`schema`]: the run documents ([`DiffRun`]).
//! - [`render_diff`]: a diff-layers run as a page.
//! - [`charts`]: the SVG charts, also usable on their own by other runs (the entropy run's
//!   [`render_entropy_chart`] and [`render_kld_histogram`] take plain slices).
//! - [`html`]: the page shell and escaping, for other pages built from these parts.
//! - [`sample`]: synthetic run documents for tests and measurements.

pub mod charts;
pub mod diff_page;
pub mod entropy_page;
pub mod gate_page;
pub mod html;
pub mod sample;
pub mod schema;

pub use charts::{render_entropy_chart, render_kld_histogram};
pub use diff_page::render_diff;
pub use entropy_page::render_entropy;
pub use gate_page::render_gate;
pub use schema::*;
