//! The local-error decision rule at reduced precision (issue 44): a simulated bf16/f16 candidate
//! of the real SmolLM2 — the reference's forward with weights and every op's output rounded to
//! the compute dtype, as a production engine stores them (accumulation stays wide) — written as a
//! foreign dump and diffed with default settings. Healthy agrees; planted faults are localized at
//! their tap and classed: one head × 1.05 and × 1.02 (scale-mismatch, per head, with the fitted
//! scale), two heads swapped (head-permutation), o_proj's input zeroed, RoPE theta ÷ 10 (rope)
//! and every norm's eps 1e-2 (config-drift wording). It also prints the calibration figure of the
//! noise model: the worst healthy local error over u·rho.

use harness::compare::{ActDtype, Baseline, Tolerances, BASELINE_MARGIN};
use harness::diff::{run_diff_candidate, DiffPlan};
use harness::dump::Dump;
use llmdiff_tests::fixtures::smollm2;
use references::config::ModelConfig;
use references::dequant::dequantize_to_vec;
use references::forward::ops;
use references::GgufFile;
use reports::DiffRun;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Dt {
    Bf16,
    F16,
    /// FP8 e4m3 storage of every op's output tensor and weight, with a per-tensor scale (the
    /// tensor's largest magnitude to e4m3's 448); the elementwise steps inside an op in bf16.
    Fp8,
}

/// Round to the dtype, nearest even.
fn round(dt: Dt, x: f32) -> f32 {
    if !x.is_finite() {
        return x;
    }
    match dt {
        Dt::Bf16 => {
            let b = x.to_bits();
            f32::from_bits(b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000)
        }
        Dt::F16 => f16_round(x),
        Dt::Fp8 => round(Dt::Bf16, x),
    }
}

/// Nearest e4m3 value (3 stored mantissa bits, exponent bias 7, subnormal quantum 2^-9,
/// largest 448) of `y`.
fn e4m3(y: f32) -> f32 {
    let a = y.abs();
    let q = if a < 2f32.powi(-6) {
        2f32.powi(-9)
    } else {
        2f32.powi(a.log2().floor() as i32 - 3)
    };
    ((y / q).round_ties_even() * q).clamp(-448.0, 448.0)
}

/// f32 → nearest f16 value (as f32), normal range only (SmolLM2's activations fit).
fn f16_round(x: f32) -> f32 {
    let b = x.to_bits();
    let exp = ((b >> 23) & 0xFF) as i32 - 127;
    if exp < -14 {
        // Subnormal f16: a fixed quantum of 2^-24.
        let q = 2f32.powi(-24);
        return (x / q).round_ties_even() * q;
    }
    // 10 stored mantissa bits: drop 13.
    f32::from_bits(b.wrapping_add(0xFFF + ((b >> 13) & 1)) & !0x1FFF)
}

fn rounded(dt: Dt, v: Vec<f32>) -> Vec<f32> {
    if dt == Dt::Fp8 {
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        if max == 0.0 || !max.is_finite() {
            return v;
        }
        let scale = max / 448.0;
        return v.into_iter().map(|x| e4m3(x / scale) * scale).collect();
    }
    v.into_iter().map(|x| round(dt, x)).collect()
}

/// A planted fault.
#[derive(Clone, Copy, Debug, Default)]
struct Faults {
    /// (layer, head, scale) on the attention output.
    head_scale: Option<(usize, usize, f32)>,
    /// (layer, a, b): attention output heads a and b exchanged.
    head_swap: Option<(usize, usize, usize)>,
    /// o_proj's input (attn_out) zeroed in this layer.
    zero_attn_out: Option<usize>,
    /// RoPE theta divided by this in every layer.
    rope_div: Option<f32>,
    /// Every RMSNorm's eps.
    eps: Option<f32>,
    /// (layer, token row, scale) on the FFN output: a fault confined to one row.
    row_scale: Option<(usize, usize, f32)>,
}

