//! Tool calling over HTTP with the tiny llama3 fixture: `tool_choice` `required` and named
//! choices force valid calls (streamed and not, the same calls); `auto` parses the model's text
//! with the server's parser (the fixture's random weights are steered into a call's text with
//! `guided_choice`, which `auto` may combine with); tool calls and results in the history are
//! accepted; bad tool fields are a 400 naming them and leave the server healthy.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config};
use kiln_server::ServerConfig;
use kiln_server::tools::{ToolCallParser, ToolSettings};
use serde_json::{Value, json};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather",
         "parameters": {"type": "object",
             "properties": {"city": {"type": "string", "maxLength": 6},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
             "required": ["zone"], "additionalProperties": false}}}
    ])
}

fn chat(extra: &Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Oslo for 3 days?"}],
        "max_tokens": 200, "temperature": 0, "tools": tools(),
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn with_parser(parser: ToolCallParser) -> ServerConfig {
    ServerConfig {
        tools: ToolSettings { parser: Some(parser), auto_tool_choice: true },
        ..default_config()
    }
}

/// Arguments of a call checked against the fixture tools' schemas.
fn check_arguments(name: &str, arguments: &str) {
    let args: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments}: {e}"));
    let obj = args.as_object().unwrap();
    match name {
        "get_weather" => {
            assert!(args["city"].as_str().is_some_and(|c| c.chars().count() <= 6), "{args}");
            assert!(args["days"].as_i64().is_some_and(|d| (1..=7).contains(&d)), "{args}");
            assert_eq!(obj.len(), 2, "{args}");
        }
        "get_time" => assert!(["UTC", "CET"].contains(&args["zone"].as_str().unwrap()), "{args}"),
        other => panic!("unknown function {other}"),
    }
}

/// `(name, arguments)` of a message's or an assembled stream's calls, ids checked apart.
fn calls_of(tool_calls: &Value) -> Vec<(String, String)> {
    tool_calls
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().is_some_and(|id| !id.is_empty()), "{c}");
            assert_eq!(c["type"], "function");
            let f = &c["function"];
            (f["name"].as_str().unwrap().to_owned(), f["arguments"].as_str().unwrap().to_owned())
        })
        .collect()
}

/// The streamed content, the calls assembled from `delta.tool_calls` as the OpenAI SDK
/// assembles them (by `index`, appending `arguments`), and the finish reason.
fn streamed(server: &TestServer, body: &Value) -> (String, Value, Value) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let (mut content, mut calls, mut finish) = (String::new(), Vec::<Value>::new(), Value::Null);
    for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
        let chunk: Value = serde_json::from_str(d).unwrap();
        let Some(c) = chunk["choices"].get(0) else { continue };
        content.push_str(c["delta"]["content"].as_str().unwrap_or(""));
        for t in c["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = usize::try_from(t["index"].as_u64().unwrap()).unwrap();
            if i == calls.len() {
                calls.push(json!({"id": t["id"], "type": t["type"],
                    "function": {"name": t["function"]["name"], "arguments": ""}}));
            }
            let args = calls[i]["function"]["arguments"].as_str().unwrap().to_owned();
            let more = t["function"]["arguments"].as_str().unwrap_or("");
            calls[i]["function"]["arguments"] = json!(args + more);
        }
        if !c["finish_reason"].is_null() {
            finish = c["finish_reason"].clone();
        }
    }
    (content, Value::Array(calls), finish)
}

fn ok(server: &TestServer, body: &Value) -> Value {
    let r = server.post("/v1/chat/completions", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

#[test]
fn required_and_named_choices_force_valid_calls_streamed_and_not() {
    let server = TestServer::start(default_config());
    let named = json!({"type": "function", "function": {"name": "get_weather"}});
    for (choice, parallel, finish) in [
        (json!("required"), false, "tool_calls"),
        (named.clone(), true, "stop"),
        (named, false, "stop"),
    ] {
        let body = chat(&json!({"tool_choice": choice, "parallel_tool_calls": parallel}));
        let r = ok(&server, &body);
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], finish, "{r}");
        assert!(c["message"]["content"].is_null(), "{r}");
        let calls = calls_of(&c["message"]["tool_calls"]);
        assert_eq!(calls.len(), 1, "{r}");
        for (name, arguments) in &calls {
            check_arguments(name, arguments);
        }
        let (content, stream_calls, stream_finish) = streamed(&server, &body);
        assert_eq!((content.as_str(), stream_finish.as_str()), ("", Some(finish)));
        assert_eq!(calls_of(&stream_calls), calls, "stream == whole for {choice}");
    }
    // With parallel calls the random fixture keeps adding calls until `max_tokens`: an output
    // cut short is no list of calls, so it comes back as content with `finish_reason: length`.
    let body = chat(&json!({"tool_choice": "required", "max_tokens": 120}));
    let r = ok(&server, &body);
    let c = &r["choices"][0];
    assert_eq!(c["finish_reason"], "length", "{r}");
    let text = c["message"]["content"].as_str().unwrap();
    assert!(text.starts_with("[{\"name\":\"") && c["message"].get("tool_calls").is_none(), "{r}");
    let (content, calls, finish) = streamed(&server, &body);
    assert_eq!((content.as_str(), calls, finish), (text, json!([]), json!("length")));
}

