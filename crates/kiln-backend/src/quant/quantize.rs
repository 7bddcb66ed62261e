//! f32 → GGUF blocks (quantize-on-load), for every type in [`GgmlType::WRITABLE`].
//!
//! Q8_0, Q4_0 and Q5_0 follow ggml's reference quantizers (Q8_0 is bit-exact with it). The
//! K-quants fit each sub-block's scale (and min) by a small search over candidate scales with a
//! least-squares refit, like ggml's `make_qkx2_quants`, then quantize the sub-block scales to
//! 6 bits (Q4_K/Q5_K) or 8 bits (Q6_K) and re-round every element against the stored scales.

use half::{bf16, f16};

use super::fit::{fit_scale_min_8, round_half_away};
use super::formats::{GgmlType, QK, QK_K};

/// Quantizes one row: `src` (`[cols]`, a multiple of `ty.block_elems()`) into `dst`
/// (`ty.row_bytes(cols)` bytes). Panics when the lengths do not match or `ty` is not in
/// [`GgmlType::WRITABLE`].
pub fn quantize_row(ty: GgmlType, src: &[f32], dst: &mut [u8]) {
    assert!(
        ty.row_bytes(src.len()) == Some(dst.len()),
        "quantize_row: {} elements do not fill {} bytes of {ty}",
        src.len(),
        dst.len()
    );
    let blocks = src.chunks_exact(ty.block_elems()).zip(dst.chunks_exact_mut(ty.block_bytes()));
    match ty {
        GgmlType::F32 => blocks.for_each(|(x, b)| b.copy_from_slice(&x[0].to_le_bytes())),
        GgmlType::F16 => {
            blocks.for_each(|(x, b)| b.copy_from_slice(&f16::from_f32(x[0]).to_le_bytes()));
        }
        GgmlType::Bf16 => {
            blocks.for_each(|(x, b)| b.copy_from_slice(&bf16::from_f32(x[0]).to_le_bytes()));
        }
        GgmlType::Q8_0 => blocks.for_each(|(x, b)| quantize_q8_0(x, b)),
        GgmlType::Q4_0 => blocks.for_each(|(x, b)| quantize_qx_0(x, b, false)),
        GgmlType::Q5_0 => blocks.for_each(|(x, b)| quantize_qx_0(x, b, true)),
        GgmlType::Q4K => blocks.for_each(|(x, b)| quantize_k45(x, b, false)),
        GgmlType::Q5K => blocks.for_each(|(x, b)| quantize_k45(x, b, true)),
        GgmlType::Q6K => blocks.for_each(|(x, b)| quantize_q6_k(x, b)),
        _ => panic!("quantize_row: kiln reads {ty} files but does not write {ty}"),
    }
}

fn put_f16(b: &mut [u8], v: f32) -> f32 {
    let h = f16::from_f32(v);
    b[..2].copy_from_slice(&h.to_le_bytes());
    h.to_f32()
}

fn quantize_q8_0(x: &[f32], b: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    put_f16(b, d);
    for (q, v) in b[2..].iter_mut().zip(x) {
        *q = ((v * id).round() as i8).cast_unsigned();
    }
}

/// Q4_0 (`five_bits == false`) and Q5_0: the value of largest magnitude maps to −8 (−16).
fn quantize_qx_0(x: &[f32], b: &mut [u8], five_bits: bool) {
    let max = x.iter().fold(0.0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
    let (half_range, top) = if five_bits { (16.0, 31) } else { (8.0, 15) };
    let d = max / -half_range;
    let id = if d == 0.0 { 0.0 } else { 1.0 / d };
    put_f16(b, d);
    let q = |v: f32| ((v * id + half_range + 0.5) as u8).min(top);
    if five_bits {
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let (lo, hi) = (q(x[j]), q(x[j + 16]));
            b[6 + j] = (lo & 0xF) | ((hi & 0xF) << 4);
            qh |= u32::from(lo >> 4) << j | u32::from(hi >> 4) << (j + 16);
        }
        b[2..6].copy_from_slice(&qh.to_le_bytes());
    } else {
        for j in 0..QK / 2 {
            b[2 + j] = q(x[j]) | (q(x[j + 16]) << 4);
        }
    }
}

