//! Prefill/decode disaggregation between servers on loopback: a prefill server answers with
//! vLLM's `kv_transfer_params`, a decode server fetches the KV and its greedy tokens and
//! log-probabilities equal a colocated server's bit for bit (completions and chat); pins are
//! released when fetched or when they expire; a decode server whose fetch fails (nothing
//! listening, a corrupted or truncated frame, a peer that dies mid-transfer, a wrong secret)
//! computes the prompt itself and stays healthy; a hostile client of the listener changes
//! nothing; requests a server cannot serve get a 400 naming `kv_transfer_params`.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{TestServer, default_config, post_ok};
use kiln_engine::{EngineConfig, KvCacheDtype};
use kiln_server::ServerConfig;
use kiln_server::kv_transfer::wire::{self, Message};
use kiln_server::kv_transfer::{KvRole, KvTransferConfig};
use serde_json::{Value, json};

const SECRET: &[u8] = b"pd-secret";
const PROMPT: &str = "The kiln fires the clay slowly, and the potter waits by the door while the \
                      glaze melts into glass over the long night";

fn transfer_config(role: KvRole, secret: &[u8], pin_timeout: Duration) -> ServerConfig {
    ServerConfig {
        kv_transfer: Some(KvTransferConfig {
            role,
            listen: "127.0.0.1:0".parse().unwrap(),
            advertise_host: None,
            secret: secret.to_vec(),
            pin_timeout,
        }),
        ..default_config()
    }
}

fn server(role: KvRole) -> TestServer {
    TestServer::start(transfer_config(role, SECRET, Duration::from_secs(60)))
}

fn completion(max_tokens: usize, params: Option<&Value>) -> Value {
    let mut body = json!({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true, "logprobs": 2});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    body
}

/// Step 1 of the handoff: the prefill server's answer's `kv_transfer_params`.
fn prefill(p: &TestServer, path: &str, body: &Value) -> Value {
    let mut body = body.clone();
    body["max_tokens"] = json!(1);
    body["kv_transfer_params"] = json!({"do_remote_decode": true});
    let params = post_ok(p, path, &body)["kv_transfer_params"].clone();
    assert_eq!(params["do_remote_prefill"], true, "{params}");
    params
}

fn metric(s: &TestServer, name: &str, direction: &str) -> f64 {
    s.metric(&format!("kiln:{name}{{model_name=\"tiny\",direction=\"{direction}\"}}"))
}

fn pinned_blocks(s: &TestServer) -> f64 {
    s.metric("kiln:kv_pinned_blocks")
}

