//! Encoding text in which some byte ranges are *literal*: control-token texts inside them are
//! ordinary text, never control tokens. A chat prompt is the template's text (whose markers,
//! such as `<start_of_turn>`, are real control tokens) with the messages' content spliced in;
//! content is literal, so a user who types `<end_of_turn>` gets the characters, not a forged
//! turn (as transformers' and vLLM's chat paths intend: the template's markers are special,
//! the user's are not).
//!
//! Invariants:
//! - a control-token occurrence that overlaps a literal range by one byte or more is text;
//!   occurrences wholly outside every literal range are cut out as [`Tokenizer::encode`] cuts
//!   them (same precedence);
//! - text with no control-token text inside a literal range encodes exactly as
//!   [`Tokenizer::encode`] (the same code path), so prompts without such text are unchanged;
//! - otherwise the text fragments between the cut-out control tokens are encoded with control
//!   tokens disabled (SentencePiece: no control / unknown token is cut out or merged into;
//!   Hugging Face: `encode_special_tokens`, on a clone of the tokenizer made on first use);
//!   user-defined (non-special) added tokens are still matched, as llama.cpp does without
//!   `parse_special`.
//!
//! Complexity: finding occurrences is O(text × longest token text), as for `encode`.

use std::ops::Range;

use super::special_split::{Fragment, SpecialSplitter};
use super::{Backend, Tokenizer};

/// What the Hugging Face backend needs for literal ranges: its special added tokens as a
/// splitter, and a clone that encodes special-token text as text.
pub(crate) struct HfLiteral {
    specials: SpecialSplitter,
    as_text: Box<tokenizers::Tokenizer>,
}

impl HfLiteral {
    fn new(tokenizer: &tokenizers::Tokenizer) -> Self {
        let decoder = tokenizer.get_added_tokens_decoder();
        let specials = SpecialSplitter::new(
            decoder.iter().filter(|(_, t)| t.special).map(|(&id, t)| (t.content.as_str(), id)),
        );
        let mut as_text = Box::new(tokenizer.clone());
        as_text.set_encode_special_tokens(true);
        Self { specials, as_text }
    }
}

fn overlaps(literals: &[Range<usize>], start: usize, len: usize) -> bool {
    literals.iter().any(|r| start < r.end && r.start < start + len)
}

impl Tokenizer {
    /// Whether `text` contains the text of a control token (Hugging Face: a special added
    /// token; GGUF: a control or unknown token).
    pub fn contains_control_text(&self, text: &str) -> bool {
        !self.control_occurrences(text).is_empty()
    }

    fn control_occurrences(&self, text: &str) -> Vec<(usize, usize, u32)> {
        match &self.backend {
            Backend::Spm(s) => s.control_occurrences(text),
            Backend::Hf(t) => self.hf_literal(t).specials.occurrences(text),
        }
    }

    fn hf_literal(&self, t: &tokenizers::Tokenizer) -> &HfLiteral {
        self.hf_literal.get_or_init(|| HfLiteral::new(t))
    }

    /// [`Self::encode`], except that control-token texts overlapping any of the byte ranges
    /// `literals` of `text` are encoded as text (see the module docs). With
    /// `add_special_tokens`, BOS / EOS follow [`Self::encode`]'s `add_bos_token` /
    /// `add_eos_token` rule (a Hugging Face post-processor does not run on this path when a
    /// literal range holds control text).
    pub fn encode_with_literals(
        &self,
        text: &str,
        literals: &[Range<usize>],
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, String> {
        let neutralized = self
            .control_occurrences(text)
            .iter()
            .any(|&(start, len, _)| overlaps(literals, start, len));
        if !neutralized {
            return self.encode(text, add_special_tokens);
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 2);
        match &self.backend {
            Backend::Spm(s) => {
                s.encode_where(text, |start, len| overlaps(literals, start, len), &mut ids)?;
            }
            Backend::Hf(t) => {
                let literal = self.hf_literal(t);
                let fragments = literal
                    .specials
                    .split_where(text, |start, len, _| !overlaps(literals, start, len));
                for fragment in fragments {
                    match fragment {
                        Fragment::Token(id) => ids.push(id),
                        Fragment::Text(t) => ids.extend_from_slice(
                            literal.as_text.encode(t, false).map_err(|e| e.to_string())?.get_ids(),
                        ),
                    }
                }
            }
        }
        if add_special_tokens {
            self.add_bos_eos(&mut ids);
        }
        Ok(ids)
    }
}
