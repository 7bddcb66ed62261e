//! LoRA updates on rows of a linear layer's output (`Backend::lora_add`): for each row,
//! `rank` dot products of its input with the rows of `a`, then `out += tmp[j] · b_t[j]` for
//! `j` in order. Rows of one adapter, gathered from all its jobs (a decode step's sequences of
//! different adapters alternate), go through in blocks of up to [`ROW_BLOCK`], sharing each
//! load of `a` and `b_t` (prefill chunks run as a small matrix product, not row by row). The
//! matrices are kept in f32, or in f16 ([`LoraValues`]: half the memory, widened to f32
//! exactly as they are loaded); the arithmetic is f32. This file holds the scalar reference
//! (the update [`OUT_CHUNK`] outputs at a time over a pass's ranks); `x86` the AVX2 and
//! AVX-512 kernels (several ranks and output vectors per pass, for enough independent
//! multiply-adds).
//!
//! Invariant: a row's result depends on its own input and adapter alone. Every row's arithmetic
//! is the same whatever block it is in: a dot product is 16 lane sums over the input in index
//! order, reduced by one fixed tree, and the update adds `tmp[j] · b_t[j, o]` for `j` in order;
//! every multiply-add is fused (one rounding: FMA instructions on the x86 paths, `f32::mul_add`
//! on the others, the same bits). So batching, the other adapters of a step, the block a row
//! falls in, the thread count and the ISA path never change a bit of it.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;
use kiln_backend::{Backend, LoadTensorError, LoraDtype, LoraJob};

use crate::ThreadPool;
use crate::simd::SimdLevel;
use crate::thread_pool::SharedMut;

#[cfg(target_arch = "x86_64")]
mod x86;

/// Rows done together.
const ROW_BLOCK: usize = 4;
/// Ranks done per pass over a block (their dot products kept on the stack).
const RANK_CHUNK: usize = 32;
/// Lanes of a dot product's partial sums.
const LANES: usize = 16;
/// Outputs of a row the scalar reference updates together over a pass's ranks.
const OUT_CHUNK: usize = 64;

/// `x · a_row` as 16 lane sums (fused multiply-adds) in index order reduced by a fixed tree,
/// for each of `R` rows.
fn dots<const R: usize>(xs: &[&[f32]; R], a_row: &[f32]) -> [f32; R] {
    let k = a_row.len();
    let mut acc = [[0f32; LANES]; R];
    let full = k / LANES * LANES;
    for c in (0..full).step_by(LANES) {
        let a = &a_row[c..c + LANES];
        for (acc, x) in acc.iter_mut().zip(xs) {
            let x = &x[c..c + LANES];
            for l in 0..LANES {
                acc[l] = x[l].mul_add(a[l], acc[l]);
            }
        }
    }
    for (acc, x) in acc.iter_mut().zip(xs) {
        for i in full..k {
            acc[i - full] = x[i].mul_add(a_row[i], acc[i - full]);
        }
    }
    acc.map(tree)
}

/// The sum of a dot product's 16 lane sums, by one fixed tree (`l + 8`, `+ 4`, then pairs).
#[allow(clippy::inline_always)] // inlined into the x86 kernels, compiled with them
#[inline(always)]
fn tree(v: [f32; LANES]) -> f32 {
    let h: [f32; 8] = std::array::from_fn(|i| v[i] + v[i + 8]);
    let q: [f32; 4] = std::array::from_fn(|i| h[i] + h[i + 4]);
    (q[0] + q[2]) + (q[1] + q[3])
}

/// A LoRA matrix on the CPU backends, row-major, in its [`LoraDtype`].
#[derive(Clone, Debug, PartialEq)]
pub enum LoraValues {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl LoraValues {
    /// `values` kept in `dtype`; `None` if a value is not finite there.
    pub fn new(values: &[f32], dtype: LoraDtype) -> Option<Self> {
        let kept = match dtype {
            LoraDtype::F32 => Self::F32(values.to_vec()),
            LoraDtype::F16 => {
                let mut half = vec![f16::ZERO; values.len()];
                half.convert_from_f32_slice(values);
                Self::F16(half)
            }
        };
        let finite = match &kept {
            Self::F32(v) => v.iter().all(|x| x.is_finite()),
            Self::F16(v) => v.iter().all(|x| x.is_finite()),
        };
        finite.then_some(kept)
    }

