//! LoRA adapters: low-rank updates `W + (α / r) · B · A` of a base model's projections, read
//! from PEFT directories ([`peft`]) or llama.cpp's GGUF adapter files ([`gguf`]), checked
//! against the base model's shapes, kept on the host until a model binds them to its backend.
//!
//! Invariants: every matrix of a [`LoraAdapter`] has the shapes of the base model's projection
//! it updates (`a`: `[rank, k]`, `b_t`: `[rank, n]` for a `[n, k]` matrix) and finite values;
//! the adapter's scale is folded into `b_t`, so applying it is `out += (x · aᵀ) · b_t`. The
//! output rows of q and k are in the base model's order: a model read from a Llama GGUF keeps
//! llama.cpp's interleaved-RoPE permutation of them ([`RopeStyle::Interleaved`]), a model read
//! from `config.json` does not, and either kind of adapter file is reordered to match.

use std::path::Path;

use kiln_backend::RopeStyle;

use crate::{LoadError, LoraDtype, ModelConfig};

mod gguf;
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

    /// How many heads its output rows hold when RoPE rotates them (q and k), else `None`.
    fn rotated_heads(self, c: &ModelConfig) -> Option<usize> {
        match self {
            Self::Q => Some(c.num_heads),
            Self::K => Some(c.num_kv_heads),
            _ => None,
        }
    }
}

/// A projection as an adapter file names it: one [`LoraTarget`], or a fused matrix whose rows
/// are the outputs of several in order (Phi-3's `qkv_proj` `[q; k; v]` and `gate_up_proj`
/// `[gate; up]`), whose update shares one `A` and splits `B` by rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LoraModule {
    One(LoraTarget),
    Fused(&'static [LoraTarget]),
}

impl LoraModule {
    const QKV: Self = Self::Fused(&[LoraTarget::Q, LoraTarget::K, LoraTarget::V]);
    const GATE_UP: Self = Self::Fused(&[LoraTarget::Gate, LoraTarget::Up]);

    fn targets(&self) -> &[LoraTarget] {
        match self {
            Self::One(target) => std::slice::from_ref(target),
            Self::Fused(targets) => targets,
        }
    }

    fn is_mlp(self) -> bool {
        self.targets()[0].is_mlp()
    }

    /// Refuses it in `layer` of `config` when that layer's MLP is a mixture of experts.
    fn check_layer(self, layer: usize, config: &ModelConfig) -> Result<(), String> {
        if self.is_mlp() && config.layer_experts(layer).is_some() {
            return Err(format!(
                "layer {layer}'s MLP is a mixture of experts: adapters of expert projections \
                 are not supported"
            ));
        }
        Ok(())
    }

    /// `(k, n)` of the (fused) matrix in `config`'s layers.
    fn dims(self, c: &ModelConfig) -> (usize, usize) {
        let k = self.targets()[0].dims(c).0;
        (k, self.targets().iter().map(|t| t.dims(c).1).sum())
    }

    /// Splits the update of the (fused) matrix (`b_t` `[rank, n]`, scale folded in) into
    /// one matrix per target, each in the base model's q/k row order, into `layer`.
    fn store(
        self,
        matrix: LoraMatrix,
        config: &ModelConfig,
        interleaved: bool,
        layer: &mut [Option<LoraMatrix>; NUM_LORA_TARGETS],
    ) {
        if let Self::One(target) = self {
            let mut matrix = matrix;
            match_rope_order(&mut matrix.b_t, target, config, interleaved);
            layer[target.index()] = Some(matrix);
            return;
        }
        let n_total = matrix.b_t.len() / matrix.rank;
        let mut start = 0;
        for &target in self.targets() {
            let n = target.dims(config).1;
            let mut b_t: Vec<f32> = matrix
                .b_t
                .chunks_exact(n_total)
                .flat_map(|row| row[start..start + n].iter().copied())
                .collect();
            match_rope_order(&mut b_t, target, config, interleaved);
            layer[target.index()] =
                Some(LoraMatrix { rank: matrix.rank, a: matrix.a.clone(), b_t });
            start += n;
        }
    }
}

