//! Foreign-engine tensor dumps (format 1, README "Foreign engines: tensor dumps"): safetensors
//! files whose tensor names are tap keys, read memory-mapped, validated, and normalized by the
//! layouts the dump declares, so a PyTorch engine's taps can stand where our engine's do.
//!
//! A dump is one file per rank (or one file for everything); every tensor is `[n_tokens, width]`
//! in f32, bf16 or f16, and `__metadata__` holds `llmdiff.format` (`"1"`), `tokens` (a JSON list
//! of ids), `model` (name or sha256), `tp`, `mapping` (JSON: tap key → the module it came from)
//! and optionally `layout` (JSON: site → declared layout, see [`Layout`]). Format errors (missing
//! metadata, bad names, shapes or dtypes, truncation) are errors; non-finite values are data and
//! are compared like any other (they show as a `nonfinite` divergence).
//!
//! Format 2 (docs/tp-dumps.md) is one file per rank of a tensor-parallel run: `rank`, a declared
//! layout for every ranked tensor class (`replicated`, `gathered`, `sharded(1,A:B)`,
//! `partial(A:B)`, `experts(ids)`; see [`crate::layout`]), the rank's effective model `config`
//! and `tp_plan`; normalizations (`hf-rotate-half`) move to `normalize`. Pre-reduce partials are
//! `KEY@rN#partial`. A replicated or gathered tap's lowest-rank copy stands as the unranked tap
//! and the other copies are kept for the cross-rank check; sharded taps keep their declared
//! column range; a ranked tensor whose class has no declared layout is an error.

use crate::capture::Captured;
use crate::compare::ActDtype;
use crate::tp_meta::{RankMeta, TpLayout};
use anyhow::{bail, Context};
use memmap2::Mmap;
use references::config::ModelConfig;
use references::tap::{Site, TapKey};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The dump format this build reads (and [`DUMP_FORMAT_TP`]).
pub const DUMP_FORMAT: &str = "1";
/// Format 2: per-rank files with declared layouts and configs.
pub const DUMP_FORMAT_TP: &str = "2";

/// A declared, legitimate layout difference and the normalization applied before comparing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Already in llmdiff's (GGUF / llama.cpp) layout.
    Gguf,
    /// HF transformers' q/k after `apply_rotary_pos_emb`: per head, rotate_half (NEOX) order
    /// `[x0..x_{hd/2}, y0..y_{hd/2}]`, while llama.cpp's converter permutes the q/k weights so the
    /// GGUF (and so the reference) holds the pairs interleaved `[x0, y0, x1, y1, ...]`. The
    /// inverse permutation per head is `gguf[2j + t] = hf[t·hd/2 + j]`.
    HfRotateHalf,
}

impl Layout {
    fn parse(s: &str) -> Option<Layout> {
        match s {
            "gguf" => Some(Layout::Gguf),
            "hf-rotate-half" => Some(Layout::HfRotateHalf),
            _ => None,
        }
    }
}

/// One tensor: its rows in one or more parts (a prefill tensor, then one part per decode step).
#[derive(Clone)]
struct Entry {
    file: usize,
    dtype: Dtype,
    shape: [usize; 2],
    bytes: Vec<std::ops::Range<usize>>,
}

/// An opened, validated dump (one or more files).
pub struct Dump {
    maps: Vec<Mmap>,
    pub paths: Vec<PathBuf>,
    pub tokens: Vec<u32>,
    pub model: String,
    pub tp: usize,
    /// Tap key → module, as the dump declared it.
    pub mapping: BTreeMap<String, String>,
    /// Site → declared layout.
    pub layout: BTreeMap<Site, Layout>,
    /// `llmdiff.compute_dtype` from the metadata (the model's compute dtype), if declared.
    pub compute_dtype: Option<ActDtype>,
    entries: BTreeMap<TapKey, Entry>,
    /// Format 2: each rank's metadata, by rank.
    pub ranks: BTreeMap<usize, RankMeta>,
    /// Format 2: replicated / gathered taps' copies by unranked key and rank (the lowest rank's
    /// also stands as the unranked entry).
    copies: BTreeMap<TapKey, BTreeMap<usize, Entry>>,
    /// Format 2: a sharded ranked tap's declared column range of the full tensor.
    pub declared_slices: BTreeMap<TapKey, std::ops::Range<usize>>,
    /// Format 2: a partial's declared input range (the columns of the row-parallel weight).
    pub partial_ranges: BTreeMap<TapKey, std::ops::Range<usize>>,
    /// Format 2: an expert-parallel partial's (`ffn_out@rN#partial`, `experts(ids)`) expert ids.
    pub expert_ids: BTreeMap<TapKey, Vec<u32>>,
    /// Tensors in the files (each is compared or is an error; see [`crate::layout`]); a tap's
    /// decode-step parts count as one tensor with it.
    pub n_tensors: usize,
    /// Prompt tokens of the first forward pass (`prefill` in the metadata); the rest of `tokens`
    /// were decoded one per step, each step's rows in `KEY#stepK` tensors (K = 1, 2, ...).
    pub n_prefill: Option<usize>,
}

