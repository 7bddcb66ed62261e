//! Prefill/decode disaggregation orchestrated by vLLM's router (`vllm-router` 0.1.17,
//! `--vllm-pd-disaggregation`, the NIXL connector's `kv_transfer_params`) over a kiln prefill
//! worker and a kiln decode worker, on loopback: completions, chat and streams through the
//! router give a colocated replica's greedy text, the decode worker fetched the KV over kiln's
//! transfer protocol (authenticated by the shared API key), and the prefill worker's pins are
//! all released. Every wait is bounded.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{free_port, http, metric, metric_where, tiny_replica_with, wait_for};

/// The router release the test is written against (as `router.rs`).
const VLLM_ROUTER: &str = "vllm-router==0.1.17";

struct Router(Child);

impl Drop for Router {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

/// The text of a stream's `data:` events.
fn stream_text(body: &str) -> String {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| d.trim() != "[DONE]")
        .filter_map(|d| json(d)["choices"][0]["text"].as_str().map(str::to_owned))
        .collect()
}

#[test]
fn vllms_router_orchestrates_a_kiln_prefill_and_decode_pair() {
    let (_p, p_addr) = tiny_replica_with(&["--kv-role", "prefill", "--kv-transfer-port", "0"]);
    let (_d, d_addr) = tiny_replica_with(&["--kv-role", "decode"]);
    let (_c, c_addr) = tiny_replica_with(&[]);
    let venv = common::venv_with("vllm-router-venv", &[VLLM_ROUTER]);
    let port = free_port();
    let child = Command::new(venv.join("bin/vllm-router"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--policy", "round_robin"])
        .args(["--vllm-pd-disaggregation", "--prefill", &format!("http://{p_addr}")])
        .args(["--decode", &format!("http://{d_addr}")])
        .args(["--prometheus-host", "127.0.0.1", "--prometheus-port", &free_port().to_string()])
        .args(["--log-level", "warning"])
        // The router's bearer token for both stages: the replicas' API key.
        .env("OPENAI_API_KEY", "test-key")
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let _router = Router(child);
    let router = format!("127.0.0.1:{port}");
    let completion = |prompt: &str, stream: bool| {
        serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": 12,
            "temperature": 0, "ignore_eos": true, "stream": stream})
        .to_string()
    };
    let warm = completion("warm up the router", false);
    wait_for(Duration::from_secs(120), "the router to serve", || {
        std::net::TcpStream::connect(&router).is_ok()
            && http(&router, "POST", "/v1/completions", &warm).0 == 200
    });
    let prompts = [
        "The kiln fires the clay slowly, and the potter waits by the door while the glaze melts",
        "A second prompt about glaze, ash and the long night of a wood-fired kiln in the hills",
    ];
    for prompt in prompts {
        let (status, got) = http(&router, "POST", "/v1/completions", &completion(prompt, false));
        assert_eq!(status, 200, "{got}");
        let (_, want) = http(&c_addr, "POST", "/v1/completions", &completion(prompt, false));
        assert_eq!(json(&got)["choices"][0]["text"], json(&want)["choices"][0]["text"]);
        let (status, got) = http(&router, "POST", "/v1/completions", &completion(prompt, true));
        assert_eq!(status, 200, "{got}");
        assert_eq!(stream_text(&got), json(&want)["choices"][0]["text"].as_str().unwrap());
    }
    let chat = serde_json::json!({"model": "tiny", "max_tokens": 10, "temperature": 0,
        "ignore_eos": true, "messages": [{"role": "user", "content": prompts[0]}]})
    .to_string();
    let (status, got) = http(&router, "POST", "/v1/chat/completions", &chat);
    assert_eq!(status, 200, "{got}");
    let (_, want) = http(&c_addr, "POST", "/v1/chat/completions", &chat);
    assert_eq!(json(&got)["choices"][0]["message"], json(&want)["choices"][0]["message"]);

    let received = metric_where(&d_addr, "kiln:kv_transfer_blocks_total", "received");
    assert!(received > 0.0, "the decode worker fetched KV");
    assert_eq!(metric_where(&d_addr, "kiln:kv_transfer_failures_total", "received"), 0.0);
    assert_eq!(metric_where(&p_addr, "kiln:kv_transfer_blocks_total", "sent"), received);
    wait_for(Duration::from_secs(10), "every pin released", || {
        metric(&p_addr, "kiln:kv_pinned_blocks") == 0.0
    });
}
