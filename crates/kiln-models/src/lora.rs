//! LoRA adapters: low-rank updates `W + (α / r) · B · A` of a base model's projections, read
//! from PEFT directories ([`peft`]), checked against the base model's shapes, kept on the host
//! until a model binds them to its backend.
//!
//! Invariants: every matrix of a [`LoraAdapter`] has the shapes of the base model's projection
//! it updates (`a`: `[rank, k]`, `b_t`: `[rank, n]` for a `[n, k]` matrix) and finite values;
//! the adapter's scale is folded into `b_t`, so applying it is `out += (x · aᵀ) · b_t`.

use std::path::Path;

use crate::{LoadError, LoraDtype, ModelConfig};

mod peft;

/// The projections an adapter may update, in a layer's order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraTarget {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// How many [`LoraTarget`]s there are.
pub const NUM_LORA_TARGETS: usize = 7;

impl LoraTarget {
    pub const ALL: [Self; NUM_LORA_TARGETS] =
        [Self::Q, Self::K, Self::V, Self::O, Self::Gate, Self::Up, Self::Down];

    /// The module name PEFT and transformers give it.
    pub fn module(self) -> &'static str {
        match self {
            Self::Q => "q_proj",
            Self::K => "k_proj",
            Self::V => "v_proj",
            Self::O => "o_proj",
            Self::Gate => "gate_proj",
            Self::Up => "up_proj",
            Self::Down => "down_proj",
        }
    }

    fn from_module(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.module() == name)
    }

    /// Whether it is part of the MLP (absent from expert layers).
    pub fn is_mlp(self) -> bool {
        matches!(self, Self::Gate | Self::Up | Self::Down)
    }

    /// `(k, n)`: the input and output widths of its matrix in `config`'s layers.
    pub fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let (h, i) = (c.hidden_size, c.intermediate_size);
        let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
        match self {
            Self::Q => (h, q),
            Self::K | Self::V => (h, kv),
            Self::O => (q, h),
            Self::Gate | Self::Up => (h, i),
            Self::Down => (i, h),
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One updated projection: `a` `[rank, k]`, `b_t` `[rank, n]` with the scale folded in.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraMatrix {
    pub rank: usize,
    pub a: Vec<f32>,
    pub b_t: Vec<f32>,
}

/// An adapter checked against one base model: per layer, the update of each target (`None`:
/// not adapted).
#[derive(Clone, Debug)]
pub struct LoraAdapter {
    layers: Vec<[Option<LoraMatrix>; NUM_LORA_TARGETS]>,
    /// The precision a backend keeps its matrices in when it is bound.
    dtype: LoraDtype,
}

impl LoraAdapter {
    /// Reads a PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`) for
    /// the model of `config`; refuses ranks above `max_rank`, shapes that do not match the
    /// model (naming the tensor), non-finite values and PEFT settings kiln does not apply.
    pub fn load_peft(dir: &Path, config: &ModelConfig, max_rank: usize) -> Result<Self, LoadError> {
        peft::load(dir, config, max_rank)
    }

    fn empty(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| Default::default()).collect(),
            dtype: LoraDtype::default(),
        }
    }

    /// Keeps its matrices in `dtype` once bound (default f16; f32 keeps the file's values
    /// exactly).
    #[must_use]
    pub fn with_dtype(mut self, dtype: LoraDtype) -> Self {
        self.dtype = dtype;
        self
    }

    pub fn dtype(&self) -> LoraDtype {
        self.dtype
    }

    /// The update of `target` in layer `layer`, if the adapter has one.
    pub fn matrix(&self, layer: usize, target: LoraTarget) -> Option<&LoraMatrix> {
        self.layers.get(layer)?[target.index()].as_ref()
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// The largest rank of its matrices (0 when it has none).
    pub fn max_rank(&self) -> usize {
        self.layers.iter().flatten().flatten().map(|m| m.rank).max().unwrap_or(0)
    }

    /// Bytes of its matrices once bound (in its dtype).
    pub fn bytes(&self) -> usize {
        let elements: usize =
            self.layers.iter().flatten().flatten().map(|m| m.a.len() + m.b_t.len()).sum();
        match self.dtype {
            LoraDtype::F16 => elements * 2,
            LoraDtype::F32 => elements * 4,
        }
    }
}
