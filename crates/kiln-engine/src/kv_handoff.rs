//! Prefill/decode disaggregation on the engine's side (`kiln serve --kv-role`): a prefill
//! worker pins the KV of a finished prompt for a decode worker to fetch, and a decode worker
//! imports fetched KV into its prefix cache before it admits the request (the wire protocol
//! between them is the server's `kv_transfer`).
//!
//! Invariants:
//! - KV moves in whole blocks of cache key 0, exactly as the backend reads them out
//!   ([`kiln_models::StepModel::read_kv_block`]); two engines exchange blocks only when their
//!   [`KvGeometry`] is equal (same model files, backend, KV dtype, block size and shapes), so
//!   a block's bytes mean the same on both sides;
//! - a pin holds the prompt's cached full blocks (those a prefix lookup finds: the prompt's
//!   last token is never among them) with one reference each, so they are not evicted until
//!   the pin is released, fetched with `release`, or expires; only pinned blocks are exported,
//!   and only to an importer whose prompt they hold token for token from the first block (KV
//!   computed after another prefix is never handed out);
//! - an import registers blocks as prefix-cache hits of the importing engine (hashes computed
//!   there from the prompt's tokens, chained after blocks it already holds) and writes their
//!   KV before any step runs, so the decode request that follows hits them as if it had
//!   computed them; a hit changes no bit of the output (prefix cache on == off), so a
//!   disaggregated request's greedy tokens equal a colocated one's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kiln_core::BlockId;

use crate::EngineCore;

/// What decides the meaning of a KV block's bytes: two engines (or a saved prefix cache and an
/// engine) exchange blocks only when theirs are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// The caller's fingerprint of the model's files.
    pub model_fingerprint: u64,
    pub backend: String,
    pub dtype: String,
    pub block_size: u32,
    pub num_layers: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub block_bytes: u64,
}

impl KvGeometry {
    /// This engine's geometry with the caller's `model_fingerprint`.
    pub fn of(core: &EngineCore, model_fingerprint: u64) -> Self {
        let model = core.model();
        let spec = model.kv_spec();
        Self {
            model_fingerprint,
            backend: model.backend_name().to_string(),
            dtype: spec.dtype.name().to_string(),
            block_size: spec.block_size as u32,
            num_layers: spec.layout.num_layers as u32,
            num_kv_heads: spec.layout.num_kv_heads as u32,
            head_dim: spec.layout.head_dim as u32,
            block_bytes: model.kv_block_bytes() as u64,
        }
    }

    /// The first field where `theirs` differs from `self`, described as "NAME THEIRS, this
    /// server has OURS".
    pub fn mismatch(&self, theirs: &KvGeometry) -> Option<String> {
        let fields: [(&str, String, String); 8] = [
            (
                "model file",
                format!("{:016x}", theirs.model_fingerprint),
                format!("{:016x}", self.model_fingerprint),
            ),
            ("backend", theirs.backend.clone(), self.backend.clone()),
            ("KV cache dtype", theirs.dtype.clone(), self.dtype.clone()),
            ("block size", theirs.block_size.to_string(), self.block_size.to_string()),
            ("layers", theirs.num_layers.to_string(), self.num_layers.to_string()),
            ("KV heads", theirs.num_kv_heads.to_string(), self.num_kv_heads.to_string()),
            ("head size", theirs.head_dim.to_string(), self.head_dim.to_string()),
            ("bytes per block", theirs.block_bytes.to_string(), self.block_bytes.to_string()),
        ];
        fields
            .into_iter()
            .find(|(_, a, b)| a != b)
            .map(|(name, theirs, ours)| format!("{name} {theirs}, this server has {ours}"))
    }
}

/// Prefill/decode disaggregation's counters ([`crate::EngineStats::kv_handoff`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvHandoffStats {
    /// Pins held now, and the blocks they hold.
    pub pins: usize,
    pub pinned_blocks: usize,
    /// Pins released unfetched at their deadline, since start.
    pub pins_expired: u64,
    /// Blocks read out for decode workers, and imported from prefill workers, since start.
    pub exported_blocks: u64,
    pub imported_blocks: u64,
}

/// A finished prompt's KV held for a decode worker: its cached full blocks, in prompt order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvPin {
    /// The pin's id (a decode worker names it when it fetches).
    pub id: u64,
    /// The prefill engine's block ids, block `i` holding prompt tokens `[i*bs, (i+1)*bs)`.
    pub blocks: Vec<u32>,
}

/// Why a KV export or import was refused (nothing changed).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KvHandoffError {
    #[error("KV export is off on this server (--kv-role prefill or both turns it on)")]
    ExportOff,
    #[error("no pinned KV {0}: it was fetched, released or expired")]
    UnknownPin(u64),
    #[error("blocks up to {end} asked of KV {pin}, which holds {pinned}")]
    OutOfRange { pin: u64, end: usize, pinned: usize },
    #[error("the prompt differs from the one prefilled, at block {block}")]
    PromptMismatch { block: usize },
    #[error("{0}")]
    BadData(String),
}

/// The pins of a prefill engine, each with its deadline.
#[derive(Debug)]
pub(crate) struct KvPins {
    /// How long a pin lives unfetched (`None`: export is off).
    ttl: Option<Duration>,
    next_id: u64,
    pins: HashMap<u64, Pinned>,
}

#[derive(Debug)]
pub(crate) struct Pinned {
    pub(crate) blocks: Vec<BlockId>,
    deadline: Instant,
}

impl Default for KvPins {
    fn default() -> Self {
        // Ids start at a value of this process's clock, so a decode worker's stale fetch
        // after a prefill worker restarted does not name a new pin by chance.
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self { ttl: None, next_id: seed.rotate_left(17) | 1, pins: HashMap::new() }
    }
}

impl KvPins {
    pub(crate) fn enable(&mut self, ttl: Duration) {
        self.ttl = Some(ttl);
    }

    pub(crate) fn enabled(&self) -> bool {
        self.ttl.is_some()
    }

    /// Records a pin of `blocks` (already held in the KV manager) until `now + ttl`.
    pub(crate) fn insert(&mut self, blocks: Vec<BlockId>, now: Instant) -> KvPin {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1).max(1);
        let ids = blocks.iter().map(|b| b.0).collect();
        let deadline = now + self.ttl.unwrap_or_default();
        self.pins.insert(id, Pinned { blocks, deadline });
        KvPin { id, blocks: ids }
    }

    pub(crate) fn get(&self, id: u64) -> Option<&Pinned> {
        self.pins.get(&id)
    }

    pub(crate) fn remove(&mut self, id: u64) -> Option<Pinned> {
        self.pins.remove(&id)
    }

    /// Removes the pins past their deadline at `now`, returning their blocks.
    pub(crate) fn take_expired(&mut self, now: Instant) -> Vec<Vec<BlockId>> {
        let expired: Vec<u64> =
            self.pins.iter().filter(|(_, p)| p.deadline <= now).map(|(&id, _)| id).collect();
        expired.into_iter().filter_map(|id| self.pins.remove(&id)).map(|p| p.blocks).collect()
    }

    /// The earliest deadline of a pin.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.pins.values().map(|p| p.deadline).min()
    }

    pub(crate) fn len(&self) -> usize {
        self.pins.len()
    }
}
