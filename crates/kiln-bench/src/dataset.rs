//! Benchmark prompts: `random` (random vocabulary tokens, with an optional shared prefix),
//! `prefix-repetition` (a few long shared prefixes, each followed by a unique suffix) and
//! `sharegpt` (first human turn of each ShareGPT conversation; the reply's length sets the
//! output length unless one is given).
//!
//! Invariants: the same config and seed give the same prompts; every prompt's `prompt_len` is
//! its length under the tokenizer (no special tokens); `output_len >= 1`. Lengths are the
//! client's view: a server adds its BOS token or chat template on top.

use std::path::PathBuf;

use anyhow::{Context, bail};
use kiln_core::Rng;
use serde_json::Value;

/// The tokenizer the datasets measure prompts with (the served model's own, ideally).
pub trait PromptTokenizer: Send + Sync {
    /// Token ids of `text`, without special tokens.
    fn encode(&self, text: &str) -> Vec<u32>;
    fn decode(&self, ids: &[u32]) -> String;
    fn vocab_size(&self) -> usize;
    /// Control and other special tokens, which random prompts avoid.
    fn is_special(&self, id: u32) -> bool;
}

/// One request to send.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchRequest {
    pub prompt: String,
    /// Prompt tokens as the tokenizer counts them.
    pub prompt_len: usize,
    /// `max_tokens` of the request.
    pub output_len: usize,
    /// vLLM's `priority` request field (`--priority-mix`); `None`: not sent.
    pub priority: Option<i64>,
    /// The `model` sent instead of the target's (a LoRA adapter, `--lora-modules`).
    pub model: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DatasetKind {
    Random,
    PrefixRepetition,
    ShareGpt(PathBuf),
}

#[derive(Clone, Debug)]
pub struct DatasetConfig {
    pub kind: DatasetKind,
    pub num_prompts: usize,
    /// Prompt tokens after the prefix (random, prefix-repetition).
    pub input_len: usize,
    /// Output tokens; `None` = 128, or the reply's length for sharegpt.
    pub output_len: Option<usize>,
    /// Lengths are drawn uniformly from `[len * (1 - r), len * (1 + r)]`.
    pub range_ratio: f64,
    /// Shared prefix tokens before each prompt.
    pub prefix_len: usize,
    /// Distinct prefixes (prefix-repetition); requests cycle through them.
    pub num_prefixes: usize,
    pub seed: u64,
}

const DEFAULT_OUTPUT_LEN: usize = 128;

/// Builds `config.num_prompts` requests.
pub fn build(
    config: &DatasetConfig,
    tok: &dyn PromptTokenizer,
) -> anyhow::Result<Vec<BenchRequest>> {
    if config.num_prompts == 0 {
        bail!("--num-prompts must be at least 1");
    }
    if !(0.0..1.0).contains(&config.range_ratio) {
        bail!("--range-ratio must be in [0, 1), got {}", config.range_ratio);
    }
    if config.output_len == Some(0) {
        bail!("--output-len must be at least 1");
    }
    let mut rng = Rng::new(config.seed);
    match &config.kind {
        DatasetKind::Random => random(config, tok, &mut rng, 1),
        DatasetKind::PrefixRepetition => {
            if config.prefix_len == 0 || config.num_prefixes == 0 {
                bail!("prefix-repetition needs --prefix-len >= 1 and --num-prefixes >= 1");
            }
            random(config, tok, &mut rng, config.num_prefixes)
        }
        DatasetKind::ShareGpt(path) => sharegpt(config, path, tok, &mut rng),
    }
}

fn random(
    config: &DatasetConfig,
    tok: &dyn PromptTokenizer,
    rng: &mut Rng,
    num_prefixes: usize,
) -> anyhow::Result<Vec<BenchRequest>> {
    if config.input_len == 0 && config.prefix_len == 0 {
        bail!("--input-len must be at least 1");
    }
    let sampler = TokenSampler::new(tok)?;
    let prefixes: Vec<String> =
        (0..num_prefixes).map(|_| text_of_len(tok, &sampler, rng, config.prefix_len)).collect();
    let output_len = config.output_len.unwrap_or(DEFAULT_OUTPUT_LEN);
    let mut requests = Vec::with_capacity(config.num_prompts);
    for i in 0..config.num_prompts {
        let input_len = jitter(rng, config.input_len, config.range_ratio);
        let out_len = jitter(rng, output_len, config.range_ratio).max(1);
        let suffix = text_of_len(tok, &sampler, rng, input_len);
        let prompt = format!("{}{suffix}", prefixes[i % num_prefixes]);
        let prompt_len = tok.encode(&prompt).len();
        requests.push(BenchRequest {
            prompt,
            prompt_len,
            output_len: out_len,
            priority: None,
            model: None,
        });
    }
    if num_prefixes > 1 {
        shuffle(&mut requests, rng);
    }
    Ok(requests)
}

