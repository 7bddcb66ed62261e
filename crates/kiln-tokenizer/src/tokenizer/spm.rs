//! SentencePiece-style BPE of GGUF `"llama"` vocabularies (Llama 1/2, Mistral v1, Gemma):
//! merges are chosen by token score, unknown characters fall back to `<0xXX>` byte tokens.
//!
//! Encoding, per the algorithm llama.cpp implements:
//! 1. special tokens (control, user-defined, unknown) are cut out whole ([`SpecialSplitter`]);
//! 2. in each text fragment ' ' becomes '▁' (U+2581); with `add_space_prefix` a '▁' is also
//!    prepended to fragments at the start or right after a special token;
//! 3. the fragment starts as one symbol per UTF-8 character; the adjacent pair whose
//!    concatenation is a token with the highest score is merged (ties: leftmost) until no pair
//!    is a token, using a max-heap of candidate pairs over a linked list of symbols;
//! 4. each symbol becomes its token, or the `<0xXX>` tokens of its bytes (else `unk`).
//!
//! Invariants:
//! - symbols are non-overlapping byte ranges of the fragment, linked in text order; a merged-away
//!   symbol has length 0, so a heap entry is stale iff its two lengths no longer sum to its own;
//! - decoding maps '▁' back to ' ', byte tokens to raw bytes, user-defined tokens to their text,
//!   control/unknown tokens to their text unless skipped, unused tokens to nothing; ids outside
//!   the vocabulary decode to nothing (as the HF backend does).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

use super::gguf_vocab::TokenKind;
use super::special_split::{Fragment, SpecialSplitter};

const SPACE: char = '\u{2581}';
const NONE: usize = usize::MAX;

pub(crate) struct Spm {
    pieces: Vec<String>,
    kinds: Vec<TokenKind>,
    scores: Vec<f32>,
    /// Text to id; for duplicate texts the last id wins (as in llama.cpp).
    ids: HashMap<String, u32>,
    /// The `<0xXX>` token of each byte.
    byte_ids: [Option<u32>; 256],
    unk: Option<u32>,
    add_space_prefix: bool,
    special: SpecialSplitter,
}

struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

/// A candidate merge of symbols `left` and its successor `right`.
struct Pair {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl PartialEq for Pair {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Pair {}
impl PartialOrd for Pair {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Pair {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score.total_cmp(&other.score).then(other.left.cmp(&self.left))
    }
}

/// The byte of a `<0xXX>` token text.
fn byte_of(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

impl Spm {
    /// `pieces`, `kinds` and `scores` have one entry per token (checked by the caller).
    pub(crate) fn new(
        pieces: Vec<String>,
        kinds: Vec<TokenKind>,
        scores: Vec<f32>,
        unk: Option<u32>,
        add_space_prefix: bool,
    ) -> Self {
        let mut ids = HashMap::with_capacity(pieces.len());
        for (id, piece) in pieces.iter().enumerate() {
            ids.insert(piece.clone(), id as u32);
        }
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            *slot = ids.get(format!("<0x{b:02X}>").as_str()).copied();
        }
        let special = SpecialSplitter::new(
            pieces
                .iter()
                .zip(&kinds)
                .enumerate()
                .filter(|(_, (_, k))| k.is_split_out())
                .map(|(id, (p, _))| (p.as_str(), id as u32)),
        );
        Self { pieces, kinds, scores, ids, byte_ids, unk, add_space_prefix, special }
    }

    /// The id of `text` as a piece of ordinary text: not a control or unknown token.
    fn text_token(&self, text: &str) -> Option<u32> {
        let id = *self.ids.get(text)?;
        self.kind(id).is_some_and(|k| !k.is_special()).then_some(id)
    }

    pub(crate) fn token_to_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    pub(crate) fn len(&self) -> usize {
        self.pieces.len()
    }

    pub(crate) fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    /// The vocabulary entry of `id`, as stored (`'▁'` for spaces, `<0xXX>` for bytes).
    pub(crate) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// Appends the ids of `text` to `out` (no BOS/EOS).
    pub(crate) fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        self.encode_fragments(self.special.split(text), out)
    }

    /// The occurrences of control and unknown token texts in `text` (`(start, len, id)`);
    /// user-defined tokens are ordinary text and are not listed.
    pub(crate) fn control_occurrences(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let mut found = self.special.occurrences(text);
        found.retain(|o| self.kind(o.2).is_some_and(TokenKind::is_special));
        found
    }

