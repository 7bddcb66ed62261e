//! Software prefetch of weight bytes spread over the arithmetic that runs meanwhile.
//!
//! The register tiles of `pairs` compute about as fast as two cores stream weights from
//! memory, so a memory-bound call (the LM head at decode: 178 MB of Q8_0 for a 262k
//! vocabulary) is only as fast as streaming and arithmetic overlap. Requesting a whole record
//! at the start of a unit (`kernel::prefetch_record`) issues some 70 requests in one burst;
//! the burst's loads stalled the arithmetic, and the LM head at 16 rows took about the sum of
//! its streaming and its arithmetic. Here the bytes a unit requests are cut into parts per row
//! tile ([`Prefetch::part`]) and each part into a few lines per block ([`PrefetchSteps`]), so
//! requests stay in flight all along (AMD Zen 5, 2 threads: the LM head at 16 rows 9.7–13.0 →
//! 4.9–5.2 ms, at 8 rows 9.2–10.8 → 5.3–6.4 ms).
//!
//! Invariant: prefetching is a hint. No address is dereferenced, ranges are clipped to the
//! matrix's data, and results never depend on what is requested or when.

use super::QuantMatrix;
use crate::prefetch_level::prefetch_line;

/// Whole cache lines of a weight matrix's data to request into the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Prefetch {
    /// First cache line of the range (64-byte aligned; never dereferenced).
    start: *const u8,
    /// Cache lines in the range.
    lines: usize,
}

impl Prefetch {
    /// Requests nothing.
    pub(crate) const NONE: Self = Self { start: std::ptr::null(), lines: 0 };

    /// The cache lines holding bytes `lo..hi` of `w`'s data (clipped to it).
    pub(crate) fn bytes(w: &QuantMatrix, lo: usize, hi: usize) -> Self {
        let total = w.data.len() * 64;
        let (lo, hi) = (lo.min(total) / 64, hi.min(total).div_ceil(64));
        let start = w.data.as_ptr().cast::<u8>().wrapping_add(lo * 64);
        Self { start, lines: hi.saturating_sub(lo) }
    }

    /// Part `i` of `parts` near-equal parts, in order: every line is in exactly one part.
    pub(crate) fn part(self, i: usize, parts: usize) -> Self {
        let (lo, hi) = (self.lines * i / parts, self.lines * (i + 1) / parts);
        Self { start: self.start.wrapping_add(lo * 64), lines: hi - lo }
    }

    /// A cursor that requests this range over `steps` calls of [`PrefetchSteps::step`].
    #[inline(always)] // inlines into the `#[target_feature]` tiles
    #[allow(clippy::inline_always)]
    pub(crate) fn steps(self, steps: usize) -> PrefetchSteps {
        let per_step = if self.lines == 0 { 0 } else { self.lines.div_ceil(steps.max(1)) };
        PrefetchSteps { rest: self, per_step }
    }

    /// Requests the range (at the level of [`crate::PrefetchLevel::selected`]).
    #[inline(always)] // inlines into the `#[target_feature]` tiles
    #[allow(clippy::inline_always)]
    pub(crate) fn issue(self) {
        for l in 0..self.lines {
            prefetch_line(self.start.wrapping_add(l * 64));
        }
    }
}

/// Requests a [`Prefetch`] range a few lines per call, in order, without a division per call.
#[derive(Clone, Copy)]
pub(crate) struct PrefetchSteps {
    /// What is still to request.
    rest: Prefetch,
    per_step: usize,
}

impl PrefetchSteps {
    /// Requests the next lines of the range (none once it is all requested) and returns them.
    #[inline(always)] // inlines into the `#[target_feature]` tiles
    #[allow(clippy::inline_always)]
    pub(crate) fn step(&mut self) -> Prefetch {
        if self.rest.lines == 0 {
            return Prefetch::NONE;
        }
        let now = Prefetch { start: self.rest.start, lines: self.per_step.min(self.rest.lines) };
        now.issue();
        self.rest.start = self.rest.start.wrapping_add(now.lines * 64);
        self.rest.lines -= now.lines;
        now
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgmlType;

    /// The line indices (from the start of `w`'s data) a range covers.
    fn lines(w: &QuantMatrix, p: Prefetch) -> Vec<usize> {
        let base = w.data.as_ptr() as usize;
        (0..p.lines).map(|l| (p.start as usize - base) / 64 + l).collect()
    }

    #[test]
    fn parts_and_steps_request_every_line_once_in_order() {
        let row_bytes = GgmlType::Q8_0.row_bytes(256).expect("whole blocks");
        let w = QuantMatrix::from_bytes(GgmlType::Q8_0, 64, 256, &vec![0; 64 * row_bytes])
            .expect("shape");
        let total = w.data.len();
        let whole = Prefetch::bytes(&w, 100, 64 * 20 + 1);
        assert_eq!(lines(&w, whole), (1..21).collect::<Vec<_>>());
        assert_eq!(Prefetch::bytes(&w, 0, usize::MAX).lines, total, "clipped to the data");
        assert_eq!(Prefetch::bytes(&w, usize::MAX, usize::MAX).lines, 0);
        for parts in [1, 3, 4, 7, 20, 33] {
            for steps in [1, 2, 8, 16, 40] {
                let mut seen = Vec::new();
                for i in 0..parts {
                    let mut cursor = whole.part(i, parts).steps(steps);
                    for _ in 0..steps {
                        seen.extend(lines(&w, cursor.step()));
                    }
                    assert_eq!(cursor.step().lines, 0, "done after {steps} steps");
                }
                assert_eq!(seen, lines(&w, whole), "parts={parts} steps={steps}");
            }
        }
        assert_eq!(Prefetch::NONE.steps(8).step().lines, 0);
    }
}
