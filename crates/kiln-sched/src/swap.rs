//! The second KV tier as the scheduler sees it: numbered slots of one KV block each (host memory
//! or a file, owned by the engine), and the rule that decides whether a preempted request's KV
//! is copied out to them or dropped and recomputed.
//!
//! A request preempted by **swap** keeps its KV in the tier: each of its first
//! `ceil(num_computed / block_size)` blocks is copied to a free slot (a [`BlockCopy`] in
//! [`crate::SchedulerOutput::swap_out`], done by the engine before the step's forward pass, so
//! before anything can overwrite the freed blocks), its blocks are freed as in preemption by
//! recompute, and it waits holding the slots. When it is admitted again, the blocks the prefix
//! cache still holds are hits as usual, new blocks take the rest, and the slots beyond the hit
//! are copied into them ([`crate::SchedulerOutput::swap_in`], again before the forward pass); its
//! `num_computed_tokens` resumes where it was (less one token when every token had been
//! computed: the last one is computed again for its logits). Its slots are free from the next
//! step on.
//!
//! The same slots keep **spilled prefix-cache blocks** when prefix caching is on
//! ([`crate::spill`]): a cached block the KV cache evicts is copied out (also listed in
//! `swap_out`), and a prompt whose prefix runs past the KV cache's hits into spilled blocks gets
//! them copied back (also in `swap_in`) and skips their prefill. A preempted request may take
//! the slots of spilled blocks, oldest first; a spilled block never takes a preempted
//! request's.
//!
//! Within a step the engine runs every copy out (in list order) before every copy in, and both
//! before the forward pass: a block evicted or freed in the step is read before its new owner
//! writes it, a block copied in is written before attention reads it, and a slot copied out of
//! in a step is not taken again before the next step (`released`), so no copy in reads a slot
//! that the same step wrote for something else.
//!
//! The choice ([`PreemptionMode::Auto`]): swap when moving the blocks out and back in is
//! predicted to take less time than prefilling the computed tokens again,
//! `2 · blocks · block_bytes / tier_bandwidth < tokens · prefill_seconds_per_token`, with both
//! rates measured by the engine as it runs ([`crate::Scheduler::set_swap_rates`]); and only
//! when the tier has a slot (free or spilled) for every block. Requests that want prompt
//! log-probabilities are always recomputed (their prompt positions must be computed again to
//! be scored).
//!
//! Invariants (checked by [`crate::Scheduler::check_invariants`]): every slot is exactly one of
//! free, released in this step, holding a spilled block, or held by one waiting swapped
//! request; running requests hold no slots.

use std::fmt;
use std::str::FromStr;

use kiln_core::{BlockId, TokenId};
use kiln_kv::{BlockHash, CachedBlockRef, EvictedBlock};

use crate::spill::{ChainEnd, SpillIndex};

/// A copy of one KV block between the device cache and a tier slot (the direction is given by
/// the list holding it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub block: BlockId,
    /// Slot index in the tier, `0..num_slots`.
    pub slot: usize,
}

/// When a preempted request's KV goes to the tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PreemptionMode {
    /// Swap when the cost model says moving the blocks is cheaper than recomputing them.
    #[default]
    Auto,
    /// Swap whenever the tier has room.
    Swap,
    /// Never swap a preempted request: recompute it (the tier still keeps spilled prefix
    /// blocks).
    Recompute,
}

impl PreemptionMode {
    pub const NAMES: [&'static str; 3] = ["auto", "swap", "recompute"];
}

impl FromStr for PreemptionMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "swap" => Ok(Self::Swap),
            "recompute" => Ok(Self::Recompute),
            other => Err(format!(
                "unknown preemption mode `{other}`; expected one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

impl fmt::Display for PreemptionMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Swap => "swap",
            Self::Recompute => "recompute",
        })
    }
}

/// The tier's size and the cost model's starting rates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SwapConfig {
    /// Slots of one KV block each.
    pub num_slots: usize,
    /// Bytes of one KV block over every layer (what one copy moves).
    pub block_bytes: usize,
    pub mode: PreemptionMode,
    /// Bytes per second one copy direction moves (until measured).
    pub tier_bytes_per_sec: f64,
    /// Seconds one prefill token costs (until measured).
    pub prefill_secs_per_token: f64,
}

