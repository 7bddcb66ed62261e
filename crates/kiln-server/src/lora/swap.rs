//! A request's adapter, brought into a slot when it is parked (`--max-cpu-loras`, vLLM's cache
//! of loaded adapters): the adapter is read again from its file and bound to a free slot, or to
//! the slot of the least recently used adapter that no request holds, once that adapter's
//! running requests have ended (the engine's `unbind_adapter_when_drained`). Requests of an
//! adapter on its way in wait for it; when every loaded adapter is in use, the load waits for
//! one to come free. The load runs in a task of its own, so a client that leaves never strands
//! an adapter half loaded.

use std::sync::Arc;

use kiln_engine::LoraAdapter;

use super::{AdapterLease, Lookup, SlotPlan, log_loaded};
use crate::config::LoraModule;
use crate::error::ApiError;
use crate::state::Loaded;

/// A lease on the serving adapter `name`, loading it first when it is parked; `None` when no
/// adapter has that name.
pub async fn acquire(loaded: &Arc<Loaded>, name: &str) -> Result<Option<AdapterLease>, ApiError> {
    let registry = &loaded.lora;
    let mut changes = registry.subscribe();
    loop {
        match registry.lookup(name) {
            Lookup::Serving(lease) => return Ok(Some(lease)),
            Lookup::Unknown => return Ok(None),
            Lookup::Busy => {}
            Lookup::Parked => {
                if let Some(module) = registry.claim_parked(name) {
                    let task = tokio::spawn(bring_in(Arc::clone(loaded), module));
                    let loading = task.await;
                    return loading
                        .map_err(|e| ApiError::internal(format!("loading failed: {e}")))?
                        .map(Some);
                }
            }
        }
        if changes.changed().await.is_err() {
            return Err(ApiError::internal("the LoRA registry is gone"));
        }
    }
}

/// Reads the claimed adapter `module`, finds it a slot and binds it, leased to the request that
/// asked; parks it again on any failure.
async fn bring_in(loaded: Arc<Loaded>, module: LoraModule) -> Result<AdapterLease, ApiError> {
    let registry = Arc::clone(&loaded.lora);
    let name = module.name.clone();
    let fail = |e: String| {
        registry.bind_failed(&name);
        ApiError::internal(format!("LoRA adapter '{name}': {e}"))
    };
    let reader = Arc::clone(&registry);
    let path = module.path.clone();
    let read = tokio::task::spawn_blocking(move || {
        LoraAdapter::load(&path, reader.model_config(), reader.max_rank)
            .map(|adapter| Arc::new(adapter.with_dtype(reader.dtype)))
    })
    .await;
    let adapter = match read {
        Ok(Ok(adapter)) => adapter,
        Ok(Err(e)) => return Err(fail(format!("reading it again failed: {e}"))),
        Err(e) => return Err(fail(e.to_string())),
    };
    let mut changes = registry.subscribe();
    let slot = loop {
        match registry.plan_slot(&name) {
            Ok(SlotPlan::Free(slot)) => break slot,
            Ok(SlotPlan::Evict(victim)) => {
                let reply = loaded.engine.unbind_adapter_when_drained(victim);
                let drained = tokio::task::spawn_blocking(move || reply.recv()).await;
                if let Ok(Ok(Ok(()))) = drained {
                    registry.evicted(victim, &name);
                    break victim;
                }
                registry.eviction_failed(victim);
                return Err(fail(format!("evicting the adapter of slot {victim} failed")));
            }
            Ok(SlotPlan::Wait) => {
                if changes.changed().await.is_err() {
                    return Err(fail("the LoRA registry is gone".into()));
                }
            }
            Err(e) => return Err(fail(e.to_string())),
        }
    };
    let reply = loaded.engine.set_adapter(slot, Some(Arc::clone(&adapter)));
    match tokio::task::spawn_blocking(move || reply.recv()).await {
        Ok(Ok(Ok(cache_key))) => {
            log_loaded(&name, &adapter, &module.path);
            registry.loaded_leased(slot, cache_key).ok_or_else(|| fail("its slot is gone".into()))
        }
        Ok(Ok(Err(e))) => Err(fail(e.to_string())),
        _ => Err(fail("the engine stopped".into())),
    }
}
