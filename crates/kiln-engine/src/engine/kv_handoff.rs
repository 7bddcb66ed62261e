//! The engine's side of prefill/decode disaggregation (see [`crate::kv_handoff`]): pins made
//! when an exporting request finishes, their blocks read out for a decode worker, and fetched
//! blocks imported into the prefix cache. Every method runs between steps (the handle settles
//! a step in flight first).

use std::time::{Duration, Instant};

use kiln_core::{BlockId, TokenId};

use super::{EngineCore, EngineError};
use crate::kv_handoff::{KvGeometry, KvHandoffError, KvPin};

impl EngineCore {
    /// Lets requests made with [`crate::PreparedRequest::with_kv_export`] pin their prompt's
    /// KV when they finish, each pin living `ttl` unless fetched or released sooner. Needs the
    /// prefix cache.
    pub fn enable_kv_export(&mut self, ttl: Duration) -> Result<(), EngineError> {
        if !self.scheduler.kv_cache().prefix_caching() {
            return Err(EngineError::Config(
                "KV export needs the prefix cache (drop --no-enable-prefix-caching)".into(),
            ));
        }
        self.kv_pins.enable(ttl);
        Ok(())
    }

    /// Whether requests may ask for their KV to be exported.
    pub fn kv_export_enabled(&self) -> bool {
        self.kv_pins.enabled()
    }

    /// This engine's KV geometry with the caller's fingerprint of the model's files.
    pub fn kv_geometry(&self, model_fingerprint: u64) -> KvGeometry {
        KvGeometry::of(self, model_fingerprint)
    }

    /// Pins the cached full blocks of a finished exporting request's `prompt` (none cached:
    /// an empty pin, which a decode worker fetches nothing from).
    pub(super) fn pin_prompt(&mut self, prompt: &[TokenId]) -> KvPin {
        let blocks = self.scheduler.kv_cache_mut().hold_prefix(prompt);
        let pin = self.kv_pins.insert(blocks, Instant::now());
        self.refresh_stats();
        pin
    }

    /// Appends the KV of pin `pin`'s blocks `[from, from + count)` (prompt blocks, in order) to
    /// `out`, each as [`kiln_models::StepModel::read_kv_block`] reads it; with `release`, the
    /// pin is released afterwards. `prompt` is the importer's prompt: every pinned block up to
    /// the last one read must hold exactly its tokens, so KV computed after another prefix is
    /// never handed out. Refused, with nothing appended, for an unknown pin, blocks past the
    /// pin, or a prompt that differs.
    pub fn export_kv(
        &mut self,
        pin: u64,
        prompt: &[TokenId],
        (from, count): (usize, usize),
        release: bool,
        out: &mut Vec<u8>,
    ) -> Result<(), KvHandoffError> {
        if !self.kv_pins.enabled() {
            return Err(KvHandoffError::ExportOff);
        }
        let pinned = self.kv_pins.get(pin).ok_or(KvHandoffError::UnknownPin(pin))?;
        let end = from.saturating_add(count);
        if end > pinned.blocks.len() {
            return Err(KvHandoffError::OutOfRange { pin, end, pinned: pinned.blocks.len() });
        }
        let blocks: Vec<BlockId> = pinned.blocks[..end].to_vec();
        let bs = self.scheduler.kv_cache().block_size();
        let pool = self.scheduler.kv_cache().pool();
        for (i, &b) in blocks.iter().enumerate() {
            let want = prompt.get(i * bs..(i + 1) * bs);
            if pool.cached_tokens(b) != want {
                return Err(KvHandoffError::PromptMismatch { block: i });
            }
        }
        let block_bytes = self.model().kv_block_bytes();
        let start = out.len();
        out.resize(start + count * block_bytes, 0);
        for (&b, dst) in blocks[from..].iter().zip(out[start..].chunks_exact_mut(block_bytes)) {
            self.model().read_kv_block(b.index(), dst);
        }
        self.stats.kv_handoff.exported_blocks += count as u64;
        if release {
            self.release_kv_pin(pin);
        }
        Ok(())
    }

    /// Releases pin `pin`; `false` when there is none (fetched, released or expired).
    pub fn release_kv_pin(&mut self, pin: u64) -> bool {
        let Some(pinned) = self.kv_pins.remove(pin) else { return false };
        self.scheduler.kv_cache_mut().release_held(&pinned.blocks);
        self.refresh_stats();
        true
    }

    /// Releases the pins past their time at `now`; returns how many.
    pub fn expire_kv_pins(&mut self, now: Instant) -> usize {
        let expired = self.kv_pins.take_expired(now);
        for blocks in &expired {
            self.scheduler.kv_cache_mut().release_held(blocks);
        }
        if !expired.is_empty() {
            self.stats.kv_handoff.pins_expired += expired.len() as u64;
            self.refresh_stats();
        }
        expired.len()
    }

    /// When the next pin expires (`None`: no pins).
    pub fn next_kv_pin_deadline(&self) -> Option<Instant> {
        self.kv_pins.next_deadline()
    }

    /// Pins held now.
    pub fn num_kv_pins(&self) -> usize {
        self.kv_pins.len()
    }

    /// How many of `prompt`'s full blocks this engine's prefix cache holds (a decode worker
    /// fetches the rest).
    pub fn kv_cached_prefix_blocks(&self, prompt: &[TokenId]) -> usize {
        self.scheduler.kv_cache().lookup_prefix(prompt).blocks.len()
    }

    /// Imports fetched KV: `data` holds whole blocks for `prompt`'s full blocks from block
    /// `first` on (block `first + i` at `data[i * block_bytes..]`), registered in the prefix
    /// cache after the cached chain of its first `first` blocks and written. Returns how many
    /// blocks were imported; fewer than given when the cache has no room or the cached prefix
    /// was evicted since it was counted (the request then computes the rest). Refused, with
    /// nothing changed, when `data` is not whole blocks.
    pub fn import_kv(
        &mut self,
        prompt: &[TokenId],
        first: usize,
        data: &[u8],
    ) -> Result<usize, KvHandoffError> {
        let block_bytes = self.model().kv_block_bytes();
        if !data.len().is_multiple_of(block_bytes) {
            return Err(KvHandoffError::BadData(format!(
                "{} bytes of KV are not whole blocks of {block_bytes} bytes",
                data.len()
            )));
        }
        let count = data.len() / block_bytes;
        let chain = self.scheduler.kv_cache_mut().import_prefix(prompt, first, count);
        for &(index, block) in &chain.to_write {
            let offset = (index - first) * block_bytes;
            self.model_mut().write_kv_block(block.index(), &data[offset..offset + block_bytes]);
        }
        self.scheduler.kv_cache_mut().release_held(&chain.held);
        self.stats.kv_handoff.imported_blocks += chain.to_write.len() as u64;
        self.refresh_stats();
        Ok(chain.to_write.len())
    }
}
