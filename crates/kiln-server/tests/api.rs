//! The OpenAI endpoints on loopback with the tiny llama3 fixture: completions and chat,
//! streaming == not streaming, usage, logprobs, n, seeds, stop strings, echo, tokenize.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config};
use serde_json::{Value, json};

fn completion(server: &TestServer, body: &Value) -> Value {
    let r = server.post("/v1/completions", body);
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()
}

/// Concatenates a completions stream's texts per choice; returns them and the usage chunk.
fn stream_texts(data: &[String], key: &str) -> (Vec<String>, Option<Value>, Vec<Value>) {
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "{data:?}");
    let mut texts: Vec<String> = Vec::new();
    let mut usage = None;
    let mut finishes = Vec::new();
    for d in &data[..data.len() - 1] {
        let chunk: Value = serde_json::from_str(d).unwrap();
        if chunk["choices"].as_array().unwrap().is_empty() {
            usage = Some(chunk["usage"].clone());
            continue;
        }
        for c in chunk["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
            }
            let piece = if key == "text" { &c["text"] } else { &c["delta"]["content"] };
            texts[i].push_str(piece.as_str().unwrap_or(""));
            if !c["finish_reason"].is_null() {
                finishes.push(c["finish_reason"].clone());
            }
        }
    }
    (texts, usage, finishes)
}

