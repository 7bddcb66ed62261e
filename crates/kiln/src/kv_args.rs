//! KV cache sizing flags shared by the engine-running subcommands: `--kv-cache-memory`,
//! `--memory-utilization`, `--num-kv-blocks`, `--block-size`, `--max-model-len`, and the
//! prefix-cache switch. Exactly one rule decides the number of blocks (first that applies):
//! `--num-kv-blocks`; `--kv-cache-memory BYTES`; `--memory-utilization F` of the RAM available
//! after the weights; else the subcommand's default. The second tier for preemption by swap:
//! `--swap-space GiB` (host memory) or `--kv-offload-dir DIR` (a file, `--kv-offload-size`),
//! and `--preemption-mode`.

use std::path::PathBuf;

use anyhow::{anyhow, bail};
use kiln_engine::{EngineConfig, KvTierConfig, KvTierLocation, PreemptionMode};

/// A byte count: plain, or with a suffix `K`/`M`/`G`/`T` (powers of 1000) or
/// `KiB`/`MiB`/`GiB`/`TiB` (powers of 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes(pub u64);

impl std::str::FromStr for Bytes {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let num: u64 = num.parse().map_err(|_| format!("`{s}` is not a byte count"))?;
        let mult: u64 = match unit.trim() {
            "" | "B" => 1,
            "K" | "KB" => 1_000,
            "M" | "MB" => 1_000_000,
            "G" | "GB" => 1_000_000_000,
            "T" | "TB" => 1_000_000_000_000,
            "KiB" => 1 << 10,
            "MiB" => 1 << 20,
            "GiB" => 1 << 30,
            "TiB" => 1 << 40,
            u => return Err(format!("unknown unit `{u}` (use K, M, G, T, KiB, MiB, GiB, TiB)")),
        };
        num.checked_mul(mult).map(Bytes).ok_or_else(|| format!("`{s}` is too large"))
    }
}

/// A token or byte count as vLLM writes it: plain, or with a suffix `k`/`m`/`g`/`t`
/// (powers of 1000; decimals allowed: `25.6k`) or `K`/`M`/`G`/`T` (powers of 1024): `32k`,
/// `128K`, `4G`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HumanCount(pub u64);

impl std::str::FromStr for HumanCount {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let bad = || format!("`{s}` is not a count (e.g. 4096, 32k, 128K)");
        let (mult, decimal) = match unit {
            "" => (1u64, false),
            "k" => (1_000, true),
            "m" => (1_000_000, true),
            "g" => (1_000_000_000, true),
            "t" => (1_000_000_000_000, true),
            "K" => (1 << 10, false),
            "M" => (1 << 20, false),
            "G" => (1 << 30, false),
            "T" => (1 << 40, false),
            _ => return Err(bad()),
        };
        if num.contains('.') {
            if !decimal {
                return Err(format!("`{s}`: decimals need a decimal suffix (k, m, g, t)"));
            }
            let v: f64 = num.parse().map_err(|_| bad())?;
            return Ok(Self((v * mult as f64) as u64));
        }
        let v: u64 = num.parse().map_err(|_| bad())?;
        v.checked_mul(mult).map(Self).ok_or_else(|| format!("`{s}` is too large"))
    }
}

impl HumanCount {
    pub fn as_usize(self) -> usize {
        usize::try_from(self.0).unwrap_or(usize::MAX)
    }
}

