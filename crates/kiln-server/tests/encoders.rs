//! Encoder models through HTTP (`tests/fixtures/embedding`, made by
//! `scripts/fixtures/make_encoder_fixtures.py`): BERT and XLM-RoBERTa embedding models give
//! sentence-transformers' vectors on `/v1/embeddings`, each input's the same alone as among
//! others; their cross-encoders give `CrossEncoder`'s scores on `/score` and `/rerank`, also
//! with the pairs cut by `truncate_prompt_tokens` (transformers' `longest_first`);
//! `truncate_prompt_tokens` keeps an encoder's first tokens and its `[CLS]` / `[SEP]`; inputs
//! past the 128 positions, or empty, are refused by name.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, assert_rows_close, data_vectors, floats, post_ok};
use serde_json::json;

fn server(name: &str) -> TestServer {
    // Below the encoder's 128 positions: the engine raises the step's budget to a whole
    // prompt by itself.
    common::pooling_server(name, 128)
}

#[test]
fn encoder_embeddings_are_sentence_transformers_vectors() {
    for name in ["bert-mean", "xlmr-cls"] {
        let s = server(name);
        let r = common::embedding_reference(name);
        let texts = &r["texts"];
        let got =
            data_vectors(&post_ok(&s, "/v1/embeddings", &json!({"input": texts})), "embedding");
        assert_rows_close(&got, &r["embeddings"], name);
        for (i, text) in texts.as_array().unwrap().iter().enumerate() {
            let alone =
                data_vectors(&post_ok(&s, "/v1/embeddings", &json!({"input": text})), "embedding");
            assert_eq!(alone[0], got[i], "{name}: input {i} alone");
        }
        let by_ids = data_vectors(
            &post_ok(&s, "/v1/embeddings", &json!({"input": r["prompt_ids"]})),
            "embedding",
        );
        assert_eq!(by_ids, got, "{name}: token ids");
        let short = post_ok(&s, "/v1/embeddings", &json!({"input": texts, "dimensions": 16}));
        assert_rows_close(&data_vectors(&short, "embedding"), &r["embeddings_16"], name);
    }
}

#[test]
fn encoder_truncation_keeps_the_first_tokens_and_the_special_ones() {
    let s = server("xlmr-cls");
    let r = common::embedding_reference("xlmr-cls");
    let ids: Vec<u64> = serde_json::from_value(r["prompt_ids"][3].clone()).unwrap();
    let text = &r["texts"][3];
    let cut = post_ok(&s, "/v1/embeddings", &json!({"input": text, "truncate_prompt_tokens": 10}));
    assert_eq!(cut["usage"]["prompt_tokens"], 10);
    // `<s>`, the text's first 8 tokens, `</s>`: what the tokenizer's right truncation gives.
    let mut want_ids = ids[..9].to_vec();
    want_ids.push(*ids.last().unwrap());
    let by_ids = post_ok(&s, "/v1/embeddings", &json!({"input": want_ids}));
    assert_eq!(data_vectors(&cut, "embedding"), data_vectors(&by_ids, "embedding"));
    let long = text.as_str().unwrap().repeat(3);
    let r = s.post("/v1/embeddings", &json!({"input": long}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("maximum context length is 128"), "{}", r.text());
    let whole =
        post_ok(&s, "/v1/embeddings", &json!({"input": long, "truncate_prompt_tokens": -1}));
    assert_eq!(whole["usage"]["prompt_tokens"], 128);
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let r = s.post("/v1/embeddings", &chat);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("not chat messages"), "{}", r.text());
    // Refused although the tokenizer would give `<s> </s>`.
    for input in [json!(""), json!(["x", ""]), json!([[]])] {
        let r = s.post("/v1/embeddings", &json!({ "input": input }));
        assert_eq!(r.status, 400, "{input}: {}", r.text());
        assert!(r.text().contains("is empty"), "{input}: {}", r.text());
    }
}

#[test]
fn encoder_cross_encoders_score_as_sentence_transformers_does() {
    for name in ["bert-rerank", "xlmr-rerank"] {
        let s = server(name);
        let r = common::embedding_reference(name);
        let (query, documents) = (&r["query"], &r["documents"]);
        let want = floats(&r["scores"]);
        let got = post_ok(&s, "/score", &json!({"text_1": query, "text_2": documents}));
        for (i, w) in want.iter().enumerate() {
            let g = got["data"][i]["score"].as_f64().unwrap() as f32;
            assert!((g - w).abs() < 1e-4, "{name} pair {i}: {g} vs {w}");
        }
        let ranked = post_ok(&s, "/rerank", &json!({"query": query, "documents": documents}));
        let best = want.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        assert_eq!(ranked["results"][0]["index"], best, "{name}: {ranked}");
        let refused = s.post("/v1/embeddings", &json!({"input": "a cross-encoder embeds nothing"}));
        assert_eq!(refused.status, 400, "{name}: {}", refused.text());
        // Pairs cut to 24 tokens: the scores of the pairs transformers cuts the same way.
        let k = &r["truncate_prompt_tokens"];
        let tokens: usize = r["truncated_pair_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_array().unwrap().len())
            .sum();
        let body = json!({"text_1": query, "text_2": documents, "truncate_prompt_tokens": k});
        let cut = post_ok(&s, "/score", &body);
        assert_eq!(cut["usage"]["prompt_tokens"], tokens, "{name}");
        for (i, w) in floats(&r["truncated_scores"]).iter().enumerate() {
            let g = cut["data"][i]["score"].as_f64().unwrap() as f32;
            assert!((g - w).abs() < 1e-4, "{name} cut pair {i}: {g} vs {w}");
        }
        let body = json!({"query": query, "documents": documents, "truncate_prompt_tokens": k});
        let ranked = post_ok(&s, "/rerank", &body);
        assert_eq!(ranked["usage"]["total_tokens"], tokens, "{name}");
    }
}

#[test]
fn an_embedding_model_scores_truncated_texts_by_cosine() {
    // Each text cut as /v1/embeddings cuts an input: the cosine of those vectors.
    let s = server("xlmr-cls");
    let r = common::embedding_reference("xlmr-cls");
    let texts = &r["texts"];
    let body = json!({"text_1": texts[0], "text_2": texts[3], "truncate_prompt_tokens": 10});
    let score = post_ok(&s, "/score", &body)["data"][0]["score"].as_f64().unwrap() as f32;
    let cut = json!({"input": [texts[0], texts[3]], "truncate_prompt_tokens": 10});
    let v = data_vectors(&post_ok(&s, "/v1/embeddings", &cut), "embedding");
    let dot: f32 = v[0].iter().zip(&v[1]).map(|(a, b)| a * b).sum();
    let norms = v[0].iter().map(|x| x * x).sum::<f32>().sqrt()
        * v[1].iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!((score - dot / norms).abs() < 1e-6, "{score} vs {}", dot / norms);
}