/// Q4_K (`five_bits == false`) and Q5_K.
fn quantize_k45(x: &[f32], b: &mut [u8], five_bits: bool) {
    let nmax = if five_bits { 31 } else { 15 };
    let (scales, mins) = fit_scale_min_8(x, nmax);
    let max_scale = scales.iter().fold(0.0f32, |a, v| a.max(*v));
    let max_min = mins.iter().fold(0.0f32, |a, v| a.max(*v));
    let d = put_f16(&mut b[0..2], max_scale / 63.0);
    let dmin = put_f16(&mut b[2..4], max_min / 63.0);
    let q6 = |v: f32, d: f32| if d > 0.0 { (v / d).round().clamp(0.0, 63.0) as u8 } else { 0 };
    let sc: [u8; 8] = std::array::from_fn(|s| q6(scales[s], d));
    let m: [u8; 8] = std::array::from_fn(|s| q6(mins[s], dmin));
    let packed = &mut b[4..16];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    let mut levels = [0u8; QK_K];
    for s in 0..8 {
        let (dl, ml) = (d * f32::from(sc[s]), dmin * f32::from(m[s]));
        for l in 0..QK {
            let v = x[s * QK + l];
            levels[s * QK + l] = if dl > 0.0 {
                round_half_away((v + ml) / dl).clamp(0.0, f32::from(nmax)) as u8
            } else {
                0
            };
        }
    }
    let qs_at = if five_bits { 48 } else { 16 };
    if five_bits {
        let qh = &mut b[16..48];
        qh.fill(0);
        for (e, lv) in levels.iter().enumerate() {
            qh[e % QK] |= (lv >> 4) << (e / QK);
        }
    }
    let qs = &mut b[qs_at..qs_at + QK_K / 2];
    for c in 0..4 {
        for l in 0..QK {
            qs[c * QK + l] =
                (levels[2 * c * QK + l] & 0xF) | ((levels[(2 * c + 1) * QK + l] & 0xF) << 4);
        }
    }
}

fn quantize_q6_k(x: &[f32], b: &mut [u8]) {
    // Per 16-element sub-block: a signed scale mapping the largest-magnitude value to -32.
    let mut scales = [0.0f32; 16];
    for (s, scale) in scales.iter_mut().enumerate() {
        let xs = &x[s * 16..(s + 1) * 16];
        let max = xs.iter().fold(0.0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
        *scale = max / -32.0;
    }
    let max_scale = scales.iter().fold(0.0f32, |m, v| if v.abs() > m.abs() { *v } else { m });
    let d = put_f16(&mut b[208..210], max_scale / -128.0);
    let mut sc = [0i8; 16];
    for (s, scale) in scales.iter().enumerate() {
        sc[s] = if d == 0.0 { 0 } else { (scale / d).round().clamp(-128.0, 127.0) as i8 };
        b[192 + s] = sc[s].cast_unsigned();
    }
    let mut levels = [0u8; QK_K];
    for (e, v) in x.iter().enumerate() {
        let dl = d * f32::from(sc[e / 16]);
        levels[e] = if dl == 0.0 { 32 } else { ((v / dl).round().clamp(-32.0, 31.0) + 32.0) as u8 };
    }
    b[..192].fill(0);
    for h in 0..2 {
        let lv = &levels[128 * h..128 * h + 128];
        for l in 0..32 {
            let q = [lv[l], lv[l + 32], lv[l + 64], lv[l + 96]];
            b[64 * h + l] = (q[0] & 0xF) | ((q[2] & 0xF) << 4);
            b[64 * h + l + 32] = (q[1] & 0xF) | ((q[3] & 0xF) << 4);
            b[128 + 32 * h + l] =
                (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}
