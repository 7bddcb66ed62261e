//! `kiln serve` end to end: the binary serves the tiny llama3 fixture on loopback and the
//! official `openai` Python SDK drives it (`tests/e2e/openai_sdk.py`): chat, completions,
//! streaming with usage, logprobs, n=2, seeds, stop strings, error types, auth. The SDK is
//! installed once with pip into a virtual environment under the target directory.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{repo, start_server};

/// The SDK version the checks are written against.
const OPENAI_SDK: &str = "openai==3.54.0";

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
