//! The cached file and its `.verified` stamp.
//!
//! A file counts as valid when it has the expected size and either its stamp matches (hash,
//! size and mtime in nanoseconds, the format the earlier Python fetcher wrote, so existing
//! caches stay valid) or its SHA-256 matches, which then writes the stamp. Hashing 250 MB takes
//! about a second; the stamp spares every later start that second.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use sha2::{Digest, Sha256};

use crate::{FetchError, MODEL_BYTES, MODEL_SHA256};

/// Lower-case hex of a digest.
pub(crate) fn hex(digest: &[u8]) -> String {
    use std::fmt::Write;
    digest.iter().fold(String::with_capacity(2 * digest.len()), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn sha256_of(path: &Path) -> Result<String, FetchError> {
    let mut file = File::open(path).map_err(|e| FetchError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| FetchError::io(path, e))?;
        if n == 0 {
            return Ok(hex(&hasher.finalize()));
        }
        hasher.update(&buf[..n]);
    }
}

fn stamp_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".verified");
    path.with_file_name(name)
}

/// `"<sha256> <size> <mtime ns>\n"` of the file as it is now.
fn stamp_text(path: &Path) -> Result<String, FetchError> {
    let meta = std::fs::metadata(path).map_err(|e| FetchError::io(path, e))?;
    let modified = meta.modified().map_err(|e| FetchError::io(path, e))?;
    let mtime_ns = modified.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    Ok(format!("{MODEL_SHA256} {} {mtime_ns}\n", meta.len()))
}

/// Records that `path` was verified.
pub(crate) fn write_stamp(path: &Path) -> Result<(), FetchError> {
    let stamp = stamp_path(path);
    std::fs::write(&stamp, stamp_text(path)?).map_err(|e| FetchError::io(&stamp, e))
}

/// Whether `path` holds the complete model (see the module docs).
pub(crate) fn is_valid(path: &Path) -> Result<bool, FetchError> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.is_file() && meta.len() == MODEL_BYTES => {}
        _ => return Ok(false),
    }
    if let Ok(stamp) = std::fs::read_to_string(stamp_path(path))
        && stamp == stamp_text(path)?
    {
        return Ok(true);
    }
    if sha256_of(path)? != MODEL_SHA256 {
        return Ok(false);
    }
    write_stamp(path)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_is_lower_case_and_padded() {
        assert_eq!(hex(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        assert_eq!(
            hex(&Sha256::digest(b"abc")),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_file_of_the_wrong_size_is_not_valid_and_not_hashed() {
        let dir = std::env::temp_dir().join(format!("kiln-fetch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("model.gguf");
        std::fs::write(&path, b"short").unwrap();
        assert!(!is_valid(&path).unwrap());
        assert!(!is_valid(&dir.join("absent.gguf")).unwrap());
        assert_eq!(stamp_path(&path), dir.join("model.gguf.verified"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
