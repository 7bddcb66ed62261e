//! The HTTP side of `kiln bench serve`: one streaming request to an OpenAI-compatible
//! `/v1/completions` or `/v1/chat/completions` endpoint (kiln, vLLM, llama.cpp's llama-server),
//! timed chunk by chunk, or one `/v1/embeddings` request (whole: its TTFT is its latency, as
//! in vLLM's `openai-embeddings` client). `http://` or `https://` (rustls, the webpki root certificates); one
//! connection per request.
//!
//! Timing: TTFT is the time to the first chunk that carries text; every later text chunk adds
//! one inter-token latency (a chunk may carry several tokens, as in vLLM's client). Token
//! counts come from the stream's final `usage` when the server sends one.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, Uri};
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::dataset::BenchRequest;
use crate::sse::SseParser;

/// Largest error body kept.
const MAX_ERROR_BODY: usize = 64 << 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndpointKind {
    Completions,
    Chat,
    Embeddings,
}

impl EndpointKind {
    /// The kind an endpoint path names.
    pub fn of_path(path: &str) -> anyhow::Result<Self> {
        match path.trim_end_matches('/') {
            p if p.ends_with("/chat/completions") => Ok(Self::Chat),
            p if p.ends_with("/completions") => Ok(Self::Completions),
            p if p.ends_with("/embeddings") => Ok(Self::Embeddings),
            p => bail!(
                "--endpoint must be /v1/completions, /v1/chat/completions or /v1/embeddings, \
                 got `{p}`"
            ),
        }
    }
}

/// Where and how requests are sent.
#[derive(Clone, Debug)]
pub struct Target {
    /// `http://host:port`, optionally with a path prefix.
    pub base_url: String,
    /// `/v1/completions` or `/v1/chat/completions`.
    pub endpoint: String,
    pub model: String,
    pub api_key: Option<String>,
    /// Ask the server to ignore EOS so every request produces its full `max_tokens`.
    pub ignore_eos: bool,
    /// The sampling temperature sent; `None`: 0 (greedy).
    pub temperature: Option<f64>,
    /// Fields added to (or replacing those of) every request body (`--extra-body`).
    pub extra_body: Option<serde_json::Map<String, Value>>,
}

impl Target {
    /// A target for the server's other endpoints (`/health`, `/v1/models`) only.
    pub fn server(base_url: &str, api_key: Option<String>) -> Self {
        Self {
            base_url: base_url.to_owned(),
            endpoint: "/v1/completions".into(),
            model: String::new(),
            api_key,
            ignore_eos: false,
            temperature: None,
            extra_body: None,
        }
    }
}

/// What one request measured.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    pub success: bool,
    pub error: Option<String>,
    /// Seconds from the start of the run to sending the request.
    pub sent_at: f64,
    /// Seconds to the first chunk carrying output (text, tool calls or the finish).
    pub ttft: f64,
    /// Seconds between consecutive chunks carrying output.
    pub itl: Vec<f64>,
    /// Seconds to the end of the stream.
    pub latency: f64,
    /// `usage.prompt_tokens` / `usage.completion_tokens`, when the server sent them.
    pub usage_prompt_tokens: Option<usize>,
    pub usage_output_tokens: Option<usize>,
    pub text: String,
}

/// A pooled HTTP client bound to one target.
#[derive(Clone)]
pub struct ApiClient {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    base: String,
    uri: Uri,
    kind: EndpointKind,
    target: Target,
}

