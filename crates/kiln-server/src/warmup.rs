//! Warm-up prompts (`kiln serve --warmup-prompts FILE`): prefilled before `/health` turns 200,
//! so that the first requests sharing their prefixes (a long system prompt) hit the prefix
//! cache instead of paying a cold prefill.
//!
//! The file is JSON Lines: each non-blank line is either a JSON string (a raw prompt, tokenized
//! as `/v1/completions` tokenizes one) or an object in `/tokenize`'s form: `{"prompt": ...}`
//! or `{"messages": [...]}` (rendered by the chat template with the generation prompt, as
//! `/v1/chat/completions` renders them; `add_generation_prompt`, `tools` and
//! `chat_template_kwargs` as there; any other key is refused). Every line is checked when the
//! server starts, before the model loads; a bad line stops the start with its line number.
//! Each prompt then runs with `max_tokens: 1`; only its full KV blocks stay cached, as for any
//! request.

use std::sync::Arc;

use kiln_core::SamplingParams;

use crate::protocol::TokenizeRequest;
use crate::routes::misc::request_tokens;
use crate::state::Loaded;

/// The keys a warm-up object may hold: `/tokenize`'s, less `model` (there is one model).
const KEYS: [&str; 6] = [
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "tools",
    "chat_template_kwargs",
];

/// One parsed line of a warm-up file, with its line number (from 1).
#[derive(Debug)]
pub struct WarmupPrompt {
    pub line: usize,
    request: TokenizeRequest,
}

/// Parses a warm-up file (see the module docs); errors name the line.
pub fn parse(text: &str) -> Result<Vec<WarmupPrompt>, String> {
    let mut prompts = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(raw).map_err(|e| format!("line {line}: not JSON: {e}"))?;
        let request = match value {
            serde_json::Value::String(prompt) => TokenizeRequest {
                model: None,
                prompt: Some(prompt),
                messages: None,
                add_special_tokens: None,
                add_generation_prompt: None,
                tools: None,
                chat_template_kwargs: None,
            },
            serde_json::Value::Object(ref fields) => {
                // Nothing in a warm-up line is dropped unread: a key it would ignore is refused.
                if let Some(key) = fields.keys().find(|k| !KEYS.contains(&k.as_str())) {
                    return Err(format!(
                        "line {line}: `{key}` has no use in a warm-up prompt (known: {})",
                        KEYS.join(", ")
                    ));
                }
                let r: TokenizeRequest = serde_json::from_value(value)
                    .map_err(|e| format!("line {line}: not a prompt or messages object: {e}"))?;
                if r.prompt.is_some() == r.messages.is_some() {
                    return Err(format!(
                        "line {line}: give exactly one of `prompt` and `messages`"
                    ));
                }
                r
            }
            _ => return Err(format!("line {line}: a JSON string or object is expected")),
        };
        prompts.push(WarmupPrompt { line, request });
    }
    Ok(prompts)
}

/// What a warm-up did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WarmupSummary {
    pub prompts: usize,
    /// Prompt tokens prefilled (cache hits included).
    pub tokens: usize,
}

/// Prefills every prompt on `loaded`'s engine (all submitted at once, so they batch) and waits
/// for them; errors name the line.
pub async fn run(
    loaded: &Arc<Loaded>,
    prompts: Vec<WarmupPrompt>,
) -> Result<WarmupSummary, String> {
    let max_model_len = loaded.limits.max_model_len;
    let mut batch = Vec::with_capacity(prompts.len());
    for WarmupPrompt { line, request } in prompts {
        let tokens = request_tokens(loaded, request)
            .await
            .map_err(|e| format!("line {line}: {}", e.message))?;
        if tokens.is_empty() || tokens.len() >= max_model_len {
            return Err(format!(
                "line {line}: {} tokens; a warm-up prompt needs 1 to {} (the context is {max_model_len})",
                tokens.len(),
                max_model_len - 1
            ));
        }
        batch.push((line, tokens));
    }
    let loaded = Arc::clone(loaded);
    tokio::task::spawn_blocking(move || {
        let mut summary = WarmupSummary::default();
        let mut streams = Vec::with_capacity(batch.len());
        for (line, tokens) in batch {
            summary.tokens += tokens.len();
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) };
            let stream = loaded
                .engine
                .submit(tokens, params, 0)
                .map_err(|e| format!("line {line}: the engine refused it: {e}"))?;
            streams.push((line, stream));
        }
        for (line, mut stream) in streams {
            while let Some(item) = stream.recv() {
                if let Err(e) = item {
                    return Err(format!("line {line}: {e}"));
                }
            }
            summary.prompts += 1;
        }
        Ok(summary)
    })
    .await
    .map_err(|e| format!("the warm-up task failed: {e}"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_prompts_or_tokenize_objects_and_errors_name_the_line() {
        let text = "\"a system prompt\"\n\n{\"messages\": [{\"role\": \"system\", \"content\": \"x\"}]}\n\
                    {\"prompt\": \"p\", \"add_special_tokens\": false}\n";
        let prompts = parse(text).unwrap();
        assert_eq!(prompts.iter().map(|p| p.line).collect::<Vec<_>>(), [1, 3, 4]);
        assert_eq!(prompts[0].request.prompt.as_deref(), Some("a system prompt"));
        assert!(prompts[1].request.messages.is_some());
        assert_eq!(prompts[2].request.add_special_tokens, Some(false));
        for (bad, message) in [
            ("\"ok\"\n{", "line 2: not JSON"),
            ("42", "line 1: a JSON string or object is expected"),
            ("{}", "line 1: give exactly one of `prompt` and `messages`"),
            ("{\"prompt\": \"a\", \"messages\": []}", "line 1: give exactly one"),
            ("{\"prompt\": 7}", "line 1: not a prompt or messages object"),
            ("{\"prompt\": \"a\", \"max_tokens\": 9}", "line 1: `max_tokens` has no use"),
            ("{\"model\": \"m\", \"prompt\": \"a\"}", "line 1: `model` has no use"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.starts_with(message), "{bad:?}: {err}");
        }
        assert!(parse("\n  \n").unwrap().is_empty());
    }
}
