//! Property tests, one per input kind a user or a foreign party controls: golden files, run
//! documents (RUN.json), candidate dump headers and server responses. Each case mutates a valid
//! input and asserts: no panic; no heap growth beyond a bound set by the input's own size (a
//! counting allocator measures the peak); and no acceptance of an input known to be invalid.
//!
//! Cases: `PROPTEST_CASES` (default 256 per target, about a second in all, so CI stays fast); seed: `PROPTEST_RNG_SEED`
//! (CI fixes it).

use proptest::prelude::*;
use serde_json::{json, Value};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// The system allocator, counting each thread's live bytes and their peak since the last reset
/// (per thread, so that other tests' threads do not count; the code under test here runs on the
/// calling thread).
struct Counting;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

// SAFETY: forwards to the system allocator; the counters are const-initialized thread-locals
// without destructors, so touching them never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the system allocator's.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            let _ = LIVE.try_with(|live| {
                let now = live.get() + l.size() as isize;
                live.set(now);
                let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
            });
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) };
        let _ = LIVE.try_with(|live| live.set(live.get() - l.size() as isize));
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The targets run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Runs `f` and returns its result with the peak heap growth it caused on this thread, in bytes.
fn peak_growth<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let r = f();
    (r, (PEAK.with(Cell::get) - base).max(0) as usize)
}

/// Heap a check of an input of `n` bytes may take: the input parsed a few times over, plus a
/// fixed allowance. A size read from the input and trusted (a 200000-head matrix) blows it.
fn bound(n: usize) -> usize {
    64 * n + (32 << 20)
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(256);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A number of the kinds that break parsers and checks.
fn hostile_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(-1.0)),
        Just(json!(0.0)),
        Just(json!(-1e300)),
        Just(json!(1e300)),
        Just(json!(4294967295u64)),
        Just(json!(u64::MAX)),
        Just(json!(300000000u64)),
        Just(Value::Null),
        Just(json!("x")),
        Just(json!([])),
        (-1e6f64..1e6).prop_map(|x| json!(x)),
        (0u64..1 << 20).prop_map(|x| json!(x)),
    ]
}

// ------------------------------------------------------------------------------------------------
// Golden files.

