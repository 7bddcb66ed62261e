//! `POST /v1/embeddings` (OpenAI's, with vLLM's extras) and `POST /pooling` (vLLM's): the
//! vectors of a pooling model (`kiln serve --runner pooling`), one per input.
//!
//! Inputs are a string, a list of strings, a list of token ids or a list of such lists (at
//! most [`MAX_INPUTS`]); text is tokenized with special tokens unless `add_special_tokens` is
//! false. vLLM's chat form, `messages` instead of `input`, is one input rendered by the chat
//! template (`add_generation_prompt` and `add_special_tokens` default false, as in vLLM;
//! `chat_template_kwargs` reach the template). Each input is one engine request of its own, batched with every other request by the
//! scheduler. `truncate_prompt_tokens` keeps an input's last tokens (vLLM's rule; -1: the
//! context length), or on an encoder its first tokens with its special tokens kept (the
//! tokenizer's right truncation, as sentence-transformers cuts: the `[CLS]` it reads stays);
//! an input longer than the context without it is refused, as is an empty
//! one. `encoding_format` `base64` gives each vector's little-endian f32 bytes in base64, as
//! OpenAI's API does; `dimensions` keeps a vector's first values (normalised again when the
//! model normalises); `normalize` overrides the model's normalisation. On a generative model
//! both endpoints answer vLLM's 400, not 404.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use kiln_core::{SamplingParams, TokenId};
use kiln_engine::{PoolingParams, PreparedRequest};
use serde::Deserialize;
use serde_json::{Value, json};

use super::chat_input::{render_tokens, template_kwargs, template_messages};
use super::{resolve_model, tokenize, tokenize_admitted};
use crate::chat_template::RenderOptions;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::start_all;
use crate::protocol::ChatMessageIn;
use crate::sequence::{Sequence, SequenceSpec};
use crate::state::{Loaded, ServerState};
use crate::validate;

/// Most inputs in one request (OpenAI's limit).
pub const MAX_INPUTS: usize = 2048;

/// The body of both endpoints.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Value,
    /// vLLM's chat form: one input, the messages rendered by the chat template (without the
    /// assistant's opening unless `add_generation_prompt`; special tokens only from the
    /// template unless `add_special_tokens`).
    #[serde(default)]
    messages: Option<Vec<ChatMessageIn>>,
    #[serde(default)]
    add_generation_prompt: Option<bool>,
    #[serde(default)]
    chat_template_kwargs: Option<Value>,
    /// `float` (default) or `base64`.
    #[serde(default)]
    encoding_format: Option<String>,
    #[serde(default)]
    dimensions: Option<i64>,
    /// OpenAI's end-user id: logged by no one here, accepted for compatibility.
    #[serde(default)]
    #[allow(dead_code)] // an identifier with no effect on the answer
    user: Option<String>,
    /// vLLM's extras.
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    normalize: Option<bool>,
    #[serde(default)]
    priority: Option<i64>,
}

impl EmbeddingRequest {
    /// The inputs of another pooling endpoint (`/classify`) in this body's terms.
    pub(crate) fn of_inputs(
        model: Option<String>,
        input: Value,
        truncate_prompt_tokens: Option<i64>,
        add_special_tokens: Option<bool>,
    ) -> Self {
        Self {
            model,
            input,
            messages: None,
            add_generation_prompt: None,
            chat_template_kwargs: None,
            encoding_format: None,
            dimensions: None,
            user: None,
            truncate_prompt_tokens,
            add_special_tokens,
            normalize: None,
            priority: None,
        }
    }
}

/// Which endpoint answers: their bodies differ in names only.
#[derive(Clone, Copy)]
enum Endpoint {
    Embeddings,
    Pooling,
}