    /// [`LoraValues::new`] as a backend's `load_lora_matrix`.
    pub fn load(values: &[f32], dtype: LoraDtype) -> Result<Self, LoadTensorError> {
        Self::new(values, dtype).ok_or_else(|| {
            LoadTensorError::Unsupported(format!("a LoRA value beyond {dtype:?}'s range"))
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F16(v) => v.len(),
            Self::F32(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Rows `rows` of width `width` in f32: borrowed, or widened into `buf` (at least
    /// `rows.len() * width` long).
    fn rows<'a>(&'a self, rows: Range<usize>, width: usize, buf: &'a mut [f32]) -> &'a [f32] {
        let (start, end) = (rows.start * width, rows.end * width);
        match self {
            Self::F32(v) => &v[start..end],
            Self::F16(v) => {
                let buf = &mut buf[..end - start];
                v[start..end].convert_to_f32_slice(buf);
                buf
            }
        }
    }
}

/// `out[o] += Σ_j scales[j] · slab[j, o]`, the terms fused-multiply-added in `j` order (`slab`:
/// `[scales.len(), out.len()]`), [`OUT_CHUNK`] outputs at a time in registers.
fn update(out: &mut [f32], scales: &[f32], slab: &[f32]) {
    let n = out.len();
    let full = n / OUT_CHUNK * OUT_CHUNK;
    for o0 in (0..full).step_by(OUT_CHUNK) {
        let mut acc = [0f32; OUT_CHUNK];
        acc.copy_from_slice(&out[o0..o0 + OUT_CHUNK]);
        for (j, &s) in scales.iter().enumerate() {
            let b = &slab[j * n + o0..j * n + o0 + OUT_CHUNK];
            for (a, &bv) in acc.iter_mut().zip(b) {
                *a = s.mul_add(bv, *a);
            }
        }
        out[o0..o0 + OUT_CHUNK].copy_from_slice(&acc);
    }
    for o in full..n {
        let mut acc = out[o];
        for (j, &s) in scales.iter().enumerate() {
            acc = s.mul_add(slab[j * n + o], acc);
        }
        out[o] = acc;
    }
}

/// Rows of f16 matrices widened, reused across blocks: `a` `[k]`, `b` `[RANK_CHUNK, n]`.
struct Widened {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// `out_r += (x_r · aᵀ) · b_t` for `R` rows (`x_r`: `[k]`, `out_r`: `[n]`; `a` `[rank, k]`,
/// `b_t` `[rank, n]`).
fn block<const R: usize>(
    xs: [&[f32]; R],
    (a, b_t): (&LoraValues, &LoraValues),
    rank: usize,
    mut outs: [&mut [f32]; R],
    wide: &mut Widened,
) {
    let k = xs[0].len();
    let n = outs[0].len();
    let mut tmp = [[0f32; RANK_CHUNK]; R];
    for j0 in (0..rank).step_by(RANK_CHUNK) {
        let j1 = (j0 + RANK_CHUNK).min(rank);
        for j in j0..j1 {
            let d = dots(&xs, a.rows(j..j + 1, k, &mut wide.a));
            for r in 0..R {
                tmp[r][j - j0] = d[r];
            }
        }
        let slab = b_t.rows(j0..j1, n, &mut wide.b);
        for (out, t) in outs.iter_mut().zip(&tmp) {
            update(out, &t[..j1 - j0], slab);
        }
    }
}

/// Rows `rows` of one adapter: blocks of [`ROW_BLOCK`], then one block of the rest.
fn job_rows<B: Backend<LoraMatrix = LoraValues>>(
    job: &LoraJob<'_, B>,
    rows: &[usize],
    (x, k): (&[f32], usize),
    n: usize,
    out: SharedMut<f32>,
    isa: SimdLevel,
) {
    // Buffers only where the scalar code widens a matrix kept in f16.
    let scalar = !cfg!(target_arch = "x86_64") || isa == SimdLevel::Scalar;
    let buffer = |m: &LoraValues, len: usize| match m {
        LoraValues::F16(_) if scalar => vec![0.0; len],
        _ => Vec::new(),
    };
    let wide = &mut Widened { a: buffer(job.a, k), b: buffer(job.b_t, RANK_CHUNK * n) };
    let rows_of = RowsOf { x, k, out, n };
    let blocks = rows.chunks_exact(ROW_BLOCK);
    let rest = blocks.remainder();
    for block in blocks {
        rows_of.run::<ROW_BLOCK, B>(block, job, isa, wide);
    }
    match rest.len() {
        1 => rows_of.run::<1, B>(rest, job, isa, wide),
        2 => rows_of.run::<2, B>(rest, job, isa, wide),
        3 => rows_of.run::<3, B>(rest, job, isa, wide),
        _ => {}
    }
}

/// The input and output rows of one call (`x`: `[m, k]`, `out`: `[m, n]`).
struct RowsOf<'x> {
    x: &'x [f32],
    k: usize,
    out: SharedMut<f32>,
    n: usize,
}

impl RowsOf<'_> {
    /// The block of the `R` rows `rows` (callers give each task disjoint rows).
    fn run<const R: usize, B: Backend<LoraMatrix = LoraValues>>(
        &self,
        rows: &[usize],
        job: &LoraJob<'_, B>,
        isa: SimdLevel,
        wide: &mut Widened,
    ) {
        let (k, n) = (self.k, self.n);
        let xs: [&[f32]; R] = std::array::from_fn(|i| &self.x[rows[i] * k..(rows[i] + 1) * k]);
        // SAFETY: callers give each task disjoint rows of `out`, which holds `[m, n]`.
        let outs: [&mut [f32]; R] =
            std::array::from_fn(|i| unsafe { self.out.slice(rows[i] * n, n) });
        let ab = (job.a, job.b_t);
        match isa {
            // SAFETY: `isa` is the selected level, which the CPU has (`SimdLevel::detect`).
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => unsafe { x86::block_avx512(xs, ab, job.rank, outs) },
            // SAFETY: as above; the level includes AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => unsafe { x86::block_avx2(xs, ab, job.rank, outs) },
            _ => block(xs, ab, job.rank, outs, wide),
        }
    }
}

/// The jobs of one adapter (the same matrices) gathered: their rows, in order.
struct Group<'j, 'a, B: Backend> {
    job: &'j LoraJob<'a, B>,
    rows: Vec<usize>,
}

fn gather<'j, 'a, B: Backend<LoraMatrix = LoraValues>>(
    jobs: &'j [LoraJob<'a, B>],
) -> Vec<Group<'j, 'a, B>> {
    let mut groups: Vec<Group<'j, 'a, B>> = Vec::new();
    for job in jobs {
        let same = groups
            .iter_mut()
            .find(|g| std::ptr::eq(g.job.a, job.a) && std::ptr::eq(g.job.b_t, job.b_t));
        match same {
            Some(group) => group.rows.extend(job.rows.clone()),
            None => groups.push(Group { job, rows: job.rows.clone().collect() }),
        }
    }
    groups
}

fn check<B: Backend<LoraMatrix = LoraValues>>(
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &[f32],
) {
    assert!(jobs.iter().all(|j| j.rank == 0 || k > 0));
    for job in jobs {
        assert!(job.rows.end * k <= x.len() && job.rows.end * n <= out.len());
        assert!(job.a.len() == job.rank * k && job.b_t.len() == job.rank * n);
    }
}

/// Rows per parallel task (whole blocks).
const ROWS_PER_TASK: usize = 4 * ROW_BLOCK;

/// Every job's rows, in parallel on `pool` (`x`: `[m, k]`, `out`: `[m, n]`, rows disjoint).
pub fn lora_add<B: Backend<LoraMatrix = LoraValues>>(
    pool: &ThreadPool,
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &mut [f32],
) {
    lora_add_at(SimdLevel::detect(), pool, x, (k, n), jobs, out);
}

/// [`lora_add`] at the vector width `isa` (which the CPU must have).
fn lora_add_at<B: Backend<LoraMatrix = LoraValues>>(
    isa: SimdLevel,
    pool: &ThreadPool,
    x: &[f32],
    (k, n): (usize, usize),
    jobs: &[LoraJob<'_, B>],
    out: &mut [f32],
) {
    check(x, k, n, jobs, out);
    let groups = gather(jobs);
    let tasks_of = |group: &Group<'_, '_, B>| group.rows.len().div_ceil(ROWS_PER_TASK);
    let num_tasks = groups.iter().map(tasks_of).sum();
    let out_ptr = SharedMut::new(out);
    pool.run(num_tasks, |mut task| {
        // The group holding this task (a step has a few adapters: a scan, no table).
        for group in &groups {
            if task < tasks_of(group) {
                let r0 = task * ROWS_PER_TASK;
                let rows = &group.rows[r0..(r0 + ROWS_PER_TASK).min(group.rows.len())];
                job_rows(group.job, rows, (x, k), n, out_ptr, isa);
                return;
            }
            task -= tasks_of(group);
        }
    });
}

/// [`lora_add`] on one thread without SIMD (the reference backend's; the same bits).
pub fn lora_add_scalar<B: Backend<LoraMatrix = LoraValues>>(
    x: &[f32],
    k: usize,
    n: usize,
    jobs: &[LoraJob<'_, B>],
    out: &mut [f32],
) {
    check(x, k, n, jobs, out);
    let out_ptr = SharedMut::new(out);
    for group in gather(jobs) {
        job_rows(group.job, &group.rows, (x, k), n, out_ptr, SimdLevel::Scalar);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Cpu;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761) ^ seed) % 1000)
            .map(|v| v as f32 / 500.0 - 1.0)
            .collect()
    }

    /// The values in f16, as an adapter is kept by default.
    fn half(values: &[f32]) -> LoraValues {
        LoraValues::new(values, LoraDtype::F16).unwrap()
    }

    /// The values as f32 (widened from f16 exactly).
    fn wide(m: &LoraValues) -> Vec<f32> {
        match m {
            LoraValues::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            LoraValues::F32(v) => v.clone(),
        }
    }

    /// f64 `out + (x · aᵀ) · b_t` of one row.
    fn naive(x: &[f32], a: &LoraValues, b_t: &LoraValues, rank: usize, out: &[f32]) -> Vec<f64> {
        let (a, b_t) = (wide(a), wide(b_t));
        let (k, n) = (x.len(), out.len());
        let tmp: Vec<f64> = (0..rank)
            .map(|j| (0..k).map(|i| f64::from(x[i]) * f64::from(a[j * k + i])).sum())
            .collect();
        (0..n)
            .map(|o| {
                f64::from(out[o])
                    + (0..rank).map(|j| tmp[j] * f64::from(b_t[j * n + o])).sum::<f64>()
            })
            .collect()
    }

    /// The update, a chunk of outputs at a time, adds the same terms in the same order as one
    /// pass over `out` per rank: the same bits.
    #[test]
    fn the_update_adds_the_ranks_in_order() {
        let (n, rank) = (2 * OUT_CHUNK + 13, 5);
        let (slab, scales, base) = (values(rank * n, 7), values(rank, 8), values(n, 9));
        let mut got = base.clone();
        update(&mut got, &scales, &slab);
        let mut want = base;
        for (j, s) in scales.iter().enumerate() {
            for (o, w) in want.iter_mut().enumerate() {
                *w = s.mul_add(slab[j * n + o], *w);
            }
        }
        assert_eq!(got, want);
    }

    /// Shapes off every vector width (k, n, rank not multiples of 16, blocks of 1 to 4 rows)
    /// and every pair of kept types: every vector width gives the scalar reference's bits.
    #[test]
    fn odd_shapes_match_the_scalar_reference() {
        let (k, n, rank) = (37, 45, 7);
        let lengths = [1, 2, 3, 4, 5, 6, 7];
        let m: usize = lengths.iter().sum();
        let x = values(m * k, 11);
        let base = values(m * n, 12);
        // One adapter per job (jobs of one adapter would be gathered into whole blocks).
        let raw: Vec<_> = (0..lengths.len() as u32)
            .map(|i| (values(rank * k, 13 + 2 * i), values(rank * n, 14 + 2 * i)))
            .collect();
        let pool = ThreadPool::new(2);
        for (da, db) in [
            (LoraDtype::F16, LoraDtype::F16),
            (LoraDtype::F32, LoraDtype::F32),
            (LoraDtype::F16, LoraDtype::F32),
            (LoraDtype::F32, LoraDtype::F16),
        ] {
            let kept: Vec<_> = raw
                .iter()
                .map(|(a, b)| (LoraValues::new(a, da).unwrap(), LoraValues::new(b, db).unwrap()))
                .collect();
            let mut start = 0;
            let jobs: Vec<LoraJob<'_, Cpu>> = lengths
                .iter()
                .zip(&kept)
                .map(|(&len, (a, b))| {
                    start += len;
                    LoraJob { rows: start - len..start, rank, a, b_t: b }
                })
                .collect();
            let mut scalar = base.clone();
            lora_add_scalar(&x, k, n, &jobs, &mut scalar);
            assert_ne!(scalar, base);
            for isa in SimdLevel::available() {
                let mut fast = base.clone();
                lora_add_at(isa, &pool, &x, (k, n), &jobs, &mut fast);
                assert_eq!(fast, scalar, "{isa:?} {da:?} {db:?}");
            }
        }
    }

    #[test]
    fn rows_match_f64_and_do_not_depend_on_their_neighbours() {
        let (m, k, n) = (11, 96, 40);
        let x = values(m * k, 1);
        let base = values(m * n, 2);
        let (a1, b1) = (half(&values(8 * k, 3)), half(&values(8 * n, 4)));
        let (a2, b2) = (half(&values(70 * k, 5)), half(&values(70 * n, 6)));
        let jobs = [
            LoraJob::<Cpu> { rows: 0..3, rank: 8, a: &a1, b_t: &b1 },
            LoraJob::<Cpu> { rows: 4..11, rank: 70, a: &a2, b_t: &b2 },
        ];
        let pool = ThreadPool::new(3);
        let mut out = base.clone();
        lora_add(&pool, &x, k, n, &jobs, &mut out);
        for (job, (a, b, rank)) in jobs.iter().zip([(&a1, &b1, 8), (&a2, &b2, 70)]) {
            for r in job.rows.clone() {
                let want = naive(&x[r * k..(r + 1) * k], a, b, rank, &base[r * n..(r + 1) * n]);
                for (o, w) in out[r * n..(r + 1) * n].iter().zip(want) {
                    assert!((f64::from(*o) - w).abs() < 1e-3 * (1.0 + w.abs()), "{o} {w}");
                }
            }
        }
        // Out of f16's range: refused; kept in f32, the same values give the same bits.
        assert!(LoraValues::new(&[1.0, 7e4], LoraDtype::F16).is_none());
        let f32s = |m: &LoraValues| LoraValues::new(&wide(m), LoraDtype::F32).unwrap();
        let (a1w, b1w, a2w, b2w) = (f32s(&a1), f32s(&b1), f32s(&a2), f32s(&b2));
        let wide_jobs = [
            LoraJob::<Cpu> { rows: 0..3, rank: 8, a: &a1w, b_t: &b1w },
            LoraJob::<Cpu> { rows: 4..11, rank: 70, a: &a2w, b_t: &b2w },
        ];
        let mut kept_f32 = base.clone();
        lora_add(&pool, &x, k, n, &wide_jobs, &mut kept_f32);
        assert_eq!(kept_f32, out);
        // The same rows as single-row jobs that alternate between the adapters (gathered into
        // blocks per adapter): the same bits.
        let mut alternating = base.clone();
        let singles: Vec<LoraJob<'_, Cpu>> = [4, 0, 5, 1, 6, 2, 7, 8, 9, 10]
            .into_iter()
            .map(|r| match r {
                0..3 => LoraJob { rows: r..r + 1, rank: 8, a: &a1, b_t: &b1 },
                _ => LoraJob { rows: r..r + 1, rank: 70, a: &a2, b_t: &b2 },
            })
            .collect();
        lora_add(&pool, &x, k, n, &singles, &mut alternating);
        assert_eq!(alternating, out);
        // Row 3 has no adapter: untouched.
        assert_eq!(out[3 * n..4 * n], base[3 * n..4 * n]);
        // The reference (no SIMD, one thread) gives the same bits.
        let mut scalar = base.clone();
        lora_add_scalar(&x, k, n, &jobs, &mut scalar);
        assert_eq!(scalar, out);
        // Each row alone, on one thread, gives the same bits.
        for (job, (a, b, rank)) in jobs.iter().zip([(&a1, &b1, 8), (&a2, &b2, 70)]) {
            for r in job.rows.clone() {
                let mut alone = base[r * n..(r + 1) * n].to_vec();
                let one = [LoraJob::<Cpu> { rows: 0..1, rank, a, b_t: b }];
                lora_add(&ThreadPool::new(1), &x[r * k..(r + 1) * k], k, n, &one, &mut alone);
                assert_eq!(alone, out[r * n..(r + 1) * n]);
            }
        }
    }
}
