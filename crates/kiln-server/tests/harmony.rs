//! gpt-oss's harmony output on a live server (`--reasoning-parser openai_gptoss`,
//! `--tool-call-parser openai`). The tiny gpt-oss fixture gets harmony's special tokens in
//! place of its reserved ones and a harmony chat template; its random weights are steered:
//! - a structured output is wrapped so that the answer is the `final` channel's message, and a
//!   `logit_bias` towards `<|end|>` and `f` makes the fixture take that channel at once: the
//!   content is the JSON without a header, streamed and not;
//! - `tool_choice: required` works the same way through the `final` channel;
//! - with only the tool parser, a grammar forces a raw harmony call (`<|channel|>commentary
//!   to=functions.get_weather <|constrain|>json<|message|>{…}`), which becomes `tool_calls`;
//! - `reasoning_effort` (chat) and `reasoning.effort` (Responses) reach the template, and are
//!   refused where the template does not read them.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{TestServer, default_config, engine_config, fixture};
use kiln_server::ServerConfig;
use kiln_server::reasoning::ReasoningParser;
use kiln_server::tools::{ToolCallParser, ToolSettings};
use serde_json::{Value, json};

/// Harmony's special tokens, given the fixture's reserved ids 505..=511.
const SPECIALS: [&str; 7] = [
    "<|channel|>",
    "<|message|>",
    "<|end|>",
    "<|start|>",
    "<|return|>",
    "<|call|>",
    "<|constrain|>",
];
const END_ID: u32 = 507;
/// The fixture vocabulary's `f`.
const F_ID: u32 = 69;

const TEMPLATE: &str = "{% if reasoning_effort is defined %}<|start|>system<|message|>\
Reasoning: {{ reasoning_effort }}<|end|>{% endif %}{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}\
<|end|>{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}";

/// The gpt-oss fixture with harmony's special tokens and template, in a fresh directory
/// named after `test`.
fn harmony_fixture(test: &str) -> PathBuf {
    let src = fixture("gptoss");
    let dir = std::env::temp_dir().join(format!("kiln-harmony-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for file in ["config.json", "model.safetensors"] {
        std::fs::copy(src.join(file), dir.join(file)).unwrap();
    }
    let read = |file: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(src.join(file)).unwrap()).unwrap()
    };
    let write = |file: &str, v: &Value| std::fs::write(dir.join(file), v.to_string()).unwrap();
    let mut tokenizer = read("tokenizer.json");
    for added in tokenizer["added_tokens"].as_array_mut().unwrap() {
        let id = added["id"].as_u64().unwrap();
        if let Some(name) = id.checked_sub(505).and_then(|i| SPECIALS.get(i as usize)) {
            added["content"] = json!(name);
        }
    }
    write("tokenizer.json", &tokenizer);
    let mut config = read("tokenizer_config.json");
    config["chat_template"] = json!(TEMPLATE);
    config["eos_token"] = json!("<|return|>");
    write("tokenizer_config.json", &config);
    let mut generation = read("generation_config.json");
    generation["eos_token_id"] = json!([509, 510]);
    write("generation_config.json", &generation);
    dir
}

fn server(dir: &Path, reasoning: bool) -> TestServer {
    let config = ServerConfig {
        reasoning_parser: reasoning.then_some(ReasoningParser::GptOss),
        tools: ToolSettings { parser: Some(ToolCallParser::OpenAi), auto_tool_choice: true },
        ..default_config()
    };
    TestServer::start_dir(dir, config, engine_config())
}

fn chat(extra: &Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "max_tokens": 60, "temperature": 0,
        "logit_bias": {END_ID.to_string(): 100, F_ID.to_string(): 50},
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo"]}},
                       "required": ["city"], "additionalProperties": false}}}])
}

/// The streamed `(reasoning_content, content, tool-call names and arguments)`.
fn streamed(server: &TestServer, body: &Value) -> (String, String, String) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (mut reasoning, mut content, mut calls) = (String::new(), String::new(), String::new());
    for event in r.sse_data().iter().filter(|e| *e != "[DONE]") {
        let v: Value = serde_json::from_str(event).unwrap();
        let Some(delta) = v["choices"].get(0).map(|c| &c["delta"]) else { continue };
        reasoning += delta["reasoning_content"].as_str().unwrap_or_default();
        content += delta["content"].as_str().unwrap_or_default();
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            calls += call["function"]["name"].as_str().unwrap_or_default();
            calls += call["function"]["arguments"].as_str().unwrap_or_default();
        }
    }
    (reasoning, content, calls)
}

