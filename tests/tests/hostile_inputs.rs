//! Verdicts that cannot be fooled: one regression test per row of the hostile-input table (hand-
//! edited golden files, crafted dumps and run documents, a lying server, hostile paths and URLs).
//! Test `rowNN_…` is row NN. Bad input must be exit 2 with one line (here: `Err`), never a pass,
//! a panic, a hang or an allocation sized by a number in the file.

use harness::cli::Cli;
use llmdiff_tests::fixtures::golden;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn run(args: &[&str]) -> anyhow::Result<ExitCode> {
    let cli = <Cli as clap::Parser>::try_parse_from(std::iter::once("llmdiff").chain(args.iter().copied()))?;
    harness::commands::run(cli)
}

/// The one-line error of a run that must exit 2.
fn exit2(args: &[&str]) -> String {
    match run(args) {
        Ok(c) => panic!("expected exit 2, got {c:?} for {args:?}"),
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(!msg.contains('\n') || msg.starts_with("error:"), "not one line: {msg}");
            msg
        }
    }
}

/// A copy of a committed golden file with `edit` applied, in `dir/golden/` (as the gate expects).
fn edited_golden(dir: &Path, name: &str, edit: impl FnOnce(&mut Value)) -> PathBuf {
    let mut g: Value = serde_json::from_str(&std::fs::read_to_string(golden(name)).unwrap()).unwrap();
    edit(&mut g);
    std::fs::create_dir_all(dir.join("golden")).unwrap();
    let p = dir.join("golden").join(name);
    std::fs::write(&p, serde_json::to_string(&g).unwrap()).unwrap();
    p
}

const SYNTH_GOLDEN: &str = "gate-deepseek-v3-mini-reference.json";
/// Blessed on the cpu engine, so `--inject` applies.
const CPU_GOLDEN: &str = "gate-deepseek-v3-mini-cpu-tp2.json";
const SERVER_GOLDEN: &str = "gate-smollm2-server.json";

fn tiny_model() -> PathBuf {
    golden("deepseek-v3-tiny.f32.gguf")
}

/// A loopback server answering each connection with the next of `replies` (a full HTTP response
/// made by `reply(port)`), recording each request's bytes.
fn scripted_server(replies: Vec<Box<dyn Fn(u16) -> String + Send>>) -> (String, u16, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    listener.set_nonblocking(true).unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    std::thread::spawn(move || {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut i = 0;
        while i < replies.len() && Instant::now() < deadline {
            let Ok((mut s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf);
                if let Some(h) = text.find("\r\n\r\n") {
                    let len = text[..h]
                        .lines()
                        .find_map(|l| {
                            l.to_ascii_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().to_string())
                        })
                        .and_then(|v| v.parse::<usize>().ok())
                        .unwrap_or(0);
                    if buf.len() >= h + 4 + len {
                        break;
                    }
                }
            }
            log.lock().unwrap().push(String::from_utf8_lossy(&buf).into_owned());
            let _ = s.write_all(replies[i](port).as_bytes());
            i += 1;
        }
    });
    (format!("http://127.0.0.1:{port}"), port, seen)
}