fn meta<'a>(m: &'a std::collections::HashMap<String, String>, k: &str, p: &Path) -> anyhow::Result<&'a str> {
    m.get(k).map(String::as_str).with_context(|| {
        format!(
            "{}: dump metadata lacks {k:?} (see README, Foreign engines)",
            p.display()
        )
    })
}

impl Dump {
    /// Opens and validates every file; they must agree on tokens, model and tp.
    pub fn open(paths: &[PathBuf]) -> anyhow::Result<Dump> {
        if paths.is_empty() {
            bail!("--candidate needs at least one dump file");
        }
        let mut d = Dump {
            maps: Vec::new(),
            paths: paths.to_vec(),
            tokens: Vec::new(),
            model: String::new(),
            tp: 1,
            mapping: BTreeMap::new(),
            layout: BTreeMap::new(),
            compute_dtype: None,
            entries: BTreeMap::new(),
            ranks: BTreeMap::new(),
            copies: BTreeMap::new(),
            declared_slices: BTreeMap::new(),
            partial_ranges: BTreeMap::new(),
            expert_ids: BTreeMap::new(),
            n_tensors: 0,
            n_prefill: None,
        };
        for (i, p) in paths.iter().enumerate() {
            crate::output::check_regular(p)?;
            let f = std::fs::File::open(p).with_context(|| format!("cannot open dump {}", p.display()))?;
            // SAFETY: the file is only read; a dump modified while we run is the user's race, as
            // with the GGUF model, and at worst gives wrong numbers, never unsoundness in our code
            // beyond what memmap2 documents.
            let map = unsafe { Mmap::map(&f) }.with_context(|| format!("cannot map dump {}", p.display()))?;
            d.read_file(i, p, &map)?;
            d.maps.push(map);
        }
        if !d.ranks.is_empty() {
            d.finish_tp()?;
        }
        if d.entries.is_empty() {
            bail!("{}: the dump holds no tensors", paths[0].display());
        }
        Ok(d)
    }

    /// Format 2 after every file: all ranks present, one format, replicated copies' primaries.
    fn finish_tp(&mut self) -> anyhow::Result<()> {
        if self.ranks.len() != self.paths.len() {
            bail!(
                "{}: format 1 and format 2 files mixed (one run's files only)",
                self.paths[0].display()
            );
        }
        if let Some(r) = (0..self.tp).find(|r| !self.ranks.contains_key(r)) {
            bail!(
                "{}: a format 2 dump of tp {} lacks rank {r}'s file (pass every NAME.rank*.safetensors)",
                self.paths[0].display(),
                self.tp
            );
        }
        for (key, copies) in &self.copies {
            if self.entries.contains_key(key) {
                bail!(
                    "{}: {key} is both an unranked tensor and a replicated rank's copy",
                    self.paths[0].display()
                );
            }
            let (_, e) = copies.iter().next().expect("a copy");
            self.entries.insert(*key, e.clone());
        }
        Ok(())
    }

