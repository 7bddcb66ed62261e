//! vLLM's `POST /classify` (and `/v1/classify`) on a sequence classifier
//! (`*ForSequenceClassification`, served with `--runner pooling`): each input's probability
//! per label and the most probable label's name (the checkpoint's `id2label`).
//!
//! Inputs are read as `/v1/embeddings` reads them (a string, strings, token ids, lists of
//! them; `truncate_prompt_tokens`, `add_special_tokens`). The probabilities are the classifier
//! head's softmax over its labels (the sigmoid of the logit with one label), computed on the
//! last token's hidden state as transformers does. Ties go to the first label. A model that
//! is not a classifier answers vLLM's 400.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_engine::PoolingParams;
use serde::Deserialize;
use serde_json::{Value, json};

use super::embeddings::{EmbeddingRequest, PoolJob, input_ids, pool_all};
use super::resolve_model;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::state::ServerState;

/// The body of `/classify`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassifyRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    input: Value,
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    add_special_tokens: Option<bool>,
    #[serde(default)]
    priority: Option<i64>,
    /// OpenAI's end-user id: accepted for compatibility, with no effect.
    #[serde(default)]
    #[allow(dead_code)] // an identifier with no effect on the answer
    user: Option<String>,
}

pub async fn classify(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ClassifyRequest>,
) -> Response {
    handle(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

async fn handle(state: Arc<ServerState>, req: ClassifyRequest) -> Result<Response, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    if loaded.labels.is_empty() {
        let served = if loaded.pooling.is_some() { "an embedding model" } else { "for generation" };
        return Err(ApiError::bad_request(format!(
            "The model does not support Classification API: it is served {served} (serve a \
             sequence classifier, `*ForSequenceClassification`, with --runner pooling)"
        )));
    }
    let adapter = resolve_model(&state, req.model.as_deref()).await?;
    let priority = req.priority.unwrap_or(0);
    let mut inputs = EmbeddingRequest::of_inputs(
        req.model,
        req.input,
        req.truncate_prompt_tokens,
        req.add_special_tokens,
    );
    let inputs = input_ids(&loaded, &mut inputs).await?;
    let job = PoolJob {
        adapter: adapter.binding,
        params: PoolingParams::default(),
        priority,
        param: "input",
    };
    let probs = pool_all(&state, &loaded, &job, &inputs).await?;
    let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
    let data: Vec<Value> = probs
        .iter()
        .enumerate()
        .map(|(index, p)| {
            json!({
                "index": index,
                "label": loaded.labels.get(best(p)).map_or("", String::as_str),
                "probs": p,
                "num_classes": p.len(),
            })
        })
        .collect();
    let model = crate::routes::reported_name(&state, adapter.binding.slot);
    drop(adapter);
    Ok(Json(json!({
        "id": state.response_id("classify"),
        "object": "list",
        "created": crate::routes::unix_now(),
        "model": model,
        "data": data,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                  "completion_tokens": 0, "prompt_tokens_details": null},
    }))
    .into_response())
}

/// The index of the largest probability (the first of equals).
fn best(probs: &[f32]) -> usize {
    probs.iter().enumerate().fold(0, |best, (i, p)| if *p > probs[best] { i } else { best })
}

#[cfg(test)]
mod tests {
    use super::best;

    #[test]
    fn the_first_of_equal_probabilities_wins() {
        assert_eq!(best(&[0.2, 0.5, 0.3]), 1);
        assert_eq!(best(&[0.4, 0.4, 0.2]), 0);
        assert_eq!(best(&[1.0]), 0);
    }
}