impl ApiClient {
    pub fn new(target: Target) -> anyhow::Result<Self> {
        let base = target.base_url.trim_end_matches('/').to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("--base-url must start with http:// or https://, got `{base}`");
        }
        let kind = EndpointKind::of_path(&target.endpoint)?;
        let uri: Uri = format!("{base}{}", target.endpoint)
            .parse()
            .with_context(|| format!("`{base}{}` is not a URL", target.endpoint))?;
        let mut http = HttpConnector::new();
        http.set_nodelay(true);
        http.enforce_http(false);
        let connector = HttpsConnectorBuilder::new()
            .with_webpki_roots()
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        // One connection per request: some servers (llama.cpp's llama-server) close a
        // connection after a streamed response in a way a pooled client only sees when it
        // reuses it, failing the next request. Loopback connects cost microseconds.
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(0)
            .pool_idle_timeout(Duration::from_secs(30))
            .build(connector);
        Ok(Self { client, base, uri, kind, target })
    }

    pub fn kind(&self) -> EndpointKind {
        self.kind
    }

    /// GET `path` under the base URL: status and body text.
    pub async fn get(&self, path: &str) -> anyhow::Result<(StatusCode, String)> {
        let uri: Uri = format!("{}{path}", self.base).parse()?;
        let mut req = Request::get(uri);
        if let Some(key) = &self.target.api_key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let resp = self.client.request(req.body(Full::new(Bytes::new()))?).await?;
        let status = resp.status();
        let body = resp.into_body().collect().await?.to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    }

    /// The JSON body of one request.
    pub fn body(&self, req: &BenchRequest) -> Value {
        let mut body = match self.kind {
            EndpointKind::Completions => json!({ "prompt": req.prompt }),
            EndpointKind::Chat => {
                json!({ "messages": [{ "role": "user", "content": req.prompt }] })
            }
            EndpointKind::Embeddings => json!({ "input": req.prompt }),
        };
        body["model"] = json!(req.model.as_deref().unwrap_or(&self.target.model));
        if self.kind == EndpointKind::Embeddings {
            self.extend(&mut body, req);
            return body;
        }
        body["max_tokens"] = json!(req.output_len);
        body["temperature"] = json!(self.target.temperature.unwrap_or(0.0));
        body["stream"] = json!(true);
        body["stream_options"] = json!({ "include_usage": true });
        if self.target.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        self.extend(&mut body, req);
        body
    }

    /// A request's priority and `--extra-body`'s fields on `body`.
    fn extend(&self, body: &mut Value, req: &BenchRequest) {
        if let Some(priority) = req.priority {
            body["priority"] = json!(priority);
        }
        if let Some(extra) = &self.target.extra_body {
            for (k, v) in extra {
                body[k.as_str()] = v.clone();
            }
        }
    }

    /// Sends one request and times its stream; failures are in the outcome, never an `Err`.
    pub async fn send(&self, req: &BenchRequest, run_start: Instant) -> Outcome {
        let start = Instant::now();
        let mut outcome = Outcome {
            sent_at: start.duration_since(run_start).as_secs_f64(),
            ..Outcome::default()
        };
        if let Err(e) = self.stream(req, start, &mut outcome).await {
            outcome.success = false;
            outcome.error = Some(format!("{e:#}"));
        }
        outcome.latency = start.elapsed().as_secs_f64();
        outcome
    }

    async fn stream(
        &self,
        req: &BenchRequest,
        start: Instant,
        out: &mut Outcome,
    ) -> anyhow::Result<()> {
        let body = serde_json::to_vec(&self.body(req))?;
        let mut request =
            Request::post(self.uri.clone()).header("content-type", "application/json");
        if let Some(key) = &self.target.api_key {
            request = request.header("authorization", format!("Bearer {key}"));
        }
        let resp = self.client.request(request.body(Full::new(Bytes::from(body)))?).await?;
        let status = resp.status();
        let mut body = resp.into_body();
        if status != StatusCode::OK {
            let mut text = Vec::new();
            while let Some(frame) = body.frame().await {
                if let Ok(data) = frame?.into_data() {
                    text.extend_from_slice(&data);
                    if text.len() > MAX_ERROR_BODY {
                        break;
                    }
                }
            }
            bail!("HTTP {status}: {}", error_message(&String::from_utf8_lossy(&text)));
        }
        if self.kind == EndpointKind::Embeddings {
            let whole = body.collect().await.context("reading the response")?.to_bytes();
            return Self::embeddings(&whole, start, out);
        }
        let mut parser = SseParser::default();
        let mut last_chunk: Option<Instant> = None;
        let mut done = false;
        while let Some(frame) = body.frame().await {
            let Ok(data) = frame.context("reading the stream")?.into_data() else { continue };
            for event in parser.push(&data) {
                done |= self.event(&event, start, &mut last_chunk, out)?;
            }
        }
        if let Some(event) = parser.finish() {
            done |= self.event(&event, start, &mut last_chunk, out)?;
        }
        if !done {
            bail!("the stream ended without `data: [DONE]`");
        }
        out.success = true;
        Ok(())
    }

    /// A whole `/v1/embeddings` response: its vectors counted, its usage read; the first (and
    /// only) output is the response itself.
    fn embeddings(body: &[u8], start: Instant, out: &mut Outcome) -> anyhow::Result<()> {
        let v: Value = serde_json::from_slice(body).context("the response is not JSON")?;
        let Some(data) = v.get("data").and_then(Value::as_array).filter(|d| !d.is_empty()) else {
            bail!("the response has no `data`: {}", error_message(&String::from_utf8_lossy(body)));
        };
        if data.iter().any(|d| d.get("embedding").is_none()) {
            bail!("an item of `data` has no `embedding`");
        }
        out.ttft = start.elapsed().as_secs_f64();
        let prompt = v.pointer("/usage/prompt_tokens").and_then(Value::as_u64);
        out.usage_prompt_tokens = prompt.map(|p| p as usize);
        out.usage_output_tokens = Some(0);
        out.success = true;
        Ok(())
    }

    /// Handles one SSE payload; true at `[DONE]`.
    fn event(
        &self,
        event: &str,
        start: Instant,
        last_chunk: &mut Option<Instant>,
        out: &mut Outcome,
    ) -> anyhow::Result<bool> {
        if event.trim() == "[DONE]" {
            return Ok(true);
        }
        let chunk: Value = serde_json::from_str(event)
            .with_context(|| format!("a stream chunk is not JSON: {event}"))?;
        if let Some(err) = chunk.get("error") {
            bail!("error event: {}", error_message(&err.to_string()));
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            let count = |k: &str| usage.get(k).and_then(Value::as_u64).map(|v| v as usize);
            out.usage_prompt_tokens = count("prompt_tokens").or(out.usage_prompt_tokens);
            out.usage_output_tokens = count("completion_tokens").or(out.usage_output_tokens);
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else { return Ok(false) };
        let delta = choice.get("delta");
        let text = match self.kind {
            EndpointKind::Completions => choice.get("text"),
            EndpointKind::Chat => delta.and_then(|d| d.get("content")),
            EndpointKind::Embeddings => None,
        };
        let text = text.and_then(Value::as_str).unwrap_or_default();
        // A chunk carries output when it has text, tool calls or the finish: tokens that
        // decode to nothing send no chunk of their own, and a request whose every token does
        // so gets its first token at the finishing chunk, not at 0. A chat stream's opening
        // chunk (the role, empty content) is not output.
        let tool_calls = delta.and_then(|d| d.get("tool_calls")).is_some_and(|t| !t.is_null());
        let finished = choice.get("finish_reason").is_some_and(|f| !f.is_null());
        if !text.is_empty() || tool_calls || finished {
            let now = Instant::now();
            match last_chunk {
                None => out.ttft = now.duration_since(start).as_secs_f64(),
                Some(prev) => out.itl.push(now.duration_since(*prev).as_secs_f64()),
            }
            *last_chunk = Some(now);
            out.text.push_str(text);
        }
        Ok(false)
    }
}

