//! The varlen input of one forward step: several sequences, each contributing any number of
//! new tokens (a prefill chunk or one decode token) whose K/V go to the cache slots given by
//! the sequence's block table.
//!
//! Invariants (checked in [`ForwardBatch::push_seq`]): the block table of each sequence covers
//! all of its `context_len` tokens; `slot_mapping[t]` is the cache slot of token `t`;
//! `positions[t]` is its position in its sequence. Buffers are reused across steps.

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
        }
    }

    pub fn clear(&mut self) {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.seqs.clear();
        self.block_tables.clear();
        self.logits_rows.clear();
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
        self.seqs.push(SeqSpan {
            query_start,
            query_len: new_tokens.len(),
            context_len,
            block_table_start: self.block_tables.len(),
        });
        let num_table_blocks = context_len.div_ceil(self.block_size);
        self.block_tables.extend_from_slice(&block_table[..num_table_blocks]);
        self.token_ids.extend_from_slice(new_tokens);
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
    }
}
