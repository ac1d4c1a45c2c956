//! What a format 2 dump declares for tensor parallelism, apart from the tensors: each ranked
//! tensor's layout ([`TpLayout`]: replicated, gathered, sharded, partial, experts) and each rank's
//! metadata ([`RankMeta`]: its effective config, TP plan and weights), with the widths a layout is
//! checked against. Read by `dump.rs` when it opens the files; used by `layout.rs` and
//! `fingerprint.rs` for the checks.

use anyhow::{bail, Context};
use references::config::ModelConfig;
use references::tap::{Site, TapKey};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::ops::Range;
use std::path::Path;

/// How one rank's tensor of a tap relates to the full tensor the reference computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TpLayout {
    /// A full copy on every rank.
    Replicated,
    /// The full tensor, gathered from the ranks' shards (compared as a replicated copy).
    Gathered,
    /// Columns `range` of the full tensor (`dim` 1 of `[n_tokens, width]`).
    Sharded { dim: usize, range: Range<usize> },
    /// A pre-reduce partial sum over the op's input columns `range` (its weight's shard).
    Partial { range: Range<usize> },
    /// Expert parallelism: the experts this rank holds.
    Experts(Vec<u32>),
}

fn parse_range(s: &str) -> Option<Range<usize>> {
    let (a, b) = s.trim().split_once(':')?;
    let (a, b) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    (a < b).then_some(a..b)
}

impl TpLayout {
    /// `replicated`, `gathered`, `sharded(DIM,A:B)`, `partial(A:B)`, `experts(1,5,9)`.
    pub fn parse(s: &str) -> Option<TpLayout> {
        let s = s.trim();
        match s {
            "replicated" => return Some(TpLayout::Replicated),
            "gathered" => return Some(TpLayout::Gathered),
            _ => {}
        }
        let (head, rest) = s.split_once('(')?;
        let body = rest.strip_suffix(')')?;
        match head {
            "sharded" => {
                let (dim, range) = body.split_once(',')?;
                Some(TpLayout::Sharded {
                    dim: dim.trim().parse().ok()?,
                    range: parse_range(range)?,
                })
            }
            "partial" => Some(TpLayout::Partial {
                range: parse_range(body)?,
            }),
            "experts" => body
                .split(',')
                .map(|x| x.trim().parse().ok())
                .collect::<Option<Vec<u32>>>()
                .map(TpLayout::Experts),
            _ => None,
        }
    }
}

impl fmt::Display for TpLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TpLayout::Replicated => f.write_str("replicated"),
            TpLayout::Gathered => f.write_str("gathered"),
            TpLayout::Sharded { dim, range } => write!(f, "sharded({dim},{}:{})", range.start, range.end),
            TpLayout::Partial { range } => write!(f, "partial({}:{})", range.start, range.end),
            TpLayout::Experts(ids) => {
                let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
                write!(f, "experts({})", ids.join(","))
            }
        }
    }
}

/// One rank's format 2 metadata.
#[derive(Clone, Debug)]
pub struct RankMeta {
    pub rank: usize,
    /// Tensor class (a site name, or `site#partial`) → layout.
    pub layout: BTreeMap<String, TpLayout>,
    /// The rank's effective model config as the adapter saw it (key → JSON value).
    pub config: BTreeMap<String, serde_json::Value>,
    /// The TP plan, as recorded (JSON text).
    pub tp_plan: String,
    /// Weight fingerprints by key (`blk.5.w.o@r1`), as recorded (see [`crate::fingerprint`]).
    pub weights: BTreeMap<String, serde_json::Value>,
}

impl RankMeta {
    /// Reads `rank`, `layout`, `config` and `tp_plan` from a format 2 file's metadata.
    pub fn read(m: &HashMap<String, String>, tp: usize, p: &Path) -> anyhow::Result<RankMeta> {
        let get = |k: &str| {
            m.get(k)
                .map(String::as_str)
                .with_context(|| format!("{}: format 2 dump metadata lacks {k:?} (docs/tp-dumps.md)", p.display()))
        };
        let rank: usize = get("rank")?
            .trim()
            .parse()
            .ok()
            .filter(|&r| r < tp)
            .with_context(|| format!("{}: metadata \"rank\" is not a rank below tp {tp}", p.display()))?;
        let raw: BTreeMap<String, String> = serde_json::from_str(get("layout")?)
            .with_context(|| format!("{}: metadata \"layout\" is not a JSON object of strings", p.display()))?;
        let mut layout = BTreeMap::new();
        for (class, spec) in raw {
            let site = class.strip_suffix("#partial").unwrap_or(&class);
            if Site::parse(site).is_none() {
                bail!("{}: layout names unknown site {site:?}", p.display());
            }
            let l = TpLayout::parse(&spec).with_context(|| {
                format!(
                    "{}: unknown layout {spec:?} for {class} (known: replicated, gathered, sharded(DIM,A:B), partial(A:B), experts(IDS))",
                    p.display()
                )
            })?;
            layout.insert(class, l);
        }
        let config: BTreeMap<String, serde_json::Value> = serde_json::from_str(get("config")?)
            .with_context(|| format!("{}: metadata \"config\" is not a JSON object", p.display()))?;
        let tp_plan = m.get("tp_plan").cloned().unwrap_or_default();
        let weights: BTreeMap<String, serde_json::Value> = match m.get("weights") {
            Some(w) => serde_json::from_str(w)
                .with_context(|| format!("{}: metadata \"weights\" is not a JSON object", p.display()))?,
            None => BTreeMap::new(),
        };
        Ok(RankMeta {
            rank,
            layout,
            config,
            tp_plan,
            weights,
        })
    }
}

