//! The accept loop and one task per connection (HTTP/1.1 on hyper), with the limits a server
//! facing hostile clients needs:
//! - at most `max_connections` connections are served normally; the next
//!   `reserved_connections` are served too, but answer only `/health` and `/metrics` (any other
//!   path: 503, and no keep-alive), so probes keep working while the cap is reached; beyond
//!   that, connections are accepted and closed at once (never left in the backlog holding file
//!   descriptors). Reaching the cap is logged, then at most every [`LOG_EVERY`];
//! - a connection is closed when a request head takes longer than `header_read_timeout`
//!   (counted from the connection's start, or from the first byte of a later request), or
//!   when it stays idle between requests longer than `idle_timeout`; the body's own deadline
//!   is enforced where it is read ([`crate::extract`]). While a request is active (from its
//!   head until its response body is finished or dropped) no timer runs, so long generations
//!   and streams are never cut;
//! - shutdown: stop accepting, close idle connections and let each finish its current
//!   response (`graceful_shutdown`); after `shutdown_timeout`, running responses are ended
//!   ([`ServerState::abort_responses`]: streams get a last `finish_reason: "abort"` chunk and
//!   `[DONE]`) and get [`ABORT_GRACE`] to be written out.
//!
//! Invariants: `open` counts the connection tasks alive (a guard decrements it whatever way a
//! task ends); a connection's [`Activity`] is `Active` exactly while one of its requests holds
//! an [`ActiveGuard`].

use std::convert::Infallible;
use std::pin::{Pin, pin};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use crate::config::ConnectionLimits;
use crate::error::ApiError;
use crate::state::ServerState;

/// Interval between log lines while connections are refused.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// Time running responses get to end properly after the shutdown deadline.
pub const ABORT_GRACE: Duration = Duration::from_secs(2);

/// Where a connection is between requests.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// Waiting for a request head that has started (or for the first one) since then.
    Head(Instant),
    /// This many requests are being answered.
    Active(usize),
    /// Idle since then (no byte of a next request yet).
    Idle(Instant),
}

/// The phase of one connection, shared by its stream, its service and its watchdog.
struct Activity(Mutex<Phase>);

impl Activity {
    fn phase(&self) -> std::sync::MutexGuard<'_, Phase> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn on_bytes_read(&self) {
        let mut phase = self.phase();
        if let Phase::Idle(_) = *phase {
            *phase = Phase::Head(Instant::now());
        }
    }

    fn begin(self: &Arc<Self>) -> ActiveGuard {
        let mut phase = self.phase();
        *phase = match *phase {
            Phase::Active(n) => Phase::Active(n + 1),
            _ => Phase::Active(1),
        };
        ActiveGuard(Arc::clone(self))
    }

    /// When the connection must close, or `None` while a request is active.
    fn deadline(&self, limits: &ConnectionLimits) -> Option<Instant> {
        match *self.phase() {
            Phase::Head(since) => Some(since + limits.header_read_timeout),
            Phase::Idle(since) => Some(since + limits.idle_timeout),
            Phase::Active(_) => None,
        }
    }
}

/// Held by a request from its head until its response body is done.
struct ActiveGuard(Arc<Activity>);

impl Drop for ActiveGuard {
    fn drop(&mut self) {
        let mut phase = self.0.phase();
        *phase = match *phase {
            Phase::Active(n) if n > 1 => Phase::Active(n - 1),
            _ => Phase::Idle(Instant::now()),
        };
    }
}

/// A TCP stream that reports reads to its connection's [`Activity`].
struct TrackedStream {
    inner: TcpStream,
    activity: Arc<Activity>,
}

impl AsyncRead for TrackedStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let result = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.on_bytes_read();
        }
        result
    }
}

impl AsyncWrite for TrackedStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, data)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// Resolves when the connection's header or idle deadline passes.
async fn watchdog(activity: Arc<Activity>, limits: ConnectionLimits) {
    let recheck =
        limits.header_read_timeout.min(limits.idle_timeout).max(Duration::from_millis(100)) / 2;
    loop {
        match activity.deadline(&limits) {
            Some(deadline) if Instant::now() >= deadline => return,
            Some(deadline) => tokio::time::sleep_until(deadline.into()).await,
            None => tokio::time::sleep(recheck).await,
        }
    }
}

/// The answer of a reserve connection to anything but `/health` and `/metrics`.
fn busy() -> Response {
    let mut e = ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "Too many connections: this one may only ask /health and /metrics.",
    );
    e.retry_after = Some(1);
    let mut response = e.into_response();
    response.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
    response
}