#[test]
fn a_disaggregated_pair_answers_as_one_server() {
    let (p, d, colocated) = (server(KvRole::Prefill), server(KvRole::Decode), server(KvRole::Both));
    let params = prefill(&p, "/v1/completions", &completion(16, None));
    let blocks = params["remote_block_ids"].as_array().unwrap().len();
    assert!(blocks >= 4, "{params}");
    assert_eq!(params["remote_host"], "127.0.0.1");
    assert_eq!(params["tp_size"], 1);
    assert_eq!(pinned_blocks(&p), blocks as f64);
    let got = post_ok(&d, "/v1/completions", &completion(16, Some(&params)));
    let want = post_ok(&colocated, "/v1/completions", &completion(16, None));
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "bitwise");
    let cached = &got["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert_eq!(cached.as_u64(), Some(blocks as u64 * 4), "the fetched blocks were hit");
    assert_eq!(metric(&p, "kv_transfer_blocks_total", "sent"), blocks as f64);
    assert_eq!(metric(&d, "kv_transfer_blocks_total", "received"), blocks as f64);
    assert!(metric(&d, "kv_transfer_bytes_total", "received") > 0.0);
    p.wait_for("the pin released", |p| pinned_blocks(p) == 0.0);

    // Again: the decode server holds the prompt now and fetches nothing, but the new pin is
    // released all the same.
    let params = prefill(&p, "/v1/completions", &completion(16, None));
    let again = post_ok(&d, "/v1/completions", &completion(16, Some(&params)));
    assert_eq!(again["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    assert_eq!(metric(&d, "kv_transfer_blocks_total", "received"), blocks as f64);
    p.wait_for("the second pin released", |p| pinned_blocks(p) == 0.0);

    // Chat, through a server of role both on each side.
    let chat = json!({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
        "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2});
    let params = prefill(&colocated, "/v1/chat/completions", &chat);
    let mut decode_chat = chat.clone();
    decode_chat["kv_transfer_params"] = params;
    let both = server(KvRole::Both);
    let got = post_ok(&both, "/v1/chat/completions", &decode_chat);
    let want = post_ok(&d, "/v1/chat/completions", &chat);
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    colocated.wait_for("the chat pin released", |s| pinned_blocks(s) == 0.0);
}

/// A decode request whose prefill worker is `addr` with pin `params`'s, but `port` replaced.
fn pointed_at(params: &Value, port: u16) -> Value {
    let mut p = params.clone();
    p["remote_port"] = json!(port);
    p
}

/// Serves each connection to `listener` with `serve`, on a thread.
fn fake_prefill(serve: fn(TcpStream)) -> (u16, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let thread = std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            serve(stream);
        }
    });
    (port, thread)
}

fn frame(m: &Message) -> Vec<u8> {
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let mut out = Vec::new();
    rt.block_on(wire::write(&mut out, m)).unwrap();
    out
}

fn read_frame(stream: &mut TcpStream) -> Message {
    let mut head = [0u8; 4];
    stream.read_exact(&mut head).unwrap();
    let len = u32::from_le_bytes(head) as usize;
    let mut rest = vec![0u8; len + 5];
    stream.read_exact(&mut rest).unwrap();
    let mut all = head.to_vec();
    all.extend(rest);
    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
    rt.block_on(wire::read(&mut all.as_slice(), 1 << 24)).unwrap()
}

/// Set once `dies_mid_transfer` has sent its first block.
static SENT_A_BLOCK: AtomicBool = AtomicBool::new(false);
/// Set when `dies_mid_transfer` is asked to release its pin after the failed fetch.
static RELEASED_AFTER_FAILURE: AtomicBool = AtomicBool::new(false);
/// Set when `stalls` is asked to release its pin.
static RELEASED_AFTER_ABORT: AtomicBool = AtomicBool::new(false);

/// Handshakes as a prefill worker that knows the secret; returns the peer's first message
/// and the block size it announced.
fn fake_handshake(s: &mut TcpStream) -> (Message, usize) {
    let server_nonce = [7u8; 32];
    s.write_all(&frame(&Message::Challenge { version: wire::VERSION, nonce: server_nonce }))
        .unwrap();
    let Message::Hello(hello) = read_frame(s) else { panic!("no hello") };
    let mac = wire::server_mac(SECRET, &server_nonce, &hello.nonce);
    s.write_all(&frame(&Message::Welcome { mac })).unwrap();
    (read_frame(s), hello.geometry.block_bytes as usize)
}

/// Answers a fetch with one block and dies; counts a later release.
fn dies_mid_transfer(mut s: TcpStream) {
    let (message, block_bytes) = fake_handshake(&mut s);
    let fetch = match message {
        Message::Fetch(fetch) => fetch,
        Message::Release { .. } => return RELEASED_AFTER_FAILURE.store(true, Ordering::SeqCst),
        other => panic!("unexpected {other:?}"),
    };
    assert!(fetch.count > 1);
    let block = vec![0u8; block_bytes];
    s.write_all(&frame(&Message::Block { index: 0, data: block })).unwrap();
    SENT_A_BLOCK.store(true, Ordering::SeqCst);
    // Half of the next frame, then the connection drops.
    let next = frame(&Message::Block { index: 1, data: vec![0u8; 64] });
    s.write_all(&next[..next.len() / 2]).unwrap();
}

/// Takes a fetch and never answers it (on a thread of its own); counts a release.
fn stalls(mut s: TcpStream) {
    match fake_handshake(&mut s).0 {
        Message::Fetch(_) => {
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_secs(20));
                drop(s);
            });
        }
        Message::Release { .. } => RELEASED_AFTER_ABORT.store(true, Ordering::SeqCst),
        other => panic!("unexpected {other:?}"),
    }
}