pub async fn embeddings(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<EmbeddingRequest>,
) -> Response {
    handle(state, req, Endpoint::Embeddings).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn pooling(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<EmbeddingRequest>,
) -> Response {
    handle(state, req, Endpoint::Pooling).await.unwrap_or_else(IntoResponse::into_response)
}

/// One input as the client sent it.
enum InputIn {
    Text(String),
    Tokens(Vec<TokenId>),
}

const INPUT_SHAPE: &str =
    "`input` must be a string, a list of strings, a list of token ids, or a list of such lists";

fn bad_input(message: impl Into<String>) -> ApiError {
    ApiError::bad_param("input", message)
}

fn token_ids(items: &[Value], loaded: &Loaded) -> Result<Vec<TokenId>, ApiError> {
    items
        .iter()
        .map(|v| match v.as_i64() {
            Some(t) => validate::token_id("input", t, &loaded.limits),
            None => Err(bad_input(INPUT_SHAPE)),
        })
        .collect()
}

fn parse_inputs(input: &Value, loaded: &Loaded) -> Result<Vec<InputIn>, ApiError> {
    let inputs = match input {
        Value::String(s) => vec![InputIn::Text(s.clone())],
        Value::Array(items) if items.is_empty() => return Err(bad_input("`input` is empty")),
        Value::Array(items) if items.len() > MAX_INPUTS => {
            return Err(bad_input(format!(
                "`input` has {} items; at most {MAX_INPUTS} per request",
                items.len()
            )));
        }
        Value::Array(items) if items.iter().all(Value::is_string) => {
            items.iter().map(|s| InputIn::Text(s.as_str().unwrap_or_default().to_owned())).collect()
        }
        Value::Array(items) if items.iter().all(Value::is_array) => items
            .iter()
            .map(|v| token_ids(v.as_array().map_or(&[][..], Vec::as_slice), loaded))
            .map(|ids| ids.map(InputIn::Tokens))
            .collect::<Result<_, _>>()?,
        Value::Array(items) => vec![InputIn::Tokens(token_ids(items, loaded)?)],
        Value::Null => return Err(bad_input("`input` is required")),
        _ => return Err(bad_input(INPUT_SHAPE)),
    };
    // An empty text is refused as OpenAI refuses it, even where the tokenizer would wrap it
    // in special tokens (an encoder's `[CLS] [SEP]`).
    let empty = inputs.iter().position(|i| matches!(i, InputIn::Text(t) if t.is_empty()));
    if let Some(i) = empty {
        return Err(bad_input(format!("input {i} is empty (no text)")));
    }
    Ok(inputs)
}

/// The tokens `truncate_prompt_tokens` keeps (`-1`: the context, `max_len`); `None` when the
/// request does not truncate.
pub(crate) fn truncation(value: Option<i64>, max_len: usize) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(-1) => Ok(Some(max_len)),
        Some(k) if k >= 1 && usize::try_from(k).is_ok_and(|k| k <= max_len) => {
            Ok(usize::try_from(k).ok())
        }
        Some(k) => Err(ApiError::bad_param(
            "truncate_prompt_tokens",
            format!("`truncate_prompt_tokens` must be -1 or 1 to {max_len}, got {k}"),
        )),
    }
}

