//! The backend seam of kiln: the contracts between the engine and models above and the devices
//! below.
//!
//! - [`ForwardBatch`] / [`SeqSpan`] / [`LogitsWanted`]: one step's varlen input on the host;
//! - [`KvLayout`], [`KvCacheDtype`], [`KvCacheSpec`] and the one block-size rule
//!   ([`check_block_size`]);
//! - [`HostTensor`]: a tensor as loaded (ggml type, shape, bytes owned or memory-mapped), and
//!   [`GgmlType`], the block geometry of its bytes;
//! - [`AttentionShape`], [`RopeConfig`], [`GateActivation`]: parameters of the operations;
//! - [`Logits`]: what every backend hands back for sampling, in host memory;
//! - [`Backend`]: device memory and the coarse operations of a decoder step, and
//!   [`Workspace`], a step's reusable activation buffers;
//! - [`quant`]: the quant codecs every backend shares (GGUF blocks to f32 and back).
//!
//! Implementations: the CPU backend (`kiln_kernels::Cpu`, SIMD kernels on a thread pool) and
//! the scalar reference backend (`kiln_kernels::Reference`, plain f32 loops for tests). This
//! crate holds no arithmetic beyond decoding float tensors on the host.

mod backend;
mod batch;
mod error;
pub mod ggml_type;
mod host;
mod kv;
mod logits;
pub mod ops;
pub mod quant;
mod storage;
mod tensor;

pub use backend::{
    Backend, ExpertLinearJob, ExpertRouting, LinearJob, LoraDtype, LoraJob, MAX_LINEAR_JOBS,
    Workspace,
};
pub use batch::{ForwardBatch, LogitsWanted, SeqSpan, TREE_ROOT, TreeKeys, TreeMask};
pub use error::{ForwardError, LoadTensorError};
pub use ggml_type::GgmlType;
pub use host::{HostParallel, HostThreads, Serial};
pub use kv::{KvCacheDtype, KvCacheSpec, KvLayout, MAX_BLOCK_SIZE, check_block_size};
pub use logits::Logits;
pub use ops::{AttentionShape, GateActivation, RopeConfig, RopeScaling, RopeStyle, Strides};
pub use storage::{MappedFile, Pod, Storage};
pub use tensor::HostTensor;
