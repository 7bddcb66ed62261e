//! The tokenizer half of a GGUF file's metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`)
//! as plain data, and what every GGUF backend derives from it: token kinds, end-of-generation
//! ids, defaults.
//!
//! Invariants (checked by [`GgufVocab::check`], which every constructor calls first):
//! - `tokens` is non-empty and has fewer than `u32::MAX` entries;
//! - `scores` and `token_types`, when present, have one entry per token;
//! - every special id (`bos`, `eos`, `eot`, `eom`, `unk`, `pad`) is inside the vocabulary.

/// Tokenizer metadata of a GGUF file, one field per key. The GGUF reader fills it; nothing here
/// reads files.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `"llama"` (SentencePiece-style BPE with scores and byte
    /// fallback), `"gpt2"` (byte-level BPE with merges) or `"bert"` (WordPiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a `"gpt2"` model (`"llama-bpe"`, `"qwen2"`, ...).
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.scores`: merge priority of each token (`"llama"` models).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, highest priority first (`"gpt2"` models).
    pub merges: Option<Vec<String>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub eom: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// `tokenizer.ggml.seperator_token_id` (llama.cpp's spelling): BERT's `[SEP]`.
    pub sep: Option<u32>,
    /// `tokenizer.ggml.normalizer.lowercase` / `.strip_accents` (`"bert"` vocabularies).
    pub lowercase: Option<bool>,
    pub strip_accents: Option<bool>,
    pub add_bos: Option<bool>,
    pub add_eos: Option<bool>,
    pub add_space_prefix: Option<bool>,
    pub chat_template: Option<String>,
}

/// What a token is, from `tokenizer.ggml.token_type` (absent or unknown values: `Normal`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(t: i32) -> Self {
        match t {
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Normal,
        }
    }

    /// Kinds that are cut out of the input text as whole tokens before the model runs.
    pub(crate) fn is_split_out(self) -> bool {
        matches!(self, Self::Control | Self::UserDefined | Self::Unknown)
    }

    /// Kinds that `skip_special` drops from decoded text.
    pub(crate) fn is_special(self) -> bool {
        matches!(self, Self::Control | Self::Unknown)
    }
}

/// Token texts that end generation whatever their declared type, as llama.cpp treats them.
const EOG_TEXTS: [&str; 12] = [
    "<end_of_turn>",
    "<|eot_id|>",
    "<|im_end|>",
    "<|endoftext|>",
    "</s>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<|end_of_text|>",
];

impl GgufVocab {
    /// Checks the invariants of the module docs.
    pub(crate) fn check(&self) -> Result<(), String> {
        let n = self.tokens.len();
        if n == 0 {
            return Err("tokenizer.ggml.tokens is empty".into());
        }
        if u32::try_from(n).is_err() {
            return Err(format!("{n} tokens do not fit u32 ids"));
        }
        let lens = [
            ("scores", self.scores.as_ref().map(Vec::len)),
            ("token_type", self.token_types.as_ref().map(Vec::len)),
        ];
        for (key, len) in lens {
            if let Some(len) = len
                && len != n
            {
                return Err(format!("tokenizer.ggml.{key} has {len} entries for {n} tokens"));
            }
        }
        let ids = [
            ("bos", self.bos),
            ("eos", self.eos),
            ("eot", self.eot),
            ("eom", self.eom),
            ("unknown", self.unk),
            ("padding", self.pad),
            ("seperator", self.sep),
        ];
        for (key, id) in ids {
            if let Some(id) = id
                && id as usize >= n
            {
                return Err(format!("tokenizer.ggml.{key}_token_id {id} is outside {n} tokens"));
            }
        }
        Ok(())
    }

    /// Kind of every token; tokens whose text ends generation (see [`Self::eog_ids`]) are
    /// `Control` whatever the file says, so `skip_special` hides them.
    pub(crate) fn kinds(&self) -> Vec<TokenKind> {
        let mut kinds: Vec<TokenKind> = match &self.token_types {
            Some(types) => types.iter().map(|&t| TokenKind::from_gguf(t)).collect(),
            None => vec![TokenKind::Normal; self.tokens.len()],
        };
        for (kind, text) in kinds.iter_mut().zip(&self.tokens) {
            if EOG_TEXTS.contains(&text.as_str()) {
                *kind = TokenKind::Control;
            }
        }
        kinds
    }

    /// End-of-generation ids, sorted: `eos`, `eot`, `eom`, and every token whose text is one of
    /// llama.cpp's end-of-generation texts (`<end_of_turn>`, `<|eot_id|>`, `</s>`, ...).
    pub(crate) fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = [self.eos, self.eot, self.eom].into_iter().flatten().collect();
        ids.extend(
            self.tokens
                .iter()
                .enumerate()
                .filter(|(_, t)| EOG_TEXTS.contains(&t.as_str()))
                .map(|(id, _)| id as u32),
        );
        ids.sort_unstable();
        ids.dedup();
        ids
    }
}
