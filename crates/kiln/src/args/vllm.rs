//! `kiln serve` flags spelled and meaning as `vllm serve`'s, beyond the engine and KV cache
//! flags that already share vLLM's names (`--dtype` is a model flag: [`super::dtype`]):
//! `--tokenizer`, `--generation-config`,
//! `--enable-log-requests`, `--config`, and the observability flags (`--metrics-prefix`,
//! `--log-stats-interval`, `--disable-log-stats`).

use std::path::PathBuf;

use anyhow::Context;
use kiln_tokenizer::GenerationDefaults;

#[derive(clap::Args, Debug, Clone)]
pub struct VllmServeArgs {
    /// The tokenizer to use instead of the model's: a GGUF file, an HF directory or a Hugging
    /// Face id.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// Sampling defaults: `auto` (the model's generation_config.json), `vllm` (none: neutral
    /// sampling), or a directory holding a generation_config.json.
    #[arg(long, default_value = "auto")]
    pub generation_config: String,
    /// Log a line per finished request (off by default, as in vLLM).
    #[arg(long)]
    pub enable_log_requests: bool,
    /// A YAML file of flags (`max-model-len: 32k`); command-line flags and `KILN_ARG_*`
    /// variables win over it.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    /// Prefix of the engine metrics' names on /metrics: `kiln:num_requests_running`; `vllm`
    /// gives vLLM's names for existing dashboards and alerts.
    #[arg(long, default_value = "kiln", value_parser = metric_prefix)]
    pub metrics_prefix: String,
    /// Seconds between the periodic stats log lines (throughput, running, waiting, KV cache
    /// usage, prefix cache hit rate), as vLLM's.
    #[arg(long, default_value_t = 10.0)]
    pub log_stats_interval: f64,
    /// No periodic stats log lines.
    #[arg(long)]
    pub disable_log_stats: bool,
}

/// A Prometheus metric name prefix: `[a-zA-Z_][a-zA-Z0-9_]*`.
fn metric_prefix(s: &str) -> Result<String, String> {
    let mut chars = s.chars();
    let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if first_ok && chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
        Ok(s.to_owned())
    } else {
        Err(format!("`{s}` is not a metric name prefix ([a-zA-Z_][a-zA-Z0-9_]*)"))
    }
}

impl VllmServeArgs {
    /// The stats log interval, if the stats log is on.
    pub fn stats_interval(&self) -> anyhow::Result<Option<std::time::Duration>> {
        if self.disable_log_stats {
            return Ok(None);
        }
        if !(self.log_stats_interval.is_finite() && self.log_stats_interval > 0.0) {
            anyhow::bail!("--log-stats-interval must be a positive number of seconds");
        }
        Ok(Some(std::time::Duration::from_secs_f64(self.log_stats_interval)))
    }

    /// The sampling defaults for `--generation-config`, given the model's own.
    pub fn generation_defaults(
        &self,
        model_defaults: GenerationDefaults,
    ) -> anyhow::Result<GenerationDefaults> {
        match self.generation_config.as_str() {
            "auto" => Ok(model_defaults),
            "vllm" => Ok(GenerationDefaults::default()),
            dir => {
                let dir = std::path::Path::new(dir);
                if !dir.join("generation_config.json").is_file() {
                    anyhow::bail!(
                        "--generation-config {}: expected `auto`, `vllm` or a directory holding \
                         generation_config.json",
                        dir.display()
                    );
                }
                GenerationDefaults::from_dir(dir)
                    .with_context(|| format!("--generation-config {}", dir.display()))
            }
        }
    }
}
