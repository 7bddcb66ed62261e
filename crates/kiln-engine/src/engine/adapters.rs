//! LoRA adapter bindings: which slots hold an adapter, the prefix-cache key of each binding,
//! and the slots being emptied once their requests finish.
//!
//! Invariants:
//! - A slot's binding changes only while no unfinished request names the slot and no step is
//!   in flight (the model is on the engine thread). A request therefore runs its whole life
//!   under one binding.
//! - Every binding gets a cache key never given before (`next_key`, from 1): a slot bound again
//!   to another adapter cannot hit the blocks the first one cached.
//! - A draining slot refuses new requests; it is emptied by [`EngineCore::unbind_drained`]
//!   once no unfinished request names it, so an unload loses no request.

use std::collections::BTreeMap;

use kiln_sched::RequestStatus;

use kiln_models::lora::LoraAdapter;

use super::{EngineCore, EngineError};

/// The highest slot an adapter can be bound to (the size of [`AdapterSet`]).
pub const MAX_ADAPTER_SLOT: u32 = 256;

/// A set of adapter slots `1..=MAX_ADAPTER_SLOT` (a copyable bit set, for the counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdapterSet([u64; 4]);

impl AdapterSet {
    /// Adds `slot` (slot 0 and slots past [`MAX_ADAPTER_SLOT`] are not adapters: ignored).
    pub fn insert(&mut self, slot: u32) {
        if (1..=MAX_ADAPTER_SLOT).contains(&slot) {
            let i = (slot - 1) as usize;
            self.0[i / 64] |= 1 << (i % 64);
        }
    }

    pub fn contains(&self, slot: u32) -> bool {
        (1..=MAX_ADAPTER_SLOT).contains(&slot) && {
            let i = (slot - 1) as usize;
            self.0[i / 64] & (1 << (i % 64)) != 0
        }
    }

    /// The slots in increasing order.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (1..=MAX_ADAPTER_SLOT).filter(|&s| self.contains(s))
    }

    pub fn len(&self) -> usize {
        self.0.iter().map(|w| w.count_ones() as usize).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.0 == [0; 4]
    }
}

/// A LoRA adapter as a request names it: its slot and the binding's prefix-cache key (what
/// [`EngineCore::set_adapter`] returned); the default is the base model.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdapterBinding {
    pub slot: u32,
    pub cache_key: u64,
}

/// The adapters a running engine holds, as its counters report them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdapterStats {
    /// Slots with an adapter bound (draining ones included).
    pub loaded: AdapterSet,
    /// Slots named by a running request.
    pub running: AdapterSet,
    /// Slots named by a waiting (queued or preempted) request.
    pub waiting: AdapterSet,
}

#[derive(Clone, Copy, Debug)]
struct Binding {
    /// The prefix-cache key of the binding's KV.
    cache_key: u64,
    /// Refuses new requests; emptied once its requests finish.
    draining: bool,
}

/// The engine's slots (module docs).
#[derive(Debug)]
pub(crate) struct AdapterBindings {
    bound: BTreeMap<u32, Binding>,
    next_key: u64,
}

impl Default for AdapterBindings {
    fn default() -> Self {
        Self { bound: BTreeMap::new(), next_key: 1 }
    }
}

impl AdapterBindings {
    /// The cache key requests of `slot` run under (0 for slot 0), or why the slot takes no
    /// request.
    pub(crate) fn admit(&self, slot: u32) -> Result<u64, String> {
        if slot == 0 {
            return Ok(0);
        }
        match self.bound.get(&slot) {
            None => Err(format!("no LoRA adapter is loaded in slot {slot}")),
            Some(b) if b.draining => Err(format!("the LoRA adapter in slot {slot} is unloading")),
            Some(b) => Ok(b.cache_key),
        }
    }
}

