//! Models of kiln: loading weights and configs (and, through `kiln-tokenizer`, the tokenizer a
//! model ships), and stateless forward passes over a paged KV cache that the caller owns, on
//! any [`kiln_backend::Backend`].
//!
//! Invariants:
//! - model code reaches device memory only through the backend's operations (it never indexes
//!   a weight, an activation or the KV cache);
//! - a model never owns KV memory: the backend's KV store is passed to every
//!   [`Model::forward`];
//! - every file is validated with checked arithmetic before use; bad input yields a
//!   [`LoadError`] naming the file and tensor, never a panic or an out-of-bounds read;
//! - `forward` allocates nothing once its [`Workspace`] has grown to the batch size.

mod config;
mod decoder;
mod encoder;
mod error;
mod family;
pub mod gguf;
mod loader;
pub mod lora;
mod model;
mod names;
mod packed;
mod pooling;
mod safetensors_store;
mod weights;

pub use config::{
    Architecture, EncoderConfig, MlaConfig, ModelConfig, MoeConfig, OutputHead, Routing,
};
pub use decoder::DecoderModel;
pub use encoder::EncoderModel;
pub use error::LoadError;
pub use kiln_backend::{
    Backend, ForwardBatch, ForwardError, HostParallel, HostThreads, KvCacheDtype, KvCacheSpec,
    KvLayout, Logits, LogitsWanted, LoraDtype, SeqSpan, Serial, TREE_ROOT, Workspace,
    check_block_size,
};
pub use loader::{LoadOptions, LoadedModel, load_model, load_model_with, load_tokenizer};
pub use model::{BoundModel, Model, StepModel};
pub use packed::{
    PackedMethod, PackedQuant, check_method as check_packed_method, repack_growth_bytes,
};
pub use pooling::{Classifier, PoolAccumulator, PoolerConfig, PoolingType};
pub use safetensors_store::WeightStore;
