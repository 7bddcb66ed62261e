//! The bytes each token id stands for in output text, for grammar engines (structured outputs)
//! that walk a trie of the vocabulary.
//!
//! Invariants:
//! - an ordinary token maps to the bytes it adds when decoded mid-text: SentencePiece '▁' is a
//!   space, a `<0xXX>` byte token its one byte, a byte-level BPE token its bytes through
//!   GPT-2's byte-to-character table (so a token may be an incomplete UTF-8 sequence);
//! - a special token (control, unknown, unused; HF special added tokens) maps to
//!   [`SPECIAL_TOKEN_MARKER`] followed by its text: `0xFF` never occurs in UTF-8, so no text a
//!   grammar matches can contain a special token, and grammars name them explicitly;
//! - an id the vocabulary does not define maps to no bytes (never allowed by a grammar).

use std::collections::HashMap;

use super::gguf_vocab::TokenKind;
use super::{Backend, Tokenizer};

/// First byte of a special token's entry in [`Tokenizer::token_bytes`].
pub const SPECIAL_TOKEN_MARKER: u8 = 0xFF;

const SPACE: char = '\u{2581}';

impl Tokenizer {
    /// The bytes of every token id in `0..self.vocab_size()` (module docs).
    pub fn token_bytes(&self) -> Vec<Vec<u8>> {
        match &self.backend {
            Backend::Spm(s) => (0..s.len() as u32)
                .map(|id| match s.kind(id) {
                    Some(TokenKind::Control | TokenKind::Unknown | TokenKind::Unused) => {
                        special(s.piece(id).unwrap_or_default())
                    }
                    Some(_) => {
                        let mut out = Vec::new();
                        s.piece_bytes(id, false, &mut out);
                        out
                    }
                    None => Vec::new(),
                })
                .collect(),
            Backend::Hf(t) => {
                let byte_level =
                    matches!(t.get_decoder(), Some(tokenizers::DecoderWrapper::ByteLevel(_)));
                let chars = byte_level.then(char_to_byte);
                let added = t.get_added_vocabulary();
                (0..t.get_vocab_size(true) as u32)
                    .map(|id| {
                        let Some(text) = t.id_to_token(id) else { return Vec::new() };
                        if added.is_special_token(&text) {
                            special(&text)
                        } else if added.get_vocab().contains_key(&text) {
                            text.into_bytes()
                        } else if let Some(chars) = &chars {
                            text.chars().filter_map(|c| chars.get(&c).copied()).collect()
                        } else if let Some(b) = byte_token(&text) {
                            vec![b]
                        } else {
                            text.replace(SPACE, " ").into_bytes()
                        }
                    })
                    .collect()
            }
        }
    }
}

fn special(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len() + 1);
    out.push(SPECIAL_TOKEN_MARKER);
    out.extend_from_slice(text.as_bytes());
    out
}

/// `<0xAB>` → `0xAB` (SentencePiece byte fallback).
fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() == 2 { u8::from_str_radix(hex, 16).ok() } else { None }
}

/// GPT-2's table, inverted: printable Latin-1 bytes stand for themselves, the other 68 bytes
/// for the characters U+0100 onwards, in byte order.
fn char_to_byte() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let c = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (c, b)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_table_is_gpt2s() {
        let t = char_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t[&'Ġ'], b' ');
        assert_eq!(t[&'Ċ'], b'\n');
        assert_eq!(t[&'a'], b'a');
        assert_eq!(t[&'\u{100}'], 0);
    }

    #[test]
    fn byte_tokens_parse_only_in_their_form() {
        assert_eq!(byte_token("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_token("<0xFF>"), Some(0xFF));
        assert_eq!(byte_token("<0x0A"), None);
        assert_eq!(byte_token("<0x0AB>"), None);
    }
}
