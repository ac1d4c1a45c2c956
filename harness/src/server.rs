//! The OpenAI-compatible client of `entropy --server`: one legacy `/v1/completions` request per
//! prompt (`echo: true`, `logprobs: K`, temperature 0, no repetition penalty, `max_tokens`), with timeouts, retries with
//! exponential backoff on connection errors, 429 and 5xx, a concurrency limit (a fixed pool of
//! std threads pulling prompt indices), and an optional bearer API key. Every failure is one line
//! naming the URL and the prompt, so `main` turns it into exit 2.
//!
//! The client is `ureq` 2: blocking (no async runtime for a handful of requests) and small, with
//! its `tls` feature: rustls (pure Rust, no system OpenSSL) with the webpki root certificates, so
//! `https://` deployments work on any machine.
//!
//! Time limits: `timeout` is each request's own, counted from when it is sent (not from when it
//! was queued in the client); with `k` requests in flight at once (the concurrency, at most the
//! prompt count) each gets `k × timeout`, since a server that serves one request at a time
//! (llama-cpp-python) may answer every other one of ours first, in any order, and the time queued
//! behind them is not the request's own. The optional `deadline` bounds the whole run: every request's limit, every
//! retry and every backoff stops there, so a hung server costs at most the deadline.

use anyhow::{anyhow, bail};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How to reach the server.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// Base URL, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted), without
    /// credentials: the only form shown or stored ([`split_credentials`]).
    pub url: String,
    /// `user:password` from the URL the user gave, sent as HTTP basic auth (when no API key).
    pub basic: Option<String>,
    pub model: String,
    pub api_key: Option<String>,
    pub top_k: usize,
    pub max_tokens: usize,
    pub timeout: Duration,
    /// Retries after the first attempt.
    pub retries: u32,
    /// First backoff; doubled on each retry.
    pub backoff: Duration,
    pub concurrency: usize,
    /// The end of the whole run (`--deadline`): no request, retry or backoff goes past it.
    pub deadline: Option<Instant>,
    /// Seconds of the `--deadline` the user gave (for messages).
    pub deadline_seconds: Option<f64>,
}

/// What a prompt is sent as.
#[derive(Clone, Debug)]
pub enum PromptBody {
    Text(String),
    Tokens(Vec<u32>),
}

/// One logprob entry of the response (a token of the echoed prompt or of the continuation).
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub token: String,
    /// Character offset of the token in the echoed text, when the server gives it.
    pub text_offset: Option<usize>,
    pub logprob: Option<f64>,
    /// The top-k (token string, logprob) pairs, highest first; `None` where the server gives null
    /// (the first echoed token).
    pub top: Option<Vec<(String, f64)>>,
}

/// A parsed completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The echoed prompt and the continuation.
    pub text: String,
    pub entries: Vec<Entry>,
    pub prompt_tokens: Option<usize>,
    /// `choices[0].finish_reason` (`"length"`, `"stop"`, …) when the server gives it.
    pub finish_reason: Option<String>,
    /// `usage.completion_tokens` when the server gives it.
    pub completion_tokens: Option<usize>,
}

impl Completion {
    /// A warning when the continuation stopped for length before `asked` tokens: the server's
    /// context (or its own `max_tokens` cap) cut it short, so fewer greedy tokens were checked
    /// than `--max-new-tokens` asked. `n_prompt` is the prompt's entry count, to count the
    /// continuation when `usage.completion_tokens` is missing.
    pub fn truncation_warning(&self, n_prompt: usize, asked: usize) -> Option<String> {
        if self.finish_reason.as_deref() != Some("length") || asked == 0 {
            return None;
        }
        let got = self
            .completion_tokens
            .unwrap_or_else(|| self.entries.len().saturating_sub(n_prompt));
        (got < asked).then(|| {
            format!(
                "the continuation stopped for length after {got} of the {asked} tokens asked (finish_reason \"length\": the server's context or its max_tokens cap cut it short); only {got} greedy tokens were checked"
            )
        })
    }
}