#[test]
fn structured_answers_and_required_calls_come_from_the_final_channel() {
    let dir = harmony_fixture("final");
    let server = server(&dir, true);
    let schema = json!({"type": "object", "properties": {"p": {"type": "integer"}},
                        "required": ["p"], "additionalProperties": false});
    let body = chat(&json!({"response_format": {"type": "json_schema",
        "json_schema": {"name": "n", "schema": schema}}}));
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let message = r.json()["choices"][0]["message"].clone();
    let content = message["content"].as_str().unwrap().to_owned();
    let value: Value = serde_json::from_str(&content).unwrap_or_else(|e| panic!("{content}: {e}"));
    assert!(value["p"].is_i64(), "{message}");
    assert!(message.get("reasoning_content").is_none_or(Value::is_null), "{message}");
    assert_eq!(streamed(&server, &body), (String::new(), content, String::new()));

    let body =
        chat(&json!({"tools": tools(), "tool_choice": "required", "parallel_tool_calls": false}));
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let choice = r.json()["choices"][0].clone();
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(
        (call["name"].as_str(), call["arguments"].as_str()),
        (Some("get_weather"), Some(r#"{"city":"Oslo"}"#))
    );
    let (_, _, calls) = streamed(&server, &body);
    assert_eq!(calls, r#"get_weather{"city":"Oslo"}"#);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_raw_harmony_call_becomes_tool_calls_with_the_tool_parser_alone() {
    let dir = harmony_fixture("call");
    let server = server(&dir, false);
    let grammar = r#"start: <|channel|> "analysis" <|message|> "hm" <|end|> <|start|> "assistant" <|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\"city\": \"Oslo\"}""#;
    let body = chat(&json!({"tools": tools(), "guided_grammar": grammar, "max_tokens": 200}));
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let choice = r.json()["choices"][0].clone();
    assert_eq!(choice["finish_reason"], "tool_calls", "{choice}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{choice}");
    assert_eq!(call["arguments"], r#"{"city":"Oslo"}"#, "{choice}");
    // Without the reasoning parser the thinking stays in the content, as its raw text.
    let content = "<|channel|>analysis<|message|>hm<|end|>";
    assert_eq!(choice["message"]["content"], content, "{choice}");
    let (_, streamed_content, calls) = streamed(&server, &body);
    assert_eq!(
        (streamed_content.as_str(), calls.as_str()),
        (content, r#"get_weather{"city":"Oslo"}"#)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn reasoning_effort_reaches_a_template_that_reads_it() {
    let dir = harmony_fixture("effort");
    let server = server(&dir, true);
    let prompt_tokens = |mut extra: Value| {
        extra["max_tokens"] = json!(1);
        let r = server.post("/v1/chat/completions", &chat(&extra));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["usage"]["prompt_tokens"].as_u64().unwrap()
    };
    let plain = prompt_tokens(json!({}));
    let high = prompt_tokens(json!({"reasoning_effort": "high"}));
    let low = prompt_tokens(json!({"chat_template_kwargs": {"reasoning_effort": "low"}}));
    assert!(high > plain && low > plain, "{plain} {high} {low}");
    let body = json!({"input": "Hi", "max_output_tokens": 1, "reasoning": {"effort": "high"}});
    let r = server.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["reasoning"]["effort"], "high");
    for (extra, said) in [
        (json!({"reasoning_effort": "extreme"}), "must be one of"),
        (
            json!({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "low"}}),
            "set twice",
        ),
    ] {
        let r = server.post("/v1/chat/completions", &chat(&extra));
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(r.json()["error"]["param"], "reasoning_effort");
        assert!(r.text().contains(said), "{}", r.text());
    }
    std::fs::remove_dir_all(&dir).unwrap();
    // The plain fixture's template has no effort: the field would change nothing.
    let plain = TestServer::start(default_config());
    let r = plain.post("/v1/chat/completions", &chat(&json!({"reasoning_effort": "high"})));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("does not read `reasoning_effort`"), "{}", r.text());
}
