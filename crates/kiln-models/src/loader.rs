//! Loading a model from a path: today a Hugging Face directory (config.json, tokenizer files,
//! safetensors weights).

use std::path::Path;

use crate::config::Architecture;
use crate::llama::LlamaModel;
use crate::{GenerationDefaults, LoadError, Model, ModelConfig, Tokenizer, WeightStore};

/// A model with its tokenizer and generation defaults.
pub struct LoadedModel {
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    pub generation_defaults: GenerationDefaults,
}

/// Loads the model at `path` (an HF model directory).
pub fn load_model(path: &Path) -> Result<LoadedModel, LoadError> {
    if !path.is_dir() {
        return Err(LoadError::format(path, "not a model directory (expected config.json inside)"));
    }
    let config = ModelConfig::from_file(&path.join("config.json"))?;
    let (tokenizer, generation_defaults) = Tokenizer::from_dir(path)?;
    let store = WeightStore::open_dir(path)?;
    let model: Box<dyn Model> = match config.architecture {
        Architecture::Llama | Architecture::Mistral | Architecture::Qwen2 | Architecture::Qwen3 => {
            Box::new(LlamaModel::load(config, &store)?)
        }
    };
    Ok(LoadedModel { model, tokenizer, generation_defaults })
}
