//! One request's structured-output state: masks logit rows, or admits one token without the
//! mask (`admits(t)` only when the mask would allow `t`), and consumes sampled tokens.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::Matcher;
use llguidance::toktrie::{SimpleVob, TokTrie};

use super::GrammarError;

/// Digits in a row (a JSON number's integral part, fraction or exponent) after which tokens
/// that start with a digit are masked while the grammar allows anything else, as llama.cpp's
/// JSON grammars cap number parts at 16 digits.
pub const MAX_NUMBER_DIGITS: usize = 16;

/// Most tokens a constraint consumes between masks ([`Constraint::admits`] then leaves the
/// next one to the mask).
///
/// llguidance renews its lexer's budget of work (`step_lexer_fuel`, spent on building lexer
/// states, shared by every request of one compiled grammar) only when it computes a mask;
/// checks and consumed tokens draw on it too, and an empty budget fails the parser for good.
pub const MASK_AT_LEAST_EVERY: usize = 32;

/// The digit cap of JSON outputs: the tokens that start with a digit (with a zero), and
/// where the output stands (inside a string or not, the digits in a row outside strings).
#[derive(Clone, Debug)]
pub(super) struct NumberCap {
    /// Tokens whose first byte is an ASCII digit.
    digit_start: Arc<SimpleVob>,
    /// Tokens whose first byte is `0`.
    zero_start: Arc<SimpleVob>,
    in_string: bool,
    escaped: bool,
    digits: usize,
}

impl NumberCap {
    pub(super) fn new(digit_start: Arc<SimpleVob>, zero_start: Arc<SimpleVob>) -> Self {
        Self { digit_start, zero_start, in_string: false, escaped: false, digits: 0 }
    }

    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if self.in_string {
                match (self.escaped, b) {
                    (true, _) => self.escaped = false,
                    (false, b'\\') => self.escaped = true,
                    (false, b'"') => self.in_string = false,
                    _ => {}
                }
                continue;
            }
            match b {
                b'0'..=b'9' => self.digits += 1,
                b'"' => {
                    self.in_string = true;
                    self.digits = 0;
                }
                _ => self.digits = 0,
            }
        }
    }

    /// Whether [`NumberCap::cap`] may narrow the next mask.
    fn is_capping(&self) -> bool {
        !self.in_string && self.digits >= MAX_NUMBER_DIGITS
    }

    /// `mask` without digit-starting tokens once a number part is long. When the grammar
    /// needs another digit (the number still equals an exclusive bound: `0.000…` for `> 0`),
    /// without zero-starting ones, since only a non-zero digit moves it past the bound; the
    /// grammar wins when nothing else would be left.
    fn cap(&self, mask: SimpleVob) -> SimpleVob {
        if !self.is_capping() {
            return mask;
        }
        for ban in [&self.digit_start, &self.zero_start] {
            let mut capped = mask.clone();
            capped.sub(ban);
            if !capped.is_zero() {
                return capped;
            }
        }
        mask
    }
}

/// A request's parser state (module docs of [`crate::structured`]).
pub struct Constraint {
    matcher: Matcher,
    /// The end-of-sequence tokens (kept here: a failed matcher no longer gives them).
    eos: Arc<SimpleVob>,
    /// JSON outputs: the digit cap of numbers.
    number_cap: Option<NumberCap>,
    /// Work since the last [`Constraint::take_stats`].
    stats: ConstraintStats,
    /// The last mask's computation time (benchmarks report percentiles).
    last_mask_time: Duration,
    /// Tokens consumed since the last mask.
    consumed_since_mask: usize,
    /// Whether the grammar's dead end was logged (once per request).
    dead_logged: bool,
}

/// What constraints cost: tokens they consumed, masks computed (the rest were admitted by
/// checking the one token, [`Constraint::admits`]), and the time of each kind of work.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConstraintStats {
    pub tokens: u64,
    pub masks: u64,
    pub mask_time: Duration,
    pub checks: u64,
    pub check_time: Duration,
}

impl std::ops::AddAssign for ConstraintStats {
    fn add_assign(&mut self, o: Self) {
        self.tokens += o.tokens;
        self.masks += o.masks;
        self.mask_time += o.mask_time;
        self.checks += o.checks;
        self.check_time += o.check_time;
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            eos: Arc::clone(&self.eos),
            number_cap: self.number_cap.clone(),
            // A copy has done no work yet (totals summed over constraints count work once).
            stats: ConstraintStats::default(),
            last_mask_time: self.last_mask_time,
            consumed_since_mask: self.consumed_since_mask,
            dead_logged: self.dead_logged,
        }
    }
}

