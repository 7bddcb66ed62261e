//! kiln replicas behind vLLM's router (`vllm-router` 0.1.17 from PyPI, installed once into a
//! virtual environment under the target directory), on loopback:
//! - every policy users pick (`round_robin`, `power_of_two`, `cache_aware`) serves completions,
//!   chat and streams through the router with the replicas' own greedy outputs, and
//!   `cache_aware` gets its prompt ids from kiln's render route (no 404 fallbacks);
//! - faults, on three replicas of the default model: one killed with SIGKILL under load is
//!   ejected and every request sent after the kill succeeds; one drained with SIGTERM finishes
//!   its streams; one that comes back on its port is used again. Every wait is bounded.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Server, free_port, start_kiln_serve_on, tiny_replica_with, wait_for};

/// The router release the tests are written against.
const VLLM_ROUTER: &str = "vllm-router==0.1.17";

/// The `vllm-router` launcher, installed into a venv under the target directory on first use.
fn vllm_router() -> PathBuf {
    common::venv_with("vllm-router-venv", &[VLLM_ROUTER]).join("bin/vllm-router")
}

/// A router process, killed when dropped.
struct Router {
    child: Child,
    addr: String,
}

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts the router over `workers` with `policy`, health-checking every second (one failure
/// ejects, one success restores), and waits until a completion goes through it.
fn start_router(workers: &[String], policy: &str, model: &str) -> Router {
    let port = free_port();
    let mut cmd = Command::new(vllm_router());
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", policy]);
    cmd.arg("--worker-urls").args(workers);
    cmd.args(["--worker-startup-check-interval", "1", "--health-check-interval-secs", "1"]);
    cmd.args(["--health-check-timeout-secs", "1", "--health-failure-threshold", "1"]);
    // Its own metrics exporter binds 29000 unless told otherwise: one per test router.
    cmd.args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port().to_string()]);
    cmd.args(["--health-success-threshold", "1", "--log-level", "warning"]);
    let child = cmd.stdout(Stdio::null()).spawn().unwrap();
    let router = Router { child, addr: format!("127.0.0.1:{port}") };
    let body = format!(r#"{{"model": "{model}", "prompt": "warm", "max_tokens": 1}}"#);
    wait_for(Duration::from_secs(120), "the router to serve", || {
        post(&router.addr, "/v1/completions", &body).0 == 200
    });
    router
}

/// A POST as HTTP/1.0 (answered unchunked, streams included), with the replicas' API key;
/// status 0 when the connection fails.
fn post(addr: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let request = format!(
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\nAuthorization: Bearer test-key\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut out = Vec::new();
    if s.write_all(request.as_bytes()).is_err() || s.read_to_end(&mut out).is_err() {
        return (0, String::new());
    }
    let out = String::from_utf8_lossy(&out).into_owned();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned())
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// Requests a replica answered on `handler`, from its `http_requests_total` (0 if none yet).
fn handled(addr: &str, handler: &str) -> f64 {
    let (_, text) = common::http(addr, "GET", "/metrics", "");
    let label = format!("handler=\"{handler}\"");
    text.lines()
        .filter(|l| l.starts_with("http_requests_total{") && l.contains(&label))
        .filter_map(|l| l.rsplit(' ').next()?.trim().parse::<f64>().ok())
        .sum()
}

/// The generated text of a stream's `data:` events, and whether it ended with `[DONE]`.
fn stream_text(body: &str, field: &str) -> (String, bool) {
    let mut text = String::new();
    let mut done = false;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data.trim() == "[DONE]" {
            done = true;
            continue;
        }
        let v = json(data);
        if let Some(t) = v["choices"][0].pointer(field).and_then(|t| t.as_str()) {
            text.push_str(t);
        }
    }
    (text, done)
}

fn tiny_replica() -> (Server, String) {
    tiny_replica_with(&[])
}

