//! The LoRA adapters a server serves by name: those of `--lora-modules`, bound at load, and
//! those loaded and unloaded at run time (`POST /v1/load_lora_adapter` and
//! `/v1/unload_lora_adapter`, allowed by `--allow-runtime-lora-updating` or vLLM's
//! `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; `routes/lora.rs`). And llama-server's `--lora` /
//! `--lora-scaled` adapters, which every request of the base model runs with: stacked into one
//! adapter ([`LoraAdapter::stack`]) bound at load to the slot after the modules', for good.
//!
//! Invariants:
//! - A name names at most one entry, a slot holds at most one entry, and no adapter takes a
//!   served model name. With `--max-cpu-loras N`, at most N entries hold slots; the others are
//!   `Parked` (checked, bound to nothing) until a request brings one in ([`acquire`]).
//! - A serving entry is evicted only while no [`AdapterLease`] holds it (a lease lives from a
//!   request's resolution to the end of its handling), and only after the engine emptied its
//!   slot, so no request of it is lost or refused.
//! - Requests resolve only `Serving` entries. An entry is `Serving` only while its adapter is
//!   bound in the engine's slot; it is `Loading` until the bind answered, and `Unloading` from
//!   the unload call until the engine emptied the slot (its running requests finish, new ones
//!   get 404 as for any unknown model). A slot is reused only after its entry left it (gone,
//!   or parked once evicted).
//! - The engine gives each binding a new prefix-cache key: the KV events name an adapter's
//!   blocks by that key (`lora_id`) and the adapter's name.

mod swap;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tokio::sync::watch;

use kiln_engine::{
    AdapterBinding, AdapterSet, EngineCore, LoraAdapter, MAX_ADAPTER_SLOT, ModelConfig,
};

use crate::config::{BaseAdapter, LoraModule, LoraSettings};

pub use swap::acquire;

/// Highest rank of a `--lora` file (llama-server has no `--max-lora-rank`; kiln's highest).
const BASE_ADAPTER_MAX_RANK: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EntryState {
    /// Known and checked, bound to no slot (`--max-cpu-loras`): the next request loads it.
    Parked,
    /// Being read and bound (a run-time load, or a request's load of a parked adapter).
    Loading,
    Serving,
    /// Chosen to make room for another adapter: taking no new request, parked once its
    /// requests end.
    Evicting,
    Unloading,
}

#[derive(Clone, Debug)]
struct Entry {
    module: LoraModule,
    /// Its slot; 0 while it has none (parked, or loading before it was given one).
    slot: u32,
    /// The engine binding's prefix-cache key (0 until bound).
    cache_key: u64,
    state: EntryState,
    /// When a request last took it (the registry's clock), for the least recently used.
    last_used: u64,
    /// Requests holding an [`AdapterLease`] on it: it is not evicted under them.
    leases: usize,
    /// Whether `/v1/models` lists it: once it was first bound or parked.
    listed: bool,
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
    /// 400: the adapter is being loaded into a slot or evicted from one.
    Busy(String),
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
            Self::Busy(name) => {
                write!(f, "The lora adapter '{name}' is being loaded or evicted; try again.")
            }
        }
    }
}

/// What a request finds under an adapter's name ([`LoraRegistry::lookup`]).
#[derive(Debug)]
pub enum Lookup {
    Serving(AdapterLease),
    /// Bound to no slot: [`LoraRegistry::claim_parked`] and load it.
    Parked,
    /// Being loaded or evicted: wait for a change ([`LoraRegistry::subscribe`]).
    Busy,
    Unknown,
}

/// Where a parked adapter being loaded goes ([`LoraRegistry::plan_slot`]).
#[derive(Debug, PartialEq, Eq)]
pub enum SlotPlan {
    /// A free slot, now the entry's.
    Free(u32),
    /// The least recently used adapter without requests in hand, now evicting: empty its slot,
    /// then [`LoraRegistry::evicted`].
    Evict(u32),
    /// Every loaded adapter is in use: wait for a change.
    Wait,
}

