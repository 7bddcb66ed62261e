//! The varlen input of one forward step: several sequences, each contributing any number of
//! new tokens (a prefill chunk or one decode token) whose K/V go to the cache slots given by
//! the sequence's block table.
//!
//! Invariants (checked in [`ForwardBatch::push_seq`]): the block table of each sequence covers
//! all of its `context_len` tokens; `slot_mapping[t]` is the cache slot of token `t`;
//! `positions[t]` is its position in its sequence. Buffers are reused across steps.
//!
//! A token tree ([`ForwardBatch::push_tree`], speculative verification of several candidate
//! continuations) is one sequence whose first new token is the root, at position `p` in slot
//! `p`, followed by the tree's nodes in topological order (parents first), node `i` in slot
//! `p + 1 + i` but at position `p + depth(i)`. A node row sees the keys up to the root through
//! the block table, then its ancestors' and its own keys ([`TreeKeys`]): exactly the keys the
//! same tokens decoded one by one would see, in position order.

use crate::ForwardError;

/// Which rows of a sequence need logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that does not reach the end of the prompt).
    None,
    /// The last new token (normal prefill end or decode).
    Last,
    /// Every new token (prompt logprobs, tests, speculative verification).
    All,
}

/// One sequence of a varlen batch: where its rows and block table sit in the batch's flat
/// buffers. Attention kernels of every backend take these.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    /// First row of this sequence in the batch's `[num_tokens, ...]` buffers.
    pub query_start: usize,
    pub query_len: usize,
    /// Tokens in the cache for this sequence, including this step's.
    pub context_len: usize,
    /// Where this sequence's block table starts in the batch's flat block-table buffer; it
    /// has `context_len.div_ceil(block_size)` entries (physical block of each logical block).
    pub block_table_start: usize,
}

/// The keys a token-tree row sees past its sequence's shared prefix: positions
/// `pos + 1 - len ..= pos` are the cache slots `tree_slots[start..start + len]` (its ancestors'
/// then its own), and positions up to `pos - len` come from the sequence's block table as for
/// any row. `len == 0`: not a tree node (its position follows from its sequence).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeKeys {
    pub pos: u32,
    pub start: u32,
    pub len: u32,
}

/// The tree keys of a batch's query rows, for attention: `rows[r]` is row `r`'s
/// ([`TreeKeys`]), with ranges into `slots`.
#[derive(Clone, Copy, Debug)]
pub struct TreeMask<'a> {
    /// `[rows]`
    pub rows: &'a [TreeKeys],
    pub slots: &'a [u32],
}

/// The parent of a tree node that hangs off the root (the sequence's last known token).
pub const TREE_ROOT: u32 = u32::MAX;

/// One step's inputs on the host. A device backend uploads the id, position, slot and block-table
/// buffers once per step; they are the same for every layer.
#[derive(Clone, Debug)]
pub struct ForwardBatch {
    block_size: usize,
    /// `[num_tokens]`
    token_ids: Vec<u32>,
    /// `[num_tokens]`
    positions: Vec<u32>,
    /// `[num_tokens]`
    slot_mapping: Vec<u32>,
    seqs: Vec<SeqSpan>,
    /// Block tables of all sequences, back to back.
    block_tables: Vec<u32>,
    /// Token rows whose logits are computed, in order.
    logits_rows: Vec<usize>,
    /// `[num_tokens]` tree keys of each token (all `len == 0` unless a tree was pushed).
    tree_rows: Vec<TreeKeys>,
    /// The slots [`TreeKeys`] ranges point into.
    tree_slots: Vec<u32>,
    /// `[num_seqs]` the LoRA adapter slot of each sequence (0: the base model alone).
    adapters: Vec<u32>,
    /// The wanted rows come back as final hidden states (after the final norm, `[rows,
    /// hidden]`) instead of logits: a pooling model's step.
    hidden_output: bool,
}

