//! Run-time choice of the instruction set, once per process.
//!
//! [`CpuIsa`] names the kernel paths, from the scalar reference up to AMX. By default the
//! process runs the best path this CPU supports ([`CpuIsa::best`]); [`CpuIsa::select`] (the
//! `--isa` flag) or the `KILN_ISA` environment variable forces a lower one, so that, say, the
//! AVX2 path can be tested and benchmarked on an AVX-512 machine. The choice is made before the
//! first kernel runs and never changes afterwards; a path the CPU lacks is refused, never
//! emulated. Every path gives bitwise identical results (each kernel's module says how), so the
//! choice changes speed only.
//!
//! [`SimdLevel`] is the vector width the non-matmul kernels (attention, norms, activations)
//! dispatch on; it follows the selected path.

use std::fmt;
use std::sync::OnceLock;

/// The environment variable the CLI (`--isa`) and the examples read to force a path; the
/// library itself reads no environment (a program selects with [`CpuIsa::select`]).
pub const ISA_ENV: &str = "KILN_ISA";

/// The vector width the non-matmul kernels run at: that of [`CpuIsa::selected`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F + BW + VL.
    Avx512,
}

impl SimdLevel {
    /// The level of the selected path (fixed once per process).
    pub fn detect() -> Self {
        CpuIsa::selected().level()
    }

    /// Every level up to the selected one, for tests that compare variants.
    pub fn available() -> Vec<Self> {
        let top = Self::detect();
        [Self::Scalar, Self::Avx2, Self::Avx512].into_iter().filter(|l| *l <= top).collect()
    }
}

/// A kernel path, in increasing order of what it needs from the CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CpuIsa {
    /// The portable reference.
    Scalar,
    /// AVX2 + FMA + F16C (`vpmaddubsw`/`vpmaddwd` integer dots, 256-bit vectors).
    Avx2,
    /// AVX-512 F + BW + VL without VNNI.
    Avx512,
    /// AVX-512 VNNI (`vpdpbusd`).
    Avx512Vnni,
    /// AMX-INT8 tiles for every 16 activation rows of a quantized matmul, AVX-512 VNNI for the
    /// rest.
    Amx,
}

/// A refused [`CpuIsa`] choice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IsaError {
    /// The name is none of [`CpuIsa::NAMES`].
    Unknown(String),
    /// This CPU lacks the path's instructions.
    Unsupported { wanted: CpuIsa, best: CpuIsa },
    /// Kernels already run with another path (the choice is made once per process).
    AlreadySelected { wanted: CpuIsa, current: CpuIsa },
}

impl fmt::Display for IsaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unknown(name) => {
                write!(f, "unknown ISA {name:?}; expected one of {}", CpuIsa::NAMES.join(", "))
            }
            Self::Unsupported { wanted, best } => write!(
                f,
                "this CPU cannot run the {wanted} path (the best it supports is {best}); \
                 supported: {}",
                CpuIsa::supported_paths()
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Self::AlreadySelected { wanted, current } => write!(
                f,
                "cannot switch to the {wanted} path: kernels already run the {current} path"
            ),
        }
    }
}

impl std::error::Error for IsaError {}

static SELECTED: OnceLock<CpuIsa> = OnceLock::new();

impl CpuIsa {
    /// Every path, lowest first.
    pub const ALL: [Self; 5] =
        [Self::Scalar, Self::Avx2, Self::Avx512, Self::Avx512Vnni, Self::Amx];
    /// Their names, as `--isa` and `KILN_ISA` take them.
    pub const NAMES: [&'static str; 5] = ["scalar", "avx2", "avx512", "avx512-vnni", "amx"];

    pub fn name(self) -> &'static str {
        Self::NAMES[self as usize]
    }

    /// The path named `name` (case-insensitive; `_` for `-` allowed), supported or not.
    pub fn parse(name: &str) -> Result<Self, IsaError> {
        let norm = name.trim().to_ascii_lowercase().replace('_', "-");
        Self::NAMES
            .iter()
            .position(|n| *n == norm)
            .map(|i| Self::ALL[i])
            .ok_or_else(|| IsaError::Unknown(name.to_owned()))
    }

    /// The vector width of the non-matmul kernels on this path.
    pub fn level(self) -> SimdLevel {
        match self {
            Self::Scalar => SimdLevel::Scalar,
            Self::Avx2 => SimdLevel::Avx2,
            Self::Avx512 | Self::Avx512Vnni | Self::Amx => SimdLevel::Avx512,
        }
    }

