//! `kiln serve` end to end: the binary serves the tiny llama3 fixture on loopback and the
//! official `openai` Python SDK drives it (`tests/e2e/openai_sdk.py`): chat, completions,
//! streaming with usage, logprobs, n=2, seeds, stop strings, error types, auth. The SDK is
//! installed once with pip into a virtual environment under the target directory.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The SDK version the checks are written against.
const OPENAI_SDK: &str = "openai==3.54.0";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A python with the `openai` package: a venv under the target directory, made on first use.
fn python_with_openai() -> PathBuf {
    let venv = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("openai-venv");
    let python = venv.join("bin/python");
    let has_sdk = |py: &Path| {
        Command::new(py)
            .args([
                "-c",
                &format!(
                    "import openai, sys; sys.exit(openai.__version__ != '{}')",
                    &OPENAI_SDK[8..]
                ),
            ])
            .status()
            .is_ok_and(|s| s.success())
    };
    if has_sdk(&python) {
        return python;
    }
    let status = Command::new("python3").args(["-m", "venv"]).arg(&venv).status().unwrap();
    assert!(status.success(), "python3 -m venv failed");
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", OPENAI_SDK])
        .status()
        .unwrap();
    assert!(status.success(), "pip install {OPENAI_SDK} failed");
    assert!(has_sdk(&python));
    python
}

struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `kiln serve` on a free port; returns it with its base URL once `/health` is 200.
fn start_server() -> (Server, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(repo().join("tests/fixtures/models/llama3"))
        .args([
            "--port",
            "0",
            "--served-model-name",
            "tiny",
            "--api-key",
            "test-key",
            "--num-kv-blocks",
            "256",
            "--max-model-len",
            "256",
            "--threads",
            "1",
            "--disable-log-requests",
        ])
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
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("kiln serve did not start");
    let addr = url.trim_start_matches("http://").to_owned();
    for _ in 0..600 {
        if health(&addr) == Some(200) {
            return (server, url);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("kiln serve never became healthy");
}

fn health(addr: &str) -> Option<u16> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split(' ').nth(1)?.parse().ok()
}

#[test]
fn the_openai_python_sdk_works_against_kiln_serve() {
    let python = python_with_openai();
    let (server, url) = start_server();
    let status = Command::new(python)
        .arg(repo().join("tests/e2e/openai_sdk.py"))
        .args([&url, "test-key", "tiny"])
        .status()
        .unwrap();
    drop(server);
    assert!(status.success(), "the openai SDK checks failed (see the output above)");
}
