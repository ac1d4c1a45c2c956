//! `diff-layers --layers A..B`: both sides run layers A..B (Rust range syntax, A included, B not)
//! from one residual, the input of layer A (what layer A-1's `resid_out` tap holds), so a long
//! model can be bisected range by range without running the layers before A on both sides.
//!
//! The residual comes from the reference (it runs layers 0..A untapped and hands its residual to
//! both sides: the verdict is on layers A..B alone), from a candidate dump that holds the
//! layer-(A-1) output tap (both sides start from it; nothing runs before A), or, with `engine`,
//! each side's own: the engine runs 0..A untapped and goes on from its own hidden state, the
//! reference from its own, and the two residuals are compared first as the tap
//! `blk.{A-1}.resid_out`, so a fault before A is named there, at the range's entry, and not at a
//! tap inside the range (the bisect's "is it before A?" question). The output norm and head run only when B is the model's last layer;
//! otherwise the verdict is on the range's layer taps.

use crate::dump::Dump;
use anyhow::{bail, Context};
use engine::{Engine, EngineOptions};
use references::forward::{Reference, Span};
use references::tap::{NoTap, Site, Tap, TapKey};
use references::GgufFile;
use std::ops::Range;
use std::path::PathBuf;

/// Where the residual at the range's first layer comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ResidualFrom {
    /// The reference runs layers 0..A untapped and hands its residual to both sides.
    Reference,
    /// Each side's own hidden state at A: the engine's (it runs 0..A untapped) for the engine,
    /// the reference's for the reference; the two are compared as `blk.{A-1}.resid_out` before
    /// the range, so what went wrong before A is named at that entry tap.
    Engine,
    /// A candidate dump's `blk.{A-1}.resid_out` tap (one file per rank is fine).
    Dump(Vec<PathBuf>),
    /// The `--candidate` dump's own `blk.{A-1}.resid_out` (the default of a `--candidate` run).
    Candidate,
}

impl ResidualFrom {
    /// `reference`, `engine`, `candidate`, or a dump's path(s) (comma-separated).
    pub fn parse(s: &str) -> Result<ResidualFrom, String> {
        match s {
            "reference" => Ok(ResidualFrom::Reference),
            "engine" => Ok(ResidualFrom::Engine),
            "candidate" => Ok(ResidualFrom::Candidate),
            "" => Err("--residual-from: give reference, engine or a dump's path".into()),
            paths => Ok(ResidualFrom::Dump(paths.split(',').map(PathBuf::from).collect())),
        }
    }

    /// The run document's name for the source.
    pub fn name(&self) -> String {
        match self {
            ResidualFrom::Reference => "reference".into(),
            ResidualFrom::Engine => "engine".into(),
            ResidualFrom::Candidate => "candidate".into(),
            ResidualFrom::Dump(p) => p.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(","),
        }
    }
}

/// A validated layer range with its residual's source.
#[derive(Clone, Debug)]
pub struct LayerRange {
    pub layers: Range<usize>,
    /// The model's layer count.
    pub total: usize,
    pub from: ResidualFrom,
}

/// Parses `A..B`, `A..` (to the last layer) or `..B` (from layer 0) against a model of `total`
/// layers: 0 ≤ A < B ≤ total.
pub fn parse_range(s: &str, total: usize) -> Result<Range<usize>, String> {
    let bad =
        |why: &str| format!("--layers {s}: {why} (Rust range syntax A..B, A included, B not; 0 <= A < B <= {total})");
    let (a, b) = s.split_once("..").ok_or_else(|| bad("no '..'"))?;
    if b.starts_with('=') {
        return Err(bad("'..=' is not taken, write A..B+1"));
    }
    let num = |t: &str, default: usize| -> Result<usize, String> {
        if t.is_empty() {
            Ok(default)
        } else {
            t.trim()
                .parse::<usize>()
                .map_err(|_| bad(&format!("'{t}' is not a layer number")))
        }
    };
    let (a, b) = (num(a, 0)?, num(b, total)?);
    if a >= b {
        return Err(bad("the range is empty"));
    }
    if b > total {
        return Err(bad(&format!("the model has {total} layers")));
    }
    Ok(a..b)
}

