use kiln_backend::GgmlType;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::json;

use super::*;

/// AWQ's packing order (the inverse of [`AWQ_NIBBLE`]): nibble `k` of a word holds column
/// `8c + AWQ_ORDER[k]`.
const AWQ_ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];

fn quant(q: &Value) -> Result<PackedQuant, String> {
    PackedQuant::from_json(q)
}

#[test]
fn reads_awq_and_gptq_configs_in_their_spellings() {
    let awq = quant(&json!({"quant_method": "awq", "bits": 4, "group_size": 128,
        "zero_point": true, "version": "GEMM", "modules_to_not_convert": null}));
    assert_eq!(awq, Ok(PackedQuant { method: PackedMethod::Awq, bits: 4, group_size: Some(128) }));
    let old_awq = quant(&json!({"quant_method": "awq", "w_bit": 4, "q_group_size": 64}));
    assert_eq!(old_awq.map(|q| q.group_size), Ok(Some(64)));
    let gptq = quant(&json!({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": true,
        "desc_act": false}));
    assert_eq!(
        gptq,
        Ok(PackedQuant {
            method: PackedMethod::Gptq { zero_offset: 1 },
            bits: 8,
            group_size: None
        })
    );
    let v2 = quant(&json!({"quant_method": "gptq", "bits": 4, "group_size": 32,
        "checkpoint_format": "gptq_v2"}));
    assert_eq!(v2.map(|q| q.method), Ok(PackedMethod::Gptq { zero_offset: 0 }));
}

/// A compressed-tensors config of one group.
#[allow(clippy::needless_pass_by_value)] // called with json! temporaries
fn ct(format: &str, weights: Value, activations: Option<Value>) -> Value {
    json!({"quant_method": "compressed-tensors", "format": format, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
            "input_activations": activations}}, "ignore": ["lm_head"]})
}

#[test]
fn reads_compressed_tensors_configs() {
    let w4a16 = ct(
        "pack-quantized",
        json!({"type": "int", "num_bits": 4, "strategy": "group",
        "group_size": 128, "symmetric": true, "actorder": "group", "dynamic": false}),
        None,
    );
    let w8a8 = ct(
        "int-quantized",
        json!({"type": "int", "num_bits": 8, "strategy": "channel",
        "symmetric": true}),
        Some(json!({"type": "int", "num_bits": 8, "dynamic": true,
        "strategy": "token"})),
    );
    for (q, bits) in [(w4a16, 4), (w8a8, 8)] {
        let want = PackedQuant { method: PackedMethod::CompressedTensors, bits, group_size: None };
        assert_eq!(quant(&q), Ok(want));
    }
}

#[test]
fn refuses_what_it_cannot_read_by_name() {
    let cases = [
        (json!({"quant_method": "bitsandbytes"}), "quant_method `bitsandbytes`"),
        (
            ct(
                "float-quantized",
                json!({"type": "float", "num_bits": 8, "strategy": "channel"}),
                None,
            ),
            "float weights",
        ),
        (
            ct(
                "pack-quantized",
                json!({"type": "int", "num_bits": 2, "strategy": "group", "group_size": 128}),
                None,
            ),
            "2-bit",
        ),
        (
            ct(
                "int-quantized",
                json!({"type": "int", "num_bits": 8, "strategy": "channel", "symmetric": false}),
                None,
            ),
            "zero points",
        ),
        (
            ct("pack-quantized", json!({"type": "int", "num_bits": 4, "strategy": "tensor"}), None),
            "strategy `tensor`",
        ),
        (
            ct(
                "int-quantized",
                json!({"type": "int", "num_bits": 8, "strategy": "channel"}),
                Some(json!({"type": "float", "num_bits": 8})),
            ),
            "float 8-bit input activations",
        ),
        (
            {
                let mut q = ct(
                    "pack-quantized",
                    json!({"type": "int", "num_bits": 4, "strategy": "channel"}),
                    None,
                );
                q["sparsity_config"] = json!({"format": "sparse-24-bitmask"});
                q
            },
            "sparse",
        ),
        (json!({"quant_method": "awq", "group_size": 128}), "missing `bits`"),
        (json!({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}), "gemv_fast"),
        (json!({"quant_method": "awq", "bits": 4, "zero_point": false}), "zero_point"),
        (json!({"quant_method": "gptq", "bits": 2}), "2 bits"),
        (json!({"quant_method": "gptq", "bits": 8, "sym": false}), "sym: false"),
        (json!({"quant_method": "gptq", "bits": 4, "group_size": 48}), "group_size 48"),
        (json!({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}), "marlin"),
        (json!({"quant_method": "gptq", "bits": 4, "pack_dtype": "int8"}), "pack_dtype"),
    ];
    for (q, needle) in cases {
        let msg = quant(&q).unwrap_err();
        assert!(msg.contains(needle), "{q}: {msg}");
    }
}

