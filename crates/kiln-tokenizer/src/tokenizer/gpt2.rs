//! Byte-level BPE of GGUF `"gpt2"` vocabularies (Llama 3, Qwen 2/3, GPT-2 style), built as a
//! `tokenizers::Tokenizer` so the Hugging Face backend serves it: BPE model from tokens and
//! merges, pre-tokenizer = the regex split named by `tokenizer.ggml.pre` then byte-level mapping,
//! byte-level decoder, control/unknown tokens as special added tokens and user-defined tokens as
//! plain added tokens (both matched whole in the input; only the special ones are skipped by
//! `skip_special`).
//!
//! Invariants:
//! - no normalizer runs (llama.cpp applies none; Qwen's HF files add NFC, so text that is not
//!   NFC may tokenize differently from transformers);
//! - `pre` absent means `"default"`, which like llama.cpp's fallback uses the GPT-2 split; an
//!   unknown `pre` is an error rather than a silent guess;
//! - `ignore_merges` (a word that is a whole token skips BPE) is on for the Llama 3 family only,
//!   as in llama.cpp.

use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::gguf_vocab::{GgufVocab, TokenKind};

const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Names of `tokenizer.ggml.pre` we know, with their split regex and `ignore_merges`.
const PRE_TOKENIZERS: [(&[&str], &str, bool); 3] = [
    (&["llama-bpe", "llama3", "llama-v3"], LLAMA3, true),
    (&["qwen2", "deepseek-r1-qwen"], QWEN2, false),
    (&["default", "gpt2", "gpt-2"], GPT2, false),
];

/// The split regex and `ignore_merges` of a pre-tokenizer name.
fn pre_tokenizer(pre: Option<&str>) -> Result<(&'static str, bool), String> {
    let name = pre.unwrap_or("default");
    PRE_TOKENIZERS
        .iter()
        .find(|(names, ..)| names.contains(&name))
        .map(|&(_, regex, ignore_merges)| (regex, ignore_merges))
        .ok_or_else(|| {
            let known: Vec<&str> =
                PRE_TOKENIZERS.iter().flat_map(|p| p.0.iter().copied()).collect();
            format!("unsupported tokenizer.ggml.pre `{name}` (supported: {})", known.join(", "))
        })
}

/// Whether `tokenizer.ggml.pre` names the Llama 3 family (which adds BOS by default).
pub(crate) fn is_llama3(pre: Option<&str>) -> bool {
    pre.is_some_and(|p| PRE_TOKENIZERS[0].0.contains(&p))
}

/// Builds the HF tokenizer of a `"gpt2"` vocabulary; `kinds` has one entry per token.
pub(crate) fn build(
    vocab: &GgufVocab,
    kinds: &[TokenKind],
) -> Result<tokenizers::Tokenizer, String> {
    let (regex, ignore_merges) = pre_tokenizer(vocab.pre.as_deref())?;
    let token_ids: Vocab =
        vocab.tokens.iter().enumerate().map(|(id, t)| (t.clone(), id as u32)).collect();
    let merges = vocab
        .merges
        .as_deref()
        .ok_or("tokenizer.ggml.merges is missing (required by gpt2 tokenizers)")?
        .iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| format!("tokenizer.ggml.merges[{i}] `{m}` is not `left right`"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(token_ids, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| format!("building the BPE model: {e}"))?;
    let split =
        Split::new(SplitPattern::Regex(regex.into()), SplitDelimiterBehavior::Isolated, false)
            .map_err(|e| format!("pre-tokenizer regex: {e}"))?;
    let pre = Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)),
    ]);
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(pre));
    tok.with_decoder(Some(ByteLevel::default()));
    let added = |special: bool| -> Vec<AddedToken> {
        vocab
            .tokens
            .iter()
            .zip(kinds)
            .filter(|(t, k)| !t.is_empty() && k.is_split_out() && k.is_special() == special)
            .map(|(t, _)| AddedToken::from(t.clone(), special))
            .collect()
    };
    tok.add_special_tokens(&added(true));
    tok.add_tokens(&added(false));
    Ok(tok)
}
