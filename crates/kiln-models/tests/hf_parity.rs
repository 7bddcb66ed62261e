//! Our forward pass against Hugging Face transformers on tiny random-weight models
//! (`tests/fixtures/models`, made by `scripts/fixtures/make_fixtures.py`), plus the engine
//! invariants that hold for any model: batched == alone, chunked prefill == one shot,
//! incremental decode == full recompute.

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;

use kiln_kernels::ThreadPool;
use kiln_models::{
    ForwardBatch, ForwardScratch, LoadedModel, Logits, LogitsWanted, PagedKvCache, WeightStore,
    load_model,
};
use serde_json::Value;

/// Every fixture: the Llama family and Gemma 3 (sandwich norms, sliding layers, GeLU).
const MODELS: [&str; 6] = ["llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma3"];
const BLOCK_SIZE: usize = 4;
/// Max |ours - transformers| on f32 logits.
const LOGIT_TOLERANCE: f32 = 1e-3;
/// Batching, chunking and caching must not change a single bit of the logits.
const BITWISE: f32 = 0.0;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

struct Case {
    prompt: String,
    prompt_ids: Vec<u32>,
    greedy_ids: Vec<u32>,
    /// `[prompt + greedy, vocab]` rows of transformers' logits.
    logits: Vec<Vec<f32>>,
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Reference cases; logits are read only when `vocab` is given.
fn cases(name: &str, vocab: Option<usize>) -> Vec<Case> {
    let dir = fixture(name);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let store = WeightStore::open_files(&[dir.join("reference_logits.safetensors")]).unwrap();
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let prompt_ids = ids(&c["prompt_ids"]);
            let greedy_ids = ids(&c["greedy_ids"]);
            let rows = prompt_ids.len() + greedy_ids.len();
            let logits = match vocab {
                None => Vec::new(),
                Some(vocab) => {
                    let name = c["logits_tensor"].as_str().unwrap();
                    let m = store.matrix(name, rows, vocab).unwrap();
                    (0..rows)
                        .map(|r| {
                            let mut row = vec![0.0; vocab];
                            m.row_to_f32(r, &mut row);
                            row
                        })
                        .collect()
                }
            };
            Case { prompt: c["prompt"].as_str().unwrap().into(), prompt_ids, greedy_ids, logits }
        })
        .collect()
}

struct Runner {
    loaded: LoadedModel,
    pool: ThreadPool,
    kv: PagedKvCache,
    scratch: ForwardScratch,
    logits: Logits,
    batch: ForwardBatch,
    next_block: u32,
}

impl Runner {
    fn new(name: &str) -> Self {
        let loaded = load_model(&fixture(name)).unwrap();
        let kv = PagedKvCache::new(loaded.model.kv_layout(), 256, BLOCK_SIZE);
        Self {
            loaded,
            pool: ThreadPool::new(2),
            kv,
            scratch: ForwardScratch::new(),
            logits: Logits::default(),
            batch: ForwardBatch::new(BLOCK_SIZE),
            next_block: 0,
        }
    }

    fn vocab(&self) -> usize {
        self.loaded.model.config().vocab_size
    }

    /// Fresh blocks for a sequence of `len` tokens, taken in a scrambled order.
    fn blocks(&mut self, len: usize) -> Vec<u32> {
        (0..len.div_ceil(BLOCK_SIZE))
            .map(|_| {
                self.next_block += 1;
                (self.next_block * 37) % 256
            })
            .collect()
    }

    /// Runs the current batch and returns its logits rows.
    fn run(&mut self) -> Vec<Vec<f32>> {
        self.loaded
            .model
            .forward(&self.pool, &self.batch, &mut self.kv, &mut self.scratch, &mut self.logits)
            .unwrap();
        (0..self.logits.num_rows()).map(|r| self.logits.row(r).to_vec()).collect()
    }

    /// Logits of every position of `tokens`, in one forward pass.
    fn one_shot(&mut self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let table = self.blocks(tokens.len());
        self.batch.clear();
        self.batch.push_seq(tokens, 0, &table, LogitsWanted::All).unwrap();
        self.run()
    }
}

fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn assert_rows_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(d <= tol, "{what}: row {i} differs by {d} (tolerance {tol})");
    }
}

#[test]
fn tokenizer_matches_transformers() {
    for name in MODELS {
        let (tok, _) = kiln_models::Tokenizer::from_dir(&fixture(name)).unwrap();
        for case in cases(name, None).iter().map(|c| (&c.prompt, &c.prompt_ids)) {
            assert_eq!(&tok.encode(case.0, true).unwrap(), case.1, "{name}: {:?}", case.0);
        }
    }
}

#[test]
fn logits_match_transformers() {
    for name in MODELS {
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
    for name in MODELS {
        let mut runner = Runner::new(name);
        let cases = cases(name, Some(runner.vocab()));
        let alone: Vec<_> = cases.iter().map(|c| runner.one_shot(&c.prompt_ids)).collect();
        runner.batch.clear();
        for c in &cases {
            let table = runner.blocks(c.prompt_ids.len());
            runner.batch.push_seq(&c.prompt_ids, 0, &table, LogitsWanted::All).unwrap();
        }
        let batched = runner.run();
        let mut row = 0;
        for (i, want) in alone.iter().enumerate() {
            assert_rows_close(
                &batched[row..row + want.len()],
                want,
                BITWISE,
                &format!("{name} #{i}"),
            );
            row += want.len();
        }
    }
}

#[test]
fn chunked_prefill_of_seven_equals_one_shot() {
    for name in MODELS {
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
    for name in MODELS {
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

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}