    fn read_file(&mut self, file: usize, p: &Path, buf: &[u8]) -> anyhow::Result<()> {
        let (header_len, metadata) = SafeTensors::read_metadata(buf)
            .map_err(|e| anyhow::anyhow!("{}: not a readable safetensors file ({e:?})", p.display()))?;
        let data_start = 8 + header_len;
        let empty = std::collections::HashMap::new();
        let m = metadata.metadata().as_ref().unwrap_or(&empty);
        let format = meta(m, "llmdiff.format", p)?;
        if format != DUMP_FORMAT && format != DUMP_FORMAT_TP {
            bail!(
                "{}: dump format {format:?}, this llmdiff reads formats {DUMP_FORMAT:?} and {DUMP_FORMAT_TP:?}",
                p.display()
            );
        }
        let tp2 = format == DUMP_FORMAT_TP;
        let tokens: Vec<u32> = serde_json::from_str(meta(m, "tokens", p)?)
            .with_context(|| format!("{}: metadata \"tokens\" is not a JSON list of token ids", p.display()))?;
        if tokens.is_empty() {
            bail!("{}: metadata \"tokens\" is empty", p.display());
        }
        let model = meta(m, "model", p)?.to_string();
        let tp: usize = meta(m, "tp", p)?
            .trim()
            .parse()
            .ok()
            .filter(|&t| t > 0)
            .with_context(|| format!("{}: metadata \"tp\" is not a positive integer", p.display()))?;
        let mapping: BTreeMap<String, String> = serde_json::from_str(meta(m, "mapping", p)?)
            .with_context(|| format!("{}: metadata \"mapping\" is not a JSON object of strings", p.display()))?;
        // Format 2 declares normalizations under "normalize" ("layout" holds the TP layouts).
        let norm_key = if tp2 { "normalize" } else { "layout" };
        let layout: BTreeMap<String, String> = match m.get(norm_key) {
            Some(s) => serde_json::from_str(s)
                .with_context(|| format!("{}: metadata {norm_key:?} is not a JSON object of strings", p.display()))?,
            None => BTreeMap::new(),
        };
        let rank_meta = if tp2 {
            let rm = RankMeta::read(m, tp, p)?;
            if self.ranks.contains_key(&rm.rank) {
                bail!("{}: a second file for rank {}", p.display(), rm.rank);
            }
            Some(rm)
        } else {
            None
        };
        if let Some(dt) = m.get("llmdiff.compute_dtype") {
            let parsed = ActDtype::parse(dt).with_context(|| {
                format!(
                    "{}: metadata \"llmdiff.compute_dtype\" is {dt:?} (known: f32, bf16, f16, fp8-e4m3)",
                    p.display()
                )
            })?;
            if self.compute_dtype.is_some_and(|d| d != parsed) {
                bail!("{}: llmdiff.compute_dtype differs from the other files'", p.display());
            }
            self.compute_dtype = Some(parsed);
        }
        if file == 0 {
            self.tokens = tokens;
            self.model = model;
            self.tp = tp;
        } else if tokens != self.tokens || tp != self.tp || model != self.model {
            bail!(
                "{}: tokens, model or tp differ from {}'s (one run's files only)",
                p.display(),
                self.paths[0].display()
            );
        }
        self.mapping.extend(mapping);
        for (site, l) in layout {
            let s =
                Site::parse(&site).with_context(|| format!("{}: layout names unknown site {site:?}", p.display()))?;
            let l = Layout::parse(&l).with_context(|| {
                format!(
                    "{}: unknown layout {l:?} for {site} (known: gguf, hf-rotate-half)",
                    p.display()
                )
            })?;
            if l == Layout::HfRotateHalf && !matches!(s, Site::Q | Site::K) {
                bail!(
                    "{}: layout hf-rotate-half applies to q and k only, not {site}",
                    p.display()
                );
            }
            self.layout.insert(s, l);
        }
        let n = self.tokens.len();
        // Decode steps: `prefill` prompt tokens, then one token per step in `NAME#stepK`.
        let prefill = match m.get("prefill") {
            Some(v) => Some(
                v.trim()
                    .parse::<usize>()
                    .ok()
                    .filter(|&p| p > 0 && p < n)
                    .with_context(|| {
                        format!(
                            "{}: metadata \"prefill\" is not a count of prompt tokens below the dump's {n}",
                            p.display()
                        )
                    })?,
            ),
            None => None,
        };
        if file > 0 && prefill != self.n_prefill {
            bail!("{}: \"prefill\" differs from the other files'", p.display());
        }
        self.n_prefill = prefill;
        let tensors = metadata.tensors();
        let mut steps: BTreeMap<&str, BTreeMap<usize, &safetensors::tensor::TensorInfo>> = BTreeMap::new();
        for (name, info) in &tensors {
            if let Some((base, k)) = name.rsplit_once("#step") {
                let k: usize = k
                    .parse()
                    .ok()
                    .filter(|&k| k > 0)
                    .with_context(|| format!("{}: tensor {name}: bad step index", p.display()))?;
                if prefill.is_none_or(|pf| k > n - pf) {
                    bail!(
                        "{}: tensor {name}: step {k} but the metadata's \"prefill\" leaves {} decode steps",
                        p.display(),
                        prefill.map_or(0, |pf| n - pf)
                    );
                }
                steps.entry(base).or_default().insert(k, *info);
            }
        }
        for (name, info) in &tensors {
            if name.contains("#step") {
                continue;
            }
            self.n_tensors += 1;
            let (base, partial) = match name.strip_suffix("#partial") {
                Some(b) if tp2 => (b, true),
                _ => (name.as_str(), false),
            };
            let key: TapKey = base
                .parse()
                .map_err(|e: String| anyhow::anyhow!("{}: tensor {e}", p.display()))?;
            if matches!(key.site, Site::Weight(_)) {
                bail!(
                    "{}: tensor {name}: weight taps are not part of dump format 1",
                    p.display()
                );
            }
            let esize = match info.dtype {
                Dtype::F32 => 4,
                Dtype::BF16 | Dtype::F16 => 2,
                other => bail!(
                    "{}: tensor {name} is {other:?}; dumps hold f32, bf16 or f16",
                    p.display()
                ),
            };
            let &[rows, width] = info.shape.as_slice() else {
                bail!(
                    "{}: tensor {name} has shape {:?}; dumps hold [n_tokens, width]",
                    p.display(),
                    info.shape
                );
            };
            let want_rows = prefill.unwrap_or(n);
            if rows != want_rows {
                bail!(
                    "{}: tensor {name} has {rows} rows but the dump's tokens are {n}{} (expected [n_tokens, width])",
                    p.display(),
                    prefill.map_or(String::new(), |pf| format!(", {pf} of them prefill"))
                );
            }
            let span = |name: &str, info: &safetensors::tensor::TensorInfo, rows: usize| {
                let (a, b) = info.data_offsets;
                let want = rows.checked_mul(width).and_then(|x| x.checked_mul(esize));
                if b.checked_sub(a).is_none()
                    || b.checked_sub(a) != want
                    || data_start.checked_add(b).is_none_or(|e| e > buf.len())
                {
                    bail!("{}: tensor {name}: data out of bounds (truncated file?)", p.display());
                }
                Ok(data_start + a..data_start + b)
            };
            let mut bytes = vec![span(name, info, rows)?];
            if let Some(pf) = prefill {
                let mine = steps.remove(name.as_str()).unwrap_or_default();
                for k in 1..=n - pf {
                    let part = mine.get(&k).with_context(|| {
                        format!(
                            "{}: tensor {name}: decode step {k} (\"{name}#step{k}\") is missing",
                            p.display()
                        )
                    })?;
                    if part.dtype != info.dtype || part.shape != [1, width] {
                        bail!(
                            "{}: tensor {name}#step{k} is {:?} {:?}; a step holds one [1, {width}] row in the prefill's dtype",
                            p.display(),
                            part.dtype,
                            part.shape
                        );
                    }
                    bytes.push(span(&format!("{name}#step{k}"), part, 1)?);
                }
            }
            let entry = Entry {
                file,
                dtype: info.dtype,
                shape: [n, width],
                bytes,
            };
            if let (Some(rm), Some(r)) = (&rank_meta, key.rank) {
                if r as usize != rm.rank {
                    bail!("{}: tensor {name} in rank {}'s file", p.display(), rm.rank);
                }
                let class = format!("{}{}", key.site.name(), if partial { "#partial" } else { "" });
                let lay = rm.layout.get(&class).with_context(|| {
                    format!(
                        "{}: tensor {name}: its layout is not declared (format 2 declares every ranked tensor class; \"layout\" lacks {class:?})",
                        p.display()
                    )
                })?;
                match lay {
                    TpLayout::Replicated | TpLayout::Gathered if !partial => {
                        self.copies
                            .entry(key.unranked())
                            .or_default()
                            .insert(rm.rank, entry);
                        continue;
                    }
                    TpLayout::Sharded { dim: 1, range } if !partial => {
                        if range.len() != width {
                            bail!(
                                "{}: tensor {name} is {width} wide but its declared range {}:{} is {}",
                                p.display(),
                                range.start,
                                range.end,
                                range.len()
                            );
                        }
                        self.declared_slices.insert(key, range.clone());
                    }
                    TpLayout::Partial { range } if partial && matches!(key.site, Site::AttnProj | Site::FfnOut | Site::Embed) => {
                        self.partial_ranges.insert(key, range.clone());
                    }
                    TpLayout::Experts(ids) if partial && key.site == Site::FfnOut => {
                        self.expert_ids.insert(key, ids.clone());
                    }
                    other => bail!(
                        "{}: tensor {name}: layout {other} cannot be compared here (sharded on dim 1 only; partial(A:B) at attn_proj/ffn_out/embed#partial only; experts(ids) at ffn_out#partial only)",
                        p.display()
                    ),
                }
            } else if partial {
                bail!("{}: tensor {name}: a partial needs a rank", p.display());
            }
            if self.entries.contains_key(&key) {
                bail!(
                    "{}: tensor {name} appears twice (two files, or a partial and a partial layout)",
                    p.display()
                );
            }
            self.entries.insert(key, entry);
        }
        if let Some((base, _)) = steps.iter().next() {
            bail!(
                "{}: tensor {base}#step…: decode steps of a tensor the dump lacks",
                p.display()
            );
        }
        if let Some(rm) = rank_meta {
            self.ranks.insert(rm.rank, rm);
        }
        Ok(())
    }

