//! Our forward pass against Hugging Face transformers on tiny random-weight models
//! (`tests/fixtures/models`, made by `scripts/fixtures/make_fixtures.py`), plus the engine
//! invariants that hold for any model: batched == alone, chunked prefill == one shot,
//! incremental decode == full recompute.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

mod common;

use common::{DECODER_FIXTURES, Runner, argmax, assert_rows_close, cases, cpu, fixture};
use kiln_kernels::GgmlType;
use kiln_models::{LoadOptions, LogitsWanted, load_model_with};

/// Max |ours - transformers| on f32 logits.
const LOGIT_TOLERANCE: f32 = 1e-3;
/// Batching, chunking and caching must not change a single bit of the logits.
const BITWISE: f32 = 0.0;

#[test]
fn tokenizer_matches_transformers() {
    for name in DECODER_FIXTURES {
        let (tok, _) = kiln_tokenizer::Tokenizer::from_dir(&fixture(name)).unwrap();
        for case in cases(name, None).iter().map(|c| (&c.prompt, &c.prompt_ids)) {
            assert_eq!(&tok.encode(case.0, true).unwrap(), case.1, "{name}: {:?}", case.0);
        }
    }
}

#[test]
fn logits_match_transformers() {
    for name in DECODER_FIXTURES {
        let mut runner = Runner::new(name);
        for (i, case) in cases(name, Some(runner.vocab())).iter().enumerate() {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            let got = runner.one_shot(&tokens);
            assert_rows_close(&got, &case.logits, LOGIT_TOLERANCE, &format!("{name} case {i}"));
        }
    }
}

#[test]
fn batch_of_four_gives_each_prompt_its_own_logits() {
    for name in DECODER_FIXTURES {
        let mut runner = Runner::new(name);
        let cases = cases(name, Some(runner.vocab()));
        let alone: Vec<_> = cases.iter().map(|c| runner.one_shot(&c.prompt_ids)).collect();
        let prompts: Vec<&[u32]> = cases.iter().map(|c| c.prompt_ids.as_slice()).collect();
        let batched = runner.batched(&prompts);
        for (i, (got, want)) in batched.iter().zip(&alone).enumerate() {
            assert_rows_close(got, want, BITWISE, &format!("{name} #{i}"));
        }
    }
}

/// A step of more tokens than a layer takes at once (the forward pass cuts it into slices of at
/// most 512 tokens around attention) gives every sequence the logits it gets alone; with
/// experts, whichever other tokens share a token's experts.
#[test]
fn step_of_1200_tokens_equals_each_sequence_alone() {
    for name in ["gemma3", "llama3", "qwen3moe", "qwen2moe", "deepseekv3"] {
        let mut runner = Runner::new(name);
        let vocab = runner.vocab() as u32;
        let seqs: Vec<Vec<u32>> = (0..6u32)
            .map(|s| (0..200u32).map(|i| (i * 31 + s * 7 + 3) % vocab).collect())
            .collect();
        let alone: Vec<_> = seqs.iter().map(|seq| runner.one_shot(seq)).collect();
        runner.batch.clear();
        for seq in &seqs {
            let table = runner.blocks(seq.len());
            runner.batch.push_seq(seq, 0, &table, LogitsWanted::All).unwrap();
        }
        let batched = runner.run();
        for (i, want) in alone.iter().enumerate() {
            let rows = &batched[i * 200..(i + 1) * 200];
            assert_rows_close(rows, want, BITWISE, &format!("{name} sequence {i}"));
        }
    }
}

/// With quantized experts (Q8_0; Q5_0, which 64-wide rows give for Q4_K) a token's logits
/// still do not depend on how many other tokens share its experts: every expert's matmul runs
/// over a different number of rows in the batch than alone.
#[test]
fn quantized_experts_batched_equal_alone() {
    for ty in [GgmlType::Q8_0, GgmlType::Q4K] {
        let options = LoadOptions { quantization: Some(ty), ..LoadOptions::default() };
        let loaded = load_model_with(&fixture("qwen3moe"), &options, &cpu()).unwrap();
        let mut runner = Runner::with(loaded);
        let vocab = runner.vocab() as u32;
        let seqs: Vec<Vec<u32>> = (0..5u32)
            .map(|s| (0..(40 + 37 * s)).map(|i| (i * 17 + s * 11 + 5) % vocab).collect())
            .collect();
        let alone: Vec<_> = seqs.iter().map(|seq| runner.one_shot(seq)).collect();
        runner.batch.clear();
        for seq in &seqs {
            let table = runner.blocks(seq.len());
            runner.batch.push_seq(seq, 0, &table, LogitsWanted::All).unwrap();
        }
        let mut rows = runner.run().into_iter();
        for (i, (seq, want)) in seqs.iter().zip(&alone).enumerate() {
            let got: Vec<_> = rows.by_ref().take(seq.len()).collect();
            assert_rows_close(&got, want, BITWISE, &format!("{} sequence {i}", ty.name()));
        }
    }
}

