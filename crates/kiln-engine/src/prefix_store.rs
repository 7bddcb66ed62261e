//! A prefix cache saved to a file and restored at start (`kiln serve --prefix-cache-dir`).
//!
//! The file holds every cached block still reachable by a chain of hits
//! ([`kiln_kv::KvCacheManager::cached_chains`]), parents first: for each, the index of its
//! parent record, its token ids and its KV bytes as the backend reads them out
//! ([`kiln_models::StepModel::read_kv_block`]). Restoring registers the blocks again (their
//! hashes recomputed from the tokens) and writes their KV back, so a request whose prompt
//! starts with a saved prefix hits it as if it had been computed in this process.
//!
//! Layout (little-endian):
//! - header: magic `KILNPFX1`, format version (u32), the key — the caller's model
//!   fingerprint (u64), backend name and KV dtype name (16 bytes each, zero padded), block size,
//!   layers, KV heads, head size (u32 each), block bytes (u64) — then the record count (u64) and
//!   a CRC-32 of everything before it;
//! - records: parent index (u32, `u32::MAX` for none; always an earlier record), `block_size`
//!   token ids (u32), the block's KV bytes, and a CRC-32 of the record.
//!
//! Invariants: a file is never trusted. Its size must be exactly the header's promise, its key
//! must equal this engine's (same model file, backend, dtype, geometry), every CRC must hold,
//! every parent must be an earlier record and every token id inside the vocabulary; anything
//! else refuses the whole file with an error naming what differs, and the cache is left as it
//! was (empty). Blocks beyond the cache's free, uncached blocks are skipped (never evicted
//! for). Saving writes a temporary file and renames it, so a crash never leaves a torn file
//! under the real name. The temporary file has a name of its own (process id and a counter),
//! is created exclusively (`O_CREAT | O_EXCL | O_NOFOLLOW`, mode 0600), so nothing planted
//! under its name (a symlink to another file) is ever written through and two servers on one
//! directory never share it, and is removed when the save fails (a full disk). The saved file
//! is opened without following a symlink.

use std::fs::{File, OpenOptions};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::{BlockId, TokenId};

use crate::EngineCore;
/// The key a file must match: everything that decides what a block's bytes mean.
use crate::kv_handoff::KvGeometry as Key;

const MAGIC: &[u8; 8] = b"KILNPFX1";
const VERSION: u32 = 1;
/// Bytes of the header, its CRC included.
const HEADER_BYTES: usize = 8 + 4 + 8 + 16 + 16 + 4 * 4 + 8 + 8 + 4;
const NO_PARENT: u32 = u32::MAX;

/// Why a saved prefix cache was refused (the cache is left empty; the server starts anyway).
#[derive(Debug, thiserror::Error)]
pub enum PrefixStoreError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The file is not one this engine can use: another model, dtype or geometry.
    #[error("saved for another configuration: {0}")]
    Foreign(String),
    /// The file is damaged: truncated, a CRC mismatch, an impossible field.
    #[error("corrupted: {0}")]
    Corrupted(String),
    /// Restoring needs an idle engine with prefix caching on.
    #[error("{0}")]
    NotIdle(String),
}

/// What a restore did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreSummary {
    /// Blocks registered again, their KV written.
    pub blocks: usize,
    /// Records skipped: no free block left, or a parent that was skipped.
    pub skipped: usize,
}

/// The bytes of one record in a file of `key`.
fn record_bytes(key: &Key) -> usize {
    4 + 4 * key.block_size as usize + key.block_bytes as usize + 4
}

fn name_field(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    let n = name.len().min(16);
    out[..n].copy_from_slice(&name.as_bytes()[..n]);
    out
}

fn encode_header(key: &Key, num_records: u64) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_BYTES);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&VERSION.to_le_bytes());
    h.extend_from_slice(&key.model_fingerprint.to_le_bytes());
    h.extend_from_slice(&name_field(&key.backend));
    h.extend_from_slice(&name_field(&key.dtype));
    for x in [key.block_size, key.num_layers, key.num_kv_heads, key.head_dim] {
        h.extend_from_slice(&x.to_le_bytes());
    }
    h.extend_from_slice(&key.block_bytes.to_le_bytes());
    h.extend_from_slice(&num_records.to_le_bytes());
    let crc = crc32fast::hash(&h);
    h.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(h.len(), HEADER_BYTES);
    h
}

