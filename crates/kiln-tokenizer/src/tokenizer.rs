//! The tokenizer of a model, with two backends:
//! - Hugging Face `tokenizers`: a model directory's `tokenizer.json` (plus `tokenizer_config.json`
//!   for BOS/EOS, `add_bos_token`, chat template, and `generation_config.json` for EOS ids and
//!   sampling defaults), or a GGUF `"gpt2"` vocabulary built programmatically (`gpt2`);
//! - our SentencePiece-style BPE for GGUF `"llama"` vocabularies (`spm`).
//!
//! Invariants:
//! - the public API (encode / decode / decode_stream / eos_token_ids / bos_token_id /
//!   chat_template) behaves the same whatever the backend;
//! - special tokens in the input text are matched as whole tokens (parse_special), except
//!   inside the literal ranges of [`Tokenizer::encode_with_literals`] (chat message content);
//! - `encode(text, true)` prepends BOS when `add_bos_token` asks for it, unless the text already
//!   starts with it, and appends EOS when a GGUF file sets `add_eos_token`;
//! - `eos_token_ids` is sorted and deduplicated; `eos_token_id` (the one EOS the config names)
//!   is one of them.

mod decode_stream;
mod gguf_vocab;
mod gpt2;
mod literal;
mod special_split;
mod spm;
#[cfg(test)]
mod tests;
mod token_bytes;
mod wpm;

use std::path::Path;

use serde_json::Value;

use crate::TokenizerError;

pub use decode_stream::DecodeStream;
pub use gguf_vocab::GgufVocab;
pub use token_bytes::SPECIAL_TOKEN_MARKER;

/// Sampling defaults a model ships in `generation_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub repetition_penalty: Option<f32>,
}

impl GenerationDefaults {
    /// The sampling fields of a parsed `generation_config.json`.
    pub fn from_json(gen_cfg: &Value) -> Self {
        let num = |k: &str| gen_cfg.get(k).and_then(Value::as_f64).map(|v| v as f32);
        Self {
            temperature: num("temperature"),
            top_p: num("top_p"),
            top_k: gen_cfg.get("top_k").and_then(Value::as_u64).map(|v| v as usize),
            repetition_penalty: num("repetition_penalty"),
        }
    }

    /// The defaults of `dir/generation_config.json` (all `None` if the file is absent).
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        Ok(read_json(&dir.join("generation_config.json"))?
            .map(|v| Self::from_json(&v))
            .unwrap_or_default())
    }
}

pub struct Tokenizer {
    backend: Backend,
    bos_token_id: Option<u32>,
    add_bos_token: Option<bool>,
    /// EOS to append on `encode(_, true)` (GGUF `add_eos_token`).
    append_eos: Option<u32>,
    /// The EOS the tokenizer names itself (tokenizer_config.json `eos_token`, GGUF
    /// `tokenizer.ggml.eos_token_id`), as opposed to every id that ends generation.
    eos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    chat_template: Option<String>,
    /// Where `chat_template` was read from (a file name or GGUF key).
    chat_template_origin: &'static str,
    /// Hugging Face backend: what [`Tokenizer::encode_with_literals`] needs, made on first use.
    hf_literal: std::sync::OnceLock<literal::HfLiteral>,
}

enum Backend {
    Hf(Box<tokenizers::Tokenizer>),
    Spm(Box<spm::Spm>),
}

/// `"<s>"` or `{"content": "<s>", ...}`.
fn token_content(v: &Value) -> Option<&str> {
    v.as_str().or_else(|| v.get("content").and_then(Value::as_str))
}

fn io_error(path: &Path, source: std::io::Error) -> TokenizerError {
    TokenizerError::Io { path: path.to_path_buf(), source }
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| io_error(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| TokenizerError::Format {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })
}

