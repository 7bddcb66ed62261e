//! vLLM's scoring endpoints on a pooling model: `POST /score` (and `/v1/score`) scores text
//! pairs, `POST /rerank` (and `/v1/rerank`, `/v2/rerank`, Jina's and Cohere's shape) orders
//! documents by their score against a query.
//!
//! A cross-encoder (`*ForSequenceClassification` with one label) scores each pair as one input,
//! the two texts encoded as a pair by the tokenizer (transformers' `tokenizer(a, b)`), its
//! classifier's logit through a sigmoid, as sentence-transformers' `CrossEncoder` and vLLM give
//! it. An embedding model scores a pair by the cosine of the two texts' embeddings (vLLM's
//! rule). Each pair or text is one engine request, batched by the scheduler like any prompt. A
//! generative model answers vLLM's 400. Pairs longer than the context are refused unless
//! `truncate_prompt_tokens` cuts them (-1: to the context): a pair as transformers'
//! `longest_first` truncation cuts one (the longer text loses its last tokens, the special
//! tokens stay), each text of an embedding model as `/v1/embeddings` cuts an input.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_core::TokenId;
use kiln_engine::PoolingParams;
use serde::Deserialize;
use serde_json::{Value, json};

use super::embeddings::{MAX_INPUTS, PoolJob, pool_all, truncation};
use super::{resolve_model, tokenize, tokenize_admitted};
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::state::{Loaded, ServerState};

/// `POST /score`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScoreRequest {
    #[serde(default)]
    model: Option<String>,
    /// A string or a list of strings (one, or as many as `text_2`).
    #[serde(default)]
    text_1: Value,
    #[serde(default)]
    text_2: Value,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
}

/// `POST /rerank`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RerankRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    query: Option<String>,
    #[serde(default)]
    documents: Value,
    /// Keep the best `top_n` (0 or absent: all).
    #[serde(default)]
    top_n: Option<i64>,
    /// Include each document's text (default true, as vLLM always does).
    #[serde(default)]
    return_documents: Option<bool>,
    #[serde(default)]
    priority: Option<i64>,
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
}

pub async fn score(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<ScoreRequest>,
) -> Response {
    handle_score(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

pub async fn rerank(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<RerankRequest>,
) -> Response {
    handle_rerank(state, req).await.unwrap_or_else(IntoResponse::into_response)
}

/// A string or a non-empty list of strings (at most [`MAX_INPUTS`]) of `param`.
fn texts(value: &Value, param: &str) -> Result<Vec<String>, ApiError> {
    let bad = |m: String| ApiError::bad_param(param, m);
    match value {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) if items.is_empty() => Err(bad(format!("`{param}` is empty"))),
        Value::Array(items) if items.len() > MAX_INPUTS => {
            Err(bad(format!("`{param}` has {} items; at most {MAX_INPUTS}", items.len())))
        }
        Value::Array(items) => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad(format!("`{param}` must be a string or a list of strings"))),
        Value::Null => Err(bad(format!("`{param}` is required"))),
        _ => Err(bad(format!("`{param}` must be a string or a list of strings"))),
    }
}

/// The pooling model that scores, or vLLM's 400 on a generative one.
fn scoring_model(state: &ServerState, api: &str) -> Result<Arc<Loaded>, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    if loaded.pooling.is_none() {
        return Err(ApiError::bad_request(format!(
            "The model does not support {api}: it is served for generation (serve a \
             cross-encoder or an embedding model with --runner pooling)"
        )));
    }
    if loaded.labels.len() > 1 {
        return Err(ApiError::bad_request(format!(
            "The model does not support {api}: it classifies into {} labels, where a score \
             needs a one-label cross-encoder (use /classify)",
            loaded.labels.len()
        )));
    }
    Ok(loaded)
}

