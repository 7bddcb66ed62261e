//! Runs a fixed set of sequences to completion over a paged KV cache.
//!
//! Every step spends a token budget (`max_num_batched_tokens`): each sequence still in its
//! prompt gets a prefill chunk (as much as the budget leaves), each decoding sequence one token.
//! Blocks are taken from a free list as sequences grow and returned when they finish, so a
//! finished run leaves every block free. This is the engine's simplest driver (used by
//! `kiln generate` and tests); the continuous-batching scheduler replaces its admission logic
//! without changing the batch or cache layout.

use std::time::{Duration, Instant};

use kiln_core::{FinishReason, SamplingError, SamplingParams};
use kiln_models::{
    Backend, BoundModel, ForwardBatch, ForwardError, KvCacheDtype, Logits, LogitsWanted, Model,
    StepModel,
};

use crate::Sampler;

/// Sizes of the generator's KV cache and steps.
#[derive(Clone, Debug)]
pub struct GeneratorConfig {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Token budget of one forward step (prefill chunk size for a single sequence).
    pub max_num_batched_tokens: usize,
    /// Longest sequence (prompt + output); defaults to the model's max positions.
    pub max_model_len: Option<usize>,
    /// Seed for requests that bring none (request `i` uses `seed + i`).
    pub seed: u64,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 1024,
            max_num_batched_tokens: 512,
            max_model_len: None,
            seed: 0,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("request {index}: {source}")]
    Sampling {
        index: usize,
        #[source]
        source: SamplingError,
    },
    #[error("request {index}: the prompt is empty")]
    EmptyPrompt { index: usize },
    #[error(
        "request {index}: this model's maximum context length is {max_model_len} tokens. \
         However, you requested {requested} tokens ({prompt} in the prompt, {max_tokens} for \
         the completion)"
    )]
    TooLong {
        index: usize,
        max_model_len: usize,
        requested: usize,
        prompt: usize,
        max_tokens: usize,
    },
    #[error("out of KV cache blocks ({num_blocks} in all); raise the cache size or send less")]
    OutOfBlocks { num_blocks: usize },
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// Something that happened in a step, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepEvent {
    Token { seq: usize, token: u32 },
    Finished { seq: usize, reason: FinishReason },
}

/// Result of one sequence.
#[derive(Clone, Debug)]
pub struct GenerationOutput {
    pub prompt_len: usize,
    pub token_ids: Vec<u32>,
    pub finish_reason: FinishReason,
}

struct Sequence {
    /// Prompt then output tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    num_computed: usize,
    block_table: Vec<u32>,
    sampler: Sampler,
    finished: Option<FinishReason>,
}

/// Timings of the last [`Generator::generate`] call.
#[derive(Clone, Copy, Debug, Default)]
pub struct RunStats {
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub num_prompt_tokens: usize,
    pub num_output_tokens: usize,
}

pub struct Generator {
    model: Box<dyn StepModel>,
    config: GeneratorConfig,
    logits: Logits,
    batch: ForwardBatch,
    free_blocks: Vec<u32>,
    stats: RunStats,
}

impl Generator {
    pub fn new<B: Backend>(
        model: Box<dyn Model<B>>,
        config: GeneratorConfig,
    ) -> Result<Self, ForwardError> {
        let model =
            BoundModel::new(model, KvCacheDtype::F32, config.num_blocks, config.block_size)?;
        let free_blocks = (0..config.num_blocks as u32).rev().collect();
        Ok(Self {
            batch: ForwardBatch::new(config.block_size),
            model: Box::new(model),
            config,
            logits: Logits::default(),
            free_blocks,
            stats: RunStats::default(),
        })
    }

    pub fn model(&self) -> &dyn StepModel {
        &*self.model
    }

    pub fn stats(&self) -> RunStats {
        self.stats
    }

    /// Blocks not held by any sequence.
    pub fn num_free_blocks(&self) -> usize {
        self.free_blocks.len()
    }

    fn max_model_len(&self) -> usize {
        self.config.max_model_len.unwrap_or(self.model.config().max_position_embeddings)
    }