impl Tokenizer {
    /// Loads the tokenizer files of an HF directory; returns it with the generation defaults.
    pub fn from_dir(dir: &Path) -> Result<(Self, GenerationDefaults), TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TokenizerError::Missing { path });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| {
            TokenizerError::Tokenizer { path: path.clone(), message: e.to_string() }
        })?;
        let mut tok = Self {
            bos_token_id: None,
            add_bos_token: None,
            append_eos: None,
            eos_token_id: None,
            eos_token_ids: Vec::new(),
            chat_template: None,
            chat_template_origin: "",
            hf_literal: std::sync::OnceLock::new(),
            backend: Backend::Hf(Box::new(inner)),
        };
        if let Some(cfg) = read_json(&dir.join("tokenizer_config.json"))? {
            tok.bos_token_id =
                cfg.get("bos_token").and_then(token_content).and_then(|t| tok.token_to_id(t));
            tok.add_bos_token = cfg.get("add_bos_token").and_then(Value::as_bool);
            if let Some(eos) =
                cfg.get("eos_token").and_then(token_content).and_then(|t| tok.token_to_id(t))
            {
                tok.eos_token_id = Some(eos);
                tok.eos_token_ids.push(eos);
            }
            tok.chat_template = cfg.get("chat_template").and_then(Value::as_str).map(String::from);
            tok.chat_template_origin = "tokenizer_config.json";
        }
        let template_file = dir.join("chat_template.jinja");
        if template_file.exists() {
            tok.chat_template = Some(
                std::fs::read_to_string(&template_file).map_err(|e| io_error(&template_file, e))?,
            );
            tok.chat_template_origin = "chat_template.jinja";
        }
        let mut defaults = GenerationDefaults::default();
        let gen_path = dir.join("generation_config.json");
        if let Some(gen_cfg) = read_json(&gen_path)? {
            let vocab_size = tok.vocab_size();
            let ids: Vec<&Value> = match gen_cfg.get("eos_token_id") {
                Some(Value::Array(ids)) => ids.iter().collect(),
                Some(Value::Null) | None => Vec::new(),
                Some(v) => vec![v],
            };
            for v in ids {
                let id = v
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .filter(|&id| (id as usize) < vocab_size)
                    .ok_or_else(|| TokenizerError::Format {
                        path: gen_path.clone(),
                        message: format!(
                            "eos_token_id {v} is not a token id of the vocabulary ({vocab_size} \
                             tokens)"
                        ),
                    })?;
                tok.eos_token_ids.push(id);
            }
            defaults = GenerationDefaults::from_json(&gen_cfg);
        }
        tok.eos_token_ids.sort_unstable();
        tok.eos_token_ids.dedup();
        Ok((tok, defaults))
    }

    /// Builds the tokenizer of a GGUF file from its metadata. `"llama"` vocabularies get our
    /// SentencePiece-style backend, `"gpt2"` ones a byte-level BPE `tokenizers::Tokenizer`.
    /// Defaults where the file is silent, as llama.cpp: `"llama"`: BOS 1, EOS 2, unknown 0, BOS
    /// added, space prefix added; `"gpt2"`: BOS added only for the Llama 3 pre-tokenizer.
    /// Errors name the offending key; the caller adds the file path.
    pub fn from_gguf_vocab(mut vocab: GgufVocab) -> Result<Self, String> {
        let n = vocab.tokens.len() as u32;
        let spm = match vocab.model.as_str() {
            "llama" => true,
            "gpt2" | "bert" => false,
            other => {
                return Err(format!(
                    "unsupported tokenizer.ggml.model `{other}` (supported: llama, gpt2, bert)"
                ));
            }
        };
        let wpm = vocab.model == "bert";
        if spm {
            let default = |id: u32| (id < n).then_some(id);
            vocab.bos = vocab.bos.or_else(|| default(1));
            vocab.eos = vocab.eos.or_else(|| default(2));
            vocab.unk = vocab.unk.or_else(|| default(0));
        }
        vocab.check()?;
        let kinds = vocab.kinds();
        // A WordPiece vocabulary's [CLS] and [SEP] come from its post-processor.
        let add_bos = !wpm && vocab.add_bos.unwrap_or(spm || gpt2::is_llama3(vocab.pre.as_deref()));
        let append_eos = vocab.eos.filter(|_| !wpm && vocab.add_eos == Some(true));
        let eos_token_ids = vocab.eog_ids();
        let backend = if spm {
            let scores = vocab.scores.take().unwrap_or_else(|| vec![0.0; vocab.tokens.len()]);
            Backend::Spm(Box::new(spm::Spm::new(
                std::mem::take(&mut vocab.tokens),
                kinds,
                scores,
                vocab.unk,
                vocab.add_space_prefix.unwrap_or(true),
            )))
        } else if wpm {
            Backend::Hf(Box::new(wpm::build(&vocab, &kinds)?))
        } else {
            Backend::Hf(Box::new(gpt2::build(&vocab, &kinds)?))
        };
        Ok(Self {
            backend,
            bos_token_id: vocab.bos,
            add_bos_token: Some(add_bos),
            append_eos,
            eos_token_id: vocab.eos,
            eos_token_ids,
            chat_template: vocab.chat_template,
            chat_template_origin: "GGUF tokenizer.chat_template",
            hf_literal: std::sync::OnceLock::new(),
        })
    }

    /// Id of a token text, if it is in the vocabulary.
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf(t) => t.token_to_id(text),
            Backend::Spm(s) => s.token_to_id(text),
        }
    }

    /// Token ids of `text`; special token texts in it become their tokens. With
    /// `add_special_tokens` the HF post-processor runs (BOS etc.), a BOS is prepended if
    /// `add_bos_token` asks for one that is not there yet, and a GGUF `add_eos_token` appends EOS.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, String> {
        let mut ids = match &self.backend {
            Backend::Hf(t) => {
                t.encode(text, add_special_tokens).map_err(|e| e.to_string())?.get_ids().to_vec()
            }
            Backend::Spm(s) => {
                let mut ids = Vec::with_capacity(text.len() / 3 + 2);
                s.encode(text, &mut ids)?;
                ids
            }
        };
        if add_special_tokens {
            self.add_bos_eos(&mut ids);
        }
        Ok(ids)
    }

    /// [`Tokenizer::encode`] of at most `max_len` tokens, cut as transformers'
    /// `tokenizer(text, truncation=True, max_length=max_len)` cuts on the right: the text's
    /// first tokens, then the special tokens the post-processor adds (an encoder's `[CLS] …
    /// [SEP]` stays whole). Without special tokens, or with a tokenizer that has no HF
    /// post-processor, the first `max_len` tokens.
    pub fn encode_truncated(
        &self,
        text: &str,
        add_special_tokens: bool,
        max_len: usize,
    ) -> Result<Vec<u32>, String> {
        use tokenizers::PostProcessor as _;
        let Backend::Hf(t) = &self.backend else {
            let mut ids = self.encode(text, add_special_tokens)?;
            ids.truncate(max_len);
            return Ok(ids);
        };
        let added = match (add_special_tokens, t.get_post_processor()) {
            (true, Some(p)) => p.added_tokens(false),
            _ => 0,
        };
        let mut content = t.encode(text, false).map_err(|e| e.to_string())?;
        let room = max_len.checked_sub(added).filter(|r| *r > 0).ok_or_else(|| {
            format!("{max_len} tokens leave no room for text beside the {added} special tokens")
        })?;
        content.truncate(room, 0, tokenizers::TruncationDirection::Right);
        let ids = t
            .post_process(content, None, add_special_tokens)
            .map_err(|e| e.to_string())?
            .get_ids()
            .to_vec();
        Ok(ids)
    }

    /// Token ids of the pair `(first, second)` as transformers' `tokenizer(first, second)`
    /// encodes it (a cross-encoder's input): the HF post-processor's pair template with
    /// `add_special_tokens`, else the two encodings back to back. Only Hugging Face tokenizers
    /// define a pair encoding; a GGUF file's tokenizer is refused.
    pub fn encode_pair(
        &self,
        first: &str,
        second: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, String> {
        let Backend::Hf(t) = &self.backend else {
            return Err("encoding a text pair needs the model's Hugging Face tokenizer \
                        (tokenizer.json); a GGUF file's tokenizer defines no pair encoding"
                .into());
        };
        let encoding = t.encode((first, second), add_special_tokens).map_err(|e| e.to_string())?;
        let mut ids = encoding.get_ids().to_vec();
        if add_special_tokens {
            self.add_bos_eos(&mut ids);
        }
        Ok(ids)
    }

    /// [`Tokenizer::encode_pair`] of at most `max_len` tokens, cut as transformers'
    /// `tokenizer(first, second, truncation=True, max_length=max_len)` cuts (`longest_first`:
    /// the longer text loses tokens from its end until both fit beside the pair template's
    /// special tokens, which stay whole).
    pub fn encode_pair_truncated(
        &self,
        first: &str,
        second: &str,
        add_special_tokens: bool,
        max_len: usize,
    ) -> Result<Vec<u32>, String> {
        use tokenizers::PostProcessor as _;
        use tokenizers::utils::truncation::{
            TruncationDirection, TruncationParams, TruncationStrategy, truncate_encodings,
        };
        let Backend::Hf(t) = &self.backend else {
            return self.encode_pair(first, second, add_special_tokens);
        };
        let added = match (add_special_tokens, t.get_post_processor()) {
            (true, Some(p)) => p.added_tokens(true),
            _ => 0,
        };
        let room = max_len.checked_sub(added).filter(|r| *r > 1).ok_or_else(|| {
            format!(
                "{max_len} tokens leave no room for two texts beside the {added} special tokens"
            )
        })?;
        let encode = |text: &str| t.encode(text, false).map_err(|e| e.to_string());
        let params = TruncationParams {
            max_length: room,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        };
        let (a, b) = truncate_encodings(encode(first)?, Some(encode(second)?), &params)
            .map_err(|e| e.to_string())?;
        let ids = t.post_process(a, b, add_special_tokens).map_err(|e| e.to_string())?;
        let mut ids = ids.get_ids().to_vec();
        if add_special_tokens {
            self.add_bos_eos(&mut ids);
        }
        Ok(ids)
    }

    /// Prepends BOS when `add_bos_token` asks for one that is not there yet; appends a GGUF
    /// `add_eos_token` EOS.
    fn add_bos_eos(&self, ids: &mut Vec<u32>) {
        if self.add_bos_token == Some(true)
            && let Some(bos) = self.bos_token_id
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        ids.extend(self.append_eos);
    }

    /// Text of `ids`; invalid UTF-8 becomes U+FFFD; `skip_special_tokens` drops control tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, String> {
        match &self.backend {
            Backend::Hf(t) => t.decode(ids, skip_special_tokens).map_err(|e| e.to_string()),
            Backend::Spm(s) => Ok(s.decode(ids, skip_special_tokens)),
        }
    }

    /// An incremental decoder for streaming one sequence's output (see [`DecodeStream`]).
    pub fn decode_stream(&self, skip_special_tokens: bool) -> DecodeStream<'_> {
        DecodeStream::new(self, skip_special_tokens)
    }

    /// Text of the vocabulary entry `id`, special tokens included (`"<bos>"`, `"<|im_end|>"`);
    /// `None` outside the vocabulary. This is the raw entry, not decoded text: ordinary tokens
    /// keep their encoded form (`"▁the"`, byte-level `"Ġthe"`), so use it for special tokens
    /// such as the chat template's `bos_token` / `eos_token`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Hf(t) => t.id_to_token(id),
            Backend::Spm(s) => s.piece(id).map(String::from),
        }
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf(t) => t.get_vocab_size(true),
            Backend::Spm(s) => s.len(),
        }
    }

    /// Whether `id` is an ordinary text token: not a control, unknown, unused, byte-fallback
    /// or user-defined token (GGUF), not a special added token (HF). Benchmarks draw random
    /// prompts from these.
    pub fn is_ordinary(&self, id: u32) -> bool {
        match &self.backend {
            Backend::Hf(t) => t
                .id_to_token(id)
                .is_some_and(|text| !t.get_added_vocabulary().is_special_token(&text)),
            Backend::Spm(s) => s.kind(id) == Some(gguf_vocab::TokenKind::Normal),
        }
    }

    /// The EOS token the tokenizer's own configuration names (tokenizer_config.json
    /// `eos_token`, GGUF `tokenizer.ggml.eos_token_id`); one of [`Self::eos_token_ids`].
    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token_id
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

    /// Where [`Self::chat_template`] was read from: `"tokenizer_config.json"`,
    /// `"chat_template.jinja"` or `"GGUF tokenizer.chat_template"`; `None` without a template.
    pub fn chat_template_origin(&self) -> Option<&'static str> {
        self.chat_template.as_ref().map(|_| self.chat_template_origin)
    }
}
