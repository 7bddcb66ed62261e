//! A server on loopback with the tiny llama3 fixture, and a minimal blocking HTTP/1.1 client
//! (one request per connection, chunked bodies decoded) so the tests see exactly the bytes a
//! client would.

#![allow(dead_code)] // each test binary uses a subset

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kiln_core::TokenId;
use kiln_engine::{EngineConfig, EngineCore, SchedulerConfig};
use kiln_kernels::Cpu;
use kiln_models::{LoadOptions, LoadedModel, load_model, load_model_with};
use kiln_server::{ServedModel, ServerConfig, ServerState};
use serde_json::Value;

/// `body` posted to `path`, which must answer 200; its JSON.
pub fn post_ok(server: &TestServer, path: &str, body: &Value) -> Value {
    let r = server.post(path, body);
    assert_eq!(r.status, 200, "{path} {body}: {}", r.text());
    r.json()
}

/// A JSON array of numbers as f32.
pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

/// Each `data` entry's `key` (`embedding`, or `/pooling`'s `data`) as floats, the entries'
/// `index` checked to count up from 0.
pub fn data_vectors(r: &Value, key: &str) -> Vec<Vec<f32>> {
    r["data"]
        .as_array()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["index"], i);
            d[key].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
        })
        .collect()
}

/// Rows within 1e-4 of `want` (a JSON list of lists), widths equal.
pub fn assert_rows_close(got: &[Vec<f32>], want: &Value, what: &str) {
    let want: Vec<Vec<f32>> = serde_json::from_value(want.clone()).unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what} {i}");
        let diff = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(diff <= 1e-4, "{what} {i}: max |diff| {diff}");
    }
}

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

/// An embedding fixture (`tests/fixtures/embedding`).
pub fn embedding_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/embedding").join(name)
}

/// An embedding fixture's `reference.json`.
pub fn embedding_reference(name: &str) -> Value {
    let path = embedding_fixture(name).join("reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A server of the embedding fixture `name` with an f32 KV cache (the references are f32), a
/// context of `max_model_len` and the prefix cache off (mean pooling reads every row).
pub fn pooling_server(name: &str, max_model_len: usize) -> TestServer {
    let engine = EngineConfig {
        kv_cache_dtype: kiln_engine::KvCacheDtype::F32,
        max_model_len: Some(max_model_len),
        scheduler: SchedulerConfig {
            max_num_batched_tokens: 64,
            enable_prefix_caching: false,
            ..SchedulerConfig::default()
        },
        ..engine_config()
    };
    TestServer::start_pooling(name, default_config(), engine)
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub state: Arc<ServerState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<JoinHandle<std::io::Result<()>>>,
}

pub fn default_config() -> ServerConfig {
    ServerConfig {
        served_model_names: vec!["tiny".into(), "tiny-alias".into()],
        disable_log_requests: true,
        keep_alive: Duration::from_millis(200),
        ..ServerConfig::default()
    }
}

pub fn engine_config() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_kv_blocks: 256,
        max_model_len: Some(256),
        scheduler: SchedulerConfig { max_num_batched_tokens: 64, ..SchedulerConfig::default() },
        ..EngineConfig::default()
    }
}

impl TestServer {
    pub fn start(config: ServerConfig) -> Self {
        Self::start_with(config, engine_config())
    }

    pub fn start_with(config: ServerConfig, engine: EngineConfig) -> Self {
        Self::start_with_template(config, engine, None)
    }

    /// [`Self::start_with`] with the operator's chat template instead of the fixture's.
    pub fn start_with_template(
        config: ServerConfig,
        engine: EngineConfig,
        template: Option<&kiln_server::chat_template::TemplateOverride>,
    ) -> Self {
        Self::start_model("llama3", config, engine, template)
    }

    /// A server of the fixture `name`.
    pub fn start_model(
        name: &str,
        config: ServerConfig,
        engine: EngineConfig,
        template: Option<&kiln_server::chat_template::TemplateOverride>,
    ) -> Self {
        let loaded = load_model(&fixture(name), &Arc::new(Cpu::new(1))).unwrap();
        Self::start_loaded(loaded, config, engine, template)
    }

    /// A server of the model directory `dir` (a fixture a test has changed).
    pub fn start_dir(dir: &std::path::Path, config: ServerConfig, engine: EngineConfig) -> Self {
        let loaded = load_model(dir, &Arc::new(Cpu::new(1))).unwrap();
        Self::start_loaded(loaded, config, engine, None)
    }

    /// A server of the embedding fixture `name` (`tests/fixtures/embedding`), loaded for
    /// pooling with the pooler its checkpoint declares.
    pub fn start_pooling(name: &str, config: ServerConfig, mut engine: EngineConfig) -> Self {
        let dir = embedding_fixture(name);
        let options = LoadOptions { pooling: true, ..LoadOptions::default() };
        let loaded = load_model_with(&dir, &options, &Arc::new(Cpu::new(1))).unwrap();
        // A cross-encoder scores its last token (an encoder's first) unnormalised; an
        // embedding model takes its checkpoint's pooler, else vLLM's default.
        let default = match loaded.classifier {
            Some(_) if loaded.model.config().encoder.is_some() => kiln_engine::PoolerConfig {
                pooling: kiln_engine::PoolingType::Cls,
                normalize: false,
            },
            Some(_) => kiln_engine::PoolerConfig {
                pooling: kiln_engine::PoolingType::Last,
                normalize: false,
            },
            None => kiln_engine::PoolerConfig::DECODER_DEFAULT,
        };
        engine.pooling =
            Some(kiln_engine::PoolerConfig::of_model(&dir).unwrap().unwrap_or(default));
        Self::start_loaded(loaded, config, engine, None)
    }

