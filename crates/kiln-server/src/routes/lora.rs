//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, vLLM's run-time adapter
//! updates, served only with `--allow-runtime-lora-updating` (or
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`): without it the routes do not exist (404), as in
//! vLLM.
//!
//! A load reads the PEFT directory or GGUF file off the async workers, checks it against the
//! base model, and binds it to a free slot between two engine steps: running requests go on
//! (with `--max-cpu-loras` adapters already loaded, it is parked instead, and the first request
//! for it loads it). An unload stops routing the name at once (new requests get 404) and
//! answers once the adapter's running requests have finished and its slot is empty: no request
//! is lost; a parked adapter is gone at once. Both finish their bookkeeping in a task of their
//! own, so a client that hangs up midway leaves nothing half done. Answers are vLLM's: `200`
//! with a plain-text `Success: ...` line, or a JSON error (`400` for a taken name, a bad
//! adapter or one on its way in or out, `404` for an unknown one).
//!
//! Also llama-server's `GET /lora-adapters` (the `--lora` files), always served.

use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use kiln_engine::LoraAdapter;
use serde::Deserialize;

use crate::config::LoraModule;
use crate::error::ApiError;
use crate::extract::ApiJson;
use crate::lora::{RegistryError, log_loaded};
use crate::state::{Loaded, ServerState};

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadLoraRequest {
    pub lora_name: String,
    pub lora_path: PathBuf,
    /// vLLM's in-place reload of a loaded name: refused (unload it first).
    #[serde(default)]
    pub load_inplace: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnloadLoraRequest {
    pub lora_name: String,
    /// When given, it must be the adapter's id (the `lora_id` of its KV events).
    #[serde(default)]
    pub lora_int_id: Option<u64>,
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::NotFound(_) => ApiError::not_found(e.to_string()),
            RegistryError::NameTaken(_) | RegistryError::Full | RegistryError::Busy(_) => {
                ApiError::bad_request(e.to_string())
            }
        }
    }
}

pub async fn load_lora_adapter(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<LoadLoraRequest>,
) -> Response {
    match load(&state, req).await {
        Ok(name) => format!("Success: LoRA adapter '{name}' added successfully.").into_response(),
        Err(e) => e.into_response(),
    }
}

pub async fn unload_lora_adapter(
    State(state): State<Arc<ServerState>>,
    ApiJson(req): ApiJson<UnloadLoraRequest>,
) -> Response {
    match unload(&state, req).await {
        Ok(name) => format!("Success: LoRA adapter '{name}' removed successfully.").into_response(),
        Err(e) => e.into_response(),
    }
}

async fn load(state: &ServerState, req: LoadLoraRequest) -> Result<String, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let name = req.lora_name;
    if name.is_empty() || req.lora_path.as_os_str().is_empty() {
        return Err(ApiError::bad_request("both `lora_name` and `lora_path` must be non-empty"));
    }
    if req.load_inplace {
        return Err(ApiError::bad_param(
            "load_inplace",
            "`load_inplace` is not supported: unload the adapter, then load it again",
        ));
    }
    if state.config.served_model_names.contains(&name) {
        return Err(RegistryError::NameTaken(name).into());
    }
    let module = LoraModule { name: name.clone(), path: req.lora_path, base_model_name: None };
    loaded.lora.reserve(module.clone())?;
    // The rest runs to the end even if the client leaves: the name is bound, parked or freed.
    let task = tokio::spawn(bind(loaded, module));
    task.await.map_err(|e| ApiError::internal(format!("loading the adapter failed: {e}")))??;
    Ok(name)
}

/// Reads the adapter and binds it to a free slot, or parks it when `--max-cpu-loras` adapters
/// hold slots; frees the name on any failure.
async fn bind(loaded: Arc<Loaded>, module: LoraModule) -> Result<(), ApiError> {
    let registry = Arc::clone(&loaded.lora);
    let name = module.name.clone();
    let fail = |e: ApiError| {
        registry.load_failed(&name);
        e
    };
    let reader = Arc::clone(&registry);
    let path = module.path.clone();
    let read = tokio::task::spawn_blocking(move || {
        LoraAdapter::load(&path, reader.model_config(), reader.max_rank)
            .map(|adapter| adapter.with_dtype(reader.dtype))
    })
    .await;
    let adapter = match read {
        Ok(Ok(adapter)) => Arc::new(adapter),
        Ok(Err(e)) => {
            return Err(fail(ApiError::bad_request(format!("LoRA adapter '{name}': {e}"))));
        }
        Err(e) => return Err(fail(ApiError::internal(format!("reading the adapter failed: {e}")))),
    };
    let Some(slot) = registry.free_slot(&name).map_err(|e| fail(e.into()))? else {
        tracing::info!("LoRA adapter {name} checked and parked until a request asks for it");
        registry.parked(&name);
        return Ok(());
    };
    let reply = loaded.engine.set_adapter(slot, Some(Arc::clone(&adapter)));
    match tokio::task::spawn_blocking(move || reply.recv()).await {
        Ok(Ok(Ok(cache_key))) => {
            registry.loaded(slot, cache_key);
            log_loaded(&name, &adapter, &module.path);
            Ok(())
        }
        Ok(Ok(Err(e))) => Err(fail(ApiError::bad_request(format!("LoRA adapter '{name}': {e}")))),
        _ => Err(fail(ApiError::internal("the engine stopped"))),
    }
}

async fn unload(state: &ServerState, req: UnloadLoraRequest) -> Result<String, ApiError> {
    let loaded = Arc::clone(state.ready()?);
    let name = req.lora_name;
    if let Some(id) = req.lora_int_id {
        let binding = loaded.lora.resolve(&name);
        if binding.is_none_or(|b| b.cache_key != id) {
            return Err(RegistryError::NotFound(format!("{name}' with lora_int_id '{id}")).into());
        }
    }
    let Some(slot) = loaded.lora.start_unload(&name)? else {
        return Ok(name); // it was parked: gone at once
    };
    let task = tokio::spawn(async move {
        let reply = loaded.engine.unbind_adapter_when_drained(slot);
        let answer = tokio::task::spawn_blocking(move || reply.recv()).await;
        // Emptied, refused or the engine gone: the entry goes either way (the name takes no
        // request any more).
        loaded.lora.unloaded(slot);
        match answer {
            Ok(Ok(Ok(()))) => {
                tracing::info!("LoRA adapter unloaded from slot {slot}");
                Ok(())
            }
            Ok(Ok(Err(e))) => Err(ApiError::internal(format!("unloading the adapter: {e}"))),
            _ => Err(ApiError::internal("the engine stopped")),
        }
    });
    task.await.map_err(|e| ApiError::internal(format!("unloading the adapter failed: {e}")))??;
    Ok(name)
}

/// `GET /lora-adapters` (llama-server's): the `--lora` adapters every request of the base model
/// runs with, as `[{"id", "path", "scale"}]`.
pub async fn list_base_adapters(State(state): State<Arc<ServerState>>) -> Response {
    let adapters = state.loaded().map(|l| l.lora.base_adapters.clone()).unwrap_or_default();
    let list: Vec<serde_json::Value> = adapters
        .iter()
        .enumerate()
        .map(|(id, a)| serde_json::json!({"id": id, "path": a.path.display().to_string(), "scale": a.scale}))
        .collect();
    axum::Json(list).into_response()
}

/// `POST /lora-adapters` (llama-server's change of the global scales): refused, the scales are
/// those given at start.
pub async fn set_base_adapters() -> Response {
    ApiError::bad_request(
        "the --lora adapters keep the scales given at start: changing them at run time is not \
         supported (to choose an adapter per request, serve it by name with --enable-lora \
         --lora-modules NAME=PATH and send that name as `model`)",
    )
    .into_response()
}