impl LayerRange {
    /// The run document's record of a layer range.
    pub fn info(&self) -> reports::LayerRangeInfo {
        reports::LayerRangeInfo {
            start: self.layers.start,
            end: self.layers.end,
            residual_from: if self.layers.start == 0 {
                "embeddings".into()
            } else {
                self.from.name()
            },
            head: self.head(),
        }
    }

    /// Whether the output norm and head run (B is the model's last layer).
    pub fn head(&self) -> bool {
        self.layers.end == self.total
    }

    /// Whether a tap of the whole model exists in the range's run: the layers' taps, and the
    /// output taps when the head runs (never the embedding of a range starting after 0).
    pub fn keeps(&self, key: &TapKey) -> bool {
        match (key.layer, key.site) {
            (Some(l), _) => self.layers.contains(&(l as usize)),
            (None, Site::Embed) => self.layers.start == 0,
            (None, _) => self.head(),
        }
    }

    /// The engine's options for the range (its layers only, no other layer loaded).
    pub fn engine_options(&self, base: &EngineOptions) -> EngineOptions {
        EngineOptions {
            layers: Some(self.layers.clone()),
            ..base.clone()
        }
    }

    /// The reference pass over the range from `residual` (None at A = 0: the embeddings).
    pub fn span(&self, residual: Option<Vec<f32>>) -> Span {
        Span {
            layers: self.layers.clone(),
            residual,
            head: self.head(),
        }
    }

    /// The residuals at A, `[n, d]`, the engine's and the reference's (the same one but for
    /// `engine`); None when A = 0 (both sides start from the embeddings).
    pub fn residuals(
        &self,
        file: &GgufFile,
        reference: &Reference,
        tokens: &[u32],
        engine: &EngineOptions,
    ) -> anyhow::Result<Residuals> {
        let a = self.layers.start;
        if a == 0 {
            return Ok(Residuals::default());
        }
        let reference_own = || -> anyhow::Result<Vec<f32>> {
            let span = Span {
                layers: 0..a,
                residual: None,
                head: false,
            };
            Ok(reference.forward_span(tokens, span, &mut NoTap)?)
        };
        let r = match &self.from {
            ResidualFrom::Reference => reference_own()?,
            ResidualFrom::Engine => {
                // The faults of the layers before A (and the global ones) act here.
                let faults = engine
                    .faults
                    .iter()
                    .filter(|f| f.layer.is_none_or(|l| (l as usize) < a))
                    .cloned()
                    .collect();
                let opts = EngineOptions {
                    layers: Some(0..a),
                    n_layers: None,
                    faults,
                    ..engine.clone()
                };
                let mut prefix = Engine::load(file, opts)?;
                let own = prefix.prefill(tokens, &mut NoTap)?;
                drop(prefix);
                return Ok(Residuals {
                    engine: Some(own),
                    reference: Some(reference_own()?),
                    entry: Some(TapKey::layer(a - 1, Site::ResidOut)),
                });
            }
            ResidualFrom::Dump(paths) => {
                let dump = Dump::open(paths)?;
                dump_residual(&dump, a, &reference.config, tokens)?
            }
            ResidualFrom::Candidate => bail!("--residual-from candidate: this run has no --candidate dump"),
        };
        Ok(Residuals {
            engine: Some(r.clone()),
            reference: Some(r),
            entry: None,
        })
    }
}

impl LayerRange {
    /// The reference's residual at A against a `--candidate` dump: the dump's own by default
    /// (`candidate`), the reference's, or another dump's; None when A = 0.
    pub fn candidate_residual(
        &self,
        dump: &Dump,
        reference: &Reference,
        tokens: &[u32],
    ) -> anyhow::Result<Option<Vec<f32>>> {
        match &self.from {
            ResidualFrom::Engine => {
                bail!("--residual-from engine: a --candidate run has no engine; give reference, candidate or a dump")
            }
            ResidualFrom::Candidate if self.layers.start > 0 => {
                Ok(Some(dump_residual(dump, self.layers.start, &reference.config, tokens)?))
            }
            _ => Ok(self
                .residuals(reference.file, reference, tokens, &EngineOptions::default())?
                .reference),
        }
    }
}

