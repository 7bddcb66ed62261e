//! The tokenizer of a GGUF file: its `tokenizer.*` metadata into a [`GgufVocab`], which
//! `kiln-tokenizer` turns into a [`Tokenizer`].

use kiln_tokenizer::{GgufVocab, Tokenizer};

use crate::LoadError;
use crate::gguf::GgufFile;

/// Reads the `tokenizer.ggml.*` keys (wrong types are errors, absent keys `None`).
pub fn read_vocab(file: &GgufFile) -> Result<GgufVocab, LoadError> {
    let k = |name: &str| format!("tokenizer.ggml.{name}");
    let id = |name: &str| -> Result<Option<u32>, LoadError> {
        file.u64(&k(name))?
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    LoadError::format(file.path(), format!("`{}` = {v} is too large", k(name)))
                })
            })
            .transpose()
    };
    let strings = |name: &str| file.array(&k(name), "a string", |v| v.as_str().map(String::from));
    let model = file.str(&k("model"))?.ok_or_else(|| LoadError::Tokenizer {
        path: file.path().to_path_buf(),
        message: "missing `tokenizer.ggml.model`".into(),
    })?;
    Ok(GgufVocab {
        model: model.to_string(),
        pre: file.str(&k("pre"))?.map(String::from),
        tokens: strings("tokens")?.unwrap_or_default(),
        scores: file.array(&k("scores"), "a number", super::GgufValue::as_f32)?,
        token_types: file.array(&k("token_type"), "an i32", |v| {
            v.as_i64().and_then(|t| i32::try_from(t).ok())
        })?,
        merges: strings("merges")?,
        bos: id("bos_token_id")?,
        eos: id("eos_token_id")?,
        eot: id("eot_token_id")?,
        eom: id("eom_token_id")?,
        unk: id("unknown_token_id")?,
        pad: id("padding_token_id")?,
        sep: id("seperator_token_id")?,
        lowercase: file.bool(&k("normalizer.lowercase"))?,
        strip_accents: file.bool(&k("normalizer.strip_accents"))?,
        add_bos: file.bool(&k("add_bos_token"))?,
        add_eos: file.bool(&k("add_eos_token"))?,
        add_space_prefix: file.bool(&k("add_space_prefix"))?,
        chat_template: file.str("tokenizer.chat_template")?.map(String::from),
    })
}

/// The tokenizer a GGUF file carries in its metadata.
pub fn read_tokenizer(file: &GgufFile) -> Result<Tokenizer, LoadError> {
    Tokenizer::from_gguf_vocab(read_vocab(file)?)
        .map_err(|message| LoadError::Tokenizer { path: file.path().to_path_buf(), message })
}