impl Constraint {
    pub(super) fn new(
        matcher: Matcher,
        number_cap: Option<NumberCap>,
    ) -> Result<Self, GrammarError> {
        if let Some(message) = matcher.get_error() {
            return Err(GrammarError { message });
        }
        let eos = matcher
            .tok_env()
            .map_err(|e| GrammarError { message: e.to_string() })?
            .tok_trie()
            .eos_token_set();
        Ok(Self {
            matcher,
            eos: Arc::new(eos),
            number_cap,
            stats: ConstraintStats::default(),
            last_mask_time: Duration::ZERO,
            consumed_since_mask: 0,
            dead_logged: false,
        })
    }

    /// Sets every logit of `logits` (`[vocab]`) the grammar does not allow next to `-inf`.
    /// When the grammar allows only tokens that `logits` already excludes (its end-of-sequence
    /// tokens while `min_tokens` holds them back), those tokens get logit 0: the grammar wins,
    /// the output ends (the scheduler ends a constrained request at such a token even before
    /// `min_tokens`). A parser in an error state, or one that allows nothing, allows only
    /// end-of-sequence tokens: the request ends rather than sampling from all `-inf`.
    pub fn mask(&mut self, logits: &mut [f32]) {
        let start = Instant::now();
        let mask = match self.matcher.compute_mask_or_eos() {
            Ok(mask) if !mask.is_zero() => mask,
            _ => {
                if !self.dead_logged {
                    self.dead_logged = true;
                    tracing::warn!(
                        "structured output: the grammar cannot continue ({}); the output ends",
                        self.matcher.get_error().unwrap_or_else(|| "no token allowed".into())
                    );
                }
                self.eos_mask()
            }
        };
        let mask = match &self.number_cap {
            Some(cap) => cap.cap(mask),
            None => mask,
        };
        self.last_mask_time = start.elapsed();
        self.stats.mask_time += self.last_mask_time;
        self.stats.masks += 1;
        self.consumed_since_mask = 0;
        if !apply_mask(&mask, logits) {
            let eos = self.eos_mask();
            let allowed = if mask.is_zero() { &eos } else { &mask };
            allowed.iter_set_entries(|t| {
                if let Some(l) = logits.get_mut(t) {
                    *l = 0.0;
                }
            });
        }
    }

    /// Whether the next [`Constraint::mask`] would allow `token`, found without computing
    /// the mask: `true` only when it certainly would (`false` leaves the question to the
    /// mask). The token's bytes are run through llguidance's own recognizer
    /// (`validate_tokens`, the byte-by-byte walk the mask's trie walk does for every token at
    /// once), so this costs one token's bytes instead of the whole vocabulary's. Left to the
    /// mask, where the two could differ: end-of-sequence, empty (padding) and special
    /// (`0xFF`-marked) tokens, ids outside the vocabulary, a stopped or failed parser, and
    /// numbers past the digit cap (the cap narrows the mask); and any token once
    /// [`MASK_AT_LEAST_EVERY`] were consumed since the last mask, so that llguidance's lexer
    /// budget is renewed at least that often. The parser state is unchanged.
    pub fn admits(&mut self, token: u32) -> bool {
        if self.consumed_since_mask >= MASK_AT_LEAST_EVERY
            || self.number_cap.as_ref().is_some_and(NumberCap::is_capping)
            || self.matcher.is_stopped()
            || self.matcher.is_error()
        {
            return false;
        }
        let Ok(env) = self.matcher.tok_env() else { return false };
        let trie = env.tok_trie();
        let plain = trie.token(token).first().is_some_and(|&b| b != TokTrie::SPECIAL_TOKEN_MARKER);
        if token as usize >= trie.vocab_size() || !plain || trie.eos_tokens().contains(&token) {
            return false;
        }
        let start = Instant::now();
        let admitted = matches!(self.matcher.validate_tokens(&[token]), Ok(1));
        self.stats.check_time += start.elapsed();
        self.stats.checks += 1;
        admitted
    }

    /// Consumes the sampled `token` (one the last [`Constraint::mask`] allowed, or that
    /// [`Constraint::admits`]).
    pub fn accept(&mut self, token: u32) {
        self.stats.tokens += 1;
        self.consumed_since_mask += 1;
        // A token the mask allowed is always consumable; should llguidance still refuse it,
        // the matcher enters its error state and the next mask allows only EOS.
        let _ = self.matcher.consume_token(token);
        if let Some(cap) = &mut self.number_cap
            && let Ok(env) = self.matcher.tok_env()
        {
            cap.feed(env.tok_trie().token(token));
        }
    }