/// `url` without its `user:password@` part, and that part. The URL is the one form shown or
/// stored; the credentials only ever go in an `Authorization` header to the URL's own origin.
pub fn split_credentials(url: &str) -> (String, Option<String>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_string(), None);
    };
    let auth_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..auth_end].rfind('@') {
        Some(at) => (
            format!("{scheme}://{}", &rest[at + 1..]),
            Some(rest[..at].to_string()).filter(|c| !c.is_empty()),
        ),
        None => (url.to_string(), None),
    }
}

/// `url` with any credentials replaced by `***`, for messages and documents.
pub fn redact_url(url: &str) -> String {
    match split_credentials(url) {
        (clean, Some(_)) => {
            let (scheme, rest) = clean.split_once("://").unwrap_or(("", &clean));
            format!("{scheme}://***@{rest}")
        }
        (clean, None) => clean,
    }
}

/// The origin (scheme, host and port) of an absolute http(s) URL, lower-cased, default ports made
/// explicit.
pub fn origin(url: &str) -> Option<String> {
    let (scheme, rest) = url.split_once("://")?;
    let scheme = scheme.to_ascii_lowercase();
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let host = rest[..end].rsplit('@').next()?.to_ascii_lowercase();
    let default = match scheme.as_str() {
        "http" => "80",
        "https" => "443",
        _ => return None,
    };
    let has_port = host
        .rsplit_once(':')
        .is_some_and(|(_, p)| p.chars().all(|c| c.is_ascii_digit()) && !host.ends_with(']'));
    Some(if has_port {
        format!("{scheme}://{host}")
    } else {
        format!("{scheme}://{host}:{default}")
    })
}

/// Where a redirect from `from` to `location` leads, absolute.
fn resolve(from: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let (scheme, rest) = from.split_once("://").unwrap_or(("http", from));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    if location.starts_with('/') {
        format!("{scheme}://{}{location}", &rest[..end])
    } else {
        let base = from.rsplit_once('/').map_or(from, |(b, _)| b);
        format!("{base}/{location}")
    }
}

fn base64(bytes: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::new();
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16 | (*c.get(1).unwrap_or(&0) as u32) << 8 | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// Redirects followed per request (same origin only).
const MAX_REDIRECTS: usize = 5;

/// The completions endpoint for a base URL.
pub fn endpoint(url: &str) -> String {
    let base = url.trim_end_matches('/');
    let base = base.strip_suffix("/v1").unwrap_or(base);
    format!("{base}/v1/completions")
}

/// The request body.
pub fn request_body(o: &ServerOptions, prompt: &PromptBody) -> Value {
    let p = match prompt {
        PromptBody::Text(t) => json!(t),
        PromptBody::Tokens(ids) => json!(ids),
    };
    json!({
        "model": o.model,
        "prompt": p,
        // llama-cpp-python reads max_tokens <= 0 as "until the context is full".
        "max_tokens": o.max_tokens.max(1),
        "temperature": 0.0,
        "top_p": 1.0,
        // Plain greedy: llama-cpp-python's completions default to repeat_penalty 1.1 (vLLM and
        // SGLang spell it repetition_penalty, default 1.0); an unknown field is ignored.
        "repeat_penalty": 1.0,
        "repetition_penalty": 1.0,
        "logprobs": o.top_k,
        "echo": true,
        "stream": false,
    })
}

/// Parses a `/v1/completions` response body (the first choice).
pub fn parse_completion(body: &str) -> anyhow::Result<Completion> {
    let v: Value = serde_json::from_str(body).map_err(|e| anyhow!("malformed response body: not JSON ({e})"))?;
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| anyhow!("malformed response body: no choices[0]"))?;
    let text = choice
        .get("text")
        .and_then(Value::as_str)
        .ok_or_else(|| anyhow!("malformed response body: choices[0].text missing"))?
        .to_string();
    let lp = match choice.get("logprobs") {
        Some(l) if l.is_object() => l,
        _ => bail!("the response has no logprobs (does the server support legacy completions logprobs with echo?)"),
    };
    let tokens = lp
        .get("tokens")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("the response has no logprobs.tokens"))?;
    let tops = lp
        .get("top_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("the response has no logprobs.top_logprobs"))?;
    let lps = lp.get("token_logprobs").and_then(Value::as_array);
    let offs = lp.get("text_offset").and_then(Value::as_array);
    if tops.len() != tokens.len() {
        bail!(
            "malformed logprobs: {} tokens but {} top_logprobs",
            tokens.len(),
            tops.len()
        );
    }
    let mut entries = Vec::with_capacity(tokens.len());
    for (i, (t, top)) in tokens.iter().zip(tops).enumerate() {
        let token = t
            .as_str()
            .ok_or_else(|| anyhow!("malformed logprobs: tokens[{i}] is not a string"))?
            .to_string();
        let top = match top {
            Value::Null => None,
            Value::Object(m) => {
                let mut pairs = Vec::with_capacity(m.len());
                for (k, x) in m {
                    let lp = x
                        .as_f64()
                        .ok_or_else(|| anyhow!("malformed logprobs: top_logprobs[{i}][{k:?}] is not a number"))?;
                    pairs.push((k.clone(), lp));
                }
                pairs.sort_by(|a, b| b.1.total_cmp(&a.1));
                Some(pairs)
            }
            _ => bail!("malformed logprobs: top_logprobs[{i}] is not an object"),
        };
        entries.push(Entry {
            token,
            text_offset: offs.and_then(|o| o.get(i)).and_then(Value::as_u64).map(|x| x as usize),
            logprob: lps.and_then(|l| l.get(i)).and_then(Value::as_f64),
            top,
        });
    }
    if entries.iter().all(|e| e.top.is_none()) {
        bail!("the response's top_logprobs are all null");
    }
    let usage = |k: &str| {
        v.get("usage")
            .and_then(|u| u.get(k))
            .and_then(Value::as_u64)
            .map(|x| x as usize)
    };
    Ok(Completion {
        text,
        entries,
        prompt_tokens: usage("prompt_tokens"),
        finish_reason: choice.get("finish_reason").and_then(Value::as_str).map(str::to_string),
        completion_tokens: usage("completion_tokens"),
    })
}