/// The simulated candidate's taps: (key, [n, width], values), in execution order.
fn simulate(file: &GgufFile, tokens: &[u32], dt: Dt, f: Faults) -> Vec<(String, usize, Vec<f32>)> {
    let c = ModelConfig::from_header(&file.header).unwrap();
    let (d, hd, nh, nkv, ff) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_dim);
    let n = tokens.len();
    let w = |name: &str| {
        let t = file.tensor(name).unwrap_or_else(|| panic!("no {name}"));
        rounded(dt, dequantize_to_vec(t.ty, file.tensor_data(t)).unwrap())
    };
    let eps = f.eps.unwrap_or(c.rms_eps);
    let norm = |x: &[f32], wt: &[f32]| {
        let ones = vec![1f32; d];
        let h = rounded(dt, ops::rms_norm(x, d, &ones, eps));
        h.chunks(d)
            .flat_map(|r| r.iter().zip(wt).map(|(&a, &b)| round(dt, a * b)).collect::<Vec<_>>())
            .collect::<Vec<f32>>()
    };
    let mm = |x: &[f32], wt: &[f32], k: usize, m: usize| rounded(dt, ops::matmul_t(x, n, k, wt, m));
    let mut out = Vec::new();
    let emb = w("token_embd.weight");
    let mut x: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| emb[t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    out.push(("embed".to_string(), d, x.clone()));
    for l in 0..c.n_layers {
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let key = |s: &str| format!("blk.{l}.{s}");
        let h = norm(&x, &w(&name("attn_norm")));
        out.push((key("attn_norm"), d, h.clone()));
        let mut q = mm(&h, &w(&name("attn_q")), d, nh * hd);
        let mut k = mm(&h, &w(&name("attn_k")), d, nkv * hd);
        let v = mm(&h, &w(&name("attn_v")), d, nkv * hd);
        let base = c.rope_base / f.rope_div.unwrap_or(1.0);
        for (t, (qt, kt)) in q.chunks_mut(nh * hd).zip(k.chunks_mut(nkv * hd)).enumerate() {
            ops::rope_norm(qt, hd, 0, t, c.rope_dim, base);
            ops::rope_norm(kt, hd, 0, t, c.rope_dim, base);
        }
        let q = rounded(dt, q);
        let k = rounded(dt, k);
        out.push((key("q"), nh * hd, q.clone()));
        out.push((key("k"), nkv * hd, k.clone()));
        out.push((key("v"), nkv * hd, v.clone()));
        let mut a = rounded(
            dt,
            ops::causal_attention(&q, &k, &v, n, nh, nkv, hd, hd, 1.0 / (hd as f64).sqrt()),
        );
        if let Some((fl, head, s)) = f.head_scale.filter(|h| h.0 == l) {
            let _ = fl;
            for row in a.chunks_mut(nh * hd) {
                for x in &mut row[head * hd..(head + 1) * hd] {
                    *x = round(dt, *x * s);
                }
            }
        }
        if let Some((_, ha, hb)) = f.head_swap.filter(|h| h.0 == l) {
            for row in a.chunks_mut(nh * hd) {
                for i in 0..hd {
                    row.swap(ha * hd + i, hb * hd + i);
                }
            }
        }
        if f.zero_attn_out == Some(l) {
            a.iter_mut().for_each(|x| *x = 0.0);
        }
        out.push((key("attn_out"), nh * hd, a.clone()));
        let p = mm(&a, &w(&name("attn_output")), nh * hd, d);
        out.push((key("attn_proj"), d, p.clone()));
        x = rounded(dt, ops::add(&x, &p));
        out.push((key("resid_attn"), d, x.clone()));
        let h = norm(&x, &w(&name("ffn_norm")));
        out.push((key("ffn_norm"), d, h.clone()));
        let g = mm(&h, &w(&name("ffn_gate")), d, ff);
        let u = mm(&h, &w(&name("ffn_up")), d, ff);
        out.push((key("ffn_gate"), ff, g.clone()));
        out.push((key("ffn_up"), ff, u.clone()));
        let act: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(&g, &u)| round(dt, round(dt, ops::silu(g as f64) as f32) * u))
            .collect();
        let mut o = mm(&act, &w(&name("ffn_down")), ff, d);
        if let Some((_, row, s)) = f.row_scale.filter(|r| r.0 == l) {
            for x in &mut o[row * d..(row + 1) * d] {
                *x = round(dt, *x * s);
            }
        }
        out.push((key("ffn_out"), d, o.clone()));
        x = rounded(dt, ops::add(&x, &o));
        out.push((key("resid_out"), d, x.clone()));
    }
    let h = norm(&x, &w("output_norm.weight"));
    out.push(("output_norm".to_string(), d, h.clone()));
    let lw = if c.tied_embeddings { emb } else { w("output.weight") };
    out.push(("logits".to_string(), c.vocab, mm(&h, &lw[..c.vocab * d], d, c.vocab)));
    out
}

