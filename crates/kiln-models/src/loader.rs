//! Loading a model from a path: a Hugging Face directory (config.json, tokenizer files,
//! safetensors weights) or a single GGUF file (config, tokenizer and weights in one).

use std::path::Path;

use crate::config::Architecture;
use crate::decoder::DecoderModel;
use crate::gguf::GgufFile;
use crate::names::Naming;
use crate::weights::Weights;
use crate::{GenerationDefaults, LoadError, Model, ModelConfig, Tokenizer, WeightStore};

/// A model with its tokenizer and generation defaults.
pub struct LoadedModel {
    pub model: Box<dyn Model>,
    pub tokenizer: Tokenizer,
    pub generation_defaults: GenerationDefaults,
}

/// Loads the model at `path`: an HF model directory or a `.gguf` file.
pub fn load_model(path: &Path) -> Result<LoadedModel, LoadError> {
    if path.is_file() {
        return load_gguf(path);
    }
    if !path.is_dir() {
        return Err(LoadError::format(
            path,
            "not found: expected a model directory (config.json inside) or a .gguf file",
        ));
    }
    let config = ModelConfig::from_file(&path.join("config.json"))?;
    let (tokenizer, generation_defaults) = Tokenizer::from_dir(path)?;
    let store = WeightStore::open_dir(path)?;
    let naming = Naming::Hf { sandwich: config.architecture == Architecture::Gemma3 };
    let model = DecoderModel::load(config, &Weights { source: &store, naming })?;
    Ok(LoadedModel { model: Box::new(model), tokenizer, generation_defaults })
}

fn load_gguf(path: &Path) -> Result<LoadedModel, LoadError> {
    let file = GgufFile::open(path)?;
    let config = ModelConfig::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let model = DecoderModel::load(config, &Weights { source: &file, naming: Naming::Gguf })?;
    Ok(LoadedModel {
        model: Box::new(model),
        tokenizer,
        generation_defaults: GenerationDefaults::default(),
    })
}
