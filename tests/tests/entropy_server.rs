//! `entropy --server` against a tiny in-process fake OpenAI server (a `TcpListener` on 127.0.0.1:0
//! answering canned JSON, bounded by a request count and a deadline): a healthy parse, 500 retried
//! then exit 2, a malformed body, missing logprobs, connection refused, an https:// URL (rustls), and
//! `gate --server` against a fake that answers from a golden file (healthy passes; permuted or flat
//! logprobs fail, checked in the JUnit file). The run against a real
//! llama.cpp server (llama-cpp-python) is opt-in: `LLMDIFF_LIVE_SERVER=1`.

use harness::cli::Cli;
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn run(args: &[String]) -> anyhow::Result<ExitCode> {
    let cli =
        <Cli as clap::Parser>::try_parse_from(std::iter::once("llmdiff".to_string()).chain(args.iter().cloned()))?;
    harness::commands::run(cli)
}

/// Serves up to `max` requests (or until 30 s pass), each answered with `status` and `body`.
/// Returns the base URL and the count of requests seen.
fn fake_server(status: u16, body: String, max: usize) -> (String, Arc<AtomicUsize>) {
    fake_server_slow(status, body, max, None)
}

/// [`fake_server`] answering one request at a time, each `delay` after it was read (as
/// llama-cpp-python does: the requests behind it wait); `None` answers at once. With
/// `Some(Duration::MAX)` it never answers (a hung server): the connections are held open.
fn fake_server_slow(status: u16, body: String, max: usize, delay: Option<Duration>) -> (String, Arc<AtomicUsize>) {
    fake_server_routed(status, Arc::new(move |_: &str| body.clone()), max, delay)
}

/// The body for a request, from its head (request line and headers, lower-cased).
type Route = Arc<dyn Fn(&str) -> String + Send + Sync>;

/// [`fake_server_slow`] answering each request with `route(head)`.
fn fake_server_routed(status: u16, route: Route, max: usize, delay: Option<Duration>) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let seen = Arc::new(AtomicUsize::new(0));
    let count = seen.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(30);
        while count.load(Ordering::SeqCst) < max && Instant::now() < deadline {
            let Ok((mut s, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            };
            let _ = s.set_nonblocking(false);
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            // Read the headers, then Content-Length bytes of body.
            let mut buf = Vec::new();
            let mut chunk = [0u8; 4096];
            let mut need: Option<usize> = None;
            let mut head_seen = String::new();
            while let Ok(n) = s.read(&mut chunk) {
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
                if need.is_none() {
                    if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                        head_seen = head.clone();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        need = Some(end + 4 + len);
                    }
                }
                if need.is_some_and(|n| buf.len() >= n) {
                    break;
                }
            }
            count.fetch_add(1, Ordering::SeqCst);
            match delay {
                Some(d) if d == Duration::MAX => {
                    held.push(s);
                    continue;
                }
                Some(d) => std::thread::sleep(d),
                None => {}
            }
            let body = route(&head_seen);
            let reply = format!(
                "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = s.write_all(reply.as_bytes());
        }
    });
    (url, seen)
}

