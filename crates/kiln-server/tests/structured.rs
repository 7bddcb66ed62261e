//! Structured outputs over HTTP with the tiny llama3 fixture: every spelling (OpenAI's
//! `response_format`, vLLM's `structured_outputs` and `guided_*`) on both endpoints, streamed
//! and not, gives output of its language; malformed schemas, regexes and grammars are a 400
//! naming the parameter and leave the server healthy; fields kiln does not implement are
//! refused by name instead of being dropped. (The schemas forbid free whitespace, which a
//! random-weight model would emit forever.)

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config};
use serde_json::{Value, json};

const SCHEMA: &str = r#"{"type": "object",
  "properties": {"city": {"type": "string", "maxLength": 8},
                 "temp": {"type": "integer", "minimum": -50, "maximum": 60}},
  "required": ["city", "temp"], "additionalProperties": false,
  "x-guidance": {"whitespace_flexible": false}}"#;

fn schema() -> Value {
    serde_json::from_str(SCHEMA).unwrap()
}

fn ok(server: &TestServer, path: &str, body: &Value) -> Value {
    let r = server.post(path, body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

fn check_weather(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v["city"].as_str().is_some_and(|c| c.chars().count() <= 8), "{text}");
    assert!(v["temp"].as_i64().is_some_and(|t| (-50..=60).contains(&t)), "{text}");
    assert_eq!(v.as_object().unwrap().len(), 2, "{text}");
}

/// The streamed text of choice 0 and its finish reason.
fn streamed(server: &TestServer, path: &str, body: &Value) -> (String, Value) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post(path, &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let mut text = String::new();
    let mut finish = Value::Null;
    for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(d).unwrap();
        for c in chunk["choices"].as_array().unwrap() {
            let piece = if path.contains("chat") { &c["delta"]["content"] } else { &c["text"] };
            text.push_str(piece.as_str().unwrap_or(""));
            if !c["finish_reason"].is_null() {
                finish = c["finish_reason"].clone();
            }
        }
    }
    (text, finish)
}

#[test]
fn every_spelling_constrains_both_endpoints_streamed_and_not() {
    let server = TestServer::start(default_config());
    let json_schema = json!({"type": "json_schema",
        "json_schema": {"name": "weather", "schema": schema(), "strict": true}});
    let constraints = [
        json!({"response_format": json_schema}),
        json!({"structured_outputs": {"json": schema(), "disable_any_whitespace": true}}),
        json!({"guided_json": SCHEMA}),
        // llama-server's spelling.
        json!({"json_schema": schema()}),
    ];
    for constraint in constraints {
        for (path, base) in [
            ("/v1/completions", json!({"prompt": "Weather report:", "max_tokens": 80})),
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}],
                       "max_tokens": 80}),
            ),
        ] {
            let mut body = base.clone();
            for (k, v) in constraint.as_object().unwrap() {
                body[k] = v.clone();
            }
            for temperature in [0.0, 0.8] {
                body["temperature"] = json!(temperature);
                body["seed"] = json!(7);
                let r = ok(&server, path, &body);
                let choice = &r["choices"][0];
                let text = if path.contains("chat") {
                    choice["message"]["content"].as_str().unwrap()
                } else {
                    choice["text"].as_str().unwrap()
                };
                assert_eq!(choice["finish_reason"], "stop", "{body}: {r}");
                check_weather(text);
                let (streamed_text, finish) = streamed(&server, path, &body);
                assert_eq!((streamed_text.as_str(), &finish), (text, &json!("stop")), "{body}");
            }
        }
    }
}

/// Whether a finished output is valid.
type Validator = fn(&str) -> bool;