/// Writes the taps as a format-1 dump in the dtype, declaring it in the metadata when `declare`.
fn write_dump(path: &Path, tokens: &[u32], dt: Dt, taps: &[(String, usize, Vec<f32>)], declare: bool) {
    let n = tokens.len();
    let mut header = serde_json::Map::new();
    let mut meta = serde_json::Map::new();
    meta.insert("llmdiff.format".into(), "1".into());
    meta.insert("tokens".into(), serde_json::to_string(tokens).unwrap().into());
    meta.insert("model".into(), "smollm2 (simulated candidate)".into());
    meta.insert("tp".into(), "1".into());
    meta.insert("mapping".into(), "{}".into());
    if declare {
        let name = match dt {
            Dt::Bf16 => "bf16",
            Dt::F16 => "f16",
            Dt::Fp8 => "fp8-e4m3",
        };
        meta.insert("llmdiff.compute_dtype".into(), name.into());
    }
    header.insert("__metadata__".into(), serde_json::Value::Object(meta));
    let mut data = Vec::new();
    for (k, width, v) in taps {
        let start = data.len();
        for &x in v {
            match dt {
                Dt::Bf16 => data.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
                Dt::F16 => data.extend_from_slice(&half_bits(x).to_le_bytes()),
                // Scaled e4m3 values: stored as f32 (safetensors has no scaled fp8).
                Dt::Fp8 => data.extend_from_slice(&x.to_le_bytes()),
            }
        }
        header.insert(
            k.clone(),
            serde_json::json!({
                "dtype": match dt {
                    Dt::Bf16 => "BF16",
                    Dt::F16 => "F16",
                    Dt::Fp8 => "F32",
                },
                "shape": [n, width],
                "data_offsets": [start, data.len()],
            }),
        );
    }
    let h = serde_json::to_string(&serde_json::Value::Object(header)).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, bytes).unwrap();
}

/// The f16 bits of an f16-representable f32.
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let a = x.abs();
    if a == 0.0 {
        return sign;
    }
    let exp = ((b >> 23) & 0xFF) as i32 - 127;
    if exp < -14 {
        return sign | (a / 2f32.powi(-24)).round() as u16;
    }
    let mant = ((b >> 13) & 0x3FF) as u16;
    sign | (((exp + 15) as u16) << 10) | mant
}

const TOKENS: [u32; 12] = [1, 9690, 314, 253, 5356, 28, 2638, 30, 378, 2260, 282, 4238];

fn diff_sim(dir: &Path, name: &str, dt: Dt, f: Faults) -> DiffRun {
    diff_sim_with(dir, name, dt, f, true, Tolerances::default())
}

fn diff_sim_with(dir: &Path, name: &str, dt: Dt, f: Faults, declare: bool, tolerances: Tolerances) -> DiffRun {
    diff_sim_tokens(dir, name, &TOKENS, dt, f, declare, tolerances)
}

fn diff_sim_tokens(
    dir: &Path,
    name: &str,
    tokens: &[u32],
    dt: Dt,
    f: Faults,
    declare: bool,
    tolerances: Tolerances,
) -> DiffRun {
    let file = GgufFile::open(smollm2()).unwrap();
    let taps = simulate(&file, tokens, dt, f);
    let path: PathBuf = dir.join(format!("{name}.safetensors"));
    write_dump(&path, tokens, dt, &taps, declare);
    let dump = Dump::open(&[path]).unwrap();
    let plan = DiffPlan {
        file: &file,
        model_name: "smollm2".into(),
        tokens: dump.tokens.clone(),
        engine: engine::EngineOptions::default(),
        tolerances,
        dtype: ActDtype::F32,
        stop_at_first: false,
        full_weights: false,
        decode_steps: 0,
        repro: String::new(),
    };
    run_diff_candidate(&plan, &dump).unwrap()
}

fn class_at(run: &DiffRun) -> (String, String, String) {
    let f = run.first_divergence.as_ref().expect("diverged");
    let d = run.diagnosis.as_ref().expect("diagnosed");
    (f.tap.clone(), d.class.clone(), d.explanation.clone())
}

/// Worst healthy local error over u·rho (the noise model's calibration figure), and the row.
fn worst_ratio(run: &DiffRun) -> (f64, String) {
    let u = run.dtype.as_ref().unwrap().unit_roundoff;
    run.taps
        .iter()
        .filter_map(|t| t.local.as_ref().map(|l| (l.rel_l2 / (u * l.rho), t.tap.clone())))
        .fold((0.0, String::new()), |a, b| if b.0 > a.0 { b } else { a })
}

