//! `--enable-lora`, `--lora-modules`, `--max-lora-rank`, `--max-loras` and
//! `--allow-runtime-lora-updating` (vLLM's flags; vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
//! environment variable sets the last): LoRA adapters served beside the base model, each under
//! its own name, loaded at start or at run time. And llama-server's `--lora FILE[,FILE]` and
//! `--lora-scaled FILE:SCALE[,FILE:SCALE]`: adapters every request of the base model runs with.

use std::path::PathBuf;

use anyhow::Context;
use kiln_engine::LoraDtype;
use kiln_server::{BaseAdapter, LoraModule, LoraSettings};

/// Highest `--max-lora-rank` (vLLM's largest choice).
const MAX_RANK_LIMIT: usize = 512;

#[derive(clap::Args, Clone, Debug)]
pub struct LoraArgs {
    /// Serve the LoRA adapters of --lora-modules beside the base model.
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters as NAME=PATH (a PEFT adapter directory) or vLLM's JSON
    /// `{"name": ..., "path": ..., "base_model_name": ...}`; a request picks one by its
    /// `model`. Needs --enable-lora.
    #[arg(long, num_args = 1.., value_name = "NAME=PATH")]
    pub lora_modules: Vec<String>,
    /// Highest rank of an adapter (a higher one is refused at start).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Precision adapters are kept in: auto (float32: the adapter file's values) or float16
    /// (half the memory, each value rounded once). The arithmetic is f32 either way.
    #[arg(long, default_value = "auto", value_name = "DTYPE")]
    pub lora_dtype: String,
    /// Most distinct adapters in one step; requests of another adapter wait until one of the
    /// running adapters has no request left (default: no limit).
    #[arg(long, value_name = "N")]
    pub max_loras: Option<usize>,
    /// Most adapters kept loaded at once (vLLM's CPU cache of adapters); the others are
    /// checked at start, then loaded again when a request asks for them, in place of the least
    /// recently used one no request holds (default: every adapter stays loaded). At least
    /// --max-loras.
    #[arg(long, value_name = "N")]
    pub max_cpu_loras: Option<usize>,
    /// Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True sets it too). Needs --enable-lora.
    #[arg(long)]
    pub allow_runtime_lora_updating: bool,
    /// llama-server's: LoRA adapters (GGUF files, or PEFT directories) that every request of
    /// the base model runs with, at scale 1; comma-separated or repeated, summed.
    #[arg(long = "lora", value_name = "FILE[,FILE]")]
    pub lora: Vec<String>,
    /// llama-server's: as --lora, each at its own scale.
    #[arg(long = "lora-scaled", value_name = "FILE:SCALE[,FILE:SCALE]")]
    pub lora_scaled: Vec<String>,
}

impl LoraArgs {
    /// The adapters to serve; `served_names` are the base model's names, which no adapter
    /// may take.
    pub fn settings(&self, served_names: &[String]) -> anyhow::Result<LoraSettings> {
        if !self.enable_lora && !self.lora_modules.is_empty() {
            anyhow::bail!("--lora-modules needs --enable-lora");
        }
        if !self.enable_lora && self.allow_runtime_lora_updating {
            anyhow::bail!(
                "runtime LoRA updating (--allow-runtime-lora-updating or \
                 VLLM_ALLOW_RUNTIME_LORA_UPDATING) needs --enable-lora"
            );
        }
        let dtype = match self.lora_dtype.as_str() {
            "auto" | "float32" | "float" => LoraDtype::F32,
            "float16" | "half" => LoraDtype::F16,
            "bfloat16" => anyhow::bail!(
                "--lora-dtype bfloat16: kiln keeps LoRA matrices in float16 (auto) or float32"
            ),
            other => anyhow::bail!("--lora-dtype {other}: expected auto, float16 or float32"),
        };
        if self.max_loras == Some(0) {
            anyhow::bail!("--max-loras must be at least 1");
        }
        if self.max_loras.is_some() && !self.enable_lora {
            anyhow::bail!("--max-loras needs --enable-lora");
        }
        if let Some(cpu) = self.max_cpu_loras {
            anyhow::ensure!(self.enable_lora, "--max-cpu-loras needs --enable-lora");
            anyhow::ensure!(cpu >= 1, "--max-cpu-loras must be at least 1");
            if let Some(step) = self.max_loras {
                anyhow::ensure!(
                    cpu >= step,
                    "--max-cpu-loras ({cpu}) must be at least --max-loras ({step})"
                );
            }
        }
        anyhow::ensure!(
            (1..=MAX_RANK_LIMIT).contains(&self.max_lora_rank),
            "--max-lora-rank must be 1 to {MAX_RANK_LIMIT}, got {}",
            self.max_lora_rank
        );
        let mut modules: Vec<LoraModule> = Vec::new();
        for arg in &self.lora_modules {
            let module = parse_module(arg)?;
            if served_names.contains(&module.name) {
                anyhow::bail!(
                    "--lora-modules {arg}: `{}` is already the base model's name",
                    module.name
                );
            }
            if modules.iter().any(|m| m.name == module.name) {
                anyhow::bail!("--lora-modules: `{}` is given twice", module.name);
            }
            modules.push(module);
        }
        if self.enable_lora && modules.is_empty() && !self.allow_runtime_lora_updating {
            tracing::warn!("--enable-lora without --lora-modules: no adapter is served");
        }
        if self.allow_runtime_lora_updating {
            tracing::warn!(
                "runtime LoRA updating is on: any client that passes the API key can load \
                 adapters from this machine's files (/v1/load_lora_adapter)"
            );
        }
        Ok(LoraSettings {
            base_adapters: self.base_adapters()?,
            modules,
            max_rank: self.max_lora_rank,
            max_loras: self.max_loras,
            max_loaded: self.max_cpu_loras,
            dtype,
            runtime_updates: self.allow_runtime_lora_updating,
        })
    }
}