/// `len` scaled by a uniform factor in `[1 - r, 1 + r]`, at least 1 when `len` is.
fn jitter(rng: &mut Rng, len: usize, r: f64) -> usize {
    if r == 0.0 || len == 0 {
        return len;
    }
    let lo = (len as f64 * (1.0 - r)).round().max(1.0) as u64;
    let hi = (len as f64 * (1.0 + r)).round() as u64;
    (lo + rng.next_u64() % (hi - lo + 1)) as usize
}

fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        items.swap(i, j);
    }
}

/// Draws ordinary (non-special) token ids.
struct TokenSampler {
    vocab: u64,
}

impl TokenSampler {
    fn new(tok: &dyn PromptTokenizer) -> anyhow::Result<Self> {
        let vocab = tok.vocab_size() as u64;
        if vocab == 0 || (0..vocab.min(4096)).all(|id| tok.is_special(id as u32)) {
            bail!("the tokenizer has no ordinary tokens to build random prompts from");
        }
        Ok(Self { vocab })
    }

    fn draw(&self, tok: &dyn PromptTokenizer, rng: &mut Rng) -> u32 {
        loop {
            let id = (rng.next_u64() % self.vocab) as u32;
            if !tok.is_special(id) {
                return id;
            }
        }
    }
}

/// Text that tokenizes to exactly `len` tokens where the tokenizer allows (random ids are
/// decoded, re-encoded and cut, as vLLM's random dataset does; a few rounds top up merges).
fn text_of_len(
    tok: &dyn PromptTokenizer,
    sampler: &TokenSampler,
    rng: &mut Rng,
    len: usize,
) -> String {
    if len == 0 {
        return String::new();
    }
    let mut ids: Vec<u32> = (0..len).map(|_| sampler.draw(tok, rng)).collect();
    let mut text = tok.decode(&ids);
    for _ in 0..8 {
        let encoded = tok.encode(&text);
        match encoded.len().cmp(&len) {
            std::cmp::Ordering::Equal => return text,
            std::cmp::Ordering::Greater => {
                text = tok.decode(&encoded[..len]);
            }
            std::cmp::Ordering::Less => {
                ids = encoded;
                ids.extend((0..len - ids.len()).map(|_| sampler.draw(tok, rng)));
                text = tok.decode(&ids);
            }
        }
    }
    text
}

/// ShareGPT's filters (vLLM's): drop pairs with a prompt or reply under 4 tokens (the reply's
/// length is not checked when `--output-len` is given), a prompt over 1,024 tokens, or more
/// than 2,048 tokens in all.
fn sharegpt(
    config: &DatasetConfig,
    path: &PathBuf,
    tok: &dyn PromptTokenizer,
    rng: &mut Rng,
) -> anyhow::Result<Vec<BenchRequest>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the ShareGPT file {}", path.display()))?;
    let json: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let Some(entries) = json.as_array() else {
        bail!("{}: expected a JSON array of conversations", path.display());
    };
    let mut pairs: Vec<(String, String)> = entries.iter().filter_map(first_exchange).collect();
    shuffle(&mut pairs, rng);
    let mut requests = Vec::with_capacity(config.num_prompts);
    for (prompt, reply) in pairs {
        if requests.len() == config.num_prompts {
            break;
        }
        let prompt_len = tok.encode(&prompt).len();
        let output_len = config.output_len.unwrap_or_else(|| tok.encode(&reply).len());
        let output_ok = output_len >= 4 || config.output_len.is_some();
        if prompt_len >= 4 && output_ok && prompt_len <= 1024 && prompt_len + output_len <= 2048 {
            requests.push(BenchRequest {
                prompt,
                prompt_len,
                output_len,
                priority: None,
                model: None,
            });
        }
    }
    if requests.len() < config.num_prompts {
        bail!(
            "{} has only {} usable conversations, fewer than --num-prompts {}",
            path.display(),
            requests.len(),
            config.num_prompts
        );
    }
    Ok(requests)
}

