//! The structured-output suite (`tests/e2e/schema_suite.json`: 52 JSON schemas with nested
//! objects, arrays with min / max items, enums, patterns, `anyOf`, `allOf`, `$ref`, bounded
//! numbers, tuples, consts, plus regexes and choices) run through `kiln serve` by the official
//! `openai` SDK (`tests/e2e/schema_suite.py`): every output ends by itself and validates with
//! Python's `jsonschema` (regexes with `re`), greedy. On the tiny random-weight fixture
//! (compact JSON: it would pick whitespace for ever) and on the default model (whitespace
//! allowed, as kiln bounds it; without the bound and the digit cap of numbers this model fills
//! `max_tokens` with whitespace or `100.000…` on 7 of the schemas).

#![allow(clippy::unwrap_used)]

mod common;

use std::process::Command;

use common::{python_with_sdk, repo, start_kiln_serve};

fn run_suite(url: &str, model: &str, flags: &[&str]) {
    let python = python_with_sdk();
    let mut cmd = Command::new(python);
    cmd.arg(repo().join("tests/e2e/schema_suite.py"))
        .args([url, "test-key", model])
        .arg(repo().join("tests/e2e/schema_suite.json"));
    cmd.args(flags);
    let status = cmd.status().unwrap();
    assert!(status.success(), "structured-output suite failed on {model} (see the output above)");
}

#[test]
fn every_schema_of_the_suite_validates_on_the_fixture() {
    let tiny = common::tiny_model();
    let (server, url) = start_kiln_serve(&[
        "--model",
        tiny.to_str().unwrap(),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--num-kv-blocks",
        "1024",
        "--threads",
        "1",
    ]);
    run_suite(&url, "tiny", &["--compact"]);
    drop(server);
}

#[test]
fn every_schema_of_the_suite_validates_on_the_default_model() {
    let (server, url) = start_kiln_serve(&[
        "gemma-3-270m",
        "--served-model-name",
        "gemma",
        "--max-model-len",
        "1024",
        "--threads",
        "1",
    ]);
    run_suite(&url, "gemma", &[]);
    drop(server);
}
