//! `kiln serve --prefix-cache-dir DIR`: the prefix cache restored from `DIR` at start and
//! saved there when the server stops (see `kiln_engine::prefix_store` for the file and what is
//! refused). The file is keyed by a fingerprint of the model's files, so a file written for
//! other weights is refused, never trusted.
//!
//! The directory must be this user's alone: one owned by another user, or that its group or
//! everyone may write, is refused at start (another user could plant a file there, or a
//! symlink for the save to write through). A directory that does not exist is created with
//! mode 0700.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use kiln_engine::EngineCore;

/// The file in `--prefix-cache-dir`.
const FILE_NAME: &str = "prefix-cache.bin";

/// A fingerprint of the model at `path`: CRC-32s of the contents and of the names and sizes of
/// the files that decide its KV (a GGUF file; or a directory's `*.safetensors`, `*.gguf` and
/// `config.json`), in name order. About 30 ms per GB of weights in the page cache.
pub fn model_fingerprint(path: &Path) -> anyhow::Result<u64> {
    let mut files: Vec<PathBuf> = if path.is_dir() {
        std::fs::read_dir(path)
            .with_context(|| format!("reading {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                let weights = p.extension().is_some_and(|e| {
                    e.eq_ignore_ascii_case("safetensors") || e.eq_ignore_ascii_case("gguf")
                });
                p.is_file() && (weights || p.file_name().is_some_and(|n| n == "config.json"))
            })
            .collect()
    } else {
        vec![path.to_path_buf()]
    };
    files.sort();
    let (mut contents, mut names) = (crc32fast::Hasher::new(), crc32fast::Hasher::new());
    let mut buf = vec![0u8; 1 << 20];
    for file in &files {
        let mut f = File::open(file).with_context(|| format!("reading {}", file.display()))?;
        let len = f.metadata()?.len();
        names.update(file.file_name().map_or(&[][..], |n| n.as_encoded_bytes()));
        names.update(&len.to_le_bytes());
        loop {
            let n = f.read(&mut buf).with_context(|| format!("reading {}", file.display()))?;
            if n == 0 {
                break;
            }
            contents.update(&buf[..n]);
        }
    }
    Ok((u64::from(contents.finalize()) << 32) | u64::from(names.finalize()))
}

/// Creates `dir` (and its parents) if missing, the last one with mode 0700.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(dir)
}

/// Refuses a directory that another user owns or that group or others may write.
#[cfg(unix)]
fn check_private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir)
        .with_context(|| format!("--prefix-cache-dir: reading {}", dir.display()))?;
    anyhow::ensure!(meta.is_dir(), "--prefix-cache-dir: {} is not a directory", dir.display());
    // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
    let me = unsafe { libc::geteuid() };
    anyhow::ensure!(
        meta.uid() == me,
        "--prefix-cache-dir: {} belongs to another user (uid {}, this process runs as {me}); \
         use a directory of your own",
        dir.display(),
        meta.uid()
    );
    anyhow::ensure!(
        meta.mode() & 0o022 == 0,
        "--prefix-cache-dir: {} may be written by other users (mode {:o}); make it private \
         (chmod go-w) or use another directory",
        dir.display(),
        meta.mode() & 0o7777
    );
    Ok(())
}

#[cfg(not(unix))]
fn check_private_dir(_dir: &Path) -> anyhow::Result<()> {
    Ok(())
}

/// Restores `dir`'s saved prefix cache into `core` (logging what happened; a refused file
/// leaves the cache empty and the start goes on) and arranges for the cache to be saved there
/// when the engine stops (unless nothing is cached then).
pub fn restore_and_save_on_stop(
    core: &mut EngineCore,
    dir: &Path,
    model: &Path,
) -> anyhow::Result<()> {
    create_private_dir(dir)
        .with_context(|| format!("--prefix-cache-dir: creating {}", dir.display()))?;
    check_private_dir(dir)?;
    let path = dir.join(FILE_NAME);
    let start = Instant::now();
    let fingerprint = model_fingerprint(model)?;
    if path.exists() {
        match core.restore_prefix_cache(&path, fingerprint) {
            Ok(s) => tracing::info!(
                "prefix cache: restored {} blocks from {} in {:.2} s ({} skipped: no room)",
                s.blocks,
                path.display(),
                start.elapsed().as_secs_f64(),
                s.skipped
            ),
            Err(e) => tracing::warn!(
                "prefix cache: {} refused ({e}); starting with an empty cache",
                path.display()
            ),
        }
    } else {
        tracing::info!("prefix cache: nothing saved in {} yet", dir.display());
    }
    core.set_shutdown_hook(Box::new(move |core: &mut EngineCore| {
        // A stop before anything was cached (a failed start) keeps the last save.
        if core.scheduler().kv_cache().pool().num_cached_blocks() == 0 {
            tracing::info!("prefix cache: nothing cached, {} left as it was", path.display());
            return;
        }
        let start = Instant::now();
        match core.save_prefix_cache(&path, fingerprint) {
            Ok(n) => tracing::info!(
                "prefix cache: saved {n} blocks to {} in {:.2} s",
                path.display(),
                start.elapsed().as_secs_f64()
            ),
            Err(e) => tracing::warn!("prefix cache: could not save to {}: {e}", path.display()),
        }
    }));
    Ok(())
}
