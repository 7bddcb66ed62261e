//! Prefill/decode disaggregation (`kiln serve --kv-role prefill | decode | both`): a prefill
//! worker computes a prompt and keeps its KV blocks pinned; a decode worker fetches the blocks
//! its own prefix cache lacks over TCP and decodes. The request and response fields are vLLM's
//! NIXL connector's `kv_transfer_params`, so vLLM's proxy and router orchestrate kiln workers:
//!
//! 1. the orchestrator sends the request to a prefill worker with `max_tokens: 1`, `stream:
//!    false` and `kv_transfer_params: {"do_remote_decode": true}`;
//! 2. the prefill worker answers as usual plus a top-level `kv_transfer_params`:
//!    `do_remote_prefill: true`, `do_remote_decode: false`, `remote_engine_id`, `remote_host`,
//!    `remote_port` (its transfer listener), `remote_block_ids` (its pinned blocks, one per
//!    full prompt block), `remote_request_id` (the pin) and `tp_size: 1`;
//! 3. the orchestrator sends the original request to a decode worker with those params; the
//!    decode worker fetches the blocks, imports them into its prefix cache, and runs the request
//!    as any other, which hits them.
//!
//! What differs from vLLM's NIXL: only full prompt blocks move (the decode worker computes the
//! last partial block and the prompt's last token itself, fewer than a block of tokens); blocks
//! the decode worker's prefix cache already holds are not fetched; a failed fetch (the prefill
//! worker gone, refused, or a corrupted frame) is logged and counted, and the decode worker
//! computes the prompt itself (vLLM's `kv_load_failure_policy: recompute`). One prompt and
//! `n: 1` per transfer, the base model only (not a LoRA adapter), `/v1/completions` and
//! `/v1/chat/completions`.
//!
//! The wire protocol (`wire`) is kiln's own: framed, checksummed, versioned, mutually
//! authenticated by a shared secret (`--kv-transfer-secret`, else the first `--api-key`), with
//! the KV geometry (model files, backend, KV dtype, block size, shapes) compared at the
//! handshake so a mismatch is refused by name. The listener is `listener`, the client `fetch`.

mod fetch;
mod listener;
pub mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::TokenId;
use kiln_engine::{KvGeometry, KvImport, KvPin, KvPort};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::generate::ChoiceResult;
use crate::metrics::Metrics;
use crate::metrics::kv_transfer::RECEIVED;
use crate::sequence::SequenceSpec;
use crate::state::Loaded;
use crate::validate::GenerationSpec;

/// What a server does in a disaggregated deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvRole {
    /// Computes prompts and hands their KV out (`do_remote_decode` requests).
    Prefill,
    /// Fetches prompts' KV from prefill workers (`do_remote_prefill` requests).
    Decode,
    /// Both (vLLM's `kv_both`).
    Both,
}

impl std::fmt::Display for KvRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Both => "both",
        })
    }
}

impl KvRole {
    fn exports(self) -> bool {
        matches!(self, Self::Prefill | Self::Both)
    }
    fn imports(self) -> bool {
        matches!(self, Self::Decode | Self::Both)
    }
}

/// `--kv-role` and its settings.
#[derive(Clone, Debug)]
pub struct KvTransferConfig {
    pub role: KvRole,
    /// Where the transfer listener binds (prefill and both).
    pub listen: SocketAddr,
    /// The host decode workers are told to connect to (`remote_host`); `None`: the listen
    /// address's IP, which must then not be unspecified (`0.0.0.0`).
    pub advertise_host: Option<String>,
    /// The shared secret both sides prove they know.
    pub secret: Vec<u8>,
    /// How long a prefill worker keeps an unfetched prompt's KV.
    pub pin_timeout: Duration,
}

/// A running server's transfer side (`Loaded::kv_transfer`).
pub struct KvTransfer {
    role: KvRole,
    engine_id: String,
    /// The secret and geometry a fetch proves and expects (shared with release tasks).
    importer: Arc<fetch::Importer>,
    /// `(remote_host, remote_port)` told to decode workers (exporting roles).
    advertised: Option<(String, u16)>,
    port: KvPort,
    metrics: Arc<Metrics>,
}