#[derive(clap::Args, Debug, Clone)]
pub struct KvCacheArgs {
    /// Tokens per KV cache block: a power of two up to 256 (default 16; 64 for an encoder,
    /// whose blocks live for one step: fewer, longer blocks make its attention faster).
    #[arg(long)]
    pub block_size: Option<usize>,
    /// KV cache size in bytes (e.g. 4GiB, 512MiB, 2G).
    #[arg(long, conflicts_with_all = ["memory_utilization", "kv_cache_memory_bytes"])]
    pub kv_cache_memory: Option<Bytes>,
    /// KV cache size in bytes, as vLLM's flag: `4G` = 4 GiB, `4g` = 4·10⁹.
    #[arg(long, conflicts_with = "memory_utilization")]
    pub kv_cache_memory_bytes: Option<HumanCount>,
    /// Fraction (0, 1] of the RAM available after loading the weights to give the KV cache.
    #[arg(long)]
    pub memory_utilization: Option<f64>,
    /// Number of KV cache blocks (overrides the flags above).
    #[arg(long, alias = "num-gpu-blocks-override")]
    pub num_kv_blocks: Option<usize>,
    /// Longest request (prompt + output) in tokens (`4096`, `32k`, `32K`); default: the
    /// subcommand's.
    #[arg(long)]
    pub max_model_len: Option<HumanCount>,
    /// Turn the prefix cache off (it is on by default).
    #[arg(long, overrides_with = "enable_prefix_caching")]
    pub no_enable_prefix_caching: bool,
    /// Keep the prefix cache on (the default; vLLM's spelling).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,
    /// GiB of host memory for a second KV tier: a request preempted when the KV cache is full
    /// has its KV copied there and back instead of recomputed, when that is cheaper (vLLM's
    /// flag; 0 = no tier, preemption recomputes). Reserved untouched: pages become resident as
    /// they are used.
    #[arg(long, value_name = "GiB", value_parser = parse_gib, conflicts_with = "kv_offload_dir")]
    pub swap_space: Option<u64>,
    /// A second KV tier in a file in DIR (e.g. on an SSD), as --swap-space; its space is
    /// reserved at start and the file unlinked at once (nothing is left behind).
    #[arg(long, value_name = "DIR")]
    pub kv_offload_dir: Option<PathBuf>,
    /// Size of the --kv-offload-dir tier (e.g. 16GiB).
    #[arg(long, value_name = "BYTES", default_value = "8GiB", requires = "kv_offload_dir")]
    pub kv_offload_size: Bytes,
    /// With a tier: `auto` swaps a preempted request's KV out when moving it (at the tier's
    /// measured rate) is cheaper than prefilling it again (at the measured prefill rate);
    /// `swap` whenever the tier has room; `recompute` never.
    #[arg(long, default_value = "auto", value_parser = parse_preemption_mode)]
    pub preemption_mode: PreemptionMode,
}

fn parse_gib(text: &str) -> Result<u64, String> {
    match text.trim().parse::<f64>() {
        Ok(g) if g.is_finite() && (0.0..=1e6).contains(&g) => Ok((g * f64::from(1 << 30)) as u64),
        _ => Err(format!("`{text}` is not a number of GiB from 0 to 1000000")),
    }
}

fn parse_preemption_mode(text: &str) -> Result<PreemptionMode, String> {
    text.parse()
}

/// The sizing decided from the flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSizing {
    pub num_blocks: usize,
    pub bytes_per_block: usize,
}

/// The block size of an encoder's cache unless `--block-size` says otherwise: its blocks hold a
/// sequence for one step only, and longer blocks cost its attention fewer block switches (a
/// bge-small-shaped encoder: +18 % inputs/s over blocks of 16).
pub const ENCODER_BLOCK_SIZE: usize = 64;

impl KvCacheArgs {
    /// `--block-size`, else 16 (64 for an encoder, [`ENCODER_BLOCK_SIZE`]).
    pub fn block_size(&self, encoder: bool) -> usize {
        let default = if encoder { ENCODER_BLOCK_SIZE } else { EngineConfig::default().block_size };
        self.block_size.unwrap_or(default)
    }

