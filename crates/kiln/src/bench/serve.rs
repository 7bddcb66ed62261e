//! `kiln bench serve`: the online benchmark (vLLM's `bench serve`) against any
//! OpenAI-compatible server. Builds the dataset with the served model's tokenizer, runs it
//! through `kiln_bench::serve`, prints the summary and saves it with `--save-result`.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, bail};
use kiln_bench::stats::parse_percentiles;
use kiln_bench::{
    BenchRequest, BenchResult, DatasetConfig, DatasetKind, RequestRate, ServeBenchConfig, Slos,
    Target,
};
use kiln_fetch::DEFAULT_MODEL_NAME;

use super::BenchTokenizer;

#[derive(clap::Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server's base URL (plain http).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// The model name to send; default: the first one the server's /v1/models lists.
    #[arg(long)]
    pub model: Option<String>,
    /// The tokenizer prompts are measured with: a GGUF file, an HF directory or `gemma-3-270m`;
    /// default: --model when it names one, else the default model.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// `/v1/completions` or `/v1/chat/completions`.
    #[arg(long, default_value = "/v1/completions")]
    pub endpoint: String,
    #[command(flatten)]
    pub data: DatasetArgs,
    /// Requests per second (`inf`: all at once); arrivals are gamma-distributed.
    #[arg(long, default_value = "inf")]
    pub request_rate: RequestRate,
    /// Gamma shape of the arrivals: 1 = Poisson, below 1 burstier, above 1 more regular.
    #[arg(long, default_value_t = 1.0)]
    pub burstiness: f64,
    /// Most requests in flight at once.
    #[arg(long)]
    pub max_concurrency: Option<usize>,
    /// Goodput objectives in ms: `ttft:500 tpot:50 e2el:10000`.
    #[arg(long, num_args = 1..)]
    pub goodput: Vec<String>,
    /// Percentiles to report.
    #[arg(long, default_value = "50,95,99")]
    pub percentiles: String,
    /// Ask the server to ignore EOS (every request generates its full output length).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Untimed requests (their own prompts) sent first; a failure stops the run.
    #[arg(long, default_value_t = 1)]
    pub num_warmups: usize,
    /// Save the summary and per-request data as JSON.
    #[arg(long)]
    pub save_result: Option<PathBuf>,
    /// A note saved with the result.
    #[arg(long, default_value = "")]
    pub label: String,
    /// `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// No progress bar (it is shown only when stderr is a terminal anyway).
    #[arg(long)]
    pub no_progress: bool,
}