impl KvTransfer {
    /// Starts the transfer side after the engine thread: the listener for exporting roles.
    /// `geometry` is the engine's ([`kiln_engine::EngineCore::kv_geometry`]).
    pub(crate) fn start(
        config: &KvTransferConfig,
        geometry: KvGeometry,
        port: KvPort,
        metrics: Arc<Metrics>,
    ) -> Result<Self, String> {
        let engine_id = format!("kiln-{:016x}", u64::from_le_bytes(random_bytes()?));
        let advertised = if config.role.exports() {
            let exporter = listener::Exporter {
                secret: config.secret.clone(),
                geometry: geometry.clone(),
                engine_id: engine_id.clone(),
                port: port.clone(),
                metrics: Arc::clone(&metrics),
            };
            let bound = listener::start(config.listen, exporter)?;
            let host = match &config.advertise_host {
                Some(h) => h.clone(),
                None if bound.ip().is_unspecified() => {
                    return Err(format!(
                        "the KV transfer listener binds {bound}: give --kv-transfer-host, the \
                         address decode workers reach this server at"
                    ));
                }
                None => bound.ip().to_string(),
            };
            tracing::info!("KV transfer: {engine_id} serves pinned KV on {bound} (as {host})");
            Some((host, bound.port()))
        } else {
            None
        };
        Ok(Self {
            role: config.role,
            engine_id,
            importer: Arc::new(fetch::Importer { secret: config.secret.clone(), geometry }),
            advertised,
            port,
            metrics,
        })
    }

    /// This engine's KV geometry, as a handshake presents it.
    pub fn geometry(&self) -> &KvGeometry {
        &self.importer.geometry
    }

    /// The id decode workers name this engine by (`remote_engine_id`).
    pub fn engine_id(&self) -> &str {
        &self.engine_id
    }

    /// The transfer listener's port (exporting roles).
    pub fn listen_port(&self) -> Option<u16> {
        self.advertised.as_ref().map(|(_, p)| *p)
    }

    /// The response's `kv_transfer_params` for a finished prefill's pin.
    pub(crate) fn response_params(&self, pin: &KvPin) -> Value {
        let (host, port) = self.advertised.clone().unwrap_or_default();
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.engine_id,
            "remote_host": host,
            "remote_port": port,
            "remote_block_ids": pin.blocks,
            "remote_request_id": pin_name(pin.id),
            "tp_size": 1,
        })
    }

    /// Fetches what this engine lacks of `remote`'s pin for `prompt` (and releases the pin);
    /// `None` when the fetch failed (logged and counted: the request computes its prompt).
    pub(crate) async fn import(
        &self,
        remote: &RemotePrefill,
        prompt: &[TokenId],
    ) -> Option<KvImport> {
        // No more blocks than the prompt has full ones before its last token, whatever the
        // params claim (they come with the request).
        let bs = self.importer.geometry.block_size as usize;
        let num_blocks = remote.num_blocks.min(prompt.len().saturating_sub(1) / bs.max(1));
        let remote = &RemotePrefill { num_blocks, ..remote.clone() };
        // Armed until the fetch completes (which releases the pin): a failed or abandoned
        // fetch releases it from a task of its own.
        let guard = fetch::ReleaseGuard::new(&self.importer, remote);
        let rx = self.port.cached_blocks(prompt.to_vec());
        let cached = tokio::task::spawn_blocking(move || rx.recv().ok()).await.ok().flatten()?;
        let first = cached.min(remote.num_blocks);
        let start = Instant::now();
        match fetch::fetch(&self.importer, remote, prompt, first).await {
            Ok(data) => {
                guard.disarm();
                let blocks = remote.num_blocks - first;
                self.metrics.kv_transfer.on_moved(&RECEIVED, blocks, data.len());
                self.metrics.kv_transfer.on_fetched(start.elapsed().as_secs_f64());
                Some(KvImport { first_block: first, data })
            }
            Err(e) => {
                self.metrics.kv_transfer.on_failure(&RECEIVED);
                tracing::warn!(
                    "KV transfer from {}:{} failed ({e}); computing the prompt here",
                    remote.host,
                    remote.port
                );
                None
            }
        }
    }
}

fn random_bytes() -> Result<[u8; 8], String> {
    let mut b = [0u8; 8];
    getrandom::fill(&mut b).map_err(|e| format!("no random numbers: {e}"))?;
    Ok(b)
}

fn pin_name(pin: u64) -> String {
    format!("kiln-pin-{pin:016x}")
}

/// Where a decode worker fetches a prompt's KV (the `kv_transfer_params` of a
/// `do_remote_prefill` request).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemotePrefill {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
    pub pin: u64,
    /// Prompt blocks the pin holds.
    pub num_blocks: usize,
}