#[test]
fn bf16_candidate_healthy_and_faults() {
    let dir = tempfile::tempdir().unwrap();
    let healthy = diff_sim(dir.path(), "healthy", Dt::Bf16, Faults::default());
    let dtype = healthy.dtype.as_ref().unwrap();
    assert_eq!((dtype.name.as_str(), dtype.source.as_str()), ("bf16", "dump metadata"));
    let (ratio, at) = worst_ratio(&healthy);
    let worst_e2e = healthy.taps.iter().map(|t| t.metrics.rel_l2).fold(0f64, f64::max);
    eprintln!("bf16 healthy: worst local/(u·rho) {ratio:.3} at {at}; worst end-to-end rel_l2 {worst_e2e:.2e}");
    assert_eq!(
        healthy.verdict, "agree",
        "{:?} {:?}",
        healthy.first_divergence, healthy.diagnosis
    );
    // Every tap but the embedding's lookup has inputs: all are judged locally.
    let local = healthy.taps.iter().filter(|t| t.local.is_some()).count();
    assert_eq!(local, healthy.taps.len(), "every tap of a full dump has a local error");
    assert!(
        worst_e2e > 1e-2,
        "bf16 drifts end to end (worst {worst_e2e:e}), which the old rule flagged"
    );

    for (scale, name) in [(1.05f32, "head-1.05"), (1.02, "head-1.02")] {
        let run = diff_sim(
            dir.path(),
            name,
            Dt::Bf16,
            Faults {
                head_scale: Some((12, 4, scale)),
                ..Faults::default()
            },
        );
        let (tap, class, why) = class_at(&run);
        assert_eq!(
            (tap.as_str(), class.as_str()),
            ("blk.12.attn_out", "scale-mismatch"),
            "{why}"
        );
        assert!(why.contains("head 4 is off by a scale of"), "{why}");
        let fitted = run.head_profile.as_ref().unwrap().heads[4].scale;
        assert!((fitted - scale as f64).abs() < 5e-3, "fitted {fitted}");
    }

    let run = diff_sim(
        dir.path(),
        "swap",
        Dt::Bf16,
        Faults {
            head_swap: Some((7, 2, 5)),
            ..Faults::default()
        },
    );
    let (tap, class, why) = class_at(&run);
    assert_eq!(
        (tap.as_str(), class.as_str()),
        ("blk.7.attn_out", "head-permutation"),
        "{why}"
    );

    let run = diff_sim(
        dir.path(),
        "zero",
        Dt::Bf16,
        Faults {
            zero_attn_out: Some(3),
            ..Faults::default()
        },
    );
    let (tap, class, why) = class_at(&run);
    assert_eq!(
        (tap.as_str(), class.as_str()),
        ("blk.3.attn_out", "stale-output"),
        "{why}"
    );

    let run = diff_sim(
        dir.path(),
        "rope",
        Dt::Bf16,
        Faults {
            rope_div: Some(10.0),
            ..Faults::default()
        },
    );
    let (tap, class, why) = class_at(&run);
    assert_eq!((tap.as_str(), class.as_str()), ("blk.0.q", "rope"), "{why}");

    let run = diff_sim(
        dir.path(),
        "eps",
        Dt::Bf16,
        Faults {
            eps: Some(1e-2),
            ..Faults::default()
        },
    );
    let (tap, class, why) = class_at(&run);
    assert_eq!(
        (tap.as_str(), class.as_str()),
        ("blk.0.attn_norm", "config-drift"),
        "{why}"
    );
    assert!(why.contains("rms eps"), "{why}");
}

#[test]
fn f16_candidate_healthy_agrees_and_a_head_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let healthy = diff_sim(dir.path(), "healthy16", Dt::F16, Faults::default());
    let (ratio, at) = worst_ratio(&healthy);
    eprintln!("f16 healthy: worst local/(u·rho) {ratio:.3} at {at}");
    assert_eq!(healthy.dtype.as_ref().unwrap().name, "f16");
    assert_eq!(
        healthy.verdict, "agree",
        "{:?} {:?}",
        healthy.first_divergence, healthy.diagnosis
    );
    let run = diff_sim(
        dir.path(),
        "head16",
        Dt::F16,
        Faults {
            head_scale: Some((20, 1, 1.01)),
            ..Faults::default()
        },
    );
    let (tap, class, why) = class_at(&run);
    assert_eq!(
        (tap.as_str(), class.as_str()),
        ("blk.20.attn_out", "scale-mismatch"),
        "{why}"
    );
}