#[test]
fn completions_greedy_stream_equals_non_stream_and_token_prompts_equal_text() {
    let server = TestServer::start(default_config());
    let body = json!({"model": "tiny", "prompt": "Hello world, and hello again", "max_tokens": 12,
                      "temperature": 0, "ignore_eos": true});
    let whole = completion(&server, &body);
    assert_eq!(whole["object"], "text_completion");
    let choice = &whole["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(whole["usage"]["completion_tokens"], 12);
    let text = choice["text"].as_str().unwrap().to_owned();
    assert!(!text.is_empty());

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let r = server.post("/v1/completions", &streamed);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let (texts, usage, finishes) = stream_texts(&r.sse_data(), "text");
    assert_eq!(texts, vec![text.clone()]);
    assert_eq!(finishes, vec![json!("length")]);
    let usage = usage.expect("a usage chunk");
    assert_eq!(usage["completion_tokens"], 12);
    assert_eq!(usage["prompt_tokens"], whole["usage"]["prompt_tokens"]);

    // vLLM's continuous usage: every chunk carries the usage so far, counting up to the end.
    streamed["stream_options"] = json!({"include_usage": true, "continuous_usage_stats": true});
    let chunks: Vec<Value> = server
        .post("/v1/completions", &streamed)
        .sse_data()
        .iter()
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let counts: Vec<u64> =
        chunks.iter().map(|c| c["usage"]["completion_tokens"].as_u64().unwrap()).collect();
    assert!(counts.len() > 2 && counts[0] >= 1, "{counts:?}");
    assert!(counts.windows(2).all(|w| w[0] <= w[1]) && counts.last() == Some(&12), "{counts:?}");
    assert!(chunks.iter().all(|c| c["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]));
    streamed["stream_options"] = json!({"include_usage": true, "include_obfuscation": true});
    assert_eq!(server.post("/v1/completions", &streamed).status, 200);
    for options in [json!({"continuous_usage_stats": true}), json!({"include_usage": true, "x": 1})]
    {
        streamed["stream_options"] = options;
        let r = server.post("/v1/completions", &streamed);
        assert_eq!(r.status, 400, "{}", r.text());
    }

    let ids = server.post("/tokenize", &json!({"prompt": "Hello world, and hello again"})).json();
    let tokens = ids["tokens"].clone();
    assert_eq!(ids["count"], whole["usage"]["prompt_tokens"]);
    let by_ids = completion(
        &server,
        &json!({"prompt": tokens, "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": true}),
    );
    assert_eq!(by_ids["choices"][0]["text"], text.as_str());
    // The second identical request hits the prefix cache and says so.
    assert!(by_ids["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap() > 0);
    let detok = server.post("/detokenize", &json!({"tokens": tokens})).json();
    assert!(detok["prompt"].as_str().unwrap().ends_with("Hello world, and hello again"));
}

#[test]
fn a_batch_of_prompts_with_n_samples_and_seeds() {
    let server = TestServer::start(default_config());
    let body = json!({"prompt": ["one", "two two"], "n": 2, "max_tokens": 6, "seed": 7,
                      "temperature": 1.0, "ignore_eos": true});
    let a = completion(&server, &body);
    let b = completion(&server, &body);
    let choices = a["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(a["choices"], b["choices"], "same seed, same samples");
    assert_eq!(a["usage"]["completion_tokens"], 24);
    // Other seeds give other samples (the tiny model is peaked: compare many tokens).
    let texts = |seed: i64| {
        let v = completion(
            &server,
            &json!({"prompt": "one", "n": 3, "max_tokens": 24,
            "seed": seed, "temperature": 5.0, "ignore_eos": true}),
        );
        v["choices"].as_array().unwrap().iter().map(|c| c["text"].clone()).collect::<Vec<_>>()
    };
    let (x, y) = (texts(100), texts(200));
    assert_eq!(x, texts(100));
    assert_ne!(x, y);
    assert_ne!(x[0], x[1], "the samples of one request differ");
}

#[test]
fn stop_strings_cut_the_output_across_tokens() {
    let server = TestServer::start(default_config());
    let body =
        json!({"prompt": "Hello world", "max_tokens": 30, "temperature": 0, "ignore_eos": true});
    let full = completion(&server, &body)["choices"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    // A stop string from the middle of the text, likely spanning tokens.
    let start = chars.len() / 2;
    let stop: String = chars[start..start + 4].iter().collect();
    let expected_end = full.find(&stop).unwrap();
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!([stop.clone()]);
        b["stream"] = json!(stream);
        let r = server.post("/v1/completions", &b);
        let (text, finish) = if stream {
            let (texts, _, finishes) = stream_texts(&r.sse_data(), "text");
            (texts[0].clone(), finishes[0].clone())
        } else {
            let v = r.json();
            (
                v["choices"][0]["text"].as_str().unwrap().to_owned(),
                v["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(text, full[..expected_end], "stream={stream}");
        assert_eq!(finish, "stop");
    }
    server.wait_for("blocks freed", |s| s.metric("kiln:kv_cache_usage_perc") == 0.0);
}

#[test]
fn logprobs_in_both_formats() {
    let server = TestServer::start(default_config());
    let c = completion(
        &server,
        &json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0,
        "ignore_eos": true, "logprobs": 3, "echo": true}),
    );
    let lp = &c["choices"][0]["logprobs"];
    let prompt_len = c["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert_eq!(lp["tokens"].as_array().unwrap().len(), prompt_len + 4);
    assert!(lp["token_logprobs"][0].is_null(), "first echoed token has no logprob");
    for i in 1..prompt_len + 4 {
        let v = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(v <= 0.0, "{v}");
        assert_eq!(
            lp["top_logprobs"][i].as_object().unwrap().len().min(3),
            lp["top_logprobs"][i].as_object().unwrap().len()
        );
    }
    // Greedy: each generated token is the most likely one.
    for i in prompt_len..prompt_len + 4 {
        let best = lp["top_logprobs"][i]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - lp["token_logprobs"][i].as_f64().unwrap()).abs() < 1e-6);
    }
    assert!(c["choices"][0]["text"].as_str().unwrap().starts_with("Hello"));

    let chat = server.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3, "temperature": 0, "ignore_eos": true, "logprobs": true, "top_logprobs": 2}));
    assert_eq!(chat.status, 200, "{}", chat.text());
    let content = chat.json()["choices"][0]["logprobs"]["content"].clone();
    assert_eq!(content.as_array().unwrap().len(), 3);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(content[0]["bytes"].is_array());

    let p = completion(
        &server,
        &json!({"prompt": "Hello world", "max_tokens": 1, "prompt_logprobs": 1}),
    );
    let plp = p["choices"][0]["prompt_logprobs"].as_array().unwrap().clone();
    assert_eq!(plp.len(), p["usage"]["prompt_tokens"].as_u64().unwrap() as usize);
    assert!(plp[0].is_null() && plp[1].is_object());
}

#[test]
fn chat_stream_equals_non_stream() {
    let server = TestServer::start(default_config());
    let body = json!({"model": "tiny-alias", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}],
        "max_completion_tokens": 10, "temperature": 0, "ignore_eos": true});
    let r = server.post("/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let whole = r.json();
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["model"], "tiny");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let text = whole["choices"][0]["message"]["content"].as_str().unwrap().to_owned();
    let mut s = body.clone();
    s["stream"] = json!(true);
    let data = server.post("/v1/chat/completions", &s).sse_data();
    let first: Value = serde_json::from_str(&data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let (texts, usage, finishes) = stream_texts(&data, "delta");
    assert_eq!(texts, vec![text]);
    assert!(usage.is_none(), "no usage chunk unless asked");
    assert_eq!(finishes, vec![json!("length")]);
}

#[test]
fn models_health_version_and_metrics() {
    let server = TestServer::start(default_config());
    let models = server.get("/v1/models").json();
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "tiny-alias"]);
    assert_eq!(models["data"][0]["max_model_len"], 256);
    // One model by name (the SDK's `models.retrieve`), a name not served is a 404.
    let alias = server.get("/v1/models/tiny-alias");
    assert_eq!((alias.status, alias.json()), (200, models["data"][1].clone()));
    let missing = server.get("/v1/models/gpt-4");
    assert_eq!((missing.status, missing.json()["error"]["param"].clone()), (404, json!("model")));
    assert_eq!(server.get("/health").status, 200);
    assert!(server.get("/version").json()["version"].is_string());
    completion(&server, &json!({"prompt": "abc", "max_tokens": 3, "ignore_eos": true}));
    let text = server.get("/metrics").text();
    for name in [
        "kiln:num_requests_running{",
        "kiln:num_requests_waiting{",
        "kiln:kv_cache_usage_perc{",
        "kiln:prefix_cache_queries_total{",
        "kiln:prefix_cache_hits_total{",
        "kiln:num_preemptions_total{",
        "kiln:prompt_tokens_total{",
        "kiln:generation_tokens_total{",
        "kiln:request_success_total{",
        "kiln:time_to_first_token_seconds_bucket{",
        "kiln:inter_token_latency_seconds_bucket{",
        "kiln:e2e_request_latency_seconds_bucket{",
        "kiln:request_queue_time_seconds_bucket{",
        "kiln:request_prefill_time_seconds_bucket{",
        "kiln:request_decode_time_seconds_bucket{",
        "kiln:iteration_tokens_total_bucket{",
        "kiln:request_prompt_tokens_bucket{",
        "kiln:request_generation_tokens_bucket{",
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
    ] {
        assert!(text.contains(name), "missing {name}");
    }
    assert!(text.contains("model_name=\"tiny\""));
    assert_eq!(server.metric("kiln:generation_tokens_total"), 3.0);
    assert_eq!(
        server.metric("kiln:request_success_total{model_name=\"tiny\",finished_reason=\"length\"}"),
        1.0
    );
}

#[test]
fn render_gives_the_prompt_ids_a_request_computes() {
    let server = TestServer::start(default_config());
    // Completions: one entry per prompt, text tokenized as generation does, ids kept as given.
    let body = json!({"prompt": ["Hello world", "and again"], "max_tokens": 3});
    let rendered = server.post("/v1/completions/render", &body);
    assert_eq!(rendered.status, 200);
    let rendered = rendered.json();
    let prompts = rendered.as_array().unwrap();
    assert_eq!(prompts.len(), 2);
    for (entry, text) in prompts.iter().zip(["Hello world", "and again"]) {
        let tokenized = server.post("/tokenize", &json!({"prompt": text})).json();
        assert_eq!(entry["token_ids"], tokenized["tokens"]);
    }
    let ids = server.post("/v1/completions/render", &json!({"prompt": [5, 6, 7]})).json();
    assert_eq!(ids, json!([{"token_ids": [5, 6, 7]}]));
    // The count a completion reports is the rendered length.
    let whole = completion(&server, &json!({"prompt": "Hello world", "max_tokens": 2}));
    assert_eq!(whole["usage"]["prompt_tokens"], prompts[0]["token_ids"].as_array().unwrap().len());

    // Chat: the template's rendering, as /tokenize renders messages.
    let messages = json!([{"role": "user", "content": "Hi there"}]);
    let chat = server.post("/v1/chat/completions/render", &json!({"messages": messages})).json();
    let tokenized = server.post("/tokenize", &json!({"messages": messages})).json();
    assert!(!tokenized["tokens"].as_array().unwrap().is_empty());
    assert_eq!(chat["token_ids"], tokenized["tokens"]);

    // Invalid requests get generation's errors.
    let bad = server.post("/v1/completions/render", &json!({"prompt": "x", "max_tokens": -1}));
    assert_eq!(bad.status, 400);
    let bad = server.post("/v1/chat/completions/render", &json!({"messages": []}));
    assert_eq!(bad.status, 400);
    let wrong_model = json!({"model": "nope", "prompt": "x"});
    assert_eq!(server.post("/v1/completions/render", &wrong_model).status, 404);
}
