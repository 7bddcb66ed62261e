//! The publishing thread: a current-thread tokio runtime that owns the sockets (kiln's own
//! ZMTP PUB and ROUTER, [`super::pub_socket`], [`super::router_socket`]), takes batches from
//! the engine over a bounded queue, numbers and sends them, keeps the last `buffer_steps` for
//! replay and answers replay requests.
//!
//! Invariants:
//! - the publishing loop never waits on a peer: a PUB send only offers the message to each
//!   subscriber's queue, and each replay runs on a task of its own;
//! - sequence numbers go up by one per batch from 0, and the replay buffer holds a contiguous
//!   run of them (the last `buffer_steps`), so finding a sequence number in it is O(1);
//! - a replay sends, in order, the buffered batches from its `start_seq` up to the newest one
//!   when it was asked, taking each from the buffer as its peer's queue has room (a batch that
//!   leaves the buffer meanwhile is skipped: a gap, as a dropped batch makes), then the end
//!   marker; a peer has at most one replay running (a request during it is ignored), so
//!   replays hold no more than their peers' bounded queues.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::Bytes;
use kiln_engine::{KvCacheEvent, KvEventSink};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use super::pub_socket::PubSocket;
use super::router_socket::{RouterSender, RouterSocket};
use super::{KvEventsConfig, LoraNames, encode_batch, now_seconds};

/// Marks the end of a replay (vLLM's `END_SEQ`).
const END_SEQ: i64 = -1;

/// A running publisher; dropping it stops the thread once the engine's sink is gone too.
pub struct KvEventPublisher {
    queue: mpsc::Sender<Vec<KvCacheEvent>>,
    /// The addresses actually bound (a `:0` port resolved).
    endpoint: String,
    replay_endpoint: Option<String>,
    topic: String,
    buffer_steps: usize,
    dropped: Arc<AtomicU64>,
}

impl KvEventPublisher {
    /// Binds the sockets (an address in use is an error here, at start-up) and starts the
    /// publishing thread.
    pub fn start(
        config: &KvEventsConfig,
        block_size: usize,
        lora_names: LoraNames,
    ) -> Result<Self, String> {
        let (queue, batches) = mpsc::channel(config.max_queue_size);
        let (bound_tx, bound_rx) = std::sync::mpsc::channel();
        let thread_config = config.clone();
        std::thread::Builder::new()
            .name("kiln-kv-events".into())
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
                let runtime = match runtime {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = bound_tx.send(Err(format!("KV events runtime: {e}")));
                        return;
                    }
                };
                let encoding = (block_size, lora_names);
                runtime.block_on(publish(thread_config, encoding, batches, bound_tx));
            })
            .map_err(|e| format!("could not start the KV events thread: {e}"))?;
        let (endpoint, replay_endpoint) = bound_rx
            .recv()
            .map_err(|_| "the KV events thread stopped before binding".to_owned())??;
        Ok(Self {
            queue,
            endpoint,
            replay_endpoint,
            topic: config.topic.clone(),
            buffer_steps: config.buffer_steps,
            dropped: Arc::new(AtomicU64::new(0)),
        })
    }

    /// The engine's side: queues each batch without blocking; a full queue drops it (counted
    /// in [`Self::dropped`], logged at the first drop and every 1,000th after).
    pub fn sink(&self) -> KvEventSink {
        let queue = self.queue.clone();
        let dropped = Arc::clone(&self.dropped);
        Box::new(move |events| {
            if queue.try_send(events).is_err() {
                let n = dropped.fetch_add(1, Ordering::Relaxed);
                if n.is_multiple_of(1000) {
                    tracing::warn!(
                        "KV events: the publisher's queue is full; dropped {} batches",
                        n + 1
                    );
                }
            }
        })
    }

    /// Batches dropped because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// The bound PUB address (`tcp://HOST:PORT`).
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// `GET /kv_event_sources`: vLLM's `KVEventsConfig` fields for data-parallel rank 0, with
    /// the bound addresses, which a router reads to subscribe (a wildcard host stands for the
    /// worker's own address).
    pub fn sources_json(&self) -> Value {
        json!({"0": {
            "enable_kv_cache_events": true,
            "publisher": "zmq",
            "encoding": "msgpack",
            "schema_version": 1,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "buffer_steps": self.buffer_steps,
        }})
    }
}

/// The last `buffer_steps` batches with their sequence numbers (contiguous, oldest first).
#[derive(Debug, Default)]
struct ReplayBuffer {
    batches: VecDeque<(i64, Bytes)>,
}

type SharedBuffer = Arc<Mutex<ReplayBuffer>>;

fn lock(buffer: &SharedBuffer) -> MutexGuard<'_, ReplayBuffer> {
    buffer.lock().unwrap_or_else(PoisonError::into_inner)
}

impl ReplayBuffer {
    fn push(&mut self, seq: i64, payload: Bytes, capacity: usize) {
        self.batches.push_back((seq, payload));
        if self.batches.len() > capacity {
            self.batches.pop_front();
        }
    }