/// A matrix of known levels, zero points and scales, packed as a checkpoint stores it.
struct Packed {
    out: usize,
    inp: usize,
    group: usize,
    bits: u32,
    /// `[out, in]`
    q: Vec<u32>,
    /// `[G, out]`
    z: Vec<u32>,
    /// `[G, out]`
    s: Vec<f32>,
}

impl Packed {
    fn new(out: usize, inp: usize, group: usize, bits: u32, zero: Option<u32>) -> Self {
        let groups = inp / group;
        let max = (1u32 << bits) - 1;
        let q = (0..out * inp).map(|k| (k as u32 * 7 + k as u32 / 5) % (max + 1)).collect();
        let z = (0..groups * out).map(|k| zero.unwrap_or(k as u32 * 3 % (max + 1))).collect();
        let s = (0..groups * out).map(|k| 0.01 + k as f32 / 512.0).collect();
        Self { out, inp, group, bits, q, z, s }
    }

    /// `s·(q − z)`, `[out, in]`.
    fn dequantized(&self) -> Vec<f32> {
        let g_idx: Vec<i32> = (0..self.inp).map(|i| (i / self.group) as i32).collect();
        self.dequantized_in(&(0..self.inp).collect::<Vec<_>>(), &g_idx)
    }

    /// `s·(q − z)` with input `i` in group `g_idx[i]`, column `j` being input `order[j]`.
    fn dequantized_in(&self, order: &[usize], g_idx: &[i32]) -> Vec<f32> {
        let mut w = Vec::new();
        for o in 0..self.out {
            for &i in order {
                let g = g_idx[i] as usize;
                let (s, z) = (self.s[g * self.out + o], self.z[g * self.out + o]);
                w.push(f16::from_f32(s).to_f32() * (self.q[o * self.inp + i] as f32 - z as f32));
            }
        }
        w
    }

