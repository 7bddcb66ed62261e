//! Errors of loading and running models. Every message names the file and, where there is one,
//! the tensor.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
    #[error("{path}: invalid config: {message}")]
    Config { path: PathBuf, message: String },
    #[error("{path}: unsupported architecture `{name}` (supported: {supported})")]
    UnsupportedArchitecture { path: PathBuf, name: String, supported: &'static str },
    #[error("tensor `{name}` not found in {path}")]
    MissingTensor { path: PathBuf, name: String },
    #[error("{path}: tensor `{name}` has shape {found:?}, expected {expected:?}")]
    Shape { path: PathBuf, name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("{path}: tensor `{name}` has unsupported dtype {dtype}")]
    Dtype { path: PathBuf, name: String, dtype: String },
    /// The backend refused a tensor: a failed conversion (`--quantization`), a size it cannot
    /// hold, a device error.
    #[error("loading tensor `{name}` onto the backend: {message}")]
    Backend { name: String, message: String },
    #[error("{path}: tokenizer: {message}")]
    Tokenizer { path: PathBuf, message: String },
}

impl LoadError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io { path: path.into(), source }
    }

    pub(crate) fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Format { path: path.into(), message: message.into() }
    }

    pub(crate) fn config(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Self::Config { path: path.into(), message: message.into() }
    }
}

impl From<kiln_tokenizer::TokenizerError> for LoadError {
    fn from(e: kiln_tokenizer::TokenizerError) -> Self {
        use kiln_tokenizer::TokenizerError as T;
        match e {
            T::Missing { path } => Self::Format {
                path,
                message: "no such file (a Hugging Face model directory needs its tokenizer.json)"
                    .into(),
            },
            T::Io { path, source } => Self::Io { path, source },
            T::Format { path, message } => Self::Format { path, message },
            T::Tokenizer { path, message } => Self::Tokenizer { path, message },
        }
    }
}