/// Swap counters since start (all 0 without a tier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SwapStats {
    /// Slots in the tier.
    pub num_slots: usize,
    /// Slots held by preempted requests now.
    pub num_used_slots: usize,
    /// Slots holding spilled prefix-cache blocks now.
    pub num_spilled_slots: usize,
    pub num_swapped_out_blocks: u64,
    pub num_swapped_in_blocks: u64,
    /// Preemptions that kept the request's KV in the tier.
    pub num_swap_preemptions: u64,
    /// Preemptions that dropped the request's KV (no tier, no room, cheaper, or a mode).
    pub num_recompute_preemptions: u64,
    /// Prefix-cache blocks copied to the tier when the KV cache evicted them.
    pub num_spilled_blocks: u64,
    /// Prompt tokens found in the tier by prefix lookups (past what the KV cache held) and
    /// copied back instead of prefilled.
    pub num_tier_hit_tokens: u64,
}

impl SwapStats {
    /// Fraction of the tier's slots in use, by preempted requests or spilled blocks (0 without
    /// a tier).
    pub fn usage(&self) -> f32 {
        if self.num_slots == 0 {
            0.0
        } else {
            (self.num_used_slots + self.num_spilled_slots) as f32 / self.num_slots as f32
        }
    }
}

/// A preempted request's KV in the tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SwappedKv {
    /// The slot of each of the request's first blocks, in block order.
    pub slots: Vec<usize>,
    /// Tokens whose KV the slots hold.
    pub num_tokens: usize,
}

/// The slots, the spilled prefix blocks and the cost model.
#[derive(Debug)]
pub(crate) struct SwapSpace {
    config: SwapConfig,
    /// Free slots, taken from the end.
    free: Vec<usize>,
    /// Slots copied out of in this step: free from the next step on (the step's copies into the
    /// tier run before its copies out of it).
    released: Vec<usize>,
    /// Spilled prefix-cache blocks (`None`: no spilling, prefix caching is off).
    spill: Option<SpillIndex>,
    stats: SwapStats,
}

impl SwapSpace {
    /// A tier of `config.num_slots` free slots; with `spill`, evicted prefix-cache blocks are
    /// kept in slots no preempted request needs.
    pub fn new(config: SwapConfig, spill: bool) -> Self {
        let free = (0..config.num_slots).rev().collect();
        let stats = SwapStats { num_slots: config.num_slots, ..SwapStats::default() };
        let spill = spill.then(|| SpillIndex::new(config.num_slots));
        Self { config, free, released: Vec::new(), spill, stats }
    }

    pub fn stats(&self) -> SwapStats {
        let num_spilled = self.spill.as_ref().map_or(0, SpillIndex::len);
        let num_used = self.config.num_slots - self.free.len() - self.released.len() - num_spilled;
        SwapStats { num_used_slots: num_used, num_spilled_slots: num_spilled, ..self.stats }
    }

    /// A new step: slots released in the last one can be taken again.
    pub fn start_step(&mut self) {
        self.free.append(&mut self.released);
    }

    pub fn set_rates(
        &mut self,
        tier_bytes_per_sec: Option<f64>,
        prefill_secs_per_token: Option<f64>,
    ) {
        if let Some(r) = tier_bytes_per_sec.filter(|r| r.is_finite() && *r > 0.0) {
            self.config.tier_bytes_per_sec = r;
        }
        if let Some(r) = prefill_secs_per_token.filter(|r| r.is_finite() && *r > 0.0) {
            self.config.prefill_secs_per_token = r;
        }
    }

    /// Slots that a preempted request may take: free ones and those of spilled blocks.
    fn num_available(&self) -> usize {
        self.free.len() + self.spill.as_ref().map_or(0, SpillIndex::len)
    }

    /// A free slot, evicting the oldest spilled block when none is free.
    fn take_slot(&mut self) -> Option<usize> {
        self.free.pop().or_else(|| self.spill.as_mut()?.evict_oldest())
    }

    /// Whether `num_tokens` computed tokens in `num_blocks` blocks should go to the tier.
    pub fn should_swap(&self, num_tokens: usize, num_blocks: usize) -> bool {
        if num_tokens == 0 || num_blocks > self.num_available() {
            return false;
        }
        match self.config.mode {
            PreemptionMode::Recompute => false,
            PreemptionMode::Swap => true,
            PreemptionMode::Auto => {
                let c = &self.config;
                let move_secs = 2.0 * (num_blocks * c.block_bytes) as f64 / c.tier_bytes_per_sec;
                move_secs < num_tokens as f64 * c.prefill_secs_per_token
            }
        }
    }