    fn awq(&self) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        let (out, groups) = (self.out, self.inp / self.group);
        let pack = |rows: usize, value: &dyn Fn(usize, usize) -> u32| -> Vec<u8> {
            let mut words = Vec::new();
            for r in 0..rows {
                for c in 0..out / 8 {
                    let w = (0..8).fold(0u32, |w, k| w | value(r, 8 * c + AWQ_ORDER[k]) << (4 * k));
                    words.extend(w.to_le_bytes());
                }
            }
            words
        };
        let qweight = pack(self.inp, &|i, o| self.q[o * self.inp + i]);
        let qzeros = pack(groups, &|g, o| self.z[g * out + o]);
        vec![
            ("l.qweight".into(), Dtype::I32, vec![self.inp, out / 8], qweight),
            ("l.qzeros".into(), Dtype::I32, vec![groups, out / 8], qzeros),
            ("l.scales".into(), Dtype::F16, vec![groups, out], self.scales()),
        ]
    }

    /// GPTQ's layout; the stored zeros are `z − zero_offset`, wrapped.
    fn gptq(
        &self,
        zero_offset: u32,
        g_idx: Option<Vec<i32>>,
    ) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        let (out, groups, bits) = (self.out, self.inp / self.group, self.bits as usize);
        let per = 32 / bits;
        let mask = (1u32 << bits) - 1;
        let mut qweight = Vec::new();
        for r in 0..self.inp / per {
            for o in 0..out {
                let w = (0..per)
                    .fold(0u32, |w, k| w | self.q[o * self.inp + r * per + k] << (bits * k));
                qweight.extend(w.to_le_bytes());
            }
        }
        let mut qzeros = Vec::new();
        for g in 0..groups {
            for c in 0..out / per {
                let w = (0..per).fold(0u32, |w, k| {
                    w | (self.z[g * out + c * per + k].wrapping_sub(zero_offset) & mask)
                        << (bits * k)
                });
                qzeros.extend(w.to_le_bytes());
            }
        }
        let g_idx =
            g_idx.unwrap_or_else(|| (0..self.inp).map(|i| (i / self.group) as i32).collect());
        vec![
            ("l.qweight".into(), Dtype::I32, vec![self.inp / per, out], qweight),
            ("l.qzeros".into(), Dtype::I32, vec![groups, out / per], qzeros),
            ("l.scales".into(), Dtype::F16, vec![groups, out], self.scales()),
            (
                "l.g_idx".into(),
                Dtype::I32,
                vec![self.inp],
                g_idx.iter().flat_map(|g| g.to_le_bytes()).collect(),
            ),
        ]
    }

    /// compressed-tensors' layouts: `pack-quantized` (zero points when `zeros`), or for 8 bits
    /// with `packed` false, `int-quantized`.
    fn compressed(&self, packed: bool, zeros: bool) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
        let (out, inp, groups, bits) =
            (self.out, self.inp, self.inp / self.group, self.bits as usize);
        let per = 32 / bits;
        let by_row = |v: &[u32], o: usize, g: usize| v[g * out + o];
        let scales: Vec<u8> = (0..out * groups)
            .flat_map(|k| f16::from_f32(self.s[(k % groups) * out + k / groups]).to_le_bytes())
            .collect();
        let mut t = vec![("l.weight_scale".into(), Dtype::F16, vec![out, groups], scales)];
        if !packed {
            let w = self.q.iter().map(|&q| (q as i32 - 128) as i8 as u8).collect();
            t.push(("l.weight".into(), Dtype::I8, vec![out, inp], w));
            return t;
        }
        let mut words = Vec::new();
        for o in 0..out {
            for c in 0..inp / per {
                let w = (0..per).fold(0u32, |w, k| w | self.q[o * inp + c * per + k] << (bits * k));
                words.extend(w.to_le_bytes());
            }
        }
        t.push(("l.weight_packed".into(), Dtype::I32, vec![out, inp / per], words));
        if zeros {
            let mut zp = Vec::new();
            for r in 0..out / per {
                for g in 0..groups {
                    let w = (0..per)
                        .fold(0u32, |w, k| w | by_row(&self.z, r * per + k, g) << (bits * k));
                    zp.extend(w.to_le_bytes());
                }
            }
            t.push(("l.weight_zero_point".into(), Dtype::I32, vec![out / per, groups], zp));
        }
        t
    }

    fn scales(&self) -> Vec<u8> {
        self.s.iter().flat_map(|s| f16::from_f32(*s).to_le_bytes()).collect()
    }
}

/// Writes `tensors` to a safetensors file in `dir` and opens it.
fn store(dir: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) -> WeightStore {
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, d, shape, bytes)| (n.clone(), TensorView::new(*d, shape.clone(), bytes).unwrap()))
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();
    WeightStore::open_files(&[path]).unwrap()
}

fn dequantize(t: &HostTensor) -> Vec<f32> {
    let row = t.ty().row_bytes(t.cols()).unwrap();
    let bytes = t.bytes().as_slice();
    let mut out = vec![0f32; t.rows() * t.cols()];
    for (r, dst) in out.chunks_exact_mut(t.cols()).enumerate() {
        kiln_kernels::quant::dequantize_row(t.ty(), &bytes[r * row..(r + 1) * row], dst);
    }
    out
}

fn read(
    tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
    quant: PackedQuant,
    (out, inp): (usize, usize),
) -> Result<HostTensor, LoadError> {
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), tensors);
    let packed = PackedWeights { inner: &store, quant };
    assert!(packed.contains("l.weight") && !packed.contains("m.weight"));
    packed.matrix("l.weight", out, inp)
}

#[test]
fn awq_reads_as_q5_0_equal_to_its_dequantized_weights() {
    let p = Packed::new(16, 64, 32, 4, None);
    let q = PackedQuant { method: PackedMethod::Awq, bits: 4, group_size: Some(32) };
    let t = read(&p.awq(), q, (16, 64)).unwrap();
    assert_eq!(t.ty(), GgmlType::Q5_0);
    assert_eq!(dequantize(&t), p.dequantized());
}