    fn start_loaded(
        loaded: LoadedModel<Cpu>,
        config: ServerConfig,
        mut engine: EngineConfig,
        template: Option<&kiln_server::chat_template::TemplateOverride>,
    ) -> Self {
        let state = ServerState::new(config);
        let LoadedModel { model, tokenizer, generation_defaults, classifier } = loaded;
        engine.classifier = classifier.map(Arc::new);
        engine.eos_token_ids = tokenizer.eos_token_ids().iter().map(|&t| TokenId(t)).collect();
        let served = ServedModel {
            core: EngineCore::new(model, engine).unwrap(),
            tokenizer,
            generation_defaults,
            builtin_template: None,
            model_fingerprint: Some(TEST_MODEL_FINGERPRINT),
        };
        let loaded = kiln_server::load(&state.config, served, template).unwrap();
        assert!(state.set_loaded(loaded));
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let (addr_tx, addr_rx) = std::sync::mpsc::channel();
        let server_state = Arc::clone(&state);
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                addr_tx.send(listener.local_addr().unwrap()).unwrap();
                kiln_server::serve(listener, server_state, async move {
                    let _ = rx.await;
                })
                .await
            })
        });
        let addr = addr_rx.recv().unwrap();
        Self { addr, state, shutdown: Some(tx), thread: Some(thread) }
    }

    /// Triggers the drain; returns the join handle of the server thread.
    pub fn begin_shutdown(&mut self) -> JoinHandle<std::io::Result<()>> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.thread.take().unwrap()
    }

    pub fn get(&self, path: &str) -> Response {
        request(self.addr, "GET", path, &[], None)
    }

    pub fn post(&self, path: &str, body: &Value) -> Response {
        request(self.addr, "POST", path, &[], Some(body.to_string().as_bytes()))
    }

    pub fn post_raw(&self, path: &str, body: &[u8]) -> Response {
        request(self.addr, "POST", path, &[], Some(body))
    }

    /// A metric's value from `/metrics` (the first sample whose name and labels start so).
    pub fn metric(&self, prefix: &str) -> f64 {
        let text = self.get("/metrics").text();
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {prefix} in\n{text}"))
    }

    /// Waits until `cond` holds (polling), or panics after 10 s.
    pub fn wait_for(&self, what: &str, mut cond: impl FnMut(&Self) -> bool) {
        let start = Instant::now();
        while !cond(self) {
            assert!(start.elapsed() < Duration::from_secs(10), "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[derive(Debug)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse_data(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|event| {
                event.lines().find_map(|l| l.strip_prefix("data: ").map(str::to_owned))
            })
            .collect()
    }
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Response {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        let _ = write!(head, "{k}: {v}\r\n");
    }
    if let Some(body) = body {
        let _ =
            write!(head, "Content-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    if let Some(body) = body {
        // The server may answer (413) before reading everything: ignore a reset here.
        let _ = stream.write_all(body);
    }
    let mut raw = Vec::new();
    let _ = stream.read_to_end(&mut raw);
    parse_response(&raw)
}

fn parse_response(raw: &[u8]) -> Response {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("no header end");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next().unwrap().split(' ').nth(1).unwrap().parse().unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':').map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned())))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    if chunked {
        body = dechunk(&body);
    }
    Response { status, headers, body }
}

fn dechunk(mut data: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(eol) = data.windows(2).position(|w| w == b"\r\n") {
        let size_text = String::from_utf8_lossy(&data[..eol]);
        let size =
            usize::from_str_radix(size_text.split(';').next().unwrap().trim(), 16).unwrap_or(0);
        if size == 0 {
            break;
        }
        let start = eol + 2;
        let end = (start + size).min(data.len());
        out.extend_from_slice(&data[start..end]);
        data = &data[(end + 2).min(data.len())..];
    }
    out
}

/// Opens the thinking at the generation prompt (as DeepSeek-R1's template does).
/// The model fingerprint every test server reports (KV transfer peers compare it).
pub const TEST_MODEL_FINGERPRINT: u64 = 0x6b69_6c6e;

const THINKING_TEMPLATE: &str = "{% for m in messages %}<|start_header_id|>{{ m.role }}\
<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}\
<|start_header_id|>assistant<|end_header_id|>\n\n<think>\n{% endif %}";

/// The llama3 fixture with `--reasoning-parser qwen3` and a template that opens the thinking,
/// so every output is thinking.
pub fn thinking_server() -> TestServer {
    let config = ServerConfig {
        reasoning_parser: Some(kiln_server::reasoning::ReasoningParser::Qwen3),
        ..default_config()
    };
    let template = kiln_server::chat_template::TemplateOverride::Inline(THINKING_TEMPLATE.into());
    TestServer::start_model("llama3", config, engine_config(), Some(&template))
}
