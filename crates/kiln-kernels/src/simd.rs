//! Run-time choice of the SIMD instruction set.

use std::sync::OnceLock;

/// The widest vector ISA this CPU supports that kiln has kernels for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum SimdLevel {
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F + BW + VL.
    Avx512,
}

impl SimdLevel {
    /// Detected once per process.
    pub fn detect() -> Self {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(Self::probe)
    }

    #[cfg(target_arch = "x86_64")]
    fn probe() -> Self {
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
        {
            Self::Avx512
        } else if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            Self::Avx2
        } else {
            Self::Scalar
        }
    }

    #[cfg(not(target_arch = "x86_64"))]
    fn probe() -> Self {
        Self::Scalar
    }

    /// Every level this CPU can run, for tests that compare variants.
    pub fn available() -> Vec<Self> {
        let top = Self::detect();
        [Self::Scalar, Self::Avx2, Self::Avx512].into_iter().filter(|l| *l <= top).collect()
    }
}