#[test]
fn gptq_reads_each_format_exactly() {
    for (bits, zero, offset, ty) in [
        (4, None, 1, GgmlType::Q5_0),
        (4, None, 0, GgmlType::Q5_0),
        (4, Some(8), 1, GgmlType::Q4_0),
        (8, Some(128), 1, GgmlType::Q8_0),
    ] {
        let p = Packed::new(8, 64, 32, bits, zero);
        let q = PackedQuant {
            method: PackedMethod::Gptq { zero_offset: offset },
            bits,
            group_size: Some(32),
        };
        let t = read(&p.gptq(offset, None), q, (8, 64)).unwrap();
        assert_eq!(t.ty(), ty, "{bits} bits, zero {zero:?}");
        assert_eq!(dequantize(&t), p.dequantized(), "{bits} bits, zero offset {offset}");
    }
}

/// An act order: input `perm[k]` is the `k`-th GPTQ quantized, in group `k / group`.
fn act_order(perm: &[usize], group: usize) -> Vec<i32> {
    let mut g_idx = vec![0; perm.len()];
    for (k, &i) in perm.iter().enumerate() {
        g_idx[i] = (k / group) as i32;
    }
    g_idx
}

#[test]
fn act_order_matrices_come_sorted_by_group_with_their_input_order() {
    let (out, inp, group) = (8, 64, 32);
    let perm: Vec<usize> = (0..inp).map(|k| (k * 37 + 5) % inp).collect();
    let g_idx = act_order(&perm, group);
    // The levels are stored by input, the zeros and scales by group: only g_idx tells which.
    let reference = Packed::new(out, inp, group, 4, None);
    let tensors = reference.gptq(1, Some(g_idx.clone()));
    let q = PackedQuant {
        method: PackedMethod::Gptq { zero_offset: 1 },
        bits: 4,
        group_size: Some(32),
    };
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), &tensors);
    let packed = PackedWeights { inner: &store, quant: q };
    let (t, order) = packed.ordered_matrix("l.weight", out, inp).unwrap();
    let order = order.expect("an act order");
    assert_eq!(dequantize(&t), reference.dequantized_in(&order, &g_idx));
    // Sorted by group, each input once.
    assert!(order.windows(2).all(|w| g_idx[w[0]] <= g_idx[w[1]]));
    let mut seen = order.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..inp).collect::<Vec<_>>());
    // A caller that cannot permute its input is refused.
    let msg = packed.matrix("l.weight", out, inp).unwrap_err().to_string();
    assert!(msg.contains("act-order"), "{msg}");
}

#[test]
fn compressed_tensors_layouts_read_exactly() {
    let q = PackedQuant { method: PackedMethod::CompressedTensors, bits: 4, group_size: None };
    for (bits, zero, packed, ty) in [
        (4, None, true, GgmlType::Q5_0),
        (4, Some(8), true, GgmlType::Q4_0),
        (8, Some(128), true, GgmlType::Q8_0),
        (8, Some(128), false, GgmlType::Q8_0),
    ] {
        let p = Packed::new(16, 64, 32, bits, zero);
        let t = read(&p.compressed(packed, zero.is_none()), q, (16, 64)).unwrap();
        assert_eq!(t.ty(), ty, "{bits} bits, zero {zero:?}, packed {packed}");
        assert_eq!(dequantize(&t), p.dequantized(), "{bits} bits, zero {zero:?}");
    }
}

/// Older compressed-tensors checkpoints (`actorder: group`) store `weight_g_idx`, read as
/// GPTQ's `g_idx`.
#[test]
fn compressed_tensors_group_order_is_read_as_gptqs() {
    let (out, inp, group) = (8, 64, 32);
    let perm: Vec<usize> = (0..inp).map(|k| (k * 29 + 3) % inp).collect();
    let g_idx = act_order(&perm, group);
    let p = Packed::new(out, inp, group, 4, None);
    let mut tensors = p.compressed(true, true);
    let bytes = g_idx.iter().flat_map(|g| g.to_le_bytes()).collect();
    tensors.push(("l.weight_g_idx".into(), Dtype::I32, vec![inp], bytes));
    let dir = tempfile::tempdir().unwrap();
    let store = store(dir.path(), &tensors);
    let q = PackedQuant { method: PackedMethod::CompressedTensors, bits: 4, group_size: None };
    let packed = PackedWeights { inner: &store, quant: q };
    let (t, order) = packed.ordered_matrix("l.weight", out, inp).unwrap();
    let order = order.expect("an act order");
    assert_eq!(dequantize(&t), p.dequantized_in(&order, &g_idx));
}