    /// The second KV tier the flags ask for (`None`: none); `--preemption-mode swap` needs one.
    pub fn tier(&self) -> anyhow::Result<Option<KvTierConfig>> {
        let tier = match (&self.kv_offload_dir, self.swap_space) {
            (Some(dir), _) => Some(KvTierConfig {
                location: KvTierLocation::Directory(dir.clone()),
                bytes: self.kv_offload_size.0,
            }),
            (None, Some(bytes)) if bytes > 0 => {
                Some(KvTierConfig { location: KvTierLocation::Memory, bytes })
            }
            (None, _) => None,
        };
        if tier.is_none() && self.preemption_mode == PreemptionMode::Swap {
            bail!("--preemption-mode swap needs a tier: --swap-space GiB or --kv-offload-dir DIR");
        }
        Ok(tier)
    }

    /// Sets the engine's second tier and preemption mode from the flags.
    pub fn apply_tier(&self, config: &mut EngineConfig) -> anyhow::Result<()> {
        config.kv_tier = self.tier()?;
        config.preemption_mode = self.preemption_mode;
        Ok(())
    }

    /// Blocks for a cache of `bytes_per_block`-byte blocks; `available` is the RAM left after
    /// the weights (for `--memory-utilization`), `default_blocks` the subcommand's choice.
    /// The cache must hold at least one request of `max_model_len` tokens.
    pub fn resolve(
        &self,
        (block_size, bytes_per_block): (usize, usize),
        max_model_len: usize,
        available: impl FnOnce() -> Option<u64>,
        default_blocks: usize,
    ) -> anyhow::Result<KvSizing> {
        kiln_models::check_block_size(block_size).map_err(|e| anyhow!("--block-size {e}"))?;
        let per_block = bytes_per_block.max(1) as u64;
        let num_blocks = if let Some(n) = self.num_kv_blocks {
            n
        } else if let Some(b) =
            self.kv_cache_memory.map(|b| b.0).or(self.kv_cache_memory_bytes.map(|b| b.0))
        {
            usize::try_from(b / per_block)?
        } else if let Some(f) = self.memory_utilization {
            if !(f > 0.0 && f <= 1.0) {
                bail!("--memory-utilization must be in (0, 1], got {f}");
            }
            let Some(avail) = available() else {
                bail!("--memory-utilization: cannot read the available memory on this system");
            };
            usize::try_from((avail as f64 * f) as u64 / per_block)?
        } else {
            default_blocks
        };
        let needed = max_model_len.div_ceil(block_size);
        if num_blocks < needed {
            bail!(
                "the KV cache ({num_blocks} blocks of {block_size} tokens) cannot hold one request of \
                 max_model_len = {max_model_len} tokens ({needed} blocks); give it more memory \
                 or lower --max-model-len"
            );
        }
        Ok(KvSizing { num_blocks, bytes_per_block })
    }
}

/// `MemAvailable` of `/proc/meminfo`, in bytes.
pub fn available_memory() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

