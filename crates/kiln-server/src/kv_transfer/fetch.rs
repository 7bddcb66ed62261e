//! The decode worker's side: one connection per request to the prefill worker its
//! `kv_transfer_params` name, the handshake, and the fetch of the blocks its own prefix cache
//! lacks.
//!
//! Invariants: the whole fetch ends within [`FETCH_DEADLINE`] and each read within
//! [`READ_TIMEOUT`]; blocks must arrive in order, each exactly one block's bytes, and their
//! count must match the fetch and the `Done`; the server must prove it knows the secret. Any
//! failure is an error for the caller, which then computes the prompt itself, so a prefill
//! worker that dies mid-transfer costs the decode worker time, never a wrong token. A fetch
//! that does not complete (it failed, or the request was aborted while it ran: the future is
//! dropped) sends the prefill worker a `Release` of the pin from a task of its own
//! ([`ReleaseGuard`]), best effort: the pin's timeout covers a prefill worker that is gone.

use std::sync::Arc;
use std::time::Duration;

use kiln_core::TokenId;
use kiln_engine::KvGeometry;
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::RemotePrefill;
use super::listener::kind_name;
use super::wire::{self, Fetch, Hello, Message, WireError};
use crate::auth::constant_time_eq;

pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
pub(crate) const READ_TIMEOUT: Duration = Duration::from_secs(30);
pub(crate) const FETCH_DEADLINE: Duration = Duration::from_secs(120);

/// What the decode side proves and expects.
pub(crate) struct Importer {
    pub secret: Vec<u8>,
    pub geometry: KvGeometry,
}

/// Releases a remote pin when dropped armed (see the module docs).
pub(crate) struct ReleaseGuard {
    armed: Option<(Arc<Importer>, RemotePrefill)>,
}

impl ReleaseGuard {
    pub(crate) fn new(importer: &Arc<Importer>, remote: &RemotePrefill) -> Self {
        Self { armed: Some((Arc::clone(importer), remote.clone())) }
    }

    /// The fetch completed: it released the pin itself.
    pub(crate) fn disarm(mut self) {
        self.armed = None;
    }
}

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        let Some((importer, remote)) = self.armed.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        runtime.spawn(async move {
            let released = timeout(FETCH_DEADLINE, release(&importer, &remote)).await;
            if !matches!(released, Ok(Ok(()))) {
                tracing::debug!(
                    "KV pin {} on {}:{} not released",
                    remote.pin,
                    remote.host,
                    remote.port
                );
            }
        });
    }
}

/// Connects to `remote`'s prefill worker and releases its pin.
async fn release(importer: &Importer, remote: &RemotePrefill) -> Result<(), WireError> {
    let mut stream = connect(remote).await?;
    handshake(&mut stream, importer, &remote.engine_id).await?;
    wire::write(&mut stream, &Message::Release { pin: remote.pin }).await?;
    Ok(())
}

async fn connect(remote: &RemotePrefill) -> Result<TcpStream, WireError> {
    let address = (remote.host.as_str(), remote.port);
    let stream = match timeout(CONNECT_TIMEOUT, TcpStream::connect(address)).await {
        Ok(connected) => connected?,
        Err(_) => return Err(timed_out("no connection to the prefill worker")),
    };
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

fn timed_out(what: &str) -> WireError {
    WireError::Io(std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_owned()))
}

async fn read(stream: &mut TcpStream, max: usize) -> Result<Message, WireError> {
    match timeout(READ_TIMEOUT, wire::read(stream, max)).await {
        Ok(Ok(Message::Refused(why))) => Err(WireError::Refused(why)),
        Ok(m) => m,
        Err(_) => Err(timed_out("the prefill worker stopped answering")),
    }
}

fn unexpected(m: &Message, wanted: &str) -> WireError {
    WireError::Malformed(format!("expected {wanted}, got {}", kind_name(m)))
}

