//! One generated sequence as the HTTP layer sees it: submitted to the engine, its tokens
//! detokenized incrementally (never broken UTF-8), stop strings matched across token
//! boundaries, timings recorded for metrics and the request log.
//!
//! Invariants: a [`Sequence`] dropped before it finished (client gone, another choice failed,
//! shutdown) aborts its engine request at once, which frees its KV blocks; a stop string ends
//! the sequence with finish reason "stop" and aborts the engine request too. Metrics record
//! every sequence exactly once, when it ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kiln_core::{FinishReason, RequestId, TokenId};
use kiln_engine::{
    AddError, CompiledOutput, EngineError, Logprobs, PrepareError, PreparedRequest, PromptLogprobs,
    StreamItem,
};
use kiln_tokenizer::DecodeStream;
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::metrics::FinishedRequest;
use crate::state::{InFlight, Loaded, QueueSlot, ServerState};
use crate::stop::StopMatcher;
use crate::validate::{GenerationSpec, Limits};

/// What one engine output adds to a sequence.
#[derive(Debug, Default)]
pub struct Delta {
    /// Text released by this token (may be empty: held back by UTF-8 or a possible stop).
    pub text: String,
    pub token: TokenId,
    pub logprobs: Option<Logprobs>,
    /// "stop" or "length" on the last delta.
    pub finish_reason: Option<&'static str>,
    /// On the last delta, when a stop string (not a token) ended the sequence: which one.
    pub stop_string: Option<String>,
    /// First delta only, when asked.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// First delta only: prompt tokens served from the prefix cache.
    pub num_cached_tokens: Option<usize>,
    /// A pooling sequence's one delta: its vector (its token is not shown).
    pub pooled: Option<Vec<f32>>,
    /// Last delta of a `do_remote_decode` request: its prompt's KV pinned for a decode worker.
    pub kv_pin: Option<kiln_engine::KvPin>,
}

/// How to run one sequence: its request prepared for the engine (ids checked against the
/// vocabulary, structured output compiled) and what the HTTP layer does with its tokens.
pub struct SequenceSpec {
    pub request: PreparedRequest,
    pub priority: i64,
    pub stop: Vec<String>,
    pub skip_special_tokens: bool,
    /// KV fetched from a prefill worker, imported just before the request is admitted.
    pub import: Option<kiln_engine::KvImport>,
}

impl SequenceSpec {
    /// Sample `sample` of `spec` on the prompt `ids`; `compiled` is `spec`'s structured output
    /// compiled once for all samples ([`crate::structured_fields::compile`]). A token id
    /// outside the vocabulary is a 400 naming the parameter that holds it.
    pub fn new(
        spec: &GenerationSpec,
        ids: &[TokenId],
        sample: usize,
        limits: &Limits,
        compiled: Option<&CompiledOutput>,
    ) -> Result<Self, ApiError> {
        let params = spec.for_prompt(ids.len(), sample, limits)?;
        let export = spec.kv_transfer == Some(crate::kv_transfer::TransferAsk::Export);
        let request = PreparedRequest::new(ids.to_vec(), params, limits.vocab_size, compiled)
            .map(|r| r.with_adapter_binding(spec.adapter))
            .map(|r| if export { r.with_kv_export() } else { r })
            .map_err(|e| match e {
                PrepareError::TokenOutOfVocab { what, token, vocab_size } => ApiError::bad_param(
                    what,
                    format!(
                        "`{what}`: token id {token} is outside the vocabulary (valid ids are 0 to \
                         {})",
                        vocab_size.saturating_sub(1)
                    ),
                ),
                other => ApiError::internal(other.to_string()),
            })?;
        Ok(Self {
            request,
            priority: spec.priority,
            stop: spec.stop.clone(),
            skip_special_tokens: spec.skip_special_tokens,
            import: None,
        })
    }
}

pub struct Sequence {
    id: RequestId,
    loaded: Arc<Loaded>,
    rx: mpsc::UnboundedReceiver<StreamItem>,
    detok: DecodeStream<'static>,
    stop: StopMatcher,
    min_tokens: usize,
    num_prompt_tokens: usize,
    num_generated: usize,
    num_cached_tokens: usize,
    submitted: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    queue_slot: Option<QueueSlot>,
    _in_flight: InFlight,
    log_requests: bool,
    finished: bool,
    /// A pooling request: one output, a vector, no text or generated token.
    pooling: bool,
}

