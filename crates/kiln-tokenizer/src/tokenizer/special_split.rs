//! Cutting special tokens (control, user-defined, unknown) out of input text before the model
//! tokenizes the rest, with llama.cpp's precedence: longer token texts win, and among equal
//! texts the leftmost occurrence wins (ties between different texts of one length: lower id).
//!
//! Invariants:
//! - fragments cover the text exactly, in order, without overlap; text fragments are non-empty;
//! - a byte trie finds every occurrence in O(text * depth); the greedy pass then accepts
//!   occurrences in precedence order, rejecting any that overlap an accepted one. That equals
//!   llama.cpp's "for each token, longest first, split every remaining text fragment".

/// A piece of input: plain text for the model, or a special token cut out whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

#[derive(Default)]
struct Node {
    /// Sorted by byte.
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

/// A byte trie over the special token texts.
pub(crate) struct SpecialSplitter {
    nodes: Vec<Node>,
}

impl SpecialSplitter {
    /// `specials`: (text, id); empty texts are ignored; for duplicate texts the last id wins.
    pub(crate) fn new<'a>(specials: impl IntoIterator<Item = (&'a str, u32)>) -> Self {
        let mut nodes = vec![Node::default()];
        for (text, id) in specials {
            if text.is_empty() {
                continue;
            }
            let mut at = 0usize;
            for &b in text.as_bytes() {
                at = match nodes[at].children.binary_search_by_key(&b, |c| c.0) {
                    Ok(i) => nodes[at].children[i].1 as usize,
                    Err(i) => {
                        let next = nodes.len();
                        nodes[at].children.insert(i, (b, next as u32));
                        nodes.push(Node::default());
                        next
                    }
                };
            }
            nodes[at].token = Some(id);
        }
        Self { nodes }
    }

    fn child(&self, node: usize, b: u8) -> Option<usize> {
        let children = &self.nodes[node].children;
        children.binary_search_by_key(&b, |c| c.0).ok().map(|i| children[i].1 as usize)
    }

    /// `(start, len, id)` of every occurrence of a token text in `text`, overlapping ones
    /// included.
    pub(crate) fn occurrences(&self, text: &str) -> Vec<(usize, usize, u32)> {
        let bytes = text.as_bytes();
        let mut found: Vec<(usize, usize, u32)> = Vec::new();
        for start in 0..bytes.len() {
            let mut node = 0;
            for (i, &b) in bytes[start..].iter().enumerate() {
                let Some(next) = self.child(node, b) else { break };
                node = next;
                if let Some(id) = self.nodes[node].token {
                    found.push((start, i + 1, id));
                }
            }
        }
        found
    }

    /// Splits `text` into fragments (see the module docs for precedence).
    pub(crate) fn split<'a>(&self, text: &'a str) -> Vec<Fragment<'a>> {
        self.split_where(text, |_, _, _| true)
    }

    /// [`Self::split`] considering only the occurrences `(start, len, id)` that `keep`
    /// accepts; the others stay text (and block nothing).
    pub(crate) fn split_where<'a>(
        &self,
        text: &'a str,
        keep: impl Fn(usize, usize, u32) -> bool,
    ) -> Vec<Fragment<'a>> {
        let bytes = text.as_bytes();
        let mut found = self.occurrences(text);
        found.retain(|&(start, len, id)| keep(start, len, id));
        if found.is_empty() {
            return if text.is_empty() { Vec::new() } else { vec![Fragment::Text(text)] };
        }
        found.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)).then(a.0.cmp(&b.0)));
        let mut taken = vec![false; bytes.len()];
        let mut accepted: Vec<(usize, usize, u32)> = Vec::new();
        for (start, len, id) in found {
            let span = &mut taken[start..start + len];
            if span.iter().all(|t| !t) {
                span.fill(true);
                accepted.push((start, len, id));
            }
        }
        accepted.sort_unstable_by_key(|a| a.0);
        let mut out = Vec::with_capacity(2 * accepted.len() + 1);
        let mut pos = 0;
        for (start, len, id) in accepted {
            if start > pos {
                out.push(Fragment::Text(&text[pos..start]));
            }
            out.push(Fragment::Token(id));
            pos = start + len;
        }
        if pos < text.len() {
            out.push(Fragment::Text(&text[pos..]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::Fragment::{Text, Token};
    use super::*;

    #[test]
    fn longest_text_wins_then_leftmost() {
        let s = SpecialSplitter::new([("\n", 1), ("\n\n", 2), ("<a>", 3), ("ab", 4), ("bcd", 5)]);
        assert_eq!(s.split("x\n\n\ny"), [Text("x"), Token(2), Token(1), Text("y")]);
        assert_eq!(s.split("<a>hi<a>"), [Token(3), Text("hi"), Token(3)]);
        // llama.cpp order: the longer "bcd" is cut first, so "ab" cannot match any more.
        assert_eq!(s.split("abcd"), [Text("a"), Token(5)]);
        assert_eq!(s.split("plain"), [Text("plain")]);
        assert_eq!(s.split(""), []);
        assert_eq!(s.split("é<a>"), [Text("é"), Token(3)]);
    }

    #[test]
    fn rejected_occurrences_stay_text_and_block_nothing() {
        let s = SpecialSplitter::new([("<a>", 3), ("a>b", 4)]);
        // "<a>" at 0 is rejected: the overlapping "a>b" can now be cut.
        assert_eq!(s.split_where("<a>b", |start, _, _| start != 0), [Text("<"), Token(4)]);
        assert_eq!(s.split_where("x<a>", |_, _, _| false), [Text("x<a>")]);
    }
}