/// The score of each pair `(firsts[i], seconds[i])`, in order (module docs).
async fn score_pairs(
    state: &Arc<ServerState>,
    loaded: &Arc<Loaded>,
    (model, priority, truncate): (Option<&str>, i64, Option<i64>),
    pairs: &[(&str, &str)],
) -> Result<(Vec<f32>, usize), ApiError> {
    let adapter = resolve_model(state, model).await?;
    let job = |param| PoolJob {
        adapter: adapter.binding,
        params: PoolingParams::default(),
        priority,
        param,
    };
    let max_len = loaded.limits.max_model_len;
    let keep = truncation(truncate, max_len)?;
    let too_long = |param: &str, n: usize| {
        ApiError::bad_param(
            param,
            format!(
                "This model's maximum context length is {max_len} tokens. However, you \
                 requested {n} tokens in the input for scoring. Please reduce the length of \
                 the input."
            ),
        )
    };
    if loaded.cross_encoder {
        let ids = encode_pairs(loaded, pairs, keep).await?;
        if let Some(long) = ids.iter().find(|p| p.len() > max_len) {
            return Err(too_long("text_2", long.len()));
        }
        let tokens = ids.iter().map(Vec::len).sum();
        let scores = pool_all(state, loaded, &job("text_2"), &ids).await?;
        return Ok((
            scores.into_iter().map(|s| s.first().copied().unwrap_or(0.0)).collect(),
            tokens,
        ));
    }
    // An embedding model: each distinct first text and every second text embedded once.
    let mut firsts: Vec<&str> = pairs.iter().map(|p| p.0).collect();
    firsts.dedup();
    let texts: Vec<String> =
        firsts.iter().chain(pairs.iter().map(|p| &p.1)).map(|t| (*t).to_owned()).collect();
    let ids = match keep {
        None => tokenize(loaded, texts, true).await?,
        Some(k) => {
            let (bytes, encoder) = (texts.iter().map(String::len).sum(), loaded.encoder);
            let mut ids = tokenize_admitted(loaded, texts, bytes, "text_2", move |t, text| {
                if encoder { t.encode_truncated(text, true, k) } else { t.encode(text, true) }
            })
            .await?;
            if !encoder {
                // A decoder keeps an input's last tokens, as /v1/embeddings does.
                for tokens in &mut ids {
                    tokens.drain(..tokens.len().saturating_sub(k));
                }
            }
            ids
        }
    };
    if let Some(long) = ids.iter().find(|p| p.len() > max_len) {
        return Err(too_long("text_2", long.len()));
    }
    if let Some(i) = ids.iter().position(Vec::is_empty) {
        return Err(ApiError::bad_param("text_2", format!("text {i} is empty (no tokens)")));
    }
    let tokens = ids.iter().map(Vec::len).sum();
    let vectors = pool_all(state, loaded, &job("text_2"), &ids).await?;
    let (first_vectors, second_vectors) = vectors.split_at(firsts.len());
    let scores = pairs
        .iter()
        .zip(second_vectors)
        .map(|((first, _), second)| {
            let at = firsts.iter().position(|f| f == first).unwrap_or(0);
            cosine(&first_vectors[at], second)
        })
        .collect();
    Ok((scores, tokens))
}

/// Each pair's token ids, as the tokenizer encodes a pair (special tokens added), cut to
/// `keep` tokens when given (module docs).
async fn encode_pairs(
    loaded: &Arc<Loaded>,
    pairs: &[(&str, &str)],
    keep: Option<usize>,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    if keep.is_none() {
        // Without truncation, text too long in bytes for the context is refused untokenized.
        for (a, b) in pairs {
            loaded.tokenize_gate.check_fits(a.len() + b.len(), loaded.limits.max_model_len)?;
        }
    }
    let bytes = pairs.iter().map(|(a, b)| a.len() + b.len()).sum();
    let owned: Vec<(String, String)> =
        pairs.iter().map(|(a, b)| ((*a).to_owned(), (*b).to_owned())).collect();
    tokenize_admitted(
        loaded,
        owned,
        bytes,
        "text_2",
        move |t, (a, b): &(String, String)| match keep {
            Some(k) => t.encode_pair_truncated(a, b, true, k),
            None => t.encode_pair(a, b, true),
        },
    )
    .await
}

