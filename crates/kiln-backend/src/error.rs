//! Why a step cannot run. The engine validates requests first; these are the last line.

/// A batch the model or backend cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ForwardError {
    #[error("token id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfVocab { token: u32, vocab_size: usize },
    #[error("block table of sequence {seq} covers {covered} tokens, needs {needed}")]
    BlockTableTooShort { seq: usize, covered: usize, needed: usize },
    #[error("block id {block} is outside the KV cache ({num_blocks} blocks)")]
    BlockOutOfRange { block: u32, num_blocks: usize },
    #[error("KV cache layout does not match the model: {0}")]
    KvLayout(String),
    #[error("malformed batch: {0}")]
    Batch(String),
    /// The device failed (out of memory, a kernel launch error).
    #[error("backend: {0}")]
    Device(String),
}

/// Why a tensor could not be loaded onto a backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadTensorError {
    #[error("{bytes} bytes do not hold [{rows}, {cols}] {ty}")]
    Size { rows: usize, cols: usize, ty: crate::GgmlType, bytes: usize },
    #[error("cannot convert {cols} columns to {ty}: not a multiple of {block}")]
    Convert { ty: crate::GgmlType, cols: usize, block: usize },
    #[error("the backend does not support {0} here")]
    Unsupported(String),
    #[error("backend: {0}")]
    Device(String),
}
