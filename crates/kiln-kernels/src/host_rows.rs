//! Row moves on host `f32` buffers (`[rows, width]`), shared by the CPU and reference backends:
//! the last layer's compaction of the logits rows, the gather before the LM head and the
//! gather and weighted combine around a mixture-of-experts layer's expert matmuls, and the
//! column permutation of an act-order matrix's input, and latent attention's segment copies.

use kiln_backend::Strides;

/// Grows `buf` to at least `len` elements (new elements are zero).
pub(crate) fn reserve(buf: &mut Vec<f32>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
}

/// Moves rows `rows[i]` (ascending) of `buf` to rows `i`.
pub(crate) fn compact_rows(buf: &mut [f32], width: usize, rows: &[usize]) {
    for (i, &r) in rows.iter().enumerate() {
        debug_assert!(r >= i && (i == 0 || r > rows[i - 1]), "rows ascend");
        buf.copy_within(r * width..(r + 1) * width, i * width);
    }
}

/// `dst[d.at(i, j)..][..len] = src[s.at(i, j)..][..len]` for `i < outer`, `j < inner`.
pub(crate) fn copy_strided(
    src: &[f32],
    s: Strides,
    dst: &mut [f32],
    d: Strides,
    (outer, inner, len): (usize, usize, usize),
) {
    for i in 0..outer {
        for j in 0..inner {
            let from = s.at(i, j);
            dst[d.at(i, j)..][..len].copy_from_slice(&src[from..from + len]);
        }
    }
}

/// `dst[i] = src[rows[i]]`.
pub(crate) fn gather_rows(src: &[f32], width: usize, rows: &[usize], dst: &mut [f32]) {
    for (d, &r) in dst.chunks_exact_mut(width).zip(rows) {
        d.copy_from_slice(&src[r * width..(r + 1) * width]);
    }
}

/// `dst[t, j] = src[t, order[j]]` over rows of `order.len()`.
pub(crate) fn permute_cols(src: &[f32], order: &[usize], dst: &mut [f32]) {
    let k = order.len();
    for (d, s) in dst.chunks_exact_mut(k).zip(src.chunks_exact(k)) {
        for (d, &j) in d.iter_mut().zip(order) {
            *d = s[j];
        }
    }
}

/// `out[t] = Σ_j weights[t·k + j] · src[rows[t·k + j]]`, summed in `j` order from zero
/// (`out`: `[rows.len() / k, width]`).
pub(crate) fn combine_rows(
    src: &[f32],
    width: usize,
    k: usize,
    rows: &[usize],
    weights: &[f32],
    out: &mut [f32],
) {
    for ((o, picks), w) in
        out.chunks_exact_mut(width).zip(rows.chunks_exact(k)).zip(weights.chunks_exact(k))
    {
        o.fill(0.0);
        for (&r, &w) in picks.iter().zip(w) {
            for (acc, &x) in o.iter_mut().zip(&src[r * width..(r + 1) * width]) {
                *acc += w * x;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn combine_sums_each_tokens_picks_in_order() {
        // Three sorted rows of width 2; token 0 picks rows 2 and 0, token 1 rows 1 and 2.
        let src = [1.0, 2.0, 10.0, 20.0, 100.0, 200.0];
        let mut out = [f32::NAN; 4];
        combine_rows(&src, 2, 2, &[2, 0, 1, 2], &[0.5, 0.25, 1.0, -1.0], &mut out);
        assert_eq!(out, [50.25, 100.5, -90.0, -180.0]);
    }
}