/// A completion of "A b c d" + " e f g h" in OpenAI alignment: every token is its own entry's
/// top-1 at logprob −0.1, with four distinct runners-up per position.
fn healthy_body() -> String {
    let toks = ["A", " b", " c", " d", " e", " f", " g", " h"];
    let mut offs = Vec::new();
    let mut o = 0;
    for t in toks {
        offs.push(o);
        o += t.len();
    }
    let tops: Vec<Value> = toks
        .iter()
        .enumerate()
        .map(|(i, t)| {
            if i == 0 {
                return Value::Null;
            }
            let mut m = serde_json::Map::new();
            m.insert(t.to_string(), json!(-0.1));
            for j in 1..5 {
                m.insert(format!("x{i}_{j}"), json!(-3.0 - 0.5 * j as f64));
            }
            Value::Object(m)
        })
        .collect();
    let lps: Vec<Value> = (0..toks.len())
        .map(|i| if i == 0 { Value::Null } else { json!(-0.1) })
        .collect();
    json!({
        "id": "cmpl-1", "object": "text_completion", "model": "fake",
        "choices": [{"text": toks.concat(), "index": 0, "finish_reason": "length",
            "logprobs": {"tokens": toks, "text_offset": offs, "token_logprobs": lps, "top_logprobs": tops}}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    })
    .to_string()
}

fn prompts(dir: &std::path::Path) -> String {
    let p = dir.join("p.txt");
    std::fs::write(&p, "A b c d\n").unwrap();
    p.display().to_string()
}

fn args(url: &str, prompts: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = [
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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A loopback URL nothing listens on (a port just bound and released).
fn refused_url() -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    format!("http://127.0.0.1:{}", l.local_addr().unwrap().port())
}

fn one_line_error(r: anyhow::Result<ExitCode>) -> String {
    let e = r.expect_err("expected an error (exit 2)");
    let msg = format!("{e:#}");
    assert!(!msg.contains('\n'), "not one line: {msg}");
    msg
}

#[test]
fn healthy_fake_server_parses() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let (url, seen) = fake_server(200, healthy_body(), 1);
    let out = dir.path().join("run.json");
    let code = run(&args(&url, &p, &["--json-out", out.to_str().unwrap()])).unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
    assert_eq!(seen.load(Ordering::SeqCst), 1);
    let doc: reports::EntropyRun = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(doc.verdict, "healthy");
    let s = doc.server.as_ref().unwrap();
    assert_eq!(s.alignment, "openai");
    let pe = &doc.prompts[0];
    assert_eq!(pe.continuation.len(), 4);
    assert_eq!(pe.continuation_text.as_deref(), Some(" e f g h"));
    // The bracket: lower ≤ upper, and the residual is what the top-5 leave.
    assert!(pe.mean_entropy <= pe.entropy_upper.unwrap());
    let listed: f64 = [-0.1f64, -3.5, -4.0, -4.5, -5.0].iter().map(|l| l.exp()).sum();
    assert!((pe.topk_residual.unwrap() - (1.0 - listed)).abs() < 1e-9);
}

#[test]
fn server_500_retries_then_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let (url, seen) = fake_server(500, "{\"error\":\"boom\"}".into(), 10);
    let msg = one_line_error(run(&args(&url, &p, &["--retries", "2"])));
    assert!(msg.contains("HTTP 500") && msg.contains("after 3 attempts"), "{msg}");
    assert_eq!(seen.load(Ordering::SeqCst), 3);
}

#[test]
fn malformed_body_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let (url, _) = fake_server(200, "this is not json".into(), 1);
    let msg = one_line_error(run(&args(&url, &p, &[])));
    assert!(msg.contains("malformed response body"), "{msg}");
}

#[test]
fn missing_logprobs_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let body = json!({"choices": [{"text": "A b c d e", "index": 0}]}).to_string();
    let (url, _) = fake_server(200, body, 1);
    let msg = one_line_error(run(&args(&url, &p, &[])));
    assert!(msg.contains("no logprobs"), "{msg}");
}

#[test]
fn connection_refused_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let url = refused_url();
    let msg = one_line_error(run(&args(&url, &p, &["--retries", "1"])));
    assert!(msg.contains("connection refused"), "{msg}");
}

// ------------------------------------------------------------------------------------------------
// Client behaviour: the deadline, queued time, a truncated continuation, reports on exit 2.

/// A hung server (accepts, never answers) costs at most `--deadline`, not (retries + 1) × timeout.
#[test]
fn deadline_bounds_a_hung_server() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let (url, _) = fake_server_slow(200, healthy_body(), 10, Some(Duration::MAX));
    let t0 = Instant::now();
    let msg = one_line_error(run(&args(
        &url,
        &p,
        &["--timeout", "60", "--retries", "3", "--deadline", "1.5"],
    )));
    let took = t0.elapsed();
    assert!(msg.contains("--deadline of 1.5 s passed"), "{msg}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
    assert!(took >= Duration::from_millis(1400), "took {took:?}");
}

