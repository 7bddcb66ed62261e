//! Qwen2 (bias on q/k/v) and Qwen3 (RMSNorm over each head of q and k before RoPE). Neither
//! slides its window in the checkpoints kiln runs; a config that asks for it is refused.

use super::Architecture;
use crate::config::Fields;
use crate::{LoadError, ModelConfig};

pub(super) fn apply_hf(
    arch: Architecture,
    f: &Fields<'_>,
    c: &mut ModelConfig,
) -> Result<(), LoadError> {
    if f.opt_bool("use_sliding_window")?.unwrap_or(false) {
        return Err(f.err("use_sliding_window = true is not supported".into()));
    }
    match arch {
        Architecture::Qwen2 => c.qkv_bias = true,
        _ => c.qk_norm = true,
    }
    Ok(())
}
