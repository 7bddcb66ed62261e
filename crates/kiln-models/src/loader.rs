//! Loading a model from a path: a Hugging Face directory (config.json, tokenizer files,
//! safetensors weights) or a single GGUF file (config, tokenizer and weights in one).

use std::path::Path;
use std::sync::Arc;

use kiln_backend::{Backend, GgmlType};
use kiln_tokenizer::{GenerationDefaults, Tokenizer};

use crate::config::OutputHead;
use crate::decoder::DecoderModel;
use crate::encoder::{EncoderModel, EncoderNames};
use crate::family::Architecture;
use crate::gguf::{GgufFile, read_tokenizer};
use crate::names::Naming;
use crate::packed::PackedWeights;
use crate::weights::{
    FusedParts, Renamed, WeightSource, Weights, text_model_layout, text_model_name,
};
use crate::{Classifier, LoadError, Model, ModelConfig, WeightStore};

/// A model on backend `B` with its tokenizer and generation defaults.
pub struct LoadedModel<B: Backend> {
    pub model: Box<dyn Model<B>>,
    pub tokenizer: Tokenizer,
    pub generation_defaults: GenerationDefaults,
    /// A sequence classifier's head (`*ForSequenceClassification`), read to the host.
    pub classifier: Option<Classifier>,
}

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Quantize float weight matrices on load (`q8_0`, `q4_K`, `q5_0`, ...); already
    /// quantized GGUF tensors are kept as they are. A float type (`f32`) instead converts
    /// every matrix to it, dequantizing GGUF tensors. Rows that are not a whole number of
    /// K-quant blocks (256) fall back to `q5_0` / `q8_0` as llama.cpp does.
    pub quantization: Option<GgmlType>,
    /// Load for pooling (embeddings): no LM head is read and steps hand back final hidden
    /// states. A base model without a head (`Qwen3Model`) loads only this way.
    pub pooling: bool,
}

/// Loads the model at `path` (an HF model directory or a `.gguf` file) onto `backend`.
pub fn load_model<B: Backend>(path: &Path, backend: &Arc<B>) -> Result<LoadedModel<B>, LoadError> {
    load_model_with(path, &LoadOptions::default(), backend)
}

/// [`load_model`] with options.
pub fn load_model_with<B: Backend>(
    path: &Path,
    options: &LoadOptions,
    backend: &Arc<B>,
) -> Result<LoadedModel<B>, LoadError> {
    if path.is_file() {
        return load_gguf(path, options, backend);
    }
    if !path.is_dir() {
        return Err(LoadError::format(
            path,
            "not found: expected a model directory (config.json inside) or a .gguf file",
        ));
    }
    let mut config = ModelConfig::from_file(&path.join("config.json"))?;
    refuse_generating_encoder(path, &config, options)?;
    match config.head {
        OutputHead::None if !options.pooling => {
            return Err(LoadError::format(
                path,
                "the checkpoint is a base model without an LM head (an embedding model): it \
                 serves pooling only (`kiln serve --runner pooling`)",
            ));
        }
        OutputHead::Classifier { .. } if !options.pooling => {
            return Err(LoadError::format(
                path,
                "the checkpoint is a sequence classifier (a cross-encoder): it serves scores \
                 and labels only (`kiln serve --runner pooling`: /score, /rerank, /classify)",
            ));
        }
        _ => {}
    }
    let (tokenizer, generation_defaults) = Tokenizer::from_dir(path)?;
    let store = WeightStore::open_dir(path)?;
    if config.encoder.is_some() {
        set_segment_separator(&mut config, &tokenizer, "[SEP]");
        let names = EncoderNames::of_hf(&store);
        let weights = Weights {
            source: &store,
            naming: Naming::Hf(config.architecture),
            backend: &**backend,
            quantize: options.quantization,
        };
        let classifier = match config.head {
            OutputHead::Classifier { num_labels } => Some(
                encoder_classifier(&store, &names, &config, num_labels)?
                    .with_labels(&id2label(path)),
            ),
            _ => None,
        };
        let model = EncoderModel::load(config, &weights, &names, Arc::clone(backend))?;
        return Ok(LoadedModel {
            model: Box::new(model),
            tokenizer,
            generation_defaults,
            classifier,
        });
    }
    let naming = Naming::Hf(config.architecture);
    // AWQ / GPTQ / compressed-tensors linear layers, repacked into block types as they are
    // read.
    let packed = config.packed.map(|quant| PackedWeights { inner: &store, quant });
    let stored: &dyn WeightSource = match &packed {
        Some(p) => p,
        None => &store,
    };
    // A multimodal checkpoint's text model (Gemma3ForConditionalGeneration) is read under
    // its prefix.
    let text_model = text_model_layout(stored).map(|(model, head)| Renamed {
        inner: stored,
        rename: move |name: &str| text_model_name(model, head, name),
    });
    let mut source: &dyn WeightSource = match &text_model {
        Some(t) => t,
        None => stored,
    };
    // Phi-3's fused projections, read as their parts.
    let fused = (config.architecture == Architecture::Phi3).then(|| FusedParts {
        inner: source,
        parts: crate::family::phi3::fused_parts(&config, naming),
    });
    if let Some(f) = &fused {
        source = f;
    }
    let weights = Weights { source, naming, backend: &**backend, quantize: options.quantization };
    let classifier = match config.head {
        OutputHead::Classifier { num_labels } => {
            let (name, h) = ("score.weight", config.hidden_size);
            let weight = source
                .matrix(name, num_labels, h)?
                .to_f32_vec()
                .ok_or_else(|| LoadError::format(path, format!("{name}: not a float tensor")))?;
            Classifier::new(num_labels, weight).map(|c| c.with_labels(&id2label(path)))
        }
        _ => None,
    };
    let model = DecoderModel::load(config, &weights, Arc::clone(backend), !options.pooling)?;
    Ok(LoadedModel { model: Box::new(model), tokenizer, generation_defaults, classifier })
}