impl LoraArgs {
    /// `--lora` (scale 1) and `--lora-scaled` adapters, in the order given.
    fn base_adapters(&self) -> anyhow::Result<Vec<BaseAdapter>> {
        let mut adapters = Vec::new();
        for arg in &self.lora {
            for path in arg.split(',') {
                anyhow::ensure!(!path.is_empty(), "--lora {arg}: an empty file name");
                adapters.push(BaseAdapter { path: path.into(), scale: 1.0 });
            }
        }
        for arg in &self.lora_scaled {
            for item in arg.split(',') {
                let (path, scale) = item
                    .rsplit_once(':')
                    .with_context(|| format!("--lora-scaled {arg}: expected FILE:SCALE"))?;
                let scale: f32 =
                    scale.parse().ok().filter(|s: &f32| s.is_finite()).with_context(|| {
                        format!("--lora-scaled {arg}: `{scale}` is not a number")
                    })?;
                anyhow::ensure!(!path.is_empty(), "--lora-scaled {arg}: an empty file name");
                adapters.push(BaseAdapter { path: path.into(), scale });
            }
        }
        Ok(adapters)
    }
}

/// `NAME=PATH`, or a JSON object with `name`, `path` and optionally `base_model_name`.
fn parse_module(arg: &str) -> anyhow::Result<LoraModule> {
    let module = if arg.trim_start().starts_with('{') {
        #[derive(serde::Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Json {
            name: String,
            path: PathBuf,
            base_model_name: Option<String>,
        }
        let json: Json = serde_json::from_str(arg)
            .with_context(|| format!("--lora-modules {arg}: not {{\"name\", \"path\"}} JSON"))?;
        LoraModule { name: json.name, path: json.path, base_model_name: json.base_model_name }
    } else {
        let (name, path) = arg
            .split_once('=')
            .with_context(|| format!("--lora-modules {arg}: expected NAME=PATH"))?;
        LoraModule { name: name.to_owned(), path: path.into(), base_model_name: None }
    };
    anyhow::ensure!(!module.name.trim().is_empty(), "--lora-modules {arg}: the name is empty");
    anyhow::ensure!(!module.path.as_os_str().is_empty(), "--lora-modules {arg}: the path is empty");
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(modules: &[&str]) -> LoraArgs {
        LoraArgs {
            enable_lora: true,
            lora_modules: modules.iter().map(|m| (*m).to_owned()).collect(),
            max_lora_rank: 16,
            lora_dtype: "auto".into(),
            max_loras: None,
            max_cpu_loras: None,
            allow_runtime_lora_updating: false,
            lora: Vec::new(),
            lora_scaled: Vec::new(),
        }
    }

    #[test]
    fn both_spellings_give_their_modules() {
        let names = ["base".to_owned()];
        let s = args(&[
            "sql=/a/sql",
            r#"{"name": "chat", "path": "/a/chat", "base_model_name": "meta/llama"}"#,
        ])
        .settings(&names)
        .unwrap();
        assert_eq!(s.modules.len(), 2);
        assert_eq!(
            (s.modules[0].name.as_str(), s.modules[0].path.to_str()),
            ("sql", Some("/a/sql"))
        );
        assert_eq!(s.modules[1].base_model_name.as_deref(), Some("meta/llama"));
    }

    #[test]
    fn bad_modules_are_refused() {
        let names = ["base".to_owned()];
        for (modules, why) in [
            (&["sql"][..], "NAME=PATH"),
            (&["=/a"][..], "name is empty"),
            (&["a=/x", "a=/y"][..], "given twice"),
            (&["base=/x"][..], "base model's name"),
            (&[r#"{"name": "a"}"#][..], "JSON"),
            (&[r#"{"name": "a", "path": "/x", "rank": 4}"#][..], "JSON"),
        ] {
            let err = args(modules).settings(&names).unwrap_err().to_string();
            assert!(err.contains(why), "{modules:?}: {err}");
        }
        let mut off = args(&["a=/x"]);
        off.enable_lora = false;
        assert!(off.settings(&names).unwrap_err().to_string().contains("--enable-lora"));
        let mut rank = args(&[]);
        rank.max_lora_rank = 0;
        assert!(rank.settings(&names).is_err());
        let mut bf16 = args(&[]);
        bf16.lora_dtype = "bfloat16".into();
        assert!(bf16.settings(&names).unwrap_err().to_string().contains("float32"));
        let mut runtime = args(&[]);
        runtime.enable_lora = false;
        runtime.allow_runtime_lora_updating = true;
        assert!(runtime.settings(&names).unwrap_err().to_string().contains("--enable-lora"));
        let mut zero = args(&[]);
        zero.max_loras = Some(0);
        assert!(zero.settings(&names).is_err());
        let mut cpu = args(&[]);
        (cpu.max_loras, cpu.max_cpu_loras) = (Some(4), Some(2));
        assert!(cpu.settings(&names).unwrap_err().to_string().contains("at least --max-loras"));
        cpu.max_cpu_loras = Some(0);
        assert!(cpu.settings(&names).is_err());
        (cpu.max_loras, cpu.max_cpu_loras) = (Some(2), Some(2));
        assert_eq!(cpu.settings(&names).unwrap().max_loaded, Some(2));
        cpu.enable_lora = false;
        assert!(cpu.settings(&names).unwrap_err().to_string().contains("--enable-lora"));
    }

    #[test]
    fn llama_server_adapters_keep_their_order_and_scales() {
        let names = ["base".to_owned()];
        let mut a = args(&[]);
        a.enable_lora = false;
        a.lora = vec!["a.gguf,b.gguf".into(), "c.gguf".into()];
        a.lora_scaled = vec!["/x/d.gguf:0.5,e.gguf:-1".into()];
        let got: Vec<(String, f32)> = a
            .settings(&names)
            .unwrap()
            .base_adapters
            .into_iter()
            .map(|b| (b.path.display().to_string(), b.scale))
            .collect();
        let want = [("a.gguf", 1.0), ("b.gguf", 1.0), ("c.gguf", 1.0), ("/x/d.gguf", 0.5)];
        assert_eq!(got[..4], want.map(|(p, s)| (p.to_owned(), s)));
        assert_eq!(got[4], ("e.gguf".to_owned(), -1.0));
        for (lora, scaled, why) in [
            (None, Some("d.gguf"), "FILE:SCALE"),
            (None, Some("d.gguf:x"), "not a number"),
            (None, Some("d.gguf:inf"), "not a number"),
            (None, Some(":1"), "empty file name"),
            (Some("a.gguf,,b.gguf"), None, "empty file name"),
        ] {
            let mut a = args(&[]);
            a.lora = lora.into_iter().map(str::to_owned).collect();
            a.lora_scaled = scaled.into_iter().map(str::to_owned).collect();
            let err = a.settings(&names).unwrap_err().to_string();
            assert!(err.contains(why), "{lora:?} {scaled:?}: {err}");
        }
    }

    #[test]
    fn lora_dtype_names_the_precision() {
        let names = ["base".to_owned()];
        for (given, dtype) in
            [("auto", LoraDtype::F32), ("float16", LoraDtype::F16), ("float32", LoraDtype::F32)]
        {
            let mut a = args(&[]);
            a.lora_dtype = given.into();
            assert_eq!(a.settings(&names).unwrap().dtype, dtype);
        }
    }
}