/// Four prompts at once to a server that answers one at a time, 0.5 s each: the fourth waits 2 s,
/// more than its 0.8 s timeout, but that time was spent queued behind the others: it passes.
#[test]
fn time_queued_behind_other_requests_is_not_the_requests_own() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p4.txt");
    std::fs::write(&p, "A b c d\nA b c d\nA b c d\nA b c d\n").unwrap();
    let (url, seen) = fake_server_slow(200, healthy_body(), 4, Some(Duration::from_millis(500)));
    let code = run(&args(
        &url,
        p.to_str().unwrap(),
        &["--timeout", "0.8", "--retries", "0", "--concurrency", "4"],
    ))
    .unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
    assert_eq!(seen.load(Ordering::SeqCst), 4);
    // One request alone slower than its own timeout still times out.
    let (url, _) = fake_server_slow(200, healthy_body(), 1, Some(Duration::from_millis(1500)));
    let msg = one_line_error(run(&args(
        &url,
        &prompts(dir.path()),
        &["--timeout", "0.5", "--retries", "0"],
    )));
    assert!(msg.contains("prompt 1") && msg.contains("after 1 attempts"), "{msg}");
}

/// `finish_reason: "length"` with fewer tokens than `--max-new-tokens`: a warning in the report
/// (JSON `warnings`, HTML), the verdict otherwise unchanged.
#[test]
fn truncated_continuation_is_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let (url, _) = fake_server(200, healthy_body(), 1);
    let out = dir.path().join("run.json");
    let html = dir.path().join("run.html");
    let mut v = args(
        &url,
        &p,
        &["--json-out", out.to_str().unwrap(), "--html", html.to_str().unwrap()],
    );
    let at = v.iter().position(|a| a == "--max-new-tokens").unwrap();
    v[at + 1] = "8".into();
    let code = run(&v).unwrap();
    assert_eq!(code, ExitCode::SUCCESS);
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let w = doc["warnings"].as_array().expect("warnings");
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(w[0].as_str().unwrap().contains("after 4 of the 8 tokens"), "{w:?}");
    assert!(std::fs::read_to_string(&html)
        .unwrap()
        .contains("after 4 of the 8 tokens"));
    // Asked for exactly what came back: no warning.
    let (url, _) = fake_server(200, healthy_body(), 1);
    run(&args(&url, &p, &["--json-out", out.to_str().unwrap()])).unwrap();
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert!(doc.get("warnings").is_none(), "{doc}");
}

/// `gate --server` that cannot reach the server exits 2 and still writes JUnit (the golden file
/// as a test error naming the cause) and the HTML report.
#[test]
fn gate_writes_junit_and_html_on_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let junit = dir.path().join("j.xml");
    let html = dir.path().join("g.html");
    let url = refused_url();
    let msg = one_line_error(run(&gate_args(
        &url,
        &junit,
        &["--retries", "0", "--html", html.to_str().unwrap()],
    )));
    assert!(msg.contains("connection refused"), "{msg}");
    let xml = std::fs::read_to_string(&junit).expect("JUnit written on exit 2");
    assert!(xml.contains("errors=\"1\""), "{xml}");
    assert!(
        xml.contains("<error message=") && xml.contains("connection refused"),
        "{xml}"
    );
    let page = std::fs::read_to_string(&html).expect("HTML written on exit 2");
    assert!(page.contains("connection refused"), "html");
}

