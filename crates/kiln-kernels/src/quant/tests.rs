use super::formats::set_f16_scale;
use super::*;
use crate::testing::values;
use crate::thread_pool::SharedMut;
use crate::{LinearJob, ThreadPool, WeightData, WeightMatrix, linear, linear_multi};
use kiln_backend::Storage;

/// Roughly Gaussian values (sum of 4 uniforms, unit variance).
fn gaussian(n: usize, seed: u64) -> Vec<f32> {
    let parts: Vec<Vec<f32>> = (0..4).map(|i| values(n, seed * 7 + i, 1.0)).collect();
    (0..n).map(|j| parts.iter().map(|p| p[j]).sum::<f32>() * 3.0f32.sqrt()).collect()
}

/// A `[rows, cols]` matrix of `ty`: Gaussian weights quantized by kiln for the types it
/// writes, random blocks with sane scales ([`file_rows`]) for the types it only reads.
fn quantized(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> (Vec<u8>, QuantMatrix) {
    let bytes = if GgmlType::WRITABLE.contains(&ty) {
        let w = gaussian(rows * cols, seed);
        let rb = ty.row_bytes(cols).unwrap();
        let mut bytes = vec![0u8; rows * rb];
        for (src, dst) in w.chunks_exact(cols).zip(bytes.chunks_exact_mut(rb)) {
            quantize_row(ty, src, dst);
        }
        bytes
    } else {
        file_rows(ty, rows, cols, seed)
    };
    let q = QuantMatrix::from_bytes(ty, rows, cols, &bytes).unwrap();
    (bytes, q)
}

/// Rows of random blocks of `ty` with scales of about `1 / 64` (MXFP4: exponents around 2⁻⁶),
/// as a file of that type holds (the other bytes, levels and sub-block scales, are any bytes).
fn file_rows(ty: GgmlType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> =
        values(rows * rb, seed, 1.0).iter().map(|v| ((v + 0.5) * 255.99) as u8).collect();
    for (i, block) in bytes.chunks_exact_mut(ty.block_bytes()).enumerate() {
        let scale = half::f16::from_f32((1.0 + (i % 7) as f32 / 8.0) / 64.0).to_le_bytes();
        set_f16_scale(ty, block, scale);
        if ty == GgmlType::Mxfp4 {
            block[0] = 119 + (i % 5) as u8;
        }
    }
    bytes
}

#[test]
fn type_table() {
    for ty in GgmlType::ALL {
        assert_eq!(GgmlType::from_gguf_id(ty.gguf_id()), Some(ty));
    }
    assert_eq!(GgmlType::from_gguf_id(16), Some(GgmlType::Iq2Xxs));
    assert_eq!(GgmlType::from_gguf_id(36), None); // IQ4_NL_4_4, a removed repacking
    assert_eq!(GgmlType::Iq1M.row_bytes(512), Some(112));
    assert_eq!(GgmlType::Tq1_0.block_bytes(), 54);
    assert_eq!(GgmlType::Iq3S.name(), "iq3_s");
    for &ty in GgmlType::CODEBOOK {
        assert!(GgmlType::QUANTIZED.contains(&ty) && !GgmlType::WRITABLE.contains(&ty), "{ty}");
        assert_eq!(ty.block_elems(), QK_K, "{ty}");
    }
    assert_eq!(GgmlType::Iq4Xs.row_bytes(512), Some(272));
    assert_eq!(GgmlType::Mxfp4.row_bytes(64), Some(34));
    assert_eq!(GgmlType::Q4K.name(), "q4_K");
    assert_eq!(GgmlType::Q6K.block_bytes(), 210);
    assert_eq!(GgmlType::Q5_0.row_bytes(64), Some(44));
    assert_eq!(GgmlType::Q4K.row_bytes(255), None);
    assert_eq!(GgmlType::F16.row_bytes(3), Some(6));
    assert_eq!(GgmlType::Q8_0.row_bytes(usize::MAX / 32 * 32), None);
}

/// Dequantization and Q8_0 quantization equal gguf-py's (llama.cpp's Python package) exactly;
/// see scripts/fixtures/make_quant_fixtures.py. `KILN_QUANT_FIXTURE` may name another file in
/// the same format (e.g. blocks extracted from a real model during development).
#[test]
fn fixture_matches_gguf_py() {
    let default = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/quant/dequant.bin");
    let custom = std::env::var("KILN_QUANT_FIXTURE").ok();
    let data = std::fs::read(custom.as_deref().unwrap_or(default)).unwrap();
    assert_eq!(&data[..4], b"KQF1");
    let u32_at = |at: usize| u32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize;
    let mut at = 8;
    let mut seen = Vec::new();
    for _ in 0..u32_at(4) {
        let (kind, id, nb, len) = (u32_at(at), u32_at(at + 4), u32_at(at + 8), u32_at(at + 12));
        at += 16;
        let ty = GgmlType::from_gguf_id(id as u32).unwrap();
        let bytes = &data[at..at + len];
        at += len;
        let n = nb * ty.block_elems();
        let want: Vec<f32> = data[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        at += 4 * n;
        if kind == 0 {
            let mut got = vec![0.0; n];
            dequantize_row(ty, bytes, &mut got);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g.to_bits(), w.to_bits(), "{ty} element {i}: {g} vs {w}");
            }
            // The repacked form dequantizes to the same bits, as one row or as several.
            for rows in [1, nb.min(2)] {
                let q = QuantMatrix::from_bytes(ty, rows, n / rows, bytes).unwrap();
                for r in 0..rows {
                    let mut row = vec![0.0; n / rows];
                    q.row_to_f32(r, &mut row);
                    assert_eq!(row, got[r * n / rows..(r + 1) * n / rows], "{ty} repacked row {r}");
                }
            }
            seen.push(ty);
        } else {
            let mut got = vec![0u8; len];
            quantize_row(ty, &want, &mut got);
            assert_eq!(got, bytes, "{ty} quantization");
        }
    }
    if custom.is_none() {
        assert_eq!(seen.len(), GgmlType::QUANTIZED.len());
    }
}

