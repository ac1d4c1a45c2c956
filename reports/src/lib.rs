//! `reports`: the versioned report schema (serde types) that harness fills, and the pure
//! rendering of a report into one self-contained HTML string with inline SVG charts.
//! The renderer arrives with the HTML-report work; the schema grows with each command.