/// The full width of a site's tensor that sharded layouts slice (None: not sliceable here).
pub fn full_width(c: &ModelConfig, site: Site) -> Option<usize> {
    match (&c.mla, site) {
        (None, Site::Q | Site::AttnOut) => Some(c.n_heads * c.head_dim),
        (None, Site::K | Site::V) => Some(c.n_kv_heads * c.head_dim),
        (Some(m), Site::Q) => Some(c.n_heads * (m.qk_nope + m.qk_rope)),
        (Some(m), Site::K) => Some(c.n_heads * m.qk_nope),
        (Some(m), Site::V | Site::AttnOut) => Some(c.n_heads * m.v_head_dim),
        (_, Site::FfnGate | Site::FfnUp) if c.moe.is_none() => Some(c.ffn_dim),
        (_, Site::Logits) => Some(c.vocab),
        (
            _,
            Site::Embed
            | Site::AttnNorm
            | Site::AttnProj
            | Site::ResidAttn
            | Site::FfnNorm
            | Site::FfnOut
            | Site::ResidOut
            | Site::OutputNorm,
        ) => Some(c.d_model),
        _ => None,
    }
}

/// The input sites of a row-parallel op whose partial is declared, and their width.
pub fn partial_inputs(site: Site) -> &'static [Site] {
    match site {
        Site::AttnProj => &[Site::AttnOut],
        Site::FfnOut => &[Site::FfnGate, Site::FfnUp],
        _ => &[],
    }
}

/// The width of the input a partial's range indexes (o_proj's: the heads; down's: the FFN).
/// For a vocab-parallel embedding (`embed@rN#partial`), the vocabulary.
pub fn partial_input_width(c: &ModelConfig, site: Site) -> Option<usize> {
    if site == Site::Embed {
        return Some(c.vocab);
    }
    full_width(c, *partial_inputs(site).first()?)
}

/// Expert parallelism's declaration checks: every expert-parallel partial at a layer with
/// routed experts, and in every such layer the ranks' ids a partition of the experts (each
/// expert on exactly one rank; every rank of the run declaring some). A gap or an overlap is
/// refused, not reported as a finding: the ids are the adapter's record of the engine's
/// placement, so a declaration that places an expert twice or nowhere cannot be compared
/// against any per-rank partial (the reduced `ffn_out` still shows a real dropped expert).
pub fn check_expert_ids(ids: &BTreeMap<TapKey, Vec<u32>>, c: &ModelConfig, tp: usize) -> Result<(), String> {
    let mut layers: BTreeMap<u32, BTreeMap<u32, &Vec<u32>>> = BTreeMap::new();
    for (key, e) in ids {
        let l = key.layer.unwrap_or(0);
        let n_exp = c
            .moe
            .as_ref()
            .filter(|_| c.is_moe_layer(l as usize) && c.arch != references::config::Arch::GptOss)
            .map(|m| m.n_experts)
            .ok_or_else(|| format!("tensor {key}#partial: experts(ids) declared where the layer has no routed experts llmdiff's MoE block computes"))?;
        if let Some(bad) = e.iter().find(|&&x| x as usize >= n_exp) {
            return Err(format!(
                "tensor {key}#partial: expert id {bad} is outside the layer's {n_exp} experts"
            ));
        }
        layers.entry(l).or_default().insert(key.rank.unwrap_or(0), e);
    }
    for (l, ranks) in layers {
        let n_exp = c.moe.as_ref().map_or(0, |m| m.n_experts);
        let mut owner: Vec<Vec<u32>> = vec![Vec::new(); n_exp];
        for (&r, e) in &ranks {
            for &x in *e {
                owner[x as usize].push(r);
            }
        }
        if let Some((x, rs)) = owner.iter().enumerate().find(|(_, rs)| rs.len() > 1) {
            return Err(format!(
                "blk.{l}.ffn_out#partial: expert {x} is declared on ranks {rs:?}; experts(ids) must place each expert on one rank"
            ));
        }
        let missing: Vec<usize> = owner
            .iter()
            .enumerate()
            .filter(|(_, rs)| rs.is_empty())
            .map(|(x, _)| x)
            .collect();
        if !missing.is_empty() || ranks.len() != tp {
            return Err(format!(
                "blk.{l}.ffn_out#partial: the ranks' experts(ids) do not cover every expert ({} of {tp} ranks declare them; experts {missing:?} on none)",
                ranks.len()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_parse_and_print_back() {
        for s in [
            "replicated",
            "gathered",
            "sharded(1,192:384)",
            "partial(0:512)",
            "experts(1,5,9)",
        ] {
            assert_eq!(TpLayout::parse(s).unwrap().to_string(), s);
        }
        assert_eq!(
            TpLayout::parse("sharded(1, 0:64)"),
            Some(TpLayout::Sharded { dim: 1, range: 0..64 })
        );
        for bad in [
            "",
            "shard(1,0:4)",
            "sharded(1,4:4)",
            "partial(0-4)",
            "experts(a)",
            "sharded(0:4)",
        ] {
            assert_eq!(TpLayout::parse(bad), None, "{bad}");
        }
    }
}
