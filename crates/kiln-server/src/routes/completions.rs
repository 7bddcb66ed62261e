//! `POST /v1/completions`: prompts as a string, a list of strings, a list of token ids or a
//! list of such lists; `n` samples each; `echo`; `logprobs` as an int; streaming or not.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;
use kiln_engine::{CompiledOutput, PromptLogprobs};
use serde_json::{Value, json};

use super::format::{completion_logprobs, prompt_logprobs};
use super::{resolve_model, tokenize};
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{
    ChoiceResult, ChunkFormat, Envelope, Usage, collect_all, start_all, stream_response,
};
use crate::protocol::CompletionRequest;
use crate::sequence::{Delta, SequenceSpec};
use crate::state::{Loaded, ServerState};
use crate::validate::{self, GenerationSpec, Limits};

/// Most prompts in one request.
const MAX_PROMPTS: usize = 256;

/// One prompt as the client sent it.
enum PromptIn {
    Text(String),
    Tokens(Vec<TokenId>),
}

fn bad_prompt(message: &str) -> ApiError {
    ApiError::bad_param("prompt", message.to_owned())
}

const PROMPT_SHAPE: &str =
    "`prompt` must be a string, a list of strings, a list of token ids, or a list of such lists";

fn token_ids(items: &[Value], limits: &Limits) -> Result<Vec<TokenId>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_i64() {
            Some(t) => validate::token_id("prompt", t, limits),
            None => Err(bad_prompt(PROMPT_SHAPE)),
        })
        .collect()
}

fn parse_prompts(prompt: &Value, limits: &Limits) -> Result<Vec<PromptIn>, ApiError> {
    let prompts = match prompt {
        Value::String(s) => vec![PromptIn::Text(s.clone())],
        Value::Array(items) if items.is_empty() => return Err(bad_prompt("`prompt` is empty")),
        Value::Array(items) if items.iter().all(Value::is_string) => items
            .iter()
            .map(|s| PromptIn::Text(s.as_str().unwrap_or_default().to_owned()))
            .collect(),
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|v| {
                let inner = v.as_array().map_or(&[][..], Vec::as_slice);
                token_ids(inner, limits).map(PromptIn::Tokens)
            })
            .collect::<Result<_, _>>()?,
        Value::Array(items) => vec![PromptIn::Tokens(token_ids(items, limits)?)],
        Value::Null => return Err(bad_prompt("`prompt` is required")),
        _ => return Err(bad_prompt(PROMPT_SHAPE)),
    };
    if prompts.len() > MAX_PROMPTS {
        return Err(bad_prompt(&format!("at most {MAX_PROMPTS} prompts per request")));
    }
    Ok(prompts)
}