/// The request's inputs as token ids, truncated and checked against the context.
pub(crate) async fn input_ids(
    loaded: &Arc<Loaded>,
    req: &mut EmbeddingRequest,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let inputs = match req.messages.take() {
        Some(_) if !req.input.is_null() => {
            return Err(bad_input("give `input` or `messages`, not both"));
        }
        Some(_) if loaded.encoder => {
            return Err(ApiError::bad_param(
                "messages",
                "an encoder (BERT, XLM-RoBERTa) embeds text, not chat messages: give `input`",
            ));
        }
        Some(messages) => vec![InputIn::Tokens(chat_ids(loaded, req, messages).await?)],
        None => parse_inputs(&req.input, loaded)?,
    };
    let max_len = loaded.limits.max_model_len;
    let keep = truncation(req.truncate_prompt_tokens, max_len)?;
    let texts: Vec<String> = inputs
        .iter()
        .filter_map(|i| match i {
            InputIn::Text(t) => Some(t.clone()),
            InputIn::Tokens(_) => None,
        })
        .collect();
    // Text is bounded by bytes before tokenizing unless truncation will cut it anyway (the
    // body's limit bounds it then).
    let add_special_tokens = req.add_special_tokens.unwrap_or(true);
    let mut encoded = if let Some(k) = keep {
        let bytes = texts.iter().map(String::len).sum();
        let encoder = loaded.encoder;
        tokenize_admitted(loaded, texts, bytes, "input", move |t, text: &String| {
            if encoder {
                t.encode_truncated(text, add_special_tokens, k)
            } else {
                t.encode(text, add_special_tokens)
            }
        })
        .await?
    } else {
        tokenize(loaded, texts, add_special_tokens).await?
    }
    .into_iter();
    let mut ids = Vec::with_capacity(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let mut tokens = match input {
            InputIn::Text(_) => encoded.next().unwrap_or_default(),
            InputIn::Tokens(t) => t,
        };
        match keep {
            Some(k) if loaded.encoder => tokens.truncate(k),
            Some(k) => {
                tokens.drain(..tokens.len().saturating_sub(k));
            }
            None => {}
        }
        if tokens.is_empty() {
            return Err(bad_input(format!("input {i} is empty (no tokens)")));
        }
        if tokens.len() > max_len {
            return Err(bad_input(format!(
                "This model's maximum context length is {max_len} tokens. However, you \
                 requested {} tokens in the input for embedding generation. Please reduce the \
                 length of the input (or set truncate_prompt_tokens).",
                tokens.len()
            )));
        }
        ids.push(tokens);
    }
    Ok(ids)
}

/// The ids of `messages` rendered by the chat template (vLLM's chat embedding request).
async fn chat_ids(
    loaded: &Arc<Loaded>,
    req: &mut EmbeddingRequest,
    messages: Vec<ChatMessageIn>,
) -> Result<Vec<TokenId>, ApiError> {
    let options = RenderOptions {
        add_generation_prompt: req.add_generation_prompt.unwrap_or(false),
        tools: None,
        kwargs: template_kwargs(req.chat_template_kwargs.take())?,
    };
    let messages = template_messages(messages)?;
    render_tokens(loaded, messages, options, req.add_special_tokens.unwrap_or(false)).await
}

/// `dimensions`, `normalize` and `encoding_format` checked.
fn pooling_params(
    req: &EmbeddingRequest,
    loaded: &Loaded,
) -> Result<(PoolingParams, bool), ApiError> {
    let width = loaded.hidden_size;
    let dimensions = match req.dimensions {
        None => None,
        Some(d) => match usize::try_from(d) {
            Ok(d) if (1..=width).contains(&d) => Some(d),
            _ => {
                return Err(ApiError::bad_param(
                    "dimensions",
                    format!(
                        "`dimensions` must be 1 to {width} (the model's embedding size), got {d}"
                    ),
                ));
            }
        },
    };
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::bad_param(
                "encoding_format",
                format!("`encoding_format` must be \"float\" or \"base64\", got {other:?}"),
            ));
        }
    };
    Ok((PoolingParams { dimensions, normalize: req.normalize }, base64))
}

