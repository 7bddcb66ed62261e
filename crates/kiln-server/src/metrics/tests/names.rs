//! `--metrics-prefix vllm`: vLLM's metric names, and kiln's own series under the same prefix.

use super::MODEL;
use crate::metrics::{CacheConfigInfo, Metrics, ModelConfigInfo};

/// vLLM's Prometheus metrics (`vllm/v1/metrics/loggers.py`, PrometheusStatLogger) for one
/// engine with speculative decoding (whose counters kiln always exposes, at 0 while it is off),
/// without LoRA, KV transfer or multimodal caches, leaving out the
/// names vLLM deprecated and hides (`gpu_cache_usage_perc`, `gpu_prefix_cache_*`,
/// `time_per_output_token_seconds`). Counters as exposed, with `_total`.
const VLLM_NAMES: [&str; 29] = [
    "vllm:lora_requests_info",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:iteration_tokens_total",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n",
    "vllm:request_params_max_tokens",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:cache_config_info",
];

/// Series vLLM does not have (modules `slo`, `swap`, `structured` and `busy`), exposed under
/// the configured prefix too.
const KILN_ONLY_NAMES: [&str; 25] = [
    "vllm:model_config_info",
    "vllm:structured_output_tokens_total",
    "vllm:structured_output_masks_total",
    "vllm:structured_output_mask_seconds_total",
    "vllm:engine_busy_seconds_total",
    "vllm:engine_forward_seconds_total",
    "vllm:kv_tier_spilled_blocks_total",
    "vllm:kv_tier_prefix_hits_total",
    "vllm:kv_swapped_out_blocks_total",
    "vllm:kv_swapped_in_blocks_total",
    "vllm:num_preemptions_by_mode_total",
    "vllm:kv_tier_usage_perc",
    "vllm:scheduler_token_budget",
    "vllm:scheduler_max_running",
    "vllm:scheduler_controller_gain",
    "vllm:scheduler_controller_bank_seconds",
    "vllm:scheduler_controller_ttft_calibration",
    "vllm:slo_target_misses_total",
    "vllm:slo_admission_total",
    "vllm:kv_transfer_blocks_total",
    "vllm:kv_transfer_bytes_total",
    "vllm:kv_transfer_failures_total",
    "vllm:kv_transfer_seconds",
    "vllm:kv_pinned_blocks",
    "vllm:kv_pins_expired_total",
];

#[test]
fn vllm_prefix_gives_vllms_metric_names() {
    let m = Metrics::with_prefix("vllm", MODEL, 1024);
    m.set_cache_config(&CacheConfigInfo {
        block_size: 16,
        cache_dtype: "f16".into(),
        enable_prefix_caching: true,
        num_blocks: 100,
    });
    m.set_model_config(&ModelConfigInfo {
        architecture: "Qwen3Moe".into(),
        weight_bytes: 4000,
        active_weight_bytes: 700,
        num_experts: 128,
        num_experts_per_tok: 8,
        num_sparse_layers: 12,
    });
    let (content_type, text) = m.render_for(Some("*/*"), "");
    assert!(content_type.starts_with("text/plain; version=0.0.4"));
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .filter(|n| n.starts_with("vllm:"))
        .map(str::to_owned)
        .collect();
    names.sort();
    // vLLM's names, plus kiln's own batch-control, SLO and KV-tier series under the same prefix.
    let mut expected: Vec<String> =
        VLLM_NAMES.iter().chain(&KILN_ONLY_NAMES).map(|s| (*s).to_owned()).collect();
    expected.sort();
    assert_eq!(names, expected);
    assert!(!text.contains("kiln:"));
    assert!(text.contains(r#"vllm:cache_config_info{model_name="test-model",block_size="16",cache_dtype="f16",enable_prefix_caching="True",num_gpu_blocks="100"} 1"#), "{text}");
    assert!(text.contains(r#"vllm:model_config_info{model_name="test-model",architecture="Qwen3Moe",weight_bytes="4000",active_weight_bytes="700",num_experts="128",num_experts_per_tok="8",num_sparse_layers="12"} 1"#), "{text}");
    let (content_type, text) = m.render_for(Some("application/openmetrics-text;version=1.0.0"), "");
    assert!(content_type.starts_with("application/openmetrics-text") && text.ends_with("# EOF\n"));
}
