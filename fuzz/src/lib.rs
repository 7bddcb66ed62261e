//! kiln's fuzz entry points (see `entries.rs`).

#![allow(clippy::unwrap_used)]

mod entries;

pub use entries::{chat_template, detokenizer, gguf, request_json, safetensors, tool_calls};
