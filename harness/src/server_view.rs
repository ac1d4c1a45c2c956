//! A completion's logprob entries read as token positions, shared by `entropy --server` and
//! `gate --server`: token strings to ids ([`TokenSpace`]), where the echoed prompt ends, which
//! alignment the server uses ([`Alignment`]), and the per-prompt top-k signals (entropy bracket,
//! top-1 logprob, top-5 ids) that feed the same verdict as the local entropy check.
//!
//! Alignment. OpenAI's echo semantics put at entry i the distribution that predicted token i.
//! llama-cpp-python (0.3.x) does so only when the prompt starts with BOS; without BOS (SmolLM2)
//! its entry i is the distribution *after* token i. The greedy continuation tells them apart: at
//! temperature 0 each generated token is the top-1 of the distribution that predicted it, so the
//! alignment under which more generated tokens are their entry's top-1 is taken (and reported).

use crate::entropy::{repetition, top5_recurrence, verdict};
use crate::server::Completion;
use crate::topk::entropy_bracket;
use anyhow::bail;
use references::tokenizer::Tokenizer;
use reports::{EntropyThresholds, PromptEntropy};
use std::collections::HashMap;

/// Token strings to ids: the model's own ids where a string names exactly one token, otherwise
/// (or without a model) an interned id above the vocabulary.
pub struct TokenSpace {
    /// Tokens that decode to valid UTF-8 on their own (`None`: more than one).
    by_str: HashMap<String, Option<u32>>,
    /// Tokens holding part of a UTF-8 sequence, by their text with the U+FFFD dropped.
    partial: HashMap<String, Option<u32>>,
    interned: HashMap<String, u32>,
    names: Vec<String>,
    base: u32,
}

/// Why a listed token text is left out of a top-k comparison.
pub const AMBIGUOUS_LISTED: &str = "a top-k key that is the text of a whole token and also of a token holding part of a UTF-8 sequence (servers decode with errors ignored) may carry either one's logprob (a JSON object keeps one per key): left out of the comparison on both sides";

/// Python's `decode("utf-8", errors="ignore")` drops what ours turns into U+FFFD.
fn norm(s: &str) -> String {
    s.replace('\u{fffd}', "")
}

impl TokenSpace {
    /// Every token of the model's tokenizer (none without one).
    pub fn new(tok: Option<&Tokenizer>, vocab: usize) -> TokenSpace {
        let texts = tok
            .into_iter()
            .flat_map(|t| (0..t.vocab_size() as u32).filter_map(move |id| t.decode(&[id]).ok().map(|s| (id, s))));
        TokenSpace::from_texts(texts, vocab)
    }

    /// Tokens given as (id, decoded text) pairs, e.g. a golden file's `token_text`.
    pub fn from_texts(texts: impl IntoIterator<Item = (u32, String)>, vocab: usize) -> TokenSpace {
        let mut by_str: HashMap<String, Option<u32>> = HashMap::new();
        let mut partial: HashMap<String, Option<u32>> = HashMap::new();
        for (id, s) in texts {
            let map = if s.contains('\u{fffd}') {
                &mut partial
            } else {
                &mut by_str
            };
            map.entry(norm(&s)).and_modify(|e| *e = None).or_insert(Some(id));
        }
        TokenSpace {
            by_str,
            partial,
            interned: HashMap::new(),
            names: Vec::new(),
            base: vocab as u32,
        }
    }

    /// The model's id of a token string, when unambiguous.
    pub fn model_id(&self, s: &str) -> Option<u32> {
        match self.by_str.get(s) {
            Some(id) => *id,
            None => self.partial.get(&norm(s)).copied().flatten(),
        }
    }

    /// The model's id of a text listed as a top-k key, when its logprob can be trusted to be that
    /// token's: `None` also where a partial-UTF-8 token reads the same with its U+FFFD dropped
    /// (llama-cpp-python's `" "` key held a byte token's −8.9 where the space token had −0.28).
    pub fn listed_id(&self, s: &str) -> Option<u32> {
        if self.by_str.get(s).is_some_and(|id| id.is_some()) && self.partial.contains_key(&norm(s)) {
            return None;
        }
        self.model_id(s)
    }

    /// The model ids of a server's first `k` top-k keys that [`TokenSpace::listed_id`] trusts,
    /// each once, in the server's order, with their logprobs.
    pub fn listed_set(&self, top: &[(String, f64)], k: usize) -> (Vec<u32>, Vec<f64>) {
        let (mut set, mut lps) = (Vec::new(), Vec::new());
        for (s, lp) in top.iter().take(k) {
            if let Some(id) = self.listed_id(s) {
                if !set.contains(&id) {
                    set.push(id);
                    lps.push(*lp);
                }
            }
        }
        (set, lps)
    }

    /// A model id, or an interned one.
    pub fn id(&mut self, s: &str) -> u32 {
        if let Some(id) = self.model_id(s) {
            return id;
        }
        if let Some(&id) = self.interned.get(s) {
            return id;
        }
        let id = self.base + self.names.len() as u32;
        self.names.push(s.to_string());
        self.interned.insert(s.to_string(), id);
        id
    }
}

/// How many entries belong to the echoed prompt of `prompt_chars` characters (the rest are the
/// continuation), from the entries' text offsets.
pub fn prompt_entries(c: &Completion, prompt_chars: usize) -> anyhow::Result<usize> {
    if c.entries.iter().all(|e| e.text_offset.is_some()) {
        return Ok(c
            .entries
            .iter()
            .take_while(|e| e.text_offset.is_some_and(|o| o < prompt_chars))
            .count());
    }
    bail!("the response's logprobs have no text_offset: cannot tell the echoed prompt from the continuation")
}

