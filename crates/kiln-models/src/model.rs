//! The model interface: a stateless forward pass on a backend over a caller-owned paged KV
//! cache, and [`BoundModel`], a model bound to its cache and workspace so that drivers above it
//! (the engine's runner) need not be generic over the backend.

use kiln_backend::{
    Backend, ForwardBatch, ForwardError, KvCacheDtype, KvCacheSpec, KvLayout, Logits, Workspace,
};

use crate::lora::LoraAdapter;
use crate::{LoadError, ModelConfig};

/// A causal language model on backend `B`. Implementations are stateless: all per-sequence
/// state lives in the KV cache and the batch.
pub trait Model<B: Backend>: Send + Sync {
    fn config(&self) -> &ModelConfig;

    /// The backend the weights live on.
    fn backend(&self) -> &B;

    /// The KV cache shape this model writes.
    fn kv_layout(&self) -> KvLayout;

    /// Bytes of the weights the model holds (of a dense model, also what one full forward step
    /// reads).
    fn weight_bytes(&self) -> usize;

    /// Bytes of the weights one token reads (what batch-1 decode costs in bandwidth): less than
    /// [`Model::weight_bytes`] for a mixture of experts, which reads only its picked experts.
    fn active_weight_bytes(&self) -> usize {
        self.weight_bytes()
    }

    /// Binds `adapter` (read for this model's config) to LoRA slot `slot` (from 1; slot 0 is the
    /// base model), replacing what the slot held; `None` empties it. A batch's sequences name
    /// their slot ([`ForwardBatch::set_last_adapter`]). Refused by a model or backend without
    /// adapters.
    fn set_adapter(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<(), LoadError> {
        let _ = (slot, adapter);
        Err(LoadError::Backend {
            name: "LoRA adapter".into(),
            message: "this model does not run LoRA adapters".into(),
        })
    }

    /// Runs the batch: writes this step's K/V into `kv` at the batch's slots and fills `logits`
    /// with one row per entry of `batch.logits_rows()`.
    fn forward(
        &self,
        batch: &ForwardBatch,
        kv: &mut B::KvStore,
        workspace: &mut Workspace<B>,
        logits: &mut Logits,
    ) -> Result<(), ForwardError>;
}

/// The checks every model's step starts with: the cache has `model`'s layout and the batch's
/// block size, and the batch is valid for the model's vocabulary and the cache's blocks.
pub(crate) fn check_cache_and_batch<B: Backend>(
    model: &dyn Model<B>,
    batch: &ForwardBatch,
    kv: &B::KvStore,
) -> Result<(), ForwardError> {
    let spec = model.backend().kv_spec(kv);
    let layout = model.kv_layout();
    if spec.layout != layout || spec.block_size != batch.block_size() {
        return Err(ForwardError::KvLayout(format!(
            "cache {:?} with block size {}, model needs {layout:?} with block size {}",
            spec.layout,
            spec.block_size,
            batch.block_size()
        )));
    }
    batch.validate(model.config().vocab_size, spec.num_blocks)
}

/// What a step driver needs of a model, with the backend erased: one virtual call per step.
pub trait StepModel: Send {
    fn config(&self) -> &ModelConfig;
    fn weight_bytes(&self) -> usize;
    /// The KV cache this model is bound to.
    fn kv_spec(&self) -> KvCacheSpec;
    /// The backend's name ("cpu", "reference").
    fn backend_name(&self) -> &'static str;
    /// Runs one step over the bound cache ([`Model::forward`]).
    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Logits) -> Result<(), ForwardError>;
    /// Bytes of one KV block over every layer ([`Backend::kv_block_bytes`]).
    fn kv_block_bytes(&self) -> usize;
    /// Copies a KV block out of the bound cache ([`Backend::read_kv_block`]).
    fn read_kv_block(&self, block: usize, out: &mut [u8]);
    /// Overwrites a KV block of the bound cache ([`Backend::write_kv_block`]).
    fn write_kv_block(&mut self, block: usize, data: &[u8]);
    /// Whether the backend runs token trees ([`Backend::supports_token_trees`]).
    fn supports_token_trees(&self) -> bool;
    /// Copies cache slots in every layer, in order ([`Backend::copy_kv_slots`]); an error on a
    /// backend without token trees.
    fn copy_kv_slots(&mut self, pairs: &[(u32, u32)]) -> Result<(), ForwardError>;
    /// Binds or empties a LoRA slot ([`Model::set_adapter`]).
    fn set_adapter(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<(), LoadError>;
}

/// A model with its own KV cache and workspace on its backend.
pub struct BoundModel<B: Backend> {
    model: Box<dyn Model<B>>,
    kv: B::KvStore,
    workspace: Workspace<B>,
}

impl<B: Backend> BoundModel<B> {
    /// Binds `model` to a fresh cache of `num_blocks` blocks of `block_size` tokens of `dtype`.
    pub fn new(
        model: Box<dyn Model<B>>,
        dtype: KvCacheDtype,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<Self, ForwardError> {
        let spec = KvCacheSpec { layout: model.kv_layout(), dtype, num_blocks, block_size };
        let kv = model.backend().alloc_kv(spec)?;
        Ok(Self { model, kv, workspace: Workspace::new() })
    }

    pub fn model(&self) -> &dyn Model<B> {
        &*self.model
    }

    pub fn kv(&self) -> &B::KvStore {
        &self.kv
    }
}

impl<B: Backend> StepModel for BoundModel<B> {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    fn kv_spec(&self) -> KvCacheSpec {
        self.model.backend().kv_spec(&self.kv)
    }

    fn backend_name(&self) -> &'static str {
        self.model.backend().name()
    }

    fn forward(&mut self, batch: &ForwardBatch, logits: &mut Logits) -> Result<(), ForwardError> {
        let (model, kv, workspace) = (&self.model, &mut self.kv, &mut self.workspace);
        model.backend().run_step(batch, logits, &mut |logits| {
            model.forward(batch, &mut *kv, &mut *workspace, logits)
        })
    }

    fn kv_block_bytes(&self) -> usize {
        self.model.backend().kv_block_bytes(&self.kv)
    }

    fn read_kv_block(&self, block: usize, out: &mut [u8]) {
        self.model.backend().read_kv_block(&self.kv, block, out);
    }

    fn write_kv_block(&mut self, block: usize, data: &[u8]) {
        self.model.backend().write_kv_block(&mut self.kv, block, data);
    }

    fn supports_token_trees(&self) -> bool {
        self.model.backend().supports_token_trees()
    }

    fn copy_kv_slots(&mut self, pairs: &[(u32, u32)]) -> Result<(), ForwardError> {
        let backend = self.model.backend();
        if !backend.supports_token_trees() {
            return Err(ForwardError::Batch(format!(
                "the {} backend does not run token trees",
                backend.name()
            )));
        }
        let num_slots = self.kv_spec().num_blocks * self.kv_spec().block_size;
        if let Some(&(src, dst)) =
            pairs.iter().find(|&&(s, d)| s as usize >= num_slots || d as usize >= num_slots)
        {
            return Err(ForwardError::Batch(format!(
                "KV slot copy {src} -> {dst} outside the cache's {num_slots} slots"
            )));
        }
        backend.copy_kv_slots(&mut self.kv, pairs);
        Ok(())
    }

    fn set_adapter(&mut self, slot: u32, adapter: Option<&LoraAdapter>) -> Result<(), LoadError> {
        self.model.set_adapter(slot, adapter)
    }
}