/// Opt-in: `LLMDIFF_LIVE_SERVER=1` starts `python -m llama_cpp.server` on the real SmolLM2 and
/// checks it is healthy and agrees with the reference within 1 nat per position, and that
/// `gate --server` passes it against `golden/gate-smollm2-server.json`.
#[test]
fn live_llama_cpp_server() {
    if std::env::var("LLMDIFF_LIVE_SERVER").ok().as_deref() != Some("1") {
        eprintln!("LLMDIFF_LIVE_SERVER=1 not set: live llama.cpp server test skipped");
        return;
    }
    let model = llmdiff_tests::fixtures::smollm2();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new("python3")
        .args(["-m", "llama_cpp.server", "--model"])
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 -m llama_cpp.server");
    let url = format!("http://127.0.0.1:{port}");
    let url_gate = url.clone();
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.txt");
    std::fs::write(&p, "The capital of France is\nOnce upon a time, there was a little\n").unwrap();
    let out = dir.path().join("run.json");
    let r = run(&[
        "entropy".into(),
        model.display().to_string(),
        "--server".into(),
        url,
        "--prompts".into(),
        p.display().to_string(),
        "--max-new-tokens".into(),
        "8".into(),
        "--against-reference".into(),
        "--kld-threshold".into(),
        "1.0".into(),
        "--json-out".into(),
        out.display().to_string(),
    ]);
    // The same server gated against the committed server golden file.
    let junit = dir.path().join("gate.xml");
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/gate-smollm2-server.json");
    let g = run(&[
        "gate".into(),
        "--server".into(),
        url_gate,
        "--golden".into(),
        golden.display().to_string(),
        "--junit".into(),
        junit.display().to_string(),
    ]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.unwrap(), ExitCode::SUCCESS);
    let text = std::fs::read_to_string(&out).unwrap();
    let doc: reports::EntropyRun = serde_json::from_str(&text).unwrap();
    assert_eq!(doc.verdict, "healthy");
    assert!(doc.overlap.unwrap().overlap_at_k > 0.8);
    // The calibrated verdict: a healthy server is within numeric noise, whatever one position does.
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["kld_verdict"]["band"], "within_noise", "{}", v["kld_verdict"]);
    assert_eq!(
        g.unwrap(),
        ExitCode::SUCCESS,
        "gate --server on the healthy live server"
    );
    assert_eq!(junit_failures(&junit).0, 0);
}

/// Opt-in (`LLMDIFF_LIVE_SERVER=1`): a llama.cpp server told RoPE frequency base 10000 where
/// SmolLM2 was trained with 1e5, checked with the model file itself as the reference (so the
/// metadata cannot give it away): the verdict names a position-dependent cause from the
/// distributions alone, with the repeated-span probe's figures.
#[test]
fn live_llama_cpp_server_rope_fault_is_named_position_dependent() {
    if std::env::var("LLMDIFF_LIVE_SERVER").ok().as_deref() != Some("1") {
        eprintln!("LLMDIFF_LIVE_SERVER=1 not set: live llama.cpp server test skipped");
        return;
    }
    let model = llmdiff_tests::fixtures::smollm2();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new("python3")
        .args(["-m", "llama_cpp.server", "--model"])
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--logits_all", "true", "--rope_freq_base", "10000"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("python3 -m llama_cpp.server");
    let deadline = Instant::now() + Duration::from_secs(60);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let dir = tempfile::tempdir().unwrap();
    let prompts = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/prompts-20.txt");
    let out = dir.path().join("run.json");
    let r = run(&[
        "entropy".into(),
        model.display().to_string(),
        "--server".into(),
        format!("http://127.0.0.1:{port}"),
        "--prompts".into(),
        prompts.display().to_string(),
        "--max-new-tokens".into(),
        "16".into(),
        "--against-reference".into(),
        "--concurrency".into(),
        "1".into(),
        "--json-out".into(),
        out.display().to_string(),
    ]);
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(r.unwrap(), ExitCode::from(1));
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    let v = &doc["kld_verdict"];
    assert_eq!(v["cause"], "grows_with_position", "{v}");
    assert_eq!(v["band"], "broken", "{v}");
    let ratio = v["repeat_probe"]["ratio"].as_f64().expect("the probe was sent");
    assert!(ratio >= v["thresholds"]["repeat_ratio"].as_f64().unwrap(), "{v}");
}

