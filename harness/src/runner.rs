//! The forward pass every command runs: the slow reference or the engine on a backend, behind
//! one type ([`Runner`]), with a greedy continuation that decodes through the engine's KV cache.

use crate::logprobs::{log_softmax, top_k};
use anyhow::bail;
use engine::{BackendKind, Engine, EngineOptions};
use references::forward::Reference;
use references::tap::{NoTap, Tap};
use references::GgufFile;

/// A forward pass: the reference or the engine.
pub enum Runner<'a> {
    Reference(Box<Reference<'a>>),
    Engine(Box<Engine>),
}

impl<'a> Runner<'a> {
    /// The reference (`kind` is `None`: `opts.tp` must be 1 and no faults) or the engine on
    /// backend `kind` with `opts` (whose own `backend` field `kind` replaces).
    pub fn new(file: &'a GgufFile, kind: Option<BackendKind>, mut opts: EngineOptions) -> anyhow::Result<Runner<'a>> {
        let Some(kind) = kind else {
            if opts.tp != 1 {
                bail!("--tp applies to the engine backends (cpu, cuda), not the reference");
            }
            if !opts.faults.is_empty() {
                bail!("--inject needs an engine backend (cpu, cuda): the reference has no faults");
            }
            return Ok(Runner::Reference(Box::new(Reference::new(file)?)));
        };
        opts.backend = kind;
        Ok(Runner::Engine(Box::new(Engine::load(file, opts)?)))
    }

    pub fn backend_name(&self) -> &'static str {
        match self {
            Runner::Reference(_) => "reference",
            Runner::Engine(e) => e.backend_name(),
        }
    }

    /// Logits `[n, vocab]` for `tokens`, with taps.
    pub fn logits(&mut self, tokens: &[u32], tap: &mut dyn Tap) -> anyhow::Result<Vec<f32>> {
        Ok(match self {
            Runner::Reference(r) => r.forward(tokens, tap)?,
            Runner::Engine(e) => e.prefill(tokens, tap)?,
        })
    }

    /// Greedy continuation of up to `max_new` tokens, stopping after `stop`, and the logits rows
    /// of the decode steps (`[len − 1, vocab]`: one row after feeding each generated token but the
    /// last), so decode-only faults show in the KL statistics too. The engine decodes through its
    /// KV cache; the reference has none and re-runs the growing sequence each step.
    pub fn greedy(
        &mut self,
        prompt: &[u32],
        max_new: usize,
        stop: Option<u32>,
    ) -> anyhow::Result<(Vec<u32>, Vec<f32>)> {
        let mut out = Vec::new();
        let mut rows = Vec::new();
        if max_new == 0 {
            return Ok((out, rows));
        }
        let mut seq = prompt.to_vec();
        let mut logits = self.logits(prompt, &mut NoTap)?;
        loop {
            let v = logits.len() / if out.is_empty() { prompt.len() } else { 1 };
            let last = &logits[logits.len() - v..];
            let next = top_k(&log_softmax(last), 1)[0].0;
            out.push(next);
            seq.push(next);
            if out.len() == max_new || Some(next) == stop {
                break;
            }
            logits = match self {
                Runner::Engine(e) => e.decode(next, &mut NoTap)?,
                Runner::Reference(r) => {
                    let all = r.forward(&seq, &mut NoTap)?;
                    all[all.len() - r.config.vocab..].to_vec()
                }
            };
            rows.extend_from_slice(&logits);
        }
        Ok((out, rows))
    }
}