/// Serves one connection until it ends, times out, or finishes after `stop`.
async fn serve_connection(
    stream: TcpStream,
    app: Router,
    limits: ConnectionLimits,
    reserve: bool,
    mut stop: watch::Receiver<bool>,
) {
    let activity = Arc::new(Activity(Mutex::new(Phase::Head(Instant::now()))));
    let io = TokioIo::new(TrackedStream { inner: stream, activity: Arc::clone(&activity) });
    let svc = TowerToHyperService::new(app);
    let act = Arc::clone(&activity);
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        let guard = act.begin();
        let refuse = reserve && !matches!(req.uri().path(), "/health" | "/metrics");
        let call = (!refuse).then(|| hyper::service::Service::call(&svc, req));
        async move {
            let Some(call) = call else { return Ok::<_, Infallible>(busy()) };
            let response = call.await?;
            Ok(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _held = &guard;
                    frame
                }))
            }))
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.keep_alive(!reserve).header_read_timeout(None);
    let mut conn = pin!(builder.serve_connection(io, service));
    let mut watchdog = pin!(watchdog(activity, limits));
    let mut stopping = false;
    loop {
        tokio::select! {
            result = conn.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!("connection ended: {e}");
                }
                return;
            }
            () = &mut watchdog => {
                tracing::debug!("closing a connection: request head or idle timeout");
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                conn.as_mut().graceful_shutdown();
            }
        }
    }
}

/// Decrements the open-connection count when a connection task ends.
struct OpenGuard {
    open: Arc<AtomicUsize>,
    closed: Arc<Notify>,
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        self.open.fetch_sub(1, Ordering::SeqCst);
        self.closed.notify_one();
    }
}

/// Rate-limited log of the connection cap.
#[derive(Default)]
struct CapLog {
    last: Option<Instant>,
    num_refused: u64,
    num_reserve: u64,
}

impl CapLog {
    fn note(&mut self, open: usize, limits: &ConnectionLimits, refused: bool) {
        if refused {
            self.num_refused += 1;
        } else {
            self.num_reserve += 1;
        }
        if self.last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
            return;
        }
        self.last = Some(Instant::now());
        tracing::warn!(
            open,
            refused = self.num_refused,
            reserve = self.num_reserve,
            "connection limit reached (--max-connections {}): {} reserve connections answer \
             only /health and /metrics, further connections are closed at once",
            limits.max_connections,
            limits.reserved_connections,
        );
        self.num_refused = 0;
        self.num_reserve = 0;
    }
}

/// Serves `app` on `listener` until `shutdown` resolves, then drains (see the module docs).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = state.config.connections.clone();
    let open = Arc::new(AtomicUsize::new(0));
    let closed = Arc::new(Notify::new());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut cap_log = CapLog::default();
    loop {
        let stream = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    // Out of file descriptors, mostly: wait for some to close.
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let num_open = open.load(Ordering::SeqCst);
        let reserve = num_open >= limits.max_connections;
        if reserve {
            let refused = num_open >= limits.max_connections + limits.reserved_connections;
            cap_log.note(num_open, &limits, refused);
            if refused {
                drop(stream);
                continue;
            }
        }
        // Streamed chunks are small writes: without TCP_NODELAY, Nagle's algorithm holds each
        // one until the client's delayed ACK (up to 40 ms), which would distort every ITL.
        let _ = stream.set_nodelay(true);
        open.fetch_add(1, Ordering::SeqCst);
        let guard = OpenGuard { open: Arc::clone(&open), closed: Arc::clone(&closed) };
        let task = serve_connection(stream, app.clone(), limits.clone(), reserve, stop_rx.clone());
        tokio::spawn(async move {
            let _guard = guard;
            task.await;
        });
    }
    drop(listener);
    state.start_draining();
    stop_tx.send_replace(true);
    tracing::info!(
        in_flight = state.num_in_flight(),
        "draining for up to {:?}",
        state.config.shutdown_timeout
    );
    let all_closed = || async {
        while open.load(Ordering::SeqCst) > 0 {
            closed.notified().await;
        }
    };
    if tokio::time::timeout(state.config.shutdown_timeout, all_closed()).await.is_ok() {
        return Ok(());
    }
    tracing::warn!(in_flight = state.num_in_flight(), "shutdown timeout: aborting what is left");
    state.abort_responses();
    let _ = tokio::time::timeout(ABORT_GRACE, all_closed()).await;
    Ok(())
}
