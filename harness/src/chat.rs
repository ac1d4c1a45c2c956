//! The chat check of `entropy --server --against-reference --chat`: the model's own chat template
//! (`tokenizer.chat_template` of the GGUF) rendered with `minijinja` (the Rust Jinja engine, the
//! template language Hugging Face chat templates are written in) for a one-turn conversation, the
//! same conversation sent to `/v1/chat/completions` with logprobs, and the two compared:
//!
//! - the server's `usage.prompt_tokens` against the rendered prompt's token count (with the BOS
//!   the model adds): equal is the model's template; equal to the rendering *without* the
//!   generation prompt is a missing generation prompt; anything else is another template;
//! - the answer's logprobs against the reference run on the rendered prompt and the server's answer
//!   tokens (top-k KLD per position, as `--against-reference`).

use crate::server::{Entry, ServerOptions};
use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};
use std::time::Duration;

/// Renders `template` for one user message. `add_generation_prompt` as Hugging Face passes it.
pub fn render(template: &str, user: &str, bos: &str, eos: &str, add_generation_prompt: bool) -> anyhow::Result<String> {
    let mut env = minijinja::Environment::new();
    // HF templates call raise_exception and strftime_now; give them the first.
    env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
        Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template)
        .map_err(|e| anyhow!("the chat template does not parse: {e}"))?;
    let t = env.get_template("chat").map_err(|e| anyhow!("{e}"))?;
    t.render(minijinja::context! {
        messages => vec![minijinja::context! { role => "user", content => user }],
        add_generation_prompt => add_generation_prompt,
        bos_token => bos,
        eos_token => eos,
    })
    .map_err(|e| anyhow!("rendering the chat template: {e}"))
}

/// What the template comparison found.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TemplateFinding {
    /// The server's prompt token count is the model's template's.
    Matches,
    /// It is the count without the generation prompt (`<|im_start|>assistant\n` and the like).
    MissingGenerationPrompt,
    /// Neither: the server renders another template (or none).
    WrongTemplate,
    /// The server gave no `usage.prompt_tokens`.
    Unknown,
}

impl TemplateFinding {
    pub fn from_counts(server: Option<usize>, with_gen: usize, without_gen: usize) -> TemplateFinding {
        match server {
            None => TemplateFinding::Unknown,
            Some(n) if n == with_gen => TemplateFinding::Matches,
            Some(n) if n == without_gen => TemplateFinding::MissingGenerationPrompt,
            Some(_) => TemplateFinding::WrongTemplate,
        }
    }

    pub fn describe(&self) -> &'static str {
        match self {
            TemplateFinding::Matches => "the server's prompt is the model's chat template",
            TemplateFinding::MissingGenerationPrompt => {
                "missing generation prompt: the server's prompt is the model's template without the assistant turn's opening"
            }
            TemplateFinding::WrongTemplate => {
                "wrong chat template: the server's prompt token count is neither the model's template's nor that without the generation prompt"
            }
            TemplateFinding::Unknown => "the server gave no usage.prompt_tokens: the template cannot be checked",
        }
    }
}

/// A parsed chat completion: the answer's entries (token, logprob, top-k) and the prompt count.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatAnswer {
    pub entries: Vec<Entry>,
    pub prompt_tokens: Option<usize>,
    pub text: String,
}

/// The `/v1/chat/completions` request for one user message.
pub fn request_body(o: &ServerOptions, user: &str) -> Value {
    json!({
        "model": o.model,
        "messages": [{"role": "user", "content": user}],
        "max_tokens": o.max_tokens.max(1),
        "temperature": 0.0,
        "top_p": 1.0,
        "repeat_penalty": 1.0,
        "repetition_penalty": 1.0,
        "logprobs": true,
        "top_logprobs": o.top_k,
        "stream": false,
    })
}