    /// Generates for every `(prompt, params)`; `eos_token_ids` end a sequence unless it sets
    /// `ignore_eos`. Events arrive as tokens are produced.
    pub fn generate(
        &mut self,
        requests: &[(Vec<u32>, SamplingParams)],
        eos_token_ids: &[u32],
        mut on_event: impl FnMut(StepEvent),
    ) -> Result<Vec<GenerationOutput>, GenerateError> {
        let max_model_len = self.max_model_len();
        let mut seqs = Vec::with_capacity(requests.len());
        for (index, (prompt, params)) in requests.iter().enumerate() {
            params.validate().map_err(|source| GenerateError::Sampling { index, source })?;
            if prompt.is_empty() {
                return Err(GenerateError::EmptyPrompt { index });
            }
            let requested = prompt.len().saturating_add(params.max_tokens);
            if prompt.len() >= max_model_len {
                return Err(GenerateError::TooLong {
                    index,
                    max_model_len,
                    requested,
                    prompt: prompt.len(),
                    max_tokens: params.max_tokens,
                });
            }
            let seed = self.config.seed.wrapping_add(index as u64);
            seqs.push(Sequence {
                tokens: prompt.clone(),
                prompt_len: prompt.len(),
                num_computed: 0,
                block_table: Vec::new(),
                sampler: Sampler::new(params.clone(), prompt, seed),
                finished: None,
            });
        }
        self.stats = RunStats {
            num_prompt_tokens: seqs.iter().map(|s| s.prompt_len).sum(),
            ..RunStats::default()
        };
        let start = Instant::now();
        let mut prefill_done_at = None;
        let result = self.run(&mut seqs, eos_token_ids, max_model_len, &mut on_event, || {
            prefill_done_at.get_or_insert_with(Instant::now);
        });
        for seq in &mut seqs {
            self.free_blocks.extend(seq.block_table.drain(..).rev());
        }
        result?;
        let prefill_end = prefill_done_at.unwrap_or_else(Instant::now);
        self.stats.prefill_time = prefill_end - start;
        self.stats.decode_time = prefill_end.elapsed();
        self.stats.num_output_tokens = seqs.iter().map(|s| s.tokens.len() - s.prompt_len).sum();
        Ok(seqs
            .into_iter()
            .map(|s| GenerationOutput {
                prompt_len: s.prompt_len,
                token_ids: s.tokens[s.prompt_len..].to_vec(),
                finish_reason: s.finished.unwrap_or(FinishReason::Abort),
            })
            .collect())
    }

    fn run(
        &mut self,
        seqs: &mut [Sequence],
        eos: &[u32],
        max_model_len: usize,
        on_event: &mut impl FnMut(StepEvent),
        mut on_all_prefilled: impl FnMut(),
    ) -> Result<(), GenerateError> {
        let mut scheduled: Vec<(usize, usize)> = Vec::with_capacity(seqs.len());
        loop {
            if seqs.iter().all(|s| s.num_computed >= s.prompt_len || s.finished.is_some()) {
                on_all_prefilled();
            }
            // Plan the step: (sequence, number of new tokens).
            scheduled.clear();
            let mut budget = self.config.max_num_batched_tokens.max(1);
            for (i, seq) in seqs.iter().enumerate() {
                if seq.finished.is_some() || budget == 0 {
                    continue;
                }
                let n = (seq.tokens.len() - seq.num_computed).min(budget);
                budget -= n;
                scheduled.push((i, n));
            }
            if scheduled.is_empty() {
                return Ok(());
            }
            self.batch.clear();
            for &(i, n) in &scheduled {
                let seq = &mut seqs[i];
                let new_len = seq.num_computed + n;
                let blocks_needed = new_len.div_ceil(self.config.block_size);
                while seq.block_table.len() < blocks_needed {
                    let block = self
                        .free_blocks
                        .pop()
                        .ok_or(GenerateError::OutOfBlocks { num_blocks: self.config.num_blocks })?;
                    seq.block_table.push(block);
                }
                let wanted = if new_len == seq.tokens.len() {
                    LogitsWanted::Last
                } else {
                    LogitsWanted::None
                };
                self.batch.push_seq(
                    &seq.tokens[seq.num_computed..new_len],
                    seq.num_computed,
                    &seq.block_table,
                    wanted,
                )?;
            }
            self.model.forward(&self.batch, &mut self.logits)?;
            let mut row = 0;
            for &(i, n) in &scheduled {
                let seq = &mut seqs[i];
                seq.num_computed += n;
                if seq.num_computed < seq.tokens.len() {
                    continue;
                }
                let token = seq.sampler.sample(self.logits.row_mut(row)).0;
                row += 1;
                seq.tokens.push(token);
                on_event(StepEvent::Token { seq: i, token });
                let params = seq.sampler.params();
                let num_output = seq.tokens.len() - seq.prompt_len;
                let reason = if (!params.ignore_eos && eos.contains(&token))
                    || params.stop_token_ids.iter().any(|t| t.0 == token)
                {
                    Some(FinishReason::Stop)
                } else if num_output >= params.max_tokens || seq.tokens.len() >= max_model_len {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if let Some(reason) = reason {
                    seq.finished = Some(reason);
                    self.free_blocks.extend(seq.block_table.drain(..).rev());
                    on_event(StepEvent::Finished { seq: i, reason });
                }
            }
        }
    }
}
