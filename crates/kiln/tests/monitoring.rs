//! The monitoring kit under `deploy/monitoring` checked with the real tools against live
//! servers: promtool's rule checks and unit tests (`kiln-alerts.test.yml`); every metric the
//! Grafana dashboard and the alert rules query is exported by a running `kiln serve`; and a real
//! Prometheus (Debian's package, unpacked under the target directory) scrapes two live replicas
//! on loopback and fires the replica-down alert for one killed with SIGKILL and the latency alert
//! for a replica whose requests take longer than the rule's threshold.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{debian_package, free_port, http, repo, start_kiln_serve, start_server, wait_for};

fn monitoring() -> PathBuf {
    repo().join("deploy/monitoring")
}

fn prometheus_bin(name: &str) -> PathBuf {
    debian_package("prometheus").join("usr/bin").join(name)
}

#[test]
fn alert_rules_pass_promtool_check_and_unit_tests() {
    let promtool = prometheus_bin("promtool");
    for args in [["check", "rules", "kiln-alerts.yml"], ["test", "rules", "kiln-alerts.test.yml"]] {
        let status = Command::new(&promtool).args(args).current_dir(monitoring()).status().unwrap();
        assert!(status.success(), "promtool {args:?} failed (see the output above)");
    }
}

/// The `expr` strings anywhere in a JSON or YAML document, with Grafana's template queries.
fn exprs_json(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "definition", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => exprs_json(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs_json(v, out)),
        _ => {}
    }
}

fn exprs_yaml(v: &serde_norway::Value, out: &mut Vec<String>) {
    match v {
        serde_norway::Value::Mapping(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    (Some("expr"), serde_norway::Value::String(s)) => out.push(s.clone()),
                    _ => exprs_yaml(v, out),
                }
            }
        }
        serde_norway::Value::Sequence(a) => a.iter().for_each(|v| exprs_yaml(v, out)),
        _ => {}
    }
}

/// The kiln metric names a PromQL expression reads (`kiln:*`, `process_*`,
/// `http_requests_total`); recording rules' `job:*` names and `up` are Prometheus' own.
fn metric_names(expr: &str) -> BTreeSet<String> {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| {
            t.starts_with("kiln:") || t.starts_with("process_") || *t == "http_requests_total"
        })
        .map(str::to_owned)
        .collect()
}

fn queried_names() -> (BTreeSet<String>, BTreeSet<String>) {
    let dashboard = std::fs::read_to_string(monitoring().join("grafana/kiln-dashboard.json"));
    let dashboard: serde_json::Value = serde_json::from_str(&dashboard.unwrap()).unwrap();
    let rules = std::fs::read_to_string(monitoring().join("kiln-alerts.yml")).unwrap();
    let rules: serde_norway::Value = serde_norway::from_str(&rules).unwrap();
    let (mut d, mut r) = (Vec::new(), Vec::new());
    exprs_json(&dashboard, &mut d);
    exprs_yaml(&rules, &mut r);
    let names = |e: Vec<String>| e.iter().flat_map(|e| metric_names(e)).collect();
    (names(d), names(r))
}