    /// The oldest buffered batch numbered `seq` or later.
    fn at_or_after(&self, seq: i64) -> Option<(i64, Bytes)> {
        let first = self.batches.front()?.0;
        // Before the first: from the first.
        let index = usize::try_from(seq.saturating_sub(first)).unwrap_or(0);
        self.batches.get(index).cloned()
    }
}

async fn publish(
    config: KvEventsConfig,
    (block_size, lora_names): (usize, LoraNames),
    mut batches: mpsc::Receiver<Vec<KvCacheEvent>>,
    bound: std::sync::mpsc::Sender<Result<(String, Option<String>), String>>,
) {
    let socket = match PubSocket::bind(&config.endpoint).await {
        Ok(s) => s,
        Err(e) => {
            let _ = bound.send(Err(format!("KV events: cannot bind {}: {e}", config.endpoint)));
            return;
        }
    };
    let mut replay = None;
    if let Some(address) = &config.replay_endpoint {
        match RouterSocket::bind(address).await {
            Ok(router) => replay = Some(router),
            Err(e) => {
                let _ = bound.send(Err(format!("KV events: cannot bind replay {address}: {e}")));
                return;
            }
        }
    }
    let replay_endpoint = replay.as_ref().map(|r| r.endpoint().to_owned());
    if bound.send(Ok((socket.endpoint().to_owned(), replay_endpoint))).is_err() {
        return;
    }
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let buffer = SharedBuffer::default();
    let mut replays = HashMap::new();
    let mut next_seq: i64 = 0;
    loop {
        tokio::select! {
            batch = batches.recv() => {
                let Some(events) = batch else { return };
                let payload = Bytes::from(encode_batch(now_seconds(), &events, block_size, &*lora_names));
                let seq = Bytes::copy_from_slice(&next_seq.to_be_bytes());
                socket.send(&[topic.clone(), seq, payload.clone()]);
                lock(&buffer).push(next_seq, payload, config.buffer_steps);
                next_seq += 1;
            }
            request = recv_replay(&mut replay) => {
                // `None`: the ROUTER's peers are gone for good (not while it accepts).
                let Some(request) = request else {
                    replay = None;
                    continue;
                };
                if let Some(router) = &replay {
                    let replay = Replay {
                        router: router.sender(),
                        topic: topic.clone(),
                        buffer: Arc::clone(&buffer),
                        end: next_seq,
                    };
                    answer_replay(replay, &request, &mut replays);
                }
            }
        }
    }
}

/// The next replay request, or never without a replay socket.
async fn recv_replay(replay: &mut Option<RouterSocket>) -> Option<Vec<Bytes>> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

/// What a replay task needs: where to send, the buffer, and the first sequence number not
/// published yet when it was asked.
struct Replay {
    router: RouterSender,
    topic: Bytes,
    buffer: SharedBuffer,
    end: i64,
}

/// Answers `[identity, "", start_seq]` on a task of its own (see the module docs); a
/// malformed request, or one from a peer whose replay is still running, is ignored.
fn answer_replay(replay: Replay, request: &[Bytes], running: &mut HashMap<Bytes, JoinHandle<()>>) {
    let [identity, _, start] = request else { return };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else { return };
    let start = i64::from_be_bytes(start);
    running.retain(|_, task| !task.is_finished());
    if running.contains_key(identity) {
        tracing::debug!("KV events: a replay request while one runs for that peer; ignored");
        return;
    }
    let task = tokio::spawn(send_replay(replay, identity.clone(), start));
    running.insert(identity.clone(), task);
}

/// The buffered batches from `start` to `replay.end` as `[identity, "", topic, seq, payload]`,
/// then `[identity, "", "", -1, ""]`; stops when the peer goes.
async fn send_replay(replay: Replay, identity: Bytes, start: i64) {
    let empty = Bytes::new();
    let mut seq = start;
    while seq < replay.end {
        let next = lock(&replay.buffer).at_or_after(seq);
        let Some((found, payload)) = next.filter(|(found, _)| *found < replay.end) else { break };
        let message = [
            identity.clone(),
            empty.clone(),
            replay.topic.clone(),
            Bytes::copy_from_slice(&found.to_be_bytes()),
            payload,
        ];
        if !replay.router.send(&message).await {
            return;
        }
        seq = found + 1;
    }
    let end = [
        identity,
        empty.clone(),
        empty.clone(),
        Bytes::copy_from_slice(&END_SEQ.to_be_bytes()),
        empty,
    ];
    replay.router.send(&end).await;
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::ReplayBuffer;

    #[test]
    fn the_replay_buffer_keeps_the_last_batches_in_order() {
        let mut buffer = ReplayBuffer::default();
        assert_eq!(buffer.at_or_after(0), None);
        for seq in 0..5 {
            buffer.push(seq, Bytes::from(seq.to_string()), 3);
        }
        let at = |seq| buffer.at_or_after(seq).map(|(s, _)| s);
        assert_eq!(
            [at(-1), at(0), at(2), at(3), at(4), at(5), at(i64::MAX)],
            [Some(2), Some(2), Some(2), Some(3), Some(4), None, None]
        );
        assert_eq!(buffer.at_or_after(3).unwrap().1, "3");
    }
}
