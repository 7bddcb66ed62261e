//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` samples,
//! `logprobs` + `top_logprobs`, streaming or not.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;
use serde_json::{Value, json};

use super::check_model;
use super::format::{chat_logprobs, prompt_logprobs};
use crate::chat_template::ChatMessage;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{ChunkFormat, Envelope, Usage, collect_all, start_all, stream_response};
use crate::protocol::{ChatMessageIn, ChatRequest, MessageContent};
use crate::sequence::{Delta, SequenceSpec};
use crate::state::{Loaded, ServerState};
use crate::validate;

/// Most messages in one conversation.
const MAX_MESSAGES: usize = 4096;
/// Most content parts over all messages of one request.
pub const MAX_CONTENT_PARTS: usize = 4096;
/// Roles a message may have (`developer`, OpenAI's successor of `system`, is rendered as
/// `system`).
const ROLES: [&str; 4] = ["system", "user", "assistant", "developer"];

fn bad_message(index: usize, message: impl Into<String>) -> ApiError {
    ApiError::bad_param("messages", format!("messages[{index}]: {}", message.into()))
}

/// Text-only messages as the template sees them: roles checked, `null` content only on
/// assistant messages, at most [`MAX_CONTENT_PARTS`] text parts in all.
pub fn template_messages(messages: Vec<ChatMessageIn>) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` must not be empty"));
    }
    if messages.len() > MAX_MESSAGES {
        return Err(ApiError::bad_param("messages", format!("at most {MAX_MESSAGES} messages")));
    }
    let mut num_parts = 0usize;
    messages
        .into_iter()
        .enumerate()
        .map(|(index, m)| {
            if !ROLES.contains(&m.role.as_str()) {
                return Err(bad_message(
                    index,
                    format!(
                        "unsupported role {:?} (supported: system, user, assistant, developer)",
                        m.role
                    ),
                ));
            }
            let role = if m.role == "developer" { "system".to_owned() } else { m.role };
            let content = match m.content {
                None if role == "assistant" => String::new(),
                None => {
                    return Err(bad_message(index, format!("`content` is required for role {role:?}")));
                }
                Some(MessageContent::Text(t)) => t,
                Some(MessageContent::Parts(parts)) => {
                    num_parts += parts.len();
                    if num_parts > MAX_CONTENT_PARTS {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!("at most {MAX_CONTENT_PARTS} content parts per request"),
                        ));
                    }
                    let mut text = String::new();
                    for part in parts {
                        match (part.kind.as_str(), part.text) {
                            ("text", Some(t)) => text.push_str(&t),
                            ("text", None) => {
                                return Err(bad_message(index, "a `text` part needs `text`"));
                            }
                            (kind, _) => {
                                return Err(bad_message(
                                    index,
                                    format!("content parts of type {kind:?} are not supported (text only)"),
                                ));
                            }
                        }
                    }
                    text
                }
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

/// Renders the conversation and tokenizes it on a blocking thread (templates are
/// fuel-bounded, not free). Message content is literal text: control-token text in it never
/// becomes a control token (`Tokenizer::encode_with_literals`); if the template transforms
/// content so that it cannot be located in the prompt, content holding control-token text is
/// refused (400, `messages`) rather than risk a forged turn.
pub async fn render_tokens(
    loaded: &Arc<Loaded>,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    add_special_tokens: bool,
) -> Result<Vec<TokenId>, ApiError> {
    let loaded = Arc::clone(loaded);
    tokio::task::spawn_blocking(move || {
        let marked = loaded
            .template
            .render_marked(&messages, add_generation_prompt)
            .map_err(|e| ApiError::bad_param("messages", format!("chat template: {e}")))?;
        let tokenizer = &loaded.tokenizer;
        let literals = if let Some(ranges) = marked.content_ranges {
            ranges
        } else {
            if let Some(index) =
                messages.iter().position(|m| tokenizer.contains_control_text(&m.content))
            {
                return Err(bad_message(
                    index,
                    "the content holds control-token text and this chat template transforms \
                     content, so it cannot be kept as plain text",
                ));
            }
            Vec::new()
        };
        tokenizer
            .encode_with_literals(&marked.text, &literals, add_special_tokens)
            .map(|ids| ids.into_iter().map(TokenId).collect())
            .map_err(|e| ApiError::bad_param("messages", format!("could not tokenize: {e}")))
    })
    .await
    .map_err(|e| ApiError::internal(format!("template task failed: {e}")))?
}

pub async fn chat_completions(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

async fn handle(state: Arc<ServerState>, req: ChatRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    check_model(&state, req.model.as_deref())?;
    let limits = loaded.limits;
    let top = req.top_logprobs.map(|k| {
        usize::try_from(k).map_err(|_| {
            ApiError::bad_param(
                "top_logprobs",
                format!("`top_logprobs` must be at least 0, got {k}"),
            )
        })
    });
    let top = top.transpose()?;
    let logprobs = match (req.logprobs.unwrap_or(false), top) {
        (true, k) => Some(k.unwrap_or(0)),
        (false, Some(k)) if k > 0 => {
            return Err(ApiError::bad_param(
                "top_logprobs",
                "`top_logprobs` requires `logprobs: true`",
            ));
        }
        (false, _) => None,
    };
    let max_tokens = req.max_completion_tokens.or(req.sampling.max_tokens);
    let spec = validate::spec(req.sampling, max_tokens, logprobs, &limits, &loaded.defaults)?;
    crate::structured_fields::check_compiles(&loaded, &spec).await?;
    let messages = template_messages(req.messages)?;
    let ids =
        render_tokens(&loaded, messages, req.add_generation_prompt.unwrap_or(true), false).await?;
    let seq_specs = (0..spec.n)
        .map(|sample| {
            Ok(SequenceSpec {
                prompt: ids.clone(),
                params: spec.for_prompt(ids.len(), sample, &limits)?,
                priority: spec.priority,
                stop: spec.stop.clone(),
                skip_special_tokens: spec.skip_special_tokens,
            })
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let max_tokens = max_tokens.and_then(|m| usize::try_from(m).ok());
    let seqs = start_all(&state, &loaded, seq_specs, spec.n, max_tokens)?;
    let mut usage = Usage::new(&[ids.len()]);
    let envelope = Envelope::new(&state, "chatcmpl");
    if spec.stream {
        let format = ChatChunks { loaded, envelope };
        return Ok(stream_response(
            seqs,
            spec.n,
            usage,
            spec.include_usage,
            state.config.keep_alive,
            state.aborted(),
            format,
        ));
    }
    let results = collect_all(seqs, spec.n, &mut usage, state.aborted()).await?;
    let tokenizer = &loaded.tokenizer;
    let choices: Vec<Value> = results
        .into_iter()
        .enumerate()
        .map(|(index, r)| {
            let mut choice = json!({
                "index": index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": logprobs.map(|_| chat_logprobs(tokenizer, &r.logprobs)),
                "finish_reason": r.finish_reason,
                "stop_reason": Value::Null,
            });
            if let Some(lps) = &r.prompt_logprobs {
                choice["prompt_logprobs"] = prompt_logprobs(tokenizer, lps);
            }
            choice
        })
        .collect();
    Ok(Json(envelope.response("chat.completion", &choices, &usage)).into_response())
}

/// Stream chunks of `/v1/chat/completions`.
struct ChatChunks {
    loaded: Arc<Loaded>,
    envelope: Envelope,
}

impl ChunkFormat for ChatChunks {
    const OBJECT: &'static str = "chat.completion.chunk";

    fn envelope(&self) -> &Envelope {
        &self.envelope
    }

    fn opening(&mut self, index: usize) -> Option<Value> {
        Some(self.chunk(&json!([{
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": Value::Null,
            "finish_reason": Value::Null,
        }])))
    }

    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value> {
        if delta.text.is_empty() && delta.finish_reason.is_none() && delta.logprobs.is_none() {
            return None;
        }
        let logprobs = delta
            .logprobs
            .as_ref()
            .map(|lp| chat_logprobs(&self.loaded.tokenizer, std::slice::from_ref(lp)));
        let content =
            if delta.text.is_empty() { json!({}) } else { json!({"content": delta.text}) };
        Some(self.chunk(&json!([{
            "index": index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }])))
    }

    fn abort(&mut self, index: usize) -> Value {
        self.chunk(&json!([{
            "index": index,
            "delta": {},
            "logprobs": Value::Null,
            "finish_reason": "abort",
        }]))
    }
}