impl Sequence {
    /// Submits `spec` (does not wait for the engine).
    pub fn start(
        state: &Arc<ServerState>,
        loaded: &Arc<Loaded>,
        spec: SequenceSpec,
        queue_slot: QueueSlot,
    ) -> Result<Self, ApiError> {
        let (tx, rx) = mpsc::unbounded_channel();
        let num_prompt_tokens = spec.request.prompt().len();
        let min_tokens = spec.request.params().min_tokens;
        let pooling = spec.request.pooling().is_some();
        let submitted = Instant::now();
        let sink = Box::new(move |item| tx.send(item).is_ok());
        let engine = &loaded.engine;
        let id = match spec.import {
            Some(import) => {
                engine.submit_imported_with_sink(spec.request, spec.priority, sink, import)
            }
            None => engine.submit_prepared_with_sink(spec.request, spec.priority, sink),
        }
        .map_err(|_| ApiError::draining())?;
        Ok(Self {
            id,
            loaded: Arc::clone(loaded),
            rx,
            detok: DecodeStream::shared(Arc::clone(&loaded.tokenizer), spec.skip_special_tokens),
            stop: StopMatcher::new(&spec.stop),
            min_tokens,
            num_prompt_tokens,
            num_generated: 0,
            num_cached_tokens: 0,
            submitted,
            first_scheduled: None,
            first_token: None,
            last_token: None,
            queue_slot: Some(queue_slot),
            _in_flight: state.enter(),
            log_requests: !state.config.disable_log_requests,
            finished: false,
            pooling,
        })
    }

    pub fn num_prompt_tokens(&self) -> usize {
        self.num_prompt_tokens
    }

    pub fn num_generated(&self) -> usize {
        self.num_generated
    }

    /// Prompt tokens served from the prefix cache (known after the first delta).
    pub fn num_cached_tokens(&self) -> usize {
        self.num_cached_tokens
    }

    /// The next delta; `None` after the last one. An error ends the sequence.
    pub async fn next(&mut self) -> Option<Result<Delta, ApiError>> {
        if self.finished {
            return None;
        }
        let item = self.rx.recv().await;
        let out = match item {
            Some(Ok(out)) => out,
            Some(Err(e)) => {
                self.finish("abort");
                return Some(Err(engine_error(&e)));
            }
            None => {
                self.finish("abort");
                return Some(Err(ApiError::internal(
                    "the engine stopped before the request finished",
                )));
            }
        };
        let now = Instant::now();
        let metrics = &self.loaded.metrics;
        if let Some(first) = out.first {
            self.first_scheduled = Some(first.scheduled_at);
            self.num_cached_tokens = first.num_cached_tokens;
        }
        if self.pooling {
            return Some(self.pooled(out, now));
        }
        if self.first_token.is_none() {
            self.first_token = Some(now);
            self.queue_slot = None;
            metrics.on_prompt_tokens(self.num_prompt_tokens);
            metrics.on_generation_token(None);
        } else {
            metrics.on_generation_token(self.last_token.map(|t| now.saturating_duration_since(t)));
        }
        self.last_token = Some(now);
        self.num_generated += 1;
        // A token the engine stopped on (EOS or a `stop_token_ids` entry) is not part of the
        // text, as in vLLM, also when special tokens are kept.
        let stop_token = out.finish_reason == Some(FinishReason::Stop);
        let piece = match if stop_token { Ok(None) } else { self.detok.step(out.new_token.0) } {
            Ok(piece) => piece.unwrap_or_default(),
            Err(e) => {
                tracing::warn!(request = %self.id, "detokenization failed: {e}");
                String::new()
            }
        };
        let (mut text, stopped) = if self.num_generated < self.min_tokens {
            let mut text = self.stop.flush();
            text.push_str(&piece);
            (text, false)
        } else {
            let released = self.stop.push(&piece);
            (released.text, released.stopped)
        };
        let finish_reason = if stopped {
            self.loaded.engine.abort(self.id);
            Some("stop")
        } else {
            out.finish_reason.map(FinishReason::as_str)
        };
        if let Some(reason) = finish_reason {
            if !stopped {
                text.push_str(&self.stop.flush());
            }
            self.finish(reason);
        }
        Some(Ok(Delta {
            text,
            token: out.new_token,
            logprobs: out.logprobs,
            finish_reason,
            stop_string: if stopped { self.stop.matched().map(str::to_owned) } else { None },
            prompt_logprobs: out.prompt_logprobs,
            num_cached_tokens: out.first.map(|f| f.num_cached_tokens),
            pooled: None,
            kv_pin: out.kv_pin,
        }))
    }

