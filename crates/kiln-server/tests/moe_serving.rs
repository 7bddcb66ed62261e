//! The server on a mixture-of-experts model (the tiny Qwen3-MoE fixture, its chat template from
//! the checkpoint) with what Qwen3-MoE deployments turn on: the `hermes` tool parser with
//! `auto` tool choice, structured outputs, and n-gram speculation, whose answers equal the
//! plain engine's token for token.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config, engine_config};
use kiln_engine::{EngineConfig, SpeculativeConfig};
use kiln_server::ServerConfig;
use kiln_server::tools::{ToolCallParser, ToolSettings};
use serde_json::{Value, json};

fn server(speculative: Option<SpeculativeConfig>) -> TestServer {
    let config = ServerConfig {
        tools: ToolSettings { parser: Some(ToolCallParser::Hermes), auto_tool_choice: true },
        ..default_config()
    };
    let engine = EngineConfig { speculative, ..engine_config() };
    TestServer::start_model("qwen3moe", config, engine, None)
}

fn ok(server: &TestServer, body: &Value) -> Value {
    let r = server.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

fn chat(extra: &Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What time is it in Paris?"}],
        "max_tokens": 80, "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_time",
            "parameters": {"type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"], "additionalProperties": false}}}],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn hermes_tools_structured_outputs_and_ngram_speculation_on_experts() {
    let mut ngram = SpeculativeConfig::ngram(3, 1, 3);
    ngram.disable_by_batch_size = 64;
    let plain = server(None);
    let speculative = server(Some(ngram));
    let call = "Checking.<tool_call>{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}</tool_call>";
    let schema = json!({"type": "json_schema", "json_schema": {"name": "n", "strict": true,
        "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                   "required": ["n"], "additionalProperties": false}}});
    for s in [&plain, &speculative] {
        // `auto`: the model's text (steered by `guided_choice`) parsed by the hermes parser.
        let r = ok(s, &chat(&json!({"guided_choice": [call]})));
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        assert_eq!(c["message"]["content"], "Checking.", "{r}");
        let f = &c["message"]["tool_calls"][0]["function"];
        assert_eq!(
            (f["name"].as_str(), f["arguments"].as_str()),
            (Some("get_time"), Some("{\"zone\":\"CET\"}"))
        );
        // `required`: a valid call whatever the weights say.
        let r = ok(s, &chat(&json!({"tool_choice": "required"})));
        let args = &r["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"];
        let args: Value = serde_json::from_str(args.as_str().unwrap()).unwrap();
        assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap()), "{r}");
        // Structured output: JSON of the schema.
        let mut body = chat(&json!({"response_format": schema}));
        body.as_object_mut().unwrap().remove("tools");
        let r = ok(s, &body);
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
        assert!(v["n"].is_i64() && v.as_object().unwrap().len() == 1, "{text}");
    }
    // Speculation changes no token: a free-running greedy answer is the same on both.
    let body = json!({"messages": [{"role": "user", "content": "one two three one two three one"}],
        "max_tokens": 40, "temperature": 0});
    let a = ok(&plain, &body);
    let b = ok(&speculative, &body);
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
    assert_eq!(a["usage"], b["usage"]);
}