/// Where each side starts: the input of layer A (None: the embeddings).
#[derive(Default)]
pub struct Residuals {
    pub engine: Option<Vec<f32>>,
    pub reference: Option<Vec<f32>>,
    /// With `--residual-from engine`, the key the two sides' own residuals are compared under
    /// (`blk.{A-1}.resid_out`) before the range runs.
    pub entry: Option<TapKey>,
}

impl Residuals {
    /// Records one side's residual as the entry tap, where the run compares the sides' own.
    pub fn record_entry(&self, tap: &mut dyn Tap, residual: Option<&Vec<f32>>, n_tokens: usize) {
        if let (Some(key), Some(x)) = (&self.entry, residual) {
            if n_tokens > 0 && tap.wants(key) {
                tap.record(key, x, [n_tokens, x.len() / n_tokens]);
            }
        }
    }
}

/// `blk.{a-1}.resid_out` from a dump (unranked, else rank 0's replica), checked against the
/// run's tokens.
pub fn dump_residual(
    dump: &Dump,
    a: usize,
    config: &references::ModelConfig,
    tokens: &[u32],
) -> anyhow::Result<Vec<f32>> {
    let key = TapKey::layer(a - 1, Site::ResidOut);
    if dump.tokens != tokens {
        bail!(
            "--residual-from: the dump was run on {} tokens, this run has {}: the residual must come from the same tokens",
            dump.tokens.len(),
            tokens.len()
        );
    }
    let found = dump
        .keys()
        .find(|k| **k == key)
        .or_else(|| dump.keys().find(|k| k.unranked() == key))
        .copied()
        .with_context(|| format!("--residual-from: the dump has no {key} (the input of layer {a})"))?;
    let c = dump.tensor(&found, config)?;
    if c.shape != [tokens.len(), config.d_model] {
        bail!(
            "--residual-from: {found} is {:?}, not [{} tokens, d_model {}]",
            c.shape,
            tokens.len(),
            config.d_model
        );
    }
    Ok(c.data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_with_open_ends_and_bad_ones_say_why() {
        assert_eq!(parse_range("4..7", 30), Ok(4..7));
        assert_eq!(parse_range("20..", 30), Ok(20..30));
        assert_eq!(parse_range("..3", 30), Ok(0..3));
        for bad in ["7..4", "4..4", "0..31", "4", "a..5", "4..=6", "..0"] {
            let e = parse_range(bad, 30).unwrap_err();
            assert!(e.starts_with(&format!("--layers {bad}:")), "{e}");
        }
    }

    #[test]
    fn a_range_keeps_its_layers_and_the_head_only_at_the_end() {
        let r = LayerRange {
            layers: 4..7,
            total: 30,
            from: ResidualFrom::Reference,
        };
        assert!(r.keeps(&TapKey::layer(4, Site::Q)) && r.keeps(&TapKey::layer(6, Site::ResidOut)));
        assert!(!r.keeps(&TapKey::layer(3, Site::ResidOut)) && !r.keeps(&TapKey::layer(7, Site::Q)));
        assert!(!r.keeps(&TapKey::global(Site::Embed)) && !r.keeps(&TapKey::global(Site::Logits)));
        let tail = LayerRange { layers: 4..30, ..r };
        assert!(tail.keeps(&TapKey::global(Site::Logits)));
        assert_eq!(ResidualFrom::parse("engine"), Ok(ResidualFrom::Engine));
        assert_eq!(
            ResidualFrom::parse("a.safetensors,b.safetensors"),
            Ok(ResidualFrom::Dump(vec!["a.safetensors".into(), "b.safetensors".into()]))
        );
    }
}