// ------------------------------------------------------------------------------------------------
// gate --server: the fake server answers from a committed golden file's own expectations.

fn golden_path() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../golden/gate-smollm2-reference.json")
}

/// How the fake deployment distorts the golden distributions.
#[derive(Clone, Copy)]
enum Fake {
    /// The golden's own top-20 and greedy continuation (OpenAI alignment).
    Healthy,
    /// The same tokens with their logprobs reversed: the least likely listed token comes first.
    Permuted,
    /// Every listed token at −ln V: a flat distribution.
    Flat,
}

/// A completion echoing the golden's first prompt and its continuation, each entry holding the
/// golden distribution that predicted that token (entry 0: null), distorted by `fake`.
fn golden_body(fake: Fake) -> String {
    let g = harness::golden::read_golden(&golden_path()).unwrap();
    let p = &g.prompts[0];
    let name = |id: u32| {
        g.token_text
            .get(&id)
            .cloned()
            .unwrap_or_else(|| format!("<unknown {id}>"))
    };
    let seq: Vec<u32> = p.tokens.iter().chain(&p.continuation).copied().collect();
    let n = p.tokens.len();
    let mut text = String::new();
    let (mut toks, mut offs, mut tops, mut lps) = (vec![], vec![], vec![], vec![]);
    for (i, &id) in seq.iter().enumerate() {
        toks.push(name(id));
        offs.push(text.chars().count());
        text.push_str(&name(id));
        // The distribution that predicted token i: position i − 1, or continuation step i − n.
        let golden = match i {
            0 => None,
            i if i <= n => Some(&p.positions[i - 1]),
            i => p.continuation_positions.get(i - n),
        };
        let Some(golden) = golden else {
            tops.push(Value::Null);
            lps.push(Value::Null);
            continue;
        };
        let listed: Vec<(u32, f64)> = golden
            .top
            .iter()
            .copied()
            .filter(|t| g.token_text.contains_key(&t.0))
            .collect();
        let mut m = serde_json::Map::new();
        for (j, &(tid, lp)) in listed.iter().enumerate() {
            let lp = match fake {
                Fake::Healthy => lp,
                Fake::Permuted => listed[listed.len() - 1 - j].1,
                Fake::Flat => -(g.vocab as f64).ln(),
            };
            m.insert(name(tid), json!(lp));
        }
        lps.push(m.get(&name(id)).cloned().unwrap_or(Value::Null));
        tops.push(Value::Object(m));
    }
    let prompt_chars = offs[n];
    json!({
        "id": "cmpl-g", "object": "text_completion", "model": "fake",
        "choices": [{"text": text, "index": 0, "finish_reason": "length",
            "logprobs": {"tokens": toks, "text_offset": offs, "token_logprobs": lps, "top_logprobs": tops}}],
        "usage": {"prompt_tokens": n, "completion_tokens": seq.len() - n, "total_tokens": seq.len(), "prompt_chars": prompt_chars}
    })
    .to_string()
}