/// The prompts: shared by `kiln bench serve` and `kiln tune`.
#[derive(clap::Args, Debug, Clone)]
pub struct DatasetArgs {
    /// `random`, `prefix-repetition`, or `sharegpt FILE`.
    #[arg(long, num_args = 1..=2, value_names = ["NAME", "FILE"], default_values = ["random"])]
    pub dataset: Vec<String>,
    /// The ShareGPT JSON file (alternative to `--dataset sharegpt FILE`).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    #[arg(long, default_value_t = 100)]
    pub num_prompts: usize,
    /// Prompt tokens (after any shared prefix).
    #[arg(long, default_value_t = 1024)]
    pub input_len: usize,
    /// Output tokens (max_tokens); default 128, or the reply's length for sharegpt.
    #[arg(long)]
    pub output_len: Option<usize>,
    /// Lengths vary uniformly in [len·(1−r), len·(1+r)].
    #[arg(long, default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Tokens of shared prefix before each prompt.
    #[arg(long, default_value_t = 0)]
    pub prefix_len: usize,
    /// Distinct prefixes of the prefix-repetition dataset.
    #[arg(long, default_value_t = 1)]
    pub num_prefixes: usize,
    /// Seed of the prompts and of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the benchmark, prints its summary, saves it if asked; returns it.
pub fn run_serve_bench(args: &ServeBenchArgs) -> anyhow::Result<BenchResult> {
    let result = run_quiet(args, !args.no_progress && std::io::stderr().is_terminal())?;
    print!("{}", result.report());
    if let Some(path) = &args.save_result {
        let json = serde_json::to_string_pretty(&result.to_json())?;
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("saved {}", path.display());
    }
    Ok(result)
}

/// Runs the benchmark without printing its summary.
pub fn run_quiet(args: &ServeBenchArgs, show_progress: bool) -> anyhow::Result<BenchResult> {
    let percentiles = parse_percentiles(&args.percentiles).map_err(anyhow::Error::msg)?;
    let slos = Slos::parse(&args.goodput).map_err(anyhow::Error::msg)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_served_model(args)?,
    };
    let tokenizer_spec = args.tokenizer.clone().unwrap_or_else(|| {
        if std::path::Path::new(&model).exists() {
            model.clone()
        } else {
            DEFAULT_MODEL_NAME.into()
        }
    });
    let tokenizer = BenchTokenizer::load(&tokenizer_spec)?;
    let (warmups, requests) = args.data.build(args.num_warmups, &tokenizer)?;
    let mean_prompt =
        requests.iter().map(|r| r.prompt_len).sum::<usize>() as f64 / requests.len().max(1) as f64;
    eprintln!(
        "{} requests ({} warm-up), mean prompt {mean_prompt:.0} tokens, rate {}, concurrency {}",
        requests.len(),
        warmups.len(),
        args.request_rate,
        args.max_concurrency.map_or_else(|| "unlimited".into(), |c| c.to_string())
    );
    let config = ServeBenchConfig {
        target: Target {
            base_url: args.base_url.clone(),
            endpoint: args.endpoint.clone(),
            model,
            api_key: args.api_key.clone(),
            ignore_eos: args.ignore_eos,
        },
        request_rate: args.request_rate,
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        slos,
        percentiles,
        seed: args.data.seed,
        show_progress,
        label: args.label.clone(),
    };
    kiln_bench::run_blocking(&config, &warmups, &requests, &tokenizer)
}

impl DatasetArgs {
    /// `num_warmups` warm-up requests (their own prompts) and the measured ones.
    pub fn build(
        &self,
        num_warmups: usize,
        tok: &BenchTokenizer,
    ) -> anyhow::Result<(Vec<BenchRequest>, Vec<BenchRequest>)> {
        let mut config = self.config()?;
        config.num_prompts += num_warmups;
        let mut requests = kiln_bench::dataset::build(&config, tok)?;
        let warmups = requests.drain(..num_warmups).collect();
        Ok((warmups, requests))
    }

    fn config(&self) -> anyhow::Result<DatasetConfig> {
        let kind = match self.dataset.first().map(String::as_str) {
            Some("random") | None => DatasetKind::Random,
            Some("prefix-repetition") => DatasetKind::PrefixRepetition,
            Some("sharegpt") => {
                let path =
                    self.dataset.get(1).map(PathBuf::from).or_else(|| self.dataset_path.clone());
                let Some(path) = path else {
                    bail!("--dataset sharegpt needs a file: --dataset sharegpt FILE");
                };
                DatasetKind::ShareGpt(path)
            }
            Some(other) => {
                bail!("unknown --dataset `{other}` (random, prefix-repetition, sharegpt FILE)")
            }
        };
        if self.dataset.len() > 1 && !matches!(kind, DatasetKind::ShareGpt(_)) {
            bail!("only --dataset sharegpt takes a file");
        }
        Ok(DatasetConfig {
            kind,
            num_prompts: self.num_prompts,
            input_len: self.input_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            prefix_len: self.prefix_len,
            num_prefixes: self.num_prefixes,
            seed: self.seed,
        })
    }
}

/// The first model id of the server's `/v1/models`.
fn first_served_model(args: &ServeBenchArgs) -> anyhow::Result<String> {
    let client = kiln_bench::ApiClient::new(Target::server(&args.base_url, args.api_key.clone()))?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (status, body) = runtime
        .block_on(client.get("/v1/models"))
        .with_context(|| format!("asking {} for its models (give --model)", args.base_url))?;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let id = json["data"][0]["id"].as_str().map(str::to_owned);
    id.with_context(|| {
        format!("{}/v1/models answered {status} without a model id; give --model", args.base_url)
    })
}