#[test]
fn quantize_round_trip_error_is_small() {
    let cols = 512;
    let x = gaussian(8 * cols, 3);
    for (ty, bound) in [
        (GgmlType::Q8_0, 0.01),
        (GgmlType::Q5_0, 0.06),
        (GgmlType::Q4_0, 0.12),
        (GgmlType::Q4K, 0.12),
        (GgmlType::Q5K, 0.06),
        (GgmlType::Q6K, 0.03),
        (GgmlType::F16, 0.001),
    ] {
        let rb = ty.row_bytes(cols).unwrap();
        let (mut err, mut norm) = (0.0f64, 0.0f64);
        for row in x.chunks_exact(cols) {
            let mut bytes = vec![0u8; rb];
            quantize_row(ty, row, &mut bytes);
            let mut back = vec![0.0; cols];
            dequantize_row(ty, &bytes, &mut back);
            for (a, b) in row.iter().zip(&back) {
                err += f64::from(a - b).powi(2);
                norm += f64::from(*a).powi(2);
            }
        }
        let rel = (err / norm).sqrt();
        assert!(rel < bound, "{ty}: relative RMSE {rel} >= {bound}");
    }
    // Degenerate blocks: all zero, one spike, constant.
    let mut x = vec![0.0f32; 256];
    x[7] = 5.0;
    for ty in GgmlType::WRITABLE.into_iter().filter(|t| t.is_quantized()) {
        for input in [vec![0.0f32; 256], x.clone(), vec![0.25f32; 256]] {
            let mut bytes = vec![0u8; ty.row_bytes(256).unwrap()];
            quantize_row(ty, &input, &mut bytes);
            let mut back = vec![0.0; 256];
            dequantize_row(ty, &bytes, &mut back);
            for (a, b) in input.iter().zip(&back) {
                assert!((a - b).abs() <= 0.03 * (1.0 + a.abs()), "{ty}: {a} -> {b}");
            }
        }
    }
}

/// f64 reference: `x[m, k] · w[n, k]ᵀ`.
fn reference(x: &[f32], m: usize, w: &[f32], n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0.0; m * n];
    for i in 0..m {
        for j in 0..n {
            out[i * n + j] =
                (0..k).map(|c| f64::from(x[i * k + c]) * f64::from(w[j * k + c])).sum::<f64>();
        }
    }
    out
}

