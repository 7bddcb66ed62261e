//! KV cache events for cache-aware routers, as vLLM publishes them (`--kv-events-config`):
//! every block the prefix cache stores (with its hash, its parent's hash and its token ids),
//! removes, or clears, so that a router (vLLM's `vllm-router --policy kv_aware`) knows exactly
//! which prefixes each replica holds.
//!
//! Wire format (vLLM's `ZmqEventPublisher`, as vllm-router 0.1.17 decodes it):
//! - a ZMQ PUB socket that binds `endpoint`; each message is three frames: the topic, the
//!   sequence number (8 bytes, big-endian, from 0), and a MessagePack batch;
//! - a batch is the array `[ts, events, data_parallel_rank]` (ts: float seconds since the Unix
//!   epoch; rank 0); events are maps tagged by `"type"`: `BlockStored` (`block_hashes`,
//!   `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`),
//!   `BlockRemoved` (`block_hashes`, `medium`), `AllBlocksCleared`; no other keys (the router
//!   rejects a batch with an unknown key). Hashes are kiln's 64-bit block hashes as unsigned
//!   integers: opaque ids that only have to be stable between a store, its children and its
//!   removal. `medium` is `"GPU"`, the router's name for an engine's primary KV cache. A
//!   block computed under a LoRA adapter carries the binding's cache key as `lora_id` (an id
//!   that is new at each load) and the adapter's name as `lora_name`; a base-model block has
//!   `nil` for both;
//! - with `replay_endpoint`, a ROUTER socket answers `[identity, "", start_seq]` with every
//!   buffered batch from `start_seq` on as `[identity, "", topic, seq, payload]`, then
//!   `[identity, "", "", -1, ""]` (the last `buffer_steps` batches are kept).
//!
//! One batch per engine step that changed the index, in order. The engine thread never blocks
//! on the publisher: batches go through a bounded queue (`max_queue_size`), and a batch that
//! does not fit is dropped and counted (the router sees the gap in sequence numbers and
//! replays, or forgets the replica's blocks).
//!
//! Transport: kiln's own ZMTP 3.x server side on tokio (TCP, NULL mechanism: `zmtp` decodes
//! and encodes, `listener` accepts, `pub_socket` and `router_socket` serve), bounded
//! against any peer that reaches the port: every size a peer declares is capped before
//! anything is allocated for it, handshakes have a deadline, connections per socket are capped,
//! a slow subscriber misses messages instead of holding the publisher, and a peer that breaks
//! a rule is disconnected (logged at debug level) with nothing else changed. The sockets have
//! no authentication: the default endpoint is loopback (`tcp://127.0.0.1:5557`), and binding
//! any other address (`tcp://*:P` is every IPv4 interface) logs a warning at start.

mod listener;
mod msgpack;
mod pub_socket;
mod publisher;
mod router_socket;
mod zmtp;

use std::time::{SystemTime, UNIX_EPOCH};

use kiln_engine::KvCacheEvent;
use serde_json::Value;

pub use publisher::KvEventPublisher;

use self::msgpack::Writer;

/// Where and how events are published.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvEventsConfig {
    /// The PUB socket's address, bound (`tcp://127.0.0.1:5557`, `tcp://*:5557` for every
    /// interface, `tcp://[::1]:0`, ...; port 0 picks a free port).
    pub endpoint: String,
    /// The ROUTER socket's address for replays (`None`: no replay).
    pub replay_endpoint: Option<String>,
    /// The first frame of every message.
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches queued between the engine and the publisher before new ones are dropped.
    pub max_queue_size: usize,
}

impl Default for KvEventsConfig {
    /// vLLM's defaults, but on loopback (vLLM binds `tcp://*:5557`): the sockets have no
    /// authentication, so exposing them is the operator's explicit choice.
    fn default() -> Self {
        Self {
            endpoint: "tcp://127.0.0.1:5557".into(),
            replay_endpoint: None,
            topic: String::new(),
            buffer_steps: 10_000,
            max_queue_size: 100_000,
        }
    }
}

