//! `kiln serve` end to end with the official `anthropic` Python SDK
//! (`tests/e2e/anthropic_sdk.py`): `messages.create` whole and streamed (raw events checked
//! against the SDK's typed events, and `messages.stream`'s accumulated message equal to the
//! whole one), `count_tokens`, a forced tool and its result, error types, `x-api-key` auth.
//! The SDK is installed once with pip into a virtual environment under the target directory.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{python_with_anthropic_sdk, repo, start_server};

#[test]
fn the_anthropic_python_sdk_works_against_kiln_serve() {
    let python = python_with_anthropic_sdk();
    let (server, url) = start_server();
    let status = Command::new(python)
        .arg(repo().join("tests/e2e/anthropic_sdk.py"))
        .args([&url, "test-key", "tiny"])
        .status()
        .unwrap();
    drop(server);
    assert!(status.success(), "the anthropic SDK checks failed (see the output above)");
}