    /// Whether the grammar is complete (only end-of-sequence tokens may follow).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// The work done since the last call (the counters restart at zero).
    pub fn take_stats(&mut self) -> ConstraintStats {
        std::mem::take(&mut self.stats)
    }

    /// The last mask's computation time.
    pub fn last_mask_time(&self) -> Duration {
        self.last_mask_time
    }

    fn eos_mask(&self) -> SimpleVob {
        (*self.eos).clone()
    }

    /// Whether the grammar admits some output from here: its first mask allows a token (an
    /// end-of-sequence one included). Computes a mask; the state is unchanged.
    pub(super) fn admits_some_output(&mut self) -> bool {
        self.matcher.compute_mask_or_eos().is_ok_and(|mask| !mask.is_zero())
            && self.matcher.get_error().is_none()
    }
}

/// `logits[t] = -inf` for every `t` not in `mask`; ids past the mask's length are disallowed.
/// Returns whether an allowed logit is still above `-inf`.
fn apply_mask(mask: &SimpleVob, logits: &mut [f32]) -> bool {
    let words = mask.as_slice();
    let mut any = false;
    for (i, chunk) in logits.chunks_mut(32).enumerate() {
        let word = words.get(i).copied().unwrap_or(0);
        if word == 0 {
            chunk.fill(f32::NEG_INFINITY);
            continue;
        }
        for (bit, l) in chunk.iter_mut().enumerate() {
            if word >> bit & 1 == 0 {
                *l = f32::NEG_INFINITY;
            } else if *l > f32::NEG_INFINITY {
                any = true;
            }
        }
    }
    any
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::test_vocab::{TOKENS, constraint, specs};

    /// `admits` answers for the mask: on random walks through every kind of grammar, at every
    /// state it admits exactly the tokens the mask allows, except those it leaves to the mask
    /// (end of sequence, the padding row, numbers past the digit cap), and asking changes
    /// nothing (the mask after all the questions is the mask before).
    #[test]
    fn admits_exactly_what_the_mask_allows() {
        let vocab = TOKENS.len() + 1;
        let eos = TOKENS.len() as u32;
        let mut rng = kiln_core::Rng::new(7);
        let (mut admitted, mut refused, mut states) = (0, 0, 0);
        for spec in specs() {
            for _walk in 0..6 {
                let mut c = constraint(&spec);
                for _step in 0..40 {
                    let mut before = vec![0.0f32; vocab];
                    c.mask(&mut before);
                    let capping = c.number_cap.as_ref().is_some_and(NumberCap::is_capping);
                    for t in 0..eos {
                        let answer = c.admits(t);
                        let allowed = before[t as usize] == 0.0;
                        if TOKENS[t as usize].is_empty() || capping {
                            assert!(!answer, "{spec:?}: token {t} left to the mask");
                        } else {
                            assert_eq!(answer, allowed, "{spec:?}: {:?}", TOKENS[t as usize]);
                        }
                        admitted += usize::from(answer);
                        refused += usize::from(!allowed);
                    }
                    assert!(!c.admits(eos), "end of sequence is left to the mask");
                    let mut after = vec![0.0f32; vocab];
                    c.mask(&mut after);
                    assert_eq!(before, after, "{spec:?}: asking moved the parser");
                    let allowed: Vec<u32> =
                        (0..eos).filter(|&t| before[t as usize] == 0.0).collect();
                    if allowed.is_empty() {
                        break;
                    }
                    let next = allowed[(rng.next_u64() % allowed.len() as u64) as usize];
                    c.accept(next);
                    states += 1;
                }
            }
        }
        assert!(admitted > 1000 && refused > 1000 && states > 200, "{admitted} {refused} {states}");
    }

    #[test]
    fn apply_mask_keeps_exactly_the_set_bits() {
        let mut mask = SimpleVob::alloc(70);
        for t in [0, 31, 32, 69] {
            mask.allow_token(t);
        }
        let mut logits: Vec<f32> = (0..75).map(|i| i as f32).collect();
        assert!(apply_mask(&mask, &mut logits));
        for (t, &l) in logits.iter().enumerate() {
            if [0, 31, 32, 69].contains(&t) {
                assert_eq!(l, t as f32);
            } else {
                assert_eq!(l, f32::NEG_INFINITY, "token {t}");
            }
        }
        let mut excluded = vec![f32::NEG_INFINITY; 75];
        assert!(!apply_mask(&mask, &mut excluded));
    }
}