    /// A pooling request's one output: its vector, the request finished ("stop").
    fn pooled(&mut self, out: kiln_engine::EngineOutput, now: Instant) -> Result<Delta, ApiError> {
        self.first_token = Some(now);
        self.last_token = Some(now);
        self.loaded.metrics.on_prompt_tokens(self.num_prompt_tokens);
        self.finish("stop");
        let Some(pooled) = out.pooled else {
            return Err(ApiError::internal(
                "the engine finished a pooling request without its vector",
            ));
        };
        Ok(Delta {
            token: out.new_token,
            finish_reason: Some("stop"),
            num_cached_tokens: out.first.map(|f| f.num_cached_tokens),
            pooled: Some(pooled),
            ..Delta::default()
        })
    }

    fn finish(&mut self, reason: &'static str) {
        self.finished = true;
        self.queue_slot = None;
        let now = Instant::now();
        let since = |a: Option<Instant>, b: Option<Instant>| -> Option<Duration> {
            Some(b?.saturating_duration_since(a?))
        };
        let record = FinishedRequest {
            finished_reason: reason,
            num_prompt_tokens: self.num_prompt_tokens,
            num_generation_tokens: self.num_generated,
            e2e: now.saturating_duration_since(self.submitted),
            queue: since(Some(self.submitted), self.first_scheduled),
            ttft: since(Some(self.submitted), self.first_token),
            prefill: since(self.first_scheduled, self.first_token),
            decode: since(self.first_token, self.last_token),
            inference: since(self.first_scheduled, Some(now)),
        };
        self.loaded.metrics.on_request_finished(&record);
        if self.log_requests {
            tracing::info!(
                request = %self.id,
                prompt_tokens = self.num_prompt_tokens,
                output_tokens = self.num_generated,
                cached_tokens = self.num_cached_tokens,
                ttft_ms = record.ttft.map_or(-1.0, |d| d.as_secs_f64() * 1e3),
                e2e_ms = record.e2e.as_secs_f64() * 1e3,
                finish_reason = reason,
                "request finished"
            );
        }
    }
}

impl Drop for Sequence {
    fn drop(&mut self) {
        if !self.finished {
            self.loaded.engine.abort(self.id);
            self.finish("abort");
        }
    }
}

fn engine_error(e: &EngineError) -> ApiError {
    match e {
        EngineError::Rejected(reason @ AddError::DeadlineUnmeetable { .. }) => ApiError {
            retry_after: Some(1),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, reason.to_string())
        },
        EngineError::Rejected(reason) => ApiError::bad_request(reason.to_string()),
        EngineError::Shutdown => ApiError::draining(),
        EngineError::Config(m) => ApiError::internal(m.clone()),
        e @ (EngineError::Forward(_) | EngineError::KvTier(_) | EngineError::Broken(_)) => {
            ApiError::internal(e.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unmeetable_deadline_is_429_with_retry_after_other_refusals_400() {
        let late = EngineError::Rejected(AddError::DeadlineUnmeetable {
            predicted_ms: 4200,
            ttft_slo_ms: 1000,
        });
        let e = engine_error(&late);
        assert_eq!((e.status, e.retry_after), (StatusCode::TOO_MANY_REQUESTS, Some(1)));
        assert!(e.message.contains("1000 ms") && e.message.contains("4200 ms"), "{}", e.message);
        let bad = engine_error(&EngineError::Rejected(AddError::InvalidSampling("x".into())));
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
    }
}
