//! The prefill worker's side: a TCP listener on a thread of its own that serves decode
//! workers' fetches of pinned KV.
//!
//! Invariants:
//! - at most [`MAX_CONNECTIONS`] peers are served at once; one beyond is closed at once;
//! - a peer has [`HANDSHAKE_TIMEOUT`] to answer the challenge and must prove it knows the
//!   secret, speak this version, have this server's KV geometry and name this engine; any
//!   failure is answered with `Refused` naming it, then the connection is closed;
//! - a connection idle for [`IDLE_TIMEOUT`] between fetches, or whose writes stall as long,
//!   is closed; a frame beyond the limits of its kind is never read into memory;
//! - blocks are read out of the engine [`EXPORT_CHUNK`] at a time, so other requests' steps run
//!   between chunks; the pin is released with the last chunk when the fetch asks, and it expires
//!   on the engine otherwise (a peer that vanishes mid-fetch leaks nothing);
//! - nothing a peer does is logged above debug level, so a hostile peer cannot flood the log.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kiln_core::TokenId;
use kiln_engine::{KvGeometry, KvPort};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

use super::wire::{self, Fetch, Message, WireError};
use crate::auth::constant_time_eq;
use crate::metrics::Metrics;
use crate::metrics::kv_transfer::SENT;

pub(crate) const MAX_CONNECTIONS: usize = 64;
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Blocks read out of the engine per command.
const EXPORT_CHUNK: usize = 16;

/// What a connection checks and serves.
pub(crate) struct Exporter {
    pub secret: Vec<u8>,
    pub geometry: KvGeometry,
    pub engine_id: String,
    pub port: KvPort,
    pub metrics: Arc<Metrics>,
}

/// Binds `address` and serves it on a thread of its own; returns the bound address.
pub(crate) fn start(address: SocketAddr, exporter: Exporter) -> Result<SocketAddr, String> {
    let listener = std::net::TcpListener::bind(address)
        .map_err(|e| format!("KV transfer: binding {address}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    listener.set_nonblocking(true).map_err(|e| e.to_string())?;
    std::thread::Builder::new()
        .name("kiln-kv-transfer".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!("KV transfer: no runtime: {e}");
                    return;
                }
            };
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(listener) => accept_loop(listener, Arc::new(exporter)).await,
                    Err(e) => tracing::error!("KV transfer: {e}"),
                }
            });
        })
        .map_err(|e| format!("could not start the KV transfer thread: {e}"))?;
    Ok(bound)
}

async fn accept_loop(listener: TcpListener, exporter: Arc<Exporter>) {
    let permits = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                tracing::warn!("KV transfer: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
            tracing::debug!("KV transfer: {peer} refused, {MAX_CONNECTIONS} connections open");
            continue;
        };
        let exporter = Arc::clone(&exporter);
        tokio::spawn(async move {
            let _permit = permit;
            let _ = stream.set_nodelay(true);
            if let Err(e) = serve(stream, &exporter).await {
                exporter.metrics.kv_transfer.on_failure(&SENT);
                tracing::debug!("KV transfer: {peer}: {e}");
            }
        });
    }
}

/// Writes within the idle timeout.
async fn send(out: &mut (impl AsyncWrite + Unpin), m: &Message) -> Result<(), WireError> {
    match timeout(IDLE_TIMEOUT, wire::write(out, m)).await {
        Ok(written) => Ok(written?),
        Err(_) => Err(WireError::Io(std::io::ErrorKind::TimedOut.into())),
    }
}

/// Refuses the peer with `why` and ends the connection with that error.
async fn refuse(out: &mut (impl AsyncWrite + Unpin), why: String) -> Result<(), WireError> {
    let _ = send(out, &Message::Refused(why.clone())).await;
    Err(WireError::Refused(why))
}

async fn serve(stream: TcpStream, exporter: &Exporter) -> Result<(), WireError> {
    let (mut input, mut out) = stream.into_split();
    handshake(&mut input, &mut out, exporter).await?;
    loop {
        let read = timeout(IDLE_TIMEOUT, wire::read(&mut input, wire::MAX_FETCH_PAYLOAD)).await;
        let message = match read {
            // Idle, or closed by the peer.
            Err(_) | Ok(Err(WireError::Closed)) => return Ok(()),
            Ok(m) => m?,
        };
        match message {
            Message::Fetch(fetch) => serve_fetch(&mut out, exporter, fetch).await?,
            Message::Release { pin } => exporter.port.release(pin),
            other => return refuse(&mut out, format!("unexpected {}", kind_name(&other))).await,
        }
    }
}