/// How far above 0 a logprob, and above 1 a listed probability mass, may sit before the response
/// is malformed (servers round in f32; the real mass of a top-k list is at most 1).
pub const LOGPROB_SLACK: f64 = 1e-3;

/// The fewest entries a top list may hold when `asked` were asked: all of them, less a tenth
/// (rounded down). `top_logprobs` is a JSON object keyed by token text, so two tokens of the same
/// text collapse into one key; a server that lists far fewer than asked (1 of 20) caps
/// `logprobs` below what the check needs and cannot be compared at top-`asked`.
pub fn min_listed(asked: usize) -> usize {
    asked - asked / 10
}

/// Checks a parsed completion against what a distribution can be, before anything is computed
/// from it: every listed logprob finite and ≤ [`LOGPROB_SLACK`], every top list's mass
/// Σ exp(logprob) ≤ 1 + [`LOGPROB_SLACK`], and at least [`min_listed`]`(asked)` entries in
/// every top list given. Errors name the entry.
pub fn check_completion(c: &Completion, asked: usize) -> anyhow::Result<()> {
    for (i, e) in c.entries.iter().enumerate() {
        let at = || format!("malformed logprobs at entry {i} (token {:?})", e.token);
        if let Some(lp) = e.logprob {
            if !lp.is_finite() || lp > LOGPROB_SLACK {
                bail!("{}: token_logprobs {lp} is not a finite logprob <= 0", at());
            }
        }
        let Some(top) = &e.top else { continue };
        if top.len() < min_listed(asked) {
            bail!(
                "{}: {} top logprobs where {asked} were asked (does the server cap logprobs below --top-logprobs?)",
                at(),
                top.len()
            );
        }
        let mut mass = 0.0;
        for (t, lp) in top {
            if !lp.is_finite() || *lp > LOGPROB_SLACK {
                bail!("{}: top logprob {lp} of {t:?} is not a finite logprob <= 0", at());
            }
            mass += lp.exp();
        }
        if mass > 1.0 + LOGPROB_SLACK {
            bail!("{}: the listed probabilities sum to {mass:.4} > 1", at());
        }
    }
    Ok(())
}