/// A challenge whose checksum is wrong.
fn corrupted_challenge(mut s: TcpStream) {
    let mut bytes = frame(&Message::Challenge { version: wire::VERSION, nonce: [1; 32] });
    bytes[10] ^= 1;
    let _ = s.write_all(&bytes);
}

/// A frame declaring 4 GiB.
fn oversized_frame(mut s: TcpStream) {
    let _ = s.write_all(&[0xff, 0xff, 0xff, 0xff, 1]);
    std::thread::sleep(Duration::from_millis(200));
}

#[test]
fn a_failed_fetch_is_computed_locally() {
    let (p, d, colocated) = (server(KvRole::Prefill), server(KvRole::Decode), server(KvRole::Both));
    let want = post_ok(&colocated, "/v1/completions", &completion(10, None));
    let closed = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let fakes = [dies_mid_transfer as fn(TcpStream), corrupted_challenge, oversized_frame];
    let mut ports: Vec<u16> = fakes.iter().map(|&f| fake_prefill(f).0).collect();
    ports.push(closed);
    for (i, port) in ports.into_iter().enumerate() {
        let params = pointed_at(&prefill(&p, "/v1/completions", &completion(10, None)), port);
        let got = post_ok(&d, "/v1/completions", &completion(10, Some(&params)));
        assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "case {i}");
        assert_eq!(metric(&d, "kv_transfer_failures_total", "received"), (i + 1) as f64);
        assert_eq!(metric(&d, "kv_transfer_blocks_total", "received"), 0.0);
    }
    assert!(SENT_A_BLOCK.load(Ordering::SeqCst), "the fake prefill got as far as a block");
    d.wait_for("the failed fetch's pin released", |_| {
        RELEASED_AFTER_FAILURE.load(Ordering::SeqCst)
    });
    assert_eq!(d.get("/health").status, 200);
    // A decode server with another secret is refused by the real prefill worker, and computes.
    let stranger =
        TestServer::start(transfer_config(KvRole::Decode, b"other", Duration::from_secs(60)));
    let params = prefill(&p, "/v1/completions", &completion(10, None));
    let got = post_ok(&stranger, "/v1/completions", &completion(10, Some(&params)));
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    assert_eq!(metric(&stranger, "kv_transfer_failures_total", "received"), 1.0);
    p.wait_for("the refusal counted", |p| metric(p, "kv_transfer_failures_total", "sent") >= 1.0);
    // The pin it could not fetch is still held (with those the fakes took); the right decode
    // server, which computed this prompt above and fetches nothing, releases it.
    let held = pinned_blocks(&p);
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as f64;
    let got = post_ok(&d, "/v1/completions", &completion(10, Some(&params)));
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    p.wait_for("the pin released", |p| pinned_blocks(p) == held - blocks);
}

#[test]
fn params_claiming_more_blocks_than_the_prompt_has_fetch_only_the_prompts() {
    let (p, d, colocated) = (server(KvRole::Prefill), server(KvRole::Decode), server(KvRole::Both));
    let mut params = prefill(&p, "/v1/completions", &completion(6, None));
    let blocks = params["remote_block_ids"].as_array().unwrap().len();
    params["remote_block_ids"] = json!(vec![7; 200_000]);
    let got = post_ok(&d, "/v1/completions", &completion(6, Some(&params)));
    let want = post_ok(&colocated, "/v1/completions", &completion(6, None));
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    assert_eq!(metric(&d, "kv_transfer_blocks_total", "received"), blocks as f64);
    p.wait_for("the pin released", |p| pinned_blocks(p) == 0.0);
}

