//! Hugging Face model ids (`org/name`, `org/name:Q4_K_M`) resolved through the standard Hugging
//! Face cache, as `vllm serve` and llama-server's `-hf` resolve them.
//!
//! The cache layout (huggingface_hub's, shared with transformers, vLLM and hf-hub):
//! `<cache>/models--<org>--<name>/refs/<revision>` holds a commit hash and
//! `<cache>/models--<org>--<name>/snapshots/<commit>/` the files of that commit. The cache is
//! `--download-dir`, else `$HF_HUB_CACHE`, `$HUGGINGFACE_HUB_CACHE`, `$HF_HOME/hub`,
//! `$XDG_CACHE_HOME/huggingface/hub`, `~/.cache/huggingface/hub` (first set wins).
//!
//! What a snapshot gives: with a `:TAG`, the GGUF model whose name carries the tag (llama-server's
//! quantization tags, case-insensitive); without one, the directory when it has `config.json`
//! (an HF model: tokenizer and safetensors beside it), else its GGUF model (`Q4_K_M` when there
//! are several, as llama-server). A GGUF model is one file, or the files of a split model
//! (`NAME-00001-of-00003.gguf`, ..., at the top level or in one folder), all of which are
//! downloaded and the first loaded. A model missing from the cache is downloaded with `hf-hub`
//! (only the files it needs) unless `HF_HUB_OFFLINE=1`; a cached one is used without any
//! network access. The environment is read once, in [`HubConfig::from_env`].

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

/// A Hugging Face model reference: `org/name`, optionally `:TAG` (a GGUF quantization).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub tag: Option<String>,
}

impl HubId {
    /// `spec` as a hub id, if it is shaped like one: `org/name[:TAG]`, ASCII letters, digits,
    /// `-`, `_`, `.` in each part, no leading `.` or `-` (a relative path such as `./m` or
    /// `models/m.gguf` that exists on disk is never asked about: local paths win).
    pub fn parse(spec: &str) -> Option<Self> {
        let (repo, tag) = match spec.split_once(':') {
            Some((repo, tag)) => (repo, Some(tag)),
            None => (spec, None),
        };
        let (org, name) = repo.split_once('/')?;
        let part_ok = |p: &str| {
            !p.is_empty()
                && !p.starts_with(['.', '-'])
                && p.len() <= 96
                && p.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        };
        if !part_ok(org) || !part_ok(name) || tag.is_some_and(|t| !part_ok(t)) {
            return None;
        }
        Some(Self { repo: repo.to_owned(), tag: tag.map(str::to_owned) })
    }

