//! Checks on a request's head, before routing and before any of its body is read:
//! - a declared `Content-Length` over `--max-body-bytes` is a 413 at once, and the connection
//!   closes (the body is never read, so `Expect: 100-continue` gets the 413 instead of
//!   `100 Continue`: hyper sends `100 Continue` only when a handler starts reading);
//! - a `POST` must declare `Content-Type: application/json` (parameters such as `charset`
//!   allowed), else 415, unless `--allow-any-content-type`: the forms a web page may send
//!   across origins without a preflight (`text/plain`, form encodings, none) are refused.
//!
//! Bodies without a length (chunked) are bounded while read ([`crate::extract`]).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::state::ServerState;

/// Whether a `Content-Type` value is JSON (`application/json`, any parameters).
pub fn is_json(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"))
}

/// The declared body length; `None` when absent, `Some(u64::MAX)` when not a number (hyper
/// refuses those before us; this is the conservative reading).
fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .map(|v| v.to_str().ok().and_then(|s| s.trim().parse().ok()).unwrap_or(u64::MAX))
}

/// A response that also closes the connection (its request body was not read).
pub fn closing(error: ApiError) -> Response {
    let mut response = error.into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

pub async fn check_head(
    State(state): State<Arc<ServerState>>,
    request: Request,
    next: Next,
) -> Response {
    let config = &state.config;
    let max = config.max_body_bytes as u64;
    if let Some(len) = declared_length(request.headers())
        && len > max
    {
        return closing(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("The request body is too large: {len} bytes declared, at most {max} accepted."),
        ));
    }
    if request.method() == Method::POST && !config.allow_any_content_type {
        let content_type = request.headers().get(header::CONTENT_TYPE).map(HeaderValue::to_str);
        if !matches!(content_type, Some(Ok(ct)) if is_json(ct)) {
            return closing(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "The request body must be JSON sent with `Content-Type: application/json`.",
            ));
        }
    }
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use super::is_json;

    #[test]
    fn json_content_types() {
        assert!(is_json("application/json"));
        assert!(is_json("Application/JSON; charset=utf-8"));
        assert!(!is_json("text/plain"));
        assert!(!is_json("application/x-www-form-urlencoded"));
        assert!(!is_json("application/jsonx"));
        assert!(!is_json(""));
    }
}