/// A failed attempt: retry or give up.
enum Attempt {
    Retry(String),
    Fatal(String),
}

fn one_line(s: &str, max: usize) -> String {
    let s: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if s.chars().count() > max {
        format!("{}…", s.chars().take(max).collect::<String>())
    } else {
        s
    }
}

/// The time left before the deadline (`None`: no deadline), zero once it has passed.
fn left(o: &ServerOptions) -> Option<Duration> {
    o.deadline.map(|d| d.saturating_duration_since(Instant::now()))
}

/// The error once the deadline has passed.
fn deadline_error(o: &ServerOptions, last: &str) -> String {
    format!(
        "the --deadline of {} s passed{}",
        o.deadline_seconds.unwrap_or(0.0),
        if last.is_empty() {
            String::new()
        } else {
            format!(" (last attempt: {last})")
        }
    )
}

/// The limit of one request while `workers` of ours are in flight at once: its own `timeout` plus
/// one `timeout` per other request (a server serving one at a time may answer all of those first;
/// which ones it takes first is its choice, not the send order), cut at the deadline.
pub fn request_limit(o: &ServerOptions, workers: usize) -> Duration {
    let own = o
        .timeout
        .saturating_mul(u32::try_from(workers.max(1)).unwrap_or(u32::MAX));
    match left(o) {
        Some(l) => own.min(l),
        None => own,
    }
}

fn attempt(
    agent: &ureq::Agent,
    o: &ServerOptions,
    url: &str,
    body: &Value,
    workers: usize,
) -> Result<Completion, Attempt> {
    let mut url = url.to_string();
    let mut hops = 0;
    let sent = loop {
        let limit = request_limit(o, workers);
        if limit.is_zero() {
            return Err(Attempt::Fatal(deadline_error(o, "")));
        }
        let mut req = agent.post(&url).timeout(limit).set("Content-Type", "application/json");
        if let Some(k) = &o.api_key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        } else if let Some(b) = &o.basic {
            req = req.set("Authorization", &format!("Basic {}", base64(b.as_bytes())));
        }
        let r = req.send_string(&body.to_string());
        // Redirects are followed here, not by ureq: only within the origin the credentials and
        // the API key were given for (a 307/308 keeps the POST and its body).
        match &r {
            Ok(resp) if (300..400).contains(&resp.status()) => {
                let code = resp.status();
                let Some(loc) = resp.header("Location").map(|l| resolve(&url, l)) else {
                    return Err(Attempt::Fatal(format!("HTTP {code} without a Location header")));
                };
                if !matches!(code, 307 | 308) {
                    return Err(Attempt::Fatal(format!(
                        "HTTP {code}: redirected to {} (a POST redirected with {code} becomes a GET): use that URL as --server",
                        redact_url(&loc)
                    )));
                }
                if origin(&loc).is_none() || origin(&loc) != origin(&url) {
                    return Err(Attempt::Fatal(format!(
                        "HTTP {code}: redirected to {}, another origin: not followed, so neither the API key nor credentials go there; use that URL as --server if you trust it",
                        redact_url(&loc)
                    )));
                }
                hops += 1;
                if hops > MAX_REDIRECTS {
                    return Err(Attempt::Fatal(format!("more than {MAX_REDIRECTS} redirects")));
                }
                url = loc;
            }
            _ => break r,
        }
    };
    match sent {
        Ok(resp) => {
            let text = resp
                .into_string()
                .map_err(|e| Attempt::Retry(format!("reading the response: {e}")))?;
            parse_completion(&text)
                .and_then(|c| check_completion(&c, o.top_k).map(|_| c))
                .map_err(|e| Attempt::Fatal(format!("{e:#}")))
        }
        Err(ureq::Error::Status(code, resp)) => {
            let text = resp.into_string().unwrap_or_default();
            let msg = format!("HTTP {code}: {}", one_line(&text, 200));
            if code == 429 || code >= 500 {
                Err(Attempt::Retry(msg))
            } else {
                Err(Attempt::Fatal(msg))
            }
        }
        Err(ureq::Error::Transport(t)) => {
            let kind = match t.kind() {
                // A refused port, or (https) a failed TLS handshake: say which.
                ureq::ErrorKind::ConnectionFailed => {
                    format!("connection refused or failed ({})", one_line(&t.to_string(), 160))
                }
                ureq::ErrorKind::Dns => "cannot resolve the host".to_string(),
                ureq::ErrorKind::Io => format!("I/O error ({})", one_line(&t.to_string(), 160)),
                _ => one_line(&t.to_string(), 200),
            };
            Err(Attempt::Retry(kind))
        }
    }
}

