//! OpenAI's Responses API: `POST /v1/responses` (whole, streamed, or in the background),
//! `GET` and `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`. A request is
//! translated into a chat request ([`request`]) and its output read back into output items
//! ([`reply`]): `reasoning` (with `--reasoning-parser`), `message` and `function_call`.
//!
//! Responses are kept (`store`, the default) in a bounded in-memory [`store`]: the oldest go
//! first once `--max-stored-responses` responses or their byte budget are reached, and a
//! `previous_response_id` or `GET` naming an evicted one gets a 404. A response continuing
//! another reads the earlier one's input and output items, then its own input (the earlier
//! `instructions` are not carried over, as OpenAI does).
//!
//! Invariants: whole, streamed and background responses of one request carry the same items
//! (one [`reply::Assembler`]); a non-background response is stored once it has finished
//! (a stream whose client left is not stored); a background response is stored at once as
//! `in_progress` and ends `completed`, `incomplete`, `failed` or `cancelled`; a cancelled or
//! evicted background response stops its generation.

mod items;
pub mod reply;
pub mod request;
pub mod store;

use std::convert::Infallible;
use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::routes::chat::{Prepared, prepare};
use crate::sequence::{Sequence, SequenceSpec};
use crate::state::ServerState;
use reply::{Assembler, Finished, Head};
use request::ResponsesRequest;
use store::Stored;