#[test]
fn a_request_aborted_during_its_fetch_releases_the_pin() {
    let (p, d) = (server(KvRole::Prefill), server(KvRole::Decode));
    let (port, _fake) = fake_prefill(stalls);
    let params = pointed_at(&prefill(&p, "/v1/completions", &completion(6, None)), port);
    let body = completion(6, Some(&params)).to_string();
    let mut client = TcpStream::connect(d.addr).unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    );
    client.write_all(head.as_bytes()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    drop(client); // the client gives up while the fetch waits
    d.wait_for("the abandoned fetch's pin released", |_| {
        RELEASED_AFTER_ABORT.load(Ordering::SeqCst)
    });
    assert_eq!(d.get("/health").status, 200);
}

#[test]
fn unfetched_pins_expire_and_hostile_clients_change_nothing() {
    let p = TestServer::start(transfer_config(KvRole::Prefill, SECRET, Duration::from_millis(300)));
    prefill(&p, "/v1/completions", &completion(8, None));
    assert!(pinned_blocks(&p) > 0.0);
    p.wait_for("the pin to expire", |p| pinned_blocks(p) == 0.0);
    assert_eq!(p.metric("kiln:kv_pins_expired_total"), 1.0);

    let loaded = p.state.ready().unwrap();
    let port = loaded.kv_transfer.as_ref().unwrap().listen_port().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let hostile: [&[u8]; 4] =
        [b"GET / HTTP/1.1\r\n\r\n", &[0xff, 0xff, 0xff, 0x7f, 2], &[40, 0, 0, 0, 2, 1, 2, 3], &[]];
    for bytes in hostile {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let Message::Challenge { .. } = read_frame(&mut s) else { panic!("no challenge") };
        // The server may close before all of it is written or the write side is shut.
        let _ = s.write_all(bytes);
        let _ = s.shutdown(std::net::Shutdown::Write);
        // The server closes the connection (a refusal frame first, or nothing), never waits
        // for more.
        let mut rest = Vec::new();
        if let Err(e) = s.read_to_end(&mut rest) {
            assert!(!matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut), "{e}");
        }
    }
    assert_eq!(p.get("/health").status, 200);
    // Still serving: a real pair works after the hostile clients.
    let d = server(KvRole::Decode);
    let p2 = server(KvRole::Prefill);
    let params = prefill(&p2, "/v1/completions", &completion(8, None));
    post_ok(&d, "/v1/completions", &completion(8, Some(&params)));
    assert!(metric(&d, "kv_transfer_blocks_total", "received") > 0.0);
}

/// The listener's refusal of `hello` (after its challenge, whose nonce `hello` gets).
fn refusal(addr: SocketAddr, mut hello: wire::Hello, secret: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let Message::Challenge { nonce, .. } = read_frame(&mut s) else { panic!("no challenge") };
    hello.mac = wire::client_mac(secret, &nonce, &hello.nonce);
    s.write_all(&frame(&Message::Hello(hello))).unwrap();
    match read_frame(&mut s) {
        Message::Refused(why) => why,
        other => panic!("not refused: {other:?}"),
    }
}