impl KvSizing {
    /// The start-up line: blocks, their bytes, and how many requests of `max_model_len` fit.
    pub fn describe(&self, block_size: usize, max_model_len: usize) -> String {
        format!(
            "KV cache: {} blocks of {block_size} tokens, {} bytes per block ({:.1} MiB in all); \
             max concurrency at {max_model_len} tokens per request: {:.2}x",
            self.num_blocks,
            self.bytes_per_block,
            (self.num_blocks * self.bytes_per_block) as f64 / f64::from(1 << 20),
            (self.num_blocks * block_size) as f64 / max_model_len as f64,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> KvCacheArgs {
        KvCacheArgs {
            block_size: None,
            kv_cache_memory: None,
            kv_cache_memory_bytes: None,
            memory_utilization: None,
            num_kv_blocks: None,
            max_model_len: None,
            no_enable_prefix_caching: false,
            enable_prefix_caching: false,
            swap_space: None,
            kv_offload_dir: None,
            kv_offload_size: Bytes(8 << 30),
            preemption_mode: PreemptionMode::Auto,
        }
    }

    #[test]
    fn the_tier_flags_choose_memory_or_a_file() {
        let mut a = args();
        assert_eq!(a.tier().unwrap(), None);
        a.swap_space = Some(parse_gib("0.5").unwrap());
        let memory = KvTierConfig { location: KvTierLocation::Memory, bytes: 1 << 29 };
        assert_eq!(a.tier().unwrap(), Some(memory));
        a.swap_space = Some(0);
        assert_eq!(a.tier().unwrap(), None);
        a.preemption_mode = PreemptionMode::Swap;
        assert!(a.tier().unwrap_err().to_string().contains("needs a tier"));
        a.kv_offload_dir = Some(PathBuf::from("/ssd/kiln"));
        a.kv_offload_size = Bytes(1 << 30);
        let file = KvTierConfig {
            location: KvTierLocation::Directory(PathBuf::from("/ssd/kiln")),
            bytes: 1 << 30,
        };
        assert_eq!(a.tier().unwrap(), Some(file));
        assert!(parse_gib("-1").is_err() && parse_gib("lots").is_err());
        assert!(parse_preemption_mode("sometimes").unwrap_err().contains("auto, swap, recompute"));
    }

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!("4GiB".parse::<Bytes>(), Ok(Bytes(4 << 30)));
        assert_eq!("2G".parse::<Bytes>(), Ok(Bytes(2_000_000_000)));
        assert_eq!("512 MiB".parse::<Bytes>(), Ok(Bytes(512 << 20)));
        assert_eq!("123".parse::<Bytes>(), Ok(Bytes(123)));
        assert!("4 parsecs".parse::<Bytes>().unwrap_err().contains("unknown unit"));
        assert!("GiB".parse::<Bytes>().is_err());
        assert!("99999999999TiB".parse::<Bytes>().unwrap_err().contains("too large"));
    }

    #[test]
    fn human_counts_parse_as_vllm() {
        let n = |s: &str| s.parse::<HumanCount>().map(|c| c.0);
        assert_eq!(n("32k"), Ok(32_000));
        assert_eq!(n("32K"), Ok(32_768));
        assert_eq!(n("25.6k"), Ok(25_600));
        assert_eq!(n("4G"), Ok(4 << 30));
        assert_eq!(n("4096"), Ok(4096));
        assert!(n("1.5K").is_err() && n("12x").is_err() && n("k").is_err());
    }

    #[test]
    fn one_rule_decides_the_blocks() {
        let none = || None;
        let mut a = args();
        assert_eq!(a.resolve((16, 1024), 256, none, 100).unwrap().num_blocks, 100);
        a.kv_cache_memory = Some(Bytes(1 << 20));
        assert_eq!(a.resolve((16, 1024), 256, none, 100).unwrap().num_blocks, 1024);
        a.num_kv_blocks = Some(50);
        assert_eq!(a.resolve((16, 1024), 256, none, 100).unwrap().num_blocks, 50);
        let mut a = args();
        a.memory_utilization = Some(0.5);
        assert_eq!(a.resolve((16, 1000), 256, || Some(1_000_000), 1).unwrap().num_blocks, 500);
        assert!(a.resolve((16, 1000), 256, none, 1).unwrap_err().to_string().contains("available"));
        a.memory_utilization = Some(1.5);
        assert!(
            a.resolve((16, 1000), 256, || Some(1), 1).unwrap_err().to_string().contains("(0, 1]")
        );
    }

    #[test]
    fn too_small_a_cache_is_an_error() {
        let mut a = args();
        a.num_kv_blocks = Some(15);
        let e = a.resolve((16, 1024), 256, || None, 1).unwrap_err().to_string();
        assert!(e.contains("cannot hold one request") && e.contains("16 blocks"), "{e}");
        assert!(
            a.resolve((12, 1024), 256, || None, 1)
                .unwrap_err()
                .to_string()
                .contains("--block-size")
        );
    }

    #[test]
    fn describes_the_sizing() {
        let s = KvSizing { num_blocks: 64, bytes_per_block: 1 << 20 }.describe(16, 256);
        assert_eq!(
            s,
            "KV cache: 64 blocks of 16 tokens, 1048576 bytes per block (64.0 MiB in all); max \
             concurrency at 256 tokens per request: 4.00x"
        );
    }
}
