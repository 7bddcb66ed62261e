//! Shared helpers of the model tests: the HF fixtures and their transformers references, and
//! a runner that does forward passes over a scrambled block table.

#![allow(dead_code)] // each test binary uses a different subset

use std::path::PathBuf;

pub mod gguf;
pub mod llama_ref;
pub mod lora;
use std::sync::Arc;

use kiln_kernels::Cpu;
use kiln_models::{
    Backend, ForwardBatch, KvCacheDtype, KvCacheSpec, LoadedModel, Logits, LogitsWanted,
    WeightStore, Workspace, load_model,
};
use serde_json::Value;

/// Every fixture: the Llama family, the mixtures of experts (Mixtral: 4 experts, 2 per token,
/// bf16; Qwen2-MoE: a shared expert, unnormalised weights; Qwen3-MoE: 8 experts, 2 per token;
/// both Qwens with a dense layer between two sparse ones), Gemma 3 (sandwich norms, sliding
/// layers, GeLU) and Phi-3 (fused `qkv_proj` and `gate_up_proj`; `phi3long` with LongRoPE;
/// `phi4mini` with RoPE on 12 of each head's 16 dimensions and LongRoPE) and DeepSeek V2/V3
/// (latent attention, YaRN, group-limited routing with shared experts; V3 with compressed
/// queries and sigmoid routing's correction bias) and gpt-oss (attention sinks, alternating
/// sliding layers, biased experts and router, the clamped SwiGLU).
pub const DECODER_FIXTURES: [&str; 14] = [
    "llama3",
    "llama2",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "qwen2moe",
    "qwen3moe",
    "gemma3",
    "phi3",
    "phi4mini",
    "deepseekv2",
    "deepseekv3",
    "gptoss",
];

pub const BLOCK_SIZE: usize = 4;
/// KV blocks of a [`Runner`] (4,096 tokens).
pub const NUM_BLOCKS: usize = 1024;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

pub struct Case {
    pub prompt: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    /// `[prompt + greedy, vocab]` rows of transformers' logits.
    pub logits: Vec<Vec<f32>>,
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// Reference cases; logits are read only when `vocab` is given.
pub fn cases(name: &str, vocab: Option<usize>) -> Vec<Case> {
    cases_in(&fixture(name), vocab)
}

/// The reference cases of the fixture in `dir` (`reference.json` and
/// `reference_logits.safetensors`; a case without a `prompt` text has an empty one).
pub fn cases_in(dir: &std::path::Path, vocab: Option<usize>) -> Vec<Case> {
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
                    let m = store.matrix(name, rows, vocab).unwrap().to_f32_vec().unwrap();
                    m.chunks_exact(vocab).map(<[f32]>::to_vec).collect()
                }
            };
            let prompt = c["prompt"].as_str().unwrap_or_default().into();
            Case { prompt, prompt_ids, greedy_ids, logits }
        })
        .collect()
}

/// The CPU backend with 2 threads.
pub fn cpu() -> Arc<Cpu> {
    Arc::new(Cpu::new(2))
}

/// A model on backend `B` with a KV cache (f32 unless [`Runner::with_dtype`]) of [`NUM_BLOCKS`]
/// blocks.
pub struct Runner<B: Backend = Cpu> {
    pub loaded: LoadedModel<B>,
    pub kv: B::KvStore,
    pub workspace: Workspace<B>,
    pub logits: Logits,
    pub batch: ForwardBatch,
    pub next_block: u32,
}

impl Runner<Cpu> {
    pub fn new(name: &str) -> Self {
        Self::with(load_model(&fixture(name), &cpu()).unwrap())
    }
}

impl<B: Backend> Runner<B> {
    /// Fixture `name` on `backend`.
    pub fn on(name: &str, backend: &Arc<B>) -> Self {
        Self::with(load_model(&fixture(name), backend).unwrap())
    }

    pub fn with(loaded: LoadedModel<B>) -> Self {
        Self::with_dtype(loaded, KvCacheDtype::F32)
    }

    /// As [`Runner::with`], with a KV cache of `dtype`.
    pub fn with_dtype(loaded: LoadedModel<B>, dtype: KvCacheDtype) -> Self {
        let spec = KvCacheSpec {
            layout: loaded.model.kv_layout(),
            dtype,
            num_blocks: NUM_BLOCKS,
            block_size: BLOCK_SIZE,
        };
        let kv = loaded.model.backend().alloc_kv(spec).unwrap();
        Self {
            loaded,
            kv,
            workspace: Workspace::new(),
            logits: Logits::default(),
            batch: ForwardBatch::new(BLOCK_SIZE),
            next_block: 0,
        }
    }

    pub fn vocab(&self) -> usize {
        self.loaded.model.config().vocab_size
    }

    /// Fresh blocks for a sequence of `len` tokens, taken in a scrambled order.
    pub fn blocks(&mut self, len: usize) -> Vec<u32> {
        (0..len.div_ceil(BLOCK_SIZE))
            .map(|_| {
                self.next_block += 1;
                (self.next_block * 37) % NUM_BLOCKS as u32
            })
            .collect()
    }

    /// Runs the current batch and returns its logits rows.
    pub fn run(&mut self) -> Vec<Vec<f32>> {
        self.loaded
            .model
            .forward(&self.batch, &mut self.kv, &mut self.workspace, &mut self.logits)
            .unwrap();
        (0..self.logits.num_rows()).map(|r| self.logits.row(r).to_vec()).collect()
    }

    /// Logits of every position of each sequence, all prefilled in one batch, split back into
    /// one list of rows per sequence.
    pub fn batched(&mut self, seqs: &[&[u32]]) -> Vec<Vec<Vec<f32>>> {
        self.batch.clear();
        for seq in seqs {
            let table = self.blocks(seq.len());
            self.batch.push_seq(seq, 0, &table, LogitsWanted::All).unwrap();
        }
        let mut rows = self.run().into_iter();
        seqs.iter().map(|seq| rows.by_ref().take(seq.len()).collect()).collect()
    }

    /// Logits of every position of `tokens`, in one forward pass.
    pub fn one_shot(&mut self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let table = self.blocks(tokens.len());
        self.batch.clear();
        self.batch.push_seq(tokens, 0, &table, LogitsWanted::All).unwrap();
        self.run()
    }
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

pub fn assert_rows_close(got: &[Vec<f32>], want: &[Vec<f32>], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: row count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = max_abs_diff(g, w);
        assert!(d <= tol, "{what}: row {i} differs by {d} (tolerance {tol})");
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0 as u32
}

/// Max |ours - sentence-transformers| per component of an embedding or score.
pub const EMBEDDING_TOLERANCE: f32 = 1e-4;

/// `got` within [`EMBEDDING_TOLERANCE`] of `want` in every component, and at cosine 0.99999.
pub fn assert_vector_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: width");
    let diff = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    let dot: f32 = got.iter().zip(want).map(|(a, b)| a * b).sum();
    let norms = got.iter().map(|x| x * x).sum::<f32>().sqrt()
        * want.iter().map(|x| x * x).sum::<f32>().sqrt();
    assert!(diff <= EMBEDDING_TOLERANCE, "{what}: max |diff| {diff}");
    assert!(dot / norms >= 0.99999, "{what}: cosine {}", dot / norms);
}