    /// Whether this CPU (and OS, for AMX's tile state) can run the path.
    pub fn is_supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            let avx2 = has!("avx2") && has!("fma") && has!("f16c");
            let avx512 = avx2 && has!("avx512f") && has!("avx512bw") && has!("avx512vl");
            match self {
                Self::Scalar => true,
                Self::Avx2 => avx2,
                Self::Avx512 => avx512,
                Self::Avx512Vnni => avx512 && has!("avx512vnni"),
                Self::Amx => avx512 && crate::quant::amx_available(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }

    /// The best path this CPU supports.
    pub fn best() -> Self {
        static BEST: OnceLock<CpuIsa> = OnceLock::new();
        *BEST.get_or_init(|| {
            Self::ALL.into_iter().rev().find(|p| p.is_supported()).unwrap_or(Self::Scalar)
        })
    }

    /// Every path this CPU supports, lowest first.
    pub fn supported_paths() -> Vec<Self> {
        Self::ALL.into_iter().filter(|p| p.is_supported()).collect()
    }

    /// The path the kernels run: the one [`CpuIsa::select`]ed, else [`CpuIsa::best`]. Fixed
    /// at the first call.
    pub fn selected() -> Self {
        *SELECTED.get_or_init(Self::best)
    }

    /// Selects the path `value` names (an environment variable's, `ISA_ENV` in a program
    /// without flags); empty or `None` leaves the choice to [`CpuIsa::selected`].
    ///
    /// # Errors
    /// An unknown name, a path this CPU lacks, or another path already selected (a forced path
    /// that silently fell back would make every benchmark of it a lie).
    pub fn select_named(value: Option<&str>) -> Result<(), IsaError> {
        match value.map(str::trim).filter(|v| !v.is_empty()) {
            Some(name) => Self::parse(name)?.select(),
            None => Ok(()),
        }
    }

    /// Makes the kernels run this path from now on. Refused when the CPU lacks it, or when
    /// kernels already run another path (selecting the current one again is fine).
    pub fn select(self) -> Result<(), IsaError> {
        let wanted = self.checked()?;
        let current = *SELECTED.get_or_init(|| wanted);
        if current == wanted { Ok(()) } else { Err(IsaError::AlreadySelected { wanted, current }) }
    }

    /// The paths up to the selected one this CPU supports, for tests that compare variants.
    pub fn available() -> Vec<Self> {
        let top = Self::selected();
        Self::supported_paths().into_iter().filter(|p| *p <= top).collect()
    }

    fn checked(self) -> Result<Self, IsaError> {
        if self.is_supported() {
            Ok(self)
        } else {
            Err(IsaError::Unsupported { wanted: self, best: Self::best() })
        }
    }
}

impl fmt::Display for CpuIsa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CpuIsa {
    type Err = IsaError;

    fn from_str(s: &str) -> Result<Self, IsaError> {
        Self::parse(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for isa in CpuIsa::ALL {
            assert_eq!(CpuIsa::parse(isa.name()), Ok(isa));
            assert_eq!(isa.to_string().parse::<CpuIsa>(), Ok(isa));
        }
        assert_eq!(CpuIsa::parse("AVX512_VNNI"), Ok(CpuIsa::Avx512Vnni));
        let err = CpuIsa::parse("sse9").unwrap_err();
        assert!(err.to_string().contains("avx512-vnni"), "{err}");
    }

    #[test]
    fn the_selection_is_supported_fixed_and_bounds_the_variants() {
        let sel = CpuIsa::selected();
        assert!(sel.is_supported() && sel <= CpuIsa::best());
        assert_eq!(sel.select(), Ok(()), "selecting the current path again is fine");
        assert_eq!(SimdLevel::detect(), sel.level());
        assert!(CpuIsa::available().iter().all(|p| *p <= sel && p.is_supported()));
        assert!(CpuIsa::available().contains(&CpuIsa::Scalar));
        for other in CpuIsa::ALL.into_iter().filter(|p| *p != sel) {
            let err = other.select().unwrap_err();
            assert!(
                matches!(err, IsaError::AlreadySelected { .. } | IsaError::Unsupported { .. }),
                "{other}: {err:?}"
            );
        }
        if CpuIsa::best() < CpuIsa::Amx {
            let err = CpuIsa::Amx.select().unwrap_err();
            assert!(err.to_string().contains("cannot run the amx path"), "{err}");
        }
    }
}
