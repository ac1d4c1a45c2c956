//! The tokenizer that a GGUF file describes in its `tokenizer.ggml.*` metadata, built to give the
//! same ids as llama.cpp's `llama_tokenize(text, add_special = false, parse_special)`.
//!
//! Two model kinds are supported:
//! - `gpt2`: byte-level BPE. The pieces come from HF's `tokenizers` crate: a [`BPE`] model built
//!   from `tokens` + `merges`, behind a pre-tokenizer sequence of the regex splits that llama.cpp
//!   uses for the file's `pre` value (llama-vocab.cpp, `llm_tokenizer_bpe`), then `ByteLevel`.
//! - `llama`: SentencePiece as llama.cpp runs it: spaces escaped to `▁`, a space prefix at the start
//!   and after every special token, then greedy merging of the adjacent pair whose concatenation is
//!   the highest-scoring token (ties: leftmost), with `<0xNN>` byte tokens for what no token covers.
//!   This is llama.cpp's own algorithm (not the `tokenizers` Unigram model, whose Viterbi search
//!   gives different ids), so it is written out here.
//!
//! Special tokens are split out before the model runs, exactly as llama.cpp's
//! `tokenizer_st_partition` does: control (3), user-defined (4) and unknown (2) tokens, longest text
//! first, each splitting every text fragment left so far. With `parse_special = false` only
//! user-defined tokens are split out. Per-model `lstrip`/`rstrip` attributes that llama.cpp sets by
//! model name (phi-3, jina, modern-bert) are not applied.
//!
//! The GGUF is hostile input: every key is checked for presence, type, length and id range, and a
//! bad one gives a one-line [`TokenizerError`] naming it, never a panic.

use crate::gguf::{value_type, GgufHeader, MetaValue};
use std::collections::{BinaryHeap, HashMap};
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

/// Metadata keys read here.
pub mod keys {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const SCORES: &str = "tokenizer.ggml.scores";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS_ID: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS_ID: &str = "tokenizer.ggml.eos_token_id";
    pub const UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
    pub const PAD_ID: &str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
}

/// Why a tokenizer could not be built or run. One line; a metadata error names its key.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("{key}: {msg}")]
    Meta { key: &'static str, msg: String },
    #[error("token id {id} is out of range (vocabulary of {n_vocab})")]
    IdOutOfRange { id: u32, n_vocab: usize },
    #[error("SPM byte fallback: the vocabulary has no token for byte 0x{0:02X}")]
    NoByteToken(u8),
    #[error("tokenizers: {0}")]
    Backend(String),
}

fn meta(key: &'static str, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Meta { key, msg: msg.into() }
}

/// `tokenizer.ggml.token_type` values, as llama.cpp numbers them. Unknown numbers read as
/// [`TokenType::Undefined`], as in llama.cpp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub fn from_gguf(v: i64) -> TokenType {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Split out of the text before the model runs (llama.cpp's special-token cache).
    fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
    }
}

/// The pre-tokenizer regexes of llama.cpp (src/llama-vocab.cpp), applied in order; each one splits
/// every piece left by the previous one, and text that no match covers stays a piece of its own.
pub mod regexes {
    pub const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    pub const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    pub const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    pub const DIGIT: &str = r"\p{N}";
}

/// The llama.cpp pre-tokenizer for a `tokenizer.ggml.pre` value: its regex list and whether it
/// skips merging a word that is already a token (`ignore_merges`) and adds BOS by default.
struct PreSpec {
    regexes: Vec<&'static str>,
    ignore_merges: bool,
    add_bos_default: bool,
}

