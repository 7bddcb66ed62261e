//! A ZMTP PUB socket that binds: subscribers (SUB or XSUB peers) connect, subscribe to topic
//! prefixes, and get each published message whose first frame starts with one of them.
//!
//! Invariants:
//! - the publisher never waits: [`PubSocket::send`] encodes a message once and offers it to
//!   every subscriber's queue of [`SUBSCRIBER_QUEUE`] messages (shared bytes, not copies); a
//!   subscriber whose queue is full misses it (counted, logged at debug level), and one that
//!   stops reading is disconnected by its write deadline ([`super::listener`]);
//! - a subscriber gets nothing until it subscribes; subscriptions come as ZMTP 3.0 messages (one
//!   frame, `0x01` + prefix to subscribe, `0x00` + prefix to cancel) or ZMTP 3.1 SUBSCRIBE /
//!   CANCEL commands, and count like libzmq's (subscribing twice takes two cancels); a peer
//!   holds at most [`MAX_SUBSCRIPTIONS`] prefixes of at most [`MAX_SUBSCRIPTION_LEN`] bytes,
//!   beyond which it is disconnected; other messages from a peer are ignored, as libzmq's PUB
//!   ignores them;
//! - the subscriber list holds the connected subscribers and those gone since the last send or
//!   connection (pruned then), so at most the connection cap plus the recently gone.
//!
//! Cost: a send is O(subscribers); a subscriber matches a topic in O(subscriptions × prefix).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use tokio::sync::mpsc::{self, error::TrySendError};

use super::listener::{self, Connection, Disconnect, Role, SERVE_LIMITS};
use super::zmtp::{self, Command, Event, ZmtpError};

/// Messages queued per subscriber before it misses new ones (a few seconds of engine steps;
/// the queues share the messages' bytes).
pub(crate) const SUBSCRIBER_QUEUE: usize = 256;
/// Distinct prefixes one subscriber may hold.
pub(crate) const MAX_SUBSCRIPTIONS: usize = 64;
/// The longest prefix.
pub(crate) const MAX_SUBSCRIPTION_LEN: usize = 1024;
/// A subscriber's misses are logged at the first and every this many after.
const LOG_DROPS_EVERY: u64 = 1000;

pub(crate) const ROLE: Role =
    Role { socket_type: "PUB", peers: &["SUB", "XSUB"], with_identity: false };

/// One message for the subscribers: its first frame, to match, and its encoded frames.
#[derive(Clone, Debug)]
struct Outgoing {
    topic: Bytes,
    wire: Bytes,
}

/// A connected subscriber, as the publisher sees it.
#[derive(Debug)]
struct Subscriber {
    queue: mpsc::Sender<Outgoing>,
    peer: SocketAddr,
    dropped: u64,
}

type Subscribers = Arc<Mutex<Vec<Subscriber>>>;

fn lock(subscribers: &Subscribers) -> MutexGuard<'_, Vec<Subscriber>> {
    subscribers.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A bound PUB socket; its accept loop and subscribers run on the current tokio runtime.
#[derive(Debug)]
pub(crate) struct PubSocket {
    subscribers: Subscribers,
    endpoint: String,
}

impl PubSocket {
    /// Binds `endpoint` (`tcp://HOST:PORT`) and starts accepting subscribers.
    pub(crate) async fn bind(endpoint: &str) -> Result<Self, String> {
        let (listener, endpoint) = listener::bind(endpoint).await?;
        let subscribers = Subscribers::default();
        let registry = Arc::clone(&subscribers);
        listener::spawn_accept_loop(listener, &ROLE, SERVE_LIMITS, move |connection, _| {
            serve(connection, Arc::clone(&registry))
        });
        Ok(Self { subscribers, endpoint })
    }

    /// The bound address (`tcp://IP:PORT`).
    pub(crate) fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// Offers the message `frames` to every subscriber without waiting (see the module docs).
    pub(crate) fn send(&self, frames: &[Bytes]) {
        let mut subscribers = lock(&self.subscribers);
        let Some(topic) = frames.first().filter(|_| !subscribers.is_empty()) else { return };
        let message = Outgoing { topic: topic.clone(), wire: zmtp::encode_message(frames) };
        subscribers.retain_mut(|s| match s.queue.try_send(message.clone()) {
            Ok(()) => true,
            Err(TrySendError::Full(_)) => {
                s.dropped += 1;
                if s.dropped % LOG_DROPS_EVERY == 1 {
                    tracing::debug!(
                        "KV events PUB: subscriber {} is slow; it missed {} messages",
                        s.peer,
                        s.dropped
                    );
                }
                true
            }
            Err(TrySendError::Closed(_)) => false,
        });
    }
}

