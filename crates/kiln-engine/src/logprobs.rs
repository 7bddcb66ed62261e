//! Log-probabilities of tokens under a row of logits, as the OpenAI API returns them.
//!
//! Computed on the model's raw logits (before logit bias, penalties and temperature: vLLM's
//! default `raw_logprobs` mode), with a numerically stable log-sum-exp. NaN logits count as
//! `-inf`. Ranks start at 1 (the most likely token); ties share the better rank. Cost: `O(vocab)`
//! plus `O(k log k)` for the top `k`.

use kiln_core::TokenId;

/// One token's log-probability and its rank in the distribution.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: TokenId,
    pub logprob: f32,
    /// 1 + the number of tokens strictly more likely.
    pub rank: usize,
}

/// The chosen token's log-probability and the `k` most likely tokens (best first).
#[derive(Clone, Debug, PartialEq)]
pub struct Logprobs {
    pub chosen: TokenLogprob,
    pub top: Vec<TokenLogprob>,
}

fn finite(x: f32) -> f32 {
    if x.is_nan() { f32::NEG_INFINITY } else { x }
}

/// The log-probabilities of `chosen` and the `k` best tokens of `logits` (`[vocab]`).
pub fn logprobs(logits: &[f32], chosen: TokenId, k: usize) -> Logprobs {
    let max = logits.iter().copied().map(finite).fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| f64::from((finite(l) - max).exp())).sum();
    let log_z = max + sum.ln() as f32;
    let entry = |token: u32, logit: f32, rank: usize| TokenLogprob {
        token: TokenId(token),
        logprob: finite(logit) - log_z,
        rank,
    };
    let chosen_logit = logits.get(chosen.index()).copied().map_or(f32::NEG_INFINITY, finite);
    let chosen_rank = 1 + logits.iter().filter(|&&l| finite(l) > chosen_logit).count();
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit_desc = |a: &u32, b: &u32| {
        finite(logits[*b as usize]).total_cmp(&finite(logits[*a as usize])).then(a.cmp(b))
    };
    let k = k.min(order.len());
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit_desc);
    }
    order.truncate(k);
    order.sort_unstable_by(by_logit_desc);
    let mut top: Vec<TokenLogprob> = Vec::with_capacity(k);
    let mut prev: Option<(f32, usize)> = None;
    for (i, &t) in order.iter().enumerate() {
        let logit = finite(logits[t as usize]);
        // Tied tokens share the rank of the first of them.
        let rank = match prev {
            Some((prev_logit, prev_rank)) if prev_logit == logit => prev_rank,
            _ => i + 1,
        };
        prev = Some((logit, rank));
        top.push(entry(t, logit, rank));
    }
    Logprobs { chosen: entry(chosen.0, chosen_logit, chosen_rank), top }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_a_direct_log_softmax() {
        let logits = [1.0f32, 3.0, 3.0, -2.0, f32::NAN, 0.5];
        let z: f64 = logits.iter().filter(|l| !l.is_nan()).map(|&l| f64::from(l).exp()).sum();
        let lp = logprobs(&logits, TokenId(5), 3);
        assert!((f64::from(lp.chosen.logprob) - (0.5 - z.ln())).abs() < 1e-5);
        assert_eq!(lp.chosen.rank, 4);
        let top: Vec<(u32, usize)> = lp.top.iter().map(|t| (t.token.0, t.rank)).collect();
        assert_eq!(top, vec![(1, 1), (2, 1), (0, 3)]);
        assert!((f64::from(lp.top[0].logprob) - (3.0 - z.ln())).abs() < 1e-5);
        let nan = logprobs(&logits, TokenId(4), 0);
        assert_eq!(nan.chosen.logprob, f32::NEG_INFINITY);
        assert!(nan.top.is_empty());
    }
}
