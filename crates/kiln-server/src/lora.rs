//! The LoRA adapters a server serves by name: those of `--lora-modules`, bound at load, and
//! those loaded and unloaded at run time (`POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, allowed by `--allow-runtime-lora-updating` or vLLM's
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; `routes/lora.rs`). And llama-server's `--lora` /
//! `--lora-scaled` adapters, which every request of the base model runs with: stacked into one
//! adapter ([`LoraAdapter::stack`]) bound at load to the slot after the modules', for good.
//!
//! Invariants:
//! - A name names at most one entry, a slot holds at most one entry, and no adapter takes a
//!   served model name.
//! - Requests resolve only `Serving` entries. An entry is `Serving` only while its adapter is
//!   bound in the engine's slot; it is `Loading` until the bind answered, and `Unloading` from
//!   the unload call until the engine emptied the slot (its running requests finish, new ones
//!   get 404 as for any unknown model). A slot is reused only after its entry is gone.
//! - The engine gives each binding a new prefix-cache key: the KV events name an adapter's
//!   blocks by that key (`lora_id`) and the adapter's name.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};

use kiln_engine::{
    AdapterBinding, AdapterSet, EngineCore, LoraAdapter, MAX_ADAPTER_SLOT, ModelConfig,
};

use crate::config::{BaseAdapter, LoraModule, LoraSettings};

/// Highest rank of a `--lora` file (llama-server has no `--max-lora-rank`; kiln's highest).
const BASE_ADAPTER_MAX_RANK: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EntryState {
    Loading,
    Serving,
    Unloading,
}

#[derive(Clone, Debug)]
struct Entry {
    module: LoraModule,
    slot: u32,
    /// The engine binding's prefix-cache key (0 until bound).
    cache_key: u64,
    state: EntryState,
}

/// What `/v1/models` shows of a serving adapter.
#[derive(Clone, Debug)]
pub struct AdapterCard {
    pub name: String,
    pub path: PathBuf,
    pub base_model_name: Option<String>,
}

/// Why a load or an unload is refused (the route maps it to a status).
#[derive(Debug, PartialEq, Eq)]
pub enum RegistryError {
    /// 400: the name is taken.
    NameTaken(String),
    /// 404: no adapter of that name is served.
    NotFound(String),
    /// 400: every slot is taken.
    Full,
}

impl std::fmt::Display for RegistryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NameTaken(name) => {
                write!(f, "The lora adapter '{name}' has already been loaded.")
            }
            Self::NotFound(name) => write!(f, "The lora adapter '{name}' cannot be found."),
            Self::Full => {
                write!(f, "No LoRA slot is free: {MAX_ADAPTER_SLOT} adapters are loaded.")
            }
        }
    }
}

/// The served adapters (module docs).
#[derive(Debug)]
pub struct LoraRegistry {
    entries: Mutex<Vec<Entry>>,
    /// The binding requests of the base model run with: llama-server's `--lora` adapters,
    /// stacked (the default binding without them).
    base: AdapterBinding,
    /// The files of `base`, for `GET /lora-adapters`.
    pub base_adapters: Vec<BaseAdapter>,
    /// The base model's, to read adapters for it.
    model_config: ModelConfig,
    /// `--max-lora-rank`.
    pub max_rank: usize,
    /// `--lora-dtype`.
    pub dtype: kiln_engine::LoraDtype,
    /// Whether adapters may be loaded and unloaded at run time.
    pub runtime_updates: bool,
}

impl LoraRegistry {
    /// Reads every adapter of `settings.modules` for the engine's model and binds the `i`-th
    /// to slot `i + 1`; then the stack of `settings.base_adapters` to the next slot.
    pub fn bind_at_load(settings: &LoraSettings, core: &mut EngineCore) -> Result<Self, String> {
        let model_config = core.model().config().clone();
        let mut entries = Vec::new();
        for (i, module) in settings.modules.iter().enumerate() {
            let fail = |e: String| format!("--lora-modules {}: {e}", module.name);
            let adapter = LoraAdapter::load(&module.path, &model_config, settings.max_rank)
                .map_err(|e| fail(e.to_string()))?
                .with_dtype(settings.dtype);
            let slot = i as u32 + 1;
            let cache_key =
                core.set_adapter(slot, Some(&adapter)).map_err(|e| fail(e.to_string()))?;
            log_loaded(&module.name, &adapter, &module.path);
            entries.push(Entry {
                module: module.clone(),
                slot,
                cache_key,
                state: EntryState::Serving,
            });
        }
        let base_slot = settings.modules.len() as u32 + 1;
        let base = bind_base(settings, &model_config, base_slot, core)?;
        Ok(Self {
            entries: Mutex::new(entries),
            base,
            base_adapters: settings.base_adapters.clone(),
            model_config,
            max_rank: settings.max_rank,
            dtype: settings.dtype,
            runtime_updates: settings.runtime_updates,
        })
    }

