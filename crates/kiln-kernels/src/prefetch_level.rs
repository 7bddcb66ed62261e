//! Which cache level the kernels' software prefetches of weights fill: L1 (`prefetcht0`) or
//! L2 (`prefetcht1`).
//!
//! A decode-sized quantized matmul streams its weights once, and its speed is how many cache
//! lines each core keeps in flight. On Intel cores a `prefetcht0` holds one of the L1's few
//! fill buffers until its line arrives, and once they are all taken the next prefetch stalls
//! the core (on an Intel Xeon with AVX-512 and AMX, 2 threads, 60 % of the kernel's samples sat
//! on its prefetches); a `prefetcht1` is tracked by the L2, which keeps several times as many
//! misses in flight, and the first load of the line then finds it in L2. Batch-1 decode of a
//! Llama-3.2-1B-shaped Q4_K_M file went from 19.9 to 23.8 tok/s (medians of 4 alternating
//! runs). On AMD Zen 5, L1 measured faster (the LM head at 16 rows: 8.8–9.0 ms against
//! 9.5–10.5 with L2), so the default follows the CPU's vendor ([`PrefetchLevel::best`]); a
//! program overrides it with [`PrefetchLevel::select`] (the CLI's `--prefetch`, or
//! `KILN_PREFETCH` = `l1` / `l2`, for measurements and for other CPUs).
//!
//! Invariant: a hint only. No prefetched address is dereferenced, and results never depend on
//! the level.

use std::sync::atomic::{AtomicU8, Ordering};

/// The environment variable the CLI (`--prefetch`) and the examples read to override
/// [`PrefetchLevel::best`]; the library itself reads no environment.
pub const PREFETCH_ENV: &str = "KILN_PREFETCH";

/// The cache level weight prefetches fill.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefetchLevel {
    /// `prefetcht0`: into L1 (and the levels below).
    L1,
    /// `prefetcht1`: into L2, not L1.
    L2,
}

impl std::fmt::Display for PrefetchLevel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::L1 => "l1",
            Self::L2 => "l2",
        })
    }
}

/// 0: not chosen yet; else `1 + level as u8`.
static SELECTED: AtomicU8 = AtomicU8::new(0);

impl PrefetchLevel {
    /// The level for this CPU: L2 on Intel, L1 elsewhere (see the module docs).
    pub fn best() -> Self {
        if is_intel() { Self::L2 } else { Self::L1 }
    }

    /// `l1` or `l2` (any case).
    ///
    /// # Errors
    /// Any other name.
    pub fn parse(name: &str) -> Result<Self, String> {
        match name.trim().to_ascii_lowercase().as_str() {
            "l1" => Ok(Self::L1),
            "l2" => Ok(Self::L2),
            other => Err(format!("unknown prefetch level {other:?}; expected l1 or l2")),
        }
    }

    /// The level the kernels use: the one [`Self::select`]ed, else [`Self::best`]. Fixed at
    /// the first call.
    pub fn selected() -> Self {
        match SELECTED.load(Ordering::Relaxed) {
            1 => Self::L1,
            2 => Self::L2,
            _ => Self::choose(Self::best()),
        }
    }

    /// Makes the kernels prefetch into `self` from now on; refused once they use another
    /// level (selecting the current one again is fine).
    ///
    /// # Errors
    /// Another level already in use.
    pub fn select(self) -> Result<(), String> {
        let current = Self::choose(self);
        if current == self {
            Ok(())
        } else {
            Err(format!("the kernels already prefetch into {current}, not {self}"))
        }
    }

    /// Sets the level if none is set yet; returns the level in force.
    #[cold]
    fn choose(level: Self) -> Self {
        match SELECTED.compare_exchange(0, 1 + level as u8, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => level,
            Err(1) => Self::L1,
            Err(_) => Self::L2,
        }
    }
}

/// Whether the CPU's vendor string is `GenuineIntel`.
fn is_intel() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Leaf 0: the vendor string, on every x86-64 CPU.
        let r = std::arch::x86_64::__cpuid(0);
        let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx].iter().flat_map(|v| v.to_le_bytes()).collect();
        vendor == b"GenuineIntel"
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Requests the cache line holding `p` at the [`PrefetchLevel::selected`] level.
#[inline(always)] // inlines into the `#[target_feature]` kernels
#[allow(clippy::inline_always)]
pub(crate) fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _MM_HINT_T1, _mm_prefetch};
        // SAFETY: prefetching is a hint that never faults; the address is not dereferenced.
        unsafe {
            if PrefetchLevel::selected() == PrefetchLevel::L2 {
                _mm_prefetch::<_MM_HINT_T1>(p.cast());
            } else {
                _mm_prefetch::<_MM_HINT_T0>(p.cast());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

#[cfg(test)]
mod tests {
    use super::PrefetchLevel;

    #[test]
    fn levels_parse_by_name_and_refuse_others() {
        assert_eq!(PrefetchLevel::parse("L2"), Ok(PrefetchLevel::L2));
        assert_eq!(PrefetchLevel::parse(" l1 "), Ok(PrefetchLevel::L1));
        let err = PrefetchLevel::parse("l3").unwrap_err();
        assert!(err.contains("\"l3\"") && err.contains("l1 or l2"), "{err}");
        for level in [PrefetchLevel::L1, PrefetchLevel::L2] {
            assert_eq!(PrefetchLevel::parse(&level.to_string()), Ok(level));
        }
    }
}