fn http(status: &str, extra: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{extra}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

/// A completion of "A b c d" + " e f g h" with `top(i)` as entry i's top list (entry 0 null).
fn completion(top: impl Fn(usize) -> Value) -> String {
    let toks = ["A", " b", " c", " d", " e", " f", " g", " h"];
    let mut offs = Vec::new();
    let mut o = 0;
    for t in toks {
        offs.push(o);
        o += t.len();
    }
    let tops: Vec<Value> = (0..toks.len())
        .map(|i| if i == 0 { Value::Null } else { top(i) })
        .collect();
    let lps: Vec<Value> = (0..toks.len())
        .map(|i| if i == 0 { Value::Null } else { json!(-0.1) })
        .collect();
    json!({"choices": [{"text": toks.concat(), "index": 0,
        "logprobs": {"tokens": toks, "text_offset": offs, "token_logprobs": lps, "top_logprobs": tops}}],
        "usage": {"prompt_tokens": 4}})
    .to_string()
}

/// A healthy top-5 for entry i: its own token at −0.1 and four runners-up.
fn healthy_top(i: usize) -> Value {
    let toks = ["A", " b", " c", " d", " e", " f", " g", " h"];
    let mut m = serde_json::Map::new();
    m.insert(toks[i].to_string(), json!(-0.1));
    for j in 1..5 {
        m.insert(format!("x{i}_{j}"), json!(-3.0 - 0.5 * j as f64));
    }
    Value::Object(m)
}

fn prompts_file(dir: &Path) -> String {
    let p = dir.join("p.txt");
    std::fs::write(&p, "A b c d\n").unwrap();
    p.display().to_string()
}

fn entropy_server_args<'a>(url: &'a str, prompts: &'a str) -> Vec<&'a str> {
    vec![
        "entropy",
        "--server",
        url,
        "--prompts",
        prompts,
        "--vocab",
        "1000",
        "--max-new-tokens",
        "4",
        "--top-logprobs",
        "5",
        "--retries",
        "0",
    ]
}

/// A safetensors dump (format 1) of `tensors` (name, rows, width; values `fill`), on `tokens`.
fn write_dump(path: &Path, tokens: &[u32], tensors: &[(&str, usize, usize)], fill: f32) {
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        json!({"llmdiff.format": "1", "tokens": serde_json::to_string(tokens).unwrap(), "model": "m",
               "tp": "1", "mapping": "{}"}),
    );
    let mut data = Vec::new();
    for (name, rows, width) in tensors {
        let start = data.len();
        for _ in 0..rows * width {
            data.extend_from_slice(&fill.to_le_bytes());
        }
        header.insert(
            name.to_string(),
            json!({"dtype": "F32", "shape": [rows, width], "data_offsets": [start, data.len()]}),
        );
    }
    let h = serde_json::to_string(&Value::Object(header)).unwrap();
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(h.as_bytes()).unwrap();
    f.write_all(&data).unwrap();
}

