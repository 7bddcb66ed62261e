//! [`ApiJson`]: a JSON body extractor whose every refusal is an OpenAI-shaped error: 413 past
//! `--max-body-bytes` (a declared length is refused earlier, by `request_limits`), 408 when the
//! whole body has not arrived within `--body-read-timeout` (a body trickled byte by byte, or
//! shorter than its `Content-Length`), 400 for malformed JSON, nesting beyond serde_json's
//! recursion limit (128) or a field of the wrong type (the message names it). The 408 and 413
//! close the connection (the rest of the body is never read). The content type is checked
//! before routing (`request_limits`).

use std::sync::Arc;

use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use serde::de::DeserializeOwned;

use crate::error::ApiError;
use crate::request_limits::closing;
use crate::state::ServerState;

pub struct ApiJson<T>(pub T);

/// Why a body could not be read.
pub enum BodyError {
    TooLarge(usize),
    Timeout(std::time::Duration),
    Read(String),
}

impl From<BodyError> for axum::response::Response {
    fn from(e: BodyError) -> Self {
        match e {
            BodyError::TooLarge(max) => closing(ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("The request body is too large: at most {max} bytes accepted."),
            )),
            BodyError::Timeout(t) => closing(ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("The request body did not arrive within {} s.", t.as_secs_f64()),
            )),
            BodyError::Read(m) => {
                closing(ApiError::bad_request(format!("Could not read the request body: {m}")))
            }
        }
    }
}

/// The whole body of `req`, at most `max` bytes, within `timeout`.
pub async fn read_body(
    req: Request,
    max: usize,
    timeout: std::time::Duration,
) -> Result<axum::body::Bytes, BodyError> {
    let body = Limited::new(req.into_body(), max);
    match tokio::time::timeout(timeout, body.collect()).await {
        Err(_) => Err(BodyError::Timeout(timeout)),
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) if e.downcast_ref::<LengthLimitError>().is_some() => {
            Err(BodyError::TooLarge(max))
        }
        Ok(Err(e)) => Err(BodyError::Read(e.to_string())),
    }
}

impl<T: DeserializeOwned> FromRequest<Arc<ServerState>> for ApiJson<T> {
    type Rejection = axum::response::Response;

    async fn from_request(req: Request, state: &Arc<ServerState>) -> Result<Self, Self::Rejection> {
        let config = &state.config;
        let bytes =
            read_body(req, config.max_body_bytes, config.connections.body_read_timeout).await?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            axum::response::IntoResponse::into_response(ApiError::bad_request(format!(
                "Invalid JSON body: {e}"
            )))
        })
    }
}