    /// Takes a slot for each of `blocks` and returns the copies out; the caller checked
    /// `should_swap`.
    pub fn swap_out(
        &mut self,
        blocks: &[BlockId],
        num_tokens: usize,
        out: &mut Vec<BlockCopy>,
    ) -> SwappedKv {
        let slots: Vec<usize> =
            blocks.iter().map(|_| self.take_slot().expect("room checked by should_swap")).collect();
        out.extend(blocks.iter().zip(&slots).map(|(&block, &slot)| BlockCopy { block, slot }));
        self.stats.num_swapped_out_blocks += blocks.len() as u64;
        self.stats.num_swap_preemptions += 1;
        SwappedKv { slots, num_tokens }
    }

    pub fn count_recompute(&mut self) {
        self.stats.num_recompute_preemptions += 1;
    }

    /// Copies `kv.slots[first_block..][..blocks.len()]` into `blocks` (one each, in order) and
    /// releases every slot of `kv`.
    pub fn swap_in(
        &mut self,
        kv: SwappedKv,
        first_block: usize,
        blocks: &[BlockId],
        out: &mut Vec<BlockCopy>,
    ) {
        let slots = &kv.slots[first_block..first_block + blocks.len()];
        out.extend(slots.iter().zip(blocks).map(|(&slot, &block)| BlockCopy { block, slot }));
        self.stats.num_swapped_in_blocks += blocks.len() as u64;
        self.released.extend(kv.slots);
    }

    /// Frees the slots of a request that will not come back for them (aborted between steps).
    pub fn release(&mut self, kv: SwappedKv) {
        self.free.extend(kv.slots);
    }

    /// Spills evicted prefix-cache blocks: each gets a slot (the oldest spilled block's when
    /// none is free) and a copy out, unless a block with its hash is spilled already.
    pub fn spill(&mut self, evicted: Vec<EvictedBlock>, out: &mut Vec<BlockCopy>) {
        if self.spill.is_none() {
            return;
        }
        for block in evicted {
            if self.spill.as_ref().is_some_and(|s| s.contains(block.hash)) {
                continue;
            }
            let Some(slot) = self.take_slot() else { return };
            out.push(BlockCopy { block: block.was.block(), slot });
            self.stats.num_spilled_blocks += 1;
            if let Some(index) = &mut self.spill {
                index.insert(block, slot);
            }
        }
    }

    /// The slots of spilled blocks continuing a verified prefix that ends at `end`, over the
    /// full blocks `chunks` (empty without spilling).
    pub fn lookup<'a>(
        &self,
        end: ChainEnd,
        chunks: impl Iterator<Item = &'a [TokenId]>,
        hash_of: impl Fn(Option<BlockHash>, &[TokenId]) -> BlockHash,
    ) -> Vec<usize> {
        self.spill.as_ref().map_or_else(Vec::new, |index| index.lookup(end, chunks, hash_of))
    }

    /// Copies a hit's spilled blocks into `blocks` (one each, in order), takes them out of the
    /// index and releases their slots; `last_block` is the KV-cache block now holding the last
    /// one's KV, if registered there.
    pub fn take_hit(
        &mut self,
        slots: &[usize],
        blocks: &[BlockId],
        last_block: Option<CachedBlockRef>,
        block_size: usize,
        out: &mut Vec<BlockCopy>,
    ) {
        debug_assert_eq!(slots.len(), blocks.len());
        out.extend(slots.iter().zip(blocks).map(|(&slot, &block)| BlockCopy { block, slot }));
        if let Some(index) = &mut self.spill {
            index.take_hit(slots, last_block);
        }
        self.released.extend_from_slice(slots);
        self.stats.num_tier_hit_tokens += (slots.len() * block_size) as u64;
    }

    /// Every slot is free, released, spilled or held exactly once (`held`: the slots of every
    /// swapped request).
    pub fn check(&self, held: impl Iterator<Item = usize>) -> Result<(), String> {
        let mut seen = vec![false; self.config.num_slots];
        let spilled = self.spill.iter().flat_map(SpillIndex::slots);
        for slot in self.free.iter().chain(&self.released).copied().chain(spilled).chain(held) {
            match seen.get_mut(slot) {
                None => return Err(format!("tier slot {slot} out of range")),
                Some(true) => return Err(format!("tier slot {slot} held twice")),
                Some(s) => *s = true,
            }
        }
        match seen.iter().position(|s| !s) {
            Some(slot) => Err(format!("tier slot {slot} leaked")),
            None => Ok(()),
        }
    }
}