#[test]
fn every_policy_of_vllms_router_serves_through_kiln_replicas() {
    let (a, a_addr) = tiny_replica();
    let (b, b_addr) = tiny_replica();
    let workers = [format!("http://{a_addr}"), format!("http://{b_addr}")];
    let prompts: Vec<String> = (0..8).map(|i| format!("request {i} says hello")).collect();
    let completion = |p: &str| {
        format!(r#"{{"model": "tiny", "prompt": "{p}", "max_tokens": 8, "temperature": 0}}"#)
    };
    let chat = r#"{"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 8, "temperature": 0}"#;
    let direct: Vec<String> = prompts
        .iter()
        .map(|p| {
            json(&post(&a_addr, "/v1/completions", &completion(p)).1)["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let direct_chat = json(&post(&a_addr, "/v1/chat/completions", chat).1);
    let direct_chat = direct_chat["choices"][0]["message"]["content"].as_str().unwrap().to_owned();

    for policy in ["round_robin", "power_of_two", "cache_aware"] {
        let before = [&a_addr, &b_addr].map(|r| handled(r, "/v1/completions"));
        let router = start_router(&workers, policy, "tiny");
        for (p, want) in prompts.iter().zip(&direct) {
            let (status, body) = post(&router.addr, "/v1/completions", &completion(p));
            assert_eq!(status, 200, "{policy}: {body}");
            assert_eq!(json(&body)["choices"][0]["text"], want.as_str(), "{policy}");
        }
        let (status, body) = post(&router.addr, "/v1/chat/completions", chat);
        assert_eq!(status, 200, "{policy}: {body}");
        let content = &json(&body)["choices"][0]["message"]["content"];
        assert_eq!(content, direct_chat.as_str(), "{policy}");
        let streamed =
            completion(&prompts[0]).replace("\"max_tokens\"", "\"stream\": true, \"max_tokens\"");
        let (status, body) = post(&router.addr, "/v1/completions", &streamed);
        assert_eq!(status, 200, "{policy}: {body}");
        assert_eq!(stream_text(&body, "/text"), (direct[0].clone(), true), "{policy}");
        let served = [&a_addr, &b_addr].map(|r| handled(r, "/v1/completions"));
        let total: f64 = served.iter().zip(before).map(|(s, b)| s - b).sum();
        assert!(total >= 10.0, "{policy}: the replicas saw {total} completions");
        if policy == "round_robin" {
            for (s, b) in served.iter().zip(before) {
                assert!(s - b >= 4.0, "round_robin left a replica idle: {served:?} {before:?}");
            }
        }
        drop(router);
    }
    // cache_aware asked each replica for prompt ids through the render routes, never falling
    // back to /tokenize after a 404.
    for r in [&a_addr, &b_addr] {
        assert!(handled(r, "/v1/completions/render") >= 9.0, "{r} rendered too few");
        assert!(handled(r, "/v1/chat/completions/render") >= 1.0);
        assert_eq!(handled(r, "/tokenize"), 0.0, "{r}: the router fell back to /tokenize");
    }
    drop((a, b));
}

fn gemma_replica(port: u16) -> (Server, String) {
    let args = ["gemma-3-270m", "--served-model-name", "gemma", "--max-model-len", "512"];
    let more = ["--threads", "1", "--shutdown-timeout", "60"];
    let all: Vec<&str> = args.iter().chain(&more).copied().collect();
    let (server, url) = start_kiln_serve_on(port, &all);
    (server, url.trim_start_matches("http://").to_owned())
}

const GEMMA_REQUEST: &str =
    r#"{"model": "gemma", "prompt": "The river", "max_tokens": 12, "temperature": 0}"#;

/// Sends `n` requests through the router from `n` threads at once; their statuses.
fn burst(router: &str, n: usize, body: &'static str) -> Vec<std::thread::JoinHandle<u16>> {
    (0..n)
        .map(|_| {
            let router = router.to_owned();
            std::thread::spawn(move || post(&router, "/v1/completions", body).0)
        })
        .collect()
}

#[test]
fn replicas_killed_drained_and_restored_behind_the_router() {
    let ports = [free_port(), free_port(), free_port()];
    let (a, a_addr) = gemma_replica(ports[0]);
    let (b, b_addr) = gemma_replica(ports[1]);
    let (c, c_addr) = gemma_replica(ports[2]);
    let workers: Vec<String> = [&a_addr, &b_addr, &c_addr].map(|r| format!("http://{r}")).into();
    let router = start_router(&workers, "round_robin", "gemma");

    // SIGKILL under load: requests in flight on C may fail; every one sent after it succeeds.
    let in_flight = burst(&router.addr, 6, GEMMA_REQUEST);
    std::thread::sleep(Duration::from_millis(300));
    drop(c);
    let after = burst(&router.addr, 9, GEMMA_REQUEST);
    let in_flight: Vec<u16> = in_flight.into_iter().map(|h| h.join().unwrap()).collect();
    let after: Vec<u16> = after.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(after.iter().all(|&s| s == 200), "requests after the kill: {after:?}");
    assert!(in_flight.iter().filter(|&&s| s == 200).count() >= 4, "{in_flight:?}");
    // Ejected: the next requests all succeed and the live replicas share them.
    let before = [&a_addr, &b_addr].map(|r| handled(r, "/v1/completions"));
    let statuses: Vec<u16> =
        burst(&router.addr, 6, GEMMA_REQUEST).into_iter().map(|h| h.join().unwrap()).collect();
    assert!(statuses.iter().all(|&s| s == 200), "after ejection: {statuses:?}");
    let after = [&a_addr, &b_addr].map(|r| handled(r, "/v1/completions"));
    assert_eq!(after[0] + after[1] - before[0] - before[1], 6.0);

    // SIGTERM mid-stream: four streams through the router, two of them on B; B finishes its
    // streams before it exits.
    let stream = r#"{"model": "gemma", "prompt": "Once upon a time", "max_tokens": 48,
                     "temperature": 0, "ignore_eos": true, "stream": true}"#;
    let streams: Vec<_> = (0..4)
        .map(|_| {
            let router = router.addr.clone();
            std::thread::spawn(move || post(&router, "/v1/completions", stream))
        })
        .collect();
    wait_for(Duration::from_secs(60), "streams on B", || {
        common::metric(&b_addr, "kiln:num_requests_running") >= 1.0
    });
    b.send_term();
    for s in streams {
        let (status, body) = s.join().unwrap();
        assert_eq!(status, 200);
        let (text, done) = stream_text(&body, "/text");
        assert!(done && !text.is_empty(), "a drained stream was cut: {body}");
    }
    assert!(b.wait().success(), "B did not exit cleanly after draining");
    let statuses: Vec<u16> =
        burst(&router.addr, 4, GEMMA_REQUEST).into_iter().map(|h| h.join().unwrap()).collect();
    assert!(statuses.iter().all(|&s| s == 200), "with B drained: {statuses:?}");

    // C comes back on its port: the router checks it healthy and routes to it again.
    let (c, c_addr2) = gemma_replica(ports[2]);
    assert_eq!(c_addr2, c_addr);
    wait_for(Duration::from_secs(60), "the restored replica to get requests", || {
        let statuses: Vec<u16> =
            burst(&router.addr, 2, GEMMA_REQUEST).into_iter().map(|h| h.join().unwrap()).collect();
        assert!(statuses.iter().all(|&s| s == 200), "with C back: {statuses:?}");
        handled(&c_addr, "/v1/completions") > 0.0
    });
    drop((router, a, c));
}

/// A tiny replica that publishes its KV cache events on a free loopback port (with replay).
fn tiny_replica_with_events() -> (Server, String) {
    let events = r#"{"enable_kv_cache_events": true, "publisher": "zmq",
                     "endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}"#;
    tiny_replica_with(&["--kv-events-config", events])
}

#[test]
fn kv_aware_routing_follows_the_published_kv_events() {
    let (a, a_addr) = tiny_replica_with_events();
    let (b, b_addr) = tiny_replica_with_events();
    // What the router reads to subscribe.
    let (status, info) = common::http(&a_addr, "GET", "/get_server_info", "");
    assert_eq!(status, 200);
    assert_eq!(json(&info)["kv_block_size"], 16);
    let (status, sources) = common::http(&a_addr, "GET", "/kv_event_sources", "");
    assert_eq!(status, 200, "{sources}");
    let endpoint = json(&sources)["0"]["endpoint"].as_str().unwrap().to_owned();
    assert!(endpoint.starts_with("tcp://127.0.0.1:"), "{endpoint}");

    let workers = [format!("http://{a_addr}"), format!("http://{b_addr}")];
    let router = start_router(&workers, "kv_aware", "tiny");
    // Two long prompts, each computed once on one replica only, directly: the router learns
    // where they are from the replicas' events alone.
    let prompt = |topic: &str| {
        format!("{topic} {}", "the story goes on and on about this very topic ".repeat(6))
    };
    let body = |p: &str, suffix: &str| {
        format!(r#"{{"model": "tiny", "prompt": "{p}{suffix}", "max_tokens": 2}}"#)
    };
    let (on_a, on_b) = (prompt("rivers"), prompt("mountains"));
    assert_eq!(post(&a_addr, "/v1/completions", &body(&on_a, "")).0, 200);
    assert_eq!(post(&b_addr, "/v1/completions", &body(&on_b, "")).0, 200);
    std::thread::sleep(Duration::from_secs(1));
    // Each request goes to the replica holding its prefix (by chance: 1 in 256).
    for i in 0..4 {
        for (p, holder) in [(&on_a, &a_addr), (&on_b, &b_addr)] {
            let before = handled(holder, "/v1/completions");
            let (status, text) = post(&router.addr, "/v1/completions", &body(p, &format!(" {i}")));
            assert_eq!(status, 200, "{text}");
            assert_eq!(handled(holder, "/v1/completions"), before + 1.0, "request {i} misplaced");
        }
    }
    drop((router, a, b));
}