pub async fn create(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ResponsesRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

fn not_found(id: &str) -> ApiError {
    let shown: String = id.chars().take(64).collect();
    ApiError::not_found(format!("Response with id '{shown}' not found."))
}

/// Refuses query parameters (`GET ?stream=true` resumes background streams at OpenAI, which
/// kiln does not do).
fn no_query(query: Option<&str>) -> Result<(), ApiError> {
    match query.filter(|q| !q.is_empty()) {
        None => Ok(()),
        Some(q) => {
            let name = q.split(['=', '&']).next().unwrap_or_default();
            let shown: String = name.chars().take(64).collect();
            Err(ApiError::bad_param(
                &shown,
                format!("query parameter `{shown}` is not supported on /v1/responses/{{id}}"),
            ))
        }
    }
}

pub async fn retrieve(
    State(state): State<Arc<ServerState>>,
    Path(id): Path<String>,
    RawQuery(query): RawQuery,
) -> Response {
    let found = no_query(query.as_deref())
        .and_then(|()| state.responses.get(&id).ok_or_else(|| not_found(&id)));
    match found {
        Ok(stored) => Json(stored.response).into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn delete(State(state): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    if state.responses.remove(&id) {
        Json(json!({"id": id, "object": "response", "deleted": true})).into_response()
    } else {
        not_found(&id).into_response()
    }
}

pub async fn cancel(State(state): State<Arc<ServerState>>, Path(id): Path<String>) -> Response {
    let cancelled = state.responses.update(&id, |stored| {
        if stored.response["background"] != json!(true) {
            return Err(ApiError::bad_request("Cannot cancel a synchronous response."));
        }
        match stored.status() {
            "in_progress" | "queued" => {
                if let Some(task) = stored.task.take() {
                    task.abort();
                }
                stored.response["status"] = json!("cancelled");
                Ok(stored.response.clone())
            }
            "cancelled" => Ok(stored.response.clone()),
            status => Err(ApiError::bad_request(format!(
                "Cannot cancel a response whose status is {status}."
            ))),
        }
    });
    match cancelled {
        None => not_found(&id).into_response(),
        Some(Ok(response)) => Json(response).into_response(),
        Some(Err(e)) => e.into_response(),
    }
}

async fn handle(state: Arc<ServerState>, req: ResponsesRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let previous = match req.previous_response_id.as_deref() {
        None => None,
        Some(id) => {
            let mut e = not_found(id);
            e.param = Some("previous_response_id".into());
            let stored = state.responses.get(id).ok_or(e)?;
            if !["completed", "incomplete"].contains(&stored.status()) {
                return Err(ApiError::bad_param(
                    "previous_response_id",
                    format!(
                        "the previous response is {}: only a completed or incomplete response \
                         can be continued",
                        stored.status()
                    ),
                ));
            }
            Some(stored.conversation)
        }
    };
    let translated = req.translate(previous.as_deref(), state.responses.enabled())?;
    let Prepared { spec, output, ids, max_tokens, reasoning, compiled, .. } =
        prepare(&state, &loaded, translated.chat).await?;
    let seq_spec = SequenceSpec::new(&spec, &ids, 0, &loaded.limits, compiled.as_ref())?;
    let max_tokens = max_tokens.and_then(|m| usize::try_from(m).ok());
    let mut seqs = crate::generate::start_all(&state, &loaded, vec![seq_spec], 1, max_tokens)?;
    let seq = seqs.pop().ok_or_else(|| ApiError::internal("no sequence started"))?;
    let head = Head {
        id: format!("resp_{:016x}{:08x}", state.unique(), state.unique() as u32),
        created_at: crate::routes::unix_now(),
        model: crate::routes::reported_name(&state, spec.adapter.slot),
        echo: translated.echo,
    };
    let tokenizer = translated.logprobs.then(|| Arc::clone(&loaded.tokenizer));
    let asm = Assembler::new(&state, tokenizer, output, reasoning);
    let mut conversation = previous.unwrap_or_default();
    conversation.extend(translated.input_items);
    let mut run = Run { state, head, asm, input_tokens: ids.len(), conversation };
    if translated.delivery.background {
        return Ok(run.background(seq));
    }
    if translated.delivery.stream {
        return Ok(run.stream(seq, translated.delivery.store));
    }
    let finished = run.whole(seq).await?;
    let response = finished.object(&run.head, run.input_tokens);
    if translated.delivery.store {
        run.store(&finished, response.clone());
    }
    Ok(Json(response).into_response())
}

/// One response being computed.
struct Run {
    state: Arc<ServerState>,
    head: Head,
    asm: Assembler,
    input_tokens: usize,
    /// The items before this response's output (what a continuation reads first).
    conversation: Vec<Value>,
}

/// Why a response ended without finishing.
enum Stop {
    /// The generation failed (or the server shut down).
    Failed(ApiError),
    /// The client of a stream left.
    Gone,
}

impl Run {
    /// Keeps the finished response with the conversation a continuation reads.
    fn store(&self, finished: &Finished, response: Value) {
        let mut conversation = self.conversation.clone();
        conversation.extend(finished.items.iter().cloned());
        self.state.responses.put(&self.head.id, Stored { response, conversation, task: None });
    }

    /// Reads `seq` to the end; with `tx`, sends each event as it is made.
    async fn drive(
        &mut self,
        mut seq: Sequence,
        tx: Option<&mpsc::Sender<Event>>,
    ) -> Result<Finished, Stop> {
        let aborted = self.state.aborted();
        let mut aborted = std::pin::pin!(aborted);
        loop {
            let next = tokio::select! {
                () = &mut aborted => {
                    return Err(Stop::Failed(ApiError::new(
                        axum::http::StatusCode::SERVICE_UNAVAILABLE,
                        "The server shut down before the response finished.",
                    )));
                }
                next = seq.next() => next,
            };
            let delta = match next {
                None => return Err(Stop::Failed(ApiError::internal("the output ended early"))),
                Some(Err(e)) => return Err(Stop::Failed(e)),
                Some(Ok(delta)) => delta,
            };
            self.asm.push(&delta);
            if let Some(tx) = tx {
                for data in self.asm.take_events() {
                    if tx.send(sse(&data)).await.is_err() {
                        return Err(Stop::Gone);
                    }
                }
            }
            if let Some(finished) = self.asm.finished() {
                return Ok(finished);
            }
        }
    }

    async fn whole(&mut self, seq: Sequence) -> Result<Finished, ApiError> {
        match self.drive(seq, None).await {
            Ok(finished) => Ok(finished),
            Err(Stop::Failed(e)) => Err(e),
            Err(Stop::Gone) => Err(ApiError::internal("the response was dropped")),
        }
    }

    /// The response as Server-Sent Events; stored at the end when `store`.
    fn stream(mut self, seq: Sequence, store: bool) -> Response {
        let (tx, rx) = mpsc::channel::<Event>(64);
        let keep_alive = self.state.config.keep_alive;
        tokio::spawn(async move {
            let created = self.head.object("in_progress", Vec::new(), Value::Null);
            self.asm.event("response.created", json!({"response": created}));
            self.asm.event("response.in_progress", json!({"response": created}));
            for data in self.asm.take_events() {
                if tx.send(sse(&data)).await.is_err() {
                    return;
                }
            }
            let last = match self.drive(seq, Some(&tx)).await {
                Ok(finished) => {
                    let response = finished.object(&self.head, self.input_tokens);
                    if store {
                        self.store(&finished, response.clone());
                    }
                    let kind = if finished.incomplete {
                        "response.incomplete"
                    } else {
                        "response.completed"
                    };
                    (kind, response)
                }
                Err(Stop::Gone) => return,
                Err(Stop::Failed(e)) => ("response.failed", failed(&self.head, &e)),
            };
            self.asm.event(last.0, json!({"response": last.1}));
            for data in self.asm.take_events() {
                let _ = tx.send(sse(&data)).await;
            }
        });
        let events = stream::unfold(rx, |mut rx| async move {
            let event = rx.recv().await?;
            Some((Ok::<_, Infallible>(event), rx))
        });
        Sse::new(events).keep_alive(KeepAlive::new().interval(keep_alive)).into_response()
    }

    /// Stores the response as `in_progress` and computes it in a task of its own; answers
    /// at once.
    fn background(mut self, seq: Sequence) -> Response {
        let response = self.head.object("in_progress", Vec::new(), Value::Null);
        let (state, id) = (Arc::clone(&self.state), self.head.id.clone());
        let entry = Stored { response: response.clone(), conversation: Vec::new(), task: None };
        if !state.responses.put(&id, entry) {
            return ApiError::internal("the response store refused the response").into_response();
        }
        let task = tokio::spawn(async move {
            let outcome = self.drive(seq, None).await;
            let (final_object, items) = match outcome {
                Ok(finished) => (finished.object(&self.head, self.input_tokens), finished.items),
                Err(Stop::Failed(e)) => (failed(&self.head, &e), Vec::new()),
                Err(Stop::Gone) => return,
            };
            let mut conversation = std::mem::take(&mut self.conversation);
            conversation.extend(items);
            // A response cancelled meanwhile stays cancelled.
            self.state.responses.update(&self.head.id, |stored| {
                if stored.status() == "in_progress" {
                    stored.task = None;
                    stored.response = final_object;
                    stored.conversation = conversation;
                }
            });
        });
        let handle = task.abort_handle();
        let kept = state.responses.update(&id, |stored| {
            if stored.status() == "in_progress" {
                stored.task = Some(handle.clone());
            }
        });
        if kept.is_none() {
            handle.abort();
        }
        Json(response).into_response()
    }
}

/// The response object of a failed generation.
fn failed(head: &Head, e: &ApiError) -> Value {
    let mut r = head.object("failed", Vec::new(), Value::Null);
    r["error"] = json!({"code": "server_error", "message": e.message});
    r
}

/// One event as SSE, named by its type.
fn sse(data: &Value) -> Event {
    let kind = data["type"].as_str().unwrap_or("message");
    Event::default().event(kind).data(data.to_string())
}