fn dequantized(q: &QuantMatrix) -> Vec<f32> {
    let mut w = vec![0.0; q.rows() * q.cols()];
    for (r, row) in w.chunks_exact_mut(q.cols()).enumerate() {
        q.row_to_f32(r, row);
    }
    w
}

fn run(isa: crate::CpuIsa, acts: &QuantActs, q: &QuantMatrix) -> Vec<f32> {
    let mut out = vec![f32::NAN; acts.m * q.rows()];
    qgemm_groups(isa, acts, q, 0..q.rows().div_ceil(16), SharedMut::new(&mut out));
    out
}

const SHAPE_TYPES: &[GgmlType] = GgmlType::QUANTIZED;

#[test]
fn every_isa_matches_scalar_bitwise_and_the_f32_reference() {
    let pool = ThreadPool::new(2);
    for &ty in SHAPE_TYPES {
        let ks: &[usize] = if ty.block_elems() == 256 { &[256, 768] } else { &[32, 352] };
        for &k in ks {
            for n in [1usize, 17, 40] {
                let (_, q) = quantized(ty, n, k, n as u64 + k as u64);
                let w = dequantized(&q);
                for m in [1usize, 2, 3, 4, 6, 17, 64, 65, 130, 300] {
                    let x = values(m * k, m as u64 + 5, 2.0);
                    let mut acts = QuantActs::default();
                    acts.quantize(&pool, &x, m, k, q.act_block());
                    let want = run(crate::CpuIsa::Scalar, &acts, &q);
                    for isa in crate::CpuIsa::available() {
                        let got = run(isa, &acts, &q);
                        let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{ty} {isa:?} m={m} n={n} k={k} differs from scalar");
                    }
                    // Against f64 on the dequantized weights and the dequantized activations.
                    let xq: Vec<f32> = (0..m * k)
                        .map(|e| f32::from(acts.qs[e]) * acts.d[e / q.act_block()])
                        .collect();
                    let exact = reference(&xq, m, &w, n, k);
                    let loose = reference(&x, m, &w, n, k);
                    let scale: Vec<f64> = {
                        let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
                        let wa: Vec<f32> = w.iter().map(|v| v.abs()).collect();
                        reference(&xa, m, &wa, n, k)
                    };
                    for e in 0..m * n {
                        let g = f64::from(want[e]);
                        assert!(
                            (g - exact[e]).abs() <= 2e-5 * scale[e] + 1e-6,
                            "{ty} m={m} n={n} k={k} [{e}]: {g} vs {}",
                            exact[e]
                        );
                        assert!(
                            (g - loose[e]).abs() <= 0.02 * scale[e] + 1e-4,
                            "{ty} m={m} n={n} k={k} [{e}]: {g} vs unquantized {}",
                            loose[e]
                        );
                    }
                }
            }
        }
    }
}

/// Raw GGUF rows of `ty` whose levels hit the extremes the kernels' 16-bit sums must survive
/// (row 0: every level byte `0xFF`, row 1: `0x80`, the rest pseudo-random), with every f16
/// scale 1.0 so no block is NaN or infinite.
fn extreme_rows(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    let rb = ty.row_bytes(cols).unwrap();
    let mut bytes: Vec<u8> =
        values(rows * rb, 77, 1.0).iter().map(|v| ((v + 0.5) * 255.99) as u8).collect();
    bytes[..rb].fill(0xFF);
    bytes[rb..2 * rb].fill(0x80);
    let one = half::f16::ONE.to_le_bytes();
    for block in bytes.chunks_exact_mut(ty.block_bytes()) {
        set_f16_scale(ty, block, one);
        if ty == GgmlType::Mxfp4 {
            block[0] = 128; // d = 1
        }
    }
    bytes
}

/// `[m, k]` activations whose first rows (up to 3) are all +1, all −1 and alternating ±1:
/// they quantize to ±127 in every block, the largest products there are.
fn extreme_activations(m: usize, k: usize) -> Vec<f32> {
    let mut x = values(m * k, 3, 2.0);
    for (j, v) in x[..m.min(3) * k].iter_mut().enumerate() {
        let alternating = if j % 2 == 0 { 1.0 } else { -1.0 };
        *v = [1.0, -1.0, alternating][j / k];
    }
    x
}