/// One subscriber's connection: its subscriptions in, its messages out.
async fn serve(mut connection: Connection, subscribers: Subscribers) -> Result<(), Disconnect> {
    let (queue, mut messages) = mpsc::channel(SUBSCRIBER_QUEUE);
    {
        let mut subscribers = lock(&subscribers);
        subscribers.retain(|s| !s.queue.is_closed());
        subscribers.push(Subscriber { queue, peer: connection.peer, dropped: 0 });
    }
    let mut subscriptions = Subscriptions::default();
    loop {
        tokio::select! {
            // Subscriptions first, so that a message queued meanwhile is matched against them.
            biased;
            event = connection.next_event() => match event? {
                Event::Command(Command::Subscribe(prefix)) => subscriptions.subscribe(prefix)?,
                Event::Command(Command::Cancel(prefix)) => subscriptions.cancel(&prefix),
                Event::Command(Command::Ping(context)) => {
                    connection.write(&zmtp::pong_command(&context)).await?;
                }
                Event::Message(frames) => subscriptions.apply_message(&frames)?,
                Event::Command(Command::Ignored) | Event::Greeting(_) | Event::Ready(_) => {}
            },
            message = messages.recv() => {
                // `None`: the socket is gone (the publisher stopped).
                let Some(message) = message else { return Ok(()) };
                if subscriptions.matches(&message.topic) {
                    connection.write(&message.wire).await?;
                }
            }
        }
    }
}

/// One subscriber's topic prefixes, each with how many times it was subscribed.
#[derive(Debug, Default)]
pub(crate) struct Subscriptions {
    prefixes: Vec<(Bytes, u32)>,
}

impl Subscriptions {
    pub(crate) fn subscribe(&mut self, prefix: Bytes) -> Result<(), ZmtpError> {
        if prefix.len() > MAX_SUBSCRIPTION_LEN {
            return Err(ZmtpError::Limit("a subscription longer than 1,024 bytes"));
        }
        if let Some((_, count)) = self.prefixes.iter_mut().find(|(p, _)| *p == prefix) {
            *count = count.saturating_add(1);
        } else if self.prefixes.len() == MAX_SUBSCRIPTIONS {
            return Err(ZmtpError::Limit("more than 64 subscriptions"));
        } else {
            self.prefixes.push((prefix, 1));
        }
        Ok(())
    }

    /// Cancels one subscription to `prefix`; one never made is ignored.
    pub(crate) fn cancel(&mut self, prefix: &[u8]) {
        if let Some(i) = self.prefixes.iter().position(|(p, _)| p == prefix) {
            self.prefixes[i].1 -= 1;
            if self.prefixes[i].1 == 0 {
                self.prefixes.swap_remove(i);
            }
        }
    }

    /// A ZMTP 3.0 subscription message; any other message is no subscription and is ignored.
    pub(crate) fn apply_message(&mut self, frames: &[Bytes]) -> Result<(), ZmtpError> {
        let [frame] = frames else { return Ok(()) };
        match frame.first() {
            Some(1) => self.subscribe(frame.slice(1..)),
            Some(0) => {
                self.cancel(&frame[1..]);
                Ok(())
            }
            _ => Ok(()),
        }
    }

    pub(crate) fn matches(&self, topic: &[u8]) -> bool {
        self.prefixes.iter().any(|(p, _)| topic.starts_with(p))
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;

    #[test]
    fn subscriptions_match_by_prefix_and_count_like_libzmq() {
        let mut s = Subscriptions::default();
        assert!(!s.matches(b"kv"));
        s.apply_message(&[Bytes::from_static(b"\x01kv")]).unwrap();
        s.subscribe(Bytes::from_static(b"kv")).unwrap();
        assert!(s.matches(b"kv") && s.matches(b"kv-events") && !s.matches(b"k"));
        s.apply_message(&[Bytes::from_static(b"\x00kv")]).unwrap();
        assert!(s.matches(b"kv"), "subscribed twice, cancelled once");
        s.cancel(b"kv");
        s.cancel(b"never");
        assert!(!s.matches(b"kv"));
        // Not subscriptions: ignored.
        for other in [&[Bytes::from_static(b"\x01a"), Bytes::new()][..], &[Bytes::new()], &[]] {
            s.apply_message(other).unwrap();
        }
        assert!(!s.matches(b"a"));
        s.subscribe(Bytes::new()).unwrap();
        assert!(s.matches(b"") && s.matches(b"anything"));
    }

    #[test]
    fn subscriptions_are_capped_in_number_and_length() {
        let mut s = Subscriptions::default();
        for i in 0..MAX_SUBSCRIPTIONS {
            s.subscribe(Bytes::from(i.to_string())).unwrap();
        }
        s.subscribe(Bytes::from_static(b"0")).unwrap();
        assert!(s.subscribe(Bytes::from_static(b"one more")).is_err());
        let mut s = Subscriptions::default();
        s.subscribe(vec![b'a'; MAX_SUBSCRIPTION_LEN].into()).unwrap();
        assert!(s.subscribe(vec![b'a'; MAX_SUBSCRIPTION_LEN + 1].into()).is_err());
        let mut frame = vec![1];
        frame.extend([b'b'; MAX_SUBSCRIPTION_LEN + 1]);
        assert!(s.apply_message(&[frame.into()]).is_err());
    }
}