    /// Checks the dump against the model before any forward pass: every tap key one the model
    /// can have (a layer below its layer count, a rank below the dump's TP, a site its
    /// architecture has), token ids within its vocabulary, and the width of every unranked tap
    /// whose width the model fixes (d_model for the residual stream, the vocabulary for logits).
    pub fn check_model(&self, c: &ModelConfig) -> anyhow::Result<()> {
        let at = || self.paths[0].display().to_string();
        if let Some(bad) = self.tokens.iter().find(|&&t| t as usize >= c.vocab) {
            bail!(
                "{}: token id {bad} is outside the model's vocabulary ({})",
                at(),
                c.vocab
            );
        }
        for (key, e) in &self.entries {
            if key.layer.is_some_and(|l| l as usize >= c.n_layers) {
                bail!(
                    "{}: tensor {key}: the model has {} layers, so no such tap",
                    at(),
                    c.n_layers
                );
            }
            if key.rank.is_some_and(|r| r as usize >= self.tp) {
                bail!("{}: tensor {key}: rank beyond the dump's tp {}", at(), self.tp);
            }
            let mla = c.mla.is_some();
            let moe_layer = key
                .layer
                .is_some_and(|l| c.moe.as_ref().is_some_and(|m| l as usize >= m.n_dense_lead));
            let has = match key.site {
                Site::QA | Site::KvLatent | Site::KPe => mla,
                Site::IndexerScore | Site::IndexerTopk => c.indexer.is_some(),
                Site::MoeLogits | Site::MoeTopk => moe_layer,
                Site::FfnGate | Site::FfnUp => !moe_layer,
                Site::AttnSink => c.arch == references::config::Arch::GptOss,
                Site::LogitsPreCap => c.family.final_softcap.is_some(),
                _ => true,
            };
            if !has {
                bail!("{}: tensor {key}: this model has no such tap", at());
            }
            if key.rank.is_none() {
                let want = match key.site {
                    Site::Embed
                    | Site::AttnNorm
                    | Site::AttnProj
                    | Site::ResidAttn
                    | Site::FfnNorm
                    | Site::FfnOut
                    | Site::ResidOut
                    | Site::OutputNorm => Some(c.d_model),
                    Site::Logits | Site::LogitsPreCap => Some(c.vocab),
                    Site::AttnSink => Some(c.n_heads),
                    _ => None,
                };
                if let Some(w) = want.filter(|&w| w != e.shape[1]) {
                    bail!(
                        "{}: tensor {key} is {} wide, the model's {w} (wrong shape for this model)",
                        at(),
                        e.shape[1]
                    );
                }
            }
        }
        for (key, range) in &self.declared_slices {
            let full = crate::tp_meta::full_width(c, key.site);
            if full.is_none_or(|w| range.end > w) {
                bail!(
                    "{}: tensor {key}: declared range {}:{} is outside the model's {} columns{}",
                    at(),
                    range.start,
                    range.end,
                    key.site.name(),
                    full.map_or(
                        " (no sharded layout is known for this site in this model)".to_string(),
                        |w| format!(" ({w})")
                    )
                );
            }
        }
        crate::tp_meta::check_expert_ids(&self.expert_ids, c, self.tp).map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
        for (key, range) in &self.partial_ranges {
            let full = crate::tp_meta::partial_input_width(c, key.site);
            if full.is_none_or(|w| range.end > w) {
                bail!(
                    "{}: tensor {key}#partial: declared input range {}:{} is outside the op's input",
                    at(),
                    range.start,
                    range.end
                );
            }
        }
        Ok(())
    }