#[test]
fn extreme_levels_and_activations_match_scalar_bitwise_on_every_isa() {
    let pool = ThreadPool::new(2);
    for &ty in SHAPE_TYPES {
        let k = if ty.block_elems() == 256 { 512 } else { 352 };
        let n = 19;
        let q = QuantMatrix::from_bytes(ty, n, k, &extreme_rows(ty, n, k)).unwrap();
        // Up to 4 rows take AVX2's decode tiles, which build the levels from the record in
        // registers; 9 rows take the unpacked ones (tiles of 4, 4 and 1); 16 and 33 rows AMX's
        // tiles where the CPU has them (Q4_K's with its scales folded into the levels).
        for m in [1, 2, 4, 9, 16, 33] {
            let x = extreme_activations(m, k);
            let mut acts = QuantActs::default();
            acts.quantize(&pool, &x, m, k, q.act_block());
            let want = run(crate::CpuIsa::Scalar, &acts, &q);
            assert!(want.iter().all(|v| v.is_finite()), "{ty}: the fixture overflowed");
            for isa in crate::CpuIsa::available() {
                let got = run(isa, &acts, &q);
                let same = got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{ty} {isa:?} m={m}: extreme levels differ from scalar");
            }
        }
    }
}

#[test]
fn rows_alone_equal_rows_in_a_batch_bitwise() {
    let pool = ThreadPool::new(2);
    for &ty in SHAPE_TYPES {
        let k = if ty.block_elems() == 256 { 512 } else { 96 };
        let n = 21;
        let (_, q) = quantized(ty, n, k, 9);
        let m = 70;
        let x = values(m * k, 4, 2.0);
        for isa in crate::CpuIsa::available() {
            let mut acts = QuantActs::default();
            acts.quantize(&pool, &x, m, k, q.act_block());
            let batch = run(isa, &acts, &q);
            for r in [0, 1, 33, 63, 64, 69] {
                acts.quantize(&pool, &x[r * k..(r + 1) * k], 1, k, q.act_block());
                let alone = run(isa, &acts, &q);
                assert_eq!(alone, batch[r * n..(r + 1) * n], "{ty} {isa:?} row {r}");
            }
        }
    }
}

#[test]
fn linear_takes_quantized_weights_transparently() {
    let pool = ThreadPool::new(2);
    let k = 512;
    let m = 5;
    let x = values(m * k, 8, 2.0);
    let float = WeightMatrix::new(70, k, WeightData::F32(gaussian(70 * k, 1).into())).unwrap();
    let mut mats: Vec<WeightMatrix> =
        GgmlType::WRITABLE.iter().map(|ty| float.quantize(*ty).unwrap()).collect();
    for &ty in GgmlType::QUANTIZED.iter().filter(|t| !GgmlType::WRITABLE.contains(t)) {
        let bytes = file_rows(ty, 70, k, 11);
        mats.push(WeightMatrix::from_quantized(70, k, ty, bytes.into()).unwrap());
    }
    let bias = values(70, 2, 1.0);
    for w in &mats {
        let wf: Vec<f32> = (0..70)
            .flat_map(|r| {
                let mut v = vec![0.0; k];
                w.row_to_f32(r, &mut v);
                v
            })
            .collect();
        let want = reference(&x, m, &wf, 70, k);
        let xa: Vec<f32> = x.iter().map(|v| v.abs()).collect();
        let wa: Vec<f32> = wf.iter().map(|v| v.abs()).collect();
        let scale = reference(&xa, m, &wa, 70, k);
        let mut out = vec![f32::NAN; m * 70];
        linear(&pool, &x, m, w, Some(&bias), &mut out);
        for e in 0..m * 70 {
            let g = f64::from(out[e]) - f64::from(bias[e % 70]);
            let what = w.data().dtype_name();
            assert!((g - want[e]).abs() < 0.01 * scale[e], "{what} [{e}]: {g} vs {}", want[e]);
        }
        assert!(w.data().num_bytes() > 0);
    }
    // Mixed jobs in one dispatch give the same as separate calls.
    let mut outs: Vec<Vec<f32>> = vec![vec![0.0; m * 70]; 4];
    let picks = [3usize, 6, 8, 0];
    {
        let mut jobs: Vec<LinearJob<'_>> = outs
            .iter_mut()
            .zip(picks)
            .map(|(out, i)| LinearJob { weight: &mats[i], bias: None, out })
            .collect();
        linear_multi(&pool, &x, m, &mut jobs);
    }
    for (out, i) in outs.iter().zip(picks) {
        let mut alone = vec![0.0; m * 70];
        linear(&pool, &x, m, &mats[i], None, &mut alone);
        assert_eq!(*out, alone, "{}", mats[i].data().dtype_name());
    }
}