/// Reorders the output columns `n` of `b_t` (`[rank, n]`) of `target` from a file whose q/k
/// rows are llama.cpp's interleaved-RoPE permutation of transformers' (`interleaved`) to the
/// order of `config`'s model (module docs). Within each head of width `d`, transformers' row
/// `half · d/2 + j` is the permuted row `2j + half`.
fn match_rope_order(b_t: &mut [f32], target: LoraTarget, config: &ModelConfig, interleaved: bool) {
    let Some(heads) = target.rotated_heads(config) else { return };
    let model_interleaved = config.rope_style == RopeStyle::Interleaved;
    if interleaved == model_interleaved || b_t.is_empty() {
        return;
    }
    let n = heads * config.head_dim;
    let d = config.head_dim;
    let mut row = vec![0f32; n];
    for out in b_t.chunks_exact_mut(n) {
        row.copy_from_slice(out);
        for h in 0..heads {
            for half in 0..2 {
                for j in 0..d / 2 {
                    let hf = h * d + half * d / 2 + j;
                    let permuted = h * d + 2 * j + half;
                    if model_interleaved {
                        out[permuted] = row[hf];
                    } else {
                        out[hf] = row[permuted];
                    }
                }
            }
        }
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

    /// Reads a llama.cpp GGUF LoRA file (`general.type` `adapter`, `adapter.type` `lora`) for
    /// the model of `config`; refuses it as [`LoraAdapter::load_peft`] does.
    pub fn load_gguf(
        path: &Path,
        config: &ModelConfig,
        max_rank: usize,
    ) -> Result<Self, LoadError> {
        gguf::load(path, config, max_rank)
    }

    /// Reads the adapter at `path`: a PEFT directory or a GGUF file.
    pub fn load(path: &Path, config: &ModelConfig, max_rank: usize) -> Result<Self, LoadError> {
        if path.is_dir() {
            Self::load_peft(path, config, max_rank)
        } else {
            Self::load_gguf(path, config, max_rank)
        }
    }

    /// Its update multiplied by `scale` (llama-server's `--lora-scaled FILE:SCALE`); refused
    /// when the scale or a scaled value is not finite.
    pub fn scaled(mut self, scale: f32) -> Result<Self, String> {
        if !scale.is_finite() {
            return Err(format!("LoRA scale {scale} is not finite"));
        }
        for matrix in self.layers.iter_mut().flatten().flatten() {
            for v in &mut matrix.b_t {
                *v *= scale;
            }
            if matrix.b_t.iter().any(|v| !v.is_finite()) {
                return Err(format!("LoRA scale {scale} makes the update overflow f32"));
            }
        }
        Ok(self)
    }

    /// One adapter whose update is the sum of `adapters`' (llama-server applies every `--lora`
    /// at once): per projection, the ranks are stacked, `a` `[r1 + r2, k]` and `b_t`
    /// `[r1 + r2, n]`. Refused when `adapters` is empty or they are for different models.
    pub fn stack(adapters: Vec<Self>) -> Result<Self, String> {
        let mut adapters = adapters.into_iter();
        let mut sum = adapters.next().ok_or("no adapter to stack")?;
        for adapter in adapters {
            if adapter.num_layers() != sum.num_layers() {
                return Err("the adapters are for models of different depths".into());
            }
            for (to, from) in sum.layers.iter_mut().zip(adapter.layers) {
                for (to, from) in to.iter_mut().zip(from) {
                    let Some(from) = from else { continue };
                    match to {
                        None => *to = Some(from),
                        Some(to) => {
                            to.rank += from.rank;
                            to.a.extend_from_slice(&from.a);
                            to.b_t.extend_from_slice(&from.b_t);
                        }
                    }
                }
            }
        }
        Ok(sum)
    }

    fn empty(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| Default::default()).collect(),
            dtype: LoraDtype::default(),
        }
    }

    /// Keeps its matrices in `dtype` once bound (default f32: the file's values exactly; f16
    /// halves the memory).
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