    fn entries(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The base model's configuration (what adapters are read for).
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The binding requests of the base model run with (module docs).
    pub fn base_binding(&self) -> AdapterBinding {
        self.base
    }

    /// The binding of the serving adapter `name`.
    pub fn resolve(&self, name: &str) -> Option<AdapterBinding> {
        let entries = self.entries();
        let entry =
            entries.iter().find(|e| e.module.name == name && e.state == EntryState::Serving);
        entry.map(|e| AdapterBinding { slot: e.slot, cache_key: e.cache_key })
    }

    /// The name of the adapter in `slot` (whatever its state).
    pub fn name_of_slot(&self, slot: u32) -> Option<String> {
        self.entries().iter().find(|e| e.slot == slot).map(|e| e.module.name.clone())
    }

    /// The name of the adapter bound under prefix-cache key `key` (while it is loaded).
    pub fn name_of_key(&self, key: u64) -> Option<String> {
        let entries = self.entries();
        entries.iter().find(|e| e.cache_key == key && key != 0).map(|e| e.module.name.clone())
    }

    /// The names of the adapters in `set`, in slot order.
    pub fn names(&self, set: AdapterSet) -> Vec<String> {
        let entries = self.entries();
        let mut named: Vec<&Entry> = entries.iter().filter(|e| set.contains(e.slot)).collect();
        named.sort_by_key(|e| e.slot);
        named.iter().map(|e| e.module.name.clone()).collect()
    }

    /// The serving adapters, in the order they were added.
    pub fn cards(&self) -> Vec<AdapterCard> {
        let entries = self.entries();
        entries
            .iter()
            .filter(|e| e.state == EntryState::Serving)
            .map(|e| AdapterCard {
                name: e.module.name.clone(),
                path: e.module.path.clone(),
                base_model_name: e.module.base_model_name.clone(),
            })
            .collect()
    }

    /// Claims `module.name` and a free slot for a load; end with [`LoraRegistry::loaded`] or
    /// [`LoraRegistry::load_failed`].
    pub fn reserve(&self, module: LoraModule) -> Result<u32, RegistryError> {
        let mut entries = self.entries();
        if entries.iter().any(|e| e.module.name == module.name) {
            return Err(RegistryError::NameTaken(module.name));
        }
        let slot = (1..=MAX_ADAPTER_SLOT)
            .find(|s| *s != self.base.slot && entries.iter().all(|e| e.slot != *s))
            .ok_or(RegistryError::Full)?;
        entries.push(Entry { module, slot, cache_key: 0, state: EntryState::Loading });
        Ok(slot)
    }

    /// The load of `slot` bound its adapter under `cache_key`: it serves from now on.
    pub fn loaded(&self, slot: u32, cache_key: u64) {
        if let Some(e) = self.entries().iter_mut().find(|e| e.slot == slot) {
            e.cache_key = cache_key;
            e.state = EntryState::Serving;
        }
    }

    /// The load of `slot` failed: the name and the slot are free again.
    pub fn load_failed(&self, slot: u32) {
        self.entries().retain(|e| e.slot != slot);
    }

    /// Stops routing requests to the serving adapter `name` and returns its slot, for the
    /// engine to empty; end with [`LoraRegistry::unloaded`].
    pub fn start_unload(&self, name: &str) -> Result<u32, RegistryError> {
        let mut entries = self.entries();
        let entry = entries
            .iter_mut()
            .find(|e| e.module.name == name && e.state == EntryState::Serving)
            .ok_or_else(|| RegistryError::NotFound(name.to_owned()))?;
        entry.state = EntryState::Unloading;
        Ok(entry.slot)
    }

    /// The engine emptied `slot`: its entry is gone.
    pub fn unloaded(&self, slot: u32) {
        self.entries().retain(|e| e.slot != slot);
    }
}

/// Reads, scales and stacks `settings.base_adapters` and binds them to `slot`; the default
/// binding when there are none.
fn bind_base(
    settings: &LoraSettings,
    config: &ModelConfig,
    slot: u32,
    core: &mut EngineCore,
) -> Result<AdapterBinding, String> {
    if settings.base_adapters.is_empty() {
        return Ok(AdapterBinding::default());
    }
    let mut adapters = Vec::new();
    for BaseAdapter { path, scale } in &settings.base_adapters {
        let fail = |e: String| format!("--lora {}: {e}", path.display());
        let adapter = LoraAdapter::load(path, config, BASE_ADAPTER_MAX_RANK)
            .map_err(|e| fail(e.to_string()))?
            .scaled(*scale)
            .map_err(fail)?;
        tracing::info!(
            "LoRA adapter {} (rank {}) at scale {scale} for every request",
            path.display(),
            adapter.max_rank()
        );
        adapters.push(adapter);
    }
    let adapter = LoraAdapter::stack(adapters)?.with_dtype(settings.dtype);
    let cache_key = core.set_adapter(slot, Some(&adapter)).map_err(|e| format!("--lora: {e}"))?;
    Ok(AdapterBinding { slot, cache_key })
}

/// Logs an adapter that starts serving.
pub fn log_loaded(name: &str, adapter: &LoraAdapter, path: &std::path::Path) {
    tracing::info!(
        "LoRA adapter {name} (rank {}, {:.1} MiB) from {}",
        adapter.max_rank(),
        adapter.bytes() as f64 / f64::from(1 << 20),
        path.display()
    );
}
