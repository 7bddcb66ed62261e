//! Runs the sequences of one HTTP request (`n` samples of each prompt) and shapes their
//! deltas into a whole response or a Server-Sent-Events stream.
//!
//! Invariants: choices are numbered `prompt_index * n + sample_index` (vLLM's order); when any
//! sequence fails, the others are dropped (and so aborted); a streaming response ends with at
//! most one error event, then the optional usage chunk, then `data: [DONE]`; the streaming task
//! stops (dropping its sequences) as soon as the client's side of the stream is gone, even while
//! it waits for a token.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream, StreamExt};
use kiln_core::TokenId;
use kiln_engine::{Logprobs, PromptLogprobs};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::sequence::{Delta, Sequence, SequenceSpec};
use crate::state::{Loaded, ServerState};

/// Starts every sequence (after reserving their queue places: all or none). `specs` are the
/// `n` samples of each prompt in turn; `max_tokens_param` is the request's `max_tokens` as
/// given (for the request-parameter metrics, recorded once per prompt once started).
pub fn start_all(
    state: &Arc<ServerState>,
    loaded: &Arc<Loaded>,
    specs: Vec<SequenceSpec>,
    n: usize,
    max_tokens_param: Option<usize>,
) -> Result<Vec<Sequence>, ApiError> {
    let slots = state.reserve(specs.len())?;
    // A pooling request has no sampling parameters to record (vLLM records none).
    let pooling = specs.iter().any(|s| s.request.pooling().is_some());
    let max_tokens: Vec<usize> = specs
        .iter()
        .step_by(n.max(1))
        .filter(|_| !pooling)
        .map(|s| s.request.params().max_tokens)
        .collect();
    let seqs = specs
        .into_iter()
        .zip(slots)
        .map(|(spec, slot)| Sequence::start(state, loaded, spec, slot))
        .collect::<Result<Vec<_>, _>>()?;
    for max in max_tokens {
        loaded.metrics.on_request_params(n, max_tokens_param, max * n);
    }
    Ok(seqs)
}

/// The deltas of all sequences as they come, tagged with the choice index.
fn merged(seqs: Vec<Sequence>) -> impl Stream<Item = (usize, Result<Delta, ApiError>)> + Send {
    stream::select_all(seqs.into_iter().enumerate().map(|(i, seq)| {
        Box::pin(stream::unfold(seq, move |mut seq| async move {
            let delta = seq.next().await?;
            Some(((i, delta), seq))
        }))
    }))
}

/// Token counts of a request, for `usage`.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    /// Prompt tokens of each prompt (counted once however many samples it has).
    pub prompt_tokens: Vec<usize>,
    /// Cached prompt tokens of each prompt (the best of its samples).
    pub cached_tokens: Vec<usize>,
    pub completion_tokens: usize,
}

impl Usage {
    pub fn new(prompt_lens: &[usize]) -> Self {
        Self {
            prompt_tokens: prompt_lens.to_vec(),
            cached_tokens: vec![0; prompt_lens.len()],
            completion_tokens: 0,
        }
    }

    fn add(&mut self, prompt: usize, delta: &Delta) {
        self.completion_tokens += 1;
        if let (Some(c), Some(slot)) = (delta.num_cached_tokens, self.cached_tokens.get_mut(prompt))
        {
            *slot = (*slot).max(c);
        }
    }

    pub fn to_json(&self) -> Value {
        let prompt: usize = self.prompt_tokens.iter().sum();
        json!({
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens.iter().sum::<usize>()},
        })
    }
}

/// Everything one choice produced.
#[derive(Debug, Default)]
pub struct ChoiceResult {
    pub text: String,
    pub tokens: Vec<TokenId>,
    pub logprobs: Vec<Logprobs>,
    pub finish_reason: Option<&'static str>,
    /// The stop string that ended the choice, if one did.
    pub stop_string: Option<String>,
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// A `do_remote_decode` request's pinned KV.
    pub kv_pin: Option<kiln_engine::KvPin>,
}

/// Runs all sequences to the end; `n` samples per prompt. When `aborted` resolves first (the
/// shutdown deadline), the answer is a 503.
pub async fn collect_all(
    seqs: Vec<Sequence>,
    n: usize,
    usage: &mut Usage,
    aborted: impl std::future::Future<Output = ()>,
) -> Result<Vec<ChoiceResult>, ApiError> {
    let mut results: Vec<ChoiceResult> = (0..seqs.len()).map(|_| ChoiceResult::default()).collect();
    let mut deltas = std::pin::pin!(merged(seqs));
    let mut aborted = std::pin::pin!(aborted);
    loop {
        let next = tokio::select! {
            () = &mut aborted => {
                return Err(ApiError::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    "The server shut down before the request finished.",
                ));
            }
            next = deltas.next() => next,
        };
        let Some((i, delta)) = next else { break };
        let delta = delta?;
        usage.add(i / n, &delta);
        let r = &mut results[i];
        r.text.push_str(&delta.text);
        r.tokens.push(delta.token);
        r.logprobs.extend(delta.logprobs);
        if delta.finish_reason.is_some() {
            r.finish_reason = delta.finish_reason;
            r.stop_string = delta.stop_string;
        }
        if delta.prompt_logprobs.is_some() {
            r.prompt_logprobs = delta.prompt_logprobs;
        }
        if delta.kv_pin.is_some() {
            r.kv_pin = delta.kv_pin;
        }
    }
    Ok(results)
}

