//! Prompt-lookup drafting (vLLM's `ngram` method, llama.cpp's lookup decoding): find the latest
//! earlier place where the sequence's last `n` tokens occurred, for the largest `n` in
//! `min..=max` that occurs, and propose the tokens that followed it there.
//!
//! The continuation is read from the sequence extended by the tokens proposed so far, so a
//! match close to the end keeps going with the period it found (a loop of `p` tokens drafts a
//! full `k` tokens, not just the `p - 1` left before the end).
//!
//! Cost: one backward scan over the sequence, comparing at each candidate end position until
//! the first mismatch or `max` tokens: O(len · typical match length), O(len · max) at worst;
//! a few microseconds for a few thousand tokens.

use kiln_core::{RequestId, TokenId};
use kiln_sched::Scheduler;

use super::proposer::Proposer;
use super::tree::TokenTree;
use crate::requests::RequestTable;

/// Prompt lookup as a [`Proposer`]: a chain of up to `k` drafts per request ([`propose`]).
#[derive(Debug)]
pub(crate) struct PromptLookup {
    min: usize,
    max: usize,
    /// Scratch: one request's drafts.
    draft: Vec<TokenId>,
}

impl PromptLookup {
    pub(crate) fn new(min: usize, max: usize) -> Self {
        Self { min, max, draft: Vec::new() }
    }
}

impl Proposer for PromptLookup {
    /// Prompt lookup costs microseconds: every round that drafted is a steady one.
    fn propose(
        &mut self,
        scheduler: &mut Scheduler,
        wanted: &[(RequestId, usize)],
        _: &mut RequestTable,
    ) -> bool {
        let mut drafted = false;
        for &(id, k) in wanted {
            let Some(req) = scheduler.request(id) else { continue };
            propose(req.all_token_ids(), self.min, self.max, k, &mut self.draft);
            drafted |= !self.draft.is_empty() && scheduler.update_draft_token_ids(id, &self.draft);
        }
        drafted
    }
}

/// Prompt lookup filling a [`TokenTree`] shape ([`propose_tree`]), its first `k` nodes per
/// request.
#[derive(Debug)]
pub(crate) struct PromptLookupTree {
    min: usize,
    max: usize,
    tree: TokenTree,
    /// Scratch: the sequence extended by a node's path; the drafts and their parents.
    context: Vec<TokenId>,
    draft: Vec<TokenId>,
    parents: Vec<u32>,
}

impl PromptLookupTree {
    pub(crate) fn new(min: usize, max: usize, tree: TokenTree) -> Self {
        Self { min, max, tree, context: Vec::new(), draft: Vec::new(), parents: Vec::new() }
    }
}

impl Proposer for PromptLookupTree {
    fn propose(
        &mut self,
        scheduler: &mut Scheduler,
        wanted: &[(RequestId, usize)],
        _: &mut RequestTable,
    ) -> bool {
        let mut drafted = false;
        for &(id, k) in wanted {
            let Some(req) = scheduler.request(id) else { continue };
            let (context, draft, parents) = (&mut self.context, &mut self.draft, &mut self.parents);
            let tokens = req.all_token_ids();
            propose_tree(tokens, (self.min, self.max), &self.tree, context, draft, parents);
            // The first `k` drafts are still a tree (parents come first).
            self.draft.truncate(k);
            self.parents.truncate(k);
            drafted |= !self.draft.is_empty()
                && scheduler.update_draft_tree(id, &self.draft, &self.parents);
        }
        drafted
    }
}

/// Appends to `out` (cleared first) up to `k` tokens predicted to follow `tokens`, from the
/// longest (up to `max`, at least `min`) suffix of `tokens` that occurred earlier, taking its
/// latest occurrence. Proposes nothing when no such suffix occurs.
pub fn propose(tokens: &[TokenId], min: usize, max: usize, k: usize, out: &mut Vec<TokenId>) {
    out.clear();
    let len = tokens.len();
    if k == 0 || min == 0 || len < min + 1 {
        return;
    }
    let last = len - 1;
    // `best`: (match length, end position of the earlier occurrence).
    let mut best: Option<(usize, usize)> = None;
    for end in (0..last).rev() {
        let limit = max.min(end + 1);
        let matched = (0..limit).take_while(|&t| tokens[end - t] == tokens[last - t]).count();
        if matched >= min && best.is_none_or(|(m, _)| matched > m) {
            best = Some((matched, end));
            if matched == max {
                break;
            }
        }
    }
    let Some((_, end)) = best else { return };
    for t in 0..k {
        let i = end + 1 + t;
        let token = if i < len { tokens[i] } else { out[i - len] };
        out.push(token);
    }
}