/// A run document of the tiny model (the reference against the cpu engine), written once.
fn run_document(dir: &Path) -> Value {
    let out = dir.join("run.json");
    let m = tiny_model();
    let code = run(&[
        "diff-layers",
        m.to_str().unwrap(),
        "--tokens",
        "1,2,3",
        "--json-out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code.unwrap(), ExitCode::SUCCESS);
    serde_json::from_str(&std::fs::read_to_string(out).unwrap()).unwrap()
}

fn report_of(dir: &Path, name: &str, doc: &Value) -> anyhow::Result<ExitCode> {
    let p = dir.join(name);
    std::fs::write(&p, serde_json::to_string(doc).unwrap()).unwrap();
    let html = dir.join("r.html");
    run(&["report", p.to_str().unwrap(), "-o", html.to_str().unwrap()])
}

// ------------------------------------------------------------------------------------------------

#[test]
fn row01_negative_thresholds_are_exit_2_when_read() {
    let dir = tempfile::tempdir().unwrap();
    for field in ["tap_rel", "logprob_abs", "entropy_abs"] {
        let p = edited_golden(dir.path(), CPU_GOLDEN, |g| g["thresholds"][field] = json!(-1.0));
        let msg = exit2(&["gate", "--golden", p.to_str().unwrap(), "--inject", "f16-residual"]);
        assert!(msg.contains(field) && msg.contains(">= 0"), "{msg}");
    }
}

#[test]
fn row02_negative_server_thresholds_are_exit_2_before_any_request() {
    let dir = tempfile::tempdir().unwrap();
    let p =
        edited_golden(
            dir.path(),
            SERVER_GOLDEN,
            |g| {
                g["thresholds"]["server"] =
                    json!({"kld_position": -1, "kld_mean": -1, "min_top1_pct": -1e300, "tie_margin": 0.5})
            },
        );
    // Port 9 (discard) on loopback: nothing is asked of it, the file is refused first.
    let msg = exit2(&[
        "gate",
        "--server",
        "http://127.0.0.1:9",
        "--golden",
        p.to_str().unwrap(),
    ]);
    assert!(msg.contains("kld_position"), "{msg}");
}

#[test]
fn row03_positive_logprobs_or_mass_over_one_are_malformed() {
    use harness::server::{check_completion, parse_completion};
    let plus5 = completion(|i| {
        let mut t = healthy_top(i);
        for v in t.as_object_mut().unwrap().values_mut() {
            *v = json!(5.0);
        }
        t
    });
    let err = check_completion(&parse_completion(&plus5).unwrap(), 5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("entry 1") && err.contains("<= 0"), "{err}");
    // Each logprob ≤ 0 but Σp ≫ 1.
    let mass = completion(|i| {
        let mut t = healthy_top(i);
        for v in t.as_object_mut().unwrap().values_mut() {
            *v = json!(-0.01);
        }
        t
    });
    let err = check_completion(&parse_completion(&mass).unwrap(), 5)
        .unwrap_err()
        .to_string();
    assert!(err.contains("sum to"), "{err}");
    // The healthy one passes the same check.
    check_completion(&parse_completion(&completion(healthy_top)).unwrap(), 5).unwrap();
    // End to end: `entropy --server` is exit 2, not "healthy".
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path());
    let (url, _, _) = scripted_server(vec![Box::new(move |_| http("200 OK", "", &plus5))]);
    let msg = exit2(&entropy_server_args(&url, &p));
    assert!(msg.contains("malformed logprobs"), "{msg}");
}

#[test]
fn row04_a_tap_the_model_cannot_have_is_exit_2_and_zero_compared_never_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("d.safetensors");
    write_dump(&dump, &[1, 2, 3], &[("blk.999.attn_out", 3, 128)], 0.5);
    let m = tiny_model();
    let msg = exit2(&[
        "diff-layers",
        m.to_str().unwrap(),
        "--candidate",
        dump.to_str().unwrap(),
    ]);
    assert!(msg.contains("blk.999.attn_out") && msg.contains("3 layers"), "{msg}");
    // A run document claiming agreement over no tap is refused too.
    let mut doc = run_document(dir.path());
    doc["taps"] = json!([]);
    doc["first_divergence"] = Value::Null;
    doc["verdict"] = json!("agree");
    let msg = format!("{:#}", report_of(dir.path(), "empty.json", &doc).unwrap_err());
    assert!(msg.contains("no taps"), "{msg}");
}

#[test]
fn row05_every_float_option_is_validated() {
    let m = tiny_model();
    let m = m.to_str().unwrap();
    for bad in ["NaN", "inf", "-1", "1e400"] {
        let kld = format!("--kld-threshold={bad}");
        let msg = exit2(&["entropy", m, "--prompts", "p.txt", "--against-reference", &kld]);
        assert!(msg.contains("--kld-threshold") && msg.contains(bad), "{msg}");
        exit2(&["gate", "--golden", "g.json", "--server", "http://x", &kld]);
        let tap = format!("--tap-rel={bad}");
        let msg = exit2(&["golden", "bless", "--model", m, "--prompt", "a", "-o", "g.json", &tap]);
        assert!(msg.contains("--tap-rel"), "{msg}");
        let lp = format!("--logprob-abs={bad}");
        exit2(&["golden", "bless", "--model", m, "--prompt", "a", "-o", "g.json", &lp]);
    }
    exit2(&[
        "gate",
        "--golden",
        "g.json",
        "--server",
        "http://x",
        "--min-top1",
        "101",
    ]);
    let ok = <Cli as clap::Parser>::try_parse_from(["llmdiff", "entropy", m, "--prompts", "p", "--kld-threshold", "0"]);
    assert!(ok.is_ok(), "0 is a valid threshold");
}

#[test]
fn row06_a_golden_file_without_prompts_is_not_a_pass() {
    let dir = tempfile::tempdir().unwrap();
    let p = edited_golden(dir.path(), SYNTH_GOLDEN, |g| g["prompts"] = json!([]));
    let msg = exit2(&["gate", "--golden", p.to_str().unwrap()]);
    assert!(msg.contains("no prompts"), "{msg}");
}

