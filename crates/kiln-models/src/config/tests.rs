use super::*;
use serde_json::json;

fn base() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 100, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0
    })
}

#[test]
fn parses_classic_and_v5_rope_spellings() {
    let p = Path::new("config.json");
    let mut classic = base();
    classic["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64});
    let a = ModelConfig::from_json(&classic, p).unwrap();
    let mut v5 = base();
    v5.as_object_mut().unwrap().remove("rope_theta");
    v5["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500_000.0,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64});
    let b = ModelConfig::from_json(&v5, p).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.head_dim, 16);
    assert!(matches!(a.rope_scaling, RopeScaling::Llama3 { .. }));
}

#[test]
fn rejects_bad_configs_with_a_message_naming_the_field() {
    let p = Path::new("dir/config.json");
    let cases = [
        ("architectures", json!(["GPTNeoXForCausalLM"]), "unsupported architecture"),
        ("hidden_size", json!(0), "hidden_size"),
        ("num_key_value_heads", json!(3), "multiple of num_key_value_heads"),
        ("num_hidden_layers", json!(-1), "num_hidden_layers"),
        ("rope_scaling", json!({"rope_type": "yarn", "factor": 4.0}), "yarn"),
        ("vocab_size", json!("many"), "vocab_size"),
        ("quantization_config", json!({"quant_method": "fp8"}), "quant_method `fp8`"),
        ("quantization_config", json!({"quant_method": "gptq", "bits": 3}), "3 bits"),
        (
            "quantization_config",
            json!({"quant_method": "awq", "bits": 4, "version": "gemv"}),
            "version `gemv`",
        ),
    ];
    for (key, value, needle) in cases {
        let mut cfg = base();
        cfg[key] = value;
        let msg = ModelConfig::from_json(&cfg, p).unwrap_err().to_string();
        assert!(msg.contains(needle) && msg.contains("dir/config.json"), "{key}: {msg}");
    }
}

#[test]
fn phi3_refuses_what_it_cannot_run_by_name() {
    let p = Path::new("dir/config.json");
    let mut cfg = base();
    cfg["architectures"] = json!(["Phi3ForCausalLM"]);
    cfg["sliding_window"] = json!(2047);
    let c = ModelConfig::from_json(&cfg, p).unwrap();
    assert_eq!(
        (c.architecture, c.layer_windows.clone()),
        (Architecture::Phi3, vec![Some(2047); 2])
    );
    assert_eq!(c.rotary_dim, c.head_dim);
    let mut partial = cfg.clone();
    partial["partial_rotary_factor"] = json!(0.75);
    let c = ModelConfig::from_json(&partial, p).unwrap();
    assert_eq!((c.head_dim, c.rotary_dim), (16, 12), "Phi-4-mini's factor");
    let long = json!({"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]});
    for (key, value, needle) in [
        ("rope_scaling", long, "longrope"),
        ("partial_rotary_factor", json!(0.1), "partial_rotary_factor 0.1: RoPE on 1 of"),
        ("partial_rotary_factor", json!(1.5), "partial_rotary_factor 1.5: RoPE on 24 of"),
    ] {
        let mut bad = cfg.clone();
        bad[key] = value;
        let msg = ModelConfig::from_json(&bad, p).unwrap_err().to_string();
        assert!(msg.contains(needle), "{key}: {msg}");
    }
}

#[test]
fn a_conditional_gemma3_reads_its_text_config_at_transformers_defaults() {
    let p = Path::new("dir/config.json");
    let cfg = json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
                        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024, "model_type": "gemma3_text"},
        "vision_config": {"hidden_size": 1152},
    });
    let c = ModelConfig::from_json(&cfg, p).unwrap();
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!((c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim), (262_208, 8, 4, 256));
    assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!((c.rope_theta, c.rope_local_theta), (1_000_000.0, Some(10_000.0)));
    assert_eq!(c.layer_windows.iter().filter(|w| w.is_none()).count(), 5, "every 6th is global");
    assert!(c.tie_word_embeddings);
    assert!((c.attention_scale - 1.0 / 16.0).abs() < 1e-7, "query_pre_attn_scalar 256");
}

