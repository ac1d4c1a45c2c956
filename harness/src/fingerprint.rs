//! Weight fingerprints of a format 2 dump (docs/tp-dumps.md): per rank and weight, as the
//! engine loaded it, the layout (`sharded(0,A:B)` rows, `sharded(1,A:B)` columns, `replicated`),
//! local shape, dtype, the sha256 of its values as little-endian f32, every local row's L2 norm
//! and a few sampled rows. Each is checked against the reference's slice of the GGUF weight for
//! the declared layout (rounded to the weight's dtype when it is bf16 or f16): shape, row norms
//! and samples; the hash is compared too (HF and llmdiff
//! dequantize the same bytes bit-exactly, so equal hashes are expected, and a difference is
//! reported as such). A shard whose norms miss its own slice is tried against every other rank's
//! slice, so "rank 0 holds rank 1's o_proj shard" is named from the weights alone, and a
//! weight whose local shape is the whole tensor where a shard was declared is "loaded whole".

use references::config::ModelConfig;
use references::dequant::dequantize_to_vec;
use references::tap::{Site, TapKey, WeightKind};
use references::GgufFile;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::ops::Range;

/// One fingerprint as the adapter recorded it.
#[derive(Clone, Debug, serde::Deserialize)]
pub struct Fingerprint {
    pub layout: String,
    pub shape: [usize; 2],
    #[serde(default)]
    pub dtype: String,
    pub sha256: String,
    pub row_norms: Vec<f64>,
    pub rows: BTreeMap<String, Vec<f64>>,
    #[serde(default)]
    pub module: String,
}

/// What the check found for one fingerprint.
pub struct Checked {
    pub key: TapKey,
    /// Problem found, if any (one sentence).
    pub finding: Option<String>,
    pub hash_equal: bool,
}

fn gguf_name(layer: u32, kind: WeightKind) -> Option<String> {
    let t = match kind {
        WeightKind::Q => "attn_q",
        WeightKind::K => "attn_k",
        WeightKind::V => "attn_v",
        WeightKind::O => "attn_output",
        WeightKind::Gate => "ffn_gate",
        WeightKind::Up => "ffn_up",
        WeightKind::Down => "ffn_down",
        // Reassembled from the llama.cpp split (attn_k_b, attn_v_b) as the reference does.
        WeightKind::KvB => "attn_kv_b",
        _ => return None,
    };
    Some(format!("blk.{layer}.{t}.weight"))
}

/// Parses `sharded(D,A:B)` / `replicated` into (dim, range).
fn parse_layout(s: &str) -> Option<Option<(usize, Range<usize>)>> {
    if s == "replicated" {
        return Some(None);
    }
    match crate::tp_meta::TpLayout::parse(s)? {
        crate::tp_meta::TpLayout::Sharded { dim, range } if dim <= 1 => Some(Some((dim, range))),
        _ => None,
    }
}

/// The reference's weight `[rows, cols]` in the engine's (HF) row order: q/k rows are stored in
/// GGUF permuted per head (llama.cpp's converter interleaves HF's rotate_half halves).
struct RefWeight {
    data: Vec<f32>,
    rows: usize,
    cols: usize,
    head_dim: Option<usize>,
}

impl RefWeight {
    fn row(&self, hf_row: usize) -> &[f32] {
        let g = match self.head_dim {
            Some(hd) if hd >= 2 => {
                let (h, w) = (hf_row / hd, hf_row % hd);
                let (t, j) = (w / (hd / 2), w % (hd / 2));
                h * hd + 2 * j + t
            }
            _ => hf_row,
        };
        &self.data[g * self.cols..(g + 1) * self.cols]
    }

    /// The local matrix for a layout: rows (dim 0) or columns (dim 1) `range`, or all.
    fn local(&self, slice: &Option<(usize, Range<usize>)>) -> Option<(Vec<f32>, [usize; 2])> {
        let (rows, cols) = match slice {
            None => (0..self.rows, 0..self.cols),
            Some((0, r)) => (r.clone(), 0..self.cols),
            Some((_, r)) => (0..self.rows, r.clone()),
        };
        if rows.end > self.rows || cols.end > self.cols {
            return None;
        }
        let mut out = Vec::with_capacity(rows.len() * cols.len());
        for i in rows.clone() {
            out.extend_from_slice(&self.row(i)[cols.clone()]);
        }
        Some((out, [rows.len(), cols.len()]))
    }
}

fn norms(m: &[f32], cols: usize) -> Vec<f64> {
    m.chunks(cols.max(1))
        .map(|r| r.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt())
        .collect()
}

fn norms_match(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * y.abs().max(1e-6))
}

/// The reference's weight as f32 `[rows, cols]` (kv_b reassembled from k_b and v_b when the
/// file splits it).
fn load(
    file: &GgufFile,
    c: &ModelConfig,
    name: &str,
    layer: u32,
    kind: WeightKind,
) -> anyhow::Result<(Vec<f32>, usize, usize)> {
    if let Some(t) = file.tensor(name) {
        let data = dequantize_to_vec(t.ty, file.tensor_data(t))?;
        return Ok((data, t.ne.get(1).copied().unwrap_or(1) as usize, t.ne[0] as usize));
    }
    if let (WeightKind::KvB, Some(m)) = (kind, &c.mla) {
        let (kb, vb) = (
            format!("blk.{layer}.attn_k_b.weight"),
            format!("blk.{layer}.attn_v_b.weight"),
        );
        if let (Some(k), Some(v)) = (file.tensor(&kb), file.tensor(&vb)) {
            let k = dequantize_to_vec(k.ty, file.tensor_data(k))?;
            let v = dequantize_to_vec(v.ty, file.tensor_data(v))?;
            let kv_lora = m.kv_lora_rank;
            if k.len() != c.n_heads * kv_lora * m.qk_nope || v.len() != c.n_heads * m.v_head_dim * kv_lora {
                anyhow::bail!("{kb}/{vb}: sizes do not match the model's MLA dims");
            }
            let mat = references::forward::reassemble_kv_b(&k, &v, c.n_heads, m.qk_nope, m.v_head_dim, kv_lora);
            return Ok((mat.to_f32(), mat.rows, mat.cols));
        }
    }
    anyhow::bail!("the model has no {name}")
}