#[test]
fn row07_printed_commands_are_shell_quoted() {
    use harness::output::shell_quote;
    assert_eq!(shell_quote("golden/m.gguf"), "golden/m.gguf");
    assert_eq!(
        shell_quote("a b;touch X;$(touch Y).gguf"),
        "'a b;touch X;$(touch Y).gguf'"
    );
    assert_eq!(shell_quote("it's"), "'it'\\''s'");
    assert_eq!(shell_quote(""), "''");
    // End to end: the repro of a run on a hostile model name, run by a shell, makes no file and
    // hands llmdiff the name unchanged.
    let dir = tempfile::tempdir().unwrap();
    let name = "a b;touch X;$(touch Y).gguf";
    let model = dir.path().join(name);
    std::fs::copy(tiny_model(), &model).unwrap();
    let out = dir.path().join("run.json");
    run(&[
        "diff-layers",
        model.to_str().unwrap(),
        "--tokens",
        "1,2",
        "--json-out",
        out.to_str().unwrap(),
    ])
    .unwrap();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let repro = doc["repro"].as_str().unwrap();
    let script = format!("llmdiff() {{ printf '%s\\n' \"$@\"; }}; {repro}");
    let sh = std::process::Command::new("sh")
        .arg("-c")
        .arg(&script)
        .current_dir(dir.path())
        .output()
        .unwrap();
    let args = String::from_utf8_lossy(&sh.stdout);
    assert!(args.lines().any(|l| l == model.to_str().unwrap()), "{args}");
    assert!(
        !dir.path().join("X").exists() && !dir.path().join("Y").exists(),
        "the repro ran injected commands"
    );
}

#[test]
fn row08_empty_top_logprobs_are_exit_2_not_a_panic() {
    use harness::server::{check_completion, parse_completion};
    let body = completion(|_| json!({}));
    let err = check_completion(&parse_completion(&body).unwrap(), 20)
        .unwrap_err()
        .to_string();
    assert!(err.contains("0 top logprobs where 20 were asked"), "{err}");
    let dir = tempfile::tempdir().unwrap();
    // The golden file has 8 prompts, sent 4 at a time: every connection gets the same answer, so
    // no request meets a closed listener (a reset would be reported instead of the bad body).
    let replies: Vec<Box<dyn Fn(u16) -> String + Send>> = (0..8)
        .map(|_| {
            let body = body.clone();
            Box::new(move |_| http("200 OK", "", &body)) as Box<dyn Fn(u16) -> String + Send>
        })
        .collect();
    let (url, _, _) = scripted_server(replies);
    let g = golden(SERVER_GOLDEN);
    let msg = exit2(&[
        "gate",
        "--server",
        &url,
        "--golden",
        g.to_str().unwrap(),
        "--retries",
        "0",
    ]);
    assert!(msg.contains("top logprobs where"), "{msg}");
    drop(dir);
}

#[test]
fn row09_sizes_from_a_run_document_are_bounded_by_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let base = run_document(dir.path());
    let t0 = Instant::now();
    let mut doc = base.clone();
    doc["heads"] = json!({"tap": "x", "n_heads": 200000, "cosine": [1.0]});
    let msg = format!("{:#}", report_of(dir.path(), "heads.json", &doc).unwrap_err());
    assert!(msg.contains("n_heads"), "{msg}");
    let mut doc = base.clone();
    doc["taps"][0]["layer"] = json!(300_000_000u32);
    let msg = format!("{:#}", report_of(dir.path(), "layer.json", &doc).unwrap_err());
    assert!(msg.contains("layer"), "{msg}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        t0.elapsed()
    );
    // The unedited document renders.
    assert_eq!(report_of(dir.path(), "ok.json", &base).unwrap(), ExitCode::SUCCESS);
}

