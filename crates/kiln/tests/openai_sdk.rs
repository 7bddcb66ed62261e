//! `kiln serve` end to end: the binary serves the tiny llama3 fixture on loopback and the
//! official `openai` Python SDK drives it (`tests/e2e/openai_sdk.py`): chat, completions,
//! streaming with usage, logprobs, n=2, seeds, stop strings, `chat.completions.parse` with a
//! pydantic model, a forced tool call whole and streamed (assembled by the SDK) and its round
//! trip, the Responses API (whole, streamed events checked against the SDK's typed events,
//! `responses.stream` with a forced function tool, `previous_response_id`, `responses.parse`,
//! logprobs, retrieve and delete), error types, auth; and `embeddings.create` against an
//! embedding model. The SDK is installed once with pip into a virtual environment under the
//! target directory.

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{python_with_sdk, repo, start_kiln_serve, start_server};

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

/// `kiln serve` of an embedding model (the tiny qwen3-embed fixture: a base model saved by
/// sentence-transformers, served for pooling without a flag) and the SDK's
/// `embeddings.create` (`tests/e2e/openai_embeddings.py`): sentence-transformers' vectors,
/// base64 and float, `dimensions`, token ids, errors.
#[test]
fn the_openai_python_sdk_gets_embeddings_from_kiln_serve() {
    sdk_embeddings_of("qwen3-embed");
}

/// The same checks on an encoder (the tiny BERT fixture, mean pooling, served for pooling
/// without a flag).
#[test]
fn the_openai_python_sdk_gets_embeddings_of_an_encoder() {
    sdk_embeddings_of("bert-mean");
}

fn sdk_embeddings_of(fixture: &str) {
    let python = python_with_sdk();
    let model = repo().join("tests/fixtures/embedding").join(fixture);
    let args = ["--model", model.to_str().unwrap(), "--served-model-name", "tiny-embed"];
    let (server, url) =
        start_kiln_serve(&[&args[..], &["--threads", "1", "--kv-cache-dtype", "f32"]].concat());
    let status = Command::new(python)
        .arg(repo().join("tests/e2e/openai_embeddings.py"))
        .args([url.as_str(), "test-key", "tiny-embed"])
        .arg(model.join("reference.json"))
        .status()
        .unwrap();
    drop(server);
    assert!(status.success(), "the openai SDK embedding checks failed (see the output above)");
}
