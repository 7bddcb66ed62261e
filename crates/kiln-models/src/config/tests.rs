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
    ];
    for (key, value, needle) in cases {
        let mut cfg = base();
        cfg[key] = value;
        let msg = ModelConfig::from_json(&cfg, p).unwrap_err().to_string();
        assert!(msg.contains(needle) && msg.contains("dir/config.json"), "{key}: {msg}");
    }
}