    /// The repository's folder in the cache: `models--org--name`.
    pub fn folder_name(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

/// Where the cache is and whether the network may be used.
#[derive(Clone, Debug)]
pub struct HubConfig {
    pub cache_dir: PathBuf,
    pub offline: bool,
    pub token: Option<String>,
    pub endpoint: Option<String>,
}

impl HubConfig {
    /// The cache from `download_dir` or the environment (see the module docs), `HF_HUB_OFFLINE`,
    /// `HF_TOKEN` and `HF_ENDPOINT`.
    pub fn from_env(download_dir: Option<&Path>) -> Self {
        let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let cache_dir = download_dir
            .map(Path::to_path_buf)
            .or_else(|| var("HF_HUB_CACHE"))
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
            .or_else(|| var("HOME").map(|h| h.join(".cache/huggingface/hub")))
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let truthy = |k: &str| {
            std::env::var(k).is_ok_and(|v| matches!(v.trim(), "1" | "true" | "TRUE" | "yes" | "on"))
        };
        Self {
            cache_dir,
            offline: truthy("HF_HUB_OFFLINE") || truthy("TRANSFORMERS_OFFLINE"),
            token: std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()),
            endpoint: std::env::var("HF_ENDPOINT").ok().filter(|e| !e.is_empty()),
        }
    }
}

/// The local path of `id` at `revision`: from the cache, or downloaded into it first.
pub fn resolve(id: &HubId, revision: &str, config: &HubConfig) -> anyhow::Result<PathBuf> {
    match resolve_cached(id, revision, &config.cache_dir) {
        Ok(path) => return Ok(path),
        Err(e) if config.offline => {
            return Err(e.context(format!(
                "`{}` is not usable from the Hugging Face cache {} and HF_HUB_OFFLINE is set",
                id.repo,
                config.cache_dir.display()
            )));
        }
        Err(_) => {}
    }
    download(id, revision, config)?;
    resolve_cached(id, revision, &config.cache_dir)
}

/// The snapshot directory of `revision` (a branch or tag with a `refs/` entry, or a commit).
fn snapshot_dir(repo_dir: &Path, revision: &str) -> anyhow::Result<PathBuf> {
    let reference = repo_dir.join("refs").join(revision);
    let commit = match std::fs::read_to_string(&reference) {
        Ok(c) => c.trim().to_owned(),
        Err(_) => revision.to_owned(),
    };
    if commit.is_empty() || commit.contains(['/', '\\']) || commit.starts_with('.') {
        bail!("bad revision `{revision}`");
    }
    let dir = repo_dir.join("snapshots").join(&commit);
    if !dir.is_dir() {
        bail!("revision `{revision}` is not in the cache ({} is missing)", dir.display());
    }
    Ok(dir)
}

/// Resolves `id` from the cache alone.
pub fn resolve_cached(id: &HubId, revision: &str, cache_dir: &Path) -> anyhow::Result<PathBuf> {
    let repo_dir = cache_dir.join(id.folder_name());
    if !repo_dir.is_dir() {
        bail!("`{}` is not in the Hugging Face cache {}", id.repo, cache_dir.display());
    }
    let snapshot = snapshot_dir(&repo_dir, revision)?;
    let files = list_files(&snapshot)?;
    let file_names: Vec<&str> = files.iter().map(String::as_str).collect();
    match pick(id, &file_names)? {
        Pick::Gguf(names) => {
            let missing: Vec<&str> =
                names.iter().copied().filter(|f| !snapshot.join(f).is_file()).collect();
            if !missing.is_empty() {
                bail!("{} lacks {}", snapshot.display(), missing.join(", "));
            }
            Ok(snapshot.join(names[0]))
        }
        Pick::HfDir(needed) => {
            let missing: Vec<&str> =
                needed.iter().copied().filter(|f| !snapshot.join(f).is_file()).collect();
            if !missing.is_empty() {
                bail!("{} lacks {}", snapshot.display(), missing.join(", "));
            }
            Ok(snapshot)
        }
    }
}

/// File names of a snapshot directory, at the top level and in its folders one level down
/// (`Q4_K_M/model-00001-of-00002.gguf`); symlinks to blobs count as files.
fn list_files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut names = Vec::new();
    let read = |d: &Path| std::fs::read_dir(d).with_context(|| format!("reading {}", d.display()));
    for entry in read(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let path = entry.path();
        if path.is_file() {
            names.push(name);
        } else if path.is_dir() && !name.starts_with('.') {
            for inner in read(&path)? {
                let inner = inner?;
                if inner.path().is_file() {
                    names.push(format!("{name}/{}", inner.file_name().to_string_lossy()));
                }
            }
        }
    }
    names.sort();
    Ok(names)
}

/// What to load from a repository's file list.
#[derive(Debug, PartialEq, Eq)]
enum Pick<'a> {
    /// One GGUF model: its file, or the files of a split model, the first first.
    Gguf(Vec<&'a str>),
    /// The directory, which must hold these files.
    HfDir(Vec<&'a str>),
}

/// llama-server's quantization when a repository has several GGUF files and no tag is given.
const DEFAULT_GGUF_TAG: &str = "Q4_K_M";

/// Chooses from `files` (names relative to the snapshot) what `id` means.
fn pick<'a>(id: &HubId, files: &[&'a str]) -> anyhow::Result<Pick<'a>> {
    let ggufs: Vec<&str> = files
        .iter()
        .copied()
        .filter(|f| f.to_ascii_lowercase().ends_with(".gguf") && !f.contains("mmproj"))
        .collect();
    let models = gguf_models(&ggufs);
    if let Some(tag) = &id.tag {
        return gguf_with_tag(&models, tag)
            .map(Pick::Gguf)
            .with_context(|| format!("`{}:{tag}`", id.repo));
    }
    if files.contains(&"config.json") {
        let mut needed = vec!["config.json", "tokenizer.json"];
        let index = "model.safetensors.index.json";
        if files.contains(&index) {
            needed.push(index);
        }
        needed.extend(files.iter().copied().filter(|f| f.ends_with(".safetensors")));
        for optional in ["tokenizer_config.json", "generation_config.json", "chat_template.jinja"] {
            if files.contains(&optional) {
                needed.push(optional);
            }
        }
        if !needed.iter().any(|f| f.ends_with(".safetensors")) {
            bail!("`{}` has config.json but no *.safetensors weights", id.repo);
        }
        return Ok(Pick::HfDir(needed));
    }
    match models.as_slice() {
        [] => bail!("`{}` has neither config.json nor a GGUF file", id.repo),
        [one] => complete(one).map(Pick::Gguf),
        _ => gguf_with_tag(&models, DEFAULT_GGUF_TAG)
            .or_else(|_| complete(&models[0]))
            .map(Pick::Gguf),
    }
}