    /// [`Self::encode`] where the control or unknown token occurrences `(start, len, id)` that
    /// `literal` accepts stay text (user-defined tokens are always cut out, as llama.cpp does
    /// without `parse_special`).
    pub(crate) fn encode_where(
        &self,
        text: &str,
        literal: impl Fn(usize, usize) -> bool,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let fragments = self.special.split_where(text, |start, len, id| {
            !(self.kind(id).is_some_and(TokenKind::is_special) && literal(start, len))
        });
        self.encode_fragments(fragments, out)
    }

    fn encode_fragments(
        &self,
        fragments: Vec<Fragment<'_>>,
        out: &mut Vec<u32>,
    ) -> Result<(), String> {
        let mut after_special = true;
        let mut buf = String::new();
        for fragment in fragments {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text(t) => {
                    buf.clear();
                    if self.add_space_prefix && after_special {
                        buf.push(SPACE);
                    }
                    for c in t.chars() {
                        buf.push(if c == ' ' { SPACE } else { c });
                    }
                    self.encode_fragment(&buf, out)?;
                    after_special = false;
                }
            }
        }
        Ok(())
    }

    fn encode_fragment(&self, text: &str, out: &mut Vec<u32>) -> Result<(), String> {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let next = if start + c.len_utf8() < text.len() { i + 1 } else { NONE };
            let prev = if i == 0 { NONE } else { i - 1 };
            symbols.push(Symbol { start, len: c.len_utf8(), prev, next });
        }
        let mut heap = BinaryHeap::with_capacity(symbols.len());
        for left in 1..symbols.len() {
            self.push_pair(text, &symbols, left - 1, left, &mut heap);
        }
        while let Some(pair) = heap.pop() {
            let (l, r) = (pair.left, pair.right);
            if symbols[l].len == 0
                || symbols[r].len == 0
                || symbols[l].len + symbols[r].len != pair.len
            {
                continue;
            }
            symbols[l].len += symbols[r].len;
            symbols[r].len = 0;
            let next = symbols[r].next;
            symbols[l].next = next;
            if next != NONE {
                symbols[next].prev = l;
            }
            let prev = symbols[l].prev;
            if prev != NONE {
                self.push_pair(text, &symbols, prev, l, &mut heap);
            }
            if next != NONE {
                self.push_pair(text, &symbols, l, next, &mut heap);
            }
        }
        let mut at = if symbols.is_empty() { NONE } else { 0 };
        while at != NONE {
            let s = &symbols[at];
            let piece = &text[s.start..s.start + s.len];
            if let Some(id) = self.text_token(piece) {
                out.push(id);
            } else {
                for &b in piece.as_bytes() {
                    let id = self.byte_ids[usize::from(b)].or(self.unk).ok_or_else(|| {
                        format!("no token for byte 0x{b:02X} and no unknown token")
                    })?;
                    out.push(id);
                }
            }
            at = s.next;
        }
        Ok(())
    }

    fn push_pair(
        &self,
        text: &str,
        symbols: &[Symbol],
        left: usize,
        right: usize,
        heap: &mut BinaryHeap<Pair>,
    ) {
        let (l, r) = (&symbols[left], &symbols[right]);
        let merged = &text[l.start..r.start + r.len];
        // Control / unknown tokens are never a merge result: their text inside a fragment is
        // literal text (encode_where), not the token.
        if let Some(id) = self.text_token(merged) {
            heap.push(Pair { score: self.scores[id as usize], left, right, len: merged.len() });
        }
    }

    /// Appends the bytes of token `id` to `out` (see the module docs).
    pub(crate) fn piece_bytes(&self, id: u32, skip_special: bool, out: &mut Vec<u8>) {
        let (Some(piece), Some(&kind)) =
            (self.pieces.get(id as usize), self.kinds.get(id as usize))
        else {
            return;
        };
        match kind {
            TokenKind::Normal => {
                for c in piece.chars() {
                    let c = if c == SPACE { ' ' } else { c };
                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                }
            }
            TokenKind::Byte => match byte_of(piece) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(piece.as_bytes()),
            },
            TokenKind::UserDefined => out.extend_from_slice(piece.as_bytes()),
            TokenKind::Control | TokenKind::Unknown => {
                if !skip_special {
                    out.extend_from_slice(piece.as_bytes());
                }
            }
            TokenKind::Unused => {}
        }
    }

    /// Whether decoding drops one leading space of the whole text (the '▁' encoding prepended).
    pub(crate) fn strips_leading_space(&self) -> bool {
        self.add_space_prefix
    }

    /// Full decode: pieces concatenated, invalid UTF-8 replaced by U+FFFD.
    pub(crate) fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            self.piece_bytes(id, skip_special, &mut bytes);
        }
        let start = usize::from(self.add_space_prefix && bytes.first() == Some(&b' '));
        String::from_utf8_lossy(&bytes[start..]).into_owned()
    }
}
