//! The KV event sockets on the wire, against raw TCP clients written here (ZMTP 3 by hand):
//! hostile peers (a frame declaring 2^40 bytes, a bad greeting, the wrong socket type, a peer
//! that never finishes its handshake) lose their own connection and nothing else; subscribers
//! get `[topic, seq, payload]` by prefix; a DEALER gets its replay. Every socket has a read
//! timeout, and the whole file runs in well under a few seconds.

#![allow(clippy::unwrap_used)]

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use kiln_engine::KvCacheEvent;
use kiln_server::kv_events::{KvEventPublisher, KvEventsConfig};

/// How long any wait here may take.
const LIMIT: Duration = Duration::from_secs(5);
/// A read that finds nothing this soon gives up (then the caller retries or concludes).
const POLL: Duration = Duration::from_millis(100);
/// `AllBlocksCleared`'s batch after the timestamp: `[[{"type": "AllBlocksCleared"}], 0]`.
const CLEARED_TAIL: &[u8] = b"\x91\x81\xa4type\xb0AllBlocksCleared\x00";

/// A publisher with a replay socket, both on free loopback ports; returns it and the
/// `host:port` of both sockets.
fn publisher() -> (KvEventPublisher, String, String) {
    let config = KvEventsConfig {
        endpoint: "tcp://127.0.0.1:0".into(),
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        topic: "kv".into(),
        buffer_steps: 100,
        max_queue_size: 100,
    };
    let publisher = KvEventPublisher::start(&config, 16, std::sync::Arc::new(|_| None)).unwrap();
    let pub_addr = publisher.endpoint().strip_prefix("tcp://").unwrap().to_owned();
    let sources = publisher.sources_json();
    let replay = sources["0"]["replay_endpoint"].as_str().unwrap();
    let replay_addr = replay.strip_prefix("tcp://").unwrap().to_owned();
    assert!(!pub_addr.ends_with(":0") && !replay_addr.ends_with(":0"));
    (publisher, pub_addr, replay_addr)
}

fn greeting(minor: u8) -> Vec<u8> {
    let mut g = vec![0u8; 64];
    (g[0], g[9], g[10], g[11]) = (0xFF, 0x7F, 3, minor);
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut out = match u8::try_from(body.len()) {
        Ok(n) => vec![flags, n],
        Err(_) => [&[flags | 0x02][..], &(body.len() as u64).to_be_bytes()].concat(),
    };
    out.extend(body);
    out
}

fn command(name: &str, data: &[u8]) -> Vec<u8> {
    frame(0x04, &[&[name.len() as u8][..], name.as_bytes(), data].concat())
}

fn ready(socket_type: &str, identity: Option<&[u8]>) -> Vec<u8> {
    let mut data = Vec::new();
    let properties = [("Socket-Type", Some(socket_type.as_bytes())), ("Identity", identity)];
    for (name, value) in properties {
        let Some(value) = value else { continue };
        data.push(name.len() as u8);
        data.extend(name.as_bytes());
        data.extend((value.len() as u32).to_be_bytes());
        data.extend(value);
    }
    command("READY", &data)
}

fn message(frames: &[&[u8]]) -> Vec<u8> {
    let last = frames.len() - 1;
    frames.iter().enumerate().flat_map(|(i, f)| frame(u8::from(i < last), f)).collect()
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(LIMIT)).unwrap();
    s.set_write_timeout(Some(LIMIT)).unwrap();
    s
}

/// Whether the server closes `s` (EOF, or a reset for the bytes it left unread) in time.
fn closed(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) => {
                return matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe);
            }
        }
    }
}

/// A well-behaved raw peer past its handshake.
struct Peer(TcpStream);

impl Peer {
    /// Connects as `socket_type`, checks kiln's greeting and READY (`Socket-Type` `want`).
    fn connect(addr: &str, socket_type: &str, identity: Option<&[u8]>, want: &str) -> Self {
        let mut s = connect(addr);
        s.write_all(&greeting(1)).unwrap();
        s.write_all(&ready(socket_type, identity)).unwrap();
        let mut g = [0u8; 64];
        s.read_exact(&mut g).unwrap();
        assert_eq!((g[0], g[9], g[10], &g[12..16]), (0xFF, 0x7F, 3, &b"NULL"[..]));
        let mut peer = Self(s);
        let (flags, body) = peer.read_frame().unwrap();
        assert_eq!(flags, 0x04);
        assert!(body.starts_with(b"\x05READY\x0bSocket-Type"), "{body:?}");
        let n = u32::from_be_bytes(body[18..22].try_into().unwrap()) as usize;
        assert_eq!(&body[22..22 + n], want.as_bytes());
        peer
    }

    fn send(&mut self, bytes: &[u8]) {
        self.0.write_all(bytes).unwrap();
    }