async fn handshake(
    input: &mut (impl AsyncRead + Unpin),
    out: &mut (impl AsyncWrite + Unpin),
    exporter: &Exporter,
) -> Result<(), WireError> {
    let server_nonce = wire::nonce()?;
    send(out, &Message::Challenge { version: wire::VERSION, nonce: server_nonce }).await?;
    let hello = match timeout(HANDSHAKE_TIMEOUT, wire::read(input, wire::MAX_CONTROL_PAYLOAD)).await
    {
        Err(_) => return refuse(out, format!("no hello within {HANDSHAKE_TIMEOUT:?}")).await,
        Ok(Ok(Message::Hello(hello))) => hello,
        Ok(Ok(other)) => {
            return refuse(out, format!("expected a hello, got {}", kind_name(&other))).await;
        }
        Ok(Err(e)) => return Err(e),
    };
    if hello.version != wire::VERSION {
        let why =
            format!("protocol version {}, this server speaks {}", hello.version, wire::VERSION);
        return refuse(out, why).await;
    }
    let expected = wire::client_mac(&exporter.secret, &server_nonce, &hello.nonce);
    if !constant_time_eq(&expected, &hello.mac) {
        return refuse(out, "authentication failed: the KV transfer secrets differ".into()).await;
    }
    if let Some(what) = exporter.geometry.mismatch(&hello.geometry) {
        return refuse(out, format!("incompatible KV cache: the decode worker has {what}")).await;
    }
    if hello.engine_id != exporter.engine_id {
        let why = format!(
            "engine id {:?}, this server is {:?} (it restarted since the prefill)",
            hello.engine_id, exporter.engine_id
        );
        return refuse(out, why).await;
    }
    let mac = wire::server_mac(&exporter.secret, &server_nonce, &hello.nonce);
    send(out, &Message::Welcome { mac }).await
}

/// Serves one fetch: its blocks in chunks, then `Done`; an engine refusal is sent as
/// `Refused` and the connection goes on.
async fn serve_fetch(
    out: &mut (impl AsyncWrite + Unpin),
    exporter: &Exporter,
    fetch: Fetch,
) -> Result<(), WireError> {
    let tokens: Arc<[TokenId]> = fetch.tokens.iter().map(|&t| TokenId(t)).collect();
    let (first, count) = (fetch.first as usize, fetch.count as usize);
    let block_bytes = exporter.geometry.block_bytes as usize;
    let mut from = first;
    loop {
        let n = (first + count - from).min(EXPORT_CHUNK);
        let last = from + n == first + count;
        let rx =
            exporter.port.export(fetch.pin, Arc::clone(&tokens), (from, n), fetch.release && last);
        let reply = tokio::task::spawn_blocking(move || rx.recv())
            .await
            .map_err(|e| WireError::Io(std::io::Error::other(e.to_string())))?;
        let data = match reply {
            Ok(Ok(data)) => data,
            Ok(Err(e)) => {
                send(out, &Message::Refused(e.to_string())).await?;
                return Ok(());
            }
            Err(_) => return refuse(out, "the engine stopped".into()).await,
        };
        for (i, block) in data.chunks_exact(block_bytes).enumerate() {
            let index = (from - first + i) as u32;
            match timeout(IDLE_TIMEOUT, wire::write_block(out, index, block)).await {
                Ok(written) => written?,
                Err(_) => return Err(WireError::Io(std::io::ErrorKind::TimedOut.into())),
            }
        }
        exporter.metrics.kv_transfer.on_moved(&SENT, n, data.len());
        from += n;
        if last {
            break;
        }
    }
    send(out, &Message::Done { blocks: fetch.count }).await
}

pub(crate) fn kind_name(m: &Message) -> &'static str {
    match m {
        Message::Challenge { .. } => "a challenge",
        Message::Hello(_) => "a hello",
        Message::Welcome { .. } => "a welcome",
        Message::Fetch(_) => "a fetch",
        Message::Block { .. } => "a block",
        Message::Done { .. } => "a done",
        Message::Release { .. } => "a release",
        Message::Refused(_) => "a refusal",
    }
}
