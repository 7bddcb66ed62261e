//! `http_requests_total{handler,method,status}`: HTTP requests by route, method and status
//! class (`2xx`, `4xx`, ...), the counter vLLM's HTTP instrumentation exposes (unprefixed).
//! Requests that match no route count under `handler="none"`. Lives on the server state, so
//! requests answered while the model loads are counted too.
//!
//! Every label takes its value from a fixed set, whatever clients send: `handler` is a route
//! pattern (or `none`), `method` one of HTTP's standard methods (or `other`), `status` a class;
//! so the number of series is bounded by routes × 10 × 5.

use std::sync::Arc;

use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus_client::encoding::text::encode_registry;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

use crate::state::ServerState;

type HttpLabels = [(&'static str, String); 3];

#[derive(Debug)]
pub struct HttpMetrics {
    registry: Registry,
    requests: Family<HttpLabels, Counter>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        let requests = Family::<HttpLabels, Counter>::default();
        let mut registry = Registry::default();
        registry.register(
            "http_requests",
            "Total number of requests by method, status and handler.",
            requests.clone(),
        );
        Self { registry, requests }
    }
}

impl HttpMetrics {
    /// Counts one answered request.
    pub fn record(&self, handler: &str, method: &str, status: u16) {
        let labels = [
            ("handler", handler.to_owned()),
            ("method", method.to_owned()),
            ("status", format!("{}xx", status / 100)),
        ];
        self.requests.get_or_create(&labels).inc();
    }

    /// The counter as OpenMetrics text, without `# EOF`.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = encode_registry(&mut out, &self.registry);
        out
    }
}

/// `method` as a label: a standard method's name, else `other` (clients choose the method's
/// text, and each distinct label value would be a series of its own).
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    static STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    STANDARD.iter().find(|&m| m == method).map_or("other", Method::as_str)
}

/// Middleware: counts every request once its response is ready.
pub async fn count(
    State(state): State<Arc<ServerState>>,
    request: Request,
    next: Next,
) -> Response {
    let handler =
        request.extensions().get::<MatchedPath>().map_or("none", MatchedPath::as_str).to_owned();
    let method = method_label(request.method()).to_owned();
    let response = next.run(request).await;
    state.http_metrics.record(&handler, &method, response.status().as_u16());
    response
}

#[cfg(test)]
mod tests {
    use super::HttpMetrics;

    #[test]
    fn counts_by_handler_method_and_status_class() {
        let m = HttpMetrics::default();
        m.record("/v1/completions", "POST", 200);
        m.record("/v1/completions", "POST", 201);
        m.record("/v1/completions", "POST", 429);
        let text = m.render();
        assert!(text.contains("# TYPE http_requests counter"), "{text}");
        assert!(
            text.contains(
                r#"http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 2"#
            ),
            "{text}"
        );
        assert!(text.contains(r#"status="4xx"} 1"#), "{text}");
    }

    #[test]
    fn methods_outside_the_standard_set_share_one_label() {
        use axum::http::Method;
        assert_eq!(super::method_label(&Method::POST), "POST");
        for name in ["BREW", "X-1", "get"] {
            let method = Method::from_bytes(name.as_bytes()).unwrap();
            assert_eq!(super::method_label(&method), "other", "{name}");
        }
    }
}
