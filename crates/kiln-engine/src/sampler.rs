//! Per-request token sampling.
//!
//! Order of operations (vLLM's): log-probabilities (when asked) on the raw logits; then logit
//! bias, the `min_tokens` mask of stop tokens, repetition / presence / frequency penalties, and
//! the structured-output mask ([`Constraint`]: every token the grammar does not allow next goes
//! to `-inf`), and (unless greedy) temperature, top-k, top-p, min-p, and a draw: an
//! exponential race over the candidates, keyed by one number from the request's own seeded
//! [`Rng`] (`race`: exact, independent of the candidates' order, and stable under small changes
//! of the distribution, which a draft model's drafts rely on). Greedy picks the lowest index
//! among equal maxima. A constraint consumes each token the sampler returns, and only those.
//! Every token returned is one the mask allows; greedy and unfiltered picks skip computing the
//! mask when the constraint admits the token picked without it, where that is exact
//! ([`Sampler::pick_allowed`]).
//!
//! Numerics: no allowed parameter value overflows or yields NaN. A temperature below
//! [`GREEDY_TEMPERATURE`] samples greedily (vLLM's `_SAMPLING_EPS`): `1 / 1e-38` is not
//! representable. Penalties that overflow a logit saturate at `f32::MAX` (a division by a tiny
//! `repetition_penalty`) or reach `-inf` (excluded). Random sampling works on logits shifted so
//! the best is 0 *before* they are scaled by `1 / temperature`, so every scaled value is
//! `<= 0` and its `exp` is in `[0, 1]`; `+inf` logits win outright and a row with no finite
//! candidate falls back to the greedy choice.
//!
//! Cost: greedy, penalties and the race are `O(vocab)` (the race hashes every candidate and
//! takes `exp` only of those whose noise could still beat the leader: few on a flat row, up to
//! about half on a peaked one); top-k/top-p select candidates with
//! `select_nth_unstable` and sort only those, so a step never sorts the whole vocabulary unless
//! top-p needs more than the best [`TOP_P_FIRST_GUESS`] tokens to reach its mass.

use std::collections::{HashMap, HashSet};

use kiln_core::{SamplingParams, TokenId};

use crate::Rng;
use crate::logprobs::{Logprobs, logprobs};
use crate::structured::{Constraint, ConstraintStats};