    fn read_frame(&mut self) -> std::io::Result<(u8, Vec<u8>)> {
        let mut head = [0u8; 2];
        self.0.read_exact(&mut head)?;
        let len = if head[0] & 0x02 == 0 {
            usize::from(head[1])
        } else {
            let mut rest = [0u8; 7];
            self.0.read_exact(&mut rest)?;
            let size = u64::from_be_bytes([&head[1..], &rest[..]].concat().try_into().unwrap());
            usize::try_from(size).unwrap()
        };
        assert!(len < 1 << 20, "a frame of {len} bytes");
        let mut body = vec![0u8; len];
        self.0.read_exact(&mut body)?;
        Ok((head[0], body))
    }

    /// The next message (commands skipped), or the read's error (a timeout when none came).
    fn read_message(&mut self, timeout: Duration) -> std::io::Result<Vec<Vec<u8>>> {
        self.0.set_read_timeout(Some(timeout)).unwrap();
        let mut frames = Vec::new();
        loop {
            let (flags, body) = self.read_frame()?;
            if flags & 0x04 != 0 {
                continue;
            }
            frames.push(body);
            if flags & 0x01 == 0 {
                self.0.set_read_timeout(Some(LIMIT)).unwrap();
                return Ok(frames);
            }
        }
    }
}

