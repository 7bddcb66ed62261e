//! Turns a request's sampling fields into engine [`SamplingParams`], refusing anything out of
//! range with a 400 that names the parameter. Limits that depend on the prompt (context length,
//! default `max_tokens`) are applied per prompt by [`GenerationSpec::for_prompt`].

use kiln_core::{SamplingParams, TokenId};
use kiln_tokenizer::GenerationDefaults;

use crate::error::ApiError;
use crate::protocol::SamplingFields;

/// Most parallel samples per prompt (`n`).
pub const MAX_N: usize = 128;
/// Most stop strings, and the longest one in bytes.
pub const MAX_STOP_STRINGS: usize = 32;
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// What validation needs to know about the model and the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub max_model_len: usize,
    pub vocab_size: usize,
    pub max_logprobs: usize,
    /// `--max-tokens-default`: `max_tokens` of requests that give none.
    pub max_tokens_default: Option<usize>,
    /// `--max-tokens-cap`: most tokens a request may ask for.
    pub max_tokens_cap: Option<usize>,
}

/// A validated request, before its prompts are known.
#[derive(Clone, Debug)]
pub struct GenerationSpec {
    /// `max_tokens` here is a placeholder until [`GenerationSpec::for_prompt`].
    pub params: SamplingParams,
    /// What the request asked for (`None`: `--max-tokens-default` or `--max-tokens-cap`,
    /// at most what is left of the context; without them, fill the context).
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stop: Vec<String>,
    pub priority: i64,
    pub skip_special_tokens: bool,
    pub stream: bool,
    /// Where a stream reports usage (`stream_options`).
    pub usage: UsageReport,
    /// The parameter that asked for `params.structured` (compile errors name it).
    pub structured_param: Option<&'static str>,
    /// The LoRA adapter `model` named (the default: the base model).
    pub adapter: kiln_engine::AdapterBinding,
    /// The request's hold on that adapter (`routes::ResolvedAdapter`), kept while the spec
    /// lives.
    pub adapter_lease: Option<std::sync::Arc<crate::lora::AdapterLease>>,
    /// `kv_transfer_params`: a prefill/decode handoff (checked against the server by the
    /// route, `kv_transfer::check`).
    pub kv_transfer: Option<crate::kv_transfer::TransferAsk>,
}

/// Where a stream reports usage (`stream_options`).
#[derive(Clone, Copy, Debug, Default)]
pub struct UsageReport {
    /// `include_usage`: a last chunk with no choices carries the usage (and every other chunk
    /// `usage: null`).
    pub last_chunk: bool,
    /// `continuous_usage_stats` (vLLM's): every chunk carries the usage so far.
    pub every_chunk: bool,
}

fn to_usize(param: &str, value: i64, min: i64) -> Result<usize, ApiError> {
    if value < min {
        return Err(ApiError::bad_param(
            param,
            format!("`{param}` must be at least {min}, got {value}"),
        ));
    }
    usize::try_from(value)
        .map_err(|_| ApiError::bad_param(param, format!("`{param}` is too large")))
}

fn to_f32(param: &str, value: f64) -> Result<f32, ApiError> {
    let v = value as f32;
    if v.is_finite() {
        Ok(v)
    } else {
        Err(ApiError::bad_param(param, format!("`{param}` must be a finite number, got {value}")))
    }
}

/// A token id named by `param`: 400 unless `value` fits one (0 to `u32::MAX`). Whether it is
/// inside the vocabulary is checked once, when the request is prepared for the engine
/// ([`kiln_engine::PreparedRequest`]), with the same message.
pub fn token_id(param: &str, value: i64, limits: &Limits) -> Result<TokenId, ApiError> {
    u32::try_from(value).map(TokenId).map_err(|_| out_of_vocab(param, value, limits))
}

/// A token id named by `param`, or 400 when it is outside the vocabulary (for ids that are
/// not generated from, such as `/detokenize`'s).
pub fn vocab_token_id(param: &str, value: i64, limits: &Limits) -> Result<TokenId, ApiError> {
    match token_id(param, value, limits) {
        Ok(t) if (t.0 as usize) < limits.vocab_size => Ok(t),
        _ => Err(out_of_vocab(param, value, limits)),
    }
}

fn out_of_vocab(param: &str, value: i64, limits: &Limits) -> ApiError {
    ApiError::bad_param(
        param,
        format!(
            "`{param}`: token id {value} is outside the vocabulary (valid ids are 0 to {})",
            limits.vocab_size.saturating_sub(1)
        ),
    )
}