/// A request's hold on a serving adapter's binding, from its resolution until the request is
/// done with it: the adapter is not evicted under it ([`LoraRegistry::lookup`]).
#[derive(Debug)]
pub struct AdapterLease {
    registry: Arc<LoraRegistry>,
    pub binding: AdapterBinding,
}

impl Drop for AdapterLease {
    fn drop(&mut self) {
        let registry = &self.registry;
        let mut entries = registry.entries();
        let binding = self.binding;
        let held =
            entries.iter_mut().find(|e| e.slot == binding.slot && e.cache_key == binding.cache_key);
        if let Some(entry) = held {
            entry.leases = entry.leases.saturating_sub(1);
        }
        drop(entries);
        registry.notify();
    }
}

/// The served adapters (module docs).
#[derive(Debug)]
pub struct LoraRegistry {
    entries: Mutex<Vec<Entry>>,
    /// Ticks at every request's lookup: the entries' `last_used`.
    clock: AtomicU64,
    /// Bumped at every change a waiting request or load may care about.
    changes: watch::Sender<u64>,
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
    /// `--max-cpu-loras`: most adapters bound at once (`None`: every one).
    max_loaded: Option<usize>,
}

impl LoraRegistry {
    /// Reads every adapter of `settings.modules` for the engine's model and binds the `i`-th
    /// to slot `i + 1`, up to `--max-cpu-loras` (the rest are checked and parked); then the
    /// stack of `settings.base_adapters` to the next slot.
    pub fn bind_at_load(settings: &LoraSettings, core: &mut EngineCore) -> Result<Self, String> {
        let model_config = core.model().config().clone();
        let mut entries = Vec::new();
        let capacity = settings.max_loaded.unwrap_or(usize::MAX);
        for (i, module) in settings.modules.iter().enumerate() {
            let fail = |e: String| format!("--lora-modules {}: {e}", module.name);
            let adapter = LoraAdapter::load(&module.path, &model_config, settings.max_rank)
                .map_err(|e| fail(e.to_string()))?
                .with_dtype(settings.dtype);
            let (slot, cache_key, state) = if i < capacity {
                let slot = i as u32 + 1;
                let key =
                    core.set_adapter(slot, Some(&adapter)).map_err(|e| fail(e.to_string()))?;
                log_loaded(&module.name, &adapter, &module.path);
                (slot, key, EntryState::Serving)
            } else {
                tracing::info!("LoRA adapter {} parked until a request asks for it", module.name);
                (0, 0, EntryState::Parked)
            };
            let module = module.clone();
            let listed = true;
            entries.push(Entry { module, slot, cache_key, state, last_used: 0, leases: 0, listed });
        }
        let base_slot = settings.modules.len().min(capacity) as u32 + 1;
        let base = bind_base(settings, &model_config, base_slot, core)?;
        Ok(Self {
            entries: Mutex::new(entries),
            clock: AtomicU64::new(0),
            changes: watch::Sender::new(0),
            base,
            base_adapters: settings.base_adapters.clone(),
            model_config,
            max_rank: settings.max_rank,
            dtype: settings.dtype,
            runtime_updates: settings.runtime_updates,
            max_loaded: settings.max_loaded,
        })
    }