async fn handle(
    state: Arc<ServerState>,
    mut req: EmbeddingRequest,
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    if loaded.pooling.is_none() {
        let api = match endpoint {
            Endpoint::Embeddings => "Embeddings API",
            Endpoint::Pooling => "Pooling API",
        };
        return Err(ApiError::bad_request(format!(
            "The model does not support {api}: it is served for generation (serve an embedding \
             model with --runner pooling)"
        )));
    }
    if loaded.cross_encoder && matches!(endpoint, Endpoint::Embeddings) {
        return Err(ApiError::bad_request(
            "The model does not support Embeddings API: it is a sequence classifier (use \
             /classify, or /score and /rerank with one label)",
        ));
    }
    let adapter = resolve_model(&state, req.model.as_deref()).await?;
    let (params, base64) = pooling_params(&req, &loaded)?;
    let inputs = input_ids(&loaded, &mut req).await?;
    let priority = req.priority.unwrap_or(0);
    let job = PoolJob { adapter: adapter.binding, params, priority, param: "input" };
    let vectors = pool_all(&state, &loaded, &job, &inputs).await?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let (prefix, object) = match endpoint {
        Endpoint::Embeddings => ("embd", "embedding"),
        Endpoint::Pooling => ("pool", "pooling"),
    };
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(index, v)| {
            let value = if base64 { json!(encode_base64(v)) } else { json!(v) };
            match endpoint {
                Endpoint::Embeddings => {
                    json!({"object": object, "index": index, "embedding": value})
                }
                Endpoint::Pooling => json!({"object": object, "index": index, "data": value}),
            }
        })
        .collect();
    let model = crate::routes::reported_name(&state, adapter.binding.slot);
    drop(adapter);
    Ok(Json(json!({
        "id": state.response_id(prefix),
        "object": "list",
        "created": crate::routes::unix_now(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0},
    }))
    .into_response())
}

/// How [`pool_all`] runs its inputs.
pub(crate) struct PoolJob {
    pub adapter: kiln_engine::AdapterBinding,
    pub params: PoolingParams,
    pub priority: i64,
    /// The request parameter the inputs came from (named in refusals).
    pub param: &'static str,
}

/// The pooled vector of each of `inputs` (token ids, checked against the context by the
/// caller), one engine request each, in order.
pub(crate) async fn pool_all(
    state: &Arc<ServerState>,
    loaded: &Arc<Loaded>,
    job: &PoolJob,
    inputs: &[Vec<TokenId>],
) -> Result<Vec<Vec<f32>>, ApiError> {
    let queue = state.config.max_queued_requests;
    if inputs.len() > queue {
        return Err(ApiError::bad_param(
            job.param,
            format!(
                "`{}` has {} items, more than the server queues at once ({queue}, \
                 --max-queued-requests); send fewer per request",
                job.param,
                inputs.len()
            ),
        ));
    }
    let vocab = loaded.limits.vocab_size;
    let specs = inputs
        .iter()
        .map(|ids| {
            let request = PreparedRequest::new(ids.clone(), SamplingParams::greedy(1), vocab, None)
                .map_err(|e| ApiError::bad_param(job.param, e.to_string()))?
                .with_adapter_binding(job.adapter)
                .with_pooling(job.params);
            Ok(SequenceSpec {
                import: None,
                request,
                priority: job.priority,
                stop: Vec::new(),
                skip_special_tokens: true,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let seqs = start_all(state, loaded, specs, 1, None)?;
    collect_vectors(seqs, state.aborted()).await
}

/// Each sequence's vector, in order; a 503 when `aborted` (the shutdown deadline) comes first.
async fn collect_vectors(
    seqs: Vec<Sequence>,
    aborted: impl std::future::Future<Output = ()>,
) -> Result<Vec<Vec<f32>>, ApiError> {
    let all = async {
        let mut vectors = Vec::with_capacity(seqs.len());
        for mut seq in seqs {
            let delta = seq.next().await.unwrap_or_else(|| {
                Err(ApiError::internal("a pooling request ended without its vector"))
            })?;
            let vector = delta.pooled.ok_or_else(|| ApiError::internal("no vector came back"))?;
            vectors.push(vector);
        }
        Ok(vectors)
    };
    tokio::select! {
        () = aborted => Err(ApiError::new(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            "The server shut down before the request finished.",
        )),
        vectors = all => vectors,
    }
}

/// OpenAI's `base64` encoding: the vector's little-endian f32 bytes.
fn encode_base64(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_is_little_endian_f32() {
        // 1.0 = 0x3f800000 → bytes 00 00 80 3f.
        assert_eq!(encode_base64(&[1.0]), "AACAPw==");
        assert_eq!(encode_base64(&[]), "");
    }
}
