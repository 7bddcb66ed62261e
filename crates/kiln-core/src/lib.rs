//! Shared vocabulary of kiln: id newtypes, sampling parameters, structured-output constraints,
//! finish reasons and the seeded PRNG every component that draws random numbers uses.
//!
//! This crate has no dependencies on the rest of kiln and does no I/O; every other crate
//! speaks these types.

mod ids;
mod rng;
mod sampling;
mod structured;

pub use ids::{BlockId, RequestId, TokenId};
pub use rng::{Rng, keyed_uniform};
pub use sampling::{FinishReason, SamplingError, SamplingParams};
pub use structured::{ReasoningMarkers, StructuredOutput};
