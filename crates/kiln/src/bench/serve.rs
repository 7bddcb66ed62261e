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

/// vLLM's `--backend` values kiln's client speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// `/v1/completions` (vLLM's `vllm` backend is the same endpoint).
    #[value(alias = "vllm")]
    Openai,
    /// `/v1/chat/completions`.
    OpenaiChat,
    /// `/v1/embeddings`: each prompt one input; a request's TTFT is its latency.
    OpenaiEmbeddings,
}

#[derive(clap::Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server's base URL (`http://` or `https://`); default: http://HOST:PORT.
    #[arg(long)]
    pub base_url: Option<String>,
    /// The server's host, when no --base-url is given.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The server's port, when no --base-url is given.
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// The model; default: the first one the server's /v1/models lists. Also the tokenizer
    /// when it names one and no --tokenizer is given.
    #[arg(long)]
    pub model: Option<String>,
    /// The name sent as `model` when it differs from --model (vLLM's flag).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// The tokenizer prompts are measured with: a GGUF file, an HF directory, a Hugging Face
    /// id or `gemma-3-270m`; default: --model when it names one, else the default model.
    #[arg(long)]
    pub tokenizer: Option<String>,
    /// `openai` (/v1/completions; `vllm` is the same), `openai-chat` (/v1/chat/completions)
    /// or `openai-embeddings` (/v1/embeddings).
    #[arg(long, value_enum, default_value = "openai")]
    pub backend: Backend,
    /// The endpoint; default: the --backend's.
    #[arg(long)]
    pub endpoint: Option<String>,
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
    /// Send vLLM's `priority` field with a mix of values, `PRIORITY:SHARE,...` (e.g.
    /// `0:0.2,1:0.8`: a fifth of the requests at priority 0, drawn with `--seed`); the report
    /// adds a summary per priority.
    #[arg(long, value_parser = parse_priority_mix)]
    pub priority_mix: Option<PriorityMix>,
    /// LoRA adapters the server serves (by name): each request asks for one of them, drawn
    /// with --seed (vLLM's flag).
    #[arg(long, num_args = 1.., value_name = "NAME")]
    pub lora_modules: Vec<String>,
    /// Percentiles to report (vLLM's default: 99).
    #[arg(long, alias = "percentiles", default_value = "99")]
    pub metric_percentiles: String,
    /// Metrics to report statistics of: ttft, tpot, itl, e2el.
    #[arg(long, default_value = "ttft,tpot,itl")]
    pub percentile_metrics: String,
    /// Sampling temperature of every request [default: 0, greedy].
    #[arg(long)]
    pub temperature: Option<f64>,
    /// A JSON object merged into every request body, e.g. '{"top_k": 20}'.
    #[arg(long)]
    pub extra_body: Option<String>,
    /// Ask the server to ignore EOS (every request generates its full output length); always
    /// on for the random dataset, as in vLLM.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Untimed requests (their own prompts) sent first; a failure stops the run.
    #[arg(long, default_value_t = 1)]
    pub num_warmups: usize,
    /// Save the result as JSON: to FILE if given, else to --result-filename, else to
    /// `{label}-{rate}qps[-concurrency{C}]-{model}-{date}.json` as vLLM names it.
    #[arg(long, num_args = 0..=1, value_name = "FILE")]
    #[allow(clippy::option_option)] // absent | the flag alone | the flag with a file
    pub save_result: Option<Option<PathBuf>>,
    /// Also save per-request data (input and output lengths, TTFTs, ITLs, latencies, texts,
    /// errors).
    #[arg(long)]
    pub save_detailed: bool,
    /// The result file's name.
    #[arg(long)]
    pub result_filename: Option<PathBuf>,
    /// The directory the result file goes in.
    #[arg(long)]
    pub result_dir: Option<PathBuf>,
    /// A note saved with the result (vLLM: the file name's prefix; default: the backend).
    #[arg(long, default_value = "")]
    pub label: String,
    /// `Authorization: Bearer KEY`.
    #[arg(long, env = "OPENAI_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// No progress bar (it is shown only when stderr is a terminal anyway).
    #[arg(long, alias = "disable-tqdm")]
    pub no_progress: bool,
}

