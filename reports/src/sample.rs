//! Synthetic run documents for tests and size/time measurements: a deterministic [`DiffRun`] of
//! any depth and TP degree, with an unwritten attention output on one rank of one layer (the
//! canary left, NaN downstream, the head matrix's rank block empty). No engine involved.

use crate::schema::*;

/// Activation sites of one MLA+MoE layer, in execution order.
pub const SITES: [&str; 15] = [
    "attn_norm",
    "q_a",
    "q",
    "kv_latent",
    "k_pe",
    "k",
    "v",
    "attn_out",
    "attn_proj",
    "resid_attn",
    "ffn_norm",
    "moe_logits",
    "moe_topk",
    "ffn_out",
    "resid_out",
];
const WEIGHTS: [&str; 8] = [
    "w.q_a", "w.q_b", "w.kv_a", "w.kv_b", "w.o", "w.router", "w.up", "w.down",
];

fn row(tap: String, layer: Option<u32>, site: &str, rank: Option<u32>, rel: f64, canary: f64, thr: f64) -> TapRow {
    let finite = rel.is_finite();
    TapRow {
        tap,
        layer,
        site: site.to_string(),
        rank,
        shape: [32, 512],
        metrics: Metrics {
            cosine: if finite { 1.0 - rel * rel / 2.0 } else { f64::NAN },
            rel_l2: rel,
            max_abs: rel * 4.0,
            nmse: rel * rel,
            sqnr_db: -20.0 * rel.log10(),
            nonfinite: if finite { 0 } else { 16384 },
            canary_left: canary,
        },
        threshold: thr,
        over: !finite || rel > thr || canary > 0.0,
        over_end_to_end: !finite || rel > thr || canary > 0.0,
        local: None,
        selection: None,
    }
}

/// A diverged run: `n_layers` layers of [`SITES`] on `tp` ranks, with an unwritten `attn_out` on
/// rank `tp - 1` of layer `fault_layer` (64 heads in the head matrix).
pub fn diverged_run(n_layers: u32, tp: u32, fault_layer: u32) -> DiffRun {
    let bad_rank = tp - 1;
    let mut taps = Vec::new();
    // Cheap deterministic jitter.
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut jitter = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        1.0 + (seed % 1000) as f64 / 1000.0
    };
    taps.push(row("embed".into(), None, "embed", None, 0.0, 0.0, 5e-5));
    for l in 0..n_layers {
        for w in WEIGHTS {
            for r in 0..tp {
                taps.push(row(format!("blk.{l}.{w}@r{r}"), Some(l), w, Some(r), 0.0, 0.0, 1e-6));
            }
        }
        let mut broken = l > fault_layer;
        for site in SITES {
            if l == fault_layer && site == "attn_out" {
                broken = true;
            }
            let healthy = 1e-7 * (1.0 + l as f64 * 0.05);
            let ranked = !matches!(site, "attn_proj" | "ffn_out");
            if ranked {
                for r in 0..tp {
                    let at_fault = l == fault_layer && site == "attn_out";
                    let (rel, canary) = if (at_fault && r == bad_rank) || (broken && !at_fault) {
                        (f64::NAN, 1.0)
                    } else {
                        (healthy * jitter(), 0.0)
                    };
                    let thr = if site == "moe_topk" { 0.0 } else { 5e-5 };
                    taps.push(row(
                        format!("blk.{l}.{site}@r{r}"),
                        Some(l),
                        site,
                        Some(r),
                        rel,
                        canary,
                        thr,
                    ));
                }
            }
            let (rel, canary) = if broken {
                (
                    f64::NAN,
                    if l == fault_layer && site == "attn_out" {
                        1.0 / tp as f64
                    } else {
                        1.0
                    },
                )
            } else {
                (healthy * jitter(), 0.0)
            };
            let thr = if site == "moe_topk" { 0.0 } else { 5e-5 };
            taps.push(row(format!("blk.{l}.{site}"), Some(l), site, None, rel, canary, thr));
        }
    }
    taps.push(row(
        "output_norm".into(),
        None,
        "output_norm",
        None,
        f64::NAN,
        1.0,
        5e-5,
    ));
    taps.push(row("logits".into(), None, "logits", None, f64::NAN, 1.0, 2.5e-4));
    let n_heads = 64usize;
    let per_rank = n_heads / tp as usize;
    let mut cosine = vec![0.0; n_heads * n_heads];
    for e in 0..n_heads {
        if e / per_rank == bad_rank as usize {
            continue;
        }
        for r in 0..n_heads {
            cosine[e * n_heads + r] = if e == r {
                1.0
            } else {
                ((e * 7 + r * 13) % 21) as f64 / 100.0 - 0.1
            };
        }
    }
    let first = format!("blk.{fault_layer}.attn_out@r{bad_rank}");
    DiffRun {
        format: DIFF_FORMAT,
        llmdiff_version: "0.1.0".into(),
        model: "synthetic-60.gguf".into(),
        backend: "cpu".into(),
        tp: tp as usize,
        tokens: (1..=32).collect(),
        injected: vec![format!("phantom-attn-out@{fault_layer}:{bad_rank}")],
        verdict: "diverged".into(),
        first_divergence: Some(Location {
            tap: first.clone(),
            layer: Some(fault_layer),
            site: "attn_out".into(),
            rank: Some(bad_rank),
        }),
        diagnosis: Some(Diagnosis {
            class: "unwritten-output".into(),
            explanation: format!(
                "canary left 100 % in {first}: the custom op never wrote any of its output buffer"
            ),
            confidence: "high".into(),
        }),
        isolation: vec![Isolation {
            tap: format!("blk.{fault_layer}.attn_out"),
            end_to_end_rel_l2: f64::NAN,
            isolated_rel_l2: f64::NAN,
            verdict: "introduced".into(),
        }],
        heads: Some(HeadMatrix {
            tap: format!("blk.{fault_layer}.attn_out"),
            n_heads,
            cosine,
        }),
        taps,
        unmatched: Vec::new(),
        missing: Vec::new(),
        allow_unknown: Vec::new(),
        repro: format!(
            "llmdiff diff-layers synthetic-60.gguf --tokens 1,2,3 --tp {tp} --inject phantom-attn-out@{fault_layer}:{bad_rank}"
        ),
        timings_s: Timings::default(),
        routing: (0..n_layers)
            .map(|layer| RoutingAgreement {
                layer,
                agree_frac: if layer < fault_layer { 1.0 } else { 0.25 },
            })
            .collect(),
        dtype: None,
        head_profile: None,
        baselines: Vec::new(),
        coverage_warnings: Vec::new(),
        tp_layout: None,
        layer_range: None,
    }
}