/// Little-endian fields read off the front of a byte slice.
struct Fields<'a>(&'a [u8]);

impl Fields<'_> {
    fn take<const N: usize>(&mut self) -> [u8; N] {
        let (head, rest) = self.0.split_at(N);
        self.0 = rest;
        head.try_into().expect("N bytes")
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take())
    }
    fn name(&mut self) -> String {
        let raw: [u8; 16] = self.take();
        let end = raw.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&raw[..end]).into_owned()
    }
}

/// Parses and checks a header: `(key, number of records)`.
fn decode_header(h: &[u8; HEADER_BYTES]) -> Result<(Key, u64), PrefixStoreError> {
    let corrupted = |what: &str| PrefixStoreError::Corrupted(what.to_string());
    if &h[..8] != MAGIC {
        return Err(PrefixStoreError::Foreign("not a kiln prefix cache file".into()));
    }
    let (body, crc) = h.split_at(HEADER_BYTES - 4);
    if crc32fast::hash(body).to_le_bytes() != crc {
        return Err(corrupted("header checksum mismatch"));
    }
    let mut f = Fields(&body[8..]);
    let version = f.u32();
    if version != VERSION {
        return Err(PrefixStoreError::Foreign(format!(
            "format version {version}, this server reads {VERSION}"
        )));
    }
    let key = Key {
        model_fingerprint: f.u64(),
        backend: f.name(),
        dtype: f.name(),
        block_size: f.u32(),
        num_layers: f.u32(),
        num_kv_heads: f.u32(),
        head_dim: f.u32(),
        block_bytes: f.u64(),
    };
    Ok((key, f.u64()))
}

/// Opens `path` for options `o` without following a symlink at its last component (where the
/// platform has `O_NOFOLLOW`).
fn open_no_follow(o: &mut OpenOptions, path: &Path) -> std::io::Result<File> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.custom_flags(libc::O_NOFOLLOW);
    }
    o.open(path)
}

/// A new temporary file beside `path`, created exclusively (module docs), with its name.
fn create_temp(path: &Path) -> std::io::Result<(File, PathBuf)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let name = path.file_name().map_or_else(|| "prefix-cache".into(), |n| n.to_string_lossy());
    let mut options = OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    for attempt in 1.. {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()));
        match open_no_follow(&mut options, &tmp) {
            Ok(file) => return Ok((file, tmp)),
            // A leftover of a crashed process with our pid, or a planted name: the next one.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 1000 => {}
            Err(e) => return Err(e),
        }
    }
    unreachable!("the attempts end in a return")
}