#[test]
fn baseline_and_patterns_set_the_bounds_and_the_dtype_comes_from_the_tensors() {
    let dir = tempfile::tempdir().unwrap();
    // No llmdiff.compute_dtype: the tensors' BF16 dtype names it.
    let healthy = diff_sim_with(
        dir.path(),
        "h",
        Dt::Bf16,
        Faults::default(),
        false,
        Tolerances::default(),
    );
    let d = healthy.dtype.as_ref().unwrap();
    assert_eq!((d.name.as_str(), d.source.as_str()), ("bf16", "dump tensor dtypes"));
    assert_eq!(healthy.verdict, "agree");
    // A healthy baseline: every tap's bound is 3 × its healthy local error.
    let mut t = Tolerances::default();
    for row in &healthy.taps {
        t.add_baseline(
            &row.tap,
            Baseline {
                local: row.local.as_ref().map(|l| l.rel_l2),
                end_to_end: row.metrics.rel_l2,
            },
        );
        for h in row.local.iter().flat_map(|l| &l.heads) {
            t.add_head_baseline(&row.tap, h.head, h.rel_l2);
        }
    }
    let healthy_heads = &healthy
        .taps
        .iter()
        .find(|r| r.tap == "blk.12.attn_out")
        .unwrap()
        .local
        .as_ref()
        .unwrap()
        .heads;
    assert_eq!(
        healthy_heads.len(),
        9,
        "attn_out's per-head profile is in the run document"
    );
    let again = diff_sim_with(dir.path(), "h2", Dt::Bf16, Faults::default(), false, t.clone());
    assert_eq!(again.verdict, "agree");
    let row = again.taps.iter().find(|r| r.tap == "blk.12.attn_out").unwrap();
    let l = row.local.as_ref().unwrap();
    assert_eq!(l.source, "baseline");
    let seen = healthy.taps.iter().find(|r| r.tap == "blk.12.attn_out").unwrap();
    let want = (BASELINE_MARGIN * seen.local.as_ref().unwrap().rel_l2).max(5e-5);
    assert_eq!(l.bound, want);
    let faulty = Faults {
        head_scale: Some((12, 4, 1.05)),
        ..Faults::default()
    };
    let run = diff_sim_with(dir.path(), "f", Dt::Bf16, faulty, false, t.clone());
    assert_eq!(run.first_divergence.as_ref().unwrap().tap, "blk.12.attn_out");
    // The per-head profile is held to each head's own healthy error × the margin.
    let profile = run.head_profile.as_ref().expect("a head profile at the divergence");
    for (h, seen) in profile.heads.iter().zip(healthy_heads) {
        assert_eq!(h.head, seen.head);
        assert_eq!(h.bound, (BASELINE_MARGIN * seen.rel_l2).max(5e-5), "head {}", h.head);
    }
    let over: Vec<usize> = profile
        .heads
        .iter()
        .filter(|h| h.rel_l2 > h.bound)
        .map(|h| h.head)
        .collect();
    assert_eq!(over, vec![4], "{profile:?}");
    // A pattern loosening every attention output hides it; one for another layer does not.
    let mut loose = t.clone();
    loose.set("blk.*.attn_out=0.2").unwrap();
    let run = diff_sim_with(dir.path(), "f2", Dt::Bf16, faulty, false, loose);
    assert_ne!(
        run.first_divergence.as_ref().map(|f| f.tap.as_str()),
        Some("blk.12.attn_out")
    );
    let mut other = t;
    other.set("blk.1?.q=0.2").unwrap();
    let run = diff_sim_with(dir.path(), "f3", Dt::Bf16, faulty, false, other);
    assert_eq!(run.first_divergence.as_ref().unwrap().tap, "blk.12.attn_out");
}

