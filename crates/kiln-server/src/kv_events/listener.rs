//! The TCP side of kiln's ZMTP sockets: binding a `tcp://` endpoint, the accept loop with a cap
//! on concurrent connections, and one peer's [`Connection`]: the greeting and READY under a
//! deadline, then events decoded within [`zmtp::PEER_LIMITS`] and writes under a deadline.
//!
//! Invariants:
//! - at most [`ServeLimits::max_connections`] peers of one socket are served at once (each
//!   connection's task holds a permit until it ends); a connection beyond that is accepted and
//!   closed at once, so it never waits in the backlog holding a file descriptor;
//! - a peer has [`ServeLimits::handshake_timeout`] from its connection to complete the greeting
//!   and READY, and its `Socket-Type` must be one its socket serves ([`Role::peers`]);
//! - one message's write must end within [`ServeLimits::write_timeout`], so a peer that stops
//!   reading gives back its connection and what its queue holds;
//! - a connection's read buffer holds at most one frame within the limits and one
//!   [`READ_CHUNK`] (the decoder asks for more bytes only when no whole event is buffered);
//! - a peer that breaks the protocol or a limit is disconnected and logged at debug level only,
//!   so a hostile peer cannot flood the log; what concerns the operator (accept errors, the cap
//!   reached) is a warning at most every [`LOG_EVERY`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio::time::timeout;

use super::zmtp::{self, Event, PeerDecoder, Ready, ZmtpError};

/// The most bytes read from a peer at once.
const READ_CHUNK: usize = 4096;
/// Frames up to this size are copied next to their header when a message is written.
const INLINE_FRAME: usize = 4096;
/// Interval between warnings about accepting.
const LOG_EVERY: Duration = Duration::from_secs(10);
/// The pause after a failed accept (out of file descriptors, say), so the loop does not spin.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// Per-socket caps on its peers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ServeLimits {
    pub max_connections: usize,
    pub handshake_timeout: Duration,
    pub write_timeout: Duration,
}

/// The caps of kiln's KV event sockets.
pub(crate) const SERVE_LIMITS: ServeLimits = ServeLimits {
    max_connections: 256,
    handshake_timeout: Duration::from_secs(10),
    write_timeout: Duration::from_secs(30),
};

/// What a socket is in the handshake.
#[derive(Debug)]
pub(crate) struct Role {
    /// Its `Socket-Type` (`PUB`, `ROUTER`).
    pub socket_type: &'static str,
    /// The peer socket types it serves.
    pub peers: &'static [&'static str],
    /// Whether its READY carries an (empty) `Identity`, as libzmq's does for a ROUTER.
    pub with_identity: bool,
}

impl Role {
    /// Refuses a peer whose `Socket-Type` this socket does not serve.
    pub(crate) fn check(&self, ready: &Ready) -> Result<(), ZmtpError> {
        if self.peers.iter().any(|t| t.as_bytes() == ready.socket_type) {
            return Ok(());
        }
        let name = String::from_utf8_lossy(&ready.socket_type).into_owned();
        Err(ZmtpError::IncompatibleSocketType(name))
    }
}

/// Why a peer's connection ended.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Disconnect {
    #[error("{0}")]
    Protocol(#[from] ZmtpError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("closed by the peer")]
    Closed,
    #[error("no greeting and READY within {0:?}")]
    HandshakeTimeout(Duration),
    #[error("a message not written within {0:?}")]
    WriteTimeout(Duration),
}

/// Binds `tcp://HOST:PORT` (`*` for every IPv4 interface, an IP, `[v6]`, or a name that
/// resolves), warning when the address is not loopback; returns the listener and the bound
/// address as `tcp://IP:PORT` (a `:0` port resolved).
pub(crate) async fn bind(endpoint: &str) -> Result<(TcpListener, String), String> {
    let address = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{endpoint:?} is not a tcp:// address"))?;
    let address = match address.strip_prefix("*:") {
        Some(port) => format!("0.0.0.0:{port}"),
        None => address.to_owned(),
    };
    let listener = TcpListener::bind(&address).await.map_err(|e| e.to_string())?;
    let local = listener.local_addr().map_err(|e| e.to_string())?;
    if !local.ip().is_loopback() {
        tracing::warn!(
            "KV events: {endpoint} listens on {local}, not a loopback address; the KV event \
             sockets have no authentication, so firewall the port"
        );
    }
    Ok((listener, format!("tcp://{local}")))
}