/// Parses a chat completion body (`choices[0].logprobs.content[]`).
pub fn parse(body: &str) -> anyhow::Result<ChatAnswer> {
    let v: Value = serde_json::from_str(body).map_err(|e| anyhow!("malformed chat response: not JSON ({e})"))?;
    let choice = v
        .get("choices")
        .and_then(|c| c.get(0))
        .ok_or_else(|| anyhow!("malformed chat response: no choices[0]"))?;
    let text = choice
        .pointer("/message/content")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let content = choice
        .pointer("/logprobs/content")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("the chat response has no logprobs.content (does the server support chat logprobs?)"))?;
    let mut entries = Vec::with_capacity(content.len());
    for (i, c) in content.iter().enumerate() {
        let token = c
            .get("token")
            .and_then(Value::as_str)
            .ok_or_else(|| anyhow!("malformed chat logprobs: content[{i}].token"))?
            .to_string();
        let mut top = Vec::new();
        for t in c.get("top_logprobs").and_then(Value::as_array).into_iter().flatten() {
            let (Some(s), Some(lp)) = (
                t.get("token").and_then(Value::as_str),
                t.get("logprob").and_then(Value::as_f64),
            ) else {
                bail!("malformed chat logprobs: content[{i}].top_logprobs");
            };
            if !lp.is_finite() || lp > crate::server::LOGPROB_SLACK {
                bail!("malformed chat logprobs: content[{i}] top logprob {lp} of {s:?}");
            }
            top.push((s.to_string(), lp));
        }
        top.sort_by(|a, b| b.1.total_cmp(&a.1));
        entries.push(Entry {
            token,
            text_offset: None,
            logprob: c.get("logprob").and_then(Value::as_f64),
            top: (!top.is_empty()).then_some(top),
        });
    }
    Ok(ChatAnswer {
        entries,
        prompt_tokens: v
            .pointer("/usage/prompt_tokens")
            .and_then(Value::as_u64)
            .map(|x| x as usize),
        text,
    })
}

/// Sends one conversation (one attempt per retry, the client's timeout and deadline).
pub fn send(o: &ServerOptions, user: &str) -> anyhow::Result<ChatAnswer> {
    let base = o.url.trim_end_matches('/');
    let url = format!("{}/v1/chat/completions", base.strip_suffix("/v1").unwrap_or(base));
    let agent = ureq::AgentBuilder::new().redirects(0).build();
    let body = request_body(o, user).to_string();
    let mut tries = 0;
    loop {
        let left = o
            .deadline
            .map(|d| d.saturating_duration_since(std::time::Instant::now()));
        let limit = left.map_or(o.timeout, |l| l.min(o.timeout));
        if limit.is_zero() {
            bail!("{url}: the --deadline passed");
        }
        let mut req = agent.post(&url).timeout(limit).set("Content-Type", "application/json");
        if let Some(k) = &o.api_key {
            req = req.set("Authorization", &format!("Bearer {k}"));
        }
        match req.send_string(&body) {
            Ok(r) => {
                let text = r.into_string().context("reading the chat response")?;
                return parse(&text).with_context(|| url.clone());
            }
            Err(ureq::Error::Status(code, r)) if code < 500 && code != 429 => {
                let t = r.into_string().unwrap_or_default();
                bail!("{url}: HTTP {code}: {}", t.chars().take(200).collect::<String>());
            }
            Err(e) if tries >= o.retries => bail!("{url}: {e} (after {} attempts)", tries + 1),
            Err(_) => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(500 << tries.min(6)));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOL: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_smollm2_template() {
        let s = render(SMOL, "Hi", "", "", true).unwrap();
        assert!(s.starts_with("<|im_start|>system\nYou are a helpful"), "{s}");
        assert!(
            s.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
            "{s}"
        );
        let n = render(SMOL, "Hi", "", "", false).unwrap();
        assert!(n.ends_with("<|im_end|>\n"), "{n}");
        assert!(render("{% if %}", "x", "", "", true).is_err());
    }

    #[test]
    fn template_findings() {
        use TemplateFinding::*;
        assert_eq!(TemplateFinding::from_counts(Some(30), 30, 27), Matches);
        assert_eq!(TemplateFinding::from_counts(Some(27), 30, 27), MissingGenerationPrompt);
        assert_eq!(TemplateFinding::from_counts(Some(41), 30, 27), WrongTemplate);
        assert_eq!(TemplateFinding::from_counts(None, 30, 27), Unknown);
    }

    #[test]
    fn parses_chat_logprobs() {
        let body = r#"{"choices":[{"message":{"content":"Hello"},"logprobs":{"content":[
            {"token":"Hello","logprob":-0.1,"top_logprobs":[{"token":"Hi","logprob":-2.5},{"token":"Hello","logprob":-0.1}]}]}}],
            "usage":{"prompt_tokens":31}}"#;
        let a = parse(body).unwrap();
        assert_eq!(a.prompt_tokens, Some(31));
        assert_eq!(a.entries[0].top.as_ref().unwrap()[0].0, "Hello");
        assert!(parse(r#"{"choices":[{"message":{"content":"x"}}]}"#).is_err());
    }
}