impl ServeBenchArgs {
    /// --base-url, else `http://HOST:PORT`.
    pub fn base_url(&self) -> String {
        self.base_url.clone().unwrap_or_else(|| {
            let host = if self.host.contains(':') {
                format!("[{}]", self.host)
            } else {
                self.host.clone()
            };
            format!("http://{host}:{}", self.port)
        })
    }

    fn endpoint(&self) -> String {
        self.endpoint.clone().unwrap_or_else(|| {
            match self.backend {
                Backend::Openai => "/v1/completions",
                Backend::OpenaiChat => "/v1/chat/completions",
                Backend::OpenaiEmbeddings => "/v1/embeddings",
            }
            .into()
        })
    }

    /// Where `--save-result` / `--result-filename` / `--result-dir` put the result, if anywhere.
    fn result_path(&self, result: &BenchResult) -> Option<PathBuf> {
        let explicit = self.save_result.clone().flatten();
        if self.save_result.is_none() && self.result_filename.is_none() {
            return None;
        }
        let name = explicit.or_else(|| self.result_filename.clone()).unwrap_or_else(|| {
            let label =
                if self.label.is_empty() { backend_name(self.backend) } else { &self.label };
            let concurrency =
                self.max_concurrency.map_or_else(String::new, |c| format!("-concurrency{c}"));
            let model = result.model.rsplit('/').next().unwrap_or(&result.model);
            PathBuf::from(format!(
                "{label}-{}qps{concurrency}-{model}-{}.json",
                result.request_rate_text(),
                result.date
            ))
        });
        Some(match &self.result_dir {
            Some(dir) => dir.join(name),
            None => name,
        })
    }
}

fn backend_name(b: Backend) -> &'static str {
    match b {
        Backend::Openai => "openai",
        Backend::OpenaiChat => "openai-chat",
        Backend::OpenaiEmbeddings => "openai-embeddings",
    }
}