    fn entries(&self) -> MutexGuard<'_, Vec<Entry>> {
        self.entries.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn notify(&self) {
        self.changes.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that wakes at the next change of any entry (subscribe before looking).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// The base model's configuration (what adapters are read for).
    pub fn model_config(&self) -> &ModelConfig {
        &self.model_config
    }

    /// The binding requests of the base model run with (module docs).
    pub fn base_binding(&self) -> AdapterBinding {
        self.base
    }

    /// Whether `name` is a served adapter (serving, parked or on its way in or out).
    pub fn knows(&self, name: &str) -> bool {
        let entries = self.entries();
        entries.iter().any(|e| e.module.name == name && e.state != EntryState::Unloading)
    }

    /// What a request for `name` finds; a serving adapter is leased to it and marked used.
    pub fn lookup(self: &Arc<Self>, name: &str) -> Lookup {
        let mut entries = self.entries();
        let Some(entry) = entries.iter_mut().find(|e| e.module.name == name) else {
            return Lookup::Unknown;
        };
        match entry.state {
            EntryState::Serving => {
                entry.leases += 1;
                entry.last_used = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
                let binding = AdapterBinding { slot: entry.slot, cache_key: entry.cache_key };
                Lookup::Serving(AdapterLease { registry: Arc::clone(self), binding })
            }
            EntryState::Parked => Lookup::Parked,
            EntryState::Loading | EntryState::Evicting => Lookup::Busy,
            EntryState::Unloading => Lookup::Unknown,
        }
    }

    /// Takes the parked adapter `name` for loading (`None` when another request took it);
    /// end with [`LoraRegistry::loaded`] or [`LoraRegistry::bind_failed`].
    pub fn claim_parked(&self, name: &str) -> Option<LoraModule> {
        let mut entries = self.entries();
        let entry =
            entries.iter_mut().find(|e| e.module.name == name && e.state == EntryState::Parked)?;
        entry.state = EntryState::Loading;
        let module = entry.module.clone();
        drop(entries);
        self.notify();
        Some(module)
    }

    /// A slot for the loading adapter `name`: a free one while fewer than `--max-cpu-loras`
    /// adapters hold slots, else that of the least recently used serving adapter no request
    /// holds. Refused when every slot is taken.
    pub fn plan_slot(&self, name: &str) -> Result<SlotPlan, RegistryError> {
        let mut entries = self.entries();
        if let Some(slot) = self.take_free_slot(&mut entries, name)? {
            return Ok(SlotPlan::Free(slot));
        }
        let victim = entries
            .iter_mut()
            .filter(|e| e.state == EntryState::Serving && e.leases == 0)
            .min_by_key(|e| e.last_used);
        Ok(match victim {
            Some(victim) => {
                victim.state = EntryState::Evicting;
                SlotPlan::Evict(victim.slot)
            }
            None => SlotPlan::Wait,
        })
    }

    /// A free slot for the loading adapter `name` while fewer than `--max-cpu-loras` adapters
    /// hold slots (`None` otherwise), now the entry's. Refused when every slot is taken.
    pub fn free_slot(&self, name: &str) -> Result<Option<u32>, RegistryError> {
        self.take_free_slot(&mut self.entries(), name)
    }

    fn take_free_slot(
        &self,
        entries: &mut [Entry],
        name: &str,
    ) -> Result<Option<u32>, RegistryError> {
        let held = entries.iter().filter(|e| e.slot != 0).count();
        if self.max_loaded.is_some_and(|max| held >= max) {
            return Ok(None);
        }
        let slot = (1..=MAX_ADAPTER_SLOT)
            .find(|s| *s != self.base.slot && entries.iter().all(|e| e.slot != *s))
            .ok_or(RegistryError::Full)?;
        let entry = entries.iter_mut().find(|e| e.module.name == name);
        entry.ok_or_else(|| RegistryError::NotFound(name.to_owned()))?.slot = slot;
        Ok(Some(slot))
    }

    /// The engine emptied the evicting adapter's `slot`: that adapter is parked and the
    /// loading adapter `name` takes the slot.
    pub fn evicted(&self, slot: u32, name: &str) {
        let mut entries = self.entries();
        for e in entries.iter_mut() {
            if e.slot == slot && e.state == EntryState::Evicting {
                tracing::info!("LoRA adapter {} parked to make room for {name}", e.module.name);
                (e.slot, e.cache_key, e.state) = (0, 0, EntryState::Parked);
            } else if e.module.name == name {
                e.slot = slot;
            }
        }
        drop(entries);
        self.notify();
    }

    /// The eviction of `slot` failed: its adapter serves on.
    pub fn eviction_failed(&self, slot: u32) {
        let mut entries = self.entries();
        let evicting = entries.iter_mut().find(|e| e.slot == slot);
        if let Some(e) = evicting.filter(|e| e.state == EntryState::Evicting) {
            e.state = EntryState::Serving;
        }
        drop(entries);
        self.notify();
    }

    /// Binding the loading adapter `name` failed: it is parked again (a request may retry).
    pub fn bind_failed(&self, name: &str) {
        let mut entries = self.entries();
        if let Some(e) = entries.iter_mut().find(|e| e.module.name == name) {
            (e.slot, e.cache_key, e.state) = (0, 0, EntryState::Parked);
            e.listed = true;
        }
        drop(entries);
        self.notify();
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
        let entries = self.entries();
        entries.iter().find(|e| e.slot == slot && slot != 0).map(|e| e.module.name.clone())
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

    /// The served adapters (bound or parked), in the order they were added.
    pub fn cards(&self) -> Vec<AdapterCard> {
        let entries = self.entries();
        entries
            .iter()
            .filter(|e| e.listed && e.state != EntryState::Unloading)
            .map(|e| AdapterCard {
                name: e.module.name.clone(),
                path: e.module.path.clone(),
                base_model_name: e.module.base_model_name.clone(),
            })
            .collect()
    }

    /// Claims `module.name` for a run-time load: read it, then bind it to a
    /// [`LoraRegistry::free_slot`] ([`LoraRegistry::loaded`]) or, with none, keep it checked and
    /// parked ([`LoraRegistry::parked`]); or give the name up ([`LoraRegistry::load_failed`]).
    pub fn reserve(&self, module: LoraModule) -> Result<(), RegistryError> {
        let mut entries = self.entries();
        if entries.iter().any(|e| e.module.name == module.name) {
            return Err(RegistryError::NameTaken(module.name));
        }
        let entry = Entry {
            module,
            slot: 0,
            cache_key: 0,
            state: EntryState::Loading,
            last_used: 0,
            leases: 0,
            listed: false,
        };
        entries.push(entry);
        Ok(())
    }

    /// The loading adapter in `slot` is bound under `cache_key`: it serves from now on.
    pub fn loaded(&self, slot: u32, cache_key: u64) {
        if let Some(e) = self.entries().iter_mut().find(|e| e.slot == slot && slot != 0) {
            e.cache_key = cache_key;
            e.state = EntryState::Serving;
            e.listed = true;
        }
        self.notify();
    }

    /// The adapter a request loaded into `slot` is bound under `cache_key`: it serves from now
    /// on, leased to that request first (so no other load evicts it before the request runs).
    pub fn loaded_leased(self: &Arc<Self>, slot: u32, cache_key: u64) -> Option<AdapterLease> {
        let mut entries = self.entries();
        let entry = entries.iter_mut().find(|e| e.slot == slot && slot != 0)?;
        (entry.cache_key, entry.state, entry.listed) = (cache_key, EntryState::Serving, true);
        entry.leases += 1;
        entry.last_used = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        drop(entries);
        self.notify();
        let binding = AdapterBinding { slot, cache_key };
        Some(AdapterLease { registry: Arc::clone(self), binding })
    }

    /// The run-time load of `name` was checked and stays parked (no slot is free).
    pub fn parked(&self, name: &str) {
        self.bind_failed(name);
    }

    /// The run-time load of `name` failed: the name (and any slot it had) is free again.
    pub fn load_failed(&self, name: &str) {
        self.entries().retain(|e| e.module.name != name);
        self.notify();
    }

    /// Stops routing requests to the adapter `name` and returns its slot, for the engine to
    /// empty (then [`LoraRegistry::unloaded`]); a parked adapter is gone at once (`None`).
    pub fn start_unload(&self, name: &str) -> Result<Option<u32>, RegistryError> {
        let mut entries = self.entries();
        let i = entries
            .iter()
            .position(|e| e.module.name == name && e.state != EntryState::Unloading)
            .ok_or_else(|| RegistryError::NotFound(name.to_owned()))?;
        let entry = &mut entries[i];
        match entry.state {
            EntryState::Serving => {
                entry.state = EntryState::Unloading;
                Ok(Some(entry.slot))
            }
            EntryState::Parked => {
                entries.remove(i);
                Ok(None)
            }
            _ => Err(RegistryError::Busy(name.to_owned())),
        }
    }

    /// The engine emptied `slot`: its entry is gone.
    pub fn unloaded(&self, slot: u32) {
        self.entries().retain(|e| e.slot != slot);
        self.notify();
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