#[test]
fn row10_dump_shapes_are_checked_before_any_forward_pass() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("d.safetensors");
    let tokens: Vec<u32> = (0..3000).map(|i| 1 + i % 400).collect();
    write_dump(&dump, &tokens, &[("embed", 3000, 1)], 0.5);
    let m = tiny_model();
    let t0 = Instant::now();
    let msg = exit2(&[
        "diff-layers",
        m.to_str().unwrap(),
        "--candidate",
        dump.to_str().unwrap(),
    ]);
    assert!(msg.contains("embed") && msg.contains("wide"), "{msg}");
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "refused only after {:?}",
        t0.elapsed()
    );
}

#[test]
fn row11_malformed_fields_are_one_line_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    // model_sha256 with multi-byte UTF-8.
    let p = edited_golden(dir.path(), SYNTH_GOLDEN, |g| {
        g["model_sha256"] = json!(format!("a{}", "é".repeat(40)))
    });
    let msg = exit2(&["gate", "--golden", p.to_str().unwrap()]);
    assert!(msg.contains("model_sha256"), "{msg}");
    // A server golden whose positions are shorter than its tokens.
    let p = edited_golden(dir.path(), SERVER_GOLDEN, |g| {
        g["prompts"][0]["positions"].as_array_mut().unwrap().truncate(1)
    });
    let msg = exit2(&[
        "gate",
        "--server",
        "http://127.0.0.1:9",
        "--golden",
        p.to_str().unwrap(),
    ]);
    assert!(msg.contains("positions for"), "{msg}");
    // Run documents: a head matrix too short, a layer at u32::MAX.
    let base = run_document(dir.path());
    let mut doc = base.clone();
    doc["heads"] = json!({"tap": "x", "n_heads": 4, "cosine": []});
    assert!(report_of(dir.path(), "h.json", &doc).is_err());
    let mut doc = base.clone();
    doc["taps"][1]["layer"] = json!(u32::MAX);
    assert!(report_of(dir.path(), "l.json", &doc).is_err());
    // Even unvalidated, rendering a short head matrix does not panic.
    let mut run: reports::DiffRun = serde_json::from_value(base).unwrap();
    run.heads = Some(reports::HeadMatrix {
        tap: "x".into(),
        n_heads: 4,
        cosine: vec![],
    });
    let _ = reports::render_diff(&run);
    // --timeout NaN.
    let msg = exit2(&[
        "entropy",
        "--server",
        "http://127.0.0.1:9",
        "--vocab",
        "10",
        "--prompts",
        "p",
        "--timeout",
        "NaN",
    ]);
    assert!(msg.contains("--timeout"), "{msg}");
}