/// What a request's `kv_transfer_params` ask for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TransferAsk {
    /// Prefill and pin the prompt's KV for a decode worker.
    Export,
    /// Fetch the prompt's KV from a prefill worker, then decode.
    Import(RemotePrefill),
}

const PARAM: &str = "kv_transfer_params";
const KNOWN_KEYS: &[&str] = &[
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_request_id",
    "tp_size",
];

fn bad(message: String) -> ApiError {
    ApiError::bad_param(PARAM, message)
}

/// Parses `kv_transfer_params` (`null`, or both flags false: no transfer). Unknown keys are
/// refused by name; `tp_size` must be 1.
pub fn parse_params(value: &Value) -> Result<Option<TransferAsk>, ApiError> {
    let map = match value {
        Value::Null => return Ok(None),
        Value::Object(m) => m,
        _ => return Err(bad(format!("`{PARAM}` must be an object"))),
    };
    if let Some(key) = map.keys().find(|k| !KNOWN_KEYS.contains(&k.as_str())) {
        return Err(bad(format!("`{PARAM}.{key}` is not supported")));
    }
    let flag = |key: &str| match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(bad(format!("`{PARAM}.{key}` must be a boolean"))),
    };
    if let Some(tp) = map.get("tp_size").filter(|v| !v.is_null())
        && tp.as_u64() != Some(1)
    {
        return Err(bad(format!("`{PARAM}.tp_size` must be 1 (kiln runs one engine per worker)")));
    }
    match (flag("do_remote_decode")?, flag("do_remote_prefill")?) {
        (false, false) => Ok(None),
        (true, true) => {
            Err(bad(format!("`{PARAM}` asks for both do_remote_decode and do_remote_prefill")))
        }
        (true, false) => Ok(Some(TransferAsk::Export)),
        (false, true) => parse_remote(map).map(|r| Some(TransferAsk::Import(r))),
    }
}

fn parse_remote(map: &serde_json::Map<String, Value>) -> Result<RemotePrefill, ApiError> {
    let string = |key: &str| match map.get(key) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= 255 => Ok(s.clone()),
        _ => Err(bad(format!("`{PARAM}.{key}` must be a non-empty string (do_remote_prefill)"))),
    };
    let engine_id = string("remote_engine_id")?;
    let host = string("remote_host")?;
    let port = map
        .get("remote_port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p != 0)
        .ok_or_else(|| bad(format!("`{PARAM}.remote_port` must be a port number")))?;
    let request_id = string("remote_request_id")?;
    let pin = request_id
        .strip_prefix("kiln-pin-")
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .ok_or_else(|| {
            bad(format!(
                "`{PARAM}.remote_request_id` {request_id:?} does not name a kiln prefill's KV"
            ))
        })?;
    // A flat list, or vLLM's list of one list per KV cache group.
    let ids = match map.get("remote_block_ids") {
        Some(Value::Array(items)) if items.len() == 1 && items[0].is_array() => items[0].as_array(),
        Some(Value::Array(items)) => Some(items),
        _ => None,
    };
    let ids = ids
        .filter(|ids| ids.iter().all(Value::is_u64))
        .ok_or_else(|| bad(format!("`{PARAM}.remote_block_ids` must be a list of block ids")))?;
    Ok(RemotePrefill { engine_id, host, port, pin, num_blocks: ids.len() })
}

/// Readies a request's transfer, if it asks for one: checked against this server (a 400 names
/// what it cannot do), and for an import the prompt's KV fetched into its one sequence's spec
/// (a failed fetch leaves it to compute the prompt).
pub(crate) async fn ready_sequences(
    loaded: &Loaded,
    spec: &GenerationSpec,
    num_prompts: usize,
    seq_specs: &mut [SequenceSpec],
) -> Result<(), ApiError> {
    let Some(ask) = &spec.kv_transfer else { return Ok(()) };
    let shape = (num_prompts, spec.n, spec.stream, spec.adapter.slot);
    check(loaded.kv_transfer.as_ref(), ask, shape)?;
    if let (TransferAsk::Import(remote), Some(transfer), [seq]) =
        (ask, &loaded.kv_transfer, seq_specs)
    {
        seq.import = transfer.import(remote, seq.request.prompt()).await;
    }
    Ok(())
}