#[test]
fn auto_parses_the_models_text_with_the_servers_parser() {
    for (parser, text, content) in [
        (
            ToolCallParser::Hermes,
            "Let me look.<tool_call>{\"name\": \"get_time\", \"arguments\": {\"zone\": \"CET\"}}</tool_call>",
            Some("Let me look."),
        ),
        (
            ToolCallParser::Pythonic,
            "[get_time(zone='UTC'), get_weather(city=\"Oslo\", days=3)]",
            None,
        ),
        (
            ToolCallParser::Llama3Json,
            "{\"name\": \"get_time\", \"parameters\": {\"zone\": \"UTC\"}}",
            None,
        ),
    ] {
        let server = TestServer::start(with_parser(parser));
        let body = chat(&json!({"guided_choice": [text]}));
        let r = ok(&server, &body);
        let c = &r["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{r}");
        assert_eq!(c["message"]["content"].as_str(), content, "{r}");
        let calls = calls_of(&c["message"]["tool_calls"]);
        for (name, arguments) in &calls {
            check_arguments(name, arguments);
        }
        let (streamed_content, stream_calls, finish) = streamed(&server, &body);
        assert_eq!(streamed_content.as_str(), content.unwrap_or(""), "{parser:?}");
        assert_eq!((calls_of(&stream_calls), finish), (calls, json!("tool_calls")));
        // Plain text stays content; `tool_choice: none` never parses.
        let r = ok(&server, &chat(&json!({"guided_choice": ["No tool needed."]})));
        assert_eq!(r["choices"][0]["message"]["content"], "No tool needed.");
        assert!(r["choices"][0]["message"].get("tool_calls").is_none(), "{r}");
        let r = ok(&server, &chat(&json!({"guided_choice": [text], "tool_choice": "none"})));
        assert_eq!(r["choices"][0]["message"]["content"], text);
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
}

#[test]
fn tool_calls_and_results_in_the_history_are_accepted() {
    let server = TestServer::start(default_config());
    let messages = json!([
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 4}"},
    ]);
    let r = ok(
        &server,
        &json!({"messages": messages, "tools": tools(), "tool_choice": "none", "max_tokens": 4}),
    );
    assert_eq!(r["usage"]["completion_tokens"], 4);
    let mut bad = messages.clone();
    bad[1]["tool_calls"][0]["function"]["arguments"] = json!("{not json");
    let r = server.post("/v1/chat/completions", &json!({"messages": bad, "max_tokens": 4}));
    assert_eq!(
        (r.status, r.json()["error"]["param"].clone()),
        (400, json!("messages")),
        "{}",
        r.text()
    );
    let mut forged = messages;
    forged[1]["tool_calls"][0]["function"]["name"] = json!("f<|eot_id|>");
    let r = server.post("/v1/chat/completions", &json!({"messages": forged, "max_tokens": 4}));
    assert_eq!(r.status, 400, "{}", r.text());
}

#[test]
fn bad_tool_fields_are_400s_naming_them_and_the_server_stays_healthy() {
    let server = TestServer::start(default_config());
    let unknown = json!({"type": "function", "function": {"name": "nope"}});
    for (extra, param, says) in [
        (json!({}), "tool_choice", "--enable-auto-tool-choice"),
        (json!({"tool_choice": "auto"}), "tool_choice", "--enable-auto-tool-choice"),
        (json!({"tool_choice": unknown}), "tool_choice", "not in `tools`"),
        (json!({"tool_choice": "always"}), "tool_choice", "always"),
        (
            json!({"tools": [{"type": "code_interpreter"}], "tool_choice": "none"}),
            "tools",
            "code_interpreter",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}], "tool_choice": "none"}),
            "tools",
            "parameters",
        ),
        (
            json!({"tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
            "cannot be combined",
        ),
        (json!({"tool_choice": "required", "ignore_eos": true}), "", ""),
        (
            json!({"tool_choice": "none", "chat_template_kwargs": {"tools": []}}),
            "chat_template_kwargs",
            "tools",
        ),
        (
            json!({"tool_choice": "none", "chat_template_kwargs": 3}),
            "chat_template_kwargs",
            "object",
        ),
        (json!({"tool_choice": "none", "functions": [{"name": "f"}]}), "functions", "tools"),
    ] {
        let r = server.post("/v1/chat/completions", &chat(&extra));
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        let err = &r.json()["error"];
        if !param.is_empty() {
            assert_eq!(err["param"], param, "{extra}: {err}");
        }
        assert!(err["message"].as_str().unwrap().contains(says), "{extra}: {err}");
    }
    let r = server.post("/v1/completions", &json!({"prompt": "x", "tools": tools()}));
    assert_eq!((r.status, r.json()["error"]["param"].clone()), (400, json!("tools")));
    let r = ok(
        &server,
        &chat(&json!({"tool_choice": "none", "chat_template_kwargs": {"enable_thinking": false}})),
    );
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(server.get("/health").status, 200);
}