    /// The candidate's compute dtype and how it was learned: the metadata's
    /// `llmdiff.compute_dtype`; else the tensors' own dtype when all are bf16 or all f16; else
    /// detected from the values (every value bf16-representable: bf16; f16-representable: f16;
    /// bf16 is tried first, since bf16 values within f16's range are also f16-representable).
    pub fn compute_dtype(&self, c: &ModelConfig) -> anyhow::Result<(ActDtype, &'static str)> {
        if let Some(d) = self.compute_dtype {
            return Ok((d, "dump metadata"));
        }
        let all = |d: Dtype| self.entries.values().all(|e| e.dtype == d);
        if all(Dtype::BF16) {
            return Ok((ActDtype::Bf16, "dump tensor dtypes"));
        }
        if all(Dtype::F16) {
            return Ok((ActDtype::F16, "dump tensor dtypes"));
        }
        let mut tensors = Vec::new();
        for k in self.entries.keys() {
            tensors.push(self.tensor(k, c)?.data);
        }
        let d = ActDtype::detect(tensors.iter().map(Vec::as_slice));
        Ok((
            d,
            if d == ActDtype::F32 {
                "default"
            } else {
                "detected from values"
            },
        ))
    }

    /// Every tap key in the dump, in execution order.
    pub fn keys(&self) -> impl Iterator<Item = &TapKey> {
        self.entries.keys()
    }

