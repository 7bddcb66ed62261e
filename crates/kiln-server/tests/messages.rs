//! Anthropic's Messages API on a live server: the same output as chat (thinking blocks with
//! `--reasoning-parser`, tool_use blocks for a forced tool), whole and streamed alike, the
//! event sequence in Anthropic's order, `stop_sequences` reported, `count_tokens` equal to
//! the prompt the message was computed from, `x-api-key`, and errors in Anthropic's shape.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config, request, thinking_server};
use kiln_server::ServerConfig;
use serde_json::{Value, json};

fn body(extra: &Value) -> Value {
    let mut body = json!({
        "model": "tiny", "max_tokens": 10, "temperature": 0,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Is 7 prime?"}]}],
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn message(server: &TestServer, body: &Value) -> Value {
    let r = server.post("/v1/messages", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

/// The `(event, data)` pairs of a streamed message, checked against Anthropic's order.
fn events(server: &TestServer, body: &Value) -> Vec<(String, Value)> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post("/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let events: Vec<(String, Value)> = r
        .text()
        .split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data = e.lines().find_map(|l| l.strip_prefix("data: "))?;
            Some((name.to_owned(), serde_json::from_str(data).unwrap()))
        })
        .collect();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(&names[names.len() - 2..], ["message_delta", "message_stop"], "{names:?}");
    let mut open = None;
    let mut next_index = 0;
    for (name, data) in &events {
        assert_eq!(data["type"], json!(name));
        match name.as_str() {
            "content_block_start" => {
                assert_eq!((open, data["index"].as_u64()), (None, Some(next_index)), "{names:?}");
                open = Some(next_index);
            }
            "content_block_delta" => assert_eq!(data["index"].as_u64(), open, "{names:?}"),
            "content_block_stop" => {
                assert_eq!(data["index"].as_u64(), open, "{names:?}");
                open = None;
                next_index += 1;
            }
            _ => assert_eq!(open, None, "{name} inside a block: {names:?}"),
        }
    }
    events
}

/// The blocks a stream built, as the whole message would hold them.
fn blocks_of(events: &[(String, Value)]) -> Vec<Value> {
    let mut blocks: Vec<Value> = Vec::new();
    let mut partial_json = String::new();
    for (name, data) in events {
        match name.as_str() {
            "content_block_start" => blocks.push(data["content_block"].clone()),
            "content_block_delta" => {
                let block = blocks.last_mut().unwrap();
                let d = &data["delta"];
                match d["type"].as_str().unwrap() {
                    "thinking_delta" => {
                        let t = block["thinking"].as_str().unwrap().to_owned();
                        block["thinking"] = json!(t + d["thinking"].as_str().unwrap());
                    }
                    "text_delta" => {
                        let t = block["text"].as_str().unwrap().to_owned();
                        block["text"] = json!(t + d["text"].as_str().unwrap());
                    }
                    "input_json_delta" => {
                        partial_json.push_str(d["partial_json"].as_str().unwrap());
                    }
                    other => panic!("unknown delta {other}"),
                }
            }
            "content_block_stop" if !partial_json.is_empty() => {
                let block = blocks.last_mut().unwrap();
                block["input"] = serde_json::from_str(&std::mem::take(&mut partial_json)).unwrap();
            }
            _ => {}
        }
    }
    blocks
}

/// Ids differ between two runs; everything else must not.
fn without_ids(mut blocks: Vec<Value>) -> Vec<Value> {
    for b in &mut blocks {
        b.as_object_mut().unwrap().remove("id");
    }
    blocks
}

#[test]
fn thinking_comes_back_as_a_thinking_block_whole_and_streamed() {
    let server = thinking_server();
    let body = body(&json!({}));
    let whole = message(&server, &body);
    assert_eq!(
        (whole["type"].as_str(), whole["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert!(whole["id"].as_str().unwrap().starts_with("msg_"), "{whole}");
    let content = whole["content"].as_array().unwrap().clone();
    assert_eq!(content[0]["type"], "thinking", "{whole}");
    assert!(!content[0]["thinking"].as_str().unwrap().is_empty());
    assert_eq!(whole["stop_reason"], "max_tokens");
    assert_eq!(whole["usage"]["output_tokens"], 10);
    // The chat endpoint reads the same output the same way.
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Is 7 prime?"}],
                "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(chat.json()["choices"][0]["message"]["reasoning_content"], content[0]["thinking"]);

    let events = events(&server, &body);
    assert_eq!(blocks_of(&events), content);
    let (_, last_delta) = &events[events.len() - 2];
    assert_eq!(last_delta["delta"]["stop_reason"], "max_tokens");
    assert_eq!(last_delta["usage"]["output_tokens"], 10);

    // count_tokens counts the prompt the message was computed from.
    let mut count = body.clone();
    for key in ["max_tokens", "temperature"] {
        count.as_object_mut().unwrap().remove(key);
    }
    let counted = server.post("/v1/messages/count_tokens", &count);
    assert_eq!(counted.status, 200, "{}", counted.text());
    let usage = &whole["usage"];
    let prompt = usage["input_tokens"].as_u64().unwrap()
        + usage["cache_read_input_tokens"].as_u64().unwrap();
    assert_eq!(counted.json()["input_tokens"].as_u64(), Some(prompt));
}

#[test]
fn a_forced_tool_is_a_tool_use_block_and_stop_sequences_are_reported() {
    let server = TestServer::start(default_config());
    let tool = json!({"name": "weather", "description": "d", "input_schema": {
        "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}});
    let forced = body(&json!({"max_tokens": 30, "tools": [tool],
                              "tool_choice": {"type": "tool", "name": "weather"}}));
    let whole = message(&server, &forced);
    let content = whole["content"].as_array().unwrap().clone();
    assert_eq!(content.len(), 1, "{whole}");
    assert_eq!(content[0]["type"], "tool_use", "{whole}");
    assert_eq!(
        (content[0]["name"].clone(), content[0]["input"].clone()),
        (json!("weather"), json!({"city": "Oslo"}))
    );
    assert!(content[0]["id"].as_str().unwrap().starts_with("toolu_"));
    let streamed = blocks_of(&events(&server, &forced));
    assert_eq!(without_ids(streamed), without_ids(content));

    // A stop string out of the greedy text ends it there, and is named.
    let plain = message(&server, &body(&json!({"max_tokens": 12})));
    let text = plain["content"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = text.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let stopped = message(&server, &body(&json!({"max_tokens": 12, "stop_sequences": [stop]})));
    assert_eq!(
        (stopped["stop_reason"].as_str(), stopped["stop_sequence"].as_str()),
        (Some("stop_sequence"), Some(stop.as_str()))
    );
    let cut = stopped["content"].get(0).map_or("", |b| b["text"].as_str().unwrap());
    assert!(text.starts_with(cut) && cut.len() < text.len(), "{cut:?} of {text:?}");
    let events = events(&server, &body(&json!({"max_tokens": 12, "stop_sequences": [stop]})));
    let (_, last_delta) = &events[events.len() - 2];
    assert_eq!(last_delta["delta"]["stop_sequence"].as_str(), Some(stop.as_str()));
}

#[test]
fn errors_have_anthropics_shape_and_x_api_key_is_a_key() {
    let config = ServerConfig { api_keys: vec!["sekrit".into()], ..default_config() };
    let server = TestServer::start(config);
    let post = |headers: &[(&str, &str)], body: &Value| {
        request(server.addr, "POST", "/v1/messages", headers, Some(body.to_string().as_bytes()))
    };
    let key = [("x-api-key", "sekrit")];
    let ok = post(&key, &body(&json!({"max_tokens": 2})));
    assert_eq!(ok.status, 200, "{}", ok.text());
    for (headers, body, status, kind) in [
        (&[("x-api-key", "wrong")][..], body(&json!({})), 401, "authentication_error"),
        (
            &key[..],
            json!({"messages": [{"role": "user", "content": "q"}]}),
            400,
            "invalid_request_error",
        ),
        (&key[..], body(&json!({"model": "claude-nope"})), 404, "not_found_error"),
        (
            &key[..],
            body(&json!({"thinking": {"type": "enabled", "budget_tokens": 4}})),
            400,
            "invalid_request_error",
        ),
        (&key[..], json!("not an object"), 400, "invalid_request_error"),
    ] {
        let r = post(headers, &body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        let e = r.json();
        assert_eq!(
            (e["type"].as_str(), e["error"]["type"].as_str()),
            (Some("error"), Some(kind)),
            "{e}"
        );
        assert!(!e["error"]["message"].as_str().unwrap().is_empty());
    }
    // Other endpoints keep OpenAI's shape.
    let r = request(
        server.addr,
        "POST",
        "/v1/chat/completions",
        &[("x-api-key", "wrong")],
        Some(b"{}"),
    );
    assert_eq!((r.status, r.json()["error"]["code"].as_u64()), (401, Some(401)));
}
