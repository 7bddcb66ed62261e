//! Micro-benchmark of the KV cache manager's operations (ns per operation).
//!
//! `cargo run --release -p kiln-kv --example kv_bench [iterations]`
//!
//! Block size 16, 8192 blocks, prompts of 512 tokens (32 blocks). Every freed prompt stays
//! cached, so once the pool has cycled, allocation also pays for evictions.

use std::hint::black_box;
use std::time::Instant;

use kiln_core::{RequestId, TokenId};
use kiln_kv::{KvCacheConfig, KvCacheManager};

const BLOCK_SIZE: usize = 16;
const NUM_BLOCKS: usize = 8192;
const PROMPT: usize = 512;

fn manager(enable_prefix_caching: bool) -> KvCacheManager {
    KvCacheManager::new(KvCacheConfig {
        block_size: BLOCK_SIZE,
        num_blocks: NUM_BLOCKS,
        enable_prefix_caching,
        extra_keys: vec![1],
    })
}

fn prompt(first: u32) -> Vec<TokenId> {
    (0..PROMPT as u32).map(|i| TokenId(if i == 0 { first } else { i * 7919 % 32000 })).collect()
}

/// Runs `f(i)` for `iters` iterations and prints ns per iteration.
fn time(name: &str, iters: usize, mut f: impl FnMut(usize)) {
    for i in 0..iters / 10 {
        f(i); // warm-up
    }
    let t = Instant::now();
    for i in 0..iters {
        f(i);
    }
    let ns = t.elapsed().as_nanos() as f64 / iters as f64;
    println!("{name:<58} {ns:>10.1} ns/op");
}

fn main() {
    let iters: usize = std::env::args().nth(1).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    println!(
        "block_size {BLOCK_SIZE}, {NUM_BLOCKS} blocks, prompt {PROMPT} tokens, {iters} iterations"
    );

    for caching in [false, true] {
        let mut m = manager(caching);
        let mut t = prompt(0);
        let label = if caching { "on" } else { "off" };
        time(&format!("allocate 512 new tokens (32 blocks) + free, caching {label}"), iters, |i| {
            t[0] = TokenId(100_000 + i as u32); // a new prefix every time: no hits
            let r = RequestId(i as u64);
            black_box(m.allocate_slots(r, &t, 0, PROMPT, 0));
            m.free(r);
        });
    }

    let mut m = manager(true);
    let mut t = prompt(1);
    m.allocate_slots(RequestId(0), &t, 0, PROMPT, 0).expect("room for the prompt");
    m.free(RequestId(0));
    t.push(TokenId(5));
    time("lookup_prefix, 32-block hit", iters, |_| {
        black_box(m.lookup_prefix(black_box(&t)));
    });
    let miss = prompt(2);
    time("lookup_prefix, miss at block 0", iters, |_| {
        black_box(m.lookup_prefix(black_box(&miss)));
    });
    time("allocate with a 32-block hit (pin) + 1 new block + free", iters, |i| {
        let r = RequestId(1_000_000 + i as u64);
        black_box(m.allocate_slots(r, &t, PROMPT, 1, 0));
        m.free(r);
    });

    // decode: one token per step on 64 running requests, blocks added every 16 steps
    let mut m = manager(true);
    let mut seqs: Vec<Vec<TokenId>> = (0..64).map(|r| prompt(200_000 + r)).collect();
    for (r, s) in seqs.iter().enumerate() {
        m.allocate_slots(RequestId(r as u64), s, 0, PROMPT, 0).expect("room for the prompt");
    }
    let steps = iters.min((NUM_BLOCKS / 64 * BLOCK_SIZE - PROMPT) * 8 / 10); // + warm-up fits
    time("decode allocate_slots (1 token, +1 block per 16 steps)", steps * 64, |i| {
        let r = i % 64;
        let s = &mut seqs[r];
        s.push(TokenId(i as u32 % 32000));
        black_box(m.allocate_slots(RequestId(r as u64), s, s.len() - 1, 1, 0));
    });

    let mut m = manager(true);
    let t = prompt(3);
    m.allocate_slots(RequestId(0), &t, 0, PROMPT, 0).expect("room for the prompt");
    time("fork 32 blocks + free child", iters, |i| {
        let c = RequestId(1 + i as u64);
        black_box(m.fork(RequestId(0), c, PROMPT));
        m.free(c);
    });
    time("check_invariants (8192 blocks, 1 request)", iters / 100, |_| {
        black_box(m.check_invariants()).ok();
    });
}
