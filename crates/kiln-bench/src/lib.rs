//! kiln's benchmark tools, independent of the engine: they talk HTTP to any OpenAI-compatible
//! server (kiln, vLLM, llama.cpp's llama-server).
//!
//! - [`dataset`]: random, prefix-repetition and ShareGPT prompts, measured with the served
//!   model's tokenizer through [`PromptTokenizer`].
//! - [`serve`]: `kiln bench serve`, the online load generator (arrival process in [`arrival`],
//!   streaming client in [`client`], summary in [`result`]).
//! - [`tune`]: `kiln tune`, sweeps of server flags × load with a chosen objective, CSV and plots.
//! - [`plan`]: `kiln plan`'s memory and roofline arithmetic.

pub mod arrival;
pub mod client;
pub mod dataset;
pub mod plan;
mod progress;
pub mod result;
pub mod serve;
pub mod slo;
mod sse;
pub mod stats;
pub mod tune;

pub use arrival::RequestRate;
pub use client::{ApiClient, EndpointKind, Target};
pub use dataset::{BenchRequest, DatasetConfig, DatasetKind, PromptTokenizer};
pub use result::BenchResult;
pub use serve::{ServeBenchConfig, run_blocking};
pub use slo::Slos;