/// The first (human, assistant) turns of one ShareGPT entry, in either the `from`/`value` or
/// the `role`/`content` spelling.
fn first_exchange(entry: &Value) -> Option<(String, String)> {
    let turns = entry.get("conversations").or_else(|| entry.get("conversation"))?.as_array()?;
    let text = |t: &Value| {
        t.get("value").or_else(|| t.get("content")).and_then(Value::as_str).map(str::to_owned)
    };
    let (first, second) = (turns.first()?, turns.get(1)?);
    Some((text(first)?, text(second)?))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A toy tokenizer: one token per lowercase letter `a..z` (ids 1..=26); id 0 is special.
    pub struct Letters;

    impl PromptTokenizer for Letters {
        fn encode(&self, text: &str) -> Vec<u32> {
            text.bytes().filter(u8::is_ascii_lowercase).map(|b| u32::from(b - b'a') + 1).collect()
        }
        fn decode(&self, ids: &[u32]) -> String {
            ids.iter().filter(|&&i| i > 0).map(|&i| char::from(b'a' + (i - 1) as u8)).collect()
        }
        fn vocab_size(&self) -> usize {
            27
        }
        fn is_special(&self, id: u32) -> bool {
            id == 0
        }
    }

    fn config(kind: DatasetKind) -> DatasetConfig {
        DatasetConfig {
            kind,
            num_prompts: 10,
            input_len: 20,
            output_len: Some(8),
            range_ratio: 0.0,
            prefix_len: 0,
            num_prefixes: 1,
            seed: 3,
        }
    }

    #[test]
    fn random_prompts_have_the_asked_lengths_and_are_reproducible() {
        let c = config(DatasetKind::Random);
        let a = build(&c, &Letters).unwrap();
        assert_eq!(a.len(), 10);
        assert!(a.iter().all(|r| r.prompt_len == 20 && r.output_len == 8));
        assert_eq!(a, build(&c, &Letters).unwrap());
        assert_ne!(a[0].prompt, a[1].prompt);
        let mut c2 = c.clone();
        c2.range_ratio = 0.5;
        let b = build(&c2, &Letters).unwrap();
        assert!(
            b.iter().all(|r| (10..=30).contains(&r.prompt_len) && (4..=12).contains(&r.output_len))
        );
        assert!(b.iter().any(|r| r.prompt_len != 20));
    }

    #[test]
    fn prefixes_are_shared() {
        let mut c = config(DatasetKind::PrefixRepetition);
        c.prefix_len = 30;
        c.num_prefixes = 2;
        let r = build(&c, &Letters).unwrap();
        let mut heads: Vec<&str> = r.iter().map(|r| &r.prompt[..30]).collect();
        heads.sort_unstable();
        heads.dedup();
        assert_eq!(heads.len(), 2);
        assert!(r.iter().all(|r| r.prompt_len == 50));
        c.prefix_len = 0;
        assert!(build(&c, &Letters).is_err());
    }

    #[test]
    fn sharegpt_takes_first_exchanges_and_filters() {
        let dir = std::env::temp_dir().join(format!("kiln-sharegpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sg.json");
        let data = serde_json::json!([
            {"conversations": [{"from": "human", "value": "hello there friend"},
                               {"from": "gpt", "value": "general kenobi you are bold"}]},
            {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"conversation": [{"role": "user", "content": "what is the time now"},
                              {"role": "assistant", "content": "it is late evening"}]},
            {"nothing": 1}
        ]);
        std::fs::write(&path, data.to_string()).unwrap();
        let mut c = config(DatasetKind::ShareGpt(path.clone()));
        c.num_prompts = 2;
        c.output_len = None;
        let mut r = build(&c, &Letters).unwrap();
        r.sort_by_key(|r| r.prompt_len);
        assert_eq!(r[0].prompt, "hello there friend");
        assert_eq!((r[0].prompt_len, r[0].output_len), (16, 23));
        assert_eq!((r[1].prompt_len, r[1].output_len), (16, 15));
        c.num_prompts = 3;
        assert!(build(&c, &Letters).unwrap_err().to_string().contains("only 2 usable"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_configs_are_refused() {
        let mut c = config(DatasetKind::Random);
        c.range_ratio = 1.5;
        assert!(build(&c, &Letters).is_err());
        let mut c = config(DatasetKind::Random);
        c.num_prompts = 0;
        assert!(build(&c, &Letters).is_err());
        let mut c = config(DatasetKind::ShareGpt("/nonexistent/x.json".into()));
        c.num_prompts = 1;
        assert!(build(&c, &Letters).unwrap_err().to_string().contains("reading"));
    }
}