/// The `kv_transfer_params` of a whole response to a `do_remote_decode` request: its pin's
/// (`null` when it pinned nothing, a stop string having cut it short); `None` for other
/// requests.
pub(crate) fn response_field(
    loaded: &Loaded,
    spec: &GenerationSpec,
    results: &[ChoiceResult],
) -> Option<Value> {
    if spec.kv_transfer != Some(TransferAsk::Export) {
        return None;
    }
    let pin = results.iter().find_map(|r| r.kv_pin.as_ref());
    Some(match (pin, &loaded.kv_transfer) {
        (Some(pin), Some(transfer)) => transfer.response_params(pin),
        _ => Value::Null,
    })
}

/// Checks that this server can serve `ask` for a request of `num_prompts` prompts, `n`
/// samples each, streamed or not, on LoRA slot `adapter`.
pub(crate) fn check(
    transfer: Option<&KvTransfer>,
    ask: &TransferAsk,
    (num_prompts, n, stream, adapter): (usize, usize, bool, u32),
) -> Result<(), ApiError> {
    let Some(transfer) = transfer else {
        return Err(bad(format!(
            "`{PARAM}`: this server does not transfer KV (start it with --kv-role)"
        )));
    };
    let role_ok = match ask {
        TransferAsk::Export => transfer.role.exports(),
        TransferAsk::Import(_) => transfer.role.imports(),
    };
    let why = if !role_ok {
        Some(match ask {
            TransferAsk::Export => "do_remote_decode needs --kv-role prefill or both",
            TransferAsk::Import(_) => "do_remote_prefill needs --kv-role decode or both",
        })
    } else if num_prompts != 1 || n != 1 {
        Some("a KV transfer is for one prompt and `n: 1`")
    } else if adapter != 0 {
        Some("a KV transfer is not supported with a LoRA adapter")
    } else if stream && *ask == TransferAsk::Export {
        Some("do_remote_decode needs `stream: false` (its answer carries the params)")
    } else {
        None
    };
    match why {
        Some(why) => Err(bad(format!("`{PARAM}`: {why}"))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_parse_as_vllm_sends_them() {
        assert_eq!(parse_params(&Value::Null).unwrap(), None);
        let neutral = json!({"do_remote_decode": false, "do_remote_prefill": false,
            "remote_engine_id": null, "remote_block_ids": null, "remote_host": null,
            "remote_port": null});
        assert_eq!(parse_params(&neutral).unwrap(), None);
        assert_eq!(
            parse_params(&json!({"do_remote_decode": true})).unwrap(),
            Some(TransferAsk::Export)
        );
        let remote = json!({"do_remote_prefill": true, "do_remote_decode": false,
            "remote_engine_id": "kiln-1", "remote_host": "10.0.0.2", "remote_port": 7600,
            "remote_block_ids": [[4, 5, 6]], "remote_request_id": "kiln-pin-00000000000000ff",
            "tp_size": 1});
        let want = RemotePrefill {
            engine_id: "kiln-1".into(),
            host: "10.0.0.2".into(),
            port: 7600,
            pin: 255,
            num_blocks: 3,
        };
        assert_eq!(parse_params(&remote).unwrap(), Some(TransferAsk::Import(want)));
    }

    #[test]
    fn bad_params_are_refused_by_name() {
        let cases = [
            (json!([1]), "must be an object"),
            (json!({"do_remote_decode": "yes"}), "must be a boolean"),
            (json!({"do_remote_decode": true, "do_remote_prefill": true}), "both"),
            (json!({"do_remote_decode": true, "tp_size": 2}), "tp_size"),
            (json!({"do_remote_decode": true, "lmcache": 1}), "kv_transfer_params.lmcache"),
            (json!({"do_remote_prefill": true}), "remote_engine_id"),
            (
                json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h",
                    "remote_port": 70000, "remote_request_id": "kiln-pin-1",
                    "remote_block_ids": []}),
                "remote_port",
            ),
            (
                json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h",
                    "remote_port": 7, "remote_request_id": "cmpl-1", "remote_block_ids": []}),
                "does not name",
            ),
            (
                json!({"do_remote_prefill": true, "remote_engine_id": "e", "remote_host": "h",
                    "remote_port": 7, "remote_request_id": "kiln-pin-1",
                    "remote_block_ids": [-1]}),
                "remote_block_ids",
            ),
        ];
        for (value, needle) in cases {
            let err = parse_params(&value).unwrap_err();
            let body = err.body().to_string();
            assert!(body.contains(needle), "{value}: {body}");
        }
    }
}