#[test]
fn handshakes_are_refused_by_name() {
    let p = server(KvRole::Prefill);
    let loaded = p.state.ready().unwrap();
    let transfer = loaded.kv_transfer.as_ref().unwrap();
    let addr: SocketAddr =
        format!("127.0.0.1:{}", transfer.listen_port().unwrap()).parse().unwrap();
    let good = wire::Hello {
        version: wire::VERSION,
        nonce: [9; 32],
        mac: [0; 32],
        geometry: transfer.geometry().clone(),
        engine_id: transfer.engine_id().to_owned(),
    };
    let with = |f: &dyn Fn(&mut wire::Hello)| {
        let mut h = good.clone();
        f(&mut h);
        h
    };
    let cases: [(wire::Hello, &[u8], &str); 5] = [
        (with(&|h| h.version = 9), SECRET, "protocol version 9, this server speaks 1"),
        (good.clone(), b"not-the-secret", "authentication failed"),
        (
            with(&|h| h.geometry.dtype = "int8".into()),
            SECRET,
            "KV cache dtype int8, this server has f16",
        ),
        (with(&|h| h.geometry.block_size = 16), SECRET, "block size 16, this server has 4"),
        (with(&|h| h.engine_id = "kiln-old".into()), SECRET, "engine id \"kiln-old\""),
    ];
    for (hello, secret, needle) in cases {
        let why = refusal(addr, hello, secret);
        assert!(why.contains(needle), "{needle}: {why}");
    }
    // End to end: a decode worker with 8-bit KV against this f16 prefill worker is refused at
    // the handshake, and computes the prompt itself.
    let int8 = EngineConfig { kv_cache_dtype: KvCacheDtype::Int8, ..common::engine_config() };
    let config = transfer_config(KvRole::Decode, SECRET, Duration::from_secs(60));
    let d = TestServer::start_with(config, int8);
    let params = prefill(&p, "/v1/completions", &completion(6, None));
    post_ok(&d, "/v1/completions", &completion(6, Some(&params)));
    assert_eq!(metric(&d, "kv_transfer_failures_total", "received"), 1.0);
    assert_eq!(metric(&d, "kv_transfer_blocks_total", "received"), 0.0);
    p.wait_for("the refusals counted", |p| metric(p, "kv_transfer_failures_total", "sent") >= 6.0);
}

#[test]
fn requests_a_server_cannot_serve_get_a_400() {
    let plain = TestServer::start(default_config());
    let (p, d) = (server(KvRole::Prefill), server(KvRole::Decode));
    let export = json!({"do_remote_decode": true});
    let remote = json!({"do_remote_prefill": true, "remote_engine_id": "kiln-x",
        "remote_host": "127.0.0.1", "remote_port": 1, "remote_block_ids": [1],
        "remote_request_id": "kiln-pin-1"});
    let cases = [
        (
            &plain,
            json!({"prompt": "a", "max_tokens": 1, "kv_transfer_params": export}),
            "--kv-role",
        ),
        (
            &d,
            json!({"prompt": "a", "max_tokens": 1, "kv_transfer_params": export}),
            "prefill or both",
        ),
        (
            &p,
            json!({"prompt": "a", "max_tokens": 1, "kv_transfer_params": remote}),
            "decode or both",
        ),
        (&p, json!({"prompt": "a", "n": 2, "kv_transfer_params": export}), "one prompt"),
        (&p, json!({"prompt": ["a", "b"], "kv_transfer_params": export}), "one prompt"),
        (&p, json!({"prompt": "a", "stream": true, "kv_transfer_params": export}), "stream"),
        (&p, json!({"prompt": "a", "kv_transfer_params": {"do_remote_decode": 1}}), "boolean"),
    ];
    for (server, body, needle) in cases {
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        let err = r.json();
        assert_eq!(err["error"]["param"], "kv_transfer_params", "{err}");
        assert!(err["error"]["message"].as_str().unwrap().contains(needle), "{needle}: {err}");
    }
    // Neutral params (vLLM's proxy sends them on plain requests) ask for nothing.
    let neutral = json!({"do_remote_decode": false, "do_remote_prefill": false,
        "remote_engine_id": null, "remote_host": null, "remote_port": null,
        "remote_block_ids": null});
    post_ok(
        &plain,
        "/v1/completions",
        &json!({"prompt": "a", "max_tokens": 1,
        "kv_transfer_params": neutral}),
    );
}
