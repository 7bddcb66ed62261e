//! Tokenizers of kiln: text to token ids and back, for every model kiln loads.
//!
//! - [`Tokenizer::from_dir`]: a Hugging Face model directory (`tokenizer.json`,
//!   `tokenizer_config.json`, `chat_template.jinja`, `generation_config.json`);
//! - [`Tokenizer::from_gguf_vocab`]: a GGUF file's tokenizer metadata as plain data
//!   ([`GgufVocab`]); reading the GGUF file itself is the model loader's business, so this
//!   crate parses no model files and links no kernels;
//! - [`DecodeStream`]: incremental detokenization for streaming;
//! - [`Tokenizer::token_bytes`]: the bytes of every token, for grammar-constrained decoding.
//!
//! Invariants: the public API behaves the same whatever the backend; errors name the file
//! ([`TokenizerError`]) or, for GGUF metadata, the key.

mod error;
mod tokenizer;

pub use error::TokenizerError;
pub use tokenizer::{DecodeStream, GenerationDefaults, GgufVocab, SPECIAL_TOKEN_MARKER, Tokenizer};