#[test]
fn chunked_prefill_of_seven_equals_one_shot() {
    for name in DECODER_FIXTURES {
        let mut runner = Runner::new(name);
        let cases = cases(name, Some(runner.vocab()));
        let case = cases.iter().max_by_key(|c| c.prompt_ids.len()).unwrap();
        let prompt = &case.prompt_ids;
        let want = runner.one_shot(prompt);
        let table = runner.blocks(prompt.len());
        let mut got = Vec::new();
        for start in (0..prompt.len()).step_by(7) {
            let end = (start + 7).min(prompt.len());
            runner.batch.clear();
            runner.batch.push_seq(&prompt[start..end], start, &table, LogitsWanted::All).unwrap();
            got.extend(runner.run());
        }
        assert_rows_close(&got, &want, BITWISE, name);
    }
}

#[test]
fn decode_after_prefill_equals_full_recompute_and_transformers() {
    for name in DECODER_FIXTURES {
        let mut runner = Runner::new(name);
        for case in cases(name, Some(runner.vocab())) {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            let full = runner.one_shot(&tokens);
            let table = runner.blocks(tokens.len());
            let n = case.prompt_ids.len();
            runner.batch.clear();
            runner.batch.push_seq(&tokens[..n], 0, &table, LogitsWanted::Last).unwrap();
            let mut got = runner.run();
            let mut greedy = Vec::new();
            for pos in n..tokens.len() {
                let last = got.last().unwrap();
                greedy.push(argmax(last));
                runner.batch.clear();
                runner.batch.push_seq(&tokens[pos..=pos], pos, &table, LogitsWanted::Last).unwrap();
                got.extend(runner.run());
            }
            assert_rows_close(&got, &full[n - 1..], BITWISE, &format!("{name} recompute"));
            assert_rows_close(&got, &case.logits[n - 1..], LOGIT_TOLERANCE, &format!("{name} hf"));
            assert_eq!(greedy, case.greedy_ids, "{name}: greedy continuation");
        }
    }
}

/// The last layer carries only the rows that need logits past its K/V. A step mixing a chunk
/// that needs none, a prompt that needs its last row, one that needs all, and a decode gives
/// each the one-shot logits bit for bit, and the chunk without logits leaves the cache right
/// for the chunk after it.
#[test]
fn rows_without_logits_change_no_logits_and_no_cache() {
    for name in ["gemma3", "llama3", "qwen3", "qwen3moe"] {
        let mut runner = Runner::new(name);
        let vocab = runner.vocab() as u32;
        let seq = |s: u32, len: u32| -> Vec<u32> {
            (0..len).map(|i| (i * 13 + s * 5 + 1) % vocab).collect()
        };
        let (a, b, c, d) = (seq(0, 40), seq(1, 23), seq(2, 9), seq(3, 17));
        let want: Vec<_> = [&a, &b, &c, &d].iter().map(|s| runner.one_shot(s)).collect();
        let tables: Vec<_> = [&a, &b, &c, &d].iter().map(|s| runner.blocks(s.len())).collect();
        // Decode's context first: all of `d` but its last token.
        runner.batch.clear();
        runner.batch.push_seq(&d[..16], 0, &tables[3], LogitsWanted::None).unwrap();
        assert!(runner.run().is_empty());
        runner.batch.clear();
        runner.batch.push_seq(&a[..25], 0, &tables[0], LogitsWanted::None).unwrap();
        runner.batch.push_seq(&b, 0, &tables[1], LogitsWanted::Last).unwrap();
        runner.batch.push_seq(&c, 0, &tables[2], LogitsWanted::All).unwrap();
        runner.batch.push_seq(&d[16..], 16, &tables[3], LogitsWanted::Last).unwrap();
        let got = runner.run();
        assert_eq!(got.len(), 1 + 9 + 1);
        assert_rows_close(&got[..1], &want[1][22..], BITWISE, &format!("{name} last row"));
        assert_rows_close(&got[1..10], &want[2], BITWISE, &format!("{name} all rows"));
        assert_rows_close(&got[10..], &want[3][16..], BITWISE, &format!("{name} decode"));
        runner.batch.clear();
        runner.batch.push_seq(&a[25..], 25, &tables[0], LogitsWanted::All).unwrap();
        let rest = runner.run();
        assert_rows_close(&rest, &want[0][25..], BITWISE, &format!("{name} after a chunk"));
    }
}