/// The prompts: shared by `kiln bench serve` and `kiln tune`.
#[derive(clap::Args, Debug, Clone)]
pub struct DatasetArgs {
    /// `random`, `prefix-repetition` (or `prefix_repetition`), or `sharegpt FILE`.
    #[arg(long, alias = "dataset-name", num_args = 1..=2, value_names = ["NAME", "FILE"], default_values = ["random"])]
    pub dataset: Vec<String>,
    /// The ShareGPT JSON file (alternative to `--dataset sharegpt FILE`).
    #[arg(long)]
    pub dataset_path: Option<PathBuf>,
    /// Requests to send [default: 1000 for bench serve (vLLM's), 100 for tune].
    #[arg(long)]
    pub num_prompts: Option<usize>,
    /// Prompt tokens (after any shared prefix).
    #[arg(long, alias = "random-input-len", default_value_t = 1024)]
    pub input_len: usize,
    /// Output tokens (max_tokens); default 128, or the reply's length for sharegpt.
    #[arg(long, visible_alias = "random-output-len", aliases = ["sharegpt-output-len", "prefix-repetition-output-len"])]
    pub output_len: Option<usize>,
    /// Lengths vary uniformly in [len·(1−r), len·(1+r)].
    #[arg(long, alias = "random-range-ratio", default_value_t = 0.0)]
    pub range_ratio: f64,
    /// Tokens of shared prefix before each prompt.
    #[arg(long, aliases = ["random-prefix-len", "prefix-repetition-prefix-len"], default_value_t = 0)]
    pub prefix_len: usize,
    /// Distinct prefixes of the prefix-repetition dataset.
    #[arg(long, alias = "prefix-repetition-num-prefixes", default_value_t = 1)]
    pub num_prefixes: usize,
    /// Seed of the prompts and of the arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Runs the benchmark, prints its summary, saves it if asked; returns it.
pub fn run_serve_bench(args: &ServeBenchArgs) -> anyhow::Result<BenchResult> {
    let result = run_quiet(args, !args.no_progress && std::io::stderr().is_terminal())?;
    print!("{}", result.report());
    if let Some(path) = args.result_path(&result) {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let json = serde_json::to_string_pretty(&result.to_json(args.save_detailed))?;
        std::fs::write(&path, json).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("saved {}", path.display());
    }
    Ok(result)
}

/// Runs the benchmark without printing its summary.
pub fn run_quiet(args: &ServeBenchArgs, show_progress: bool) -> anyhow::Result<BenchResult> {
    let percentiles = parse_percentiles(&args.metric_percentiles).map_err(anyhow::Error::msg)?;
    let percentile_metrics = parse_metrics(&args.percentile_metrics)?;
    let extra_body = match &args.extra_body {
        Some(text) => match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(map)) => Some(map),
            _ => bail!("--extra-body must be a JSON object, got `{text}`"),
        },
        None => None,
    };
    let base_url = args.base_url();
    let slos = Slos::parse(&args.goodput).map_err(anyhow::Error::msg)?;
    let model = match &args.model {
        Some(m) => m.clone(),
        None => first_served_model(args, &base_url)?,
    };
    let tokenizer_spec = args.tokenizer.clone().unwrap_or_else(|| {
        // A model that names files or a Hugging Face id is its own tokenizer, as in vLLM.
        if std::path::Path::new(&model).exists() || crate::hub::HubId::parse(&model).is_some() {
            model.clone()
        } else {
            DEFAULT_MODEL_NAME.into()
        }
    });
    let tokenizer = BenchTokenizer::load(&tokenizer_spec)?;
    let mut data = args.data.clone();
    data.num_prompts = Some(data.num_prompts.unwrap_or(1000));
    let (warmups, mut requests) = data.build(args.num_warmups, &tokenizer)?;
    if let Some(PriorityMix(mix)) = &args.priority_mix {
        assign_priorities(&mut requests, mix, args.data.seed);
    }
    assign_adapters(&mut requests, &args.lora_modules, args.data.seed);
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
            base_url,
            endpoint: args.endpoint(),
            model: args.served_model_name.clone().unwrap_or_else(|| model.clone()),
            api_key: args.api_key.clone(),
            ignore_eos: args.ignore_eos || args.data.is_random(),
            temperature: args.temperature,
            extra_body,
        },
        request_rate: args.request_rate,
        burstiness: args.burstiness,
        max_concurrency: args.max_concurrency,
        slos,
        percentiles,
        seed: args.data.seed,
        show_progress,
        label: args.label.clone(),
        backend: backend_name(args.backend).into(),
        tokenizer_id: tokenizer_spec,
        percentile_metrics,
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
            Some("prefix-repetition" | "prefix_repetition") => DatasetKind::PrefixRepetition,
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
            num_prompts: self.num_prompts.unwrap_or(100),
            input_len: self.input_len,
            output_len: self.output_len,
            range_ratio: self.range_ratio,
            prefix_len: self.prefix_len,
            num_prefixes: self.num_prefixes,
            seed: self.seed,
        })
    }
}

/// `--priority-mix`: `(priority, share)` pairs whose shares sum to 1.
#[derive(Clone, Debug, PartialEq)]
pub struct PriorityMix(pub Vec<(i64, f64)>);

/// `--priority-mix`: `PRIORITY:SHARE` pairs; shares are positive and normalised to sum to 1.
fn parse_priority_mix(text: &str) -> Result<PriorityMix, String> {
    let mut mix = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (p, share) = item
            .split_once(':')
            .ok_or_else(|| format!("`{item}`: expected PRIORITY:SHARE, e.g. 0:0.2"))?;
        let p: i64 = p.trim().parse().map_err(|_| format!("`{item}`: `{p}` is not an integer"))?;
        let share: f64 = share.trim().parse().map_err(|_| format!("`{item}`: bad share"))?;
        if !(share.is_finite() && share > 0.0) {
            return Err(format!("`{item}`: the share must be a positive number"));
        }
        if mix.iter().any(|&(q, _)| q == p) {
            return Err(format!("priority {p} is given twice"));
        }
        mix.push((p, share));
    }
    if mix.is_empty() {
        return Err("give at least one PRIORITY:SHARE".into());
    }
    let total: f64 = mix.iter().map(|&(_, s)| s).sum();
    Ok(PriorityMix(mix.into_iter().map(|(p, s)| (p, s / total)).collect()))
}

/// Gives each request a priority drawn from `mix` (seeded, so runs compare request by request).
fn assign_priorities(requests: &mut [BenchRequest], mix: &[(i64, f64)], seed: u64) {
    let mut rng = kiln_core::Rng::new(seed ^ 0x5052_494f);
    for req in requests {
        let u = rng.next_f64();
        let mut acc = 0.0;
        let mut chosen = mix[mix.len() - 1].0;
        for &(p, share) in mix {
            acc += share;
            if u < acc {
                chosen = p;
                break;
            }
        }
        req.priority = Some(chosen);
    }
}