/// On a longer prompt the local error of a healthy tap is estimated on a sample of token rows
/// (harness/src/local_rows.rs) and the verdict stays; a fault confined to one token row, sized
/// at twice what the exact rule can see (its row error spread over every row is 2 × the tap's
/// bound), is still localized at its tap, decided on the full replay.
#[test]
fn sampled_rows_keep_the_verdict_and_a_one_row_fault_is_found() {
    let dir = tempfile::tempdir().unwrap();
    let tokens: Vec<u32> = (0..60).map(|i| 100 + 37 * i).collect();
    let n = tokens.len();
    let sim =
        |name: &str, f: Faults| diff_sim_tokens(dir.path(), name, &tokens, Dt::Bf16, f, true, Tolerances::default());
    let healthy = sim("long", Faults::default());
    assert_eq!(
        healthy.verdict, "agree",
        "{:?} {:?}",
        healthy.first_divergence, healthy.diagnosis
    );
    let sampled = healthy
        .taps
        .iter()
        .filter(|t| t.local.as_ref().is_some_and(|l| l.rows.is_some_and(|r| r < n)))
        .count();
    assert!(
        sampled * 10 >= healthy.taps.len() * 9,
        "{sampled} of {} taps sampled",
        healthy.taps.len()
    );
    let bound = healthy
        .taps
        .iter()
        .find(|t| t.tap == "blk.20.ffn_out")
        .and_then(|t| t.local.as_ref())
        .unwrap()
        .bound;
    // The row's share of the tap's norm sizes the fault: scaling row r by s adds a local error
    // of (s − 1)·‖y_r‖/‖y‖, set to 2 × the bound.
    let file = GgufFile::open(smollm2()).unwrap();
    let taps = simulate(&file, &tokens, Dt::Bf16, Faults::default());
    let y = &taps.iter().find(|t| t.0 == "blk.20.ffn_out").unwrap().2;
    let d = y.len() / n;
    let norm2 = |v: &[f32]| v.iter().map(|&x| x as f64 * x as f64).sum::<f64>();
    for row in [0, 31, 59] {
        let share = (norm2(&y[row * d..(row + 1) * d]) / norm2(y)).sqrt();
        let scale = 1.0 + 2.0 * bound / share;
        let run = sim(
            &format!("row{row}"),
            Faults {
                row_scale: Some((20, row, scale as f32)),
                ..Faults::default()
            },
        );
        let first = run.first_divergence.as_ref().map(|f| f.tap.as_str());
        assert_eq!(first, Some("blk.20.ffn_out"), "row {row}, scale {scale}");
        let local = run
            .taps
            .iter()
            .find(|t| t.tap == "blk.20.ffn_out")
            .unwrap()
            .local
            .clone()
            .unwrap();
        assert!(local.rows.is_none(), "decided on every row: {local:?}");
        assert!(local.rel_l2 > local.bound, "{local:?}");
    }
}

/// FP8: a synthetic candidate whose every tensor is rounded to e4m3 with a per-tensor scale, its
/// metadata naming fp8-e4m3, gets fp8's bound (u = 2^-4, and the accumulator term on its sums):
/// healthy agrees, where bf16's bound would flag it; o_proj's input zeroed and two heads
/// swapped are each localized at their tap.
#[test]
fn fp8_candidate_gets_fp8s_bound() {
    let dir = tempfile::tempdir().unwrap();
    let healthy = diff_sim(dir.path(), "fp8", Dt::Fp8, Faults::default());
    let d = healthy.dtype.as_ref().unwrap();
    assert_eq!((d.name.as_str(), d.source.as_str()), ("fp8-e4m3", "dump metadata"));
    assert_eq!(d.unit_roundoff, 2f64.powi(-4));
    let (ratio, at) = worst_ratio(&healthy);
    eprintln!("fp8 healthy: worst local/(u·rho) {ratio:.3} at {at}");
    assert_eq!(
        healthy.verdict, "agree",
        "{:?} {:?}",
        healthy.first_divergence, healthy.diagnosis
    );
    // The same values judged at bf16's u would be far over: the dtype is what lets it pass.
    let worst_local = healthy
        .taps
        .iter()
        .filter_map(|t| t.local.as_ref())
        .map(|l| l.rel_l2 / l.rho)
        .fold(0f64, f64::max);
    assert!(worst_local > 1.5 * 2f64.powi(-8) * 4.0, "{worst_local}");
    for (name, f, tap) in [
        (
            "zero",
            Faults {
                zero_attn_out: Some(9),
                ..Faults::default()
            },
            "blk.9.attn_out",
        ),
        (
            "swap",
            Faults {
                head_swap: Some((14, 2, 7)),
                ..Faults::default()
            },
            "blk.14.attn_out",
        ),
    ] {
        let run = diff_sim(dir.path(), name, Dt::Fp8, f);
        assert_eq!(
            run.first_divergence.as_ref().map(|f| f.tap.as_str()),
            Some(tap),
            "{name}"
        );
    }
}
