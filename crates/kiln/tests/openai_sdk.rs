//! `kiln serve` end to end: the binary serves the tiny llama3 fixture on loopback and the
//! official `openai` Python SDK drives it (`tests/e2e/openai_sdk.py`): chat, completions,
//! streaming with usage, logprobs, n=2, seeds, stop strings, `chat.completions.parse` with a
//! pydantic model, a forced tool call whole and streamed (assembled by the SDK) and its round
//! trip, the Responses API (whole, streamed events checked against the SDK's typed events,
//! `responses.stream` with a forced function tool, `previous_response_id`, `responses.parse`,
//! logprobs, retrieve and delete), error types, auth. The SDK is installed once with pip into a
//! virtual environment under the target directory.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{python_with_sdk, repo, start_server};

#[test]
fn the_openai_python_sdk_works_against_kiln_serve() {
    let python = python_with_sdk();
    let (server, url) = start_server();
    let status = Command::new(python)
        .arg(repo().join("tests/e2e/openai_sdk.py"))
        .args([&url, "test-key", "tiny"])
        .status()
        .unwrap();
    drop(server);
    assert!(status.success(), "the openai SDK checks failed (see the output above)");
}
