//! `/score` and `/rerank` on the cross-encoder fixture (`tests/fixtures/embedding/qwen3-rerank`,
//! a `Qwen3ForSequenceClassification` with one label): sentence-transformers' `CrossEncoder`
//! scores through every route and shape, documents ordered by them; on an embedding model the
//! cosine of the embeddings; bad requests refused by name; a generative server answers vLLM's
//! 400, a cross-encoder refuses `/v1/embeddings`.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config, floats, post_ok};
use serde_json::{Value, json};

fn reference(name: &str) -> Value {
    common::embedding_reference(name)
}

fn server(name: &str) -> TestServer {
    common::pooling_server(name, 96)
}

#[test]
fn scores_are_cross_encoder_scores_on_every_route() {
    let s = server("qwen3-rerank");
    let r = reference("qwen3-rerank");
    let want = floats(&r["scores"]);
    let (query, documents) = (&r["query"], &r["documents"]);
    let tokens: usize =
        r["pair_ids"].as_array().unwrap().iter().map(|p| p.as_array().unwrap().len()).sum();
    for path in ["/score", "/v1/score"] {
        let got =
            post_ok(&s, path, &json!({"model": "tiny", "text_1": query, "text_2": documents}));
        assert_eq!(got["object"], "list");
        assert_eq!(got["usage"]["prompt_tokens"], tokens);
        let scores: Vec<f32> = got["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["score"].as_f64().unwrap() as f32)
            .collect();
        for (i, (g, w)) in scores.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-4, "{path} pair {i}: {g} vs {w}");
        }
        // N to N pairs give the same scores; one pair alone gives its score bit for bit.
        let n = documents.as_array().unwrap().len();
        let queries = vec![query.clone(); n];
        let pairs = post_ok(&s, path, &json!({"text_1": queries, "text_2": documents}));
        assert_eq!(pairs["data"], got["data"]);
        let alone = post_ok(&s, path, &json!({"text_1": query, "text_2": documents[2]}));
        assert_eq!(alone["data"][0]["score"], got["data"][2]["score"]);
    }
    for path in ["/rerank", "/v1/rerank", "/v2/rerank"] {
        let got = post_ok(&s, path, &json!({"query": query, "documents": documents, "top_n": 3}));
        let results = got["results"].as_array().unwrap();
        assert_eq!(results.len(), 3);
        let mut order: Vec<usize> = (0..want.len()).collect();
        order.sort_by(|&a, &b| want[b].total_cmp(&want[a]));
        for (r, &i) in results.iter().zip(&order) {
            assert_eq!(r["index"], i, "{path}: {got}");
            assert_eq!(r["document"]["text"], documents[i]);
            assert!((r["relevance_score"].as_f64().unwrap() as f32 - want[i]).abs() < 1e-4);
        }
        assert_eq!(got["usage"]["total_tokens"], tokens);
        let bare = post_ok(
            &s,
            path,
            &json!({"query": query, "documents": documents, "return_documents": false}),
        );
        assert_eq!(bare["results"].as_array().unwrap().len(), 4);
        assert!(bare["results"][0].get("document").is_none());
    }
}

#[test]
fn an_embedding_model_scores_by_cosine() {
    let s = server("qwen3-embed");
    let r = reference("qwen3-embed");
    let texts = r["texts"].as_array().unwrap();
    let embeddings: Vec<Vec<f32>> =
        r["embeddings"].as_array().unwrap().iter().map(floats).collect();
    let got = post_ok(&s, "/score", &json!({"text_1": texts[0], "text_2": texts[1..]}));
    for (i, d) in got["data"].as_array().unwrap().iter().enumerate() {
        // The reference vectors are unit length: their dot product is the cosine.
        let want: f32 = embeddings[0].iter().zip(&embeddings[i + 1]).map(|(a, b)| a * b).sum();
        assert!((d["score"].as_f64().unwrap() as f32 - want).abs() < 1e-4, "{i}");
    }
}

#[test]
fn bad_requests_and_wrong_models_are_refused() {
    let s = server("qwen3-rerank");
    for (path, body, needle) in [
        ("/score", json!({"text_2": "a"}), "`text_1` is required"),
        (
            "/score",
            json!({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
            "give one, or as many",
        ),
        ("/score", json!({"text_1": "a", "text_2": []}), "`text_2` is empty"),
        ("/score", json!({"text_1": "a", "text_2": [1]}), "list of strings"),
        (
            "/score",
            json!({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0}),
            "truncate_prompt_tokens",
        ),
        (
            "/score",
            json!({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 1000}),
            "truncate_prompt_tokens",
        ),
        (
            "/score",
            json!({"text_1": "a", "text_2": "b", "truncate_prompt_tokens": "3"}),
            "expected i64",
        ),
        ("/score", json!({"text_1": "a", "text_2": "b".repeat(2000)}), "maximum context length"),
        ("/rerank", json!({"documents": ["a"]}), "`query` is required"),
        ("/rerank", json!({"query": "q", "documents": ["a"], "top_n": -1}), "`top_n`"),
        ("/rerank", json!({"query": "q", "documents": ["a"], "model": "nope"}), "does not exist"),
        ("/v1/embeddings", json!({"input": "a"}), "sequence classifier"),
    ] {
        let r = s.post(path, &body);
        assert!(r.status == 400 || r.status == 404, "{path} {body}: {}", r.status);
        assert!(r.text().contains(needle), "{path} {body}: {}", r.text());
    }
    assert_eq!(s.state.loaded().unwrap().engine.stats().num_running, 0);
    let generative = TestServer::start(default_config());
    for (path, body) in [
        ("/score", json!({"text_1": "a", "text_2": "b"})),
        ("/rerank", json!({"query": "q", "documents": ["d"]})),
    ] {
        let r = generative.post(path, &body);
        assert_eq!(r.status, 400, "{path}");
        assert!(r.text().contains("does not support"), "{path}: {}", r.text());
    }
}
