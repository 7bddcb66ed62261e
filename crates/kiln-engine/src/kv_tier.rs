//! The second KV tier's storage: numbered slots of one KV block each (the bytes of
//! [`StepModel::read_kv_block`], every layer), in host memory (`--swap-space`) or in a file
//! (`--kv-offload-dir`, e.g. on an SSD). The scheduler decides which slot holds what
//! ([`kiln_sched::swap`]); this module only moves bytes, and measures how fast, so the
//! swap-or-recompute rule runs on this machine's numbers.
//!
//! Memory is reserved zeroed and untouched (pages become resident as slots are written); the
//! file's disk space is reserved at once (a disk too small is a start-up error, not a failed
//! swap), under a unique name in the directory, and the file is unlinked at once, so its
//! space goes back to the file system when the process ends, however it ends (a kill
//! included). Writing a block and reading it back gives the same bytes (tested for both).

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kiln_models::StepModel;
use kiln_sched::BlockCopy;

/// Where the tier lives and how large it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvTierConfig {
    pub location: KvTierLocation,
    /// Bytes of KV the tier holds (whole blocks; the rest is unused).
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvTierLocation {
    /// Host memory (vLLM's `--swap-space`).
    Memory,
    /// A file created in this directory (an SSD tier).
    Directory(PathBuf),
}

impl KvTierLocation {
    /// A copy rate to start from until the tier has been measured (bytes per second): a
    /// conservative memory copy, and a conservative SSD.
    pub fn prior_bytes_per_sec(&self) -> f64 {
        match self {
            Self::Memory => 2e9,
            Self::Directory(_) => 3e8,
        }
    }
}

enum Storage {
    /// `[num_slots × block_bytes]`
    Memory(Box<[u8]>),
    /// An unlinked file; `path` is where it was created.
    File { file: File, path: PathBuf },
}

/// The slots.
pub struct KvTier {
    storage: Storage,
    block_bytes: usize,
    num_slots: usize,
    /// One block, for copies (`[block_bytes]`).
    scratch: Vec<u8>,
}

impl KvTier {
    /// A tier of `config.bytes / block_bytes` slots; refuses a size under one block and a
    /// directory it cannot create a file in.
    pub fn new(config: &KvTierConfig, block_bytes: usize) -> Result<Self, String> {
        let num_slots = usize::try_from(config.bytes / block_bytes.max(1) as u64)
            .map_err(|_| format!("a KV tier of {} bytes is too large", config.bytes))?;
        if num_slots == 0 {
            return Err(format!(
                "a KV tier of {} bytes holds no KV block ({block_bytes} bytes each)",
                config.bytes
            ));
        }
        let total = num_slots
            .checked_mul(block_bytes)
            .ok_or_else(|| format!("a KV tier of {} bytes is too large", config.bytes))?;
        let storage = match &config.location {
            KvTierLocation::Memory => Storage::Memory(zeroed(total).ok_or_else(|| {
                format!("cannot reserve {total} bytes of memory for the KV tier")
            })?),
            KvTierLocation::Directory(dir) => create_file(dir, total as u64)?,
        };
        Ok(Self { storage, block_bytes, num_slots, scratch: vec![0; block_bytes] })
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Where the tier's (unlinked) file was created (`None` in memory).
    pub fn path(&self) -> Option<&Path> {
        match &self.storage {
            Storage::Memory(_) => None,
            Storage::File { path, .. } => Some(path),
        }
    }

    fn write_slot(&mut self, slot: usize, data: &[u8]) -> io::Result<()> {
        let at = slot * self.block_bytes;
        match &mut self.storage {
            Storage::Memory(bytes) => {
                bytes[at..at + data.len()].copy_from_slice(data);
                Ok(())
            }
            Storage::File { file, .. } => file.write_all_at(data, at as u64),
        }
    }

    fn read_slot(&self, slot: usize, out: &mut [u8]) -> io::Result<()> {
        let at = slot * self.block_bytes;
        match &self.storage {
            Storage::Memory(bytes) => {
                out.copy_from_slice(&bytes[at..at + out.len()]);
                Ok(())
            }
            Storage::File { file, .. } => file.read_exact_at(out, at as u64),
        }
    }

    /// Copies `blocks` of the model's KV cache into their slots; returns the bytes per second
    /// it moved (`None` for an empty list).
    pub fn swap_out(
        &mut self,
        model: &dyn StepModel,
        blocks: &[BlockCopy],
    ) -> io::Result<Option<f64>> {
        let start = Instant::now();
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = blocks.iter().try_for_each(|c| {
            model.read_kv_block(c.block.index(), &mut scratch);
            self.write_slot(c.slot, &scratch)
        });
        self.scratch = scratch;
        result.map(|()| self.rate(blocks.len(), start))
    }

    /// Copies slots into `blocks` of the model's KV cache; returns the bytes per second it
    /// moved (`None` for an empty list).
    pub fn swap_in(
        &mut self,
        model: &mut dyn StepModel,
        blocks: &[BlockCopy],
    ) -> io::Result<Option<f64>> {
        let start = Instant::now();
        let mut scratch = std::mem::take(&mut self.scratch);
        let result = blocks.iter().try_for_each(|c| {
            self.read_slot(c.slot, &mut scratch)?;
            model.write_kv_block(c.block.index(), &scratch);
            Ok(())
        });
        self.scratch = scratch;
        result.map(|()| self.rate(blocks.len(), start))
    }

    fn rate(&self, num_blocks: usize, start: Instant) -> Option<f64> {
        let secs = start.elapsed().as_secs_f64();
        (num_blocks > 0).then(|| (num_blocks * self.block_bytes) as f64 / secs.max(1e-9))
    }
}

/// `len` zero bytes from the OS, untouched (pages become resident when written); `None` when
/// the allocation is refused.
fn zeroed(len: usize) -> Option<Box<[u8]>> {
    if len == 0 {
        return Some(Box::default());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return None;
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of a `[u8]` of
    // length `len`, all of it initialized (zeroed), and nothing else owns it.
    Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, len)) })
}

