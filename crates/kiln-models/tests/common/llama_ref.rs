//! llama.cpp's own outputs on GGUF files (`llama_cpp_reference.json`, written by
//! `scripts/fixtures/llama_server_reference.py`) and the teacher-forced comparison of kiln's
//! logits against them.

use std::path::Path;

use serde_json::Value;

use super::{Runner, argmax};

pub struct Case {
    pub prompt: Vec<u32>,
    pub output: Vec<u32>,
    /// Per output step: llama.cpp's top 5 `(id, logprob)`, best first; `None` where
    /// llama-server reported none of its own (a byte token ending incomplete UTF-8; see
    /// `scripts/fixtures/llama_server_reference.py`).
    pub top5: Vec<Option<Vec<(u32, f32)>>>,
}

/// The cases of `file` in the reference document `path`.
pub fn cases(path: &Path, file: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(path).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array().unwrap().iter().map(|x| u32::try_from(x.as_u64().unwrap()).unwrap()).collect()
    };
    doc["files"][file]["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("no reference for {file}"))
        .iter()
        .map(|c| Case {
            prompt: ids(&c["prompt_ids"]),
            output: ids(&c["output_ids"]),
            top5: c["top5"]
                .as_array()
                .unwrap()
                .iter()
                .map(|step| {
                    step.as_array().map(|top| {
                        top.iter()
                            .map(|p| {
                                let id = u32::try_from(p[0].as_u64().unwrap()).unwrap();
                                (id, p[1].as_f64().unwrap() as f32)
                            })
                            .collect()
                    })
                })
                .collect(),
        })
        .collect()
}

/// Teacher-forced logits of every output step of `case` (the rows after the prompt's last token
/// and after each output token but the last), one forward pass.
pub fn output_logits(runner: &mut Runner, case: &Case) -> Vec<Vec<f32>> {
    let mut tokens = case.prompt.clone();
    tokens.extend_from_slice(&case.output[..case.output.len() - 1]);
    runner.one_shot(&tokens).split_off(case.prompt.len() - 1)
}

fn log_softmax(row: &[f32]) -> Vec<f32> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&v| f64::from(v - max).exp()).sum();
    let log_sum = sum.ln() as f32;
    row.iter().map(|&v| v - max - log_sum).collect()
}

/// How kiln's teacher-forced distributions fit llama.cpp's.
pub struct Fit {
    /// Mean |Δ logprob| over llama.cpp's top 5 of every step.
    pub mean_dlogprob: f64,
}

/// Runs every case teacher-forced: wherever llama.cpp's top-1 leads its top-2 by more than
/// `clear_margin` nat, kiln's top-1 must be the same (asserted); returns the mean |Δ logprob|
/// over llama.cpp's top 5 (at least 20 steps must have probabilities).
pub fn teacher_forced(runner: &mut Runner, cases: &[Case], file: &str, clear_margin: f32) -> Fit {
    let (mut sum, mut count, mut agree, mut steps) = (0.0f64, 0u32, 0u32, 0u32);
    for case in cases {
        let rows = output_logits(runner, case);
        for (step, (row, reference)) in rows.iter().zip(&case.top5).enumerate() {
            let Some(reference) = reference else { continue };
            let lp = log_softmax(row);
            for &(id, want) in reference {
                sum += f64::from((lp[id as usize] - want).abs());
                count += 1;
            }
            steps += 1;
            let (ours, (want, want_lp)) = (argmax(row), reference[0]);
            if ours == want {
                agree += 1;
            } else {
                let margin = want_lp - reference[1].1;
                assert!(
                    margin <= clear_margin,
                    "{file} step {step}: top-1 {ours} but llama.cpp's {want} leads by {margin} nat"
                );
            }
        }
    }
    assert!(steps >= 20, "{file}: only {steps} steps with llama.cpp's probabilities");
    let mean = sum / f64::from(count);
    eprintln!("{file}: top-1 {agree}/{steps}, mean |dlogprob| over llama.cpp's top 5 {mean:.4}");
    Fit { mean_dlogprob: mean }
}