impl KvEventsConfig {
    /// Parses vLLM's `--kv-events-config` JSON (`enable_kv_cache_events`, `publisher`,
    /// `endpoint`, `replay_endpoint`, `topic`, `buffer_steps`, `max_queue_size`); `None` when
    /// events stay off (`enable_kv_cache_events` false or absent, or `publisher: "null"`).
    /// Every other field is refused by name.
    pub fn parse(json: &str) -> Result<Option<Self>, String> {
        let value: Value =
            serde_json::from_str(json).map_err(|e| format!("--kv-events-config: {e}"))?;
        let Value::Object(fields) = value else {
            return Err("--kv-events-config must be a JSON object".into());
        };
        let mut config = Self::default();
        let mut enabled = false;
        let mut publisher = None;
        for (key, v) in &fields {
            let bad = |want: &str| format!("--kv-events-config: `{key}` must be {want}");
            match key.as_str() {
                "enable_kv_cache_events" => enabled = v.as_bool().ok_or_else(|| bad("a bool"))?,
                "publisher" => publisher = Some(v.as_str().ok_or_else(|| bad("a string"))?),
                "endpoint" => {
                    v.as_str().ok_or_else(|| bad("a string"))?.clone_into(&mut config.endpoint);
                }
                "replay_endpoint" => {
                    config.replay_endpoint = match v {
                        Value::Null => None,
                        Value::String(s) => Some(s.clone()),
                        _ => return Err(bad("a string or null")),
                    };
                }
                "topic" => v.as_str().ok_or_else(|| bad("a string"))?.clone_into(&mut config.topic),
                "buffer_steps" | "max_queue_size" => {
                    let n =
                        v.as_u64().filter(|&n| n > 0).ok_or_else(|| bad("a positive integer"))?;
                    let n = usize::try_from(n).map_err(|_| bad("smaller"))?;
                    if key == "buffer_steps" {
                        config.buffer_steps = n;
                    } else {
                        config.max_queue_size = n;
                    }
                }
                "hwm" => {
                    return Err("--kv-events-config: `hwm` is not supported (kiln bounds the \
                                publisher's queue with `max_queue_size`)"
                        .into());
                }
                other => return Err(format!("--kv-events-config: unknown field `{other}`")),
            }
        }
        match publisher {
            None | Some("zmq") if enabled => {}
            None | Some("zmq" | "null") => return Ok(None),
            Some(other) => {
                return Err(format!(
                    "--kv-events-config: `publisher` must be \"zmq\" or \"null\", got {other:?}"
                ));
            }
        }
        let endpoints = [
            ("endpoint", Some(&config.endpoint)),
            ("replay_endpoint", config.replay_endpoint.as_ref()),
        ];
        for (name, endpoint) in endpoints {
            if let Some(e) = endpoint
                && !e.starts_with("tcp://")
            {
                return Err(format!(
                    "--kv-events-config: `{name}` must be a tcp:// address to bind, got {e:?}"
                ));
            }
        }
        Ok(Some(config))
    }
}

/// The name of the LoRA adapter bound under a prefix-cache key, while it is loaded.
pub type LoraNames = std::sync::Arc<dyn Fn(u64) -> Option<String> + Send + Sync>;

/// The MessagePack batch `[ts, events, 0]` of one step's events; `lora_names` names the
/// adapters of keyed blocks.
pub fn encode_batch(
    ts: f64,
    events: &[KvCacheEvent],
    block_size: usize,
    lora_names: &dyn Fn(u64) -> Option<String>,
) -> Vec<u8> {
    let mut w = Writer::default();
    w.array(3);
    w.f64(ts);
    w.array(events.len());
    for event in events {
        match event {
            KvCacheEvent::Stored { hash, parent, tokens, key } => {
                w.map(8);
                w.str("type");
                w.str("BlockStored");
                w.str("block_hashes");
                w.array(1);
                w.uint(hash.0);
                w.str("parent_block_hash");
                match parent {
                    Some(p) => w.uint(p.0),
                    None => w.nil(),
                }
                w.str("token_ids");
                w.array(tokens.len());
                for t in tokens {
                    w.uint(u64::from(t.0));
                }
                w.str("block_size");
                w.uint(block_size as u64);
                let name = (*key != 0).then(|| lora_names(*key)).flatten();
                w.str("lora_id");
                match key {
                    0 => w.nil(),
                    k => w.uint(*k),
                }
                w.str("medium");
                w.str("GPU");
                w.str("lora_name");
                match &name {
                    Some(name) => w.str(name),
                    None => w.nil(),
                }
            }
            KvCacheEvent::Removed { hash } => {
                w.map(3);
                w.str("type");
                w.str("BlockRemoved");
                w.str("block_hashes");
                w.array(1);
                w.uint(hash.0);
                w.str("medium");
                w.str("GPU");
            }
            KvCacheEvent::AllCleared => {
                w.map(1);
                w.str("type");
                w.str("AllBlocksCleared");
            }
        }
    }
    w.uint(0);
    w.bytes
}

