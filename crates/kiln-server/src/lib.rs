//! kiln's OpenAI-compatible HTTP server.