/// Which distribution a logprob entry holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alignment {
    /// Entry i is the distribution that predicted token i (OpenAI's echo semantics).
    OpenAi,
    /// Entry i is the distribution after token i (llama-cpp-python's echo without BOS).
    Shifted,
}

impl Alignment {
    /// The name reported in run documents.
    pub fn name(self) -> &'static str {
        match self {
            Alignment::OpenAi => "openai",
            Alignment::Shifted => "shifted",
        }
    }

    /// How many tokens of the echoed sequence the distribution at entry `i` has seen.
    pub fn context(self, i: usize) -> usize {
        match self {
            Alignment::OpenAi => i,
            Alignment::Shifted => i + 1,
        }
    }

    /// The alignment under which more generated tokens are their entry's top-1, over all
    /// completions (`n_prompt[j]`: completion j's prompt entries), with the two vote counts
    /// (openai, shifted). A tie is OpenAI's.
    pub fn detect(completions: &[Completion], n_prompt: &[usize]) -> (Alignment, usize, usize) {
        let (mut openai, mut shifted) = (0, 0);
        for (c, &np) in completions.iter().zip(n_prompt) {
            let top1 = |i: usize| {
                c.entries
                    .get(i)
                    .and_then(|e| e.top.as_ref())
                    .and_then(|t| t.first())
                    .map(|t| t.0.as_str())
            };
            for i in np..c.entries.len() {
                let tok = c.entries[i].token.as_str();
                if top1(i) == Some(tok) {
                    openai += 1;
                }
                if i > 0 && top1(i - 1) == Some(tok) {
                    shifted += 1;
                }
            }
        }
        let a = if shifted > openai {
            Alignment::Shifted
        } else {
            Alignment::OpenAi
        };
        (a, openai, shifted)
    }
}

/// The top-k signals of one prompt's positions (entries whose context lies within the prompt).
#[derive(Clone, Debug, Default)]
pub struct TopkSignals {
    /// Entropy lower and upper bounds and the residual mass, per position.
    pub lower: Vec<f64>,
    pub upper: Vec<f64>,
    pub residual: Vec<f64>,
    /// The top-1 logprob per position.
    pub top1: Vec<f64>,
    /// The top-5 ids per position (at most `k`).
    pub top5: Vec<Vec<u32>>,
}

/// The signals of the entries of `c` whose distribution has seen at most `n_prompt` tokens.
pub fn topk_signals(
    c: &Completion,
    n_prompt: usize,
    align: Alignment,
    k: usize,
    vocab: usize,
    space: &mut TokenSpace,
) -> TopkSignals {
    let mut s = TopkSignals::default();
    for (i, e) in c.entries.iter().enumerate() {
        let Some(top) = &e.top else { continue };
        if align.context(i) > n_prompt {
            continue;
        }
        let lps: Vec<f64> = top.iter().map(|t| t.1).collect();
        let b = entropy_bracket(&lps, k, vocab);
        s.lower.push(b.lower);
        s.upper.push(b.upper);
        s.residual.push(b.residual);
        s.top1.push(lps.first().copied().unwrap_or(f64::NAN));
        s.top5.push(top.iter().take(5.min(k)).map(|t| space.id(&t.0)).collect());
    }
    s
}

/// A prompt's entropy record from its top-k signals and greedy continuation, with its verdict
/// (the local check's thresholds and rules). `kld` and `overlap` are left for the caller.
pub fn prompt_entropy(
    label: &str,
    n_tokens: usize,
    s: &TopkSignals,
    continuation: Vec<u32>,
    continuation_text: Option<String>,
    vocab: usize,
    thresholds: &EntropyThresholds,
) -> PromptEntropy {
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (recurrence, recurring) = top5_recurrence(&s.top5);
    let mean_entropy = mean(&s.lower);
    let mut pe = PromptEntropy {
        label: label.to_string(),
        n_tokens,
        verdict: String::new(),
        reasons: Vec::new(),
        mean_entropy,
        min_entropy: s.lower.iter().copied().fold(f64::INFINITY, f64::min),
        norm_entropy: mean_entropy / (vocab as f64).ln(),
        mean_top1_logprob: mean(&s.top1),
        top5_recurrence: recurrence,
        recurring_top5: recurring,
        repetition: repetition(&continuation),
        continuation,
        continuation_text,
        nonfinite: s.top1.iter().filter(|x| x.is_nan() || **x == f64::INFINITY).count() as u64,
        kld: None,
        entropy_upper: Some(mean(&s.upper)),
        topk_residual: Some(mean(&s.residual)),
        overlap: None,
        // Per-position lower bounds (the server gives top-k only).
        entropies: s.lower.clone(),
        reference_entropies: Vec::new(),
        kld_positions: Vec::new(),
    };
    let (v, reasons) = verdict(&pe, thresholds);
    pe.verdict = v;
    pe.reasons = reasons;
    pe
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_key_shared_with_a_partial_token_is_left_out() {
        let s = TokenSpace::from_texts(
            [(1, " ".to_string()), (2, " \u{fffd}".to_string()), (3, "a".to_string())],
            10,
        );
        // The echoed token is the space token; as a top-k key its logprob may be the byte token's.
        assert_eq!(s.model_id(" "), Some(1));
        assert_eq!(s.listed_id(" "), None);
        assert_eq!(s.listed_id("a"), Some(3));
    }
}