/// Fuzz entry (a cargo-fuzz target calls it): feeds `data` as one peer's byte stream through
/// what the KV event sockets run on each connection: the greeting, READY and its properties,
/// the socket-type checks, commands, the frame decoder and multipart messages within the peer
/// limits (8 KiB a frame, 16 frames and 16 KiB a message), and a subscriber's subscriptions
/// within their caps. The first byte sets the size of the reads the rest arrives in (1 to 256
/// bytes), so partial reads are explored. It must never panic, and never buffer more than one
/// frame within the limits (asserted after each read); it allocates nothing for a size a peer
/// declares until the size has passed the caps.
pub fn fuzz_peer_bytes(data: &[u8]) {
    let Some((&read_size, stream)) = data.split_first() else { return };
    let mut decoder = zmtp::PeerDecoder::new(zmtp::PEER_LIMITS);
    let mut subscriptions = pub_socket::Subscriptions::default();
    let mut buf = bytes::BytesMut::new();
    for read in stream.chunks(usize::from(read_size) + 1) {
        buf.extend_from_slice(read);
        loop {
            let event = match decoder.next(&mut buf) {
                Ok(Some(event)) => event,
                Ok(None) => break,
                Err(_) => return,
            };
            let applied = match event {
                zmtp::Event::Ready(ready) => {
                    let pub_peer = pub_socket::ROLE.check(&ready);
                    router_socket::ROLE.check(&ready).or(pub_peer)
                }
                zmtp::Event::Command(zmtp::Command::Subscribe(prefix)) => {
                    subscriptions.subscribe(prefix)
                }
                zmtp::Event::Command(zmtp::Command::Cancel(prefix)) => {
                    subscriptions.cancel(&prefix);
                    Ok(())
                }
                zmtp::Event::Message(frames) => subscriptions.apply_message(&frames),
                zmtp::Event::Greeting(_) | zmtp::Event::Command(_) => Ok(()),
            };
            if applied.is_err() {
                return;
            }
        }
        assert!(buf.len() < 9 + zmtp::PEER_LIMITS.frame_bytes, "{} bytes buffered", buf.len());
    }
    let _ = subscriptions.matches(b"kv");
}

