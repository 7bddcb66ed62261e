//! Shared vocabulary of kiln: id newtypes, sampling parameters and finish reasons.
//!
//! This crate has no dependencies on the rest of kiln and does no I/O; every other crate
//! speaks these types.

mod ids;
mod sampling;

pub use ids::{BlockId, RequestId, TokenId};
pub use sampling::{FinishReason, SamplingError, SamplingParams};