fn pre_spec(pre: &str) -> Option<PreSpec> {
    use regexes::*;
    let spec = |regexes: Vec<&'static str>| PreSpec {
        regexes,
        ignore_merges: false,
        add_bos_default: false,
    };
    Some(match pre {
        "default" => spec(vec![r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2" => PreSpec {
            regexes: vec![LLAMA3],
            ignore_merges: true,
            add_bos_default: true,
        },
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
            spec(vec![DIGIT, GPT2])
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0" | "mellum"
        | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4" => spec(vec![GPT2]),
        "qwen2" | "deepseek-r1-qwen" | "kormo" | "stablelm2" | "megrez" | "hunyuan" => spec(vec![QWEN2]),
        "falcon" => spec(vec![r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"]),
        _ => return None,
    })
}

/// How the text between special tokens becomes ids.
enum Model {
    /// Byte-level BPE through the `tokenizers` crate (boxed: it is large).
    Bpe(Box<tokenizers::Tokenizer>),
    /// An HF checkpoint's own `tokenizer.json`, run whole by the `tokenizers` crate as
    /// transformers runs it (added and special tokens split out by the tokenizer itself).
    Hf(Box<tokenizers::Tokenizer>),
    /// llama.cpp's SentencePiece merge-by-score.
    Spm {
        scores: Vec<f32>,
        add_space_prefix: bool,
        byte_ids: Vec<Option<u32>>,
    },
}

/// A tokenizer built from GGUF metadata.
pub struct Tokenizer {
    model: Model,
    kind: String,
    pre: Option<String>,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_to_id: HashMap<String, u32>,
    /// Special tokens in llama.cpp's partition order: longest text first, then lowest id.
    special_order: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.kind)
            .field("pre", &self.pre)
            .field("n_vocab", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .finish_non_exhaustive()
    }
}

/// A piece of the text during special-token partitioning.
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

impl Tokenizer {
    /// The model's tokenizer: an HF folder's `tokenizer.json`, else the GGUF metadata.
    pub fn for_model(file: &crate::GgufFile) -> Result<Tokenizer, TokenizerError> {
        match &file.source {
            crate::ModelSource::HfFolder {
                tokenizer_json: Some(p),
            } => Tokenizer::from_hf_json(p),
            crate::ModelSource::HfFolder { tokenizer_json: None } => Err(TokenizerError::Backend(format!(
                "{}: the folder has no tokenizer.json (give --tokens)",
                file.path.display()
            ))),
            crate::ModelSource::Gguf => Tokenizer::from_gguf(&file.header),
        }
    }

    /// Builds the tokenizer from an HF `tokenizer.json` (and, beside it, `tokenizer_config.json`'s
    /// `add_bos_token`): ids as transformers gives them with `add_special_tokens=False`. Added
    /// tokens are control tokens when special, user-defined otherwise; ids the vocabulary skips
    /// read as `[PADi]` (as convert_hf_to_gguf.py names them).
    pub fn from_hf_json(path: &std::path::Path) -> Result<Tokenizer, TokenizerError> {
        let bad = |e: String| TokenizerError::Backend(format!("{}: {e}", path.display()));
        let len = std::fs::metadata(path).map_err(|e| bad(e.to_string()))?.len();
        if len > 1 << 30 {
            return Err(bad(format!("{len} bytes: too large for a tokenizer")));
        }
        let tok = tokenizers::Tokenizer::from_file(path).map_err(|e| bad(e.to_string()))?;
        let vocab = tok.get_vocab(true);
        let n_vocab = vocab.values().map(|&i| i as usize + 1).max().unwrap_or(0);
        if n_vocab == 0 || n_vocab > 1 << 24 {
            return Err(bad(format!("a vocabulary of {n_vocab} ids")));
        }
        let mut tokens: Vec<String> = (0..n_vocab).map(|i| format!("[PAD{i}]")).collect();
        let mut types = vec![TokenType::Unused; n_vocab];
        for (t, &i) in &vocab {
            tokens[i as usize] = t.clone();
            types[i as usize] = TokenType::Normal;
        }
        for (&i, added) in tok.get_added_tokens_decoder().iter() {
            if let Some(ty) = types.get_mut(i as usize) {
                *ty = if added.special {
                    TokenType::Control
                } else {
                    TokenType::UserDefined
                };
            }
        }
        let token_to_id: HashMap<String, u32> = vocab.into_iter().collect();
        let cfg: Option<serde_json::Value> = path
            .parent()
            .map(|d| d.join("tokenizer_config.json"))
            .and_then(|p| std::fs::read_to_string(p).ok())
            .and_then(|t| serde_json::from_str(&t).ok());
        let named = |k: &str| -> Option<u32> {
            let v = cfg.as_ref()?.get(k)?;
            let text = v.as_str().or_else(|| v.get("content")?.as_str())?;
            token_to_id.get(text).copied()
        };
        let add_bos = cfg
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(|v| v.as_bool())
            .unwrap_or(false);
        Ok(Tokenizer {
            model: Model::Hf(Box::new(tok)),
            kind: "hf".into(),
            pre: None,
            tokens,
            types,
            special_order: Vec::new(),
            bos: named("bos_token"),
            eos: named("eos_token"),
            unk: named("unk_token"),
            pad: named("pad_token"),
            token_to_id,
            add_bos,
        })
    }

    /// Builds the tokenizer from a GGUF header's `tokenizer.ggml.*` keys.
    pub fn from_gguf(header: &GgufHeader) -> Result<Tokenizer, TokenizerError> {
        let kind = get_str(header, keys::MODEL)?
            .ok_or_else(|| meta(keys::MODEL, "missing"))?
            .to_string();
        let tokens = get_str_array(header, keys::TOKENS)?.ok_or_else(|| meta(keys::TOKENS, "missing"))?;
        let n_vocab = tokens.len();
        if n_vocab == 0 {
            return Err(meta(keys::TOKENS, "empty vocabulary"));
        }
        if n_vocab > u32::MAX as usize {
            return Err(meta(keys::TOKENS, format!("{n_vocab} tokens do not fit token ids")));
        }
        // llama.cpp renames empty tokens so that every text is a key.
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    format!("[EMPTY_{i}]")
                } else {
                    t.to_string()
                }
            })
            .collect();
        let mut token_to_id = HashMap::with_capacity(n_vocab);
        for (i, t) in tokens.iter().enumerate() {
            if let Some(prev) = token_to_id.insert(t.clone(), i as u32) {
                return Err(meta(keys::TOKENS, format!("token {i} {t:?} duplicates token {prev}")));
            }
        }
        let types = match header.get(keys::TOKEN_TYPE) {
            None => vec![TokenType::Normal; n_vocab],
            Some(v) => {
                let items = int_array(v).ok_or_else(|| meta(keys::TOKEN_TYPE, "expected an array of integers"))?;
                if items.len() != n_vocab {
                    return Err(meta(
                        keys::TOKEN_TYPE,
                        format!("has {} entries for {n_vocab} tokens", items.len()),
                    ));
                }
                items.into_iter().map(TokenType::from_gguf).collect()
            }
        };
        let id = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match header.get(key) {
                None => Ok(None),
                Some(v) => {
                    let id = v.as_u64().filter(|_| !matches!(v, MetaValue::Bool(_)));
                    let id = id.ok_or_else(|| meta(key, format!("expected a token id, got {v}")))?;
                    if id >= n_vocab as u64 {
                        return Err(meta(key, format!("id {id} is out of range ({n_vocab} tokens)")));
                    }
                    Ok(Some(id as u32))
                }
            }
        };
        let (bos, eos, unk, pad) = (
            id(keys::BOS_ID)?,
            id(keys::EOS_ID)?,
            id(keys::UNK_ID)?,
            id(keys::PAD_ID)?,
        );
        let pre = get_str(header, keys::PRE)?.map(str::to_string);

        let (model, add_bos_default) = match kind.as_str() {
            "gpt2" => {
                let pre_name = pre.as_deref().unwrap_or("default");
                let spec = pre_spec(pre_name).ok_or_else(|| {
                    meta(
                        keys::PRE,
                        format!("unsupported pre-tokenizer {pre_name:?} for a gpt2 vocabulary"),
                    )
                })?;
                let merges = get_str_array(header, keys::MERGES)?
                    .ok_or_else(|| meta(keys::MERGES, "missing (gpt2 needs it)"))?;
                let bpe = build_bpe(&tokens, &token_to_id, &merges, &spec)?;
                (Model::Bpe(Box::new(bpe)), spec.add_bos_default)
            }
            "llama" => {
                let scores = match header.get(keys::SCORES) {
                    None => vec![0.0; n_vocab],
                    Some(v) => {
                        let s = float_array(v).ok_or_else(|| meta(keys::SCORES, "expected an array of f32 or i32"))?;
                        if s.len() != n_vocab {
                            return Err(meta(
                                keys::SCORES,
                                format!("has {} entries for {n_vocab} tokens", s.len()),
                            ));
                        }
                        s
                    }
                };
                let add_space_prefix = get_bool(header, keys::ADD_SPACE_PREFIX)?.unwrap_or(true);
                let mut byte_ids = vec![None; 256];
                for (b, slot) in byte_ids.iter_mut().enumerate() {
                    let hex = format!("<0x{b:02X}>");
                    *slot = token_to_id.get(&hex).copied().or_else(|| {
                        // llama.cpp falls back to the byte itself as a one-byte string.
                        std::str::from_utf8(&[b as u8])
                            .ok()
                            .and_then(|s| token_to_id.get(s).copied())
                    });
                }
                (
                    Model::Spm {
                        scores,
                        add_space_prefix,
                        byte_ids,
                    },
                    true,
                )
            }
            other => {
                return Err(meta(
                    keys::MODEL,
                    format!("unsupported tokenizer model {other:?} (gpt2 and llama are)"),
                ));
            }
        };
        let add_bos = get_bool(header, keys::ADD_BOS)?.unwrap_or(add_bos_default);
        if add_bos && bos.is_none() {
            return Err(meta(keys::BOS_ID, "missing, but add_bos_token is true"));
        }

        let mut special_order: Vec<u32> = (0..n_vocab as u32)
            .filter(|&i| types[i as usize].is_special())
            .collect();
        special_order.sort_by(|&a, &b| tokens[b as usize].len().cmp(&tokens[a as usize].len()).then(a.cmp(&b)));

        Ok(Tokenizer {
            model,
            kind,
            pre,
            tokens,
            types,
            token_to_id,
            special_order,
            bos,
            eos,
            unk,
            pad,
            add_bos,
        })
    }

    /// Token ids for `text`, without BOS: llama.cpp's `tokenize(text, add_special = false,
    /// parse_special)`. With `parse_special`, control tokens written in the text (such as
    /// `<|im_start|>`) become their ids; user-defined tokens always do.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        if let Model::Hf(tok) = &self.model {
            let enc = if parse_special {
                tok.encode_fast(text, false)
            } else {
                // Special tokens written in the text stay text (transformers' split_special_tokens).
                let mut t = tok.as_ref().clone();
                t.set_encode_special_tokens(true);
                t.encode_fast(text, false)
            };
            return Ok(enc
                .map_err(|e| TokenizerError::Backend(e.to_string()))?
                .get_ids()
                .to_vec());
        }
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::new();
        let mut prev_special = true;
        for f in fragments {
            match f {
                Fragment::Token(id) => {
                    out.push(id);
                    prev_special = true;
                }
                Fragment::Text(s, e) => {
                    let piece = &text[s..e];
                    match &self.model {
                        Model::Bpe(bpe) | Model::Hf(bpe) => {
                            let enc = bpe
                                .encode_fast(piece, false)
                                .map_err(|e| TokenizerError::Backend(e.to_string()))?;
                            out.extend_from_slice(enc.get_ids());
                        }
                        Model::Spm {
                            scores,
                            add_space_prefix,
                            byte_ids,
                        } => {
                            let mut t = String::with_capacity(piece.len() + 3);
                            if *add_space_prefix && prev_special {
                                t.push(' ');
                            }
                            t.push_str(piece);
                            let t = t.replace(' ', "\u{2581}");
                            self.spm_tokenize(&t, scores, byte_ids, &mut out)?;
                        }
                    }
                    prev_special = false;
                }
            }
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let mut frags = if text.is_empty() {
            vec![]
        } else {
            vec![Fragment::Text(0, text.len())]
        };
        for &id in &self.special_order {
            let ty = self.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(s, e) if text[*s..*e].contains(needle)))
            {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Token(_) => next.push(f),
                    Fragment::Text(mut s, e) => {
                        while let Some(at) = text[s..e].find(needle) {
                            if at > 0 {
                                next.push(Fragment::Text(s, s + at));
                            }
                            next.push(Fragment::Token(id));
                            s += at + needle.len();
                        }
                        if s < e {
                            next.push(Fragment::Text(s, e));
                        }
                    }
                }
            }
            frags = next;
        }
        frags
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` on whitespace-escaped text.
    fn spm_tokenize(
        &self,
        text: &str,
        scores: &[f32],
        byte_ids: &[Option<u32>],
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        // Symbols: byte ranges of the text, linked as a list; a merged-away symbol has len 0.
        struct Sym {
            start: usize,
            len: usize,
            prev: Option<usize>,
            next: Option<usize>,
        }
        let mut syms: Vec<Sym> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            syms.push(Sym {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
            if i > 0 {
                syms[i - 1].next = Some(i);
            }
        }
        if syms.is_empty() {
            return Ok(());
        }
        // Max-heap on score, ties to the leftmost pair.
        #[derive(PartialEq)]
        struct Bigram {
            score: f32,
            left: usize,
            right: usize,
            size: usize,
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(o))
            }
        }
        impl Ord for Bigram {
            fn cmp(&self, o: &Self) -> std::cmp::Ordering {
                self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
            }
        }
        let mut heap = BinaryHeap::new();
        let try_add = |l: Option<usize>, r: Option<usize>, syms: &[Sym], heap: &mut BinaryHeap<Bigram>| {
            let (Some(l), Some(r)) = (l, r) else { return };
            let s = syms[l].start;
            let piece = &text[s..s + syms[l].len + syms[r].len];
            if let Some(&id) = self.token_to_id.get(piece) {
                heap.push(Bigram {
                    score: scores[id as usize],
                    left: l,
                    right: r,
                    size: piece.len(),
                });
            }
        };
        for i in 1..syms.len() {
            try_add(Some(i - 1), Some(i), &syms, &mut heap);
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (b.left, b.right);
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
                continue;
            }
            syms[l].len += syms[r].len;
            syms[r].len = 0;
            syms[l].next = syms[r].next;
            if let Some(n) = syms[r].next {
                syms[n].prev = Some(l);
            }
            try_add(syms[l].prev, Some(l), &syms, &mut heap);
            try_add(Some(l), syms[l].next, &syms, &mut heap);
        }
        // Every merge made a token, so a final symbol that is not a token is a single character
        // outside the vocabulary: it goes out as byte tokens (llama.cpp's `resegment`).
        let mut i = Some(0);
        while let Some(idx) = i {
            let (s, n) = (syms[idx].start, syms[idx].len);
            let piece = &text[s..s + n];
            match self.token_to_id.get(piece) {
                Some(&id) => out.push(id),
                None => self.push_bytes(piece, byte_ids, out)?,
            }
            i = syms[idx].next;
        }
        Ok(())
    }

    fn push_bytes(&self, piece: &str, byte_ids: &[Option<u32>], out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        for &b in piece.as_bytes() {
            out.push(byte_ids[b as usize].ok_or(TokenizerError::NoByteToken(b))?);
        }
        Ok(())
    }

    /// The text of `ids` as bytes: special tokens as written, byte-level and `<0xNN>` tokens as their
    /// bytes (llama.cpp's `detokenize` with `unparse_special = true`). For SPM with a space prefix,
    /// the one leading space that encoding added is removed.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>, TokenizerError> {
        if let Model::Hf(tok) = &self.model {
            for &id in ids {
                self.token_str(id)?;
            }
            let text = tok
                .decode(ids, false)
                .map_err(|e| TokenizerError::Backend(e.to_string()))?;
            return Ok(text.into_bytes());
        }
        let mut out = Vec::new();
        for &id in ids {
            let i = id as usize;
            let text = self.token_str(id)?;
            match (&self.model, self.types[i]) {
                (_, TokenType::Control | TokenType::UserDefined | TokenType::Unknown) => {
                    out.extend_from_slice(text.as_bytes())
                }
                (Model::Bpe(_) | Model::Hf(_), _) => {
                    for c in text.chars() {
                        match unicode_to_byte(c) {
                            Some(b) => out.push(b),
                            None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                }
                (Model::Spm { .. }, ty) => match parse_byte_token(text) {
                    Some(b) if ty == TokenType::Byte => out.push(b),
                    _ => out.extend_from_slice(text.replace('\u{2581}', " ").as_bytes()),
                },
            }
        }
        if let Model::Spm {
            add_space_prefix: true, ..
        } = self.model
        {
            if out.first() == Some(&b' ') {
                out.remove(0);
            }
        }
        Ok(out)
    }

    /// [`Tokenizer::decode_bytes`] as a string; bytes that are not UTF-8 (a token sequence cut inside
    /// a character) become U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }

    /// The vocabulary text of one token, as stored in the GGUF.
    pub fn token_str(&self, id: u32) -> Result<&str, TokenizerError> {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .ok_or(TokenizerError::IdOutOfRange {
                id,
                n_vocab: self.tokens.len(),
            })
    }

    /// The id of a token text, if it is in the vocabulary.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether a prompt should start with BOS (`tokenizer.ggml.add_bos_token`, else llama.cpp's
    /// default for the model and pre-tokenizer).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// `tokenizer.ggml.model`: "gpt2" or "llama".
    pub fn model_kind(&self) -> &str {
        &self.kind
    }

    /// `tokenizer.ggml.pre`, if the file has it.
    pub fn pre(&self) -> Option<&str> {
        self.pre.as_deref()
    }
}

fn build_bpe(
    tokens: &[String],
    token_to_id: &HashMap<String, u32>,
    merges: &[&str],
    spec: &PreSpec,
) -> Result<tokenizers::Tokenizer, TokenizerError> {
    let mut pairs = Vec::with_capacity(merges.len());
    for (i, m) in merges.iter().enumerate() {
        // llama.cpp splits at the first space after the first byte.
        let at = m.as_bytes().iter().skip(1).position(|&c| c == b' ').map(|p| p + 1);
        let Some(at) = at else {
            return Err(meta(
                keys::MERGES,
                format!("merge {i} {m:?} is not two tokens separated by a space"),
            ));
        };
        let (a, b) = (&m[..at], &m[at + 1..]);
        for part in [a, b, m.replacen(' ', "", 1).as_str()] {
            if !token_to_id.contains_key(part) {
                return Err(meta(
                    keys::MERGES,
                    format!("merge {i} {m:?}: {part:?} is not in the vocabulary"),
                ));
            }
        }
        pairs.push((a.to_string(), b.to_string()));
    }
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, pairs)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| meta(keys::MERGES, e.to_string()))?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    for r in &spec.regexes {
        let split = Split::new(
            SplitPattern::Regex(r.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Backend(format!("pre-tokenizer regex {r:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tk)
}

/// GPT-2's byte-to-character table inverted: printable Latin-1 bytes stand for themselves, the
/// other 68 bytes for U+0100 onwards, in byte order.
fn unicode_to_byte(c: char) -> Option<u8> {
    let cp = c as u32;
    let direct = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    if cp < 0x100 {
        return direct(cp).then_some(cp as u8);
    }
    let n = cp.checked_sub(0x100)?;
    (0u32..256).filter(|&b| !direct(b)).nth(n as usize).map(|b| b as u8)
}

/// `<0xNN>` → the byte.
fn parse_byte_token(t: &str) -> Option<u8> {
    let hex = t.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn get_str<'h>(h: &'h GgufHeader, key: &'static str) -> Result<Option<&'h str>, TokenizerError> {
    match h.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .map(Some)
            .ok_or_else(|| meta(key, format!("expected a string, got {}", type_name(v)))),
    }
}

fn get_bool(h: &GgufHeader, key: &'static str) -> Result<Option<bool>, TokenizerError> {
    match h.get(key) {
        None => Ok(None),
        Some(MetaValue::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(meta(key, format!("expected a bool, got {}", type_name(v)))),
    }
}

fn get_str_array<'h>(h: &'h GgufHeader, key: &'static str) -> Result<Option<Vec<&'h str>>, TokenizerError> {
    let Some(v) = h.get(key) else { return Ok(None) };
    let items = v
        .as_array()
        .ok_or_else(|| meta(key, format!("expected an array of strings, got {}", type_name(v))))?;
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            s.as_str()
                .ok_or_else(|| meta(key, format!("item {i} is a {}, not a string", type_name(s))))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

fn int_array(v: &MetaValue) -> Option<Vec<i64>> {
    v.as_array()?
        .iter()
        .map(|x| {
            if matches!(x, MetaValue::Bool(_)) {
                None
            } else {
                x.as_i64()
            }
        })
        .collect()
}

fn float_array(v: &MetaValue) -> Option<Vec<f32>> {
    v.as_array()?
        .iter()
        .map(|x| match x {
            MetaValue::F32(f) => Some(*f),
            MetaValue::I32(i) => Some(*i as f32),
            _ => None,
        })
        .collect()
}

fn type_name(v: &MetaValue) -> &'static str {
    match v.type_id() {
        value_type::U8 => "u8",
        value_type::I8 => "i8",
        value_type::U16 => "u16",
        value_type::I16 => "i16",
        value_type::U32 => "u32",
        value_type::I32 => "i32",
        value_type::F32 => "f32",
        value_type::BOOL => "bool",
        value_type::STRING => "string",
        value_type::ARRAY => "array",
        value_type::U64 => "u64",
        value_type::I64 => "i64",
        _ => "f64",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::writer::{meta_bool, meta_i32_array, meta_str, meta_str_array, meta_u32};

    fn header(metadata: Vec<(String, MetaValue)>) -> GgufHeader {
        GgufHeader {
            version: 3,
            metadata,
            tensors: vec![],
            alignment: 32,
            data_offset: 0,
            allow_unknown: vec![],
        }
    }

    /// GPT-2's byte → character table.
    fn byte_char(b: u8) -> char {
        let direct = |b: u32| (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        if direct(b as u32) {
            return b as char;
        }
        let n = (0u32..b as u32).filter(|&x| !direct(x)).count() as u32;
        char::from_u32(0x100 + n).unwrap()
    }

    /// A byte-level BPE vocabulary: the 256 byte characters (id = byte), then merged tokens, then
    /// two control tokens and one user-defined token.
    fn bpe_meta(pre: &str) -> Vec<(String, MetaValue)> {
        let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
        let merges = [
            "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "1 2",
        ];
        for m in merges {
            tokens.push(m.replace(' ', ""));
        }
        tokens.extend(["<|start|>", "<|end|>", "<tool>"].map(String::from));
        let mut types = vec![1; tokens.len()];
        let n = types.len();
        types[n - 3] = 3;
        types[n - 2] = 3;
        types[n - 1] = 4;
        let merges: Vec<String> = merges.iter().map(|s| s.to_string()).collect();
        vec![
            meta_str(keys::MODEL, "gpt2"),
            meta_str(keys::PRE, pre),
            meta_str_array(keys::TOKENS, &tokens),
            meta_i32_array(keys::TOKEN_TYPE, &types),
            meta_str_array(keys::MERGES, &merges),
            meta_u32(keys::BOS_ID, (n - 3) as u32),
            meta_u32(keys::EOS_ID, (n - 2) as u32),
        ]
    }

    fn bpe(pre: &str) -> Tokenizer {
        Tokenizer::from_gguf(&header(bpe_meta(pre))).unwrap()
    }

    fn ids(tk: &Tokenizer, texts: &[&str]) -> Vec<u32> {
        texts
            .iter()
            .map(|t| tk.token_id(t).unwrap_or_else(|| panic!("{t:?}")))
            .collect()
    }

    #[test]
    fn bpe_merges_by_rank_and_splits_words() {
        let tk = bpe("gpt-2");
        assert_eq!(tk.vocab_size(), 256 + 10 + 3);
        assert!(!tk.add_bos());
        assert_eq!(tk.encode("hello world", false).unwrap(), ids(&tk, &["hello", "Ġworld"]));
        // "hellohello" is one pre-token: merges still find both words.
        assert_eq!(tk.encode("hellohello", false).unwrap(), ids(&tk, &["hello", "hello"]));
        // Bytes with no merge stay byte tokens, id = byte.
        assert_eq!(tk.encode("é!", false).unwrap(), vec![0xC3, 0xA9, b'!' as u32]);
    }

    #[test]
    fn smollm_pre_splits_digits_one_by_one() {
        let gpt2 = bpe("gpt-2");
        let smollm = bpe("smollm");
        assert_eq!(gpt2.encode("12", false).unwrap(), ids(&gpt2, &["12"]));
        assert_eq!(smollm.encode("12", false).unwrap(), vec![b'1' as u32, b'2' as u32]);
        // The digit split comes first, so a space before a digit stays its own piece.
        assert_eq!(
            smollm.encode(" 1", false).unwrap(),
            vec![gpt_space(&smollm), b'1' as u32]
        );
    }

    fn gpt_space(tk: &Tokenizer) -> u32 {
        tk.token_id("Ġ").unwrap()
    }

    #[test]
    fn special_tokens_split_only_when_asked() {
        let tk = bpe("smollm");
        let (start, end, tool) = (266, 267, 268);
        assert_eq!(tk.token_str(start).unwrap(), "<|start|>");
        let got = tk.encode("<|start|>hello<|end|>", true).unwrap();
        assert_eq!(got, [vec![start], ids(&tk, &["hello"]), vec![end]].concat());
        let plain = tk.encode("<|start|>hello", false).unwrap();
        assert!(!plain.contains(&start));
        assert_eq!(tk.decode(&plain).unwrap(), "<|start|>hello");
        // User-defined tokens are split out even without special parsing.
        assert_eq!(tk.encode("<tool>", false).unwrap(), vec![tool]);
        assert_eq!(tk.decode(&got).unwrap(), "<|start|>hello<|end|>");
    }

    #[test]
    fn llama3_pre_ignores_merges_and_adds_bos() {
        let tk = bpe("llama-bpe");
        assert!(tk.add_bos());
        assert_eq!(tk.encode("hello", false).unwrap(), ids(&tk, &["hello"]));
        // \p{N}{1,3}: "12" stays together, and merges to "12".
        assert_eq!(tk.encode("12", false).unwrap(), ids(&tk, &["12"]));
        let mut m = bpe_meta("default");
        m.push(meta_bool(keys::ADD_BOS, true));
        assert!(Tokenizer::from_gguf(&header(m)).unwrap().add_bos());
    }

    fn spm_meta() -> Vec<(String, MetaValue)> {
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
        let mut types = vec![2, 3, 3];
        let mut scores = vec![0.0f32; 3];
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(6);
            scores.push(0.0);
        }
        for (t, s) in [
            ("▁", -1.0),
            ("h", -2.0),
            ("e", -2.0),
            ("l", -2.0),
            ("o", -2.0),
            ("he", -3.0),
            ("ll", -3.5),
        ]
        .into_iter()
        .chain([("llo", -4.0), ("hello", -5.0), ("▁hello", -5.5), ("▁h", -6.0)])
        {
            tokens.push(t.into());
            types.push(1);
            scores.push(s);
        }
        vec![
            meta_str(keys::MODEL, "llama"),
            meta_str_array(keys::TOKENS, &tokens),
            meta_i32_array(keys::TOKEN_TYPE, &types),
            (
                keys::SCORES.into(),
                MetaValue::Array {
                    elem_type: value_type::F32,
                    items: scores.into_iter().map(MetaValue::F32).collect(),
                },
            ),
            meta_u32(keys::BOS_ID, 1),
            meta_u32(keys::EOS_ID, 2),
            meta_u32(keys::UNK_ID, 0),
        ]
    }

    #[test]
    fn spm_merges_by_score_with_space_prefix_and_byte_fallback() {
        let tk = Tokenizer::from_gguf(&header(spm_meta())).unwrap();
        assert!(tk.add_bos());
        assert_eq!(tk.bos_id(), Some(1));
        assert_eq!(tk.encode("hello", false).unwrap(), ids(&tk, &["▁hello"]));
        // 'i' is not a token: it goes out as its byte.
        assert_eq!(
            tk.encode("hi", false).unwrap(),
            [ids(&tk, &["▁h"]), vec![3 + b'i' as u32]].concat()
        );
        // After a special token the space prefix is added again.
        let got = tk.encode("<s>hello</s>hello", true).unwrap();
        assert_eq!(
            got,
            [vec![1], ids(&tk, &["▁hello"]), vec![2], ids(&tk, &["▁hello"])].concat()
        );
        assert_eq!(tk.decode(&tk.encode("hi hello", false).unwrap()).unwrap(), "hi hello");
        assert_eq!(tk.decode(&tk.encode("日本", false).unwrap()).unwrap(), "日本");
        let mut m = spm_meta();
        m.push(meta_bool(keys::ADD_SPACE_PREFIX, false));
        let tk = Tokenizer::from_gguf(&header(m)).unwrap();
        assert_eq!(tk.encode("hello", false).unwrap(), ids(&tk, &["hello"]));
    }

    /// Replaces (or, with `None`, removes) one key.
    fn with(mut m: Vec<(String, MetaValue)>, key: &str, v: Option<MetaValue>) -> Vec<(String, MetaValue)> {
        m.retain(|(k, _)| k != key);
        if let Some(v) = v {
            m.push((key.into(), v));
        }
        m
    }

    fn err(m: Vec<(String, MetaValue)>) -> String {
        let e = Tokenizer::from_gguf(&header(m)).expect_err("hostile metadata accepted");
        let s = e.to_string();
        assert!(!s.contains('\n'), "{s}");
        s
    }

    fn strs(v: &[&str]) -> MetaValue {
        meta_str_array("", &v.iter().map(|s| s.to_string()).collect::<Vec<_>>()).1
    }

    #[test]
    fn hostile_metadata_is_an_error_naming_the_key() {
        let m = bpe_meta("smollm");
        let cases: Vec<(&str, Option<MetaValue>)> = vec![
            (keys::MODEL, None),
            (keys::MODEL, Some(MetaValue::U32(2))),
            (keys::MODEL, Some(MetaValue::String("wordpiece".into()))),
            (keys::PRE, Some(MetaValue::String("no-such-pre".into()))),
            (keys::PRE, Some(strs(&["smollm"]))),
            (keys::TOKENS, None),
            (keys::TOKENS, Some(strs(&[]))),
            (keys::TOKENS, Some(meta_i32_array("", &[1, 2]).1)),
            (keys::TOKENS, Some(strs(&["a", "b", "a"]))),
            (keys::TOKEN_TYPE, Some(meta_i32_array("", &[1, 1, 1]).1)),
            (keys::TOKEN_TYPE, Some(strs(&["x"]))),
            (keys::MERGES, None),
            (keys::MERGES, Some(strs(&["h e", "q zz"]))),
            (keys::MERGES, Some(strs(&["he"]))),
            (keys::MERGES, Some(strs(&["Ġ Ġ"]))),
            (keys::BOS_ID, Some(MetaValue::U32(1_000_000))),
            (keys::EOS_ID, Some(MetaValue::I32(-1))),
            (keys::EOS_ID, Some(MetaValue::String("2".into()))),
            (keys::ADD_BOS, Some(MetaValue::U8(1))),
        ];
        for (key, v) in cases {
            let msg = err(with(m.clone(), key, v.clone()));
            assert!(msg.starts_with(key), "{key} = {v:?}: {msg}");
        }
        let s = spm_meta();
        let short = MetaValue::Array {
            elem_type: value_type::F32,
            items: vec![MetaValue::F32(0.0); 4],
        };
        assert!(err(with(s.clone(), keys::SCORES, Some(short))).starts_with(keys::SCORES));
        assert!(err(with(s.clone(), keys::SCORES, Some(strs(&["x"])))).starts_with(keys::SCORES));
        // add_bos without a BOS id.
        let no_bos = with(s, keys::BOS_ID, None);
        assert!(err(no_bos).starts_with(keys::BOS_ID));
    }

    #[test]
    fn out_of_range_ids_are_errors() {
        let tk = bpe("gpt-2");
        let n = tk.vocab_size() as u32;
        assert!(matches!(tk.token_str(n), Err(TokenizerError::IdOutOfRange { .. })));
        assert!(tk.decode(&[0, n]).is_err());
        assert!(tk.decode(&[u32::MAX]).is_err());
    }

    #[test]
    fn spm_without_byte_tokens_errors_instead_of_panicking() {
        let m = with(spm_meta(), keys::TOKEN_TYPE, None);
        let mut tokens: Vec<String> = vec!["<unk>".into(), "<s>".into(), "</s>".into(), "▁".into(), "a".into()];
        tokens.push("▁a".into());
        let m = with(m, keys::TOKENS, Some(meta_str_array("", &tokens).1));
        let m = with(m, keys::SCORES, None);
        let tk = Tokenizer::from_gguf(&header(m)).unwrap();
        assert_eq!(tk.encode("a", false).unwrap(), vec![5]);
        assert!(matches!(tk.encode("z", false), Err(TokenizerError::NoByteToken(b'z'))));
    }

    proptest::proptest! {
        #[test]
        fn bpe_round_trips_any_text(s in "\\PC{0,40}") {
            let tk = bpe("smollm");
            let ids = tk.encode(&s, false).unwrap();
            proptest::prop_assert_eq!(tk.decode(&ids).unwrap(), s);
        }
    }
}
