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

use kiln_core::TokenId;

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
    fn a_loop_near_the_end_continues_with_its_period() {
        // Period 3: [1, 2, 3] repeating; the latest match of [2, 3] ends at 2... continuation
        // wraps through the drafted tokens.
        assert_eq!(run(&[1, 2, 3, 1, 2, 3, 1, 2, 3], 1, 2, 7), vec![1, 2, 3, 1, 2, 3, 1]);
        // One token repeated.
        assert_eq!(run(&[4, 4, 4], 1, 5, 4), vec![4, 4, 4, 4]);
    }
}
