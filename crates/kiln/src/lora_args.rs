//! `--enable-lora`, `--lora-modules`, `--max-lora-rank`, `--max-loras` and
//! `--allow-runtime-lora-updating` (vLLM's flags; vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
//! environment variable sets the last): LoRA adapters served beside the base model, each under
//! its own name, loaded at start or at run time.

use std::path::PathBuf;

use anyhow::Context;
use kiln_engine::LoraDtype;
use kiln_server::{LoraModule, LoraSettings};

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
    /// Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
    /// VLLM_ALLOW_RUNTIME_LORA_UPDATING=True sets it too). Needs --enable-lora.
    #[arg(long)]
    pub allow_runtime_lora_updating: bool,
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
            modules,
            max_rank: self.max_lora_rank,
            max_loras: self.max_loras,
            dtype,
            runtime_updates: self.allow_runtime_lora_updating,
        })
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
            allow_runtime_lora_updating: false,
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
