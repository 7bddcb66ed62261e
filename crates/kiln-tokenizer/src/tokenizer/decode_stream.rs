//! Incremental detokenization for streaming: one token in, the text it completes out.
//!
//! Invariants:
//! - emitted text is always valid UTF-8 made of whole characters; bytes of a character split
//!   over several tokens are held back until the character is complete;
//! - for the SentencePiece backend the concatenation of all emitted text equals
//!   `Tokenizer::decode` of all ids, except that a trailing incomplete character is never
//!   emitted, and an invalid byte sequence is emitted as U+FFFD as soon as it is known invalid;
//! - the HF backend uses the prefix/read offsets scheme (as vLLM and `tokenizers` do): decode a
//!   window that starts one step back, emit the part past the previous window's text unless it
//!   ends in U+FFFD (an incomplete character), then slide. Memory stays bounded by the window.

use std::ops::Deref;
use std::sync::Arc;

use super::{Backend, Tokenizer};

/// Streaming decoder of one sequence; see [`Tokenizer::decode_stream`] and
/// [`DecodeStream::shared`].
pub struct DecodeStream<'a> {
    tokenizer: TokenizerRef<'a>,
    skip_special: bool,
    state: State,
}

enum State {
    /// SentencePiece: raw bytes not yet emitted; whether nothing has been emitted yet.
    Bytes { pending: Vec<u8>, at_start: bool },
    /// HF: ids of the window, where its already-emitted part ends, and that part's text.
    Window { ids: Vec<u32>, read: usize, prefix: String },
}

/// The tokenizer a stream decodes with: borrowed, or shared (for streams that outlive a
/// borrow, such as one per HTTP request).
enum TokenizerRef<'a> {
    Borrowed(&'a Tokenizer),
    Shared(Arc<Tokenizer>),
}

impl Deref for TokenizerRef<'_> {
    type Target = Tokenizer;

    fn deref(&self) -> &Tokenizer {
        match self {
            Self::Borrowed(t) => t,
            Self::Shared(t) => t,
        }
    }
}

impl DecodeStream<'static> {
    /// A stream that holds its own reference to the tokenizer.
    pub fn shared(tokenizer: Arc<Tokenizer>, skip_special: bool) -> Self {
        Self::with_ref(TokenizerRef::Shared(tokenizer), skip_special)
    }
}

impl<'a> DecodeStream<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        Self::with_ref(TokenizerRef::Borrowed(tokenizer), skip_special)
    }

    fn with_ref(tokenizer: TokenizerRef<'a>, skip_special: bool) -> Self {
        let state = match tokenizer.backend {
            Backend::Spm(_) => State::Bytes { pending: Vec::new(), at_start: true },
            Backend::Hf(_) => State::Window { ids: Vec::new(), read: 0, prefix: String::new() },
        };
        Self { tokenizer, skip_special, state }
    }

    /// Feeds one token; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, String> {
        match (&mut self.state, &self.tokenizer.backend) {
            (State::Bytes { pending, at_start }, Backend::Spm(spm)) => {
                spm.piece_bytes(id, self.skip_special, pending);
                if *at_start && !pending.is_empty() {
                    *at_start = false;
                    if spm.strips_leading_space() && pending[0] == b' ' {
                        pending.remove(0);
                    }
                }
                let text = take_complete_utf8(pending);
                Ok((!text.is_empty()).then_some(text))
            }
            (State::Window { ids, read, prefix }, Backend::Hf(_)) => {
                ids.push(id);
                let text = self.tokenizer.decode(ids, self.skip_special)?;
                if text.len() <= prefix.len() || text.ends_with('\u{FFFD}') {
                    return Ok(None);
                }
                let Some(new) = text.strip_prefix(prefix.as_str()) else {
                    return Err(format!("decoded text no longer starts with {prefix:?}"));
                };
                let new = new.to_owned();
                // The next window starts at the first token not yet in the old window.
                ids.drain(..*read);
                *read = ids.len();
                *prefix = self.tokenizer.decode(ids, self.skip_special)?;
                Ok(Some(new))
            }
            _ => Err("decode stream used with a different tokenizer backend".into()),
        }
    }
}

/// Removes and returns the longest prefix of `pending` that is whole characters; invalid
/// sequences become U+FFFD; an incomplete character at the end stays in `pending`.
fn take_complete_utf8(pending: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut rest: &[u8] = pending;
    loop {
        match std::str::from_utf8(rest) {
            Ok(s) => {
                out.push_str(s);
                rest = &[];
                break;
            }
            Err(e) => {
                let (valid, after) = rest.split_at(e.valid_up_to());
                out.push_str(std::str::from_utf8(valid).unwrap_or_default());
                if let Some(bad) = e.error_len() {
                    out.push('\u{FFFD}');
                    rest = &after[bad..];
                } else {
                    rest = after;
                    break;
                }
            }
        }
    }
    let keep = rest.len();
    pending.drain(..pending.len() - keep);
    out
}

#[cfg(test)]
mod tests {
    use super::take_complete_utf8;

    #[test]
    fn holds_back_incomplete_characters() {
        let euro = "€".as_bytes(); // 3 bytes
        let mut pending = vec![b'a', euro[0]];
        assert_eq!(take_complete_utf8(&mut pending), "a");
        assert_eq!(pending, [euro[0]]);
        pending.push(euro[1]);
        assert_eq!(take_complete_utf8(&mut pending), "");
        pending.push(euro[2]);
        assert_eq!(take_complete_utf8(&mut pending), "€");
        assert!(pending.is_empty());
        let mut bad = vec![0xFF, b'x', 0xF0];
        assert_eq!(take_complete_utf8(&mut bad), "\u{FFFD}x");
        assert_eq!(bad, [0xF0]);
    }
}