/// Fetches prompt blocks `[first, remote.num_blocks)` of `remote`'s pin for `prompt` and
/// releases the pin (with `first == remote.num_blocks`: only releases it). Returns the blocks'
/// bytes in order.
pub(crate) async fn fetch(
    importer: &Importer,
    remote: &RemotePrefill,
    prompt: &[TokenId],
    first: usize,
) -> Result<Vec<u8>, WireError> {
    match timeout(FETCH_DEADLINE, fetch_within(importer, remote, prompt, first)).await {
        Ok(result) => result,
        Err(_) => Err(timed_out("the fetch took longer than its deadline")),
    }
}

async fn fetch_within(
    importer: &Importer,
    remote: &RemotePrefill,
    prompt: &[TokenId],
    first: usize,
) -> Result<Vec<u8>, WireError> {
    let mut stream = connect(remote).await?;
    handshake(&mut stream, importer, &remote.engine_id).await?;
    let bs = importer.geometry.block_size as usize;
    let covered = (remote.num_blocks * bs).min(prompt.len());
    let count = remote.num_blocks.saturating_sub(first);
    let fetch = Fetch {
        pin: remote.pin,
        first: first as u32,
        count: count as u32,
        release: true,
        tokens: prompt[..covered].iter().map(|t| t.0).collect(),
    };
    wire::write(&mut stream, &Message::Fetch(fetch)).await?;
    let block_bytes = importer.geometry.block_bytes as usize;
    let mut data = Vec::with_capacity(count * block_bytes);
    for expected in 0..count {
        let read =
            timeout(READ_TIMEOUT, wire::read_block_into(&mut stream, block_bytes, &mut data));
        match read.await {
            Err(_) => return Err(timed_out("the prefill worker stopped answering")),
            Ok(Err(e)) => return Err(e),
            Ok(Ok(Ok(index))) if index as usize == expected => {}
            Ok(Ok(Ok(index))) => {
                return Err(WireError::Malformed(format!(
                    "block {index} where block {expected} was due"
                )));
            }
            Ok(Ok(Err(Message::Refused(why)))) => return Err(WireError::Refused(why)),
            Ok(Ok(Err(other))) => return Err(unexpected(&other, "a block")),
        }
    }
    match read(&mut stream, wire::MAX_CONTROL_PAYLOAD).await? {
        Message::Done { blocks } if blocks as usize == count => Ok(data),
        other => Err(unexpected(&other, &format!("the end of {count} blocks"))),
    }
}

async fn handshake(
    stream: &mut TcpStream,
    importer: &Importer,
    engine_id: &str,
) -> Result<(), WireError> {
    let server_nonce = match read(stream, wire::MAX_CONTROL_PAYLOAD).await? {
        Message::Challenge { version, nonce } if version == wire::VERSION => nonce,
        Message::Challenge { version, .. } => {
            return Err(WireError::Refused(format!(
                "the prefill worker speaks protocol version {version}, this server {}",
                wire::VERSION
            )));
        }
        other => return Err(unexpected(&other, "a challenge")),
    };
    let nonce = wire::nonce()?;
    let hello = Hello {
        version: wire::VERSION,
        nonce,
        mac: wire::client_mac(&importer.secret, &server_nonce, &nonce),
        geometry: importer.geometry.clone(),
        engine_id: engine_id.to_owned(),
    };
    wire::write(stream, &Message::Hello(hello)).await?;
    match read(stream, wire::MAX_CONTROL_PAYLOAD).await? {
        Message::Welcome { mac } => {
            let expected = wire::server_mac(&importer.secret, &server_nonce, &nonce);
            if constant_time_eq(&expected, &mac) {
                Ok(())
            } else {
                Err(WireError::Refused(
                    "the prefill worker failed authentication: the secrets differ".into(),
                ))
            }
        }
        other => Err(unexpected(&other, "a welcome")),
    }
}