/// Checks every fingerprint of every rank (`(rank, key, fingerprint)`) against the GGUF.
pub fn check(
    file: &GgufFile,
    c: &ModelConfig,
    prints: &[(usize, TapKey, Fingerprint)],
) -> anyhow::Result<Vec<Checked>> {
    let head_dim = c.head_dim;
    let mut cache: BTreeMap<String, RefWeight> = BTreeMap::new();
    let mut out = Vec::new();
    for (_, key, fp) in prints {
        let (Some(layer), Site::Weight(kind)) = (key.layer, key.site) else {
            anyhow::bail!("weight fingerprint {key}: not a layer weight key");
        };
        let Some(name) = gguf_name(layer, kind) else {
            anyhow::bail!("weight fingerprint {key}: weight kind not checked by this build");
        };
        if !cache.contains_key(&name) {
            let (data, rows, cols) =
                load(file, c, &name, layer, kind).map_err(|e| anyhow::anyhow!("weight fingerprint {key}: {e:#}"))?;
            let hd = (c.mla.is_none()
                && matches!(kind, WeightKind::Q | WeightKind::K)
                && head_dim >= 2
                && rows.is_multiple_of(head_dim))
            .then_some(head_dim);
            cache.insert(
                name.clone(),
                RefWeight {
                    data,
                    rows,
                    cols,
                    head_dim: hd,
                },
            );
        }
        let w = &cache[&name];
        let slice = parse_layout(&fp.layout)
            .ok_or_else(|| anyhow::anyhow!("weight fingerprint {key}: unknown layout {:?}", fp.layout))?;
        let full = [w.rows, w.cols];
        let mut finding = None;
        let mut hash_equal = false;
        match w.local(&slice) {
            None => {
                finding = Some(format!(
                    "{key}: declared {} lies outside the weight's {full:?}",
                    fp.layout
                ))
            }
            Some((_, shape)) if shape != fp.shape => {
                finding = Some(if fp.shape == full {
                    format!(
                        "{key}: loaded whole ({:?}) where its layout {} declares a {shape:?} shard",
                        fp.shape, fp.layout
                    )
                } else {
                    format!(
                        "{key} is {:?} where the reference's slice for {} is {shape:?}",
                        fp.shape, fp.layout
                    )
                })
            }
            Some((mut m, shape)) => {
                // An engine holding its weights in a 16-bit dtype holds the reference's values
                // rounded to it (the fingerprint's values are those, widened to f32).
                let round = |m: &mut Vec<f32>| match fp.dtype.as_str() {
                    "bfloat16" => m.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32()),
                    "float16" => m.iter_mut().for_each(|x| *x = half::f16::from_f32(*x).to_f32()),
                    _ => {}
                };
                round(&mut m);
                let mut h = Sha256::new();
                for x in &m {
                    h.update(x.to_le_bytes());
                }
                hash_equal = format!("{:x}", h.finalize()) == fp.sha256;
                let want = norms(&m, shape[1]);
                let samples_ok = fp.rows.iter().all(|(r, vals)| {
                    r.parse::<usize>().ok().is_some_and(|r| {
                        r < shape[0]
                            && vals
                                .iter()
                                .zip(&m[r * shape[1]..(r + 1) * shape[1]])
                                .all(|(&a, &b)| (a - b as f64).abs() <= 1e-6 * (b.abs() as f64).max(1.0))
                    })
                });
                if !norms_match(&fp.row_norms, &want) || !samples_ok {
                    // Whose slice is it? Every other aligned slice of the same size.
                    let mut whose = None;
                    if let Some((dim, r)) = &slice {
                        let len = r.len();
                        let total = if *dim == 0 { w.rows } else { w.cols };
                        for s in (0..total / len.max(1)).map(|i| i * len..(i + 1) * len) {
                            if s == *r {
                                continue;
                            }
                            if let Some((mut m2, sh2)) = w.local(&Some((*dim, s.clone()))) {
                                round(&mut m2);
                                if norms_match(&fp.row_norms, &norms(&m2, sh2[1])) {
                                    whose = Some(s);
                                    break;
                                }
                            }
                        }
                    }
                    let what = if matches!(slice, Some((1, _))) {
                        "columns"
                    } else {
                        "rows"
                    };
                    finding = Some(match (whose, &slice) {
                        (Some(s), Some((_, r))) => format!(
                            "{key}: the weight holds the reference's {what} {}:{} (rank {}'s shard), not its declared {}:{}",
                            s.start,
                            s.end,
                            s.start / s.len().max(1),
                            r.start,
                            r.end
                        ),
                        _ => format!(
                            "{key}: row norms or sampled rows differ from the reference's slice for {}",
                            fp.layout
                        ),
                    });
                }
            }
        }
        out.push(Checked {
            key: *key,
            finding,
            hash_equal,
        });
    }
    Ok(out)
}
