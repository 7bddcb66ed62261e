//! Token trees through whole models: the logits of a tree's rows equal, bitwise, those of the
//! same tokens in one causal sequence, on every fixture, on the CPU backend (f32, f16 and int8
//! caches, int8 rows Hadamard-rotated where the head size allows) and on the reference backend,
//! with another sequence's prefill chunk in the batch (so the last layer runs on the logits rows
//! only); and once the accepted path's K/V is copied from its nodes' slots to its positions'
//! slots, the next decode equals the causal one.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use std::sync::Arc;

use common::{Runner, cases, cpu, fixture};
use kiln_kernels::Reference;
use kiln_models::{Backend, KvCacheDtype, LogitsWanted, TREE_ROOT, load_model};

const MODELS: [&str; 6] = ["llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma3"];

fn bits(rows: &[f32]) -> Vec<u32> {
    rows.iter().map(|x| x.to_bits()).collect()
}

/// Checks one fixture on `runner` (fresh) against `causal` (a second fresh runner of the same
/// model and cache type).
fn check<B: Backend>(name: &str, tree: &mut Runner<B>, causal: &mut Runner<B>) {
    let case = &cases(name, None)[0];
    let seq: Vec<u32> = case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
    assert!(seq.len() >= 8, "{name}: fixture too short");
    let vocab = tree.vocab() as u32;
    // The root is `seq[m - 1]`; the accepted path `seq[m..m + 3]`, then `seq[m + 3]` decoded.
    let m = seq.len() - 4;
    let want = causal.one_shot(&seq);
    let other = |t: u32| (t + 1) % vocab;
    let (c1, c2, c3) = (seq[m], seq[m + 1], seq[m + 2]);
    // Nodes: 0 x (root), 1 c1 (root), 2 y (x), 3 c2 (c1), 4 z (y), 5 c3 (c2).
    let tokens = [seq[m - 1], other(c1), c1, other(c2), c2, other(c3), c3];
    let parents = [TREE_ROOT, TREE_ROOT, 0, 1, 2, 3];
    let table = tree.blocks(m + 8);
    let side = tree.blocks(9);
    tree.batch.clear();
    tree.batch.push_seq(&seq[..m - 1], 0, &table, LogitsWanted::None).unwrap();
    tree.run();
    tree.batch.clear();
    // A prefill chunk without logits in the same step: the last layer is pruned to the tree's.
    tree.batch.push_seq(&seq[..9], 0, &side, LogitsWanted::None).unwrap();
    tree.batch.push_tree(&tokens, &parents, m - 1, &table).unwrap();
    let got = tree.run();
    assert_eq!(got.len(), tokens.len(), "{name}: one logits row per tree token");
    for (row, pos) in [(0, m - 1), (2, m), (4, m + 1), (6, m + 2)] {
        assert_eq!(bits(&got[row]), bits(&want[pos]), "{name}: tree row {row}, position {pos}");
    }
    // The path c1, c2, c3 (nodes 1, 3, 5 in slots m + 1, m + 3, m + 5) to positions m..m + 3.
    let slot = |p: usize| {
        table[p / common::BLOCK_SIZE] * common::BLOCK_SIZE as u32 + (p % common::BLOCK_SIZE) as u32
    };
    let pairs = [(slot(m + 1), slot(m)), (slot(m + 3), slot(m + 1)), (slot(m + 5), slot(m + 2))];
    let backend = tree.loaded.model.backend();
    assert!(backend.supports_token_trees());
    backend.copy_kv_slots(&mut tree.kv, &pairs);
    tree.batch.clear();
    tree.batch.push_seq(&seq[m + 3..m + 4], m + 3, &table, LogitsWanted::Last).unwrap();
    let next = tree.run();
    assert_eq!(bits(&next[0]), bits(&want[m + 3]), "{name}: the decode after the moved path");
}

#[test]
fn tree_rows_and_the_moved_path_equal_a_causal_sequence() {
    for name in MODELS {
        for dtype in [KvCacheDtype::F32, KvCacheDtype::F16, KvCacheDtype::Int8] {
            let runner = || Runner::with_dtype(load_model(&fixture(name), &cpu()).unwrap(), dtype);
            check(name, &mut runner(), &mut runner());
        }
        let backend = Arc::new(Reference);
        check(name, &mut Runner::on(name, &backend), &mut Runner::on(name, &backend));
    }
}