/// Gives each request one of `names` as its `model`, drawn uniformly (seeded); none: the
/// target's model.
fn assign_adapters(requests: &mut [BenchRequest], names: &[String], seed: u64) {
    if names.is_empty() {
        return;
    }
    let mut rng = kiln_core::Rng::new(seed ^ 0x4c4f_5241);
    for req in requests {
        let i = ((rng.next_f64() * names.len() as f64) as usize).min(names.len() - 1);
        req.model = Some(names[i].clone());
    }
}

/// The metrics named by `--percentile-metrics`.
fn parse_metrics(list: &str) -> anyhow::Result<Vec<String>> {
    let names: Vec<String> =
        list.split(',').map(|m| m.trim().to_owned()).filter(|m| !m.is_empty()).collect();
    if let Some(bad) = names.iter().find(|m| !["ttft", "tpot", "itl", "e2el"].contains(&m.as_str()))
    {
        bail!("--percentile-metrics: unknown metric `{bad}` (ttft, tpot, itl, e2el)");
    }
    Ok(names)
}

impl DatasetArgs {
    /// Whether the dataset is the random one (vLLM then ignores EOS).
    pub fn is_random(&self) -> bool {
        matches!(self.dataset.first().map(String::as_str), Some("random") | None)
    }
}

/// The first model id of the server's `/v1/models`.
fn first_served_model(args: &ServeBenchArgs, base_url: &str) -> anyhow::Result<String> {
    let client = kiln_bench::ApiClient::new(Target::server(base_url, args.api_key.clone()))?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (status, body) = runtime
        .block_on(client.get("/v1/models"))
        .with_context(|| format!("asking {base_url} for its models (give --model)"))?;
    let json: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    let id = json["data"][0]["id"].as_str().map(str::to_owned);
    id.with_context(|| {
        format!("{base_url}/v1/models answered {status} without a model id; give --model")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        bench: ServeBenchArgs,
    }

    #[test]
    fn priority_mix_parses_normalises_and_assigns_by_share() {
        let PriorityMix(mix) = parse_priority_mix("0:1, 1:4").unwrap();
        assert_eq!(mix, vec![(0, 0.2), (1, 0.8)]);
        // Through clap, as the command line gives it.
        let cli = <Cli as clap::Parser>::try_parse_from(["kiln", "--priority-mix", "0:0.2,1:0.8"]);
        assert_eq!(cli.unwrap().bench.priority_mix, Some(PriorityMix(vec![(0, 0.2), (1, 0.8)])));
        for bad in ["", "0", "x:1", "0:-1", "0:nan", "0:1,0:2"] {
            assert!(parse_priority_mix(bad).is_err(), "{bad}");
        }
        let mut requests = vec![blank(); 2000];
        assign_priorities(&mut requests, &mix, 3);
        let zeros = requests.iter().filter(|r| r.priority == Some(0)).count();
        assert!((340..460).contains(&zeros), "{zeros} of 2000 at priority 0");
        let mut again = requests.clone();
        assign_priorities(&mut again, &mix, 3);
        assert_eq!(again, requests);
    }

    /// A request whose fields the assignments fill.
    fn blank() -> BenchRequest {
        BenchRequest {
            prompt: String::new(),
            prompt_len: 1,
            output_len: 1,
            priority: None,
            model: None,
        }
    }

    #[test]
    fn lora_modules_spread_requests_over_the_adapters() {
        let names: Vec<String> = ["a", "b", "c", "d"].map(String::from).to_vec();
        let mut requests = vec![blank(); 2000];
        assign_adapters(&mut requests, &names, 7);
        for name in &names {
            let count = requests.iter().filter(|r| r.model.as_ref() == Some(name)).count();
            assert!((400..600).contains(&count), "{count} of 2000 ask for {name}");
        }
        let mut none = requests.clone();
        for r in &mut none {
            r.model = None;
        }
        assign_adapters(&mut none, &[], 7);
        assert!(none.iter().all(|r| r.model.is_none()));
    }
}