/// A new file of `len` reserved bytes in `dir`, named uniquely for this process, already
/// unlinked.
fn create_file(dir: &Path, len: u64) -> Result<Storage, String> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let fail =
        |what: &str, e: io::Error| format!("KV offload directory {}: {what}: {e}", dir.display());
    fs::create_dir_all(dir).map_err(|e| fail("cannot create it", e))?;
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let path = dir.join(format!("kiln-kv-tier-{}-{n}.bin", std::process::id()));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| fail("cannot create the tier file", e))?;
    let reserved = reserve(&file, len);
    fs::remove_file(&path).map_err(|e| fail("cannot unlink the tier file", e))?;
    reserved.map_err(|e| fail(&format!("cannot reserve {len} bytes for the tier"), e))?;
    Ok(Storage::File { file, path })
}

/// Reserves `len` bytes of disk for `file` without writing them (Linux `fallocate`), so a disk
/// too small is refused at start instead of failing a swap later; where the file system cannot
/// reserve, the file is only sized (sparse).
fn reserve(file: &File, len: u64) -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        let too_large = || io::Error::new(io::ErrorKind::InvalidInput, "size out of range");
        let len = libc::off_t::try_from(len).map_err(|_| too_large())?;
        // SAFETY: the descriptor is open and writable for the whole call, and `fallocate` reads
        // and writes no memory of this process.
        let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(err);
        }
    }
    file.set_len(len)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(location: KvTierLocation) {
        let config = KvTierConfig { location, bytes: 3 * 64 + 10 };
        let mut tier = KvTier::new(&config, 64).unwrap();
        assert_eq!(tier.num_slots(), 3);
        for slot in 0..3 {
            let data: Vec<u8> = (0..64).map(|i| (i * 7 + slot * 31) as u8).collect();
            tier.write_slot(slot, &data).unwrap();
        }
        for slot in (0..3).rev() {
            let mut out = vec![0; 64];
            tier.read_slot(slot, &mut out).unwrap();
            assert!(out.iter().enumerate().all(|(i, &b)| b == (i * 7 + slot * 31) as u8));
        }
    }

    #[test]
    fn slots_read_back_what_was_written_in_memory_and_in_a_file() {
        roundtrip(KvTierLocation::Memory);
        let dir = std::env::temp_dir().join(format!("kiln-tier-test-{}", std::process::id()));
        let tier = KvTier::new(
            &KvTierConfig { location: KvTierLocation::Directory(dir.clone()), bytes: 128 },
            64,
        )
        .unwrap();
        let path = tier.path().unwrap().to_owned();
        assert!(path.starts_with(&dir) && !path.exists(), "the tier file is unlinked at once");
        if let Storage::File { file, .. } = &tier.storage {
            assert_eq!(file.metadata().unwrap().len(), 128);
        }
        drop(tier);
        roundtrip(KvTierLocation::Directory(dir.clone()));
        let _ = fs::remove_dir_all(dir);
    }

    #[test]
    fn a_tier_too_small_for_a_block_or_in_an_unusable_directory_is_refused() {
        let err = KvTier::new(&KvTierConfig { location: KvTierLocation::Memory, bytes: 63 }, 64)
            .err()
            .unwrap();
        assert!(err.contains("holds no KV block (64 bytes each)"), "{err}");
        let huge = KvTierConfig { location: KvTierLocation::Memory, bytes: 1 << 60 };
        let err = KvTier::new(&huge, 64).err().unwrap();
        assert!(err.contains("cannot reserve"), "{err}");
        let file = std::env::temp_dir().join(format!("kiln-tier-not-a-dir-{}", std::process::id()));
        fs::write(&file, b"x").unwrap();
        let location = KvTierLocation::Directory(file.join("sub"));
        let err = KvTier::new(&KvTierConfig { location, bytes: 1024 }, 64).err().unwrap();
        assert!(err.contains("KV offload directory"), "{err}");
        let _ = fs::remove_file(file);
    }
}