/// A GGUF model of a repository: its name (a file's without `.gguf`, a split model's without
/// `-0000i-of-0000n.gguf`; folders left out), its files, and how many a split model has.
#[derive(Debug)]
struct GgufModel<'a> {
    name: String,
    files: Vec<&'a str>,
    split_count: Option<usize>,
}

/// The GGUF models among `ggufs` (the files of each split model gathered in order).
fn gguf_models<'a>(ggufs: &[&'a str]) -> Vec<GgufModel<'a>> {
    let mut models: Vec<GgufModel<'a>> = Vec::new();
    for &file in ggufs {
        let base = file.rsplit('/').next().unwrap_or(file);
        let stem = &base[..base.len() - ".gguf".len()];
        let split = stem.rsplit_once("-of-").and_then(|(rest, of)| {
            let (prefix, part) = rest.rsplit_once('-')?;
            let five = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
            (five(part) && five(of)).then(|| (prefix, part.parse::<usize>().ok(), of.parse().ok()))
        });
        match split {
            Some((prefix, Some(part), Some(count))) if part >= 1 => {
                let dir = &file[..file.len() - base.len()];
                let key = format!("{dir}{prefix}");
                match models.iter_mut().find(|m| {
                    m.split_count == Some(count) && m.files[0].starts_with(&key) && m.name == prefix
                }) {
                    Some(m) => m.files.push(file),
                    None => models.push(GgufModel {
                        name: prefix.to_owned(),
                        files: vec![file],
                        split_count: Some(count),
                    }),
                }
            }
            _ => models.push(GgufModel {
                name: stem.to_owned(),
                files: vec![file],
                split_count: None,
            }),
        }
    }
    for m in &mut models {
        m.files.sort_unstable();
    }
    models
}

/// A model's files, or which parts of a split model the repository lacks.
fn complete<'a>(model: &GgufModel<'a>) -> anyhow::Result<Vec<&'a str>> {
    if let Some(count) = model.split_count
        && model.files.len() != count
    {
        bail!(
            "the split model `{}` has {} of its {count} files here: {}",
            model.name,
            model.files.len(),
            model.files.join(", ")
        );
    }
    Ok(model.files.clone())
}

/// The GGUF model whose name carries `tag` (`model-Q4_K_M.gguf`, `model.q4_k_m.gguf`,
/// `model-Q4_K_M-00001-of-00002.gguf`).
fn gguf_with_tag<'a>(models: &[GgufModel<'a>], tag: &str) -> anyhow::Result<Vec<&'a str>> {
    let tag = tag.to_ascii_lowercase();
    let matches: Vec<&GgufModel<'a>> = models
        .iter()
        .filter(|m| {
            let name = m.name.to_ascii_lowercase();
            name.ends_with(&format!("-{tag}")) || name.ends_with(&format!(".{tag}")) || name == tag
        })
        .collect();
    let names =
        |ms: &[&GgufModel<'_>]| ms.iter().map(|m| m.files[0]).collect::<Vec<_>>().join(", ");
    match matches.as_slice() {
        [one] => complete(one),
        [] => {
            let all: Vec<&GgufModel<'_>> = models.iter().collect();
            bail!("no GGUF file with the tag `{tag}` (files: {})", names(&all))
        }
        several => bail!("several GGUF files match `{tag}`: {}", names(several)),
    }
}

