//! LoRA adapters served by name (`--lora-modules`) on the llama3 fixture with two PEFT
//! adapters (`tests/fixtures/lora`): a request whose `model` names an adapter generates PEFT's
//! greedy tokens and is answered under that name; `/v1/models` lists the adapters with their
//! parent; an unknown name is a 404 naming `model`; a broken adapter stops the start with a
//! message naming it. At run time (when allowed), adapters load and unload while requests run:
//! no request is lost, a bad adapter is refused and changes nothing.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::path::PathBuf;

use common::{TestServer, default_config, engine_config};
use kiln_server::{BaseAdapter, LoraModule, LoraSettings, ServerConfig};
use serde_json::{Value, json};

fn lora_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/lora").join(name)
}

fn config() -> ServerConfig {
    ServerConfig {
        lora: LoraSettings {
            modules: vec![
                LoraModule {
                    name: "sql".into(),
                    path: lora_dir("llama3-r8-all"),
                    base_model_name: None,
                },
                LoraModule {
                    name: "chat".into(),
                    path: lora_dir("llama3-r4-attn"),
                    base_model_name: Some("meta/llama".into()),
                },
            ],
            max_rank: 16,
            max_loras: None,
            max_loaded: None,
            dtype: kiln_engine::LoraDtype::default(),
            runtime_updates: true,
            base_adapters: Vec::new(),
        },
        ..default_config()
    }
}

