//! [`ApiJson`]: a JSON body extractor whose every refusal is an OpenAI-shaped error: 413 past
//! the body limit, 400 for malformed JSON, nesting beyond serde_json's recursion limit (128) or
//! a field of the wrong type (the message names it). The content type is not checked, as many
//! clients forget it.

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::ApiError;

pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            let status = rejection.status();
            if status == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(status, "The request body is too large.")
            } else {
                ApiError::bad_request(format!("Could not read the request body: {rejection}"))
            }
        })?;
        serde_json::from_slice(&bytes)
            .map(ApiJson)
            .map_err(|e| ApiError::bad_request(format!("Invalid JSON body: {e}")))
    }
}