/// Validates the shared fields; `max_tokens` is the completions field or chat's
/// `max_completion_tokens` (whichever the request set), `logprobs` the number of top
/// log-probabilities asked for per token.
pub fn spec(
    mut f: SamplingFields,
    max_tokens: Option<i64>,
    logprobs: Option<usize>,
    limits: &Limits,
    defaults: &GenerationDefaults,
) -> Result<GenerationSpec, ApiError> {
    crate::request_fields::check_other_fields(&f.other)?;
    let structured = crate::structured_fields::structured_output(&mut f)?;
    let n = to_usize("n", f.n.unwrap_or(1), 1)?;
    if n > MAX_N {
        return Err(ApiError::bad_param("n", format!("`n` must be at most {MAX_N}, got {n}")));
    }
    if let Some(best_of) = f.best_of
        && best_of != 1
        && best_of != n as i64
    {
        return Err(ApiError::bad_param("best_of", "`best_of` other than `n` is not supported"));
    }
    let max_tokens = max_tokens.map(|m| to_usize("max_tokens", m, 1)).transpose()?;
    if let (Some(m), Some(cap)) = (max_tokens, limits.max_tokens_cap)
        && m > cap
    {
        return Err(ApiError::bad_param(
            "max_tokens",
            format!("`max_tokens` must be at most {cap} (--max-tokens-cap), got {m}"),
        ));
    }
    let mut params = SamplingParams {
        temperature: match f.temperature {
            Some(t) => to_f32("temperature", t)?,
            None => defaults.temperature.unwrap_or(1.0),
        },
        top_p: match f.top_p {
            Some(p) => to_f32("top_p", p)?,
            None => defaults.top_p.unwrap_or(1.0),
        },
        top_k: match f.top_k {
            Some(-1 | 0) => 0,
            Some(k) => to_usize("top_k", k, -1)?,
            None => defaults.top_k.unwrap_or(0),
        },
        min_p: f.min_p.map_or(Ok(0.0), |p| to_f32("min_p", p))?,
        repetition_penalty: match f.repetition_penalty {
            Some(p) => to_f32("repetition_penalty", p)?,
            None => defaults.repetition_penalty.unwrap_or(1.0),
        },
        presence_penalty: f.presence_penalty.map_or(Ok(0.0), |p| to_f32("presence_penalty", p))?,
        frequency_penalty: f
            .frequency_penalty
            .map_or(Ok(0.0), |p| to_f32("frequency_penalty", p))?,
        ..SamplingParams::default()
    };
    params.seed = f.seed.map(|s| s as u64);
    params.ignore_eos = f.ignore_eos.unwrap_or(false);
    params.min_tokens =
        f.min_tokens.map(|m| to_usize("min_tokens", m, 0)).transpose()?.unwrap_or(0);
    token_fields(&mut params, f.stop_token_ids, f.logit_bias, limits)?;
    let structured_param = structured.as_ref().map(|(_, param)| *param);
    params.structured = structured.map(|(spec, _)| spec);
    let check_logprobs = |param: &str, k: usize| {
        if k > limits.max_logprobs {
            Err(ApiError::bad_param(
                param,
                format!(
                    "`{param}` must be at most {} (--max-logprobs), got {k}",
                    limits.max_logprobs
                ),
            ))
        } else {
            Ok(k)
        }
    };
    params.logprobs = logprobs.map(|k| check_logprobs("logprobs", k)).transpose()?;
    params.prompt_logprobs = f
        .prompt_logprobs
        .map(|k| {
            to_usize("prompt_logprobs", k, 0).and_then(|k| check_logprobs("prompt_logprobs", k))
        })
        .transpose()?;
    let stop = stop_strings(f.stop)?;
    // Domain checks of the engine (temperature >= 0, top_p in (0, 1], ...), with a placeholder
    // max_tokens that min_tokens cannot exceed.
    let mut probe = params.clone();
    probe.max_tokens = max_tokens.unwrap_or(usize::MAX).max(probe.min_tokens).max(1);
    probe.validate().map_err(|e| ApiError::bad_param(e.param, e.to_string()))?;
    let kv_transfer = f.kv_transfer_params.as_ref().map(crate::kv_transfer::parse_params);
    Ok(GenerationSpec {
        params,
        max_tokens,
        n,
        stop,
        priority: f.priority.unwrap_or(0),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        stream: f.stream.unwrap_or(false),
        usage: usage_report(f.stream_options)?,
        structured_param,
        adapter: kiln_engine::AdapterBinding::default(),
        adapter_lease: None,
        kv_transfer: kv_transfer.transpose()?.flatten(),
    })
}

