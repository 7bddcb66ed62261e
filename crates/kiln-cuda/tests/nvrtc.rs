//! The kernels compile with NVRTC (no GPU needed, only libnvrtc): every kernel the backend
//! loads is in the PTX, for Ampere and for Hopper.
//!
//! libnvrtc comes from the system when the loader finds it; otherwise from NVIDIA's
//! `nvidia-cuda-nvrtc` wheel, fetched once with pip into `target/nvrtc`, and the test runs
//! itself again in a child process with that directory on `LD_LIBRARY_PATH` (the dynamic loader
//! reads it only at start).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// The wheel of CUDA 13.0's NVRTC (the version the backend is built against).
const WHEEL: &str = "nvidia-cuda-nvrtc==13.0.88";
const CHILD: &str = "KILN_NVRTC_CHILD";

fn compile_all() {
    for (major, minor) in [(8, 0), (9, 0)] {
        let ptx = kiln_cuda::kernels::compile(major, minor).unwrap();
        assert!(ptx.contains(&format!(".target sm_{major}{minor}")), "target of {major}.{minor}");
        for name in kiln_cuda::kernels::NAMES {
            assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
        }
    }
}

/// A directory holding libnvrtc.so.13, from the wheel (downloaded and unpacked once).
fn wheel_lib_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/nvrtc");
    let lib = root.join("nvidia/cu13/lib");
    if lib.join("libnvrtc.so.13").exists() {
        return lib;
    }
    let dl = root.join("download");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:"])
        .args(["--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2010_x86_64"])
        .arg("-d")
        .arg(&dl)
        .arg(WHEEL)
        .status()
        .expect("running pip");
    assert!(status.success(), "pip download {WHEEL} failed");
    let wheel = std::fs::read_dir(&dl)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .expect("the wheel");
    unzip(&wheel, &root);
    assert!(lib.join("libnvrtc.so.13").exists(), "libnvrtc.so.13 not in {}", wheel.display());
    lib
}

fn unzip(wheel: &Path, into: &Path) {
    let script = "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])";
    let status =
        Command::new("python3").args(["-c", script]).arg(wheel).arg(into).status().unwrap();
    assert!(status.success(), "unpacking {}", wheel.display());
}

#[test]
fn kernels_compile_for_ampere_and_hopper() {
    let loadable = std::panic::catch_unwind(|| kiln_cuda::kernels::compile(9, 0).is_ok());
    if matches!(loadable, Ok(true)) || std::env::var_os(CHILD).is_some() {
        compile_all();
        return;
    }
    let lib = wheel_lib_dir();
    let path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", lib.display()),
        _ => lib.display().to_string(),
    };
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "kernels_compile_for_ampere_and_hopper", "--nocapture"])
        .env("LD_LIBRARY_PATH", path)
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "with NVRTC from {}:\n{text}", lib.display());
    assert!(text.contains("1 passed"), "the child ran no test:\n{text}");
}
