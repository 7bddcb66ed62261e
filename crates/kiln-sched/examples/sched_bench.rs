//! The scheduler's own cost per step: microseconds per `schedule()` + `update()` with 256
//! running requests in decode (no model; sampled tokens are made up outside the timed region).
//!
//! `cargo run --release -p kiln-sched --example sched_bench [steps]`
//!
//! Block size 16, prompts of 128 tokens (distinct, so no prefix hits), prefix caching on: every
//! 16th step each request fills a block, which is hashed and registered.

use std::time::{Duration, Instant};

use kiln_core::{RequestId, SamplingParams, TokenId};
use kiln_kv::KvCacheConfig;
use kiln_sched::{ModelRunnerOutput, Request, Scheduler, SchedulerConfig, SchedulerOutput};

const NUM_REQUESTS: u64 = 256;
const PROMPT: u32 = 128;
const BLOCK_SIZE: usize = 16;
const MAX_MODEL_LEN: usize = 8192;
/// Requests never finish within the measured steps.
const MAX_TOKENS: usize = MAX_MODEL_LEN - PROMPT as usize;

fn sampled(out: &SchedulerOutput, step: u64) -> ModelRunnerOutput {
    let token = |id: RequestId| TokenId(((id.0 * 31 + step * 7) % 30_000) as u32 + 1);
    out.scheduled().map(|(id, _)| (id, [token(id)])).collect()
}

fn main() {
    let steps: u64 = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(2000);
    let steps = steps.min(MAX_TOKENS as u64 - 100);
    let config = SchedulerConfig {
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
        max_model_len: MAX_MODEL_LEN,
        ..SchedulerConfig::default()
    };
    let kv = KvCacheConfig {
        block_size: BLOCK_SIZE,
        num_blocks: NUM_REQUESTS as usize * MAX_MODEL_LEN / BLOCK_SIZE,
        enable_prefix_caching: true,
        extra_keys: vec![],
    };
    let mut s = Scheduler::new(config, kv).expect("valid bench config");
    for i in 0..NUM_REQUESTS {
        let prompt = (0..PROMPT).map(|t| TokenId(i as u32 * 1000 + t)).collect();
        let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(MAX_TOKENS) };
        s.add(Request::new(RequestId(i), prompt, params)).expect("fits");
    }
    // prefill until every request decodes
    let mut step = 0;
    loop {
        step += 1;
        let out = s.schedule();
        let prefill = out.num_scheduled_tokens > out.num_scheduled_requests();
        s.update(&out, &sampled(&out, step));
        if !prefill && s.num_running() == NUM_REQUESTS as usize && s.num_waiting() == 0 {
            break;
        }
    }
    let (mut t_schedule, mut t_update) = (Duration::ZERO, Duration::ZERO);
    let mut per_step = Vec::with_capacity(steps as usize);
    for _ in 0..steps {
        step += 1;
        let t0 = Instant::now();
        let out = s.schedule();
        let t1 = Instant::now();
        let res = sampled(&out, step);
        let t2 = Instant::now();
        let outputs = s.update(&out, &res);
        let t3 = Instant::now();
        assert_eq!(outputs.len(), NUM_REQUESTS as usize);
        t_schedule += t1 - t0;
        t_update += t3 - t2;
        per_step.push((t1 - t0) + (t3 - t2));
    }
    per_step.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    let n = steps as f64;
    println!(
        "sched_bench: {NUM_REQUESTS} running requests in decode, {steps} steps, block size {BLOCK_SIZE}"
    );
    println!(
        "  schedule()+update(): median {:.1} us/step, mean {:.1} us/step (schedule {:.1}, update {:.1}), p99 {:.1}",
        us(per_step[per_step.len() / 2]),
        us(t_schedule + t_update) / n,
        us(t_schedule) / n,
        us(t_update) / n,
        us(per_step[per_step.len() * 99 / 100]),
    );
    println!("  kv usage {:.3}, preemptions {}", s.kv_cache().usage(), s.stats().num_preemptions);
}