#[test]
fn row12_only_regular_files_are_opened() {
    let dir = tempfile::tempdir().unwrap();
    let p = edited_golden(dir.path(), SYNTH_GOLDEN, |g| g["model"] = json!({"path": "/dev/zero"}));
    let t0 = Instant::now();
    let msg = exit2(&["gate", "--golden", p.to_str().unwrap()]);
    assert!(msg.contains("not a regular file"), "{msg}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    let fifo = dir.path().join("fifo");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .is_ok_and(|s| s.success());
    for path in ["/dev/zero", fifo.to_str().unwrap(), dir.path().to_str().unwrap()] {
        if path == fifo.to_str().unwrap() && !made {
            continue;
        }
        let msg = exit2(&["inspect", path]);
        // A folder is a model only with config.json (an HF checkpoint): this one has none.
        let want = if path == dir.path().to_str().unwrap() {
            "without config.json"
        } else {
            "not a regular file"
        };
        assert!(msg.contains(want), "{path}: {msg}");
        let msg = exit2(&["gate", "--golden", path]);
        assert!(msg.contains("not a regular file"), "{path}: {msg}");
        let msg = exit2(&["report", path, "-o", dir.path().join("r.html").to_str().unwrap()]);
        assert!(msg.contains("not a regular file"), "{path}: {msg}");
        let m = tiny_model();
        let msg = exit2(&["diff-layers", m.to_str().unwrap(), "--candidate", path]);
        assert!(msg.contains("not a regular file"), "{path}: {msg}");
    }
}

#[test]
fn row13_credentials_in_a_url_are_never_shown_or_stored() {
    use harness::server::{redact_url, split_credentials};
    assert_eq!(
        split_credentials("http://user:password@host:8000/v1"),
        ("http://host:8000/v1".to_string(), Some("user:password".to_string()))
    );
    assert_eq!(redact_url("https://u:p@h/v1"), "https://***@h/v1");
    assert_eq!(redact_url("http://h:1/a@b"), "http://h:1/a@b");
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path());
    let body = completion(healthy_top);
    let (url, port, seen) = scripted_server(vec![Box::new(move |_| http("200 OK", "", &body))]);
    assert!(url.starts_with("http://127.0.0.1:"));
    let url = format!("http://user:s3cr3t@127.0.0.1:{port}");
    let out = dir.path().join("run.json");
    let html = dir.path().join("run.html");
    let mut args = entropy_server_args(&url, &p);
    args.extend(["--json-out", out.to_str().unwrap(), "--html", html.to_str().unwrap()]);
    assert_eq!(run(&args).unwrap(), ExitCode::SUCCESS);
    for f in [&out, &html] {
        let text = std::fs::read_to_string(f).unwrap();
        assert!(!text.contains("s3cr3t"), "{} holds the password", f.display());
    }
    // The credentials went to the server itself, as basic auth.
    let req = seen.lock().unwrap()[0].to_ascii_lowercase();
    assert!(req.contains("authorization: basic dxnlcjpzm2nym3q="), "{req}");
    // A connection error names the URL without them.
    let refused = format!("http://user:s3cr3t@127.0.0.1:{}", {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    });
    let msg = exit2(&entropy_server_args(&refused, &p));
    assert!(!msg.contains("s3cr3t") && msg.contains("127.0.0.1"), "{msg}");
}

#[test]
fn row14_control_characters_are_escaped() {
    use harness::output::term;
    assert_eq!(term("blk.0.q\x1b[2J\rPASS"), "blk.0.q\\u{1b}[2J\\rPASS");
    assert_eq!(term("plain"), "plain");
    let dir = tempfile::tempdir().unwrap();
    let p = edited_golden(dir.path(), CPU_GOLDEN, |g| {
        g["prompts"][0]["taps"][0]["tap"] = json!("blk.0.q\u{1b}[2J\rPASS")
    });
    let msg = exit2(&["gate", "--golden", p.to_str().unwrap(), "--inject", "f16-residual"]);
    assert!(msg.contains("not a tap key"), "{msg}");
    assert!(
        !msg.contains('\u{1b}'),
        "the error itself carries the escape raw: {msg:?}"
    );
}

#[test]
fn row15a_thresholds_of_zero_pass_at_equality() {
    use harness::golden::ratio;
    assert_eq!(ratio(0.0, 0.0), 0.0);
    assert!(ratio(1e-300, 0.0) > 1.0);
    assert!(ratio(f64::NAN, 1.0) > 1.0);
    assert_eq!(ratio(0.5, 0.5), 1.0);
    // The gate's own comparisons of identical values under all-zero thresholds pass.
    use harness::golden::{compare_position, compare_tap, position_of, summarize, GateThresholds};
    let t = GateThresholds {
        tap_rel: 0.0,
        logprob_abs: 0.0,
        entropy_abs: 0.0,
        ..GateThresholds::default()
    };
    let data: Vec<f32> = (0..96).map(|i| (i as f32 * 0.37).sin()).collect();
    let s = summarize("blk.0.attn_out", &data, [2, 48]);
    let c = compare_tap(&s, &s, &t);
    assert!(c.ratio <= 1.0, "identical tap fails at 0: {c:?}");
    let (pos, logp) = position_of(&data[..48]);
    let c = compare_position(0, &logp, &pos, &t);
    assert!(c.ratio <= 1.0, "identical position fails at 0: {c:?}");
    // One ulp off at 0 is over.
    let mut other = data.clone();
    other[5] = f32::from_bits(other[5].to_bits() + 1);
    assert!(compare_tap(&summarize("blk.0.attn_out", &other, [2, 48]), &s, &t).ratio > 1.0);
}

