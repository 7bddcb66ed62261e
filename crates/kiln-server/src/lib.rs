//! kiln server

pub mod chat_template;
pub mod metrics;