/// An encoder runs for pooling only: refused when loaded for generation.
fn refuse_generating_encoder(
    path: &Path,
    config: &ModelConfig,
    options: &LoadOptions,
) -> Result<(), LoadError> {
    if config.encoder.is_some() && !options.pooling {
        return Err(LoadError::format(
            path,
            format!(
                "{:?} is an encoder (embeddings, scores): it serves pooling only (`kiln serve \
                 --runner pooling`), not generation",
                config.architecture
            ),
        ));
    }
    Ok(())
}

/// With two or more token types, the tokenizer's `separator` token ends the first segment
/// ([`crate::EncoderConfig::segment_separator`]).
fn set_segment_separator(config: &mut ModelConfig, tokenizer: &Tokenizer, separator: &str) {
    if let Some(encoder) = &mut config.encoder
        && encoder.type_vocab_size > 1
    {
        encoder.segment_separator = tokenizer.token_to_id(separator);
    }
}

/// An encoder's classifier head, read to the host: BERT's pooler (`pooler.dense`, tanh) then
/// `classifier`; RoBERTa's `classifier.dense` (tanh) then `classifier.out_proj`.
fn encoder_classifier(
    source: &dyn WeightSource,
    names: &EncoderNames,
    config: &ModelConfig,
    num_labels: usize,
) -> Result<Classifier, LoadError> {
    let h = config.hidden_size;
    let (dense, out) = match (config.architecture, names) {
        (Architecture::Bert, EncoderNames::Hf { prefix }) => {
            (format!("{prefix}pooler.dense"), "classifier".to_string())
        }
        _ => ("classifier.dense".to_string(), "classifier.out_proj".to_string()),
    };
    let floats = |name: String, rows: usize, cols: usize| -> Result<Vec<f32>, LoadError> {
        source.matrix(&name, rows, cols)?.to_f32_vec().ok_or_else(|| LoadError::Backend {
            name,
            message: "a classifier matrix must be a float tensor".into(),
        })
    };
    let head = Classifier::new(num_labels, floats(format!("{out}.weight"), num_labels, h)?)
        .ok_or_else(|| LoadError::Backend {
            name: out.clone(),
            message: format!("expected [{num_labels}, {h}]"),
        })?;
    Ok(head.with_bias(source.vector(&format!("{out}.bias"), num_labels)?).with_pre_dense(
        floats(format!("{dense}.weight"), h, h)?,
        source.vector(&format!("{dense}.bias"), h)?,
    ))
}

/// The `id2label` map of the checkpoint at `path` (empty when `config.json` has none; the file
/// itself was read and checked already).
fn id2label(path: &Path) -> serde_json::Map<String, serde_json::Value> {
    let text = std::fs::read_to_string(path.join("config.json")).unwrap_or_default();
    let config: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
    config.get("id2label").and_then(serde_json::Value::as_object).cloned().unwrap_or_default()
}

/// Loads only the tokenizer of the model at `path` (an HF directory or a `.gguf` file),
/// without its weights.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, LoadError> {
    if path.is_file() {
        return read_tokenizer(&GgufFile::open(path)?);
    }
    Ok(Tokenizer::from_dir(path)?.0)
}

fn load_gguf<B: Backend>(
    path: &Path,
    options: &LoadOptions,
    backend: &Arc<B>,
) -> Result<LoadedModel<B>, LoadError> {
    let file = GgufFile::open(path)?;
    let mut config = ModelConfig::from_gguf(&file)?;
    refuse_generating_encoder(path, &config, options)?;
    let tokenizer = read_tokenizer(&file)?;
    let num_tokens =
        file.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map_or(0, <[_]>::len);
    if num_tokens > config.vocab_size {
        return Err(LoadError::format(
            path,
            format!(
                "the tokenizer has {num_tokens} tokens but token_embd.weight has only {} rows",
                config.vocab_size
            ),
        ));
    }
    // Phi-3's fused projections (`attn_qkv`, `ffn_up`), read as their parts.
    let fused = (config.architecture == Architecture::Phi3).then(|| FusedParts {
        inner: &file,
        parts: crate::family::phi3::fused_parts(&config, Naming::Gguf),
    });
    // gpt-oss's pre-MLP norm is `post_attention_norm`.
    let renamed = (config.architecture == Architecture::GptOss)
        .then_some(Renamed { inner: &file, rename: crate::family::gpt_oss::gguf_name });
    let source: &dyn WeightSource = match (&fused, &renamed) {
        (Some(f), _) => f,
        (None, Some(r)) => r,
        (None, None) => &file,
    };
    let weights = Weights {
        source,
        naming: Naming::Gguf,
        backend: &**backend,
        quantize: options.quantization,
    };
    if config.encoder.is_some() {
        set_segment_separator(&mut config, &tokenizer, "[SEP]");
        let model = EncoderModel::load(config, &weights, &EncoderNames::Gguf, Arc::clone(backend))?;
        return Ok(LoadedModel {
            model: Box::new(model),
            tokenizer,
            generation_defaults: GenerationDefaults::default(),
            classifier: None,
        });
    }
    let model = DecoderModel::load(config, &weights, Arc::clone(backend), !options.pooling)?;
    Ok(LoadedModel {
        model: Box::new(model),
        tokenizer,
        generation_defaults: GenerationDefaults::default(),
        classifier: None,
    })
}