impl ForwardBatch {
    pub fn new(block_size: usize) -> Self {
        Self {
            block_size,
            token_ids: Vec::new(),
            positions: Vec::new(),
            slot_mapping: Vec::new(),
            seqs: Vec::new(),
            block_tables: Vec::new(),
            logits_rows: Vec::new(),
            tree_rows: Vec::new(),
            tree_slots: Vec::new(),
            adapters: Vec::new(),
            hidden_output: false,
        }
    }

    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.logits_rows.clear();
        self.tree_rows.clear();
        self.tree_slots.clear();
        self.adapters.clear();
        self.hidden_output = false;
    }

    /// Whether the wanted rows come back as final hidden states instead of logits.
    pub fn hidden_output(&self) -> bool {
        self.hidden_output
    }

    /// Asks for the wanted rows' final hidden states (after the final norm) instead of their
    /// logits (until the next [`ForwardBatch::clear`]).
    pub fn set_hidden_output(&mut self, hidden: bool) {
        self.hidden_output = hidden;
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    pub fn seqs(&self) -> &[SeqSpan] {
        &self.seqs
    }

    /// `[num_tokens]` token ids.
    pub fn token_ids(&self) -> &[u32] {
        &self.token_ids
    }

    /// Sets the id of token `index` (a token planned before its id was known, replaced before
    /// the forward runs). Panics if `index` is out of range.
    pub fn set_token_id(&mut self, index: usize, token: u32) {
        self.token_ids[index] = token;
    }

    /// `[num_tokens]` positions in their sequences.
    pub fn positions(&self) -> &[u32] {
        &self.positions
    }

    /// `[num_tokens]` cache slot of each token (`block * block_size + offset`).
    pub fn slot_mapping(&self) -> &[u32] {
        &self.slot_mapping
    }

    /// The block tables of all sequences, back to back (see [`SeqSpan::block_table_start`]).
    pub fn block_tables(&self) -> &[u32] {
        &self.block_tables
    }

    /// Rows (token indices) for which logits are produced, in output order.
    pub fn logits_rows(&self) -> &[usize] {
        &self.logits_rows
    }

    /// The tree keys of every token (`[num_tokens]`), or `None` when no tree was pushed (every
    /// row is a plain causal row).
    pub fn tree_mask(&self) -> Option<TreeMask<'_>> {
        (!self.tree_slots.is_empty())
            .then_some(TreeMask { rows: &self.tree_rows, slots: &self.tree_slots })
    }

    /// `[num_seqs]` the LoRA adapter slot of each sequence (0: none, the base model alone).
    pub fn seq_adapters(&self) -> &[u32] {
        &self.adapters
    }

    /// Whether any sequence runs with an adapter.
    pub fn has_adapters(&self) -> bool {
        self.adapters.iter().any(|&a| a != 0)
    }

    /// Runs the last sequence pushed with the adapter in `slot` (0: none). Panics when no
    /// sequence was pushed.
    pub fn set_last_adapter(&mut self, slot: u32) {
        *self.adapters.last_mut().expect("a sequence was pushed") = slot;
    }

    /// Adds a sequence whose first `num_cached` tokens are already in the cache and whose
    /// `new_tokens` follow. `block_table` must cover `num_cached + new_tokens.len()` tokens.
    pub fn push_seq(
        &mut self,
        new_tokens: &[u32],
        num_cached: usize,
        block_table: &[u32],
        logits: LogitsWanted,
    ) -> Result<(), ForwardError> {
        if new_tokens.is_empty() {
            return Err(ForwardError::Batch("a sequence must bring at least one token".into()));
        }
        let context_len = num_cached + new_tokens.len();
        let covered = block_table.len() * self.block_size;
        if covered < context_len {
            return Err(ForwardError::BlockTableTooShort {
                seq: self.seqs.len(),
                covered,
                needed: context_len,
            });
        }
        let position_limit = u32::MAX as usize;
        if context_len > position_limit {
            return Err(ForwardError::Batch("sequence longer than 2^32 tokens".into()));
        }
        let query_start = self.token_ids.len();
        self.adapters.push(0);
        self.seqs.push(SeqSpan {
            query_start,
            query_len: new_tokens.len(),
            context_len,
            block_table_start: self.block_tables.len(),
        });
        let num_table_blocks = context_len.div_ceil(self.block_size);
        self.block_tables.extend_from_slice(&block_table[..num_table_blocks]);
        self.token_ids.extend_from_slice(new_tokens);
        self.tree_rows.resize(self.token_ids.len(), TreeKeys::default());
        for pos in num_cached..context_len {
            self.positions.push(pos as u32);
            let block = block_table[pos / self.block_size] as usize;
            self.slot_mapping.push((block * self.block_size + pos % self.block_size) as u32);
        }
        match logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => self.logits_rows.push(query_start + new_tokens.len() - 1),
            LogitsWanted::All => {
                self.logits_rows.extend(query_start..query_start + new_tokens.len());
            }
        }
        Ok(())
    }

    /// Adds a token tree (module docs): `tokens[0]` is the root, the sequence's last known
    /// token, at position `num_cached`; `tokens[1 + i]` is node `i`, whose parent is node
    /// `parents[i]` (an earlier node) or the root ([`TREE_ROOT`]). `block_table` must cover
    /// `num_cached + tokens.len()` slots. Every row gets logits.
    pub fn push_tree(
        &mut self,
        tokens: &[u32],
        parents: &[u32],
        num_cached: usize,
        block_table: &[u32],
    ) -> Result<(), ForwardError> {
        if tokens.len() != parents.len() + 1 {
            return Err(ForwardError::Batch(format!(
                "a tree of {} nodes needs {} tokens (the root first), got {}",
                parents.len(),
                parents.len() + 1,
                tokens.len()
            )));
        }
        if let Some(i) =
            parents.iter().enumerate().position(|(i, &p)| p != TREE_ROOT && p as usize >= i)
        {
            return Err(ForwardError::Batch(format!(
                "tree node {i} has parent {} (parents must come first)",
                parents[i]
            )));
        }
        let first = self.token_ids.len();
        self.push_seq(tokens, num_cached, block_table, LogitsWanted::All)?;
        // A node's keys are its parent's then its own (the root's children have only their own);
        // its depth is their count.
        for (i, &parent) in parents.iter().enumerate() {
            let row = first + 1 + i;
            let start = self.tree_slots.len();
            if parent != TREE_ROOT {
                let p = self.tree_rows[first + 1 + parent as usize];
                self.tree_slots.extend_from_within(p.start as usize..(p.start + p.len) as usize);
            }
            self.tree_slots.push(self.slot_mapping[row]);
            let depth = self.tree_slots.len() - start;
            let pos = (num_cached + depth) as u32;
            self.positions[row] = pos;
            self.tree_rows[row] = TreeKeys { pos, start: start as u32, len: depth as u32 };
        }
        Ok(())
    }

    /// Checks ids against the vocabulary and blocks against the cache size.
    pub fn validate(&self, vocab_size: usize, num_blocks: usize) -> Result<(), ForwardError> {
        if let Some(&token) = self.token_ids.iter().find(|t| **t as usize >= vocab_size) {
            return Err(ForwardError::TokenOutOfVocab { token, vocab_size });
        }
        if let Some(&block) = self.block_tables.iter().find(|b| **b as usize >= num_blocks) {
            return Err(ForwardError::BlockOutOfRange { block, num_blocks });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_positions_and_logit_rows() {
        let mut b = ForwardBatch::new(4);
        b.push_seq(&[1, 2, 3], 5, &[7, 2], LogitsWanted::Last).unwrap();
        b.push_seq(&[9, 9], 0, &[0], LogitsWanted::All).unwrap();
        assert_eq!(b.positions, vec![5, 6, 7, 0, 1]);
        assert_eq!(b.slot_mapping, vec![9, 10, 11, 0, 1]);
        assert_eq!(b.logits_rows(), &[2, 3, 4]);
        assert_eq!(b.block_tables, vec![7, 2, 0]);
        assert!(matches!(
            b.push_seq(&[1], 8, &[0, 1], LogitsWanted::Last),
            Err(ForwardError::BlockTableTooShort { .. })
        ));
        assert!(b.validate(10, 8).is_ok());
        assert!(matches!(b.validate(5, 8), Err(ForwardError::TokenOutOfVocab { token: 9, .. })));
        assert!(matches!(b.validate(10, 3), Err(ForwardError::BlockOutOfRange { block: 7, .. })));
        assert!(b.tree_mask().is_none());
    }

    #[test]
    fn a_tree_gets_positions_by_depth_and_its_ancestors_slots() {
        let mut b = ForwardBatch::new(4);
        b.push_seq(&[5], 2, &[3], LogitsWanted::Last).unwrap();
        // Root 10 at position 3 (slot 3 of block 0 → 3); nodes: a(root) b(a) c(root) d(b).
        b.push_tree(&[10, 11, 12, 13, 14], &[TREE_ROOT, 0, TREE_ROOT, 1], 3, &[0, 1]).unwrap();
        assert_eq!(b.positions(), &[2, 3, 4, 5, 4, 6]);
        assert_eq!(b.slot_mapping(), &[14, 3, 4, 5, 6, 7]);
        assert_eq!(b.logits_rows(), &[0, 1, 2, 3, 4, 5]);
        let mask = b.tree_mask().unwrap();
        let keys = |row: usize| {
            let t = mask.rows[row];
            (t.pos, mask.slots[t.start as usize..][..t.len as usize].to_vec())
        };
        assert_eq!(mask.rows[0].len, 0);
        assert_eq!(mask.rows[1].len, 0, "the root is a plain row");
        assert_eq!(keys(2), (4, vec![4]));
        assert_eq!(keys(3), (5, vec![4, 5]));
        assert_eq!(keys(4), (4, vec![6]));
        assert_eq!(keys(5), (6, vec![4, 5, 7]));
        assert!(b.push_tree(&[1, 2], &[1], 0, &[0]).is_err(), "a node must follow its parent");
        assert!(b.push_tree(&[1, 2], &[], 0, &[0]).is_err(), "one token per node plus the root");
    }
}
