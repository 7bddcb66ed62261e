//! Engine flags shared by `kiln serve` and the in-process benchmarks: kernel threads, the
//! scheduler's limits and policy (vLLM's flag names), and `--profile`, which sets coherent
//! defaults for the scheduler knobs. A flag given explicitly always wins over the profile.
//!
//! | knob | latency | balanced (default) | throughput |
//! |---|---:|---:|---:|
//! | `--max-num-seqs` | 32 | 128 | 256 |
//! | `--max-num-batched-tokens` | 512 | 2048 | 8192 |
//! | `--long-prefill-token-threshold` | 256 | 1024 | 0 (off) |
//! | `--max-num-partial-prefills` | 2 | 1 | 1 |
//!
//! Latency keeps steps small and mixes prefill chunks into decode steps, so new requests get
//! their first token sooner (lowest TTFT; decode steps that carry a chunk are slower);
//! throughput lets a step take all the work it can (a burst of prompts prefilled at once, then
//! pure decode steps: the steadiest inter-token latency, later first tokens); balanced sits
//! between. Measured effects: docs/BENCHMARKS.md, "Profiles".

use std::collections::BTreeMap;

use kiln_engine::slo::parse_slo_classes;
use kiln_engine::{
    EngineConfig, KvCacheDtype, SchedulerConfig, SchedulingPolicy, SloAdmission, SloClass,
    SloConfig, SpeculativeConfig,
};

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Policy {
    Fcfs,
    Priority,
    Sjf,
    Deadline,
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Admission {
    Reject,
    Demote,
    Off,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Profile {
    Latency,
    Balanced,
    Throughput,
}

/// The scheduler knobs a profile sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProfileDefaults {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub long_prefill_token_threshold: usize,
    pub max_num_partial_prefills: usize,
}

impl Profile {
    pub fn defaults(self) -> ProfileDefaults {
        let (seqs, tokens, threshold, partial) = match self {
            Self::Latency => (32, 512, 256, 2),
            Self::Balanced => (128, 2048, 1024, 1),
            Self::Throughput => (256, 8192, 0, 1),
        };
        ProfileDefaults {
            max_num_seqs: seqs,
            max_num_batched_tokens: tokens,
            long_prefill_token_threshold: threshold,
            max_num_partial_prefills: partial,
        }
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct EngineArgs {
    /// Kernel threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Defaults for the four scheduler knobs below (see docs/OPERATIONS.md).
    #[arg(long, value_enum, default_value = "balanced")]
    pub profile: Profile,
    /// Most requests running at once [profile: 32 | 128 | 256].
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one engine step (prefill chunks and decodes) [profile: 512 | 2048 | 8192].
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Prompts longer than this are prefilled in chunks of at most this many tokens (0 = no
    /// limit) [profile: 256 | 1024 | 0].
    #[arg(long)]
    pub long_prefill_token_threshold: Option<usize>,
    /// Most prompts being prefilled in chunks at once [profile: 2 | 1 | 1].
    #[arg(long)]
    pub max_num_partial_prefills: Option<usize>,
    /// Who runs first: arrival order, the request's `priority` (lower first), shortest
    /// remaining work (both aged so nothing starves), or the earliest first-token deadline
    /// (`--slo-classes`, `--target-ttft-ms`; late waiting work is demoted once).
    #[arg(long, value_enum, default_value = "fcfs")]
    pub scheduling_policy: Policy,
    /// p95 inter-token latency target in ms, every step: the batch controller moves the step's
    /// token budget and the running cap (below the profile's) to hold it (docs/OPERATIONS.md).
    #[arg(long, value_parser = parse_target_ms)]
    pub target_itl_ms: Option<f64>,
    /// Time-per-output-token target in ms, a request's mean gap after its first token (vLLM's
    /// TPOT): as --target-itl-ms, but a step may run longer on time shorter steps saved.
    #[arg(long, value_parser = parse_target_ms)]
    pub target_tpot_ms: Option<f64>,
    /// p95 time-to-first-token target in ms: the deadline of requests outside `--slo-classes`;
    /// the step budget drains queued prompts within it.
    #[arg(long, value_parser = parse_target_ms)]
    pub target_ttft_ms: Option<f64>,
    /// SLO classes by request `priority`, JSON: `{"0": {"ttft_ms": 1000, "tpot_ms": 60},
    /// "1": {"ttft_ms": 30000}}`.
    #[arg(long, value_parser = parse_slo_classes_arg)]
    pub slo_classes: Option<BTreeMap<i64, SloClass>>,
    /// A request whose first-token deadline the queued work already makes unmeetable: refused
    /// with 429 (reject, the default), queued behind on-time work (demote), or queued as is
    /// (off). Needs deadlines: --slo-classes or --target-ttft-ms.
    #[arg(long, value_enum)]
    pub slo_admission: Option<Admission>,
    /// Under --scheduling-policy deadline: a waiting request whose deadline passed, and a request
    /// without an SLO class, is due this many ms later [default: 60000].
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    pub slo_demotion_ms: Option<u64>,
    /// Element type of the KV cache: f16 (as llama.cpp's default) halves f32's memory and the
    /// bytes attention reads; int8, fp8 (= fp8_e4m3) and fp8_e5m2 halve them again (one byte
    /// per element plus a scale per token and KV head); f32 keeps K and V unrounded.
    #[arg(long, default_value = EngineConfig::default().kv_cache_dtype.name())]
    pub kv_cache_dtype: KvCacheDtype,
    /// Speculative decoding, vLLM's JSON: `{"method": "ngram", "num_speculative_tokens": K,
    /// "prompt_lookup_min": A, "prompt_lookup_max": B, "disable_by_batch_size": N}` (prompt
    /// lookup over the prompt and output so far), or `{"model": M, "num_speculative_tokens":
    /// K}` (method `draft_model`: a smaller model M with the same tokenizer, loaded as --model);
    /// outputs are unchanged, see docs/OPERATIONS.md.
    #[arg(long, value_parser = parse_speculative_config)]
    pub speculative_config: Option<SpeculativeConfig>,
    /// Runs each step's model forward on a second thread while the engine hands out the step
    /// before's tokens and takes new requests (vLLM's flag; outputs are unchanged; not with
    /// --speculative-config). See docs/OPERATIONS.md.
    #[arg(long)]
    pub async_scheduling: bool,
}

/// clap's parser for `--speculative-config` (the error names the field).
pub fn parse_speculative_config(text: &str) -> Result<SpeculativeConfig, String> {
    SpeculativeConfig::from_json(text).map_err(|e| e.to_string())
}

/// clap's parser for the millisecond targets.
pub fn parse_target_ms(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(ms) if ms.is_finite() && ms > 0.0 && ms <= 3.6e6 => Ok(ms),
        _ => Err(format!("`{text}` is not a number of milliseconds above 0 (at most one hour)")),
    }
}

fn parse_slo_classes_arg(text: &str) -> Result<BTreeMap<i64, SloClass>, String> {
    parse_slo_classes(text).map_err(|e| e.to_string())
}

impl Default for EngineArgs {
    fn default() -> Self {
        Self {
            threads: 0,
            profile: Profile::Balanced,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            long_prefill_token_threshold: None,
            max_num_partial_prefills: None,
            scheduling_policy: Policy::Fcfs,
            target_itl_ms: None,
            target_tpot_ms: None,
            target_ttft_ms: None,
            slo_classes: None,
            slo_admission: None,
            slo_demotion_ms: None,
            kv_cache_dtype: EngineConfig::default().kv_cache_dtype,
            speculative_config: None,
            async_scheduling: false,
        }
    }
}

impl EngineArgs {
    /// The profile's knobs with the explicit flags applied.
    pub fn resolved(&self) -> ProfileDefaults {
        let d = self.profile.defaults();
        ProfileDefaults {
            max_num_seqs: self.max_num_seqs.unwrap_or(d.max_num_seqs),
            max_num_batched_tokens: self.max_num_batched_tokens.unwrap_or(d.max_num_batched_tokens),
            long_prefill_token_threshold: self
                .long_prefill_token_threshold
                .unwrap_or(d.long_prefill_token_threshold),
            max_num_partial_prefills: self
                .max_num_partial_prefills
                .unwrap_or(d.max_num_partial_prefills),
        }
    }

    pub fn scheduler_config(&self, enable_prefix_caching: bool) -> SchedulerConfig {
        let knobs = self.resolved();
        SchedulerConfig {
            max_num_batched_tokens: knobs.max_num_batched_tokens,
            max_num_seqs: knobs.max_num_seqs,
            long_prefill_token_threshold: knobs.long_prefill_token_threshold,
            max_num_partial_prefills: knobs.max_num_partial_prefills,
            policy: match self.scheduling_policy {
                Policy::Fcfs => SchedulingPolicy::Fcfs,
                Policy::Priority => SchedulingPolicy::Priority,
                Policy::Sjf => SchedulingPolicy::Sjf,
                Policy::Deadline => SchedulingPolicy::Deadline,
            },
            slo_demotion_ms: self
                .slo_demotion_ms
                .unwrap_or(SchedulerConfig::default().slo_demotion_ms),
            enable_prefix_caching,
            ..SchedulerConfig::default()
        }
    }
}

impl EngineArgs {
    /// Latency targets, SLO classes and admission control; refuses flags that would have
    /// nothing to act on.
    pub fn slo_config(&self) -> anyhow::Result<SloConfig> {
        let has_deadlines = self.slo_classes.is_some() || self.target_ttft_ms.is_some();
        if self.slo_admission.is_some() && !has_deadlines {
            anyhow::bail!(
                "--slo-admission needs deadlines to act on: give --slo-classes or --target-ttft-ms"
            );
        }
        if self.slo_demotion_ms.is_some() && !matches!(self.scheduling_policy, Policy::Deadline) {
            anyhow::bail!("--slo-demotion-ms applies to --scheduling-policy deadline only");
        }
        Ok(SloConfig {
            target_itl_ms: self.target_itl_ms,
            target_tpot_ms: self.target_tpot_ms,
            target_ttft_ms: self.target_ttft_ms,
            classes: self.slo_classes.clone().unwrap_or_default(),
            admission: match self.slo_admission.unwrap_or(Admission::Reject) {
                Admission::Reject => SloAdmission::Reject,
                Admission::Demote => SloAdmission::Demote,
                Admission::Off => SloAdmission::Off,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineArgs,
    }

    fn parse(args: &[&str]) -> EngineArgs {
        Cli::try_parse_from(std::iter::once("kiln").chain(args.iter().copied())).unwrap().engine
    }

    #[test]
    fn profiles_set_defaults_and_flags_win() {
        assert_eq!(parse(&[]).resolved(), Profile::Balanced.defaults());
        let latency = parse(&["--profile", "latency"]).scheduler_config(true);
        assert_eq!((latency.max_num_seqs, latency.max_num_batched_tokens), (32, 512));
        assert_eq!(
            (latency.long_prefill_token_threshold, latency.max_num_partial_prefills),
            (256, 2)
        );
        let t = parse(&["--profile", "throughput", "--max-num-seqs", "7"]).resolved();
        assert_eq!(
            (t.max_num_seqs, t.max_num_batched_tokens, t.long_prefill_token_threshold),
            (7, 8192, 0)
        );
        assert!(Cli::try_parse_from(["kiln", "--profile", "fast"]).is_err());
        assert_eq!(parse(&[]).kv_cache_dtype, KvCacheDtype::F16);
        assert_eq!(parse(&["--kv-cache-dtype", "f32"]).kv_cache_dtype, KvCacheDtype::F32);
    }

    #[test]
    fn latency_targets_and_slo_classes() {
        let none = parse(&[]).slo_config().unwrap();
        assert_eq!(none, SloConfig::default());
        let e = parse(&[
            "--target-tpot-ms",
            "60",
            "--target-ttft-ms",
            "1000",
            "--scheduling-policy",
            "deadline",
            "--slo-classes",
            r#"{"0": {"ttft_ms": 500, "tpot_ms": 40}}"#,
            "--slo-admission",
            "demote",
        ]);
        let slo = e.slo_config().unwrap();
        assert_eq!((slo.target_tpot_ms, slo.target_ttft_ms), (Some(60.0), Some(1000.0)));
        assert_eq!(slo.target_itl_ms, None);
        let both = parse(&["--target-itl-ms", "200", "--target-tpot-ms", "50"]).slo_config();
        let both = both.unwrap();
        assert_eq!((both.target_itl_ms, both.target_tpot_ms), (Some(200.0), Some(50.0)));
        assert_eq!(slo.classes[&0], SloClass { ttft_ms: 500, tpot_ms: Some(40) });
        assert_eq!(slo.admission, SloAdmission::Demote);
        assert_eq!(e.scheduler_config(true).policy, SchedulingPolicy::Deadline);
        let bad_flags = [
            ["--target-itl-ms", "0"],
            ["--target-tpot-ms", "-5"],
            ["--target-ttft-ms", "nan"],
            ["--slo-classes", "{}"],
        ];
        for bad in bad_flags {
            assert!(Cli::try_parse_from(["kiln", bad[0], bad[1]]).is_err(), "{bad:?}");
        }
        // Flags with nothing to act on are refused, not ignored.
        let e = parse(&["--slo-admission", "demote", "--target-itl-ms", "50"]).slo_config();
        assert!(e.unwrap_err().to_string().contains("needs deadlines"));
        let e = parse(&["--slo-demotion-ms", "5000"]).slo_config();
        assert!(e.unwrap_err().to_string().contains("deadline only"));
        let d = parse(&["--scheduling-policy", "deadline", "--slo-demotion-ms", "5000"]);
        assert_eq!(d.scheduler_config(true).slo_demotion_ms, 5000);
    }

    #[test]
    fn speculative_config_is_vllms_json_and_errors_name_the_field() {
        assert_eq!(parse(&[]).speculative_config, None);
        let spec = r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}"#;
        let c = parse(&["--speculative-config", spec]).speculative_config.unwrap();
        assert_eq!(c.num_speculative_tokens, 3);
        let Err(e) =
            Cli::try_parse_from(["kiln", "--speculative-config", r#"{"method": "ngram"}"#])
        else {
            panic!("accepted a config without num_speculative_tokens");
        };
        assert!(e.to_string().contains("`num_speculative_tokens` is required"), "{e}");
    }
}