/// Fills `tree`'s shape (see [`TokenTree`]) for the tokens after `tokens`: a node of rank `r`
/// is the `r`-th candidate after its parent's path, candidates being the distinct tokens that
/// followed earlier occurrences of a suffix (of `min..=max` tokens) of the sequence extended by
/// that path, longest match first, then latest. A node without a candidate of its rank is left
/// out with its subtree. Appends the drafts to `drafts` and their parents (indices into
/// `drafts`, `u32::MAX` for the root) to `parents`, both cleared first.
///
/// Cost: per node with children, a copy of the sequence extended by its path and one backward
/// scan of it (O(len · match length), stopping once more candidates than a rank can ask for
/// matched `max` tokens); a few microseconds per node for a few thousand tokens.
pub fn propose_tree(
    tokens: &[TokenId],
    (min, max): (usize, usize),
    tree: &TokenTree,
    scratch: &mut Vec<TokenId>,
    drafts: &mut Vec<TokenId>,
    parents: &mut Vec<u32>,
) {
    drafts.clear();
    parents.clear();
    if min == 0 {
        return;
    }
    // Per shape node: its draft index (if it was filled), and its ranked candidates once
    // computed. The root's candidates are computed first.
    let n = tree.num_nodes();
    let mut placed: Vec<Option<u32>> = vec![None; n];
    let mut ranked: Vec<Option<Vec<TokenId>>> = vec![None; n];
    let mut root: Option<Vec<TokenId>> = None;
    for i in 0..n {
        let shape_parent = tree.parents[i];
        let parent = if shape_parent == u32::MAX {
            u32::MAX
        } else {
            match placed[shape_parent as usize] {
                Some(p) => p,
                None => continue, // its parent was left out
            }
        };
        let candidates = if shape_parent == u32::MAX {
            root.get_or_insert_with(|| ranked_candidates(tokens, min, max))
        } else {
            let p = shape_parent as usize;
            if ranked[p].is_none() {
                // The sequence extended by the parent's path.
                scratch.clear();
                scratch.extend_from_slice(tokens);
                let start = scratch.len();
                let mut node = parent;
                while node != u32::MAX {
                    scratch.push(drafts[node as usize]);
                    node = parents[node as usize];
                }
                scratch[start..].reverse();
                ranked[p] = Some(ranked_candidates(scratch, min, max));
            }
            ranked[p].as_ref().expect("just computed")
        };
        if let Some(&token) = candidates.get(tree.ranks[i]) {
            placed[i] = Some(drafts.len() as u32);
            drafts.push(token);
            parents.push(parent);
        }
    }
}

