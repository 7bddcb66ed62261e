//! `/classify` on the three-label classifier fixture (`tests/fixtures/embedding/qwen3-classify`,
//! a `Qwen3ForSequenceClassification` with `id2label`): transformers' softmax per input and the
//! best label's name, from text and from token ids, alone or among others bit for bit; the
//! one-label cross-encoder classifies too; `/score` refuses several labels; bad requests and
//! models that do not classify get 400s naming the problem.

#![allow(clippy::unwrap_used)]

mod common;

use common::{TestServer, default_config, embedding_reference, floats, pooling_server, post_ok};
use serde_json::json;

#[test]
fn probabilities_and_labels_are_transformers_ones() {
    let s = pooling_server("qwen3-classify", 96);
    let r = embedding_reference("qwen3-classify");
    let labels: Vec<&str> =
        r["labels"].as_array().unwrap().iter().map(|l| l.as_str().unwrap()).collect();
    let texts = &r["texts"];
    let tokens: usize =
        r["ids"].as_array().unwrap().iter().map(|i| i.as_array().unwrap().len()).sum();
    for path in ["/classify", "/v1/classify"] {
        let got = post_ok(&s, path, &json!({"model": "tiny", "input": texts}));
        assert_eq!(got["object"], "list");
        assert_eq!(got["usage"]["prompt_tokens"], tokens);
        let data = got["data"].as_array().unwrap();
        assert_eq!(data.len(), texts.as_array().unwrap().len());
        for (i, (d, want)) in data.iter().zip(r["probs"].as_array().unwrap()).enumerate() {
            let (probs, want) = (floats(&d["probs"]), floats(want));
            assert_eq!(d["index"], i);
            assert_eq!(d["num_classes"], 3);
            for (g, w) in probs.iter().zip(&want) {
                assert!((g - w).abs() < 1e-4, "{path} input {i}: {probs:?} vs {want:?}");
            }
            let best = (0..3).max_by(|&a, &b| want[a].total_cmp(&want[b])).unwrap();
            assert_eq!(d["label"], labels[best], "{path} input {i}");
        }
        // Token ids give the same answer; an input alone the same bits.
        let by_ids = post_ok(&s, path, &json!({"input": r["ids"]}));
        assert_eq!(by_ids["data"], got["data"]);
        let alone = post_ok(&s, path, &json!({"input": texts[1]}));
        assert_eq!(alone["data"][0]["probs"], got["data"][1]["probs"]);
    }
    // Several labels are no score.
    let r = s.post("/score", &json!({"text_1": "a", "text_2": "b"}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("3 labels"), "{}", r.text());
    for (body, said) in [
        (json!({"input": []}), "empty"),
        (json!({"input": "x", "dimensions": 2}), "dimensions"),
        (json!({}), "required"),
    ] {
        let r = s.post("/classify", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.text().contains(said), "{body}: {}", r.text());
    }
}

#[test]
fn a_cross_encoder_classifies_and_other_models_refuse() {
    let s = pooling_server("qwen3-rerank", 96);
    let got = post_ok(&s, "/classify", &json!({"input": "hello"}));
    assert_eq!(got["data"][0]["label"], "LABEL_0");
    assert_eq!(got["data"][0]["num_classes"], 1);
    let p = got["data"][0]["probs"][0].as_f64().unwrap();
    assert!(p > 0.0 && p < 1.0, "{got}");
    let embed = pooling_server("qwen3-embed", 96);
    let r = embed.post("/classify", &json!({"input": "hello"}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("an embedding model"), "{}", r.text());
    let generative = TestServer::start(default_config());
    let r = generative.post("/classify", &json!({"input": "hello"}));
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("for generation"), "{}", r.text());
}