/// Serves `listener`'s peers on tasks of their own: each completes the handshake as `role`,
/// then `serve` has its connection; how it ended is logged at debug level.
pub(crate) fn spawn_accept_loop<S, F>(
    listener: TcpListener,
    role: &'static Role,
    limits: ServeLimits,
    serve: S,
) where
    S: Fn(Connection, Ready) -> F + Send + Sync + 'static,
    F: Future<Output = Result<(), Disconnect>> + Send + 'static,
{
    let serve = Arc::new(serve);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    tokio::spawn(async move {
        let mut warned: Option<Instant> = None;
        let mut warn = |what: &dyn std::fmt::Display| {
            if warned.is_none_or(|t| t.elapsed() >= LOG_EVERY) {
                tracing::warn!("KV events {}: {what}", role.socket_type);
                warned = Some(Instant::now());
            }
        };
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    warn(&format_args!("accept failed: {e}"));
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            };
            let Ok(permit) = Arc::clone(&permits).try_acquire_owned() else {
                warn(&format_args!(
                    "{} connections already; closing new ones (from {peer})",
                    limits.max_connections
                ));
                continue;
            };
            let serve = Arc::clone(&serve);
            tokio::spawn(async move {
                let ended = match handshake(stream, peer, role, limits).await {
                    Ok((connection, ready)) => serve(connection, ready).await,
                    Err(e) => Err(e),
                };
                let reason = ended.map_or_else(|e| e.to_string(), |()| "socket closed".into());
                tracing::debug!(
                    "KV events {}: peer {peer} disconnected: {reason}",
                    role.socket_type
                );
                drop(permit);
            });
        }
    });
}

/// Greetings, then READYs, both ways, within the handshake deadline; then checks the peer's
/// socket type.
async fn handshake(
    stream: TcpStream,
    peer: SocketAddr,
    role: &Role,
    limits: ServeLimits,
) -> Result<(Connection, Ready), Disconnect> {
    // Small messages go out at once, as ZMQ does.
    let _ = stream.set_nodelay(true);
    let mut connection = Connection {
        stream,
        peer,
        buf: BytesMut::new(),
        chunk: vec![0; READ_CHUNK].into_boxed_slice(),
        decoder: PeerDecoder::new(zmtp::PEER_LIMITS),
        write_timeout: limits.write_timeout,
    };
    let steps = async {
        connection.stream.write_all(&zmtp::greeting()).await?;
        connection.next_event().await?;
        let ready = zmtp::ready_command(role.socket_type, role.with_identity);
        connection.stream.write_all(&ready).await?;
        match connection.next_event().await? {
            Event::Ready(ready) => Ok(ready),
            _ => Err(Disconnect::Protocol(ZmtpError::ExpectedReady("another event"))),
        }
    };
    let ready = timeout(limits.handshake_timeout, steps)
        .await
        .map_err(|_| Disconnect::HandshakeTimeout(limits.handshake_timeout))??;
    role.check(&ready)?;
    Ok((connection, ready))
}

/// One peer after the handshake.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: TcpStream,
    pub peer: SocketAddr,
    /// Bytes read and not decoded yet.
    buf: BytesMut,
    /// Where a read lands before it is appended to `buf`.
    chunk: Box<[u8]>,
    decoder: PeerDecoder,
    write_timeout: Duration,
}

impl Connection {
    /// The peer's next event. Cancel-safe: bytes are only taken from the socket by a read
    /// that completed, and kept in `buf` until decoded.
    pub(crate) async fn next_event(&mut self) -> Result<Event, Disconnect> {
        loop {
            if let Some(event) = self.decoder.next(&mut self.buf)? {
                return Ok(event);
            }
            let n = self.stream.read(&mut self.chunk).await?;
            if n == 0 {
                return Err(Disconnect::Closed);
            }
            self.buf.extend_from_slice(&self.chunk[..n]);
        }
    }

    /// Writes a multipart message from its frames: small ones gathered with the headers,
    /// a large body written from where it lies (shared, not copied); each write within the
    /// write deadline.
    pub(crate) async fn write_message(&mut self, frames: &[Bytes]) -> Result<(), Disconnect> {
        let mut pending = Vec::new();
        for (i, frame) in frames.iter().enumerate() {
            zmtp::encode_frame_header(
                &mut pending,
                zmtp::message_flags(i, frames.len()),
                frame.len(),
            );
            if frame.len() <= INLINE_FRAME {
                pending.extend_from_slice(frame);
            } else {
                self.write(&pending).await?;
                pending.clear();
                self.write(frame).await?;
            }
        }
        self.write(&pending).await
    }

