//! Prefill/decode disaggregation across hosts: the prefill worker runs in a network namespace
//! this test creates, reached over a veth pair with added latency (`tc netem`, where the
//! kernel has it) and, for the kill, a rate limit; the decode worker and a colocated replica run
//! here. On the default model, the decode worker's greedy tokens and log-probabilities equal
//! the colocated replica's bit for bit; with the prefill worker killed mid-transfer, the decode
//! worker computes the prompt itself (the same tokens), stays healthy, and holds no blocks
//! after. Where network namespaces cannot be made (no privileges), the test says so and
//! passes without running.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{http, metric, metric_where, start_kiln_serve_on, start_kiln_serve_via};

/// A network namespace with one end of a veth pair (10.77.N.1) whose other end is here
/// (10.77.N.2); deleted (with the pair) when dropped.
struct Netns {
    name: String,
    outside: String,
    inside: String,
    inside_ip: String,
}

fn ip(args: &[&str]) -> bool {
    Command::new("ip").args(args).status().is_ok_and(|s| s.success())
}

fn tc(args: &[&str]) -> bool {
    Command::new("tc").args(args).output().is_ok_and(|o| o.status.success())
}

impl Netns {
    /// `None` where namespaces or veth pairs cannot be made here.
    fn create() -> Option<Self> {
        let id = std::process::id();
        let subnet = id % 250 + 1;
        let ns = Self {
            name: format!("kiln-pd-{id}"),
            outside: format!("kpd{id}a"),
            inside: format!("kpd{id}b"),
            inside_ip: format!("10.77.{subnet}.1"),
        };
        let inside = ns.inside.clone();
        if !ip(&["netns", "add", &ns.name]) {
            return None;
        }
        let ok = ip(&["link", "add", &ns.outside, "type", "veth", "peer", "name", &inside])
            && ip(&["link", "set", &inside, "netns", &ns.name])
            && ip(&["addr", "add", &format!("10.77.{subnet}.2/24"), "dev", &ns.outside])
            && ip(&["link", "set", &ns.outside, "up"])
            && ns.exec_ok(&["ip", "addr", "add", &format!("{}/24", ns.inside_ip), "dev", &inside])
            && ns.exec_ok(&["ip", "link", "set", &inside, "up"])
            && ns.exec_ok(&["ip", "link", "set", "lo", "up"]);
        ok.then_some(ns)
    }

    fn exec_ok(&self, args: &[&str]) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .status()
            .is_ok_and(|s| s.success())
    }

    /// Delays both directions of the pair by `delay` (`tc netem`); `false` where the kernel
    /// has no `netem`.
    fn delay(&self, delay: &str) -> bool {
        let netem = |dev| ["qdisc", "replace", "dev", dev, "root", "netem", "delay", delay];
        tc(&netem(&self.outside)) && self.exec_ok(&[&["tc"][..], &netem(&self.inside)].concat())
    }

    /// Limits what leaves the namespace (the prefill worker's blocks) to `rate` with a token
    /// bucket (`tc tbf`, which kernels without `netem` have); `false` where it cannot.
    fn limit_rate(&self, rate: &str) -> bool {
        let dev = self.inside.as_str();
        self.exec_ok(&[
            "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "4kb",
            "latency", "10s",
        ])
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        ip(&["link", "del", &self.outside]);
        ip(&["netns", "del", &self.name]);
    }
}

fn completion(prompt: &str, max_tokens: usize, params: Option<&serde_json::Value>) -> String {
    let mut body = serde_json::json!({"prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": true, "logprobs": 2});
    if let Some(p) = params {
        body["kv_transfer_params"] = p.clone();
    }
    body.to_string()
}

fn json(body: &str) -> serde_json::Value {
    serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("not JSON ({e}): {body}"))
}

fn ok(addr: &str, body: &str) -> serde_json::Value {
    let (status, text) = http(addr, "POST", "/v1/completions", body);
    assert_eq!(status, 200, "{text}");
    json(&text)
}