    /// One tap as f32, normalized to llmdiff's layout by the dump's declared layouts.
    pub fn tensor(&self, key: &TapKey, c: &ModelConfig) -> anyhow::Result<Captured> {
        let e = self
            .entries
            .get(key)
            .with_context(|| format!("dump has no tensor {key}"))?;
        self.decode(key, e, c)
    }

    /// Format 2: the replicated / gathered copies of an unranked tap, by rank (empty otherwise).
    pub fn copies(&self, key: &TapKey, c: &ModelConfig) -> anyhow::Result<Vec<(usize, Captured)>> {
        let mut out = Vec::new();
        for (&r, e) in self.copies.get(key).into_iter().flatten() {
            out.push((r, self.decode(key, e, c)?));
        }
        Ok(out)
    }

    /// Format 2: the unranked keys whose tensors are replicated copies.
    pub fn replicated_keys(&self) -> impl Iterator<Item = &TapKey> {
        self.copies.keys()
    }

    fn decode(&self, key: &TapKey, e: &Entry, c: &ModelConfig) -> anyhow::Result<Captured> {
        let mut data: Vec<f32> = Vec::with_capacity(e.shape[0] * e.shape[1]);
        for part in &e.bytes {
            let bytes = &self.maps[e.file][part.clone()];
            match e.dtype {
                Dtype::F32 => data.extend(
                    bytes
                        .chunks_exact(4)
                        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
                ),
                Dtype::BF16 => data.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
                _ => data.extend(
                    bytes
                        .chunks_exact(2)
                        .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()),
                ),
            }
        }
        if self.layout.get(&key.site) == Some(&Layout::HfRotateHalf) {
            let hd = c.head_dim;
            if c.mla.is_some() || c.rope_dim != hd || hd % 2 != 0 {
                bail!("{key}: layout hf-rotate-half is defined for llama attention with full-width RoPE only");
            }
            if e.shape[1] % hd != 0 {
                bail!("{key}: width {} is not a whole number of {hd}-wide heads", e.shape[1]);
            }
            data = unrotate_half(&data, hd);
        }
        Ok(Captured::whole(*key, e.shape, data))
    }
}

/// HF rotate_half order to GGUF's interleaved order, per `hd`-wide head: `out[2j + t] = in[t·hd/2 + j]`.
pub fn unrotate_half(x: &[f32], hd: usize) -> Vec<f32> {
    let half = hd / 2;
    let mut out = vec![0f32; x.len()];
    for (src, dst) in x.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        for j in 0..half {
            dst[2 * j] = src[j];
            dst[2 * j + 1] = src[half + j];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unrotate_half_interleaves_each_head() {
        let x = [0., 1., 2., 3., 10., 11., 12., 13.];
        assert_eq!(unrotate_half(&x, 4), [0., 2., 1., 3., 10., 12., 11., 13.]);
    }
}