/// Publishes `AllCleared` batches until `subscriber` gets one (a subscription takes effect
/// some time after it is sent, as with ZMQ); returns its frames.
fn published(publisher: &KvEventPublisher, subscriber: &mut Peer) -> Vec<Vec<u8>> {
    let mut sink = publisher.sink();
    let start = Instant::now();
    loop {
        assert!(start.elapsed() < LIMIT, "no batch reached the subscriber");
        sink(vec![KvCacheEvent::AllCleared]);
        match subscriber.read_message(POLL) {
            Ok(frames) => return frames,
            Err(e) => assert!(matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        }
    }
}

/// Checks a batch message's three frames: topic, 8-byte big-endian seq, one `AllCleared`.
fn assert_cleared_batch(frames: &[Vec<u8>]) -> u64 {
    assert_eq!(frames.len(), 3, "{frames:?}");
    assert_eq!(frames[0], b"kv");
    let seq = u64::from_be_bytes(frames[1].as_slice().try_into().unwrap());
    let payload = &frames[2];
    assert_eq!(&payload[..2], [0x93, 0xcb], "[ts as float64, ...]");
    assert_eq!(&payload[10..], CLEARED_TAIL);
    seq
}

/// A replay request from `start` and its answer: the `(seq, payload)` of each batch, checked
/// to be `["", topic, seq, payload]`, up to the end marker `["", "", -1, ""]`.
fn replay(dealer: &mut Peer, start: i64) -> Vec<(i64, Vec<u8>)> {
    dealer.send(&message(&[b"", &start.to_be_bytes()]));
    let mut batches = Vec::new();
    loop {
        let frames = dealer.read_message(LIMIT).unwrap();
        assert_eq!(frames.len(), 4, "{frames:?}");
        assert!(frames[0].is_empty());
        let seq = i64::from_be_bytes(frames[2].as_slice().try_into().unwrap());
        if seq == -1 {
            assert!(frames[1].is_empty() && frames[3].is_empty(), "{frames:?}");
            return batches;
        }
        assert_eq!(frames[1], b"kv");
        batches.push((seq, frames[3].clone()));
    }
}

#[test]
fn a_frame_declaring_a_terabyte_closes_only_its_connection() {
    let (publisher, pub_addr, replay_addr) = publisher();
    let mut terabyte = vec![0x02];
    terabyte.extend((1u64 << 40).to_be_bytes());
    for (addr, socket_type) in [(&pub_addr, "SUB"), (&replay_addr, "DEALER")] {
        let mut s = connect(addr);
        s.write_all(&[greeting(1), ready(socket_type, None), terabyte.clone()].concat()).unwrap();
        assert!(closed(&mut s), "{socket_type}: still open after a 2^40-byte frame header");
    }
    // Other rule breakers: not ZMTP, ZMTP 2, another mechanism, the wrong socket type, a
    // message before READY, too many subscriptions.
    let mut plain = greeting(1);
    plain[12..17].copy_from_slice(b"PLAIN");
    let mut v2 = greeting(0);
    v2[10] = 2;
    let many: Vec<u8> =
        (0..65).flat_map(|i: u32| message(&[&[&[1u8][..], &i.to_be_bytes()].concat()])).collect();
    let hostile: [(&str, &String, Vec<u8>); 7] = [
        ("http", &pub_addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec()),
        ("zmtp 2", &replay_addr, v2),
        ("PLAIN", &pub_addr, plain),
        ("PUB to PUB", &pub_addr, [greeting(1), ready("PUB", None)].concat()),
        ("SUB to ROUTER", &replay_addr, [greeting(1), ready("SUB", None)].concat()),
        ("no READY", &replay_addr, [greeting(1), message(&[b"", b"x"])].concat()),
        ("65 subscriptions", &pub_addr, [greeting(0), ready("SUB", None), many].concat()),
    ];
    for (what, addr, bytes) in hostile {
        let mut s = connect(addr);
        s.write_all(&bytes).unwrap();
        assert!(closed(&mut s), "{what}: still open");
    }

    // The publisher still publishes: to a ZMTP 3.0-style subscriber of everything, to a 3.1
    // SUBSCRIBE command of "kv", not to a subscriber of "zz".
    let mut everything = Peer::connect(&pub_addr, "SUB", None, "PUB");
    everything.send(&message(&[b"\x01"]));
    let mut by_command = Peer::connect(&pub_addr, "XSUB", None, "PUB");
    by_command.send(&command("SUBSCRIBE", b"kv"));
    let mut other = Peer::connect(&pub_addr, "SUB", None, "PUB");
    other.send(&command("SUBSCRIBE", b"zz"));
    assert_cleared_batch(&published(&publisher, &mut everything));
    assert_cleared_batch(&published(&publisher, &mut by_command));
    let e = other.read_message(POLL).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{e}");
    // A heartbeat is answered with its context.
    everything.send(&command("PING", b"\x00\x00hi"));
    let pong = loop {
        let (flags, body) = everything.read_frame().unwrap();
        if flags == 0x04 {
            break body;
        }
    };
    assert_eq!(pong, b"\x04PONGhi");
    // And the replay socket answers after its own hostile peer.
    let mut dealer = Peer::connect(&replay_addr, "DEALER", None, "ROUTER");
    let batches = replay(&mut dealer, 0);
    assert!(!batches.is_empty());
    assert_eq!(publisher.dropped(), 0);
}

#[test]
fn a_dealer_gets_the_buffered_batches_from_its_start_then_the_end_marker() {
    let (publisher, _, replay_addr) = publisher();
    let mut sink = publisher.sink();
    for _ in 0..3 {
        sink(vec![KvCacheEvent::AllCleared]);
    }
    let mut dealer = Peer::connect(&replay_addr, "DEALER", None, "ROUTER");
    // A named peer next to it, to check that answers are routed by identity.
    let mut named = Peer::connect(&replay_addr, "DEALER", Some(b"router-1"), "ROUTER");
    let start = Instant::now();
    let all = loop {
        let all = replay(&mut dealer, 0);
        if all.len() == 3 {
            break all;
        }
        assert!(start.elapsed() < LIMIT, "the batches never reached the buffer: {all:?}");
        std::thread::sleep(POLL);
    };
    let seqs: Vec<i64> = all.iter().map(|(seq, _)| *seq).collect();
    assert_eq!(seqs, [0, 1, 2]);
    for (_, payload) in &all {
        assert_eq!(&payload[10..], CLEARED_TAIL);
    }
    let from_one: Vec<i64> = replay(&mut named, 1).into_iter().map(|(seq, _)| seq).collect();
    assert_eq!(from_one, [1, 2]);
    assert!(replay(&mut dealer, 3).is_empty(), "past the newest: only the end marker");
    assert_eq!(replay(&mut named, -5).len(), 3, "before the oldest: from the oldest");
    // Nothing was sent to the other one.
    let e = dealer.read_message(POLL).unwrap_err();
    assert!(matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{e}");
    // A malformed request is ignored; the peer stays and can ask properly.
    dealer.send(&message(&[b"", b"short"]));
    assert_eq!(replay(&mut dealer, 2).len(), 1);
}

#[test]
fn peers_that_never_finish_their_handshake_do_not_stop_others() {
    let (publisher, pub_addr, replay_addr) = publisher();
    // Silent, half a greeting, a greeting and no READY: on both sockets, held open.
    let mut stalled = Vec::new();
    for addr in [&pub_addr, &replay_addr] {
        for bytes in [&[][..], &greeting(1)[..5], &greeting(1)] {
            let mut s = connect(addr);
            s.write_all(bytes).unwrap();
            stalled.push(s);
        }
    }
    let mut subscriber = Peer::connect(&pub_addr, "SUB", None, "PUB");
    subscriber.send(&message(&[b"\x01kv"]));
    assert_cleared_batch(&published(&publisher, &mut subscriber));
    let mut dealer = Peer::connect(&replay_addr, "REQ", None, "ROUTER");
    assert!(!replay(&mut dealer, 0).is_empty());
    // The stalled ones got kiln's greeting and wait: not closed yet (the deadline is 10 s).
    for s in &mut stalled {
        s.set_read_timeout(Some(POLL)).unwrap();
        let mut g = [0u8; 64];
        s.read_exact(&mut g).unwrap();
        assert_eq!(g[0], 0xFF);
    }
}