#[test]
fn from_quantized_checks_sizes_and_maps_floats() {
    assert!(WeightMatrix::from_quantized(2, 32, GgmlType::Q8_0, vec![0u8; 67].into()).is_none());
    assert!(WeightMatrix::from_quantized(2, 33, GgmlType::Q8_0, vec![0u8; 68].into()).is_none());
    let w = WeightMatrix::from_quantized(2, 32, GgmlType::Q8_0, vec![0u8; 68].into()).unwrap();
    assert_eq!(w.data().dtype_name(), "q8_0");
    // f32 data at an odd offset of a mapped file is copied; at an aligned one it is viewed.
    let path = std::env::temp_dir().join(format!("kiln-quant-test-{}.bin", std::process::id()));
    let vals: Vec<f32> = values(8, 1, 1.0);
    let mut bytes = vec![0u8; 5];
    bytes.extend(vals.iter().flat_map(|v| v.to_le_bytes()));
    std::fs::write(&path, &bytes).unwrap();
    let file = std::sync::Arc::new(crate::MappedFile::open(&path).unwrap());
    std::fs::remove_file(&path).unwrap();
    let odd = Storage::Mapped { file: file.clone(), byte_offset: 5, len: 32 };
    let w = WeightMatrix::from_quantized(2, 4, GgmlType::F32, odd).unwrap();
    let mut row = vec![0.0; 4];
    w.row_to_f32(1, &mut row);
    assert_eq!(row, vals[4..]);
    assert!(matches!(w.data(), WeightData::F32(Storage::Owned(_))));
    let aligned = Storage::Mapped { file, byte_offset: 8, len: 28 };
    let w = WeightMatrix::from_quantized(1, 14, GgmlType::F16, aligned).unwrap();
    assert!(matches!(w.data(), WeightData::F16(Storage::Mapped { .. })));
    // quantize() rejects columns that are not whole blocks.
    let f = WeightMatrix::new(1, 96, WeightData::F32(vec![0.0; 96].into())).unwrap();
    assert!(f.quantize(GgmlType::Q4K).is_err());
    assert!(f.quantize(GgmlType::Q8_0).is_ok());
}

/// Vocabulary-sized outputs go out with non-temporal stores (`kernel::stream_output`); the
/// values must be those of ordinary stores: each row equals the row computed alone.
#[test]
fn streamed_outputs_equal_rows_alone_bitwise() {
    let pool = ThreadPool::new(2);
    let (k, n, m) = (32, 1 << 16, 64);
    let (_, q) = quantized(GgmlType::Q8_0, n, k, 5);
    let x = values(m * k, 6, 2.0);
    let mut acts = QuantActs::default();
    for isa in crate::CpuIsa::available() {
        acts.quantize(&pool, &x, m, k, q.act_block());
        // A 64-byte aligned output, as the streaming stores need.
        let mut buf = vec![f32::NAN; m * n + 15];
        let start = buf.as_ptr().align_offset(64);
        let out = &mut buf[start..start + m * n];
        qgemm_groups(isa, &acts, &q, 0..n / 16, SharedMut::new(out));
        for r in [0, 17, 63] {
            acts.quantize(&pool, &x[r * k..(r + 1) * k], 1, k, q.act_block());
            let alone = run(isa, &acts, &q);
            assert_eq!(alone, out[r * n..(r + 1) * n], "{isa:?} row {r}");
        }
    }
}