const PROMPT: &str = "The potter loads the kiln at dusk: bowls on the lower shelf, cups above, \
                      the big jars at the back where the fire is hottest. Through the night she \
                      feeds the firebox and watches the cones bend, one after another, until \
                      the glaze has melted into glass and the kiln can cool until morning.";

#[test]
fn a_prefill_worker_in_another_namespace_hands_over_the_default_models_kv() {
    let Some(ns) = Netns::create() else {
        eprintln!("skipped: network namespaces cannot be created here (needs CAP_NET_ADMIN)");
        return;
    };
    if !ns.delay("5ms") {
        eprintln!("tc netem is unavailable: the veth pair runs without added latency");
    }
    let prefix = ["ip", "netns", "exec", ns.name.as_str()];
    let inside: Vec<&str> = vec!["--host", &ns.inside_ip, "--kv-role", "prefill"];
    let prefill_args =
        [inside.as_slice(), &["--kv-transfer-host", &ns.inside_ip, "--threads", "1"]].concat();
    let (prefill, p_url) = start_kiln_serve_via(&prefix, 0, &prefill_args);
    let p_addr = p_url.trim_start_matches("http://").to_owned();
    let (_decode, d_url) = start_kiln_serve_on(0, &["--kv-role", "decode", "--threads", "1"]);
    let d_addr = d_url.trim_start_matches("http://").to_owned();
    let (_colocated, c_url) = start_kiln_serve_on(0, &["--threads", "1"]);
    let c_addr = c_url.trim_start_matches("http://").to_owned();

    // 1. Bitwise equal to the colocated replica, the KV crossing the veth pair.
    let export = serde_json::json!({"do_remote_decode": true});
    let params = ok(&p_addr, &completion(PROMPT, 1, Some(&export)))["kv_transfer_params"].clone();
    assert_eq!(params["remote_host"], ns.inside_ip.as_str(), "{params}");
    let blocks = params["remote_block_ids"].as_array().unwrap().len();
    assert!(blocks >= 3, "{params}");
    let got = ok(&d_addr, &completion(PROMPT, 16, Some(&params)));
    let want = ok(&c_addr, &completion(PROMPT, 16, None));
    assert_eq!(got["choices"][0]["text"], want["choices"][0]["text"]);
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "bitwise");
    assert_eq!(metric_where(&d_addr, "kiln:kv_transfer_blocks_total", "received"), blocks as f64);

    // 2. The prefill worker killed while its blocks cross a slow link: the decode worker
    // computes the prompt itself and stays healthy, holding no blocks once it answered.
    let second = format!("{PROMPT} The next morning she opens the door.");
    let params = ok(&p_addr, &completion(&second, 1, Some(&export)))["kv_transfer_params"].clone();
    let limited = ns.limit_rate("400kbit");
    if !limited {
        eprintln!("tc tbf is unavailable: the kill may come before the blocks start to move");
    }
    let decode = {
        let (addr, body) = (d_addr.clone(), completion(&second, 8, Some(&params)));
        std::thread::spawn(move || ok(&addr, &body))
    };
    // A second into a transfer of about 30 s (the prompt's blocks at 400 kbit/s).
    std::thread::sleep(Duration::from_millis(if limited { 1000 } else { 0 }));
    prefill.kill();
    let got = decode.join().unwrap();
    let want = ok(&c_addr, &completion(&second, 8, None));
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
    assert_eq!(metric_where(&d_addr, "kiln:kv_transfer_failures_total", "received"), 1.0);
    assert_eq!(metric_where(&d_addr, "kiln:kv_transfer_blocks_total", "received"), blocks as f64);
    let start = Instant::now();
    while metric(&d_addr, "kiln:kv_cache_usage_perc") != 0.0 {
        assert!(start.elapsed() < Duration::from_secs(10), "the decode worker holds blocks");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(common::health(&d_addr), Some(200));
}
