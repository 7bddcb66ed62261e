//! The publishing thread: a current-thread tokio runtime that owns the ZMQ sockets, takes
//! batches from the engine over a bounded queue, numbers and sends them, keeps the last
//! `buffer_steps` for replay and answers replay requests.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kiln_engine::{KvCacheEvent, KvEventSink};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

use super::{KvEventsConfig, encode_batch, now_seconds};

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
    pub fn start(config: &KvEventsConfig, block_size: usize) -> Result<Self, String> {
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
                runtime.block_on(publish(thread_config, block_size, batches, bound_tx));
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

/// `tcp://*:P` is bound on every interface (`0.0.0.0`), as ZMQ reads it.
fn bind_address(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

async fn publish(
    config: KvEventsConfig,
    block_size: usize,
    mut batches: mpsc::Receiver<Vec<KvCacheEvent>>,
    bound: std::sync::mpsc::Sender<Result<(String, Option<String>), String>>,
) {
    let mut socket = PubSocket::new();
    let endpoint = match socket.bind(&bind_address(&config.endpoint)).await {
        Ok(e) => e.to_string(),
        Err(e) => {
            let _ = bound.send(Err(format!("KV events: cannot bind {}: {e}", config.endpoint)));
            return;
        }
    };
    let mut replay = None;
    let mut replay_endpoint = None;
    if let Some(address) = &config.replay_endpoint {
        let mut router = RouterSocket::new();
        match router.bind(&bind_address(address)).await {
            Ok(e) => replay_endpoint = Some(e.to_string()),
            Err(e) => {
                let _ = bound.send(Err(format!("KV events: cannot bind replay {address}: {e}")));
                return;
            }
        }
        replay = Some(router);
    }
    if bound.send(Ok((endpoint, replay_endpoint))).is_err() {
        return;
    }
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut buffer: VecDeque<(i64, Bytes)> = VecDeque::new();
    let mut next_seq: i64 = 0;
    loop {
        tokio::select! {
            batch = batches.recv() => {
                let Some(events) = batch else { return };
                let payload = Bytes::from(encode_batch(now_seconds(), &events, block_size));
                let frames = vec![topic.clone(), Bytes::copy_from_slice(&next_seq.to_be_bytes()), payload.clone()];
                if let Ok(message) = ZmqMessage::try_from(frames)
                    && let Err(e) = socket.send(message).await
                {
                    tracing::warn!("KV events: send failed: {e}");
                }
                buffer.push_back((next_seq, payload));
                if buffer.len() > config.buffer_steps {
                    buffer.pop_front();
                }
                next_seq += 1;
            }
            request = recv_replay(&mut replay) => {
                if let (Some(router), Ok(request)) = (replay.as_mut(), request) {
                    answer_replay(router, &topic, &buffer, request).await;
                }
            }
        }
    }
}

/// The next replay request, or never without a replay socket.
async fn recv_replay(replay: &mut Option<RouterSocket>) -> zeromq::ZmqResult<ZmqMessage> {
    match replay {
        Some(router) => router.recv().await,
        None => std::future::pending().await,
    }
}

/// Answers `[identity, "", start_seq]` with the buffered batches from `start_seq` on, then the
/// end marker; a malformed request is ignored.
async fn answer_replay(
    router: &mut RouterSocket,
    topic: &Bytes,
    buffer: &VecDeque<(i64, Bytes)>,
    request: ZmqMessage,
) {
    let frames = request.into_vec();
    let [identity, _, start] = frames.as_slice() else { return };
    let Ok(start) = <[u8; 8]>::try_from(start.as_ref()) else { return };
    let start = i64::from_be_bytes(start);
    let empty = Bytes::new();
    let replies = buffer
        .iter()
        .filter(|(seq, _)| *seq >= start)
        .map(|(seq, payload)| (topic.clone(), *seq, payload.clone()))
        .chain(std::iter::once((empty.clone(), END_SEQ, empty.clone())));
    for (topic, seq, payload) in replies {
        let frames = vec![
            identity.clone(),
            empty.clone(),
            topic,
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            payload,
        ];
        let Ok(message) = ZmqMessage::try_from(frames) else { return };
        if router.send(message).await.is_err() {
            return;
        }
    }
}