/// The distinct tokens that followed earlier occurrences of suffixes of `tokens` at least `min`
/// (at most `max`) long, longest match first, then latest; as many as a rank can ask for.
fn ranked_candidates(tokens: &[TokenId], min: usize, max: usize) -> Vec<TokenId> {
    let len = tokens.len();
    if len < min + 1 {
        return Vec::new();
    }
    let last = len - 1;
    // (match length, end of the earlier occurrence)
    let mut matches: Vec<(usize, usize)> = Vec::new();
    // Distinct tokens after full-length (`max`) matches: once there are more than any rank asks
    // for, no earlier match can rank among them.
    let mut full: Vec<TokenId> = Vec::new();
    for end in (0..last).rev() {
        let limit = max.min(end + 1);
        let matched = (0..limit).take_while(|&t| tokens[end - t] == tokens[last - t]).count();
        if matched >= min {
            matches.push((matched, end));
        }
        if matched == max && !full.contains(&tokens[end + 1]) {
            full.push(tokens[end + 1]);
            if full.len() > super::tree::MAX_TREE_RANK {
                break;
            }
        }
    }
    // Longest first; the scan found later ends first, and the sort is stable.
    matches.sort_by_key(|&(m, _)| std::cmp::Reverse(m));
    let mut out: Vec<TokenId> = Vec::new();
    for (_, end) in matches {
        let next = tokens[end + 1];
        if !out.contains(&next) {
            out.push(next);
            if out.len() > super::tree::MAX_TREE_RANK {
                break;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(v: &[u32]) -> Vec<TokenId> {
        v.iter().map(|&t| TokenId(t)).collect()
    }

    fn run(tokens: &[u32], min: usize, max: usize, k: usize) -> Vec<u32> {
        let mut out = Vec::new();
        propose(&ids(tokens), min, max, k, &mut out);
        out.into_iter().map(|t| t.0).collect()
    }

    #[test]
    fn proposes_the_continuation_of_the_longest_latest_match() {
        // Suffix [7, 8] occurred at 1..3 (followed by 9, 10, 11).
        assert_eq!(run(&[6, 7, 8, 9, 10, 11, 7, 8], 1, 3, 3), vec![9, 10, 11]);
        // k cuts the continuation.
        assert_eq!(run(&[6, 7, 8, 9, 10, 11, 7, 8], 1, 3, 1), vec![9]);
        // The longer match wins over a later shorter one: [1, 2, 3] at 0..3 -> 4; [3] alone
        // occurs later, followed by 5.
        assert_eq!(run(&[1, 2, 3, 4, 3, 5, 1, 2, 3], 1, 3, 1), vec![4]);
        // Among equally long matches, the latest one.
        assert_eq!(run(&[1, 2, 9, 1, 2, 8, 1, 2], 2, 2, 1), vec![8]);
        // No occurrence at least `min` long: nothing.
        assert_eq!(run(&[1, 2, 3, 4, 5, 3], 2, 3, 2), Vec::<u32>::new());
        assert_eq!(run(&[1, 2, 3], 1, 3, 2), Vec::<u32>::new());
        assert_eq!(run(&[], 1, 3, 2), Vec::<u32>::new());
        assert_eq!(run(&[5], 1, 3, 2), Vec::<u32>::new());
        assert_eq!(run(&[1, 2, 1, 2], 1, 3, 0), Vec::<u32>::new());
    }

    #[test]
    fn a_tree_ranks_the_candidates_of_each_path() {
        // After [1, 2]: 3 followed it latest with the longest match ([0, 1, 2]), 4 earlier with
        // a shorter one, 5 earliest.
        let tokens = ids(&[1, 2, 5, 0, 1, 2, 3, 9, 1, 2, 4, 0, 1, 2]);
        let tree =
            TokenTree::parse("[(0,), (1,), (2,), (3,), (0, 0), (1, 0), (3, 0)]", 32).unwrap();
        let (mut scratch, mut drafts, mut parents) = (Vec::new(), Vec::new(), Vec::new());
        propose_tree(&tokens, (1, 3), &tree, &mut scratch, &mut drafts, &mut parents);
        let drafted: Vec<u32> = drafts.iter().map(|t| t.0).collect();
        // Root: 3, 4, 5 (no fourth: (3,) and (3, 0) are left out). After 3: 9 (from [2, 3]);
        // after 4: 0 (from [2, 4]).
        assert_eq!(drafted, [3, 4, 5, 9, 0]);
        assert_eq!(parents, [u32::MAX, u32::MAX, u32::MAX, 0, 1]);
        // Nothing matches: nothing drafted.
        propose_tree(&ids(&[1, 2, 3]), (1, 3), &tree, &mut scratch, &mut drafts, &mut parents);
        assert!(drafts.is_empty() && parents.is_empty());
    }

    #[test]
    fn a_loop_near_the_end_continues_with_its_period() {
        // Period 3: [1, 2, 3] repeating; the latest match of [2, 3] ends at 2... continuation
        // wraps through the drafted tokens.
        assert_eq!(run(&[1, 2, 3, 1, 2, 3, 1, 2, 3], 1, 2, 7), vec![1, 2, 3, 1, 2, 3, 1]);
        // One token repeated.
        assert_eq!(run(&[4, 4, 4], 1, 5, 4), vec![4, 4, 4, 4]);
    }
}