    /// Writes bytes already encoded (whole frames), within the write deadline.
    pub(crate) async fn write(&mut self, bytes: &[u8]) -> Result<(), Disconnect> {
        match timeout(self.write_timeout, self.stream.write_all(bytes)).await {
            Ok(written) => Ok(written?),
            Err(_) => Err(Disconnect::WriteTimeout(self.write_timeout)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::time::Duration;

    use super::*;

    const ROLE: Role = Role { socket_type: "PUB", peers: &["SUB"], with_identity: false };

    /// A listener on a free loopback port whose peers are held until they disconnect.
    fn serving(limits: ServeLimits) -> (tokio::runtime::Runtime, SocketAddr) {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let addr = runtime.block_on(async {
            let (listener, endpoint) = bind("tcp://127.0.0.1:0").await.unwrap();
            spawn_accept_loop(listener, &ROLE, limits, |mut c: Connection, _| async move {
                while c.next_event().await.is_ok() {}
                Ok(())
            });
            endpoint.strip_prefix("tcp://").unwrap().parse().unwrap()
        });
        (runtime, addr)
    }

    /// Whether the server closes `s` within a second (EOF or reset after what it sent).
    fn closed_soon(s: &mut std::net::TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let mut buf = [0u8; 256];
        loop {
            match s.read(&mut buf) {
                Ok(0) => return true,
                Ok(_) => {}
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }

    #[test]
    fn endpoints_bind_wildcards_ips_and_port_zero() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (_l, e) = bind("tcp://127.0.0.1:0").await.unwrap();
            assert!(e.starts_with("tcp://127.0.0.1:") && !e.ends_with(":0"), "{e}");
            let (_l, e) = bind("tcp://*:0").await.unwrap();
            assert!(e.starts_with("tcp://0.0.0.0:"), "{e}");
            let (_l, e) = bind("tcp://0.0.0.0:0").await.unwrap();
            assert!(e.starts_with("tcp://0.0.0.0:"), "{e}");
            // IPv6 loopback, where the machine has it.
            if let Ok((_l, e)) = bind("tcp://[::1]:0").await {
                assert!(e.starts_with("tcp://[::1]:"), "{e}");
            }
            assert!(bind("ipc:///tmp/x").await.is_err());
            assert!(bind("tcp://127.0.0.1:http").await.is_err());
        });
    }

    #[test]
    fn a_stalled_handshake_is_closed_and_the_cap_refuses_the_rest() {
        let limits = ServeLimits {
            max_connections: 2,
            handshake_timeout: Duration::from_millis(300),
            write_timeout: Duration::from_secs(1),
        };
        let (_runtime, addr) = serving(limits);
        let mut a = std::net::TcpStream::connect(addr).unwrap();
        let mut b = std::net::TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        // The third is over the cap: closed at once, before any greeting.
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_millis(250))).unwrap();
        let mut byte = [0u8; 1];
        assert!(matches!(c.read(&mut byte), Ok(0) | Err(_)));
        // The two that never answer the greeting are closed at the deadline.
        assert!(closed_soon(&mut a) && closed_soon(&mut b));
        // Then there is room again: a good peer completes the handshake and stays.
        std::thread::sleep(Duration::from_millis(50));
        let mut d = std::net::TcpStream::connect(addr).unwrap();
        d.write_all(&zmtp::greeting()).unwrap();
        let mut ready = Vec::new();
        let mut data = vec![11];
        data.extend(b"Socket-Type");
        data.extend(3u32.to_be_bytes());
        data.extend(b"SUB");
        ready.extend([0x04, 6 + data.len() as u8, 5]);
        ready.extend(b"READY");
        ready.extend(data);
        d.write_all(&ready).unwrap();
        d.set_read_timeout(Some(Duration::from_millis(600))).unwrap();
        let mut got = [0u8; 64];
        d.read_exact(&mut got).unwrap();
        assert_eq!(got, zmtp::greeting());
        let mut rest = [0u8; 256];
        let n = d.read(&mut rest).unwrap();
        assert!(n > 0 && rest[0] == 0x04, "{:?}", &rest[..n]);
        let e = d.read(&mut rest).unwrap_err().kind();
        assert!(matches!(e, std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut));
    }

    #[test]
    fn a_peer_of_the_wrong_socket_type_is_closed() {
        let (_runtime, addr) = serving(SERVE_LIMITS);
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.write_all(&zmtp::greeting()).unwrap();
        s.write_all(&zmtp::ready_command("PUB", false)).unwrap();
        assert!(closed_soon(&mut s));
    }
}
