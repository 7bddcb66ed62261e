//! `kiln serve --async-scheduling` end to end on the tiny fixture: eight concurrent completions
//! give the text of a synchronous server; a graceful stop with requests running ends with
//! status 0 and every request it served whole; the flag next to `--speculative-config` stops
//! start-up with the reason.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

/// Eight prompts of 20–41 tokens.
fn prompts() -> Vec<Vec<u32>> {
    (0..8u32)
        .map(|i| (0..20 + 3 * i).map(|t| (i * 71 + t * 13 + t * t) % 470 + 12).collect())
        .collect()
}

#[test]
fn async_scheduling_serves_the_synchronous_text_and_stops_cleanly() {
    let (sync, url) = common::start_server();
    let expected =
        common::concurrent_completions(url.trim_start_matches("http://"), prompts(), 200);
    drop(sync);
    let (server, url) = common::start_server_with(&["--async-scheduling"]);
    let addr = url.trim_start_matches("http://").to_owned();
    assert_eq!(common::concurrent_completions(&addr, prompts(), 200), expected);
    // A graceful stop while requests run: they drain, the engine ends its step in flight.
    let wave: Vec<_> = prompts()
        .into_iter()
        .map(|p| {
            let addr = addr.clone();
            std::thread::spawn(move || common::greedy_completion(&addr, &p, 200))
        })
        .collect();
    let start = std::time::Instant::now();
    while common::metric(&addr, "kiln:num_requests_running") == 0.0
        && start.elapsed() < std::time::Duration::from_secs(2)
    {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert!(server.terminate().success());
    // A request the stop refused panics in its thread; every one that was served is whole.
    let served: Vec<_> =
        wave.into_iter().zip(&expected).filter_map(|(t, e)| Some((t.join().ok()?, e))).collect();
    assert!(!served.is_empty());
    for (text, expected) in served {
        assert_eq!(&text, expected);
    }
}

#[test]
fn async_scheduling_with_speculative_decoding_is_refused_at_start_up() {
    let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(["serve", "--model"])
        .arg(common::tiny_model())
        .args(["--port", "0", "--async-scheduling", "--speculative-config"])
        .arg(r#"{"method": "ngram", "num_speculative_tokens": 2}"#)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains("asynchronous scheduling does not run with speculative"), "{stderr}");
}
