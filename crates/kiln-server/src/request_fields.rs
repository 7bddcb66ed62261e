//! Request fields kiln has no parser for (`SamplingFields::other`): none is dropped without a
//! word. A field that would change the output and that kiln does not implement gets a 400
//! naming it, unless its value is neutral (`null`, `false`, an empty list, `tool_choice:
//! "none"`, ...), which asks for nothing. Fields that change nothing kiln returns (`user`,
//! `metadata`, ...; vLLM ignores them too) are logged at debug level. Any other field is
//! unknown: a 400 naming it unless its value is `null` (vLLM only logs it, and a typo such as
//! `max_token` or a field of a newer API then changes the output silently).

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Fields that would change the output, and why kiln refuses them.
const REFUSED: &[(&str, &str)] = &[
    ("tools", "tools are only supported on /v1/chat/completions"),
    ("tool_choice", "tools are only supported on /v1/chat/completions"),
    ("parallel_tool_calls", "tools are only supported on /v1/chat/completions"),
    ("functions", "the deprecated `functions` is not supported (use `tools`)"),
    ("function_call", "the deprecated `function_call` is not supported (use `tool_choice`)"),
    ("use_beam_search", "beam search is not supported"),
    ("length_penalty", "beam search is not supported"),
    ("include_stop_str_in_output", "`include_stop_str_in_output` is not supported"),
    ("bad_words", "`bad_words` is not supported (use `logit_bias`)"),
    ("allowed_token_ids", "`allowed_token_ids` is not supported (use `structured_outputs`)"),
    ("logits_processors", "custom logits processors are not supported"),
    ("truncate_prompt_tokens", "`truncate_prompt_tokens` is not supported"),
    ("prediction", "predicted outputs are not supported"),
    ("audio", "audio output is not supported"),
    ("modalities", "only text output is supported"),
    ("reasoning_effort", "`reasoning_effort` is only supported on /v1/chat/completions"),
    ("web_search_options", "web search is not supported"),
    ("chat_template", "a per-request chat template is not supported (use --chat-template)"),
    ("chat_template_kwargs", "`chat_template_kwargs` is only supported on /v1/chat/completions"),
    ("continue_final_message", "`continue_final_message` is not supported"),
    ("documents", "`documents` is not supported"),
    ("echo", "`echo` is only supported on /v1/completions"),
    ("return_tokens_as_token_ids", "`return_tokens_as_token_ids` is not supported"),
    ("guided_whitespace_pattern", "`guided_whitespace_pattern` is not supported"),
    ("structural_tag", "structural tags are not supported"),
    ("cache_salt", "`cache_salt` is not supported (the prefix cache is shared)"),
    ("prompt_embeds", "prompt embeddings are not supported (send text or token ids)"),
    ("return_token_ids", "`return_token_ids` is not supported"),
    ("vllm_xargs", "`vllm_xargs` is not supported"),
    // vLLM's router sends these on every request (as `false`, and the reasoning ones `true`).
    ("no_stop_trim", "`no_stop_trim` is not supported (stop strings are trimmed)"),
    ("return_hidden_states", "hidden states are not returned"),
    ("include_reasoning", "`include_reasoning` is only supported on /v1/chat/completions"),
    ("separate_reasoning", "reasoning is not parsed: it is always part of the text"),
    ("stream_reasoning", "reasoning is not parsed: it is always part of the text"),
    ("multi_modal_data", "multimodal inputs are not supported"),
    ("mm_processor_kwargs", "multimodal inputs are not supported"),
    // llama-server's samplers (`n_predict`, `json_schema` and `grammar` are implemented).
    ("typical_p", "locally typical sampling is not supported (1.0 turns it off)"),
    ("mirostat", "mirostat sampling is not supported (0 turns it off)"),
    ("dry_multiplier", "DRY repetition penalties are not supported (0 turns them off)"),
    ("xtc_probability", "XTC sampling is not supported (0 turns it off)"),
    ("dynatemp_range", "dynamic temperature is not supported (0 turns it off)"),
    ("top_n_sigma", "top-n-sigma sampling is not supported (-1 turns it off)"),
    ("n_probs", "`n_probs` is not supported (use `logprobs`)"),
    (
        "lora",
        "per-request LoRA scales are not supported: the --lora adapters apply to every request \
         of the base model; serve an adapter by name (--enable-lora --lora-modules NAME=PATH) \
         and send that name as `model`",
    ),
    ("samplers", "a custom sampler order is not supported"),
];

/// llama-server's fields that only act with another one, which kiln refuses unless it is
/// neutral (e.g. `dry_base` without `dry_multiplier`): without it they change nothing.
const DEPENDENT: &[(&str, &str)] = &[
    ("mirostat_tau", "mirostat"),
    ("mirostat_eta", "mirostat"),
    ("dry_base", "dry_multiplier"),
    ("dry_allowed_length", "dry_multiplier"),
    ("dry_penalty_last_n", "dry_multiplier"),
    ("dry_sequence_breakers", "dry_multiplier"),
    ("xtc_threshold", "xtc_probability"),
    ("dynatemp_exponent", "dynatemp_range"),
];

