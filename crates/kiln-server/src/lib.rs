//! kiln's OpenAI-compatible HTTP server.
pub mod chat_template;