impl EngineCore {
    /// Binds a LoRA adapter (read for this model: [`LoraAdapter::load_peft`]) to `slot`
    /// (`1..=MAX_ADAPTER_SLOT`), or empties the slot (`None`); requests name their slot
    /// ([`crate::PreparedRequest::with_adapter`]). Refused while an unfinished request names
    /// the slot, while a step is in flight ([`EngineCore::finish_in_flight`] ends it), and
    /// binding over a slot being unloaded; other requests keep running. Returns the binding's prefix-cache key (0 when emptied).
    pub fn set_adapter(
        &mut self,
        slot: u32,
        adapter: Option<&LoraAdapter>,
    ) -> Result<u64, EngineError> {
        if !(1..=MAX_ADAPTER_SLOT).contains(&slot) {
            let why = format!("LoRA slot {slot} is not in 1..={MAX_ADAPTER_SLOT}");
            return Err(EngineError::Config(why));
        }
        if self.step_in_flight || self.executor().has_pending() {
            return Err(EngineError::Config(
                "LoRA adapters are bound only between steps (a step is in flight)".into(),
            ));
        }
        if adapter.is_some() && self.adapters.bound.get(&slot).is_some_and(|b| b.draining) {
            return Err(EngineError::Config(format!(
                "the LoRA adapter in slot {slot} is unloading; bind another slot"
            )));
        }
        let users = self.adapter_users(slot);
        if users > 0 {
            return Err(EngineError::Config(format!(
                "the LoRA adapter in slot {slot} is in use by {users} unfinished requests"
            )));
        }
        self.runner
            .model_mut()
            .set_adapter(slot, adapter)
            .map_err(|e| EngineError::Config(format!("LoRA adapter in slot {slot}: {e}")))?;
        let bindings = &mut self.adapters;
        if adapter.is_none() {
            bindings.bound.remove(&slot);
            self.refresh_stats();
            return Ok(0);
        }
        let cache_key = bindings.next_key;
        bindings.next_key += 1;
        bindings.bound.insert(slot, Binding { cache_key, draining: false });
        self.refresh_stats();
        Ok(cache_key)
    }

    /// Starts unloading the adapter in `slot`: new requests naming it are refused, and it is
    /// emptied once its unfinished requests end ([`EngineCore::unbind_drained`], which the
    /// engine thread calls between steps). `Ok(true)` when it was emptied now.
    pub fn unbind_adapter_when_drained(&mut self, slot: u32) -> Result<bool, EngineError> {
        let Some(binding) = self.adapters.bound.get_mut(&slot) else {
            return Err(EngineError::Config(format!("no LoRA adapter is loaded in slot {slot}")));
        };
        binding.draining = true;
        Ok(self.unbind_drained().contains(&slot))
    }

    /// Empties every draining slot that no unfinished request names any more, when no step is
    /// in flight; returns those slots.
    pub fn unbind_drained(&mut self) -> Vec<u32> {
        if self.step_in_flight || self.executor().has_pending() {
            return Vec::new();
        }
        let draining: Vec<u32> =
            self.adapters.bound.iter().filter(|(_, b)| b.draining).map(|(&s, _)| s).collect();
        let mut emptied = Vec::new();
        for slot in draining {
            if self.adapter_users(slot) == 0 && self.set_adapter(slot, None).is_ok() {
                emptied.push(slot);
            }
        }
        emptied
    }

    /// Whether a draining slot has no unfinished request left (and only waits for the step in
    /// flight, if any, to be emptied).
    pub fn has_drained_adapters(&self) -> bool {
        self.adapters.bound.iter().any(|(&slot, b)| b.draining && self.adapter_users(slot) == 0)
    }

    /// Unfinished requests naming `slot`.
    fn adapter_users(&self, slot: u32) -> usize {
        self.requests
            .iter()
            .filter(|(id, live)| live.adapter == slot && self.scheduler.request(*id).is_some())
            .count()
    }

    /// The loaded, running and waiting adapters, for the counters.
    pub(super) fn adapter_stats(&self) -> AdapterStats {
        let mut stats = AdapterStats::default();
        for &slot in self.adapters.bound.keys() {
            stats.loaded.insert(slot);
        }
        if self.adapters.bound.is_empty() {
            return stats;
        }
        for (id, live) in self.requests.iter().filter(|(_, live)| live.adapter != 0) {
            match self.scheduler.request(id).map(kiln_sched::Request::status) {
                Some(RequestStatus::Running) => stats.running.insert(live.adapter),
                Some(RequestStatus::Waiting | RequestStatus::Preempted) => {
                    stats.waiting.insert(live.adapter);
                }
                _ => {}
            }
        }
        stats
    }

    /// The cache key a request of `slot` runs under, or why it is refused.
    pub(super) fn admit_adapter(&self, slot: u32) -> Result<u64, String> {
        self.adapters.admit(slot)
    }
}
