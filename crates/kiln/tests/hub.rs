//! Hugging Face ids resolved offline from a fake Hugging Face cache built on disk
//! (`models--org--name/refs/<rev>` + `snapshots/<commit>/`, files as symlinks the way
//! huggingface_hub stores them): HF directories, revisions, GGUF files chosen by tag, and the
//! errors for what the cache lacks.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use kiln_fetch::{FetchConfig, fetch_default_model};

/// A cache directory removed on drop.
struct FakeCache(PathBuf);

impl Drop for FakeCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Adds `repo` at `commit` (named by `refs/<rev>` when given) holding `files` (name, target).
fn add_snapshot(
    cache: &Path,
    repo: &str,
    rev: Option<&str>,
    commit: &str,
    files: &[(&str, &Path)],
) {
    let repo_dir = cache.join(format!("models--{}", repo.replace('/', "--")));
    let snapshot = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    if let Some(rev) = rev {
        std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
        std::fs::write(repo_dir.join("refs").join(rev), commit).unwrap();
    }
    for (name, target) in files {
        std::os::unix::fs::symlink(target, snapshot.join(name)).unwrap();
    }
}

fn hf_files(model: &str) -> Vec<(&'static str, PathBuf)> {
    let dir = common::repo().join("tests/fixtures/models").join(model);
    [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    .into_iter()
    .map(|f| (f, dir.join(f)))
    .collect()
}

fn fake_cache(name: &str) -> FakeCache {
    let root = std::env::temp_dir().join(format!("kiln-hf-cache-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let llama = hf_files("llama3");
    let refs: Vec<(&str, &Path)> = llama.iter().map(|(n, p)| (*n, p.as_path())).collect();
    add_snapshot(&root, "kiln-test/tiny", Some("main"), "1111aaaa", &refs);
    let qwen = hf_files("qwen3");
    let refs: Vec<(&str, &Path)> = qwen.iter().map(|(n, p)| (*n, p.as_path())).collect();
    add_snapshot(&root, "kiln-test/tiny", Some("v2"), "2222bbbb", &refs);
    let gguf = fetch_default_model(&FetchConfig::from_env()).unwrap();
    let junk = root.join("not-a-model.gguf");
    std::fs::create_dir_all(&root).unwrap();
    std::fs::write(&junk, b"not a gguf").unwrap();
    add_snapshot(
        &root,
        "kiln-test/gemma-3-270m-GGUF",
        Some("main"),
        "3333cccc",
        &[("gemma-3-270m-Q4_K_M.gguf", &gguf), ("gemma-3-270m-Q8_0.gguf", &junk)],
    );
    FakeCache(root)
}

fn generate(cache: &Path, model: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", model, "--prompt", "Hello", "--max-tokens", "3", "--threads", "1"])
        .args(extra)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap()
}

#[test]
fn hub_ids_resolve_offline_from_the_cache() {
    let cache = fake_cache("resolve");
    let ok = |model: &str, extra: &[&str]| {
        let out = generate(&cache.0, model, extra);
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{model} {extra:?}: {stderr}");
        stderr
    };
    let main = ok("kiln-test/tiny", &[]);
    let v2 = ok("kiln-test/tiny", &["--revision", "v2"]);
    // The two revisions are different fixtures (llama3, qwen3): different tokenizers.
    let prompt_len =
        |s: &str| s.split("prompt: ").nth(1).unwrap().split(' ').next().unwrap().to_owned();
    assert_ne!(prompt_len(&main), prompt_len(&v2), "{main}\n{v2}");
    ok("kiln-test/tiny", &["--revision", "2222bbbb"]);
    ok("kiln-test/gemma-3-270m-GGUF:Q4_K_M", &[]);
    // No tag: llama-server's default quantization, Q4_K_M (the Q8_0 file is junk).
    ok("kiln-test/gemma-3-270m-GGUF", &[]);

    let err = |model: &str, extra: &[&str]| {
        let out = generate(&cache.0, model, extra);
        assert!(!out.status.success(), "{model} succeeded");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = err("kiln-test/gemma-3-270m-GGUF:Q2_K", &[]);
    assert!(e.contains("no GGUF file with the tag `q2_k`"), "{e}");
    let e = err("kiln-test/absent", &[]);
    assert!(e.contains("HF_HUB_OFFLINE") && e.contains("not in the Hugging Face cache"), "{e}");
    let e = err("kiln-test/tiny", &["--revision", "v9"]);
    assert!(e.contains("revision `v9` is not in the cache"), "{e}");
}

#[test]
fn download_dir_names_the_cache() {
    let cache = fake_cache("download-dir");
    let dir = cache.0.to_str().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["generate", "--model", "kiln-test/tiny", "--download-dir", dir])
        .args(["--prompt", "Hi", "--max-tokens", "2", "--threads", "1"])
        .env("HF_HUB_CACHE", "/nonexistent")
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `kiln serve ORG/NAME` from the cache, as vLLM's users start it: the id is the served name,
/// `--metrics-prefix vllm` gives vLLM's metric names, and the stats line is logged.
#[test]
fn serve_a_hub_id_with_vllm_metrics_and_stats_lines() {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::process::Stdio;
    use std::time::Duration;

    let cache = fake_cache("serve");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "kiln-test/tiny", "--port", "0", "--threads", "1"])
        .args(["--num-kv-blocks", "64", "--max-model-len", "256", "--metrics-prefix", "vllm"])
        .args(["--log-stats-interval", "0.2", "--enforce-eager"])
        .env("HF_HUB_CACHE", &cache.0)
        .env("HF_HUB_OFFLINE", "1")
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let mut lines = Vec::new();
    let addr = loop {
        let line = rx.recv_timeout(Duration::from_secs(60)).unwrap();
        lines.push(line.clone());
        if let Some(at) = line.find("listening on http://") {
            let url = line[at + "listening on http://".len()..].split_whitespace().next().unwrap();
            break url.to_owned();
        }
    };
    let http = |request: String| {
        let mut s = std::net::TcpStream::connect(&addr).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    while common::health(&addr) != Some(200) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let body = r#"{"model": "kiln-test/tiny", "prompt": "Hello", "max_tokens": 4}"#;
    let reply = http(format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    ));
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    let metrics = http("GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".into());
    assert!(metrics.contains("text/plain; version=0.0.4"), "{metrics}");
    assert!(
        metrics.contains(
            r#"vllm:request_success_total{model_name="kiln-test/tiny",finished_reason="length"} 1"#
        ),
        "{metrics}"
    );
    assert!(
        metrics.contains(
            r#"http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 1"#
        ),
        "{metrics}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !lines.iter().any(|l| l.contains("Avg prompt throughput")) {
        assert!(std::time::Instant::now() < deadline, "no stats line: {lines:#?}");
        if let Ok(line) = rx.recv_timeout(Duration::from_millis(500)) {
            lines.push(line);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}