#[test]
fn row15b_nan_is_shown_as_nan() {
    let m = harness::compare::metrics(&[f32::NAN; 8], &[1.0; 8]);
    assert!(m.cosine.is_nan(), "cosine {}", m.cosine);
    assert_eq!(m.nonfinite, 8);
    // Finite values keep their cosine.
    assert!((harness::compare::metrics(&[1.0; 8], &[1.0; 8]).cosine - 1.0).abs() < 1e-12);
}

#[test]
fn row15c_redirects_are_followed_within_the_origin_only() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path());
    // Same origin, 307: followed, the key sent again to the same origin.
    let body = completion(healthy_top);
    let (url, _, seen) = scripted_server(vec![
        Box::new(|_| http("307 Temporary Redirect", "Location: /moved/v1/completions\r\n", "")),
        Box::new(move |_| http("200 OK", "", &body)),
    ]);
    let mut args = entropy_server_args(&url, &p);
    args.extend(["--api-key", "k3y"]);
    assert_eq!(run(&args).unwrap(), ExitCode::SUCCESS);
    let reqs = seen.lock().unwrap().clone();
    assert_eq!(reqs.len(), 2);
    assert!(reqs[1].starts_with("POST /moved/v1/completions"), "{}", reqs[1]);
    // Another origin, 308: named, not followed, the key never sent there.
    let body = completion(healthy_top);
    let (other, _, other_seen) = scripted_server(vec![Box::new(move |_| http("200 OK", "", &body))]);
    let loc = format!("Location: {other}/v1/completions\r\n");
    let (url, _, _) = scripted_server(vec![Box::new(move |_| http("308 Permanent Redirect", &loc, ""))]);
    let mut args = entropy_server_args(&url, &p);
    args.extend(["--api-key", "k3y"]);
    let msg = exit2(&args);
    assert!(msg.contains("another origin") && msg.contains(&other), "{msg}");
    std::thread::sleep(Duration::from_millis(100));
    assert!(other_seen.lock().unwrap().is_empty(), "the other origin was asked");
}

#[test]
fn row15d_fewer_top_logprobs_than_asked_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts_file(dir.path());
    let body = completion(|i| {
        let mut m = serde_json::Map::new();
        m.insert(
            ["A", " b", " c", " d", " e", " f", " g", " h"][i].to_string(),
            json!(-0.1),
        );
        Value::Object(m)
    });
    let (url, _, _) = scripted_server(vec![Box::new(move |_| http("200 OK", "", &body))]);
    let msg = exit2(&entropy_server_args(&url, &p));
    assert!(msg.contains("1 top logprobs where 5 were asked"), "{msg}");
}

#[test]
fn row16_a_killed_writer_leaves_nothing_a_later_run_keeps() {
    use harness::output::{write_atomic, TEMP_PREFIX};
    let dir = tempfile::tempdir().unwrap();
    // A pid that has exited.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let stale = dir.path().join(format!("{TEMP_PREFIX}{dead}-abc123"));
    std::fs::write(&stale, vec![0u8; 1024]).unwrap();
    // One of a live process (this one) is left alone.
    let live = dir.path().join(format!("{TEMP_PREFIX}{}-def456", std::process::id()));
    std::fs::write(&live, b"x").unwrap();
    write_atomic(&dir.path().join("out.json"), b"{}").unwrap();
    assert!(!stale.exists(), "the crashed writer's temp file is still there");
    assert!(live.exists());
    // End to end (a real `llmdiff synth` killed with SIGKILL mid-write):
    // harness/tests/row16_synth_killed.rs.
}

#[test]
fn every_committed_golden_file_passes_the_reader_s_checks() {
    let mut n = 0;
    for e in std::fs::read_dir(golden("")).unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("gate-") && name.ends_with(".json") {
            harness::golden::read_golden(&e.path()).unwrap_or_else(|err| panic!("{name}: {err:#}"));
            n += 1;
        }
    }
    assert!(n >= 6, "found {n} golden files");
}