fn gate_args(url: &str, junit: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["gate", "--server", url, "--served-model", "smollm2", "--golden"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    v.push(golden_path().display().to_string());
    v.extend(["--junit".to_string(), junit.display().to_string()]);
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The `failures="N"` of the JUnit file's `<testsuites>` line, and the failed test case names.
fn junit_failures(path: &std::path::Path) -> (usize, Vec<String>) {
    let xml = std::fs::read_to_string(path).unwrap();
    let head = xml.lines().find(|l| l.starts_with("<testsuites")).unwrap();
    let n: usize = head
        .split("failures=\"")
        .nth(1)
        .unwrap()
        .split('"')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let mut names = Vec::new();
    let lines: Vec<&str> = xml.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        if l.trim_start().starts_with("<failure") {
            let case = lines[i - 1];
            names.push(
                case.split("name=\"")
                    .nth(1)
                    .unwrap()
                    .split('"')
                    .next()
                    .unwrap()
                    .to_string(),
            );
        }
    }
    assert_eq!(n, names.len(), "{xml}");
    (n, names)
}

/// Gates the golden file against a fake answering `fake`: the exit code, the failed JUnit cases,
/// the JUnit text, and how many requests the fake saw.
fn gate_fake(fake: Fake, extra: &[&str]) -> (ExitCode, Vec<String>, String, usize) {
    let dir = tempfile::tempdir().unwrap();
    let junit = dir.path().join("junit.xml");
    let (url, seen) = fake_server(200, golden_body(fake), 1);
    let code = run(&gate_args(&url, &junit, extra)).unwrap();
    let (_, failed) = junit_failures(&junit);
    (
        code,
        failed,
        std::fs::read_to_string(&junit).unwrap(),
        seen.load(Ordering::SeqCst),
    )
}

#[test]
fn gate_server_healthy_fake_passes() {
    let (code, failed, xml, seen) = gate_fake(Fake::Healthy, &[]);
    assert_eq!(code, ExitCode::SUCCESS);
    assert_eq!(seen, 1);
    assert!(failed.is_empty(), "{failed:?}");
    for case in [
        "prompt 1 / server positions",
        "prompt 1 / greedy continuation",
        "prompt 1 / entropy",
        "agreement",
    ] {
        assert!(xml.contains(&format!("name=\"{case}\"")), "no case {case:?}: {xml}");
    }
}

#[test]
fn gate_server_permuted_logprobs_fail() {
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("gate.html");
    let (code, failed, _, _) = gate_fake(Fake::Permuted, &["--html", html.to_str().unwrap()]);
    assert_eq!(code, ExitCode::from(1));
    assert!(
        failed.contains(&"prompt 1 / server positions".to_string()),
        "{failed:?}"
    );
    assert!(failed.contains(&"agreement".to_string()), "{failed:?}");
    // The greedy tokens are the golden's, so that case passes.
    assert!(
        !failed.contains(&"prompt 1 / greedy continuation".to_string()),
        "{failed:?}"
    );
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(page.contains(">FAIL<") && page.contains("same top-1"), "html report");
}

#[test]
fn gate_server_flat_logprobs_fail_the_entropy_case() {
    let (code, failed, _, _) = gate_fake(Fake::Flat, &[]);
    assert_eq!(code, ExitCode::from(1));
    assert!(failed.contains(&"prompt 1 / entropy".to_string()), "{failed:?}");
}

#[test]
fn gate_server_connection_refused_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let url = refused_url();
    let msg = one_line_error(run(&gate_args(&url, &dir.path().join("j.xml"), &["--retries", "0"])));
    assert!(msg.contains("connection refused"), "{msg}");
}

#[test]
fn gate_server_needs_a_format_2_golden_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(golden_path()).unwrap()).unwrap();
    v["format"] = json!(1);
    v.as_object_mut().unwrap().remove("token_text");
    let old = dir.path().join("gate-old.json");
    std::fs::write(&old, v.to_string()).unwrap();
    let args: Vec<String> = [
        "gate",
        "--server",
        "http://127.0.0.1:9",
        "--golden",
        old.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let msg = one_line_error(run(&args));
    assert!(
        msg.contains("format 1") && msg.contains("golden bless --update"),
        "{msg}"
    );
}

