//! `/v1/embeddings` and `/pooling` on the embedding fixtures (`tests/fixtures/embedding`):
//! sentence-transformers' vectors through HTTP (text, token ids, base64, `dimensions`,
//! `normalize`, truncation), each input's vector the same alone as among others, and every
//! malformed or hostile request a 400 naming what is wrong, which changes nothing; a
//! generative server answers vLLM's 400 to both endpoints, a pooling server refuses
//! generation.

#![allow(clippy::unwrap_used)]

mod common;

use base64::Engine as _;
use common::{TestServer, assert_rows_close, data_vectors, default_config};
use serde_json::{Value, json};

fn reference(name: &str) -> Value {
    common::embedding_reference(name)
}

fn server(name: &str) -> TestServer {
    common::pooling_server(name, 64)
}

fn embed(s: &TestServer, body: &Value) -> Value {
    let r = s.post("/v1/embeddings", body);
    assert_eq!(r.status, 200, "{body}: {}", r.text());
    r.json()
}

#[test]
fn embeddings_are_sentence_transformers_vectors_in_every_form() {
    for name in ["qwen3-embed", "llama3-mean"] {
        let s = server(name);
        let reference = reference(name);
        let texts = &reference["texts"];
        let r = embed(&s, &json!({"model": "tiny", "input": texts}));
        assert_eq!((r["object"].as_str(), r["model"].as_str()), (Some("list"), Some("tiny")));
        assert!(r["id"].as_str().unwrap().starts_with("embd-"));
        assert_eq!(r["data"][0]["object"], "embedding");
        let tokens: usize = reference["prompt_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_array().unwrap().len())
            .sum();
        assert_eq!(
            r["usage"],
            json!({"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0})
        );
        let got = data_vectors(&r, "embedding");
        assert_rows_close(&got, &reference["embeddings"], name);
        // Token ids give the same vectors; so does each input alone, bit for bit.
        let by_ids =
            data_vectors(&embed(&s, &json!({"input": reference["prompt_ids"]})), "embedding");
        assert_eq!(by_ids, got, "{name}: token ids");
        for (i, text) in texts.as_array().unwrap().iter().enumerate() {
            let alone = data_vectors(&embed(&s, &json!({"input": text})), "embedding");
            assert_eq!(alone[0], got[i], "{name}: input {i} alone");
        }
        // base64: the little-endian f32 bytes of the same vectors.
        let b64 = embed(&s, &json!({"input": texts, "encoding_format": "base64"}));
        for (i, d) in b64["data"].as_array().unwrap().iter().enumerate() {
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(d["embedding"].as_str().unwrap())
                .unwrap();
            let floats: Vec<f32> =
                bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
            assert_eq!(floats, got[i], "{name}: base64 {i}");
        }
        // `dimensions`: sentence-transformers' `truncate_dim` (normalised again where the
        // model normalises).
        let short = embed(&s, &json!({"input": texts, "dimensions": 16}));
        assert_rows_close(&data_vectors(&short, "embedding"), &reference["embeddings_16"], name);
        // /pooling: vLLM's shape, the same vectors.
        let r = s.post("/pooling", &json!({"input": texts}));
        assert_eq!(r.status, 200, "{}", r.text());
        let pooled = r.json();
        assert!(pooled["id"].as_str().unwrap().starts_with("pool-"));
        assert_eq!(pooled["data"][0]["object"], "pooling");
        assert_eq!(data_vectors(&pooled, "data"), got, "{name}: /pooling");
    }
}

/// vLLM's chat form: `messages` rendered by the chat template without the assistant's
/// opening, embedded as one input: the vector of the same ids given as tokens.
#[test]
fn messages_are_rendered_by_the_chat_template() {
    let s = server("qwen3-embed");
    let messages = json!([{"role": "user", "content": "What is a paged KV cache?"}]);
    let render = s.post(
        "/v1/chat/completions/render",
        &json!({"messages": messages, "add_generation_prompt": false}),
    );
    assert_eq!(render.status, 200, "{}", render.text());
    let ids = render.json()["token_ids"].clone();
    let by_messages = embed(&s, &json!({"messages": messages}));
    let by_ids = embed(&s, &json!({"input": ids}));
    assert_eq!(data_vectors(&by_messages, "embedding"), data_vectors(&by_ids, "embedding"));
    assert_eq!(by_messages["usage"]["prompt_tokens"], ids.as_array().unwrap().len());
    let opened = embed(&s, &json!({"messages": messages, "add_generation_prompt": true}));
    assert_ne!(data_vectors(&opened, "embedding"), data_vectors(&by_ids, "embedding"));
    for (body, needle) in [
        (json!({"messages": messages, "input": "x"}), "not both"),
        (json!({"messages": []}), "must not be empty"),
    ] {
        let r = s.post("/v1/embeddings", &body);
        assert_eq!(r.status, 400, "{body}");
        assert!(r.text().contains(needle), "{body}: {}", r.text());
    }
}

#[test]
fn normalize_and_truncation() {
    let s = server("llama3-mean");
    let reference = reference("llama3-mean");
    let text = &reference["texts"][3];
    let raw = data_vectors(&embed(&s, &json!({"input": text})), "embedding").remove(0);
    let unit =
        data_vectors(&embed(&s, &json!({"input": text, "normalize": true})), "embedding").remove(0);
    let norm = raw.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!(raw.iter().zip(&unit).all(|(r, u)| (r / norm - u).abs() < 1e-6));
    // `truncate_prompt_tokens`: the input's last tokens, as their token ids give.
    let ids: Vec<u64> = serde_json::from_value(reference["prompt_ids"][3].clone()).unwrap();
    let tail = &ids[ids.len() - 10..];
    let truncated = embed(&s, &json!({"input": text, "truncate_prompt_tokens": 10}));
    assert_eq!(truncated["usage"]["prompt_tokens"], 10);
    let by_tail = embed(&s, &json!({"input": tail}));
    assert_eq!(data_vectors(&truncated, "embedding"), data_vectors(&by_tail, "embedding"));
    // The 56-token text is within the context of 64; 100 copies of it are not, unless cut.
    let long = text.as_str().unwrap().repeat(3);
    let r = s.post("/v1/embeddings", &json!({"input": long}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("maximum context length is 64"), "{}", r.text());
    let cut = embed(&s, &json!({"input": long, "truncate_prompt_tokens": -1}));
    assert_eq!(cut["usage"]["prompt_tokens"], 64);
}

#[test]
fn bad_requests_are_refused_by_name_and_change_nothing() {
    let s = server("qwen3-embed");
    let many: Vec<&str> = vec!["a"; 2049];
    for (body, needle) in [
        (json!({"input": ""}), "input 0 is empty"),
        (json!({"input": ["ok", ""]}), "input 1 is empty"),
        (json!({"input": []}), "`input` is empty"),
        (json!({}), "`input` is required"),
        (json!({"input": many}), "at most 2048"),
        (json!({"input": 7}), "`input` must be"),
        (json!({"input": [1, "a"]}), "`input` must be"),
        (json!({"input": [[1, 2], [100_000]]}), "outside the vocabulary"),
        (json!({"input": "x", "dimensions": 0}), "`dimensions` must be 1 to 64"),
        (json!({"input": "x", "dimensions": 65}), "`dimensions` must be 1 to 64"),
        (json!({"input": "x", "encoding_format": "int8"}), "`encoding_format`"),
        (json!({"input": "x", "truncate_prompt_tokens": 0}), "truncate_prompt_tokens"),
        (json!({"input": "x", "truncate_prompt_tokens": 65}), "truncate_prompt_tokens"),
        (json!({"input": "x", "messages": []}), "not both"),
        (json!({"input": "x", "prompt": "y"}), "unknown field `prompt`"),
        (json!({"input": "x", "model": "other"}), "does not exist"),
    ] {
        let r = s.post("/v1/embeddings", &body);
        assert!(r.status == 400 || r.status == 404, "{body}: {} {}", r.status, r.text());
        assert!(r.text().contains(needle), "{body}: {}", r.text());
    }
    // More inputs than the queue holds (the default test config queues 1024).
    let queued: Vec<&str> = vec!["a"; 1025];
    let r = s.post("/v1/embeddings", &json!({"input": queued}));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("--max-queued-requests"), "{}", r.text());
    let r =
        s.post("/v1/chat/completions", &json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!(r.status, 400);
    assert!(r.text().contains("pooling model"), "{}", r.text());
    // Nothing was left behind: every refused request is gone, and the server still answers.
    let r = embed(&s, &json!({"input": "still here"}));
    assert_eq!(r["data"].as_array().unwrap().len(), 1);
    assert_eq!(s.state.loaded().unwrap().engine.stats().num_running, 0);
}

/// Pooling requests count in vLLM's request metrics: one success each (finished "stop"), their
/// prompt tokens, no generated token, no sampling parameters.
#[test]
fn pooling_requests_are_counted_in_the_metrics() {
    let s = server("qwen3-embed");
    let r = embed(&s, &json!({"input": ["one", "two words", "and three words"]}));
    let prompt_tokens = r["usage"]["prompt_tokens"].as_u64().unwrap();
    let text = s.get("/metrics").text();
    // The sample of `name` whose labels contain `label`.
    let value = |name: &str, label: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(name) && l.contains(label))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} {label} missing:\n{text}"))
    };
    assert_eq!(value("kiln:request_success_total{", "finished_reason=\"stop\""), 3.0);
    assert_eq!(value("kiln:prompt_tokens_total{", ""), prompt_tokens as f64);
    assert_eq!(value("kiln:generation_tokens_total{", ""), 0.0);
    assert_eq!(value("kiln:e2e_request_latency_seconds_count{", ""), 3.0);
    assert_eq!(value("kiln:request_params_max_tokens_count{", ""), 0.0);
}

#[test]
fn a_generative_server_answers_vllm_s_error() {
    let s = TestServer::start(default_config());
    for path in ["/v1/embeddings", "/pooling"] {
        let r = s.post(path, &json!({"input": "hello"}));
        assert_eq!(r.status, 400, "{path}");
        assert!(r.text().contains("does not support"), "{path}: {}", r.text());
    }
}
