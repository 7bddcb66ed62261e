//! Shared by the CLI's integration tests: the repository root, the tiny fixture model and a
//! `kiln serve` child process on a free loopback port.

#![allow(clippy::unwrap_used, dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The tiny llama3 fixture (2 layers, random weights).
pub fn tiny_model() -> PathBuf {
    repo().join("tests/fixtures/models/llama3")
}

pub struct Server(Child);

impl Server {
    /// Kills the process (SIGKILL) and waits for it.
    pub fn kill(mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }

    /// Sends SIGTERM (a graceful stop: drain, then the engine's shutdown work) and waits for
    /// the exit status.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        self.send_term();
        self.0.wait().unwrap()
    }

    /// Sends SIGTERM and returns at once (the server drains while the caller goes on).
    pub fn send_term(&self) {
        let pid = self.0.id().to_string();
        let sent = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
        assert!(sent.success(), "kill -TERM {pid}");
    }

    /// Waits for the process to exit.
    pub fn wait(mut self) -> std::process::ExitStatus {
        self.0.wait().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kiln serve` with the tiny llama3 fixture (served as `tiny`, API key `test-key`) on
/// a free port; returns it with its base URL once `/health` is 200.
pub fn start_server() -> (Server, String) {
    start_server_with(&[])
}

/// [`start_server`] with more flags.
pub fn start_server_with(extra: &[&str]) -> (Server, String) {
    let tiny = tiny_model();
    let mut args = vec!["--model", tiny.to_str().unwrap(), "--served-model-name", "tiny"];
    args.extend(["--num-kv-blocks", "256", "--max-model-len", "256", "--threads", "1"]);
    args.extend(extra);
    start_kiln_serve(&args)
}

/// [`start_server_with`], returning the server's `host:port` instead of its URL.
pub fn tiny_replica_with(extra: &[&str]) -> (Server, String) {
    let (server, url) = start_server_with(extra);
    (server, url.trim_start_matches("http://").to_owned())
}

/// Polls `done` every 200 ms until it holds; panics after `limit`.
pub fn wait_for(limit: Duration, what: &str, mut done: impl FnMut() -> bool) {
    let start = std::time::Instant::now();
    while !done() {
        assert!(start.elapsed() < limit, "timed out after {limit:?} waiting for {what}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `kiln serve ARGS` on a free loopback port with API key `test-key`; returns it with its
/// base URL once `/health` is 200 (the default model may take a first fetch).
pub fn start_kiln_serve(args: &[&str]) -> (Server, String) {
    start_kiln_serve_on(0, args)
}

/// [`start_kiln_serve`] on loopback port `port` (0: a free one).
pub fn start_kiln_serve_on(port: u16, args: &[&str]) -> (Server, String) {
    start_kiln_serve_via(&[], port, args)
}

/// [`start_kiln_serve_on`] run through `prefix` (e.g. `ip netns exec NS`, which execs kiln in
/// place, so the child is kiln itself); the URL is the one kiln says it listens on.
pub fn start_kiln_serve_via(prefix: &[&str], port: u16, args: &[&str]) -> (Server, String) {
    let mut command = match prefix.split_first() {
        Some((program, rest)) => {
            let mut c = Command::new(program);
            c.args(rest).arg(env!("CARGO_BIN_EXE_kiln"));
            c
        }
        None => Command::new(env!("CARGO_BIN_EXE_kiln")),
    };
    let mut child = command
        .arg("serve")
        .args(args)
        .args(["--port", &port.to_string(), "--api-key", "test-key", "--disable-log-requests"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[kiln] {line}");
            if let Some(at) = line.find("listening on http://") {
                let url = line[at + "listening on ".len()..].split_whitespace().next().unwrap();
                let _ = tx.send(url.to_owned());
            }
        }
    });
    let server = Server(child);
    let url = rx.recv_timeout(Duration::from_secs(600)).expect("kiln serve did not start");
    let addr = url.trim_start_matches("http://").to_owned();
    for _ in 0..600 {
        if health(&addr) == Some(200) {
            return (server, url);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("kiln serve never became healthy");
}

pub fn health(addr: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split(' ').nth(1)?.parse().ok()
}

/// One HTTP/1.1 request on a fresh connection; returns the status and the body.
pub fn http(addr: &str, method: &str, path: &str, body: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer test-key\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(request.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
    (status, body)
}

/// The text of a greedy `/v1/completions` of `prompt` (token ids) for the served model `tiny`,
/// `max_tokens` long (EOS ignored); panics on any status but 200.
pub fn greedy_completion(addr: &str, prompt: &[u32], max_tokens: usize) -> String {
    let body = serde_json::json!({
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": true,
    });
    let (status, text) = http(addr, "POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|_| {
        // A chunked body: the JSON is the second line.
        serde_json::from_str(text.lines().nth(1).unwrap()).unwrap()
    });
    v["choices"][0]["text"].as_str().unwrap().to_owned()
}

/// [`greedy_completion`] of each prompt, all sent at once (one thread each); texts in order.
pub fn concurrent_completions(
    addr: &str,
    prompts: Vec<Vec<u32>>,
    max_tokens: usize,
) -> Vec<String> {
    let threads: Vec<_> = prompts
        .into_iter()
        .map(|prompt| {
            let addr = addr.to_owned();
            std::thread::spawn(move || greedy_completion(&addr, &prompt, max_tokens))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// The value of the first `/metrics` series named `name` (labelled, as every `kiln:` series).
pub fn metric(addr: &str, name: &str) -> f64 {
    metric_where(addr, name, "")
}

/// [`metric`] of the first series whose line also contains `label` (e.g. `mode="swap"`).
pub fn metric_where(addr: &str, name: &str, label: &str) -> f64 {
    let (_, text) = http(addr, "GET", "/metrics", "");
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{') && l.contains(label))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{name} {label} missing"))
}

/// The `openai` SDK version the Python checks are written against.
pub const OPENAI_SDK: &str = "openai==3.54.0";
/// The `jsonschema` version that validates structured outputs.
pub const JSONSCHEMA: &str = "jsonschema==4.23.0";

/// The `anthropic` SDK version the Messages checks are written against.
pub const ANTHROPIC_SDK: &str = "anthropic==2.17.0";

/// A python with `anthropic`: a venv under the target directory, made on first use.
pub fn python_with_anthropic_sdk() -> PathBuf {
    venv_with("anthropic-venv", &[ANTHROPIC_SDK]).join("bin/python")
}

/// A python with `openai` and `jsonschema`: a venv under the target directory, made on first
/// use (and completed when a package is missing or at another version).
pub fn python_with_sdk() -> PathBuf {
    venv_with("openai-venv", &[OPENAI_SDK, JSONSCHEMA]).join("bin/python")
}

/// A virtual environment `name` under the target directory with `packages` (each
/// `name==version`) installed by pip, made on first use and completed when a package is
/// missing or at another version; returns its directory.
pub fn venv_with(name: &str, packages: &[&str]) -> PathBuf {
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = MAKING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let python = venv.join("bin/python");
    let pins: Vec<String> = packages
        .iter()
        .map(|p| {
            let (name, version) = p.split_once("==").expect("packages are pinned: name==version");
            format!("m.version('{name}') == '{version}'")
        })
        .collect();
    let check =
        format!("import importlib.metadata as m, sys; sys.exit(not ({}))", pins.join(" and "));
    let ready =
        |py: &PathBuf| Command::new(py).args(["-c", &check]).status().is_ok_and(|s| s.success());
    if ready(&python) {
        return venv;
    }
    if !python.exists() {
        let status = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().unwrap();
        assert!(status.success(), "python3 -m venv failed");
    }
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
        .args(packages)
        .status()
        .unwrap();
    assert!(status.success(), "pip install {packages:?} failed");
    assert!(ready(&python));
    venv
}

/// The files of Debian package `package` (the machine's own apt sources, e.g. `prometheus` for
/// Prometheus and promtool), unpacked once under the target directory without installing it;
/// returns the unpacked root (binaries under `usr/bin`). `apt-get download` needs the package
/// lists: when it fails they are refreshed once with `apt-get update`.
pub fn debian_package(package: &str) -> PathBuf {
    static UNPACKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = UNPACKING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("debian").join(package);
    let root = dir.join("root");
    if root.join("usr").exists() {
        return root;
    }
    std::fs::create_dir_all(&dir).unwrap();
    let download = || {
        Command::new("apt-get")
            .args(["download", "-qq", package])
            .current_dir(&dir)
            .status()
            .is_ok_and(|s| s.success())
    };
    if !download() {
        let updated = Command::new("apt-get").args(["update", "-qq"]).status().unwrap();
        assert!(updated.success(), "apt-get update failed");
        assert!(download(), "apt-get download {package} failed");
    }
    let deb = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .unwrap();
    let unpacking = dir.join("unpacking");
    let _ = std::fs::remove_dir_all(&unpacking);
    let status = Command::new("dpkg").arg("-x").arg(&deb).arg(&unpacking).status().unwrap();
    assert!(status.success(), "dpkg -x {} failed", deb.display());
    std::fs::rename(&unpacking, &root).unwrap();
    root
}

/// A free loopback port (bound and released: another process may take it first, unlikely).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