/// Token ids of every prompt (text is tokenized with special tokens added), and with `echo`
/// the text to echo for each.
async fn resolve_prompts(
    loaded: &Arc<Loaded>,
    prompt: &Value,
    echo: bool,
    skip_special_tokens: bool,
) -> Result<(Vec<Vec<TokenId>>, Vec<String>), ApiError> {
    let prompts = parse_prompts(prompt, &loaded.limits)?;
    let texts: Vec<String> = prompts
        .iter()
        .filter_map(|p| match p {
            PromptIn::Text(t) => Some(t.clone()),
            PromptIn::Tokens(_) => None,
        })
        .collect();
    let mut encoded = tokenize(loaded, texts, true).await?.into_iter();
    let prompt_ids: Vec<Vec<TokenId>> = prompts
        .iter()
        .map(|p| match p {
            PromptIn::Text(_) => encoded.next().unwrap_or_default(),
            PromptIn::Tokens(ids) => ids.clone(),
        })
        .collect();
    let echo_texts = if echo {
        prompts
            .iter()
            .zip(&prompt_ids)
            .map(|(p, ids)| match p {
                PromptIn::Text(t) => t.clone(),
                PromptIn::Tokens(_) => {
                    let raw: Vec<u32> = ids.iter().map(|t| t.0).collect();
                    loaded.tokenizer.decode(&raw, skip_special_tokens).unwrap_or_default()
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    Ok((prompt_ids, echo_texts))
}

pub async fn completions(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

/// A validated completion request with its prompts tokenized, as generation and
/// `/v1/completions/render` take it.
pub(crate) struct Prepared {
    pub spec: GenerationSpec,
    /// Per prompt, its token ids (what the engine computes, and `render` returns).
    pub prompt_ids: Vec<Vec<TokenId>>,
    echo_texts: Vec<String>,
    echo: bool,
    logprobs: Option<usize>,
    max_tokens: Option<i64>,
    /// The structured output compiled once for every prompt and sample.
    compiled: Option<CompiledOutput>,
}

/// Validates `req` and tokenizes its prompts.
pub(crate) async fn prepare(
    state: &ServerState,
    loaded: &Arc<Loaded>,
    req: CompletionRequest,
) -> Result<Prepared, ApiError> {
    let adapter = resolve_model(state, req.model.as_deref()).await?;
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad_param("suffix", "`suffix` is not supported"));
    }
    let limits = loaded.limits;
    let logprobs = req
        .logprobs
        .map(|k| {
            usize::try_from(k).map_err(|_| {
                ApiError::bad_param("logprobs", format!("`logprobs` must be at least 0, got {k}"))
            })
        })
        .transpose()?;
    let echo = req.echo.unwrap_or(false);
    let max_tokens = req.sampling.max_tokens_given()?;
    let mut spec = validate::spec(req.sampling, max_tokens, logprobs, &limits, &loaded.defaults)?;
    (spec.adapter, spec.adapter_lease) = (adapter.binding, adapter.lease);
    let compiled = crate::structured_fields::compile(loaded, &spec).await?;
    if let (true, Some(k)) = (echo, logprobs) {
        // Echoed prompt tokens carry their log-probabilities too.
        spec.params.prompt_logprobs = Some(spec.params.prompt_logprobs.unwrap_or(0).max(k));
    }
    let (prompt_ids, echo_texts) =
        resolve_prompts(loaded, &req.prompt, echo, spec.skip_special_tokens).await?;
    Ok(Prepared { spec, prompt_ids, echo_texts, echo, logprobs, max_tokens, compiled })
}

async fn handle(state: Arc<ServerState>, req: CompletionRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let limits = loaded.limits;
    let Prepared { spec, prompt_ids, echo_texts, echo, logprobs, max_tokens, compiled } =
        prepare(&state, &loaded, req).await?;
    let mut seq_specs = Vec::with_capacity(prompt_ids.len() * spec.n);
    for ids in &prompt_ids {
        for sample in 0..spec.n {
            seq_specs.push(SequenceSpec::new(&spec, ids, sample, &limits, compiled.as_ref())?);
        }
    }
    crate::kv_transfer::ready_sequences(&loaded, &spec, prompt_ids.len(), &mut seq_specs).await?;
    let max_tokens = max_tokens.and_then(|m| usize::try_from(m).ok());
    let seqs = start_all(&state, &loaded, seq_specs, spec.n, max_tokens)?;
    let usage = Usage::new(&prompt_ids.iter().map(Vec::len).collect::<Vec<_>>());
    let envelope = Envelope::new(&state, "cmpl", spec.adapter.slot);
    if spec.stream {
        let format = CompletionChunks {
            loaded,
            envelope,
            n: spec.n,
            echo_texts,
            prompt_ids,
            echo_logprobs: echo && logprobs.is_some(),
            offsets: Vec::new(),
        };
        return Ok(stream_response(
            seqs,
            spec.n,
            usage,
            spec.usage,
            state.config.keep_alive,
            state.aborted(),
            format,
        ));
    }
    let mut usage = usage;
    let results = collect_all(seqs, spec.n, &mut usage, state.aborted()).await?;
    let kv_transfer_params = crate::kv_transfer::response_field(&loaded, &spec, &results);
    let echo = echo.then_some(Echo { texts: &echo_texts, prompt_ids: &prompt_ids });
    let choices = choices_json(&loaded, results, &spec, echo, logprobs);
    let mut body = envelope.response("text_completion", &choices, &usage);
    if let Some(params) = kv_transfer_params {
        body["kv_transfer_params"] = params;
    }
    Ok(Json(body).into_response())
}

/// What `echo` puts before each choice.
#[derive(Clone, Copy)]
struct Echo<'a> {
    texts: &'a [String],
    prompt_ids: &'a [Vec<TokenId>],
}

/// The `choices` of a whole (not streamed) response.
fn choices_json(
    loaded: &Loaded,
    results: Vec<ChoiceResult>,
    spec: &GenerationSpec,
    echo: Option<Echo<'_>>,
    logprobs: Option<usize>,
) -> Vec<Value> {
    let tokenizer = &loaded.tokenizer;
    results
        .into_iter()
        .enumerate()
        .map(|(index, r)| {
            let prompt = index / spec.n;
            let mut text = String::new();
            let mut echo_lps: Option<(&[TokenId], &PromptLogprobs)> = None;
            if let Some(echo) = echo {
                text.push_str(&echo.texts[prompt]);
                echo_lps =
                    r.prompt_logprobs.as_ref().map(|lps| (echo.prompt_ids[prompt].as_slice(), lps));
            }
            let lps = logprobs.map(|_| {
                let items: Vec<_> = r
                    .tokens
                    .iter()
                    .zip(r.logprobs.iter().map(Some))
                    .map(|(t, l)| (*t, l))
                    .collect();
                completion_logprobs(tokenizer, echo_lps, &items, 0)
            });
            text.push_str(&r.text);
            let mut choice = json!({
                "index": index,
                "text": text,
                "logprobs": lps,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_string,
            });
            if let (Some(_), Some(lps)) = (spec.params.prompt_logprobs, &r.prompt_logprobs) {
                choice["prompt_logprobs"] = prompt_logprobs(tokenizer, lps);
            }
            choice
        })
        .collect()
}

/// Stream chunks of `/v1/completions`.
struct CompletionChunks {
    loaded: Arc<Loaded>,
    envelope: Envelope,
    n: usize,
    /// Per prompt: the text echoed before the first token (empty without echo).
    echo_texts: Vec<String>,
    prompt_ids: Vec<Vec<TokenId>>,
    echo_logprobs: bool,
    /// Per choice: bytes of text sent so far (for `text_offset`).
    offsets: Vec<usize>,
}

impl ChunkFormat for CompletionChunks {
    const OBJECT: &'static str = "text_completion";

    fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    fn opening(&mut self, _index: usize) -> Option<Value> {
        None
    }

    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value> {
        if self.offsets.len() <= index {
            self.offsets.resize(index + 1, usize::MAX);
        }
        let prompt = index / self.n;
        let first = self.offsets[index] == usize::MAX;
        let mut text = String::new();
        if first {
            self.offsets[index] = 0;
            if let Some(echo) = self.echo_texts.get(prompt) {
                text.push_str(echo);
            }
        }
        text.push_str(&delta.text);
        if text.is_empty() && delta.finish_reason.is_none() && delta.logprobs.is_none() {
            return None;
        }
        let logprobs = delta.logprobs.as_ref().map(|lp| {
            let echo = (first && self.echo_logprobs)
                .then(|| {
                    delta.prompt_logprobs.as_ref().map(|p| (self.prompt_ids[prompt].as_slice(), p))
                })
                .flatten();
            completion_logprobs(
                &self.loaded.tokenizer,
                echo,
                &[(delta.token, Some(lp))],
                self.offsets[index],
            )
        });
        self.offsets[index] += text.len();
        Some(self.chunk(&json!([{
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
            "stop_reason": Value::Null,
        }])))
    }

    fn abort(&mut self, index: usize) -> Value {
        self.chunk(&json!([{
            "index": index,
            "text": "",
            "logprobs": Value::Null,
            "finish_reason": "abort",
            "stop_reason": Value::Null,
        }]))
    }
}