/// Writes the engine's reachable cached blocks to `path` (through a temporary file of its own
/// and a rename; module docs); returns how many. `model_fingerprint` identifies the model file
/// (the caller's hash). On an error `path` is as it was and the temporary file is gone.
pub fn save(core: &EngineCore, path: &Path, model_fingerprint: u64) -> std::io::Result<usize> {
    let (file, tmp) = create_temp(path)?;
    let written = write_blocks(core, file, model_fingerprint).and_then(|n| {
        std::fs::rename(&tmp, path)?;
        Ok(n)
    });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// The file's contents into `file`, synced; returns the number of blocks.
fn write_blocks(core: &EngineCore, file: File, model_fingerprint: u64) -> std::io::Result<usize> {
    let key = Key::of(core, model_fingerprint);
    let chains = core.scheduler().kv_cache().cached_chains();
    let mut out = BufWriter::new(file);
    out.write_all(&encode_header(&key, chains.len() as u64))?;
    let pool = core.scheduler().kv_cache().pool();
    let mut record = Vec::with_capacity(record_bytes(&key));
    let mut kv = vec![0u8; key.block_bytes as usize];
    for &(block, parent) in &chains {
        record.clear();
        let parent = parent.map_or(NO_PARENT, |p| p as u32);
        record.extend_from_slice(&parent.to_le_bytes());
        for t in pool.cached_tokens(block).expect("a cached block has tokens") {
            record.extend_from_slice(&t.0.to_le_bytes());
        }
        core.model().read_kv_block(block.index(), &mut kv);
        record.extend_from_slice(&kv);
        let crc = crc32fast::hash(&record);
        record.extend_from_slice(&crc.to_le_bytes());
        out.write_all(&record)?;
    }
    let file = out.into_inner().map_err(std::io::IntoInnerError::into_error)?;
    file.sync_all()?;
    Ok(chains.len())
}

/// Restores the blocks saved in `path` into an idle engine (see the module docs for what is
/// refused). On any error the cache is left empty.
pub fn restore(
    core: &mut EngineCore,
    path: &Path,
    model_fingerprint: u64,
) -> Result<RestoreSummary, PrefixStoreError> {
    if core.has_unfinished() {
        return Err(PrefixStoreError::NotIdle("requests are running".into()));
    }
    if !core.scheduler().config().enable_prefix_caching {
        return Err(PrefixStoreError::NotIdle("prefix caching is off".into()));
    }
    let ours = Key::of(core, model_fingerprint);
    let file = open_no_follow(OpenOptions::new().read(true), path)?;
    let len = file.metadata()?.len();
    let mut input = BufReader::with_capacity(1 << 20, file);
    let mut header = [0u8; HEADER_BYTES];
    input.read_exact(&mut header).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => {
            PrefixStoreError::Corrupted(format!("{len} bytes, shorter than a header"))
        }
        _ => e.into(),
    })?;
    let (saved, num_records) = decode_header(&header)?;
    if let Some(what) = ours.mismatch(&saved) {
        return Err(PrefixStoreError::Foreign(what));
    }
    let expected = u128::from(num_records) * record_bytes(&ours) as u128 + HEADER_BYTES as u128;
    if u128::from(len) != expected {
        return Err(PrefixStoreError::Corrupted(format!(
            "{len} bytes, the header promises {expected} ({num_records} blocks)"
        )));
    }
    let mut restored: Vec<BlockId> = Vec::new();
    let result = restore_records(core, &mut input, &ours, num_records as usize, &mut restored);
    let kv = core.scheduler_mut().kv_cache_mut();
    kv.finish_restore(&restored);
    if result.is_err() {
        kv.reset_prefix_cache();
    }
    result
}

fn restore_records(
    core: &mut EngineCore,
    input: &mut impl Read,
    key: &Key,
    num_records: usize,
    restored: &mut Vec<BlockId>,
) -> Result<RestoreSummary, PrefixStoreError> {
    let vocab_size = core.model().config().vocab_size as u32;
    let bs = key.block_size as usize;
    let mut record = vec![0u8; record_bytes(key)];
    // Each record's block in this cache (`None`: skipped).
    let mut placed: Vec<Option<BlockId>> = Vec::with_capacity(num_records.min(1 << 20));
    let mut summary = RestoreSummary::default();
    let mut tokens = Vec::with_capacity(bs);
    for i in 0..num_records {
        input.read_exact(&mut record)?;
        let (body, crc) = record.split_at(record.len() - 4);
        if crc32fast::hash(body).to_le_bytes() != crc {
            return Err(PrefixStoreError::Corrupted(format!("block {i}: checksum mismatch")));
        }
        let mut f = Fields(body);
        let parent = match f.u32() {
            NO_PARENT => None,
            p if (p as usize) < i => Some(p as usize),
            p => {
                return Err(PrefixStoreError::Corrupted(format!(
                    "block {i}: parent {p} is not an earlier block"
                )));
            }
        };
        tokens.clear();
        for _ in 0..bs {
            let t = f.u32();
            if t >= vocab_size {
                return Err(PrefixStoreError::Corrupted(format!(
                    "block {i}: token id {t} outside the vocabulary ({vocab_size})"
                )));
            }
            tokens.push(TokenId(t));
        }
        // A record whose parent was skipped is unreachable: skipped too.
        let parent_block = parent.map(|p| placed[p]);
        if parent_block == Some(None) {
            placed.push(None);
            summary.skipped += 1;
            continue;
        }
        let parent_block = parent_block.flatten();
        let kv = core.scheduler_mut().kv_cache_mut();
        let Some(block) = kv.restore_block(parent_block, &tokens) else {
            placed.push(None);
            summary.skipped += 1;
            continue;
        };
        restored.push(block);
        core.model_mut().write_kv_block(block.index(), f.0);
        placed.push(Some(block));
        summary.blocks += 1;
    }
    Ok(summary)
}
