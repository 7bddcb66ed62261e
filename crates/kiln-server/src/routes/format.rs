//! Log-probabilities in the wire formats: legacy completions (`tokens`, `token_logprobs`,
//! `top_logprobs`, `text_offset`), chat (`content[]` with `bytes`), and vLLM's
//! `prompt_logprobs` (per position, token id → `{logprob, rank, decoded_token}`).
//! `-inf` is sent as -9999.0 (JSON has no infinity), as vLLM does.

use kiln_core::TokenId;
use kiln_engine::{Logprobs, PromptLogprobs, TokenLogprob};
use kiln_tokenizer::Tokenizer;
use serde_json::{Map, Value, json};

fn finite(lp: f32) -> f64 {
    if lp.is_finite() { f64::from(lp) } else { -9999.0 }
}

/// The text of one token as a client sees it (special tokens included).
pub fn token_text(tokenizer: &Tokenizer, token: TokenId) -> String {
    tokenizer.decode(&[token.0], false).unwrap_or_default()
}

/// Chat's `logprobs.content` entries.
pub fn chat_logprobs(tokenizer: &Tokenizer, items: &[Logprobs]) -> Value {
    let entry = |t: &TokenLogprob| {
        let text = token_text(tokenizer, t.token);
        json!({"token": text, "logprob": finite(t.logprob), "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = items
        .iter()
        .map(|lp| {
            let mut e = entry(&lp.chosen);
            e["top_logprobs"] = lp.top.iter().map(entry).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions' `logprobs` object; `prompt` entries (echo) come first, the first of
/// them without a log-probability. `text_offset` counts bytes from `start_offset`.
pub fn completion_logprobs(
    tokenizer: &Tokenizer,
    prompt: Option<(&[TokenId], &PromptLogprobs)>,
    items: &[(TokenId, Option<&Logprobs>)],
    start_offset: usize,
) -> Value {
    let mut tokens = Vec::new();
    let mut token_logprobs = Vec::new();
    let mut top_logprobs = Vec::new();
    let mut text_offset = Vec::new();
    let mut offset = start_offset;
    let mut push = |token: TokenId, lp: Option<&Logprobs>| {
        let text = token_text(tokenizer, token);
        text_offset.push(offset);
        offset += text.len();
        tokens.push(Value::String(text));
        token_logprobs.push(lp.map_or(Value::Null, |lp| json!(finite(lp.chosen.logprob))));
        top_logprobs.push(lp.map_or(Value::Null, |lp| {
            let mut top = Map::new();
            for t in &lp.top {
                top.insert(token_text(tokenizer, t.token), json!(finite(t.logprob)));
            }
            Value::Object(top)
        }));
    };
    if let Some((ids, lps)) = prompt {
        for (i, &id) in ids.iter().enumerate() {
            push(id, lps.get(i).and_then(Option::as_ref));
        }
    }
    for &(id, lp) in items {
        push(id, lp);
    }
    json!({
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    })
}

/// vLLM's `prompt_logprobs`: `null` for the first position, then a map from token id to
/// `{logprob, rank, decoded_token}` holding the prompt token and the top ones.
pub fn prompt_logprobs(tokenizer: &Tokenizer, lps: &PromptLogprobs) -> Value {
    lps.iter()
        .map(|entry| {
            entry.as_ref().map_or(Value::Null, |lp| {
                let mut map = Map::new();
                for t in std::iter::once(&lp.chosen).chain(&lp.top) {
                    map.entry(t.token.0.to_string()).or_insert_with(|| {
                        json!({
                            "logprob": finite(t.logprob),
                            "rank": t.rank,
                            "decoded_token": token_text(tokenizer, t.token),
                        })
                    });
                }
                Value::Object(map)
            })
        })
        .collect()
}