/// `error.message` of an OpenAI-style error body, or the body itself, shortened.
fn error_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let message = parsed
        .as_ref()
        .and_then(|v| {
            v.get("error")
                .map(|e| e.get("message").unwrap_or(e).clone())
                .or_else(|| v.get("message").cloned())
        })
        .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned));
    let mut message = message.unwrap_or_else(|| body.trim().to_owned());
    if message.len() > 300 {
        let cut = (0..=300).rev().find(|&i| message.is_char_boundary(i)).unwrap_or(0);
        message.truncate(cut);
        message.push('…');
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_kinds() {
        assert_eq!(EndpointKind::of_path("/v1/completions").unwrap(), EndpointKind::Completions);
        assert_eq!(EndpointKind::of_path("/v1/chat/completions/").unwrap(), EndpointKind::Chat);
        assert_eq!(EndpointKind::of_path("/v1/embeddings").unwrap(), EndpointKind::Embeddings);
        assert!(EndpointKind::of_path("/v1/rerank").is_err());
    }

    #[test]
    fn error_messages_are_extracted() {
        assert_eq!(error_message(r#"{"error":{"message":"bad n","code":400}}"#), "bad n");
        assert_eq!(error_message(r#"{"message":"nope"}"#), "nope");
        assert_eq!(error_message(" plain text \n"), "plain text");
        assert!(error_message(&"é".repeat(400)).ends_with('…'));
    }

    /// A target on a closed port, model "m", greedy, ignoring EOS.
    fn target(endpoint: &str) -> Target {
        Target {
            base_url: "http://127.0.0.1:1".into(),
            endpoint: endpoint.into(),
            model: "m".into(),
            api_key: None,
            ignore_eos: true,
            temperature: None,
            extra_body: None,
        }
    }

    /// An `Outcome` after feeding `events` to a client of `path` whose request started
    /// 50 ms ago.
    fn outcome_of(path: &str, events: &[&str]) -> Outcome {
        let c = ApiClient::new(target(path)).unwrap();
        let start = Instant::now().checked_sub(Duration::from_millis(50)).unwrap();
        let (mut out, mut last) = (Outcome::default(), None);
        for e in events {
            c.event(e, start, &mut last, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn first_token_time_counts_output_chunks_only() {
        // Text chunks: the first sets TTFT, the next an inter-token latency.
        let out = outcome_of(
            "/v1/completions",
            &[
                r#"{"choices":[{"text":"a","finish_reason":null}]}"#,
                r#"{"choices":[{"text":"b","finish_reason":"length"}]}"#,
            ],
        );
        assert!(out.ttft >= 0.05 && out.itl.len() == 1 && out.text == "ab", "{out:?}");
        // Every token decoded to nothing: the first token is the finishing chunk, not 0.
        let out = outcome_of(
            "/v1/completions",
            &[
                r#"{"choices":[{"text":"","finish_reason":"length"}]}"#,
                r#"{"choices":[],"usage":{"completion_tokens":4}}"#,
            ],
        );
        assert!(out.ttft >= 0.05 && out.itl.is_empty(), "{out:?}");
        assert_eq!(out.usage_output_tokens, Some(4));
        // A chat stream's opening chunk (role, empty content) is not its first token.
        let out = outcome_of(
            "/v1/chat/completions",
            &[r#"{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#],
        );
        assert_eq!(out.ttft, 0.0);
        let out = outcome_of(
            "/v1/chat/completions",
            &[
                r#"{"choices":[{"delta":{"role":"assistant","content":""},"finish_reason":null}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]},"finish_reason":null}]}"#,
                r#"{"choices":[{"delta":{"content":"x"},"finish_reason":"stop"}]}"#,
            ],
        );
        assert!(out.ttft >= 0.05 && out.itl.len() == 1 && out.text == "x", "{out:?}");
    }

    #[test]
    fn embeddings_bodies_and_responses() {
        let c = ApiClient::new(target("/v1/embeddings")).unwrap();
        let req = BenchRequest {
            prompt: "hi".into(),
            prompt_len: 1,
            output_len: 7,
            priority: Some(2),
            model: None,
        };
        let b = c.body(&req);
        assert_eq!(b, json!({"input": "hi", "model": "m", "priority": 2}));
        let start = Instant::now().checked_sub(Duration::from_millis(50)).unwrap();
        let mut out = Outcome::default();
        let ok = br#"{"data":[{"embedding":[0.5]}],"usage":{"prompt_tokens":3}}"#;
        ApiClient::embeddings(ok, start, &mut out).unwrap();
        assert!(out.success && out.ttft >= 0.05, "{out:?}");
        assert_eq!((out.usage_prompt_tokens, out.usage_output_tokens), (Some(3), Some(0)));
        for bad in [&br#"{"data":[]}"#[..], br#"{"data":[{"index":0}]}"#, b"not json"] {
            assert!(ApiClient::embeddings(bad, start, &mut Outcome::default()).is_err());
        }
    }

    #[test]
    fn bodies_for_both_endpoints() {
        let target = |endpoint: &str| Target {
            extra_body: serde_json::from_str(r#"{"top_k": 5, "max_tokens": 3}"#).ok(),
            ..target(endpoint)
        };
        let req = BenchRequest {
            prompt: "hi".into(),
            prompt_len: 1,
            output_len: 7,
            priority: None,
            model: None,
        };
        let c = ApiClient::new(target("/v1/completions")).unwrap();
        let b = c.body(&req);
        assert_eq!((b["prompt"].as_str(), b["max_tokens"].as_u64()), (Some("hi"), Some(3)));
        assert_eq!((b["top_k"].as_u64(), b["temperature"].as_f64()), (Some(5), Some(0.0)));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(b["ignore_eos"], json!(true));
        let c = ApiClient::new(target("/v1/chat/completions")).unwrap();
        assert_eq!(c.body(&req)["messages"][0]["content"], json!("hi"));
        let https = Target { base_url: "https://x.example".into(), ..target("/v1/completions") };
        assert!(ApiClient::new(https).is_ok());
        let ftp = Target { base_url: "ftp://x".into(), ..target("/v1/completions") };
        assert!(ApiClient::new(ftp).is_err());
    }
}