/// An `https://` URL reaches rustls: a port that does not speak TLS is a one-line transport error
/// (exit 2), not "unknown scheme".
#[test]
fn https_url_is_accepted_by_the_client() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        // Accept, answer plain text to the ClientHello, close.
        if let Ok((mut s, _)) = listener.accept() {
            let mut buf = [0u8; 512];
            let _ = s.read(&mut buf);
            let _ = s.write_all(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n");
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let p = prompts(dir.path());
    let url = format!("https://127.0.0.1:{port}");
    let msg = one_line_error(run(&args(&url, &p, &["--retries", "0"])));
    assert!(
        msg.contains(&format!("https://127.0.0.1:{port}/v1/completions")),
        "{msg}"
    );
    let lower = msg.to_lowercase();
    assert!(!lower.contains("scheme"), "the TLS stack is not compiled in: {msg}");
}

// ------------------------------------------------------------------------------------------------
// The calibrated verdict of `entropy --server --against-reference`: the fake answers with the
// golden file's distributions (the reference's own), so the KLD is at rounding level.

/// Runs `entropy SmolLM2 --server --against-reference` on the golden's first prompt against a fake
/// answering `body`; the exit code and the JSON document.
fn entropy_against_reference(body: String, extra: &[&str]) -> (ExitCode, Value) {
    let g = harness::golden::read_golden(&golden_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.txt");
    std::fs::write(&p, format!("{}\n", g.prompts[0].text.as_ref().unwrap())).unwrap();
    let out = dir.path().join("run.json");
    let (url, _) = fake_server(200, body, 1);
    let mut v: Vec<String> = [
        "entropy",
        llmdiff_tests::fixtures::smollm2().to_str().unwrap(),
        "--server",
        &url,
        "--prompts",
        p.to_str().unwrap(),
        "--max-new-tokens",
        &g.n_continuation.to_string(),
        "--against-reference",
        "--json-out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    let code = run(&v).unwrap();
    (
        code,
        serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap(),
    )
}

#[test]
fn against_reference_healthy_is_within_noise() {
    let (code, doc) = entropy_against_reference(golden_body(Fake::Healthy), &[]);
    let v = &doc["kld_verdict"];
    assert_eq!(v["band"], "within_noise", "{v}");
    assert_eq!(v["cause"], "none", "{v}");
    assert_eq!(doc["agreement"], "within numeric noise");
    assert_eq!(code, ExitCode::SUCCESS);
    // MODEL.gguf may be the deployed file itself: the blind spot is said.
    assert!(v["blind_spot"].as_str().unwrap().contains("--trusted-model"), "{v}");
}

/// The server counts one prompt token more than the model's tokenizer: BOS added, broken.
#[test]
fn against_reference_names_an_added_bos_from_the_token_count() {
    let mut body: Value = serde_json::from_str(&golden_body(Fake::Healthy)).unwrap();
    let n = body["usage"]["prompt_tokens"].as_u64().unwrap();
    body["usage"]["prompt_tokens"] = json!(n + 1);
    let (code, doc) = entropy_against_reference(body.to_string(), &[]);
    let v = &doc["kld_verdict"];
    assert_eq!(v["cause"], "bos_added", "{v}");
    assert_eq!(v["band"], "broken", "{v}");
    assert!(
        v["evidence"][1].as_str().unwrap().contains("1 prompt token more"),
        "{v}"
    );
    assert_eq!(code, ExitCode::from(1));
}

/// A calibration whose floor sits far below this run's KLD and whose broken band is out of reach:
/// precision loss, exit 1 by default and 0 with `--precision-loss-exit 0`.
#[test]
fn precision_loss_exit_code_is_configurable() {
    let dir = tempfile::tempdir().unwrap();
    let mut cal = harness::kld_verdict::Calibration::committed();
    cal.floor.mean = 1e-300;
    cal.floor.p95 = 1e-300;
    cal.floor.p99 = 1e-300;
    cal.thresholds.broken_mean = 1e308;
    cal.thresholds.broken_p95 = 1e308;
    cal.thresholds.growth_ratio = 1e308;
    cal.thresholds.z = 0.0;
    let path = dir.path().join("cal.json");
    std::fs::write(&path, serde_json::to_string(&cal).unwrap()).unwrap();
    let body: Value = serde_json::from_str(&golden_body(Fake::Healthy)).unwrap();
    // Nudge every listed logprob so the KLD is not exactly zero.
    let mut b = body.clone();
    for top in b["choices"][0]["logprobs"]["top_logprobs"].as_array_mut().unwrap() {
        if let Some(m) = top.as_object_mut() {
            for (i, (_, lp)) in m.iter_mut().enumerate() {
                *lp = json!(lp.as_f64().unwrap() - 0.01 * (i % 3) as f64);
            }
        }
    }
    let c = path.to_str().unwrap();
    let (code, doc) = entropy_against_reference(b.to_string(), &["--kld-calibration", c]);
    assert_eq!(doc["kld_verdict"]["band"], "precision_loss", "{}", doc["kld_verdict"]);
    assert_eq!(code, ExitCode::from(1));
    let (code, doc) = entropy_against_reference(b.to_string(), &["--kld-calibration", c, "--precision-loss-exit", "0"]);
    assert_eq!(code, ExitCode::SUCCESS, "{} {}", doc["verdict"], doc["kld_verdict"]);
}

// ------------------------------------------------------------------------------------------------
// --chat: the model's own chat template rendered here against the server's prompt token count.

/// The SmolLM2 chat template's token counts for `text`, with and without the generation prompt.
fn template_counts(text: &str) -> (usize, usize) {
    let f = references::gguf::GgufFile::open(llmdiff_tests::fixtures::smollm2()).unwrap();
    let tok = references::tokenizer::Tokenizer::from_gguf(&f.header).unwrap();
    let Some(references::gguf::MetaValue::String(t)) = f.header.get("tokenizer.chat_template") else {
        panic!("no chat template")
    };
    let with = harness::chat::render(t, text, "", "", true).unwrap();
    let without = harness::chat::render(t, text, "", "", false).unwrap();
    (
        tok.encode(&with, true).unwrap().len(),
        tok.encode(&without, true).unwrap().len(),
    )
}

/// Runs `--chat` against a fake whose chat answer reports `prompt_tokens`; the exit code and the
/// JSON `chat` findings.
fn chat_run(prompt_tokens: usize) -> (ExitCode, Value) {
    let completion = golden_body(Fake::Healthy);
    let chat = json!({
        "choices": [{"message": {"role": "assistant", "content": " Paris"},
            "logprobs": {"content": [
                {"token": " Paris", "logprob": -0.2, "top_logprobs": [
                    {"token": " Paris", "logprob": -0.2}, {"token": " the", "logprob": -2.0}]}]}}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1}
    })
    .to_string();
    let route: Route = Arc::new(move |head: &str| {
        if head.starts_with("post /v1/chat/completions") {
            chat.clone()
        } else {
            completion.clone()
        }
    });
    let g = harness::golden::read_golden(&golden_path()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.txt");
    std::fs::write(&p, format!("{}\n", g.prompts[0].text.as_ref().unwrap())).unwrap();
    let out = dir.path().join("run.json");
    let (url, seen) = fake_server_routed(200, route, 2, None);
    let v: Vec<String> = [
        "entropy",
        llmdiff_tests::fixtures::smollm2().to_str().unwrap(),
        "--server",
        &url,
        "--prompts",
        p.to_str().unwrap(),
        "--max-new-tokens",
        &g.n_continuation.to_string(),
        "--against-reference",
        "--chat",
        "--json-out",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let code = run(&v).unwrap();
    assert_eq!(seen.load(Ordering::SeqCst), 2, "one completion, one chat request");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    (code, doc["chat"].clone())
}

#[test]
fn chat_template_match_missing_generation_prompt_and_wrong_template() {
    let g = harness::golden::read_golden(&golden_path()).unwrap();
    let (with, without) = template_counts(g.prompts[0].text.as_ref().unwrap());
    assert!(with > without, "{with} {without}");
    let (_, chat) = chat_run(with);
    assert_eq!(chat["prompts"][0]["finding"], "matches", "{chat}");
    assert_eq!(chat["prompts"][0]["template_tokens"], json!(with));
    let (code, chat) = chat_run(without);
    assert_eq!(chat["prompts"][0]["finding"], "missing_generation_prompt", "{chat}");
    assert_eq!(code, ExitCode::from(1));
    let (code, chat) = chat_run(with + 7);
    assert_eq!(chat["prompts"][0]["finding"], "wrong_template", "{chat}");
    assert_eq!(code, ExitCode::from(1));
}
