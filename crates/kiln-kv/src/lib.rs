//! Paged KV cache bookkeeping for kiln: which physical block holds which token positions of
//! which request, and which full blocks can be reused across requests (prefix caching).
//!
//! The design is vLLM v1's: a [`BlockPool`] owns ref counts, an LRU [`FreeBlockQueue`] and the
//! `hash -> block` index; the [`KvCacheManager`] owns per-request block tables and policy. No
//! tensors, threads or I/O: everything here is deterministic and tests in microseconds.
//!
//! Modules, bottom up: `hash` (chained block hashes), `free_queue` (index-linked LRU list),
//! `block_pool` (block states and the cache index), `manager` (block tables and the scheduler's
//! API). Each module's docs state its invariants.

mod block_pool;
mod free_queue;
mod hash;
mod manager;

pub use block_pool::{BlockPool, CachedBlockRef, EvictedBlock, KvCacheEvent};
pub use free_queue::FreeBlockQueue;
pub use hash::{BlockHash, BlockHashFn, hash_block};
pub use manager::{ImportedChain, KvCacheConfig, KvCacheManager, PrefixCacheStats, PrefixHit};