/// Seconds since the Unix epoch, for a batch's `ts`.
fn now_seconds() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use kiln_core::TokenId;
    use kiln_engine::{BlockHash, KvCacheEvent};

    use super::{KvEventsConfig, encode_batch, fuzz_peer_bytes, zmtp};

    #[test]
    fn the_config_takes_vllms_fields_and_refuses_the_rest() {
        let on = KvEventsConfig::parse(
            r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001", "topic": "kv",
                "buffer_steps": 8, "max_queue_size": 4}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(on.endpoint, "tcp://*:6000");
        assert_eq!(on.replay_endpoint.as_deref(), Some("tcp://*:6001"));
        assert_eq!((on.topic.as_str(), on.buffer_steps, on.max_queue_size), ("kv", 8, 4));
        let defaults = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true}"#).unwrap();
        assert_eq!(defaults, Some(KvEventsConfig::default()));
        // Loopback unless told otherwise: the sockets have no authentication.
        assert_eq!(KvEventsConfig::default().endpoint, "tcp://127.0.0.1:5557");
        for off in ["{}", r#"{"enable_kv_cache_events": false, "publisher": "zmq"}"#] {
            assert_eq!(KvEventsConfig::parse(off).unwrap(), None, "{off}");
        }
        let off = r#"{"enable_kv_cache_events": true, "publisher": "null"}"#;
        assert_eq!(KvEventsConfig::parse(off).unwrap(), None);
        for (bad, names) in [
            (r#"{"enable_kv_cache_events": true, "hwm": 10}"#, "hwm"),
            (r#"{"enable_kv_cache_events": true, "colour": 1}"#, "colour"),
            (r#"{"enable_kv_cache_events": "yes"}"#, "enable_kv_cache_events"),
            (r#"{"enable_kv_cache_events": true, "publisher": "nats"}"#, "publisher"),
            (r#"{"enable_kv_cache_events": true, "buffer_steps": 0}"#, "buffer_steps"),
            (r#"{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}"#, "endpoint"),
            ("[1]", "object"),
        ] {
            let e = KvEventsConfig::parse(bad).unwrap_err();
            assert!(e.contains(names), "{bad}: {e}");
        }
    }

    #[test]
    fn the_fuzz_entry_takes_any_bytes() {
        let mut handshake = zmtp::greeting().to_vec();
        handshake.extend(zmtp::ready_command("SUB", false));
        // SUBSCRIBE "kv", a ZMTP 3.0 subscription, then a frame declaring 2^40 bytes.
        handshake.extend(b"\x04\x0c\x09SUBSCRIBEkv\x00\x03\x01kv");
        let mut huge = handshake.clone();
        huge.push(0x02);
        huge.extend((1u64 << 40).to_be_bytes());
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut noise = || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (state >> 56) as u8
        };
        for read_size in [0u8, 1, 63, 255] {
            for stream in [&[][..], &handshake, &huge, b"GET / HTTP/1.1\r\n\r\n"] {
                let mut data = vec![read_size];
                data.extend(stream);
                fuzz_peer_bytes(&data);
                // And the same stream cut short, or followed by noise.
                fuzz_peer_bytes(&data[..data.len() / 2]);
                data.extend((0..4096).map(|_| noise()));
                fuzz_peer_bytes(&data);
            }
        }
        fuzz_peer_bytes(&[]);
    }

    #[test]
    fn a_batch_encodes_as_vllms_tagged_events() {
        let events = [
            KvCacheEvent::Stored {
                hash: BlockHash(300),
                parent: None,
                tokens: vec![TokenId(1), TokenId(2)],
                key: 0,
            },
            KvCacheEvent::Removed { hash: BlockHash(5) },
            KvCacheEvent::AllCleared,
        ];
        let bytes = encode_batch(2.0, &events, 2, &|_| None);
        let mut want = vec![0x93, 0xcb];
        want.extend(2.0f64.to_be_bytes());
        want.push(0x93);
        // {"type": "BlockStored", "block_hashes": [300], "parent_block_hash": nil, ...}
        want.push(0x88);
        for (key, value) in [
            ("type", &b"\xabBlockStored"[..]),
            ("block_hashes", &[0x91, 0xcd, 0x01, 0x2c]),
            ("parent_block_hash", &[0xc0]),
            ("token_ids", &[0x92, 0x01, 0x02]),
            ("block_size", &[0x02]),
            ("lora_id", &[0xc0]),
            ("medium", b"\xa3GPU"),
            ("lora_name", &[0xc0]),
        ] {
            want.push(0xa0 | key.len() as u8);
            want.extend(key.as_bytes());
            want.extend(value);
        }
        want.push(0x83);
        for (key, value) in [
            ("type", &b"\xacBlockRemoved"[..]),
            ("block_hashes", &[0x91, 0x05]),
            ("medium", b"\xa3GPU"),
        ] {
            want.push(0xa0 | key.len() as u8);
            want.extend(key.as_bytes());
            want.extend(value);
        }
        want.extend(b"\x81\xa4type\xb0AllBlocksCleared");
        want.push(0x00);
        assert_eq!(bytes, want);
    }
    #[test]
    fn an_adapter_s_block_carries_its_key_and_name() {
        let stored = |key| KvCacheEvent::Stored {
            hash: BlockHash(1),
            parent: None,
            tokens: vec![TokenId(1)],
            key,
        };
        let names = |key: u64| (key == 7).then(|| "sql".to_owned());
        let find = |bytes: &[u8], field: &str| {
            let mut tag = vec![0xa0 | field.len() as u8];
            tag.extend(field.as_bytes());
            let at = bytes.windows(tag.len()).position(|w| w == tag).unwrap() + tag.len();
            bytes[at..].to_vec()
        };
        let bytes = encode_batch(0.0, &[stored(7)], 1, &names);
        assert_eq!(find(&bytes, "lora_id")[0], 0x07);
        assert!(find(&bytes, "lora_name").starts_with(b"\xa3sql"));
        // A key whose adapter was unloaded since: its id, no name.
        let bytes = encode_batch(0.0, &[stored(8)], 1, &names);
        assert_eq!(find(&bytes, "lora_id")[0], 0x08);
        assert_eq!(find(&bytes, "lora_name")[0], 0xc0);
    }
}
