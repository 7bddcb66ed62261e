//! `POST /v1/chat/completions`: messages rendered with the model's chat template, `n` samples,
//! `logprobs` + `top_logprobs`, tool calls (`tools`, `tool_choice`), streaming or not.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_engine::CompiledOutput;
use serde_json::{Value, json};

use super::chat_input::{render_tokens, set_reasoning_effort, template_kwargs, template_messages};
use super::format::{chat_logprobs, prompt_logprobs};
use super::resolve_model;
use crate::chat_template::RenderOptions;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::generate::{ChunkFormat, Envelope, Usage, collect_all, start_all, stream_response};
use crate::protocol::ChatRequest;
use crate::reasoning::{ReasoningParser, ReasoningSplit, Start};
use crate::sequence::{Delta, SequenceSpec};
use crate::state::{Loaded, ServerState};
use crate::tools::{self, ToolOutput, ToolStream};
use crate::validate;

pub async fn chat_completions(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

/// A validated chat request with its messages rendered and tokenized, as generation and
/// `/v1/chat/completions/render` take it.
pub(crate) struct Prepared {
    pub spec: validate::GenerationSpec,
    /// How the output is read: tool calls or plain content.
    pub output: tools::ToolOutput,
    pub logprobs: Option<usize>,
    /// The prompt's token ids (what the engine computes, and `render` returns).
    pub ids: Vec<kiln_core::TokenId>,
    pub max_tokens: Option<i64>,
    /// With `--reasoning-parser`: where each output starts, and whether the client wants the
    /// reasoning (`include_reasoning`, default true).
    pub reasoning: Option<(Start, bool)>,
    /// The structured output compiled once for every sample.
    pub compiled: Option<CompiledOutput>,
}

/// Validates `req`, plans its tools and renders its messages through the chat template.
pub(crate) async fn prepare(
    state: &ServerState,
    loaded: &Arc<Loaded>,
    req: ChatRequest,
) -> Result<Prepared, ApiError> {
    let adapter = resolve_model(state, req.model.as_deref()).await?;
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
    let max_tokens = match req.max_completion_tokens {
        Some(m) => Some(m),
        None => req.sampling.max_tokens_given()?,
    };
    let mut spec = validate::spec(req.sampling, max_tokens, logprobs, &limits, &loaded.defaults)?;
    (spec.adapter, spec.adapter_lease) = (adapter.binding, adapter.lease);
    let settings = state.config.tools;
    let fields = (req.tools, req.tool_choice, req.parallel_tool_calls);
    let plan = plan_tools(fields, settings, &mut spec)?;
    let include_reasoning = req.include_reasoning.unwrap_or(true);
    if !include_reasoning && state.config.reasoning_parser.is_none() {
        return Err(ApiError::bad_param(
            "include_reasoning",
            "`include_reasoning: false` needs a reasoning parser (--reasoning-parser); without \
             one the reasoning is part of the text",
        ));
    }
    let mut kwargs = template_kwargs(req.chat_template_kwargs)?;
    set_reasoning_effort(req.reasoning_effort, &loaded.template, &mut kwargs)?;
    let options = RenderOptions {
        add_generation_prompt: req.add_generation_prompt.unwrap_or(true),
        tools: plan.tools,
        kwargs,
    };
    let messages = template_messages(req.messages)?;
    let ids = render_tokens(loaded, messages, options, false).await?;
    let reasoning = state.config.reasoning_parser.map(|parser| {
        spec.skip_special_tokens &= !parser.needs_special_tokens();
        let start = reasoning_start(loaded, parser, &ids);
        if let Some(answer) = spec.params.structured.take() {
            spec.params.structured = Some(ReasoningParser::constrain_answer(start, answer));
        }
        (start, include_reasoning)
    });
    let compiled = crate::structured_fields::compile(loaded, &spec).await?;
    Ok(Prepared { spec, output: plan.output, logprobs, ids, max_tokens, reasoning, compiled })
}

/// Tokens at the prompt's end decoded to find an opened or closed `<think>` (enough for the
/// markers and the whitespace around them even when a small vocabulary spells them out).
const PROMPT_TAIL_TOKENS: usize = 64;

/// Where the outputs of the prompt `ids` start, by its last tokens' text.
pub(crate) fn reasoning_start(
    loaded: &Loaded,
    parser: ReasoningParser,
    ids: &[kiln_core::TokenId],
) -> Start {
    let tail: Vec<u32> =
        ids[ids.len().saturating_sub(PROMPT_TAIL_TOKENS)..].iter().map(|t| t.0).collect();
    parser.start(&loaded.tokenizer.decode(&tail, false).unwrap_or_default())
}

async fn handle(state: Arc<ServerState>, req: ChatRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let limits = loaded.limits;
    let Prepared { spec, output, logprobs, ids, max_tokens, reasoning, compiled } =
        prepare(&state, &loaded, req).await?;
    let settings = state.config.tools;
    let mut seq_specs = (0..spec.n)
        .map(|sample| SequenceSpec::new(&spec, &ids, sample, &limits, compiled.as_ref()))
        .collect::<Result<Vec<_>, ApiError>>()?;
    crate::kv_transfer::ready_sequences(&loaded, &spec, 1, &mut seq_specs).await?;
    let max_tokens = max_tokens.and_then(|m| usize::try_from(m).ok());
    let seqs = start_all(&state, &loaded, seq_specs, spec.n, max_tokens)?;
    let mut usage = Usage::new(&[ids.len()]);
    let envelope = Envelope::new(&state, "chatcmpl", spec.adapter.slot);
    let parser = settings.parser;
    let mut new_id = || tools::call_id(state.unique(), parser);
    if spec.stream {
        let streams = (0..spec.n).map(|_| ToolStream::new(output.clone())).collect();
        let splits = (0..spec.n).map(|_| reasoning.map(|(start, _)| ReasoningSplit::new(start)));
        let include_reasoning = reasoning.is_some_and(|(_, include)| include);
        let format = ChatChunks {
            loaded,
            envelope,
            state: Arc::clone(&state),
            streams,
            splits: splits.collect(),
            include_reasoning,
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
    let results = collect_all(seqs, spec.n, &mut usage, state.aborted()).await?;
    let kv_transfer_params = crate::kv_transfer::response_field(&loaded, &spec, &results);
    let tokenizer = &loaded.tokenizer;
    let choices: Vec<Value> = results
        .into_iter()
        .enumerate()
        .map(|(index, mut r)| {
            let (thinking, text) = match reasoning {
                Some((start, include)) => {
                    let split = ReasoningSplit::whole(start, &r.text);
                    let thinking = Some(split.reasoning).filter(|t| include && !t.is_empty());
                    (Some(thinking), split.answer)
                }
                None => (None, r.text),
            };
            let had_thinking = thinking.as_ref().is_some_and(Option::is_some);
            let mut answer = tools::answer(&output, text, r.finish_reason);
            if had_thinking && answer.content.as_deref() == Some("") {
                answer.content = None;
            }
            let mut message = json!({"role": "assistant", "content": answer.content});
            if let Some(thinking) = thinking {
                message["reasoning_content"] = json!(thinking);
            }
            if !answer.calls.is_empty() {
                message["tool_calls"] = tools::wire_calls(&answer.calls, &mut new_id);
            }
            let stop_string = r.stop_string.take();
            let mut choice = json!({
                "index": index,
                "message": message,
                "logprobs": logprobs.map(|_| chat_logprobs(tokenizer, &r.logprobs)),
                "finish_reason": answer.finish_reason,
                "stop_reason": stop_string,
            });
            if let Some(lps) = &r.prompt_logprobs {
                choice["prompt_logprobs"] = prompt_logprobs(tokenizer, lps);
            }
            choice
        })
        .collect();
    let mut body = envelope.response("chat.completion", &choices, &usage);
    if let Some(params) = kv_transfer_params {
        body["kv_transfer_params"] = params;
    }
    Ok(Json(body).into_response())
}

/// The request's tool fields as a plan; a forced call becomes `spec`'s grammar, and a parser
/// whose markers are special tokens keeps them in the text.
fn plan_tools(
    (tools, tool_choice, parallel): (Option<Value>, Option<Value>, Option<Value>),
    settings: tools::ToolSettings,
    spec: &mut validate::GenerationSpec,
) -> Result<tools::ToolPlan, ApiError> {
    let (plan, grammar) =
        tools::plan(tools, tool_choice, parallel.as_ref(), settings, spec.structured_param)?;
    if let Some(grammar) = grammar {
        spec.params.structured = Some(grammar);
        spec.structured_param = Some("tool_choice");
    }
    if let ToolOutput::Parsed { parser, .. } = plan.output {
        spec.skip_special_tokens &= !parser.needs_special_tokens();
    }
    Ok(plan)
}

/// Stream chunks of `/v1/chat/completions`.
struct ChatChunks {
    loaded: Arc<Loaded>,
    envelope: Envelope,
    state: Arc<ServerState>,
    /// Per choice: what of its text is content and what tool calls.
    streams: Vec<ToolStream>,
    /// Per choice, with a reasoning parser: what of its text is reasoning.
    splits: Vec<Option<ReasoningSplit>>,
    /// Reasoning is sent (`delta.reasoning_content`) rather than dropped.
    include_reasoning: bool,
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
        let (state, parser) = (&self.state, self.state.config.tools.parser);
        let mut new_id = || tools::call_id(state.unique(), parser);
        let (thinking, text) = match &mut self.splits[index] {
            Some(split) => {
                let s = split.push(&delta.text, delta.finish_reason.is_some());
                (if self.include_reasoning { s.reasoning } else { String::new() }, s.answer)
            }
            None => (String::new(), delta.text),
        };
        let step = self.streams[index].push(&text, delta.finish_reason, &mut new_id);
        if thinking.is_empty()
            && step.content.is_empty()
            && step.tool_calls.is_empty()
            && step.finish_reason.is_none()
            && delta.logprobs.is_none()
        {
            return None;
        }
        let logprobs = delta
            .logprobs
            .as_ref()
            .map(|lp| chat_logprobs(&self.loaded.tokenizer, std::slice::from_ref(lp)));
        let mut content = json!({});
        if !thinking.is_empty() {
            content["reasoning_content"] = json!(thinking);
        }
        if !step.content.is_empty() {
            content["content"] = json!(step.content);
        }
        if !step.tool_calls.is_empty() {
            content["tool_calls"] = Value::Array(step.tool_calls);
        }
        Some(self.chunk(&json!([{
            "index": index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": step.finish_reason,
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