/// Downloads what `id` needs into the cache with hf-hub.
fn download(id: &HubId, revision: &str, config: &HubConfig) -> anyhow::Result<()> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};

    let mut builder = ApiBuilder::new()
        .with_cache_dir(config.cache_dir.clone())
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if config.token.is_some() {
        builder = builder.with_token(config.token.clone());
    }
    if let Some(endpoint) = &config.endpoint {
        builder = builder.with_endpoint(endpoint.clone());
    }
    let api = builder.build().context("starting the Hugging Face client")?;
    let repo = api.repo(Repo::with_revision(id.repo.clone(), RepoType::Model, revision.to_owned()));
    let info = repo
        .info()
        .with_context(|| format!("asking the Hugging Face Hub about `{}` ({revision})", id.repo))?;
    let files: Vec<&str> = info.siblings.iter().map(|s| s.rfilename.as_str()).collect();
    let wanted = match pick(id, &files)? {
        Pick::Gguf(names) | Pick::HfDir(names) => names,
    };
    for name in wanted {
        eprintln!("downloading {}/{name} into {}", id.repo, config.cache_dir.display());
        repo.get(name).with_context(|| format!("downloading {}/{name}", id.repo))?;
    }
    // hf-hub writes `refs/<revision>` only for some revisions; make the one asked for resolve.
    let refs = config.cache_dir.join(id.folder_name()).join("refs");
    let reference = refs.join(revision);
    if !reference.exists() && revision != info.sha {
        std::fs::create_dir_all(&refs)?;
        std::fs::write(&reference, &info.sha)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> HubId {
        HubId::parse(s).unwrap()
    }

    #[test]
    fn parses_ids() {
        assert_eq!(id("Qwen/Qwen3-0.6B"), HubId { repo: "Qwen/Qwen3-0.6B".into(), tag: None });
        let tagged = id("ggml-org/gemma-3-1b-it-GGUF:Q4_K_M");
        assert_eq!(tagged.tag.as_deref(), Some("Q4_K_M"));
        assert_eq!(tagged.folder_name(), "models--ggml-org--gemma-3-1b-it-GGUF");
        for bad in ["gemma-3-270m", "a/b/c", "./x", "/abs/path", "a/", "a/.b", "x/y:", "~/m"] {
            assert!(HubId::parse(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn picks_what_an_id_means() {
        let hf = ["config.json", "model.safetensors", "tokenizer.json", "README.md"];
        assert_eq!(
            pick(&id("o/m"), &hf).unwrap(),
            Pick::HfDir(vec!["config.json", "tokenizer.json", "model.safetensors"])
        );
        let gguf = ["m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-f16.gguf", "mmproj-m-f16.gguf"];
        assert_eq!(pick(&id("o/m"), &gguf).unwrap(), Pick::Gguf(vec!["m-Q4_K_M.gguf"]));
        assert_eq!(pick(&id("o/m:q8_0"), &gguf).unwrap(), Pick::Gguf(vec!["m-Q8_0.gguf"]));
        assert_eq!(pick(&id("o/m:F16"), &gguf).unwrap(), Pick::Gguf(vec!["m-f16.gguf"]));
        let e = pick(&id("o/m:Q2_K"), &gguf).unwrap_err();
        assert!(format!("{e:#}").contains("no GGUF file with the tag `q2_k`"), "{e:#}");
        assert_eq!(pick(&id("o/m"), &["only.gguf"]).unwrap(), Pick::Gguf(vec!["only.gguf"]));
        assert!(pick(&id("o/m"), &["config.json", "tokenizer.json"]).is_err());
        assert!(pick(&id("o/m"), &["README.md"]).is_err());
    }

    #[test]
    fn split_models_are_picked_whole() {
        let files = [
            "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf",
            "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
            "m-Q8_0-00001-of-00003.gguf",
            "m-Q8_0-00003-of-00003.gguf",
            "m-F16.gguf",
        ];
        assert_eq!(
            pick(&id("o/m:Q4_K_M"), &files).unwrap(),
            Pick::Gguf(vec![
                "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
                "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"
            ])
        );
        assert_eq!(
            pick(&id("o/m"), &files).unwrap(),
            Pick::Gguf(vec![
                "Q4_K_M/m-Q4_K_M-00001-of-00002.gguf",
                "Q4_K_M/m-Q4_K_M-00002-of-00002.gguf"
            ])
        );
        let e = pick(&id("o/m:q8_0"), &files).unwrap_err();
        assert!(format!("{e:#}").contains("has 2 of its 3 files"), "{e:#}");
        assert_eq!(pick(&id("o/m:f16"), &files).unwrap(), Pick::Gguf(vec!["m-F16.gguf"]));
    }
}