/// Cosine similarity, summed in element order.
fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na: f32 = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb: f32 = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    dot / (na * nb).max(1e-12)
}

async fn handle_score(state: Arc<ServerState>, req: ScoreRequest) -> Result<Response, ApiError> {
    let loaded = scoring_model(&state, "Score API")?;
    let (firsts, seconds) = (texts(&req.text_1, "text_1")?, texts(&req.text_2, "text_2")?);
    let pairs: Vec<(&str, &str)> = match (firsts.len(), seconds.len()) {
        (1, _) => seconds.iter().map(|s| (firsts[0].as_str(), s.as_str())).collect(),
        (n, m) if n == m => {
            firsts.iter().zip(&seconds).map(|(a, b)| (a.as_str(), b.as_str())).collect()
        }
        (n, m) => {
            return Err(ApiError::bad_param(
                "text_1",
                format!("`text_1` has {n} texts and `text_2` {m}: give one, or as many"),
            ));
        }
    };
    let model_and_priority =
        (req.model.as_deref(), req.priority.unwrap_or(0), req.truncate_prompt_tokens);
    let (scores, tokens) = score_pairs(&state, &loaded, model_and_priority, &pairs).await?;
    let data: Vec<Value> = scores
        .iter()
        .enumerate()
        .map(|(index, score)| json!({"index": index, "object": "score", "score": score}))
        .collect();
    Ok(Json(json!({
        "id": state.response_id("score"),
        "object": "list",
        "created": crate::routes::unix_now(),
        "model": reported_name(&state, req.model.as_deref()),
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
    .into_response())
}

async fn handle_rerank(state: Arc<ServerState>, req: RerankRequest) -> Result<Response, ApiError> {
    let loaded = scoring_model(&state, "Rerank API")?;
    let query = req
        .query
        .as_deref()
        .ok_or_else(|| ApiError::bad_param("query", "`query` is required (a string)"))?;
    let documents = texts(&req.documents, "documents")?;
    let top_n = match req.top_n {
        None | Some(0) => documents.len(),
        Some(n) if n > 0 => usize::try_from(n).unwrap_or(usize::MAX).min(documents.len()),
        Some(n) => {
            return Err(ApiError::bad_param(
                "top_n",
                format!("`top_n` must be at least 0, got {n}"),
            ));
        }
    };
    let pairs: Vec<(&str, &str)> = documents.iter().map(|d| (query, d.as_str())).collect();
    let model_and_priority =
        (req.model.as_deref(), req.priority.unwrap_or(0), req.truncate_prompt_tokens);
    let (scores, tokens) = score_pairs(&state, &loaded, model_and_priority, &pairs).await?;
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // Best first; equal scores keep the documents' order.
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    let with_text = req.return_documents.unwrap_or(true);
    let results: Vec<Value> = order
        .into_iter()
        .take(top_n)
        .map(|i| {
            let mut r = json!({"index": i, "relevance_score": scores[i]});
            if with_text {
                r["document"] = json!({"text": documents[i]});
            }
            r
        })
        .collect();
    Ok(Json(json!({
        "id": state.response_id("rerank"),
        "model": reported_name(&state, req.model.as_deref()),
        "usage": {"total_tokens": tokens},
        "results": results,
    }))
    .into_response())
}

/// The name answered: the request's `model` when it names one served, else the first name.
fn reported_name(state: &ServerState, model: Option<&str>) -> String {
    model.map_or_else(|| crate::routes::model_name(state).to_owned(), str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_and_cosine() {
        assert_eq!(texts(&json!("a"), "t").unwrap(), ["a"]);
        assert_eq!(texts(&json!(["a", "b"]), "t").unwrap(), ["a", "b"]);
        for bad in [json!([]), json!(null), json!([1]), json!(3)] {
            assert!(texts(&bad, "t").is_err(), "{bad}");
        }
        assert!((cosine(&[1.0, 0.0], &[1.0, 1.0]) - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert_eq!(cosine(&[0.0], &[0.0]), 0.0);
    }
}