/// Where a stream reports usage (`stream_options`).
fn usage_report(options: Option<crate::protocol::StreamOptions>) -> Result<UsageReport, ApiError> {
    let options = options.unwrap_or_default();
    let include_usage = options.include_usage.unwrap_or(false);
    let continuous_usage = options.continuous_usage_stats.unwrap_or(false);
    if continuous_usage && !include_usage {
        // vLLM reads it only with `include_usage`; alone it would ask for nothing.
        return Err(ApiError::bad_param(
            "stream_options",
            "`stream_options.continuous_usage_stats` needs `include_usage: true`",
        ));
    }
    Ok(UsageReport { last_chunk: include_usage, every_chunk: continuous_usage })
}

/// The stop strings, checked: at most [`MAX_STOP_STRINGS`], none empty or longer than
/// [`MAX_STOP_STRING_BYTES`].
fn stop_strings(stop: Option<crate::protocol::StopField>) -> Result<Vec<String>, ApiError> {
    let stop = stop.map(crate::protocol::StopField::into_vec).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(ApiError::bad_param(
            "stop",
            format!("at most {MAX_STOP_STRINGS} stop strings"),
        ));
    }
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad_param("stop", "a stop string must not be empty"));
    }
    if stop.iter().any(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(ApiError::bad_param(
            "stop",
            format!("a stop string may be at most {MAX_STOP_STRING_BYTES} bytes"),
        ));
    }
    Ok(stop)
}

/// `stop_token_ids` and `logit_bias` (keys are token ids as strings; the vocabulary is
/// checked when the request is prepared).
fn token_fields(
    params: &mut SamplingParams,
    stop_token_ids: Option<Vec<i64>>,
    logit_bias: Option<std::collections::HashMap<String, f64>>,
    limits: &Limits,
) -> Result<(), ApiError> {
    if let Some(ids) = stop_token_ids {
        params.stop_token_ids = ids
            .into_iter()
            .map(|t| token_id("stop_token_ids", t, limits))
            .collect::<Result<_, _>>()?;
    }
    if let Some(bias) = logit_bias {
        for (key, value) in bias {
            // Only plain decimal digits: `" +7 "` is not read as 7.
            let id = Some(&key)
                .filter(|k| !k.is_empty() && k.len() <= 10 && k.bytes().all(|b| b.is_ascii_digit()))
                .and_then(|k| k.parse::<i64>().ok())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "logit_bias",
                        format!("`logit_bias` key {key:?} is not a token id (decimal digits only)"),
                    )
                })?;
            params
                .logit_bias
                .push((token_id("logit_bias", id, limits)?, to_f32("logit_bias", value)?));
        }
        params.logit_bias.sort_by_key(|b| b.0);
    }
    Ok(())
}

impl GenerationSpec {
    /// The params of sample `index` of a prompt of `num_prompt_tokens`: `max_tokens` resolved
    /// against the context (vLLM's message when it does not fit), and the seed of sample `i`
    /// offset by `i` (as vLLM does for `n > 1`).
    pub fn for_prompt(
        &self,
        num_prompt_tokens: usize,
        index: usize,
        limits: &Limits,
    ) -> Result<SamplingParams, ApiError> {
        let max_len = limits.max_model_len;
        if num_prompt_tokens == 0 {
            return Err(ApiError::bad_param("prompt", "The prompt cannot be empty."));
        }
        if num_prompt_tokens >= max_len {
            return Err(ApiError::bad_param(
                "input_tokens",
                format!(
                    "This model's maximum context length is {max_len} tokens. However, your \
                     prompt contains {num_prompt_tokens} input tokens, which leaves no room for \
                     output tokens. Please reduce the length of the input prompt. \
                     (parameter=input_tokens, value={num_prompt_tokens})"
                ),
            ));
        }
        let rest = max_len - num_prompt_tokens;
        let default = limits.max_tokens_default.into_iter().chain(limits.max_tokens_cap).min();
        let max_tokens = self.max_tokens.unwrap_or_else(|| default.map_or(rest, |d| d.min(rest)));
        if num_prompt_tokens.saturating_add(max_tokens) > max_len {
            return Err(ApiError::bad_param(
                "input_tokens",
                format!(
                    "This model's maximum context length is {max_len} tokens. However, you \
                     requested {max_tokens} output tokens and your prompt contains at least \
                     {num_prompt_tokens} input tokens, for a total of at least {} tokens. Please \
                     reduce the length of the input prompt or the number of requested output \
                     tokens. (parameter=input_tokens, value={num_prompt_tokens})",
                    num_prompt_tokens.saturating_add(max_tokens)
                ),
            ));
        }
        let mut params = self.params.clone();
        params.max_tokens = max_tokens;
        if params.min_tokens > max_tokens {
            return Err(ApiError::bad_param(
                "min_tokens",
                format!("`min_tokens` ({}) exceeds max_tokens ({max_tokens})", params.min_tokens),
            ));
        }
        params.seed = params.seed.map(|s| s.wrapping_add(index as u64));
        Ok(params)
    }
}
