//! Bounds on the work of tokenizing client text, spent before the prompt's length is known.
//!
//! - **By bytes first.** No token stands for more than [`TokenizeGate::max_token_bytes`] bytes
//!   of text (the longest token of the vocabulary, control-token names included), so a text of
//!   `b` bytes is at least `b / (max_token_bytes × NORMALIZATION_SLACK)` tokens. A text that
//!   cannot fit the context by that count is refused before it is tokenized (400,
//!   `input_tokens`, the parameter of the token-count refusal). `NORMALIZATION_SLACK` covers
//!   normalizers that shorten text before it is split (Unicode composition at most halves
//!   it). So tokenizing one request's text costs at most
//!   `max_model_len × max_token_bytes × NORMALIZATION_SLACK` bytes of work.
//! - **Few at once.** Texts over [`LARGE_TEXT_BYTES`] are tokenized under one of a few permits
//!   (half the cores, at least one), so a burst of huge prompts queues behind those permits
//!   instead of taking every blocking thread and core; shorter texts never wait for a permit.

use tokio::sync::{Semaphore, SemaphorePermit};

use crate::error::ApiError;

/// How much a normalizer may shorten text before it is split into tokens.
const NORMALIZATION_SLACK: usize = 4;

/// Texts at least this long (bytes, summed over one request) wait for a tokenizing permit.
pub const LARGE_TEXT_BYTES: usize = 64 << 10;

/// The byte bound and the permits of one model's tokenizer.
#[derive(Debug)]
pub struct TokenizeGate {
    /// The longest token's text, in bytes (at least 1).
    max_token_bytes: usize,
    permits: Semaphore,
}

impl TokenizeGate {
    /// A gate for a vocabulary whose tokens decode to `token_bytes`, with `num_permits` large
    /// tokenizations at once (at least one).
    pub fn new(token_bytes: &[Vec<u8>], num_permits: usize) -> Self {
        let max_token_bytes = token_bytes.iter().map(Vec::len).max().unwrap_or(1).max(1);
        Self { max_token_bytes, permits: Semaphore::new(num_permits.max(1)) }
    }

    /// Permits for this machine: half its cores, at least one.
    pub fn default_permits() -> usize {
        std::thread::available_parallelism().map_or(1, |n| n.get() / 2).max(1)
    }

    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The fewest tokens a text of `num_bytes` can be.
    pub fn min_tokens(&self, num_bytes: usize) -> usize {
        num_bytes / (self.max_token_bytes * NORMALIZATION_SLACK)
    }

    /// Refuses a text of `num_bytes` that cannot fit a context of `max_model_len` tokens with
    /// room for one output token (the token-count check's rule).
    pub fn check_fits(&self, num_bytes: usize, max_model_len: usize) -> Result<(), ApiError> {
        let at_least = self.min_tokens(num_bytes);
        if at_least < max_model_len {
            return Ok(());
        }
        Err(ApiError::bad_param(
            "input_tokens",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 prompt is {num_bytes} bytes long, which is at least {at_least} tokens for this \
                 tokenizer. Please reduce the length of the input prompt. \
                 (parameter=input_tokens, value={at_least})"
            ),
        ))
    }

    /// A permit to tokenize `num_bytes` of text: `None` (no wait) below
    /// [`LARGE_TEXT_BYTES`], else one of the few permits, waited for.
    pub async fn admit(&self, num_bytes: usize) -> Result<Option<SemaphorePermit<'_>>, ApiError> {
        if num_bytes < LARGE_TEXT_BYTES {
            return Ok(None);
        }
        self.permits
            .acquire()
            .await
            .map(Some)
            .map_err(|_| ApiError::internal("the tokenizer permits are closed"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_that_cannot_fit_are_refused_by_their_bytes() {
        let gate = TokenizeGate::new(&[b"a".to_vec(), b"abcd".to_vec(), Vec::new()], 1);
        assert_eq!(gate.max_token_bytes(), 4);
        // 4-byte tokens, shortened at most 4x: 16 bytes a token at best.
        assert!(gate.check_fits(16 * 99, 100).is_ok());
        let e = gate.check_fits(16 * 100, 100).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("input_tokens"));
        assert!(e.message.contains("at least 100 tokens"), "{}", e.message);
        assert_eq!(TokenizeGate::new(&[], 0).max_token_bytes(), 1);
    }

    #[tokio::test]
    async fn only_large_texts_wait_for_a_permit() {
        let gate = TokenizeGate::new(&[b"ab".to_vec()], 1);
        let held = gate.admit(LARGE_TEXT_BYTES).await.unwrap();
        assert!(held.is_some());
        assert!(gate.admit(LARGE_TEXT_BYTES - 1).await.unwrap().is_none());
        let waiting = gate.admit(LARGE_TEXT_BYTES);
        let timed = tokio::time::timeout(std::time::Duration::from_millis(50), waiting).await;
        assert!(timed.is_err(), "a second large text waits while the permit is held");
        drop(held);
        assert!(gate.admit(LARGE_TEXT_BYTES).await.unwrap().is_some());
    }
}