/// `(prompt ids, PEFT's greedy ids)` of the first case of adapter fixture `name`.
fn reference(name: &str) -> (Vec<u64>, Vec<u64>) {
    let text = std::fs::read_to_string(lora_dir(name).join("reference.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| {
        v["cases"][0][key].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
    };
    (ids("prompt_ids"), ids("greedy_ids"))
}

/// The text of `ids` as the server decodes it.
fn detokenize(server: &TestServer, ids: &[u64]) -> String {
    let r = server.post("/detokenize", &json!({"tokens": ids}));
    assert_eq!(r.status, 200, "{}", r.text());
    r.json()["prompt"].as_str().unwrap().to_owned()
}

#[test]
fn a_request_naming_an_adapter_generates_peft_s_tokens() {
    let server = TestServer::start_with(config(), engine_config());
    for (model, fixture) in [("sql", "llama3-r8-all"), ("chat", "llama3-r4-attn")] {
        let (prompt, greedy) = reference(fixture);
        let body = json!({"model": model, "prompt": prompt, "max_tokens": greedy.len(),
                          "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["model"], model);
        assert_eq!(v["choices"][0]["text"], detokenize(&server, &greedy), "{model}");
        // The base model, on the same prompt, says something else.
        let base = server.post(
            "/v1/completions",
            &json!({"model": "tiny", "prompt": prompt,
            "max_tokens": greedy.len(), "temperature": 0, "ignore_eos": true,
            "skip_special_tokens": false}),
        );
        assert_eq!(base.json()["model"], "tiny");
        assert_ne!(base.json()["choices"][0]["text"], v["choices"][0]["text"], "{model}");
    }
    // Chat too, answered under the adapter's name.
    let r = server.post(
        "/v1/chat/completions",
        &json!({"model": "chat", "max_tokens": 3,
        "messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["model"], "chat");
}

/// llama-server's `--lora FILE` / `--lora-scaled FILE:SCALE`: llama.cpp's GGUF conversion of
/// `sql`, given twice at scale 0.5, applies to every request of the base model and gives PEFT's
/// tokens; the same file serves by name too; `GET /lora-adapters` lists the files; a
/// per-request `lora` field and `POST /lora-adapters` are refused.
#[test]
fn llama_server_lora_files_apply_to_every_base_model_request() {
    let file = lora_dir("llama3-r8-all").join("adapter-f32.gguf");
    let mut config = config();
    config.lora.runtime_updates = false;
    config.lora.modules =
        vec![LoraModule { name: "sql-gguf".into(), path: file.clone(), base_model_name: None }];
    config.lora.base_adapters = vec![
        BaseAdapter { path: file.clone(), scale: 0.5 },
        BaseAdapter { path: file.clone(), scale: 0.5 },
    ];
    let server = TestServer::start_with(config, engine_config());
    let (prompt, greedy) = reference("llama3-r8-all");
    let want = detokenize(&server, &greedy);
    for model in [Some("tiny"), None, Some("sql-gguf")] {
        let mut body = json!({"prompt": prompt, "max_tokens": greedy.len(), "temperature": 0,
                              "ignore_eos": true, "skip_special_tokens": false});
        if let Some(model) = model {
            body["model"] = json!(model);
        }
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["model"], model.unwrap_or("tiny"));
        assert_eq!(r.json()["choices"][0]["text"], want, "{model:?}");
    }
    let listed = server.get("/lora-adapters").json();
    let path = file.display().to_string();
    assert_eq!(
        listed,
        json!([{"id": 0, "path": path, "scale": 0.5}, {"id": 1, "path": path, "scale": 0.5}])
    );
    let r = server.post("/lora-adapters", &json!([{"id": 0, "scale": 1.0}]));
    assert_eq!(r.status, 400, "{}", r.text());
    let body = json!({"prompt": "hi", "max_tokens": 1, "lora": [{"id": 0, "scale": 1.0}]});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("per-request LoRA scales"), "{}", r.text());
}

/// `--max-cpu-loras 1`: of three adapters (two PEFT directories and a GGUF file) one is loaded
/// at a time, the others parked; requests of each, one after another and then all at once,
/// get their adapter's PEFT tokens while the engine never holds more than one adapter; a
/// parked adapter is listed and unloads at once.
#[test]
fn max_cpu_loras_keeps_one_adapter_loaded_and_swaps_them_on_demand() {
    let mut config = config();
    config.lora.max_loaded = Some(1);
    let gguf = lora_dir("llama3-r8-all").join("adapter-f32.gguf");
    config.lora.modules.push(LoraModule {
        name: "sql-gguf".into(),
        path: gguf,
        base_model_name: None,
    });
    let server = TestServer::start_with(config, engine_config());
    let ids: Vec<String> = server.get("/v1/models").json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["tiny", "tiny-alias", "sql", "chat", "sql-gguf"]);
    let loaded = server.state.loaded().unwrap();
    let cases =
        [("sql", "llama3-r8-all"), ("chat", "llama3-r4-attn"), ("sql-gguf", "llama3-r8-all")];
    let wanted: Vec<(&str, Vec<u64>, String)> = cases
        .iter()
        .map(|&(model, fixture)| {
            let (prompt, greedy) = reference(fixture);
            (model, prompt, detokenize(&server, &greedy))
        })
        .collect();
    let generate = |model: &str, prompt: &[u64]| {
        let body = json!({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                          "ignore_eos": true, "skip_special_tokens": false});
        let r = server.post("/v1/completions", &body);
        assert_eq!(r.status, 200, "{model}: {}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    for _ in 0..2 {
        for (model, prompt, want) in &wanted {
            assert_eq!(&generate(model, prompt), want, "{model} alone");
            assert!(loaded.engine.stats().adapters.loaded.len() <= 1);
        }
    }
    std::thread::scope(|scope| {
        for i in 0..6 {
            let (model, prompt, want) = &wanted[i % wanted.len()];
            let generate = &generate;
            scope.spawn(move || assert_eq!(&generate(model, prompt), want, "{model} at once"));
        }
        for _ in 0..50 {
            assert!(loaded.engine.stats().adapters.loaded.len() <= 1);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
    });
    // A parked adapter unloads at once and is gone.
    let parked = ["sql", "chat", "sql-gguf"]
        .into_iter()
        .find(|name| loaded.lora.resolve(name).is_none())
        .unwrap();
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": parked}));
    assert_eq!(r.status, 200, "{}", r.text());
    let r =
        server.post("/v1/completions", &json!({"model": parked, "prompt": "hi", "max_tokens": 1}));
    assert_eq!(r.status, 404);
}

#[test]
fn models_lists_adapters_and_unknown_names_are_404() {
    let server = TestServer::start_with(config(), engine_config());
    let v = server.get("/v1/models").json();
    let cards = v["data"].as_array().unwrap();
    let ids: Vec<&str> = cards.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "tiny-alias", "sql", "chat"]);
    assert_eq!(cards[0]["parent"], Value::Null);
    assert_eq!(cards[2]["parent"], "tiny");
    assert_eq!(cards[2]["root"], lora_dir("llama3-r8-all").display().to_string());
    assert_eq!(cards[3]["parent"], "meta/llama");
    assert_eq!(server.get("/v1/models/sql").json()["id"], "sql");
    let r =
        server.post("/v1/completions", &json!({"model": "nope", "prompt": "hi", "max_tokens": 1}));
    assert_eq!(r.status, 404);
    assert_eq!(r.json()["error"]["param"], "model");
}

#[test]
#[should_panic(expected = "--lora-modules bad")]
fn a_broken_adapter_stops_the_start_naming_it() {
    let mut config = config();
    config.lora.modules.push(LoraModule {
        name: "bad".into(),
        path: lora_dir("llama3-r8-all").join("missing"),
        base_model_name: None,
    });
    TestServer::start_with(config, engine_config());
}

/// A completion of `max_tokens` greedy tokens under `model`, from a thread.
fn complete_in_thread(
    server: &TestServer,
    model: &str,
    max_tokens: usize,
) -> std::thread::JoinHandle<(u16, Value)> {
    let addr = server.addr;
    let body = json!({"model": model, "prompt": [5, 6, 7, 8], "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true});
    std::thread::spawn(move || {
        let body = body.to_string();
        let r = common::request(addr, "POST", "/v1/completions", &[], Some(body.as_bytes()));
        (r.status, r.json())
    })
}

#[test]
fn adapters_load_and_unload_at_run_time_and_lose_no_request() {
    let long = kiln_engine::EngineConfig {
        num_kv_blocks: 640,
        max_model_len: Some(512),
        ..engine_config()
    };
    let server = TestServer::start_with(config(), long);
    // Requests of `sql` run while another adapter is loaded and `sql` is unloaded.
    let running: Vec<_> = (0..4).map(|_| complete_in_thread(&server, "sql", 500)).collect();
    let started = std::time::Instant::now();
    while server.metric("kiln:num_requests_running") < 1.0 {
        assert!(started.elapsed().as_secs() < 30, "the requests never started");
        std::thread::yield_now();
    }
    let load = json!({"lora_name": "sql2", "lora_path": lora_dir("llama3-r4-attn")});
    let r = server.post("/v1/load_lora_adapter", &load);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), "Success: LoRA adapter 'sql2' added successfully.");
    // The new adapter serves at once, with its PEFT tokens.
    let (prompt, greedy) = reference("llama3-r4-attn");
    let body = json!({"model": "sql2", "prompt": prompt, "max_tokens": greedy.len(),
                      "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.json()["choices"][0]["text"], detokenize(&server, &greedy));
    let busy = server.metric("kiln:num_requests_running");
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "sql"}));
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.text(), "Success: LoRA adapter 'sql' removed successfully.");
    // The unload answered only once the adapter's requests had ended.
    assert_eq!(server.metric("kiln:num_requests_running"), 0.0, "{busy} were running");
    for handle in running {
        let (status, v) = handle.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 500, "{v}");
        assert_eq!(v["model"], "sql");
    }
    // Gone: 404 by name, not listed; the name can be loaded again.
    let r =
        server.post("/v1/completions", &json!({"model": "sql", "prompt": "hi", "max_tokens": 1}));
    assert_eq!(r.status, 404, "{}", r.text());
    let models = server.get("/v1/models").json();
    let ids: Vec<&str> =
        models["data"].as_array().unwrap().iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["tiny", "tiny-alias", "chat", "sql2"]);
    let r = server.post("/v1/unload_lora_adapter", &json!({"lora_name": "sql"}));
    assert_eq!(r.status, 404, "{}", r.text());
    let again = json!({"lora_name": "sql", "lora_path": lora_dir("llama3-r8-all")});
    assert_eq!(server.post("/v1/load_lora_adapter", &again).status, 200);
    let (prompt, greedy) = reference("llama3-r8-all");
    let body = json!({"model": "sql", "prompt": prompt, "max_tokens": greedy.len(),
                      "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.json()["choices"][0]["text"], detokenize(&server, &greedy));
    // The metrics name the adapters in use (none now).
    let metrics = server.get("/metrics").text();
    assert!(metrics.contains("kiln:lora_requests_info{"), "{metrics}");
    assert!(metrics.contains("running_lora_adapters=\"\""), "{metrics}");
}

#[test]
fn bad_loads_are_refused_and_the_server_keeps_serving() {
    let server = TestServer::start_with(config(), engine_config());
    let dir = std::env::temp_dir().join(format!("kiln-lora-server-{}", std::process::id()));
    let cut = dir.join("cut");
    std::fs::create_dir_all(&cut).unwrap();
    for file in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(lora_dir("llama3-r8-all").join(file), cut.join(file)).unwrap();
    }
    let weights = cut.join("adapter_model.safetensors");
    let len = std::fs::metadata(&weights).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&weights).unwrap().set_len(len / 2).unwrap();
    let huge = dir.join("huge");
    std::fs::create_dir_all(&huge).unwrap();
    std::fs::copy(weights, huge.join("adapter_model.safetensors")).unwrap();
    let config_text =
        std::fs::read_to_string(lora_dir("llama3-r8-all").join("adapter_config.json"));
    let mut config_json: Value = serde_json::from_str(&config_text.unwrap()).unwrap();
    config_json["r"] = json!(4096);
    std::fs::write(huge.join("adapter_config.json"), config_json.to_string()).unwrap();
    for (body, status, expected) in [
        (json!({"lora_name": "cut", "lora_path": cut}), 400, "LoRA adapter 'cut'"),
        (json!({"lora_name": "huge", "lora_path": huge}), 400, "--max-lora-rank"),
        (json!({"lora_name": "gone", "lora_path": dir.join("missing")}), 400, "'gone'"),
        (json!({"lora_name": "sql", "lora_path": lora_dir("llama3-r4-attn")}), 400, "already"),
        (json!({"lora_name": "tiny", "lora_path": lora_dir("llama3-r4-attn")}), 400, "already"),
        (json!({"lora_name": "", "lora_path": "/x"}), 400, "non-empty"),
        (json!({"lora_name": "x", "lora_path": "/x", "load_inplace": true}), 400, "load_inplace"),
        (json!({"lora_name": "x", "lora_path": "/x", "scale": 2}), 400, "scale"),
    ] {
        let r = server.post("/v1/load_lora_adapter", &body);
        assert_eq!(r.status, status, "{body}: {}", r.text());
        assert!(r.text().contains(expected), "{body}: {}", r.text());
    }
    let r =
        server.post("/v1/unload_lora_adapter", &json!({"lora_name": "sql", "lora_int_id": 999}));
    assert_eq!(r.status, 404, "{}", r.text());
    // Nothing changed: the adapters and the base model serve as before, the names are free.
    let (prompt, greedy) = reference("llama3-r8-all");
    let body = json!({"model": "sql", "prompt": prompt, "max_tokens": greedy.len(),
                      "temperature": 0, "ignore_eos": true, "skip_special_tokens": false});
    let r = server.post("/v1/completions", &body);
    assert_eq!(r.json()["choices"][0]["text"], detokenize(&server, &greedy));
    let models = server.get("/v1/models").json();
    assert_eq!(models["data"].as_array().unwrap().len(), 4);
    let ok = json!({"lora_name": "cut", "lora_path": lora_dir("llama3-r4-attn")});
    assert_eq!(server.post("/v1/load_lora_adapter", &ok).status, 200);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn run_time_updates_are_off_unless_allowed() {
    let mut config = config();
    config.lora.runtime_updates = false;
    let server = TestServer::start_with(config, engine_config());
    let body = json!({"lora_name": "x", "lora_path": lora_dir("llama3-r4-attn")});
    assert_eq!(server.post("/v1/load_lora_adapter", &body).status, 404);
    assert_eq!(server.post("/v1/unload_lora_adapter", &json!({"lora_name": "sql"})).status, 404);
    assert_eq!(server.get("/v1/models").json()["data"].as_array().unwrap().len(), 4);
}
