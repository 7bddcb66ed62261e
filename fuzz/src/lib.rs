//! kiln's fuzz entry points (see `entries.rs`).

#![allow(clippy::unwrap_used)]

mod entries;

pub use entries::{
    chat_template, detokenizer, gguf, kv_events_socket, request_json, safetensors, template_kwargs,
    tool_calls,
};