#[test]
fn regex_choice_grammar_and_json_object() {
    let server = TestServer::start(default_config());
    let base = json!({"prompt": "Answer:", "max_tokens": 60, "temperature": 0.7, "seed": 1});
    let cases: [(Value, Validator); 7] = [
        (json!({"guided_regex": "[A-Z][a-z]{2,5} [0-9]{2}"}), |t| {
            let (w, n) = t.split_once(' ').unwrap_or_default();
            (3..=6).contains(&w.len()) && n.len() == 2 && n.bytes().all(|b| b.is_ascii_digit())
        }),
        (json!({"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}), |t| {
            ["yes", "no", "maybe so"].contains(&t)
        }),
        (json!({"guided_choice": ["red", "green"]}), |t| ["red", "green"].contains(&t)),
        (
            json!({"structured_outputs": {"grammar": "start: \"(\" num (\"+\" num)* \")\"\nnum: /[0-9]/"}}),
            |t| t.starts_with('(') && t.ends_with(')') && t.len() >= 3,
        ),
        // GBNF, as vLLM's xgrammar backend and llama-server's `grammar` take it.
        (
            json!({"structured_outputs": {"grammar": "root ::= \"(\" num (\"+\" num)* \")\"\nnum ::= [0-9]"}}),
            |t| t.starts_with('(') && t.ends_with(')') && t.len() >= 3,
        ),
        (json!({"grammar": "root ::= [a-c]{2,4} \"!\"", "n_predict": 20}), |t| {
            t.ends_with('!') && (3..=5).contains(&t.len())
        }),
        (json!({"response_format": {"type": "json_object"}}), |t| {
            serde_json::from_str::<Value>(t).is_ok_and(|v| v.is_object())
        }),
    ];
    for (constraint, valid) in cases {
        let mut body = base.clone();
        for (k, v) in constraint.as_object().unwrap() {
            body[k] = v.clone();
        }
        body["n"] = json!(3);
        if body.get("n_predict").is_some() {
            body.as_object_mut().unwrap().remove("max_tokens");
        }
        let r = ok(&server, "/v1/completions", &body);
        for choice in r["choices"].as_array().unwrap() {
            let text = choice["text"].as_str().unwrap();
            // A grammar with an unbounded repetition may run out of tokens; a finished output
            // must be complete.
            if choice["finish_reason"] == "stop" {
                assert!(valid(text), "{constraint}: {text:?}");
            } else {
                assert!(
                    constraint.to_string().contains("grammar")
                        || constraint.to_string().contains("json_object"),
                    "{constraint}: {choice}"
                );
            }
        }
    }
}

#[test]
fn malformed_constraints_are_a_400_naming_the_parameter_and_change_nothing() {
    let server = TestServer::start(default_config());
    let cases = [
        (json!({"guided_json": "{\"type\": "}), "guided_json"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (json!({"response_format": {"type": "yaml"}}), "response_format.type"),
        (json!({"guided_regex": "([a-z]"}), "guided_regex"),
        (json!({"structured_outputs": {"grammar": "start: undefined_rule"}}), "structured_outputs"),
        (
            json!({"structured_outputs": {"json": {"type": "object",
            "properties": {"a": {"$ref": "#/definitions/missing"}}}}}),
            "structured_outputs",
        ),
        (json!({"guided_choice": []}), "guided_choice"),
        (json!({"guided_regex": "a+", "guided_choice": ["a"]}), "guided_choice"),
        (json!({"response_format": {"type": "json_object"}, "ignore_eos": true}), "ignore_eos"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
            "tools",
        ),
        (json!({"use_beam_search": true}), "use_beam_search"),
        (json!({"grammar": "root ::= item"}), "grammar"),
        (json!({"grammar": "root ::= \"a\"", "guided_regex": "a"}), "grammar"),
        (json!({"n_predict": 4}), "n_predict"),
        (json!({"typical_p": 0.5}), "typical_p"),
    ];
    for (fields, param) in cases {
        let mut body = json!({"prompt": "x", "max_tokens": 4});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(r.json()["error"]["param"], param, "{body}: {}", r.text());
    }
    assert_eq!(server.get("/health").status, 200);
    assert_eq!(server.metric("kiln:num_requests_running{"), 0.0);
    // Still serving, constrained and not.
    let r = ok(
        &server,
        "/v1/completions",
        &json!({"prompt": "x", "max_tokens": 20,
        "guided_choice": ["ok"]}),
    );
    assert_eq!(r["choices"][0]["text"], "ok");
}
