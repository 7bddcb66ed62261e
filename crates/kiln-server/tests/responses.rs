//! OpenAI's Responses API on a live server: the same output as chat (a reasoning item with
//! `--reasoning-parser`, a function_call item for a forced tool), whole, streamed and in the
//! background alike, the event sequence in OpenAI's order, continuations by
//! `previous_response_id` equal to the chat they stand for, the bounded store, cancel, and
//! log-probabilities equal to chat's.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config, thinking_server};
use kiln_server::ServerConfig;
use kiln_server::responses::store::StoreLimits;
use serde_json::{Value, json};

fn body(extra: &Value) -> Value {
    let mut body = json!({
        "model": "tiny", "max_output_tokens": 10, "temperature": 0,
        "instructions": "Answer briefly.", "input": "Is 7 prime?",
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn respond(server: &TestServer, body: &Value) -> Value {
    let r = server.post("/v1/responses", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

/// The events of a streamed response, checked against OpenAI's order: `response.created`,
/// `response.in_progress`, each item added, filled and done before the next, then one final
/// event; sequence numbers from 0.
fn events(server: &TestServer, body: &Value) -> Vec<Value> {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post("/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let events: Vec<Value> = r
        .text()
        .split("\n\n")
        .filter_map(|e| {
            let name = e.lines().find_map(|l| l.strip_prefix("event: "))?;
            let data: Value =
                serde_json::from_str(e.lines().find_map(|l| l.strip_prefix("data: "))?).unwrap();
            assert_eq!(data["type"], json!(name));
            Some(data)
        })
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(&kinds[..2], ["response.created", "response.in_progress"], "{kinds:?}");
    assert!(
        ["response.completed", "response.incomplete"].contains(kinds.last().unwrap()),
        "{kinds:?}"
    );
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i), "{kinds:?}");
    }
    let mut open: Option<u64> = None;
    let mut next = 0;
    for e in &events[2..events.len() - 1] {
        let kind = e["type"].as_str().unwrap();
        let index = e["output_index"].as_u64();
        match kind {
            "response.output_item.added" => {
                assert_eq!((open, index), (None, Some(next)), "{kinds:?}");
                open = index;
            }
            "response.output_item.done" => {
                assert_eq!(index, open, "{kinds:?}");
                open = None;
                next += 1;
            }
            _ => assert_eq!(index, open, "{kind} outside its item: {kinds:?}"),
        }
    }
    assert_eq!(open, None);
    events
}

/// The items a stream built from its deltas, as the whole response holds them.
fn items_of(events: &[Value]) -> Vec<Value> {
    let mut items: Vec<Value> = Vec::new();
    for e in events {
        match e["type"].as_str().unwrap() {
            "response.output_item.added" => items.push(e["item"].clone()),
            "response.content_part.added" => {
                let item = items.last_mut().unwrap();
                item["content"].as_array_mut().unwrap().push(e["part"].clone());
            }
            "response.reasoning_text.delta" | "response.output_text.delta" => {
                let part = &mut items.last_mut().unwrap()["content"][0];
                let text = part["text"].as_str().unwrap().to_owned();
                part["text"] = json!(text + e["delta"].as_str().unwrap());
            }
            "response.function_call_arguments.delta" => {
                let item = items.last_mut().unwrap();
                let text = item["arguments"].as_str().unwrap().to_owned();
                item["arguments"] = json!(text + e["delta"].as_str().unwrap());
            }
            "response.output_item.done" => {
                let item = items.last_mut().unwrap();
                item["status"] = e["item"]["status"].clone();
                let parts = item.get_mut("content").and_then(Value::as_array_mut);
                for part in parts.into_iter().flatten() {
                    if part.get("logprobs").is_some() {
                        // Checked apart (the last token's has no text delta).
                        part["logprobs"] = json!([]);
                    }
                }
            }
            _ => {}
        }
    }
    items
}

/// Items without their ids and log-probabilities (ids differ between runs).
fn comparable(items: &[Value]) -> Vec<Value> {
    items
        .iter()
        .map(|i| {
            let mut i = i.clone();
            let obj = i.as_object_mut().unwrap();
            obj.remove("id");
            obj.remove("call_id");
            if let Some(parts) = obj.get_mut("content").and_then(Value::as_array_mut) {
                for part in parts {
                    if part.get("logprobs").is_some() {
                        part["logprobs"] = json!([]);
                    }
                }
            }
            i
        })
        .collect()
}

#[test]
fn thinking_comes_back_as_a_reasoning_item_whole_and_streamed() {
    let server = thinking_server();
    let plain = body(&json!({}));
    let whole = respond(&server, &plain);
    assert_eq!(whole["object"], "response");
    assert!(whole["id"].as_str().unwrap().starts_with("resp_"), "{whole}");
    assert_eq!(whole["status"], "incomplete", "{whole}");
    assert_eq!(whole["incomplete_details"]["reason"], "max_output_tokens");
    let output = whole["output"].as_array().unwrap().clone();
    assert_eq!(output[0]["type"], "reasoning", "{whole}");
    let thinking = output[0]["content"][0]["text"].as_str().unwrap();
    assert!(!thinking.is_empty());
    let usage = &whole["usage"];
    assert_eq!(usage["output_tokens"], 10);
    let reasoning_tokens = usage["output_tokens_details"]["reasoning_tokens"].as_u64().unwrap();
    assert!(reasoning_tokens > 0 && reasoning_tokens <= 10, "{usage}");
    // The chat endpoint reads the same output the same way.
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Is 7 prime?"}],
                "max_tokens": 10, "temperature": 0}),
    );
    let chat = chat.json();
    assert_eq!(chat["choices"][0]["message"]["reasoning_content"], json!(thinking));
    assert_eq!(usage["input_tokens"], chat["usage"]["prompt_tokens"]);

    let events = events(&server, &plain);
    assert_eq!(comparable(&items_of(&events)), comparable(&output));
    let last = events.last().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    assert_eq!(comparable(last["response"]["output"].as_array().unwrap()), comparable(&output));
    // The same counts (the stream's prompt was read from the prefix cache).
    let streamed_usage = &last["response"]["usage"];
    for key in ["input_tokens", "output_tokens", "total_tokens", "output_tokens_details"] {
        assert_eq!(streamed_usage[key], whole["usage"][key], "{key}");
    }
    assert!(streamed_usage["input_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);

    // `reasoning.effort: "none"` turns the template's thinking off (this template ignores it,
    // so the output is the same; a template that reads `enable_thinking` would change).
    let off = respond(&server, &body(&json!({"reasoning": {"effort": "none"}})));
    assert_eq!(off["status"], "incomplete");
}

#[test]
fn a_forced_function_call_is_an_item_and_its_continuation_is_the_chat_it_stands_for() {
    let server = TestServer::start(default_config());
    let tool = json!({"type": "function", "name": "weather", "description": "d", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Oslo"]}}, "required": ["city"]}});
    let forced = body(&json!({"max_output_tokens": 30, "tools": [tool],
                              "tool_choice": {"type": "function", "name": "weather"}}));
    let whole = respond(&server, &forced);
    let output = whole["output"].as_array().unwrap().clone();
    assert_eq!(output.len(), 1, "{whole}");
    let call = &output[0];
    assert_eq!(
        (call["type"].as_str(), call["name"].as_str(), call["arguments"].as_str()),
        (Some("function_call"), Some("weather"), Some("{\"city\":\"Oslo\"}")),
        "{whole}"
    );
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(whole["status"], "completed");
    assert_eq!(whole["tools"][0]["name"], "weather");
    let streamed = events(&server, &forced);
    assert_eq!(comparable(&items_of(&streamed)), comparable(&output));
    let done = streamed.iter().find(|e| e["type"] == "response.function_call_arguments.done");
    assert_eq!(done.unwrap()["arguments"], call["arguments"]);

    // `required` (one call: the random model would repeat calls up to the limit).
    let required =
        body(&json!({"max_output_tokens": 60, "tools": [tool], "tool_choice": "required",
                                "parallel_tool_calls": false}));
    let whole_required = respond(&server, &required);
    let items = whole_required["output"].as_array().unwrap().clone();
    assert!(!items.is_empty(), "{whole_required}");
    for item in &items {
        assert_eq!(
            (item["type"].as_str(), item["name"].as_str()),
            (Some("function_call"), Some("weather"))
        );
        assert_eq!(item["arguments"], "{\"city\":\"Oslo\"}");
    }
    assert_eq!(comparable(&items_of(&events(&server, &required))), comparable(&items));

    // The continuation's prompt is the chat conversation it stands for.
    let call_id = call["call_id"].as_str().unwrap();
    let next = respond(
        &server,
        &json!({
            "previous_response_id": whole["id"], "max_output_tokens": 4, "temperature": 0,
            "tools": [tool], "tool_choice": "none",
            "input": [{"type": "function_call_output", "call_id": call_id, "output": "cold"}],
        }),
    );
    assert_eq!(next["previous_response_id"], whole["id"]);
    let chat = server.post(
        "/v1/chat/completions",
        &json!({
            "max_tokens": 4, "temperature": 0,
            "tools": [{"type": "function", "function": {"name": "weather", "description": "d",
                        "parameters": tool["parameters"]}}],
            "tool_choice": "none",
            "messages": [
                {"role": "user", "content": "Is 7 prime?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call_id,
                  "type": "function", "function": {"name": "weather",
                  "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": call_id, "content": "cold"},
            ],
        }),
    );
    assert_eq!(chat.status, 200, "{}", chat.text());
    let chat = chat.json();
    assert_eq!(next["usage"]["input_tokens"], chat["usage"]["prompt_tokens"], "{next}");
    assert_eq!(
        next["output"][0]["content"][0]["text"], chat["choices"][0]["message"]["content"],
        "{next}"
    );
}

#[test]
fn stored_responses_are_read_deleted_and_bounded() {
    let config = ServerConfig {
        responses_store: StoreLimits { max_responses: 2, max_bytes: 1 << 20 },
        ..default_config()
    };
    let server = TestServer::start(config);
    let ids: Vec<String> = (0..3)
        .map(|_| {
            respond(&server, &body(&json!({"max_output_tokens": 2})))["id"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    // The oldest went when the third came.
    let gone = server.get(&format!("/v1/responses/{}", ids[0]));
    assert_eq!(gone.status, 404, "{}", gone.text());
    let continued = server.post(
        "/v1/responses",
        &json!({"previous_response_id": ids[0], "input": "more", "max_output_tokens": 2}),
    );
    assert_eq!(continued.status, 404);
    assert_eq!(continued.json()["error"]["param"], "previous_response_id");
    let kept = server.get(&format!("/v1/responses/{}", ids[2]));
    assert_eq!((kept.status, kept.json()["id"].as_str()), (200, Some(ids[2].as_str())));
    assert_eq!(kept.json()["status"], "incomplete");
    let resumed = server.get(&format!("/v1/responses/{}?stream=true", ids[2]));
    assert_eq!(resumed.status, 400);

    let deleted =
        common::request(server.addr, "DELETE", &format!("/v1/responses/{}", ids[2]), &[], None);
    assert_eq!(deleted.status, 200);
    assert_eq!(deleted.json(), json!({"id": ids[2], "object": "response", "deleted": true}));
    assert_eq!(server.get(&format!("/v1/responses/{}", ids[2])).status, 404);

    // `store: false` keeps nothing, and says so.
    let unstored = respond(&server, &body(&json!({"max_output_tokens": 2, "store": false})));
    assert_eq!(unstored["store"], false);
    assert_eq!(
        server.get(&format!("/v1/responses/{}", unstored["id"].as_str().unwrap())).status,
        404
    );
    let cancel = server.post(&format!("/v1/responses/{}/cancel", ids[1]), &json!({}));
    assert_eq!(cancel.status, 400, "a synchronous response is not cancelled");
}

#[test]
fn background_responses_finish_as_the_whole_one_or_cancel() {
    let server = TestServer::start(default_config());
    let plain = body(&json!({"max_output_tokens": 8}));
    let whole = respond(&server, &plain);
    let started = respond(&server, &body(&json!({"max_output_tokens": 8, "background": true})));
    assert_eq!(
        (started["status"].as_str(), started["background"].as_bool()),
        (Some("in_progress"), Some(true))
    );
    let path = format!("/v1/responses/{}", started["id"].as_str().unwrap());
    server.wait_for("the background response", |s| s.get(&path).json()["status"] != "in_progress");
    let done = server.get(&path).json();
    assert_eq!(done["status"], whole["status"]);
    assert_eq!(
        comparable(done["output"].as_array().unwrap()),
        comparable(whole["output"].as_array().unwrap())
    );
    assert_eq!(done["usage"]["output_tokens"], whole["usage"]["output_tokens"]);

    // A long one cancelled stops generating. (On a loaded machine the tiny model may finish
    // first: then the cancel is refused, and another is tried.)
    let (path, cancelled) = (0..5)
        .find_map(|_| {
            let long = body(&json!({"max_output_tokens": 200, "background": true}));
            let long = respond(&server, &long);
            let path = format!("/v1/responses/{}", long["id"].as_str().unwrap());
            let cancelled = server.post(&format!("{path}/cancel"), &json!({}));
            (cancelled.status == 200).then_some((path, cancelled))
        })
        .expect("no background response was still running when cancelled");
    assert_eq!(cancelled.json()["status"], "cancelled");
    assert_eq!(server.get(&path).json()["status"], "cancelled");
    server.wait_for("no request running", |s| s.metric("kiln:num_requests_running{") == 0.0);
    let again = server.post(&format!("{path}/cancel"), &json!({}));
    assert_eq!((again.status, again.json()["status"].as_str()), (200, Some("cancelled")));
    let finished =
        server.post(&format!("/v1/responses/{}/cancel", done["id"].as_str().unwrap()), &json!({}));
    assert_eq!(finished.status, 400);
}

#[test]
fn logprobs_are_the_chat_ones_and_unknown_fields_are_refused() {
    let server = TestServer::start(default_config());
    let asked = body(&json!({"max_output_tokens": 6, "include": ["message.output_text.logprobs"],
                             "top_logprobs": 2}));
    let whole = respond(&server, &asked);
    let part = &whole["output"][0]["content"][0];
    let logprobs = part["logprobs"].as_array().unwrap();
    assert_eq!(logprobs.len(), 6, "{whole}");
    let chat = server.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": "Answer briefly."},
                             {"role": "user", "content": "Is 7 prime?"}],
                "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(&chat.json()["choices"][0]["logprobs"]["content"], &json!(logprobs));
    // Streamed, the deltas carry them (all of them, when every token has text).
    let events = events(&server, &asked);
    let streamed: Vec<Value> = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().unwrap().clone())
        .collect();
    let done = events.iter().find(|e| e["type"] == "response.output_text.done").unwrap();
    assert_eq!(&done["logprobs"], &json!(logprobs));
    assert!(logprobs.starts_with(&streamed), "{streamed:?}");

    for (extra, param) in [
        (json!({"max_tokens": 4}), "max_tokens"),
        (json!({"reasoning": {"effort": "extreme"}}), "reasoning"),
        // The fixture's template has no reasoning effort (chat's field names it).
        (json!({"reasoning": {"effort": "high"}}), "reasoning_effort"),
        (json!({"previous_response_id": "resp_nope"}), "previous_response_id"),
        (json!({"tools": [{"type": "web_search"}]}), "tools"),
    ] {
        let r = server.post("/v1/responses", &body(&extra));
        assert!(matches!(r.status, 400 | 404), "{extra}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{extra}");
    }
}
