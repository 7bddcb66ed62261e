//! A ZMTP ROUTER socket that binds: peers (DEALER, REQ or ROUTER) connect, each under an
//! identity; their messages come out of [`RouterSocket::recv`] as `[identity, frames...]`, and
//! [`RouterSender::send`] routes `[identity, frames...]` to that peer.
//!
//! Invariants:
//! - a peer's identity is its READY `Identity` when not empty, else a generated one (a zero
//!   byte and a 4-byte counter, as libzmq makes them); identities are unique among connected
//!   peers: a peer announcing one in use is disconnected (libzmq's default, no handover);
//! - incoming messages share one queue of [`INCOMING_QUEUE`] messages; a peer's task waits
//!   while it is full (that peer's reads stop; nothing is dropped, nothing else waits);
//! - each peer has a queue of [`PEER_QUEUE`] messages (their frames shared, not copied: a
//!   replay's payloads are the replay buffer's); `send` waits while it is full (the
//!   publisher's replay tasks wait, never the publisher), and returns false at once for an
//!   identity not connected (the message is dropped) or once the peer is gone;
//! - the identity map holds exactly the peers past their handshake (each removes itself when
//!   its task ends).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::sync::mpsc;

use super::listener::{self, Connection, Disconnect, Role, SERVE_LIMITS};
use super::zmtp::{self, Command, Event, Ready, ZmtpError};

/// Messages from all peers waiting for [`RouterSocket::recv`].
const INCOMING_QUEUE: usize = 64;
/// Messages waiting to be written to one peer.
const PEER_QUEUE: usize = 16;

pub(crate) const ROLE: Role =
    Role { socket_type: "ROUTER", peers: &["DEALER", "REQ", "ROUTER"], with_identity: true };

/// The connected peers by identity, and the counter of generated identities.
#[derive(Debug, Default)]
struct Peers {
    by_identity: HashMap<Bytes, mpsc::Sender<Vec<Bytes>>>,
    next_generated: u32,
}

type SharedPeers = Arc<Mutex<Peers>>;

fn lock(peers: &SharedPeers) -> MutexGuard<'_, Peers> {
    peers.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Peers {
    /// Registers a peer under its announced identity, or a generated one when it announced
    /// none.
    fn register(
        &mut self,
        announced: Bytes,
        queue: mpsc::Sender<Vec<Bytes>>,
    ) -> Result<Bytes, ZmtpError> {
        let identity = if announced.is_empty() {
            loop {
                let mut id = vec![0];
                id.extend(self.next_generated.to_be_bytes());
                self.next_generated = self.next_generated.wrapping_add(1);
                let id = Bytes::from(id);
                if !self.by_identity.contains_key(&id) {
                    break id;
                }
            }
        } else if self.by_identity.contains_key(&announced) {
            return Err(ZmtpError::Limit("an Identity already connected"));
        } else {
            announced
        };
        self.by_identity.insert(identity.clone(), queue);
        Ok(identity)
    }
}

/// Removes a peer from the map when its task ends, however it ends.
struct Registration {
    peers: SharedPeers,
    identity: Bytes,
    queue: mpsc::Sender<Vec<Bytes>>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let mut peers = lock(&self.peers);
        if peers.by_identity.get(&self.identity).is_some_and(|q| q.same_channel(&self.queue)) {
            peers.by_identity.remove(&self.identity);
        }
    }
}

/// Routes messages to the socket's peers; clones share the socket.
#[derive(Clone, Debug)]
pub(crate) struct RouterSender {
    peers: SharedPeers,
}

impl RouterSender {
    /// Queues `[identity, frames...]` (at least one frame after the identity) for that peer,
    /// waiting while its queue is full; false when it is not connected (dropped) or goes.
    pub(crate) async fn send(&self, message: &[Bytes]) -> bool {
        let Some((identity, frames)) = message.split_first().filter(|(_, f)| !f.is_empty()) else {
            return false;
        };
        let queue = lock(&self.peers).by_identity.get(identity).cloned();
        match queue {
            Some(queue) => queue.send(frames.to_vec()).await.is_ok(),
            None => false,
        }
    }
}

/// A bound ROUTER socket; its accept loop and peers run on the current tokio runtime.
#[derive(Debug)]
pub(crate) struct RouterSocket {
    incoming: mpsc::Receiver<Vec<Bytes>>,
    sender: RouterSender,
    endpoint: String,
}