/// Sends one prompt with retries, none past the deadline.
fn complete_one(
    agent: &ureq::Agent,
    o: &ServerOptions,
    prompt: &PromptBody,
    workers: usize,
) -> anyhow::Result<Completion> {
    let url = endpoint(&o.url);
    let body = request_body(o, prompt);
    let mut wait = o.backoff;
    let mut tries = 0u32;
    loop {
        match attempt(agent, o, &url, &body, workers) {
            Ok(c) => return Ok(c),
            Err(Attempt::Fatal(m)) => bail!("{url}: {m}"),
            Err(Attempt::Retry(m)) if left(o).is_some_and(|l| l <= wait) => {
                bail!("{url}: {} after {} attempts", deadline_error(o, &m), tries + 1)
            }
            Err(Attempt::Retry(m)) if tries >= o.retries => {
                bail!("{url}: {m} (after {} attempts)", tries + 1)
            }
            Err(Attempt::Retry(_)) => {
                std::thread::sleep(wait);
                wait = wait.saturating_mul(2);
                tries += 1;
            }
        }
    }
}

/// Sends every prompt, at most `concurrency` at a time; results in prompt order. The first
/// failing prompt (by index) is the error, naming the prompt.
pub fn complete_all(o: &ServerOptions, prompts: &[PromptBody]) -> anyhow::Result<Vec<Completion>> {
    if !(o.url.starts_with("http://") || o.url.starts_with("https://")) {
        bail!("--server {}: expected an http:// or https:// URL", o.url);
    }
    // The overall limit is set per request (see [`request_limit`]).
    let agent = ureq::AgentBuilder::new()
        .redirects(0)
        .timeout_connect(o.timeout.min(Duration::from_secs(10)))
        .build();
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<anyhow::Result<Completion>>>> =
        Mutex::new((0..prompts.len()).map(|_| None).collect());
    let workers = o.concurrency.clamp(1, prompts.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= prompts.len() {
                    break;
                }
                let r = complete_one(&agent, o, &prompts[i], workers);
                let failed = r.is_err();
                if let Ok(mut g) = results.lock() {
                    g[i] = Some(r);
                }
                if failed {
                    // Stop handing out work; the prompts already in flight finish.
                    next.store(prompts.len(), Ordering::SeqCst);
                }
            });
        }
    });
    let results = results.into_inner().map_err(|_| anyhow!("a request thread panicked"))?;
    let mut out = Vec::with_capacity(prompts.len());
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(c)) => out.push(c),
            Some(Err(e)) => return Err(e.context(format!("prompt {}", i + 1))),
            None => {}
        }
    }
    if out.len() != prompts.len() {
        bail!("requests stopped after an error");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_and_parse() {
        assert_eq!(endpoint("http://h:1/"), "http://h:1/v1/completions");
        assert_eq!(endpoint("http://h:1/v1"), "http://h:1/v1/completions");
        let body = r#"{"choices":[{"text":"ab","logprobs":{"tokens":["a","b"],"text_offset":[0,1],
            "token_logprobs":[null,-0.5],"top_logprobs":[null,{"b":-0.5,"c":-1.5}]}}],
            "usage":{"prompt_tokens":1}}"#;
        let c = parse_completion(body).unwrap();
        assert_eq!(c.entries.len(), 2);
        assert_eq!(c.entries[1].top.as_ref().unwrap()[0].0, "b");
        assert!(parse_completion("{").is_err());
        let e = parse_completion(r#"{"choices":[{"text":"x","logprobs":null}]}"#).unwrap_err();
        assert!(e.to_string().contains("no logprobs"), "{e}");
    }
}