#[test]
fn every_metric_the_dashboard_and_alerts_query_is_exported_by_a_live_server() {
    let (dashboard, rules) = queried_names();
    // The walk must find the queries: the dashboard reads ~25 series, the rules 11.
    assert!(dashboard.len() >= 25, "dashboard names only {dashboard:?}");
    assert!(rules.len() >= 11, "rules name only {rules:?}");
    let (server, url) = start_server();
    let addr = url.trim_start_matches("http://");
    let body = r#"{"model": "tiny", "prompt": "hello", "max_tokens": 4}"#;
    assert_eq!(http(addr, "POST", "/v1/completions", body).0, 200);
    let (status, text) = http(addr, "GET", "/metrics", "");
    drop(server);
    assert_eq!(status, 200);
    let exported = |name: &str| {
        text.lines().any(|l| {
            l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
    };
    let missing: Vec<_> = dashboard.union(&rules).filter(|n| !exported(n)).collect();
    assert!(missing.is_empty(), "queried but not exported: {missing:?}");
}

/// A child process killed when dropped.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The alert rules with every `for:` hold cut to 0 s: the same expressions, firing at the first
/// evaluation that breaks them (a test cannot wait the rules' minutes).
fn rules_without_holds() -> String {
    let rules = std::fs::read_to_string(monitoring().join("kiln-alerts.yml")).unwrap();
    let mut out = String::new();
    for line in rules.lines() {
        match line.split_once("for: ") {
            Some((indent, _)) if indent.trim().is_empty() => {
                out.push_str(indent);
                out.push_str("for: 0s");
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    assert!(out.matches("for: 0s").count() >= 10, "the holds were not found");
    out
}

fn start_prometheus(dir: &Path, targets: &[&str]) -> (Process, String) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("rules.yml"), rules_without_holds()).unwrap();
    let targets: Vec<String> = targets.iter().map(|t| format!("'{t}'")).collect();
    let config = format!(
        "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
         rule_files: [rules.yml]\n\
         scrape_configs:\n  - job_name: kiln\n    static_configs: [{{targets: [{}]}}]\n",
        targets.join(", ")
    );
    std::fs::write(dir.join("prometheus.yml"), config).unwrap();
    let addr = format!("127.0.0.1:{}", free_port());
    let child = Command::new(prometheus_bin("prometheus"))
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log")).unwrap())
        .spawn()
        .unwrap();
    let process = Process(child);
    wait_for(Duration::from_secs(60), "Prometheus ready", || get(&addr, "/-/ready").0 == 200);
    (process, addr)
}

/// A GET as HTTP/1.0, so that Prometheus (Go's server) answers unchunked; the status and body.
fn get(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(addr) else { return (0, String::new()) };
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    let mut out = String::new();
    if s.write_all(request.as_bytes()).is_err() || s.read_to_string(&mut out).is_err() {
        return (0, String::new());
    }
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned())
}

/// `(alertname, instance)` of the alerts Prometheus reports firing.
fn firing(prometheus: &str) -> Vec<(String, String)> {
    let (_, body) = get(prometheus, "/api/v1/alerts");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let alerts = v["data"]["alerts"].as_array().cloned().unwrap_or_default();
    alerts
        .iter()
        .filter(|a| a["state"] == "firing")
        .map(|a| {
            let label = |k: &str| a["labels"][k].as_str().unwrap_or_default().to_owned();
            (label("alertname"), label("instance"))
        })
        .collect()
}

fn targets_up(prometheus: &str) -> usize {
    let (_, body) = get(prometheus, "/api/v1/query?query=up%7Bjob%3D%22kiln%22%7D%3D%3D1");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    v["data"]["result"].as_array().map_or(0, Vec::len)
}

#[test]
fn prometheus_scrapes_live_replicas_and_fires_the_down_and_latency_alerts() {
    // The slow replica: the default model, one thread, one request at a time, so six requests
    // of 96 tokens each take seconds end to end (most of them queued) on any CPU.
    let (slow, slow_url) = start_kiln_serve(&[
        "gemma-3-270m",
        "--served-model-name",
        "gemma",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "1",
        "--threads",
        "1",
    ]);
    let (doomed, doomed_url) = start_server();
    let slow_addr = slow_url.trim_start_matches("http://").to_owned();
    let doomed_addr = doomed_url.trim_start_matches("http://").to_owned();
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("prometheus-{}", free_port()));
    let (_prometheus, prom) = start_prometheus(&dir, &[&slow_addr, &doomed_addr]);
    wait_for(Duration::from_secs(60), "both replicas scraped up", || targets_up(&prom) == 2);
    assert!(firing(&prom).is_empty(), "alerts before any fault: {:?}", firing(&prom));

    drop(doomed); // SIGKILL
    let body = r#"{"model": "gemma", "prompt": "The history of the city", "max_tokens": 96,
                   "temperature": 0, "ignore_eos": true}"#;
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let addr = slow_addr.clone();
            std::thread::spawn(move || http(&addr, "POST", "/v1/completions", body).0)
        })
        .collect();
    for c in clients {
        assert_eq!(c.join().unwrap(), 200);
    }
    let want = [
        ("KilnReplicaDown".to_owned(), doomed_addr.clone()),
        ("KilnE2ELatencyHighP50".to_owned(), String::new()),
    ];
    wait_for(Duration::from_secs(120), "the down and latency alerts", || {
        let now = firing(&prom);
        want.iter().all(|w| now.contains(w))
    });
    let now = firing(&prom);
    assert!(
        !now.iter().any(|(name, instance)| name == "KilnReplicaDown" && *instance == slow_addr),
        "the live replica was reported down: {now:?}"
    );
    drop(slow);
    let _ = std::fs::remove_dir_all(&dir);
}
