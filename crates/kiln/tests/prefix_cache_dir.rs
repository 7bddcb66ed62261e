//! `kiln serve --warmup-prompts` and `--prefix-cache-dir` end to end on the tiny fixture: a
//! warm-up prompt is cached before `/health` turns 200; the cache saved at a graceful stop is
//! hit by the first request of the next server, with the same completion; a damaged file is
//! refused and the server starts with an empty cache; a bad warm-up file stops the start with
//! its line named.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::PathBuf;
use std::process::Command;

/// A long shared prefix (a system prompt's role).
fn system_prompt() -> String {
    "You are kiln, a careful assistant. Answer briefly and cite the manual. ".repeat(3)
}

/// Greedy completion of `prompt`: (text, cached prompt tokens).
fn complete(addr: &str, prompt: &str) -> (String, u64) {
    let body = serde_json::json!({
        "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true,
    });
    let (status, text) = common::http(addr, "POST", "/v1/completions", &body.to_string());
    assert_eq!(status, 200, "{text}");
    let v: serde_json::Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|_| serde_json::from_str(text.lines().nth(1).unwrap()).unwrap());
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    (v["choices"][0]["text"].as_str().unwrap().to_owned(), cached)
}

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("prefix-cache-dir-{name}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn warm_up_and_a_saved_prefix_cache_serve_the_first_request_from_the_cache() {
    let dir = scratch("restart");
    let cache = dir.join("cache");
    let warmup = dir.join("warmup.jsonl");
    std::fs::write(&warmup, format!("\n{}\n", serde_json::json!(system_prompt()))).unwrap();
    let question = format!("{}What is a kiln?", system_prompt());

    let (server, url) = common::start_server_with(&[
        "--prefix-cache-dir",
        cache.to_str().unwrap(),
        "--warmup-prompts",
        warmup.to_str().unwrap(),
    ]);
    let addr = url.trim_start_matches("http://").to_owned();
    let (expected, cached) = complete(&addr, &question);
    assert!(cached >= 64, "the warm-up prompt was not cached: {cached} tokens hit");
    assert!(server.terminate().success());
    let saved = cache.join("prefix-cache.bin");
    assert!(saved.exists(), "nothing saved at shutdown");

    // A new process: the first request hits what the last one computed, and answers the same.
    let (server, url) = common::start_server_with(&["--prefix-cache-dir", cache.to_str().unwrap()]);
    let addr = url.trim_start_matches("http://").to_owned();
    let (text, cached_again) = complete(&addr, &question);
    assert_eq!(text, expected);
    assert!(cached_again >= cached, "{cached_again} tokens hit after the restart");
    assert!(server.terminate().success());

    // A damaged file is refused: the server starts, computes everything, answers the same.
    let mut bytes = std::fs::read(&saved).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    std::fs::write(&saved, &bytes).unwrap();
    let (_server, url) =
        common::start_server_with(&["--prefix-cache-dir", cache.to_str().unwrap()]);
    let (text, cached_damaged) = complete(url.trim_start_matches("http://"), &question);
    assert_eq!((text, cached_damaged), (expected, 0));
}

/// `kiln serve` of the tiny model with `flag path`, which must fail to start; its stderr.
fn refused_start(flag: &str, path: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", flag])
        .arg(path)
        .output()
        .unwrap();
    assert!(!out.status.success(), "kiln serve {flag} {} started", path.display());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_bad_warm_up_file_stops_the_start_with_its_line() {
    let dir = scratch("bad-warmup");
    let warmup = dir.join("warmup.jsonl");
    std::fs::write(&warmup, "\"fine\"\n{\"prompt\": \"also fine\"}\nnot json\n").unwrap();
    let stderr = refused_start("--warmup-prompts", &warmup);
    assert!(stderr.contains("warmup.jsonl: line 3: not JSON"), "{stderr}");
}

/// Issue 53: a directory other users may write is refused at start, naming the flag.
#[cfg(unix)]
#[test]
fn a_prefix_cache_dir_others_may_write_is_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch("shared");
    let cache = dir.join("cache");
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o777)).unwrap();
    let stderr = refused_start("--prefix-cache-dir", &cache);
    assert!(stderr.contains("--prefix-cache-dir") && stderr.contains("other users"), "{stderr}");
    // A directory kiln creates is private.
    let fresh = dir.join("fresh");
    let (server, _) = common::start_server_with(&["--prefix-cache-dir", fresh.to_str().unwrap()]);
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700);
    assert!(server.terminate().success());
}

/// Issue 53: SIGTERM during a long warm-up ends the process promptly, never `ready`.
#[test]
fn a_shutdown_signal_stops_the_warm_up() {
    use std::io::BufRead;
    let dir = scratch("long-warmup");
    let warmup = dir.join("warmup.jsonl");
    // Distinct prompts (no prefix shared), many more than a few seconds of prefill.
    let lines: Vec<String> = (0..20_000)
        .map(|i| serde_json::json!(format!("{i} {}", "the quick brown fox ".repeat(3))).to_string())
        .collect();
    std::fs::write(&warmup, lines.join("\n")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", "--threads", "1", "--shutdown-timeout", "2", "--warmup-prompts"])
        .arg(&warmup)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let mut lines = stderr.lines().map_while(Result::ok);
    let started = lines.by_ref().any(|l| l.contains("warm-up: prefilling 20000 prompts"));
    assert!(started, "the warm-up never started");
    std::thread::sleep(std::time::Duration::from_millis(500));
    let signalled = std::time::Instant::now();
    let sent = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(sent.success());
    let rest: Vec<String> = lines.collect();
    let status = child.wait().unwrap();
    let took = signalled.elapsed();
    assert!(status.success(), "{status}: {rest:?}");
    assert!(took < std::time::Duration::from_secs(10), "exited {took:?} after the signal");
    assert!(!rest.iter().any(|l| l.contains("ready: serving")), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("warm-up stopped")), "{rest:?}");
}
