//! LoRA adapters served by name (`--lora-modules`) on the llama3 fixture with two PEFT
//! adapters (`tests/fixtures/lora`): a request whose `model` names an adapter generates PEFT's
//! greedy tokens and is answered under that name; `/v1/models` lists the adapters with their
//! parent; an unknown name is a 404 naming `model`; a broken adapter stops the start with a
//! message naming it.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;

use common::{TestServer, default_config, engine_config};
use kiln_server::{LoraModule, LoraSettings, ServerConfig};
use serde_json::{Value, json};

fn lora_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora").join(name)
}

fn config() -> ServerConfig {
    ServerConfig {
        lora: LoraSettings {
            modules: vec![
                LoraModule {
                    name: "sql".into(),
                    path: lora_dir("llama3-r8-all"),
                    base_model_name: None,
                },
                LoraModule {
                    name: "chat".into(),
                    path: lora_dir("llama3-r4-attn"),
                    base_model_name: Some("meta/llama".into()),
                },
            ],
            max_rank: 16,
        },
        ..default_config()
    }
}

/// `(prompt ids, PEFT's greedy ids)` of the first case of adapter fixture `name`.
fn reference(name: &str) -> (Vec<u64>, Vec<u64>) {
    let text = std::fs::read_to_string(lora_dir(name).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| {
        v["cases"][0][key].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    };
    (ids("prompt_ids"), ids("greedy_ids"))
}

/// The text of `ids` as the server decodes it.
fn detokenize(server: &TestServer, ids: &[u64]) -> String {
    let r = server.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["prompt"].as_str().unwrap().to_owned()
}

#[test]
fn a_request_naming_an_adapter_generates_peft_s_tokens() {
    let server = TestServer::start_with(config(), engine_config());
    for (model, fixture) in [("sql", "llama3-r8-all"), ("chat", "llama3-r4-attn")] {
        let (prompt, greedy) = reference(fixture);
        let body = json!({"model": model, "prompt": prompt, "max_tokens": greedy.len(),
                          "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["model"], model);
        assert_eq!(v["choices"][0]["text"], detokenize(&server, &greedy), "{model}");
        // The base model, on the same prompt, says something else.
        let base = server.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompt,
            "max_tokens": greedy.len(), "temperature": 0, "ignore_eos": true,
            "skip_special_tokens": false}),
        );
        assert_eq!(base.json()["model"], "tiny");
        assert_ne!(base.json()["choices"][0]["text"], v["choices"][0]["text"], "{model}");
    }
    // Chat too, answered under the adapter's name.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": "chat", "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "chat");
}

#[test]
fn models_lists_adapters_and_unknown_names_are_404() {
    let server = TestServer::start_with(config(), engine_config());
    let v = server.get("/v1/models").json();
    let cards = v["data"].as_array().unwrap();
    let ids: Vec<&str> = cards.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "tiny-alias", "sql", "chat"]);
    assert_eq!(cards[0]["parent"], Value::Null);
    assert_eq!(cards[2]["parent"], "tiny");
    assert_eq!(cards[2]["root"], lora_dir("llama3-r8-all").display().to_string());
    assert_eq!(cards[3]["parent"], "meta/llama");
    assert_eq!(server.get("/v1/models/sql").json()["id"], "sql");
    let r =
        server.post("/v1/completions", &json!({"model": "nope", "prompt": "hi", "max_tokens": 1}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["param"], "model");
}

#[test]
#[should_panic(expected = "--lora-modules bad")]
fn a_broken_adapter_stops_the_start_naming_it() {
    let mut config = config();
    config.lora.modules.push(LoraModule {
        name: "bad".into(),
        path: lora_dir("llama3-r8-all").join("missing"),
        base_model_name: None,
    });
    TestServer::start_with(config, engine_config());
}