/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`).
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Candidates sorted first when top-p is on and top-k is not.
const TOP_P_FIRST_GUESS: usize = 512;

/// Sampling state of one request.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// Output token → occurrences (presence / frequency penalties).
    output_counts: HashMap<u32, u32>,
    /// Prompt and output tokens seen (repetition penalty).
    seen: HashSet<u32>,
    /// `(token, logit)` scratch reused across steps.
    candidates: Vec<(u32, f32)>,
    /// Tokens masked while fewer than `min_tokens` were generated (EOS ids and stop ids).
    stop_ids: Vec<u32>,
    num_generated: usize,
    /// Copy of the raw logits when log-probabilities are asked for (`[vocab]`).
    raw: Vec<f32>,
    /// The structured-output parser state (`params.structured`, compiled by the engine).
    constraint: Option<Constraint>,
}

impl Sampler {
    /// `seed` is used when the params carry none.
    pub fn new(params: SamplingParams, prompt: &[u32], seed: u64) -> Self {
        let rng = Rng::new(params.seed.unwrap_or(seed));
        let seen = if params.repetition_penalty == 1.0 {
            HashSet::new()
        } else {
            prompt.iter().copied().collect()
        };
        Self {
            params,
            rng,
            output_counts: HashMap::new(),
            seen,
            candidates: Vec::new(),
            stop_ids: Vec::new(),
            num_generated: 0,
            raw: Vec::new(),
            constraint: None,
        }
    }

    /// Masks every sampled row with `constraint` and hands it each returned token.
    #[must_use]
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Self {
        self.constraint = constraint;
        self
    }

    /// Sets the model's end-of-sequence ids, masked (with the params' `stop_token_ids`) until
    /// `min_tokens` tokens were generated; ignored with `ignore_eos`.
    #[must_use]
    pub fn with_eos_token_ids(mut self, eos: &[u32]) -> Self {
        self.stop_ids = self.params.stop_token_ids.iter().map(|t| t.0).collect();
        if !self.params.ignore_eos {
            self.stop_ids.extend_from_slice(eos);
        }
        self
    }

    /// A copy that draws a draft model's tokens for this request: the same params, random
    /// state, penalty counts and `min_tokens` progress, without the structured-output state and
    /// log-probabilities. Drawing draft `i` from the draft's row with it races the tokens under
    /// the key this sampler will use for the token after draft `i - 1` (when the drafts before
    /// it are accepted), so where the draft's distribution is close to the target's the two
    /// races have the same winner, and verification (which samples the target as decoding
    /// alone would) accepts the draft. It only proposes: the target's tokens never depend on it.
    #[must_use]
    pub fn for_drafting(&self) -> Self {
        Self {
            params: SamplingParams {
                logprobs: None,
                prompt_logprobs: None,
                structured: None,
                ..self.params.clone()
            },
            rng: self.rng.clone(),
            output_counts: self.output_counts.clone(),
            seen: self.seen.clone(),
            candidates: Vec::new(),
            stop_ids: self.stop_ids.clone(),
            num_generated: self.num_generated,
            raw: Vec::new(),
            constraint: None,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Records a generated token (call after each sample, or for teacher-forced tokens).
    pub fn observe(&mut self, token: u32) {
        self.num_generated += 1;
        *self.output_counts.entry(token).or_insert(0) += 1;
        if self.params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
    }

    /// Picks the next token from `logits` (modified in place by penalties and temperature).
    pub fn sample(&mut self, logits: &mut [f32]) -> TokenId {
        self.sample_with_logprobs(logits).0
    }

    /// [`Sampler::sample`], plus the log-probabilities the params ask for (`logprobs`).
    pub fn sample_with_logprobs(&mut self, logits: &mut [f32]) -> (TokenId, Option<Logprobs>) {
        let wants_logprobs = self.params.logprobs;
        if wants_logprobs.is_some() {
            self.raw.clear();
            self.raw.extend_from_slice(logits);
        }
        self.apply_bias_and_penalties(logits);
        let token = match self.constraint.take() {
            Some(mut constraint) => {
                let token = self.pick_allowed(&mut constraint, logits);
                constraint.accept(token);
                self.constraint = Some(constraint);
                token
            }
            None => self.pick(logits),
        };
        self.observe(token);
        let lp = wants_logprobs.map(|k| logprobs(&self.raw, TokenId(token), k));
        (TokenId(token), lp)
    }

    /// Verifies `drafts` against `logits` (`[drafts.len() + 1, vocab]`: row 0 predicting the
    /// token after the last known one, row `1 + i` the token after draft `i`), drafts forming a
    /// tree by `parents` (draft `i` follows draft `parents[i]`, or the last known token for
    /// `u32::MAX`; a chain is `MAX, 0, 1, ...`). Samples row by row from row 0, as decoding one
    /// token at a time would, moving to the child draft holding the sampled token, and stops at
    /// the first sampled token no child holds. Appends the sampled tokens to `out` (the
    /// accepted drafts then one more) and the accepted drafts' indices to `path`. Each row is
    /// sampled as decoding alone would sample it (same penalties, same random state), so the
    /// tokens are those of decoding alone whatever the drafts are, and follow the target's
    /// distribution; the drafts only decide how many rows are used.
    pub fn verify(
        &mut self,
        logits: &mut [f32],
        drafts: &[u32],
        parents: &[u32],
        out: &mut Vec<(TokenId, Option<Logprobs>)>,
        path: &mut Vec<usize>,
    ) {
        let vocab = logits.len() / (drafts.len() + 1);
        debug_assert_eq!(vocab * (drafts.len() + 1), logits.len(), "one row per draft plus one");
        debug_assert_eq!(drafts.len(), parents.len(), "one parent per draft");
        let mut node = u32::MAX;
        loop {
            let row = if node == u32::MAX { 0 } else { node as usize + 1 };
            let (token, lp) = self.sample_with_logprobs(&mut logits[row * vocab..][..vocab]);
            out.push((token, lp));
            let child = (0..drafts.len()).find(|&i| parents[i] == node && drafts[i] == token.0);
            let Some(child) = child else { break };
            path.push(child);
            node = child as u32;
        }
    }

    /// Whether this request picks the argmax (temperature 0 or below [`GREEDY_TEMPERATURE`]).
    fn is_greedy(&self) -> bool {
        self.params.is_greedy() || self.params.temperature < GREEDY_TEMPERATURE
    }

    /// Greedy or random, as the params say.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.is_greedy() { argmax(logits) } else { self.sample_random(logits) }
    }

    /// What [`Sampler::pick`] returns from `logits` masked by `constraint`, mostly without
    /// computing the mask (a walk of the whole vocabulary, milliseconds for some grammar
    /// states). Greedy, and random without top-k, top-p or min-p, pick from the unmasked
    /// logits first; the pick stands if the grammar allows it (the constraint admits it, or
    /// else the mask, now computed, keeps it), and otherwise the masked logits are picked
    /// from again. Greedy: masking only removes tokens, so an allowed argmax is the masked
    /// argmax. Random: a draw from the whole distribution kept exactly when allowed, else a
    /// draw from the masked one, is a draw from the masked distribution (allowed mass `A`:
    /// `p(t) + (1 - A) * p(t) / A = p(t) / A`); the second draw advances the request's random
    /// state, so a seed still fixes the output. The filters keep tokens by rank or mass among
    /// what the mask leaves, so with them the mask comes first.
    fn pick_allowed(&mut self, constraint: &mut Constraint, logits: &mut [f32]) -> u32 {
        let p = &self.params;
        if !self.is_greedy() && (p.top_k != 0 || p.top_p < 1.0 || p.min_p > 0.0) {
            constraint.mask(logits);
            return self.pick(logits);
        }
        let token = self.pick(logits);
        let finite = |l: &[f32]| l.get(token as usize).is_some_and(|&l| l > f32::NEG_INFINITY);
        if finite(logits) {
            if constraint.admits(token) {
                return token;
            }
            constraint.mask(logits);
            if finite(logits) {
                return token;
            }
        } else {
            // No finite pick (a fallback, not a draw): the masked logits decide.
            constraint.mask(logits);
        }
        self.pick(logits)
    }

    /// Hands over the structured-output work done since the last call.
    pub fn take_constraint_stats(&mut self) -> Option<ConstraintStats> {
        self.constraint.as_mut().map(Constraint::take_stats)
    }

    fn apply_bias_and_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        for &(t, bias) in &p.logit_bias {
            if let Some(l) = logits.get_mut(t.index()) {
                *l += bias;
            }
        }
        if self.num_generated < p.min_tokens {
            for &t in &self.stop_ids {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    let penalized = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                    // A tiny penalty divides a positive logit past f32::MAX: saturate.
                    *l = if penalized == f32::INFINITY { f32::MAX } else { penalized };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &count) in &self.output_counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
        }
    }

    /// A draw from the tempered, filtered distribution of `logits`: an exponential race
    /// ([`race`]) keyed by one draw of the request's random state.
    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let raw_max =
            logits.iter().copied().filter(|l| !l.is_nan()).fold(f32::NEG_INFINITY, f32::max);
        if raw_max.is_infinite() || !inv_t.is_finite() {
            // +inf wins outright; no finite candidate or no finite scale: greedy.
            return argmax(logits);
        }
        let key = self.rng.next_u64();
        // Shifted before scaling: every value is <= 0, the best is exactly 0.
        let scaled = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| !l.is_nan())
            .map(|(i, &l)| (i as u32, (l - raw_max) * inv_t));
        let filtered = (p.top_k > 0 && p.top_k < logits.len()) || p.top_p < 1.0 || p.min_p > 0.0;
        if !filtered {
            return race(scaled, key).unwrap_or(0);
        }
        let cands = &mut self.candidates;
        cands.clear();
        cands.extend(scaled);
        let by_logit_desc =
            |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cands.truncate(p.top_k);
        }
        if p.top_p < 1.0 && !cands.is_empty() {
            let total: f64 = cands.iter().map(|c| f64::from(c.1.exp())).sum();
            let target = f64::from(p.top_p) * total;
            let mut guess = TOP_P_FIRST_GUESS.min(cands.len());
            loop {
                if guess < cands.len() {
                    cands.select_nth_unstable_by(guess - 1, by_logit_desc);
                }
                cands[..guess].sort_unstable_by(by_logit_desc);
                let mut mass = 0.0f64;
                let keep = cands[..guess].iter().position(|c| {
                    mass += f64::from(c.1.exp());
                    mass >= target
                });
                match keep {
                    Some(last) => {
                        cands.truncate(last + 1);
                        break;
                    }
                    None if guess == cands.len() => break,
                    None => guess = cands.len(),
                }
            }
        }
        if p.min_p > 0.0 {
            let threshold = p.min_p.ln();
            cands.retain(|c| c.1 >= threshold);
        }
        race(cands.iter().copied(), key).unwrap_or(0)
    }
}

/// Relative slack in [`race`]'s shortcuts, far above `f64` rounding near 1 (`1.1e-16`), so a
/// token they skip could not have won.
const RACE_SLACK: f64 = 1e-12;

/// The winner of an exponential race over `cands` (`(token, scaled logit <= 0)`, the best
/// exactly 0): token `t` of weight `w = exp(scaled)` finishes at `E_t / w`, with
/// `E_t = -ln(U_t)` exponential and `U_t = keyed_uniform(key, t)`, and the first to finish
/// wins (ties: the lower id). That is a draw with probability `w / sum(w)` (the Gumbel-max
/// trick), decided per token, so it does not depend on the candidates' order, and two nearby
/// distributions raced under the same key usually pick the same token: at least
/// `(1 - d) / (1 + d)` of the time, `d` their total-variation distance. A draft model draws its
/// drafts this way with the request's key (`Sampler::for_drafting`), which is what makes its
/// sampled drafts acceptable. `None` when no candidate has a weight (empty, or all `-inf`).
///
/// Cost: one hash per candidate; `exp` only where `U_t` is high enough to finish before the
/// leader even at weight 1, and `ln` only where it can also finish before the leader at its
/// weight (`-ln(u) >= x` whenever `u <= 1 - x`).
fn race(cands: impl Iterator<Item = (u32, f32)>, key: u64) -> Option<u32> {
    let (mut best, mut winner) = (f64::INFINITY, None::<u32>);
    // `U_t` at or below this cannot finish first even at weight 1.
    let mut no_chance = 0.0f64;
    for (token, scaled) in cands {
        let u = kiln_core::keyed_uniform(key, u64::from(token));
        if u <= no_chance {
            continue;
        }
        let w = f64::from(scaled.exp());
        if w == 0.0 {
            continue;
        }
        let x = best * w;
        if x.is_finite() && u <= 1.0 - x * (1.0 + RACE_SLACK) - RACE_SLACK {
            continue;
        }
        let time = -u.ln() / w;
        if time < best || (time == best && winner.is_some_and(|leader| token < leader)) {
            (best, winner) = (time, Some(token));
            no_chance = (-best).exp() * (1.0 - RACE_SLACK);
        }
    }
    winner
}

/// Index of the largest value (lowest index among ties; NaN never wins).
pub fn argmax(values: &[f32]) -> u32 {
    kiln_core::host_ops::argmax(values) as u32
}

#[cfg(test)]
mod tests;
