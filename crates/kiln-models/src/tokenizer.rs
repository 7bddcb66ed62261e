//! Tokenizer of a Hugging Face model directory: `tokenizer.json` through the `tokenizers`
//! crate, plus `tokenizer_config.json` (BOS/EOS, `add_bos_token`, chat template) and
//! `generation_config.json` (EOS ids, default sampling values).

use std::path::Path;

use serde_json::Value;

use crate::LoadError;

/// Sampling defaults a model ships in `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos_token_id: Option<u32>,
    add_bos_token: Option<bool>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_content(v: &Value) -> Option<&str> {
    v.as_str().or_else(|| v.get("content").and_then(Value::as_str))
}

fn read_json(path: &Path) -> Result<Option<Value>, LoadError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| LoadError::io(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| LoadError::format(path, format!("not valid JSON: {e}")))
}

impl Tokenizer {
    /// Loads the tokenizer files of an HF directory; returns it with the generation defaults.
    pub fn from_dir(dir: &Path) -> Result<(Self, GenerationDefaults), LoadError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(LoadError::io(&path, std::io::ErrorKind::NotFound.into()));
        }
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| LoadError::Tokenizer { path: path.clone(), message: e.to_string() })?;
        let mut tok = Self {
            inner,
            bos_token_id: None,
            add_bos_token: None,
            eos_token_ids: Vec::new(),
            chat_template: None,
        };
        if let Some(cfg) = read_json(&dir.join("tokenizer_config.json"))? {
            tok.bos_token_id =
                cfg.get("bos_token").and_then(token_content).and_then(|t| tok.inner.token_to_id(t));
            tok.add_bos_token = cfg.get("add_bos_token").and_then(Value::as_bool);
            if let Some(eos) =
                cfg.get("eos_token").and_then(token_content).and_then(|t| tok.inner.token_to_id(t))
            {
                tok.eos_token_ids.push(eos);
            }
            tok.chat_template = cfg.get("chat_template").and_then(Value::as_str).map(String::from);
        }
        let template_file = dir.join("chat_template.jinja");
        if template_file.exists() {
            tok.chat_template = Some(
                std::fs::read_to_string(&template_file)
                    .map_err(|e| LoadError::io(&template_file, e))?,
            );
        }
        let mut defaults = GenerationDefaults::default();
        if let Some(gen_cfg) = read_json(&dir.join("generation_config.json"))? {
            match gen_cfg.get("eos_token_id") {
                Some(Value::Array(ids)) => {
                    tok.eos_token_ids
                        .extend(ids.iter().filter_map(Value::as_u64).map(|v| v as u32));
                }
                Some(v) => tok.eos_token_ids.extend(v.as_u64().map(|v| v as u32)),
                None => {}
            }
            let num = |k: &str| gen_cfg.get(k).and_then(Value::as_f64).map(|v| v as f32);
            defaults = GenerationDefaults {
                temperature: num("temperature"),
                top_p: num("top_p"),
                top_k: gen_cfg.get("top_k").and_then(Value::as_u64).map(|v| v as usize),
                repetition_penalty: num("repetition_penalty"),
            };
        }
        tok.eos_token_ids.sort_unstable();
        tok.eos_token_ids.dedup();
        Ok((tok, defaults))
    }

    /// Token ids of `text`. With `add_special_tokens` the tokenizer's post-processor runs (BOS
    /// etc.), and a BOS is prepended if `add_bos_token` asks for one the processor did not add.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let enc = self.inner.encode(text, add_special_tokens).map_err(|e| e.to_string())?;
        let mut ids = enc.get_ids().to_vec();
        if add_special_tokens
            && self.add_bos_token == Some(true)
            && let Some(bos) = self.bos_token_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| e.to_string())
    }

    /// Ids that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// The `tokenizers` object, for incremental decoding.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}
