//! Errors of loading a tokenizer from files. Every message names the file.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// The model directory has no `tokenizer.json`.
    #[error("{path}: no such file (a Hugging Face model directory needs its tokenizer.json)")]
    Missing { path: PathBuf },
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A JSON side file (`tokenizer_config.json`, `generation_config.json`) is malformed.
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    /// `tokenizers` refused the tokenizer file.
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
}