/// The fields every response body or stream chunk of one request shares.
#[derive(Clone, Debug)]
pub struct Envelope {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Envelope {
    /// A fresh id with `prefix` (`cmpl`, `chatcmpl`), now, and the model name of LoRA slot
    /// `adapter` (the served name for the base model).
    pub fn new(state: &ServerState, prefix: &str, adapter: u32) -> Self {
        Self {
            id: state.response_id(prefix),
            created: crate::routes::unix_now(),
            model: crate::routes::reported_name(state, adapter),
        }
    }

    /// A whole (not streamed) response.
    pub fn response(&self, object: &str, choices: &[Value], usage: &Usage) -> Value {
        let mut response = self.chunk(object, &json!(choices));
        response["usage"] = usage.to_json();
        response
    }

    /// A stream chunk of `object`.
    pub fn chunk(&self, object: &str, choices: &Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }
}

/// How an endpoint renders stream chunks.
pub trait ChunkFormat: Send + 'static {
    /// The chunks' `object`.
    const OBJECT: &'static str;
    fn envelope(&self) -> &Envelope;
    /// A chunk of [`Self::OBJECT`] carrying `choices`.
    fn chunk(&self, choices: &Value) -> Value {
        self.envelope().chunk(Self::OBJECT, choices)
    }
    /// Chunks sent before any token (chat's role chunk), per choice.
    fn opening(&mut self, index: usize) -> Option<Value>;
    /// The chunk for one delta of choice `index` (`None`: nothing worth sending).
    fn delta(&mut self, index: usize, delta: Delta) -> Option<Value>;
    /// The last chunk of choice `index` when it is cut short (`finish_reason: "abort"`).
    fn abort(&mut self, index: usize) -> Value;
}

/// A streaming response: SSE chunks as the sequences produce them. When `aborted` resolves
/// (the shutdown deadline), every choice still running gets [`ChunkFormat::abort`], then the
/// usage chunk (if asked) and `[DONE]` end the stream properly.
pub fn stream_response<F: ChunkFormat>(
    seqs: Vec<Sequence>,
    n: usize,
    mut usage: Usage,
    report: crate::validate::UsageReport,
    keep_alive: Duration,
    aborted: impl std::future::Future<Output = ()> + Send + 'static,
    mut format: F,
) -> Response {
    let (tx, rx) = mpsc::channel::<Event>(64);
    let num_choices = seqs.len();
    tokio::spawn(async move {
        let send = |value: String| {
            let tx = tx.clone();
            async move { tx.send(Event::default().data(value)).await.is_ok() }
        };
        // With `include_usage`, every chunk but the last carries `usage: null` (OpenAI), or
        // the usage so far with `continuous_usage_stats` (vLLM).
        let with_usage = |mut chunk: Value, usage: &Usage| {
            if report.every_chunk {
                chunk["usage"] = usage.to_json();
            } else if report.last_chunk {
                chunk["usage"] = Value::Null;
            }
            chunk.to_string()
        };
        for i in 0..num_choices {
            if let Some(chunk) = format.opening(i)
                && !send(with_usage(chunk, &usage)).await
            {
                return;
            }
        }
        let mut deltas = std::pin::pin!(merged(seqs));
        let mut aborted = std::pin::pin!(aborted);
        let mut finished = vec![false; num_choices];
        loop {
            let next = tokio::select! {
                () = tx.closed() => return,
                () = &mut aborted => {
                    for i in (0..num_choices).filter(|&i| !finished[i]) {
                        if !send(with_usage(format.abort(i), &usage)).await {
                            return;
                        }
                    }
                    break;
                }
                next = deltas.next() => next,
            };
            match next {
                None => break,
                Some((i, Ok(delta))) => {
                    usage.add(i / n, &delta);
                    if delta.finish_reason.is_some() {
                        finished[i] = true;
                    }
                    if let Some(chunk) = format.delta(i, delta)
                        && !send(with_usage(chunk, &usage)).await
                    {
                        return;
                    }
                }
                Some((_, Err(e))) => {
                    if !send(e.body().to_string()).await {
                        return;
                    }
                    break;
                }
            }
        }
        if report.last_chunk {
            let mut chunk = format.chunk(&json!([]));
            chunk["usage"] = usage.to_json();
            if !send(chunk.to_string()).await {
                return;
            }
        }
        // The sequences still running after an abort are dropped with the task: aborted.
        send("[DONE]".to_owned()).await;
    });
    let events = stream::unfold(rx, |mut rx| async move {
        let event = rx.recv().await?;
        Some((Ok::<_, Infallible>(event), rx))
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
}