/// Fields that change nothing kiln returns.
const NO_EFFECT: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "request_id",
    "guided_decoding_backend",
    "spaces_between_special_tokens",
    // llama-server: reusing the KV cache of a prompt's prefix never changes kiln's output.
    "cache_prompt",
];

/// Longest field name an error message repeats.
const MAX_NAME_SHOWN: usize = 64;

/// Refuses the first field of `other` that kiln does not implement and whose value asks for
/// something, and the first unknown field that is not `null`; logs the fields without effect.
pub fn check_other_fields(other: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in other {
        if let Some((field, why)) = REFUSED.iter().find(|(f, _)| f == name) {
            if !is_neutral(field, value) {
                return Err(ApiError::bad_param(field, format!("`{field}`: {why}")));
            }
        } else if NO_EFFECT.contains(&name.as_str()) {
            tracing::debug!("request field `{name}` has no effect");
        } else if let Some((_, control)) = DEPENDENT.iter().find(|(f, _)| f == name) {
            // The controlling field, when given and not neutral, is refused by its own name.
            tracing::debug!("request field `{name}` has no effect without `{control}`");
        } else if !value.is_null() {
            let shown: String = name.chars().take(MAX_NAME_SHOWN).collect();
            return Err(ApiError::bad_param(
                &shown,
                format!("unknown field `{shown}`: kiln does not support it (leave it out)"),
            ));
        }
    }
    Ok(())
}

/// Whether `value` of `field` asks for nothing beyond what kiln does anyway.
fn is_neutral(field: &str, value: &Value) -> bool {
    match (field, value) {
        // Without a reasoning parser the reasoning is in the text: included, and there is none
        // to separate or stream apart; leaving it out would need a parser.
        ("include_reasoning", Value::Bool(include)) => *include,
        (_, Value::Null | Value::Bool(false))
        | ("parallel_tool_calls" | "separate_reasoning" | "stream_reasoning", Value::Bool(_)) => {
            true
        }
        (_, Value::Array(a)) if a.is_empty() => true,
        (_, Value::Object(o)) if o.is_empty() => true,
        ("tool_choice", Value::String(s)) => s == "none" || s == "auto",
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        ("length_penalty" | "typical_p", Value::Number(n)) => n.as_f64() == Some(1.0),
        (
            "mirostat" | "dry_multiplier" | "xtc_probability" | "dynatemp_range",
            Value::Number(n),
        ) => n.as_f64() == Some(0.0),
        ("top_n_sigma", Value::Number(n)) => n.as_f64().is_some_and(|s| s <= 0.0),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn check(body: &Value) -> Result<(), ApiError> {
        check_other_fields(body.as_object().unwrap())
    }

    #[test]
    fn unimplemented_fields_that_ask_for_something_are_refused_by_name() {
        for (body, param) in [
            (json!({"tools": [{"type": "function", "function": {"name": "f"}}]}), "tools"),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (json!({"use_beam_search": true}), "use_beam_search"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"chat_template_kwargs": {"enable_thinking": false}}), "chat_template_kwargs"),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (json!({"include_reasoning": false}), "include_reasoning"),
            (json!({"return_hidden_states": true}), "return_hidden_states"),
            (json!({"typical_p": 0.9}), "typical_p"),
            (json!({"mirostat": 2, "mirostat_tau": 5.0}), "mirostat"),
            (json!({"dry_multiplier": 0.8, "dry_base": 1.75}), "dry_multiplier"),
            (json!({"xtc_probability": 0.5}), "xtc_probability"),
            (json!({"n_probs": 3}), "n_probs"),
        ] {
            assert_eq!(check(&body).unwrap_err().param.as_deref(), Some(param));
        }
    }

    #[test]
    fn neutral_values_and_fields_without_effect_pass() {
        for body in [
            json!({"tools": [], "tool_choice": "none", "parallel_tool_calls": true}),
            json!({"use_beam_search": false, "length_penalty": 1.0, "modalities": ["text"]}),
            json!({"user": "u1", "metadata": {"k": "v"}, "store": false}),
            // What vLLM's router 0.1.17 adds to every chat request.
            json!({"no_stop_trim": false, "return_hidden_states": false, "include_reasoning": true,
                   "separate_reasoning": true, "stream_reasoning": true,
                   "continue_final_message": false}),
            json!({"some_future_field": null}),
            // llama-server's defaults, as its clients send them.
            json!({"typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1,
                   "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
                   "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n"],
                   "xtc_probability": 0.0, "xtc_threshold": 0.1, "top_n_sigma": -1.0,
                   "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "cache_prompt": true}),
        ] {
            assert!(check(&body).is_ok(), "{body}");
        }
    }

    #[test]
    fn unknown_fields_are_refused_by_name() {
        for (body, param) in [
            (json!({"prompt_embeds": "AAAA"}), "prompt_embeds"),
            (json!({"some_future_field": 3}), "some_future_field"),
            (json!({"max_token": 5}), "max_token"),
            (Value::Object(Map::from_iter([("x".repeat(500), json!(1))])), &*"x".repeat(64)),
        ] {
            let e = check(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(param), "{}", e.message);
        }
    }
}