#[test]
fn refuses_split_groups_bad_shapes_and_eight_bit_zero_points_by_name() {
    let p = Packed::new(8, 64, 32, 4, None);
    let q = PackedQuant {
        method: PackedMethod::Gptq { zero_offset: 1 },
        bits: 4,
        group_size: Some(32),
    };
    // Groups of 31 and 33 inputs: a block of 32 would span two groups.
    let mut g_idx: Vec<i32> = (0..64).map(|i| i / 32).collect();
    g_idx[0] = 1;
    let msg = read(&p.gptq(1, Some(g_idx)), q, (8, 64)).unwrap_err().to_string();
    assert!(msg.contains("l groups") && msg.contains("whole blocks"), "{msg}");
    let msg = read(&p.gptq(1, Some(vec![7; 64])), q, (8, 64)).unwrap_err().to_string();
    assert!(msg.contains("outside 0..2"), "{msg}");
    let msg = read(&p.gptq(1, None), q, (8, 32)).unwrap_err().to_string();
    assert!(msg.contains("`l.") && msg.contains("has shape"), "{msg}");
    let eight = Packed::new(8, 64, 32, 8, None);
    let q8 = PackedQuant { bits: 8, ..q };
    let msg = read(&eight.gptq(1, None), q8, (8, 64)).unwrap_err().to_string();
    assert!(msg.contains("8-bit zero points"), "{msg}");
}

/// The fixtures of `tests/fixtures/models` (AutoAWQ / AutoGPTQ / compressed-tensors packed;
/// Llama, Qwen3-MoE experts, Phi-3's fused matrices): every matrix, read as
/// kiln reads it and put back in input order, equals the packing library's own
/// dequantization (`dequantized.safetensors`: `(q − z) · s` in f32) exactly.
#[test]
fn fixture_matrices_equal_the_libraries_own_dequantization() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    let names = ["awq", "gptq", "gptq-sym8", "gptq-sym4", "gptq-act", "gptq-qwen3moe", "awq-phi3"];
    let compressed = ["ct-w4a16", "ct-w4a16-asym", "ct-w8a8", "ct-w8a16"];
    for name in names.into_iter().chain(compressed) {
        let dir = root.join(name);
        let config = crate::ModelConfig::from_file(&dir.join("config.json")).unwrap();
        let quant = config.packed.expect("a packed checkpoint");
        let store = WeightStore::open_dir(&dir).unwrap();
        let reference = WeightStore::open_files(&[dir.join("dequantized.safetensors")]).unwrap();
        let packed = PackedWeights { inner: &store, quant };
        let matrices: Vec<String> = reference.tensor_sizes().map(|(n, ..)| n.to_owned()).collect();
        assert!(matrices.len() >= 8, "{name}: {} matrices", matrices.len());
        for w in &matrices {
            let &[rows, cols] = reference.shape(w).unwrap() else { panic!("{w}: not a matrix") };
            let (t, order) = packed.ordered_matrix(w, rows, cols).unwrap();
            let sorted = dequantize(&t);
            let want = reference.floats(w, &[rows, cols]).unwrap();
            for r in 0..rows {
                for j in 0..cols {
                    let i = order.as_ref().map_or(j, |o| o[j]);
                    let (g, w_) = (sorted[r * cols + j], want[r * cols + i]);
                    assert_eq!(g, w_, "{name} {w} [{r}, {i}]");
                }
            }
        }
    }
}

#[test]
fn the_quantization_flag_must_name_the_checkpoints_method() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models");
    check_method(&root.join("awq"), "awq").unwrap();
    check_method(&root.join("gptq-act"), "gptq").unwrap();
    let msg = check_method(&root.join("awq"), "gptq").unwrap_err().to_string();
    assert!(msg.contains("--quantization gptq") && msg.contains("`awq`"), "{msg}");
    let msg = check_method(&root.join("llama3"), "awq").unwrap_err().to_string();
    assert!(msg.contains("no quantization_config"), "{msg}");
}
