//! Row moves on host `f32` buffers (`[rows, width]`), shared by the CPU and reference backends:
//! the last layer's compaction of the logits rows and the gather before the LM head.

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

/// `dst[i] = src[rows[i]]`.
pub(crate) fn gather_rows(src: &[f32], width: usize, rows: &[usize], dst: &mut [f32]) {
    for (d, &r) in dst.chunks_exact_mut(width).zip(rows) {
        d.copy_from_slice(&src[r * width..(r + 1) * width]);
    }
}
