//! Models of kiln: loading weights and configs (and, through `kiln-tokenizer`, the tokenizer a
//! model ships), and stateless forward passes over a paged KV cache that the caller owns.
//!
//! Invariants:
//! - a model never owns KV memory: [`PagedKvCache`] is passed to every [`Model::forward`];
//! - every file is validated with checked arithmetic before use; bad input yields a
//!   [`LoadError`] naming the file and tensor, never a panic or an out-of-bounds read;
//! - `forward` allocates nothing once its [`ForwardScratch`] has grown to the batch size.

mod batch;
mod config;
mod decoder;
mod error;
pub mod gguf;
mod kv_cache;
mod loader;
mod model;
mod names;
mod safetensors_store;
mod weights;

pub use batch::{BatchSeq, ForwardBatch, LogitsWanted};
pub use config::{Architecture, ModelConfig};
pub use decoder::DecoderModel;
pub use error::{ForwardError, LoadError};
pub use kv_cache::{KvCacheDtype, KvLayerMut, KvLayout, PagedKvCache};
pub use loader::{LoadOptions, LoadedModel, load_model, load_model_with, load_tokenizer};
pub use model::{ForwardScratch, Logits, Model};
pub use safetensors_store::WeightStore;