impl RouterSocket {
    /// Binds `endpoint` (`tcp://HOST:PORT`) and starts accepting peers.
    pub(crate) async fn bind(endpoint: &str) -> Result<Self, String> {
        let (listener, endpoint) = listener::bind(endpoint).await?;
        let peers = SharedPeers::default();
        let (incoming_tx, incoming) = mpsc::channel(INCOMING_QUEUE);
        let registry = Arc::clone(&peers);
        listener::spawn_accept_loop(listener, &ROLE, SERVE_LIMITS, move |connection, ready| {
            serve(connection, ready, Arc::clone(&registry), incoming_tx.clone())
        });
        Ok(Self { incoming, sender: RouterSender { peers }, endpoint })
    }

    /// The bound address (`tcp://IP:PORT`).
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The next message from a peer, as `[identity, frames...]`. Cancel-safe.
    pub(crate) async fn recv(&mut self) -> Option<Vec<Bytes>> {
        self.incoming.recv().await
    }

    /// A handle to send from other tasks.
    pub(crate) fn sender(&self) -> RouterSender {
        self.sender.clone()
    }
}

/// One peer's connection: its messages in (with its identity), its queue out.
async fn serve(
    mut connection: Connection,
    ready: Ready,
    peers: SharedPeers,
    incoming: mpsc::Sender<Vec<Bytes>>,
) -> Result<(), Disconnect> {
    let (queue, mut outgoing) = mpsc::channel(PEER_QUEUE);
    let identity = lock(&peers).register(ready.identity, queue.clone())?;
    let _registration = Registration { peers, identity: identity.clone(), queue };
    loop {
        tokio::select! {
            event = connection.next_event() => match event? {
                Event::Message(frames) => {
                    let mut message = Vec::with_capacity(frames.len() + 1);
                    message.push(identity.clone());
                    message.extend(frames);
                    if incoming.send(message).await.is_err() {
                        return Ok(());
                    }
                }
                Event::Command(Command::Ping(context)) => {
                    connection.write(&zmtp::pong_command(&context)).await?;
                }
                // Subscriptions mean nothing to a ROUTER.
                Event::Command(_) | Event::Greeting(_) | Event::Ready(_) => {}
            },
            message = outgoing.recv() => {
                // The registration keeps a sender: `None` cannot come while it lives.
                let Some(message) = message else { return Ok(()) };
                connection.write_message(&message).await?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use tokio::sync::mpsc;

    use super::*;

    #[test]
    fn identities_are_announced_or_generated_and_unique() {
        let mut peers = Peers::default();
        let (tx, _rx) = mpsc::channel(1);
        assert_eq!(peers.register("me".into(), tx.clone()).unwrap(), "me");
        assert!(peers.register("me".into(), tx.clone()).is_err());
        let a = peers.register(Bytes::new(), tx.clone()).unwrap();
        let b = peers.register(Bytes::new(), tx.clone()).unwrap();
        assert_eq!((&a[..], &b[..]), (&[0, 0, 0, 0, 0][..], &[0, 0, 0, 0, 1][..]));
        // A peer that announced what would be generated next does not collide.
        peers.register(Bytes::from_static(&[0, 0, 0, 0, 2]), tx.clone()).unwrap();
        assert_eq!(&peers.register(Bytes::new(), tx).unwrap()[..], &[0, 0, 0, 0, 3]);
    }

    #[test]
    fn a_registration_removes_only_its_own_peer() {
        let peers = SharedPeers::default();
        let (tx, _rx) = mpsc::channel(1);
        let identity = lock(&peers).register("x".into(), tx.clone()).unwrap();
        let registration = Registration { peers: Arc::clone(&peers), identity, queue: tx };
        let sender = RouterSender { peers: Arc::clone(&peers) };
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        assert!(!runtime.block_on(sender.send(&[Bytes::from_static(b"unknown"), Bytes::new()])));
        assert!(!runtime.block_on(sender.send(&[Bytes::from_static(b"x")])));
        assert!(runtime.block_on(sender.send(&[Bytes::from_static(b"x"), Bytes::new()])));
        drop(registration);
        assert!(lock(&peers).by_identity.is_empty());
    }
}
