//! Shared vocabulary of kiln: id newtypes, sampling parameters, structured-output constraints,
//! finish reasons, the seeded PRNG every component that draws random numbers uses, and the
//! host helpers every layer may use on logits ([`host_ops`]: greedy argmax).
//!
//! This crate has no dependencies on the rest of kiln and does no I/O; every other crate
//! speaks these types.

pub mod host_ops;
mod ids;
mod rng;
mod sampling;
mod structured;

pub use ids::{BlockId, RequestId, TokenId};
pub use rng::{Rng, keyed_uniform};
pub use sampling::{FinishReason, SamplingError, SamplingParams};
pub use structured::{ReasoningFormat, ReasoningMarkers, StructuredOutput};
