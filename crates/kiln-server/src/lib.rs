//! kiln's OpenAI-compatible HTTP server.

pub mod metrics;