fn base_golden() -> &'static Value {
    static G: OnceLock<Value> = OnceLock::new();
    G.get_or_init(|| {
        let p = repo().join("golden/gate-deepseek-v3-mini-cpu-tp2.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    })
}

/// A mutation of a golden file, and whether it makes the file invalid for certain.
#[derive(Clone, Debug)]
enum GoldenEdit {
    Threshold(&'static str, f64),
    ServerThreshold(&'static str, f64),
    TruncatePositions(usize),
    EmptyTop(usize),
    TapName(String),
    Field(&'static str, Value),
    NoPrompts,
}

fn golden_edit() -> impl Strategy<Value = GoldenEdit> {
    prop_oneof![
        (
            prop::sample::select(vec!["tap_rel", "logprob_abs", "entropy_abs"]),
            -1e9f64..1e9
        )
            .prop_map(|(f, x)| GoldenEdit::Threshold(f, x)),
        (
            prop::sample::select(vec!["kld_position", "kld_mean", "min_top1_pct", "tie_margin"]),
            -1e9f64..1e9
        )
            .prop_map(|(f, x)| GoldenEdit::ServerThreshold(f, x)),
        (0usize..8).prop_map(GoldenEdit::TruncatePositions),
        (0usize..8).prop_map(GoldenEdit::EmptyTop),
        "[ -~\u{1b}\r\n]{0,24}".prop_map(GoldenEdit::TapName),
        (
            prop::sample::select(vec![
                "tp",
                "vocab",
                "model_sha256",
                "backend",
                "format",
                "n_continuation"
            ]),
            hostile_number()
        )
            .prop_map(|(f, v)| GoldenEdit::Field(f, v)),
        Just(GoldenEdit::NoPrompts),
    ]
}

/// Applies `e`; returns whether this edit alone breaks an invariant (a later edit may undo it,
/// so the test judges the final file with [`golden_invalid`]).
fn apply_golden(g: &mut Value, e: &GoldenEdit) -> bool {
    let n_pos = g["prompts"][0]["positions"].as_array().map_or(0, |a| a.len());
    let n_taps = g["prompts"][0]["taps"].as_array().map_or(0, |a| a.len());
    match e {
        GoldenEdit::TruncatePositions(_) | GoldenEdit::EmptyTop(_) if n_pos == 0 => false,
        GoldenEdit::TapName(_) if n_taps == 0 => false,
        GoldenEdit::Threshold(f, x) => {
            g["thresholds"][*f] = json!(x);
            *x < 0.0
        }
        GoldenEdit::ServerThreshold(f, x) => {
            g["thresholds"]["server"][*f] = json!(x);
            *x < 0.0 || (*f == "min_top1_pct" && *x > 100.0)
        }
        GoldenEdit::TruncatePositions(k) => {
            g["prompts"][0]["positions"].as_array_mut().unwrap().truncate(*k);
            *k < n_pos
        }
        GoldenEdit::EmptyTop(i) => {
            let i = i % n_pos;
            g["prompts"][0]["positions"][i]["top"] = json!([]);
            true
        }
        GoldenEdit::TapName(s) => {
            g["prompts"][0]["taps"][0]["tap"] = json!(s);
            s.parse::<references::tap::TapKey>().is_err()
        }
        GoldenEdit::Field(f, v) => {
            g[*f] = v.clone();
            match *f {
                "tp" => v.as_u64() == Some(0) || !v.is_u64(),
                "model_sha256" => true,
                "backend" => true,
                _ => false,
            }
        }
        GoldenEdit::NoPrompts => {
            g["prompts"] = json!([]);
            true
        }
    }
}

/// Whether a golden file breaks an invariant the reader must enforce (judged on the JSON, apart
/// from the reader's code).
fn golden_invalid(g: &Value) -> bool {
    let neg = |v: &Value| v.as_f64().is_some_and(|x| x < 0.0);
    let t = &g["thresholds"];
    if ["tap_rel", "logprob_abs", "entropy_abs"].iter().any(|f| neg(&t[*f]))
        || ["kld_position", "kld_mean", "min_top1_pct", "tie_margin"]
            .iter()
            .any(|f| neg(&t["server"][*f]))
        || t["server"]["min_top1_pct"].as_f64().is_some_and(|x| x > 100.0)
    {
        return true;
    }
    let sha_ok = g["model_sha256"]
        .as_str()
        .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()));
    let backend_ok = matches!(g["backend"].as_str(), Some("reference" | "cpu"));
    if !sha_ok || !backend_ok || !g["tp"].is_u64() || g["tp"].as_u64() == Some(0) {
        return true;
    }
    let Some(prompts) = g["prompts"].as_array() else {
        return true;
    };
    if prompts.is_empty() {
        return true;
    }
    prompts.iter().any(|p| {
        let n = p["tokens"].as_array().map_or(0, |a| a.len());
        let pos = p["positions"].as_array().cloned().unwrap_or_default();
        pos.len() != n
            || pos.iter().any(|q| q["top"].as_array().is_some_and(|a| a.is_empty()))
            || p["taps"].as_array().into_iter().flatten().any(|t| {
                t["tap"]
                    .as_str()
                    .is_some_and(|s| s.parse::<references::tap::TapKey>().is_err())
            })
    })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn golden_files_never_pass_invalid_never_panic(edits in prop::collection::vec(golden_edit(), 1..4)) {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut g = base_golden().clone();
        let mut last_breaks = false;
        for e in &edits {
            last_breaks = apply_golden(&mut g, e);
        }
        let invalid = golden_invalid(&g);
        // The oracle agrees with the edit that nothing came after.
        prop_assert!(!last_breaks || invalid, "the last edit broke the file but the oracle missed it: {edits:?}");
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("gate-x.json");
        let text = serde_json::to_string(&g).unwrap();
        std::fs::write(&p, &text).unwrap();
        let (r, grew) = peak_growth(|| harness::golden::read_golden(&p));
        prop_assert!(grew <= bound(text.len()), "read_golden took {grew} bytes for {} bytes", text.len());
        if invalid {
            prop_assert!(r.is_err(), "accepted an invalid golden file: {edits:?}");
        }
        if let Ok(g) = r {
            prop_assert!(g.validate().is_ok());
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Run documents (RUN.json).

fn base_run() -> &'static Value {
    static R: OnceLock<Value> = OnceLock::new();
    R.get_or_init(|| {
        use harness::compare::{ActDtype, Tolerances};
        use harness::diff::{run_diff, DiffPlan};
        let file = references::GgufFile::open(repo().join("golden/deepseek-v3-tiny.f32.gguf")).unwrap();
        let plan = DiffPlan {
            file: &file,
            model_name: "tiny".into(),
            tokens: vec![1, 2, 3],
            engine: engine::EngineOptions {
                tp: 2,
                faults: vec!["f16-residual".parse().unwrap()],
                ..engine::EngineOptions::default()
            },
            tolerances: Tolerances::default(),
            dtype: ActDtype::F32,
            stop_at_first: false,
            full_weights: false,
            decode_steps: 0,
            repro: "llmdiff diff-layers tiny.gguf".into(),
        };
        serde_json::to_value(run_diff(&plan).unwrap()).unwrap()
    })
}

#[derive(Clone, Debug)]
enum RunEdit {
    TapLayer(usize, Value),
    TapRank(usize, Value),
    Heads(Value, usize),
    Tp(Value),
    RoutingLayer(Value),
    Verdict(String),
    NoTaps,
}

fn run_edit() -> impl Strategy<Value = RunEdit> {
    prop_oneof![
        (0usize..200, hostile_number()).prop_map(|(i, v)| RunEdit::TapLayer(i, v)),
        (0usize..200, hostile_number()).prop_map(|(i, v)| RunEdit::TapRank(i, v)),
        (hostile_number(), 0usize..40).prop_map(|(n, k)| RunEdit::Heads(n, k)),
        hostile_number().prop_map(RunEdit::Tp),
        hostile_number().prop_map(RunEdit::RoutingLayer),
        "[a-z]{0,9}".prop_map(RunEdit::Verdict),
        Just(RunEdit::NoTaps),
    ]
}

/// Applies `e`; returns whether this edit alone breaks an invariant (a later edit may undo it,
/// so the test judges the final document with [`run_invalid`]).
fn apply_run(d: &mut Value, e: &RunEdit) -> bool {
    let n = d["taps"].as_array().map_or(0, |t| t.len());
    let tp = d["tp"].as_u64().unwrap_or(1);
    match e {
        RunEdit::TapLayer(i, v) if n > 0 => {
            d["taps"][i % n]["layer"] = v.clone();
            v.as_u64().is_some_and(|l| l >= n as u64)
        }
        RunEdit::TapRank(i, v) if n > 0 => {
            d["taps"][i % n]["rank"] = v.clone();
            v.as_u64().is_some_and(|r| r >= tp)
        }
        RunEdit::Heads(nh, k) => {
            d["heads"] = json!({"tap": "x", "n_heads": nh, "cosine": vec![1.0; *k]});
            nh.as_u64().is_some_and(|h| h.checked_mul(h) != Some(*k as u64))
        }
        RunEdit::Tp(v) => {
            d["tp"] = v.clone();
            v.as_u64() == Some(0) || v.as_u64().is_some_and(|t| t > 4096)
        }
        RunEdit::RoutingLayer(v) => {
            d["routing"] = json!([{"layer": v, "agree_frac": 1.0}]);
            v.as_u64().is_some_and(|l| l >= n as u64)
        }
        RunEdit::Verdict(s) => {
            d["verdict"] = json!(s);
            s != "agree" && s != "diverged"
        }
        RunEdit::NoTaps => {
            d["taps"] = json!([]);
            true
        }
        _ => false,
    }
}

/// Whether a run document breaks an invariant `DiffRun::validate` must enforce.
fn run_invalid(d: &Value) -> bool {
    let taps = d["taps"].as_array().cloned().unwrap_or_default();
    let n = taps.len() as u64;
    let tp = d["tp"].as_u64();
    if n == 0 || !d["tp"].is_u64() || tp == Some(0) || tp.is_some_and(|t| t > 4096) {
        return true;
    }
    if !matches!(d["verdict"].as_str(), Some("agree" | "diverged")) {
        return true;
    }
    let tp = tp.unwrap_or(u64::MAX);
    if taps
        .iter()
        .any(|t| t["layer"].as_u64().is_some_and(|l| l >= n) || t["rank"].as_u64().is_some_and(|r| r >= tp))
    {
        return true;
    }
    if d["routing"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|r| r["layer"].as_u64().is_some_and(|l| l >= n))
    {
        return true;
    }
    let h = &d["heads"];
    if let (Some(nh), Some(c)) = (h["n_heads"].as_u64(), h["cosine"].as_array()) {
        if nh.checked_mul(nh) != Some(c.len() as u64) {
            return true;
        }
    }
    false
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn run_documents_never_pass_invalid_never_panic(edits in prop::collection::vec(run_edit(), 1..4)) {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let mut d = base_run().clone();
        let mut last_breaks = false;
        for e in &edits {
            last_breaks = apply_run(&mut d, e);
        }
        let invalid = run_invalid(&d);
        prop_assert!(!last_breaks || invalid, "the last edit broke the document but the oracle missed it: {edits:?}");
        let text = serde_json::to_string(&d).unwrap();
        let (r, grew) = peak_growth(|| {
            let run: reports::DiffRun = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            run.validate()?;
            Ok::<usize, String>(reports::render_diff(&run).len())
        });
        prop_assert!(grew <= bound(text.len()), "took {grew} bytes for {} bytes", text.len());
        if invalid {
            prop_assert!(r.is_err(), "accepted an invalid run document: {edits:?}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Candidate dump headers.

#[derive(Clone, Debug)]
struct DumpCase {
    tokens: Vec<u32>,
    tensors: Vec<(String, usize, usize, String)>,
    tp: String,
    lie_offsets: bool,
}

fn dump_case() -> impl Strategy<Value = DumpCase> {
    let name = prop_oneof![
        Just("embed".to_string()),
        Just("logits".to_string()),
        Just("output_norm".to_string()),
        (
            0u32..6,
            prop::sample::select(vec!["attn_out", "attn_norm", "resid_out", "q", "ffn_gate", "moe_topk"])
        )
            .prop_map(|(l, s)| format!("blk.{l}.{s}")),
        (0u32..6, 0u32..4).prop_map(|(l, r)| format!("blk.{l}.attn_out@r{r}")),
        "[ -~]{0,12}",
    ];
    (
        prop::collection::vec(0u32..600, 1..6),
        prop::collection::vec(
            (
                name,
                0usize..8,
                0usize..200,
                prop::sample::select(vec!["F32", "F16", "I64"]),
            ),
            1..4,
        ),
        prop::sample::select(vec!["1", "2", "0", "x", "99999999999"]),
        any::<bool>(),
    )
        .prop_map(|(tokens, t, tp, lie_offsets)| DumpCase {
            tokens,
            tensors: t.into_iter().map(|(n, r, w, d)| (n, r, w, d.to_string())).collect(),
            tp: tp.to_string(),
            lie_offsets,
        })
}

fn write_dump(path: &Path, c: &DumpCase) -> usize {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        json!({"llmdiff.format": "1", "tokens": serde_json::to_string(&c.tokens).unwrap(), "model": "m",
               "tp": c.tp, "mapping": "{}"}),
    );
    let mut data: Vec<u8> = Vec::new();
    for (name, rows, width, dtype) in &c.tensors {
        let es = if dtype == "F32" {
            4
        } else if dtype == "F16" {
            2
        } else {
            8
        };
        let start = data.len();
        data.resize(start + rows * width * es, 0);
        let end = if c.lie_offsets { start + (1 << 40) } else { data.len() };
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": [rows, width], "data_offsets": [start, end]}),
        );
    }
    let h = serde_json::to_string(&Value::Object(header)).unwrap();
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(h.as_bytes());
    bytes.extend_from_slice(&data);
    std::fs::write(path, &bytes).unwrap();
    bytes.len()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn dump_headers_never_pass_invalid_never_panic(c in dump_case()) {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        static CONFIG: OnceLock<references::ModelConfig> = OnceLock::new();
        let config = CONFIG.get_or_init(|| {
            let f = references::GgufFile::open(repo().join("golden/deepseek-v3-tiny.f32.gguf")).unwrap();
            references::ModelConfig::from_header(&f.header).unwrap()
        });
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.safetensors");
        let size = write_dump(&p, &c);
        let (r, grew) = peak_growth(|| {
            let d = harness::dump::Dump::open(std::slice::from_ref(&p))?;
            d.check_model(config)?;
            for k in d.keys() {
                d.tensor(k, config)?;
            }
            anyhow::Ok(())
        });
        prop_assert!(grew <= bound(size), "took {grew} bytes for a {size}-byte dump");
        let beyond_model = c.tensors.iter().any(|(n, ..)| {
            n.parse::<references::tap::TapKey>().is_ok_and(|k| k.layer.is_some_and(|l| l as usize >= config.n_layers))
        });
        let bad_token = c.tokens.iter().any(|&t| t as usize >= config.vocab);
        if beyond_model || bad_token || c.lie_offsets || c.tp == "0" || c.tp == "x" {
            prop_assert!(r.is_err(), "accepted an invalid dump: {c:?}");
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Server responses.

#[derive(Clone, Debug)]
struct Entry {
    top: Option<Vec<(String, f64)>>,
    logprob: Option<f64>,
}

fn entry() -> impl Strategy<Value = Entry> {
    let lp = prop_oneof![(-30.0f64..0.0), (-1.0f64..10.0), Just(0.0), Just(-1e300)];
    (
        prop::option::of(prop::collection::vec(("[a-z ]{1,4}", lp.clone()), 0..8)),
        prop::option::of(lp),
    )
        .prop_map(|(top, logprob)| Entry { top, logprob })
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn server_responses_never_pass_invalid_never_panic(entries in prop::collection::vec(entry(), 1..10), asked in 1usize..6) {
        use harness::server::{check_completion, min_listed, parse_completion, LOGPROB_SLACK};
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let toks: Vec<String> = (0..entries.len()).map(|i| format!("t{i}")).collect();
        let tops: Vec<Value> = entries
            .iter()
            .map(|e| match &e.top {
                None => Value::Null,
                Some(t) => Value::Object(t.iter().map(|(k, v)| (k.clone(), json!(v))).collect()),
            })
            .collect();
        let lps: Vec<Value> = entries.iter().map(|e| e.logprob.map_or(Value::Null, |x| json!(x))).collect();
        let body = json!({"choices": [{"text": toks.concat(),
            "logprobs": {"tokens": toks, "top_logprobs": tops, "token_logprobs": lps}}]})
        .to_string();
        let (r, grew) = peak_growth(|| parse_completion(&body).and_then(|c| check_completion(&c, asked).map(|_| c)));
        prop_assert!(grew <= bound(body.len()), "took {grew} bytes for {} bytes", body.len());
        if let Ok(c) = &r {
            for e in &c.entries {
                if let Some(t) = &e.top {
                    prop_assert!(t.len() >= min_listed(asked));
                    prop_assert!(t.iter().all(|(_, lp)| lp.is_finite() && *lp <= LOGPROB_SLACK));
                    prop_assert!(t.iter().map(|(_, lp)| lp.exp()).sum::<f64>() <= 1.0 + LOGPROB_SLACK);
                }
            }
        }
        // A listed positive logprob beyond the slack is never accepted.
        let positive = entries.iter().any(|e| {
            e.top.as_ref().is_some_and(|t| {
                // Duplicate keys collapse in a JSON object: the last value wins.
                let mut m = std::collections::HashMap::new();
                for (k, v) in t {
                    m.insert(k, *v);
                }
                m.values().any(|&v| v > LOGPROB_SLACK)
            })
        });
        if positive {
            prop_assert!(r.is_err(), "accepted a positive logprob");
        }
    }
}

#[test]
fn the_heap_bound_catches_a_size_taken_on_trust() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    // What an unvalidated 200000-head matrix would ask for, scaled down: 8 × 8192² bytes.
    let (v, grew) = peak_growth(|| vec![0u8; 8 * 8192 * 8192].len());
    assert_eq!(v, 8 * 8192 * 8192);
    assert!(grew > bound(1 << 16), "the counter missed {grew} bytes");
    let (_, small) = peak_growth(|| serde_json::to_string(&json!({"a": 1})).unwrap().len());
    assert!(small < 1 << 16, "{small}");
}