#[test]
fn longrope_picks_its_factors_once_by_the_models_context() {
    let p = Path::new("dir/config.json");
    let mut cfg = base();
    cfg["architectures"] = json!(["Phi3ForCausalLM"]);
    cfg["max_position_embeddings"] = json!(4096);
    let (short, long) = (json!([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]), json!(vec![2.0; 8]));
    cfg["rope_scaling"] = json!({"type": "longrope", "short_factor": short, "long_factor": long});
    cfg["original_max_position_embeddings"] = json!(4096);
    let c = ModelConfig::from_json(&cfg, p).unwrap();
    assert_eq!(c.rope_freq_factors.as_deref(), Some(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0][..]));
    assert_eq!(c.attention_scale, 1.0 / 4.0, "no attention factor within the original context");
    cfg["original_max_position_embeddings"] = json!(1024);
    let c = ModelConfig::from_json(&cfg, p).unwrap();
    assert_eq!(c.rope_freq_factors.as_deref(), Some(&[2.0; 8][..]));
    let m2 = 1.0 + 4f64.ln() / 1024f64.ln();
    assert!((f64::from(c.attention_scale) - m2 / 4.0).abs() < 1e-6, "{}", c.attention_scale);
    cfg["architectures"] = json!(["LlamaForCausalLM"]);
    let msg = ModelConfig::from_json(&cfg, p).unwrap_err().to_string();
    assert!(msg.contains("longrope") && msg.contains("LlamaForCausalLM"), "{msg}");
}

/// A DeepSeek-V3-shaped config (hub spelling).
fn deepseek_v3() -> Value {
    json!({
        "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 100, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "n_shared_experts": 1,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 4, "topk_group": 2, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
    })
}

#[test]
fn deepseek_reads_latent_attention_and_group_routing() {
    let c = ModelConfig::from_json(&deepseek_v3(), Path::new("config.json")).unwrap();
    let mla = c.mla.unwrap();
    assert_eq!((c.num_kv_heads, c.head_dim, c.rotary_dim), (1, 40, 8));
    assert_eq!((mla.q_lora_rank, mla.qk_head_dim()), (Some(24), 24));
    assert_eq!(c.rope_style, RopeStyle::Interleaved);
    // YaRN's m = 0.1 · ln(40) + 1 squared on 24^-0.5; the cos/sin factor m(1)/m(1) = 1.
    let m = 0.1 * 40f32.ln() + 1.0;
    assert!((c.attention_scale - m * m / 24f32.sqrt()).abs() < 1e-6);
    assert!((c.rope_mscale - 1.0).abs() < 1e-6);
    let moe = c.moe.unwrap();
    assert_eq!(moe.routing, Routing::SigmoidBiased { groups: 4, topk_groups: 2 });
    assert_eq!(moe.sparse_layers, [false, true, true, true]);
    assert_eq!((moe.shared_expert_intermediate_size, moe.shared_expert_gate), (Some(32), false));
    assert!(moe.norm_topk_prob && (moe.routed_scaling_factor - 2.5).abs() < 1e-6);
}

#[test]
fn deepseek_refuses_what_it_cannot_run_by_name() {
    let p = Path::new("dir/config.json");
    let cases = [
        ("n_group", json!(3), "groups must divide"),
        ("topk_group", json!(0), "groups must divide"),
        ("num_experts_per_tok", json!(5), "exceeds the 4 experts of the kept groups"),
        ("topk_method", json!("greedy"), "routing `greedy`"),
        ("attention_bias", json!(true), "attention_bias"),
        ("qk_rope_head_dim", json!(7), "must be even"),
        ("kv_lora_rank", json!(0), "kv_lora_rank"),
    ];
    for (key, value, needle) in cases {
        let mut cfg = deepseek_v3();
        cfg[key] = value;
        let msg = ModelConfig::from_json(&cfg, p).unwrap_err().to_string();
        assert!(msg.contains(needle) && msg.contains("dir/config.json"), "{key}: {msg}");
    }
}
