//! The start-up check that a model's weights fit in host memory before the CPU backend loads
//! them. The CPU kernels hold quantized weights in their own layout, a copy in anonymous
//! memory about as large as the stored tensors (larger for the codebook types, counted), so a
//! model whose weights exceed the memory
//! available would be killed by the kernel's OOM killer half-way through loading; it is
//! refused first, with the numbers. A mixture of experts holds every expert, though a token
//! reads only a few. With `--quantization` the loaded size differs from the files', and the
//! check is left to the KV-cache sizing after load.

use std::path::Path;

use anyhow::{Context, bail};

/// The bytes of the weight files at `path`: a GGUF file's size (with the other files of a
/// split model, named as llama.cpp names them, beside it, and what the kernels' layout adds
/// to its tensors, [`gguf_growth_bytes`]), or the sum of a Hugging Face directory's
/// `*.safetensors` (plus, for an AWQ / GPTQ / compressed-tensors checkpoint, what repacking
/// its integers into block types adds).
pub fn weight_file_bytes(path: &Path) -> anyhow::Result<u64> {
    let meta = std::fs::metadata(path).with_context(|| format!("reading {}", path.display()))?;
    if meta.is_file() {
        let growth = gguf_growth_bytes(path);
        let count = kiln_models::gguf::split_count(path).filter(|&n| n > 1);
        let Some(count) = count.filter(|&n| n <= 1024) else { return Ok(meta.len() + growth) };
        let mut total = 0;
        for no in 0..count {
            if let Some(shard) = kiln_models::gguf::shard_name(path, no, count) {
                total += std::fs::metadata(&shard).map_or(0, |m| m.len());
            }
        }
        return Ok(total + growth);
    }
    let mut total = 0u64;
    for entry in std::fs::read_dir(path).with_context(|| format!("listing {}", path.display()))? {
        let entry = entry?;
        if entry.path().extension().is_some_and(|e| e == "safetensors") {
            total += entry.metadata()?.len();
        }
    }
    Ok(total + kiln_models::repack_growth_bytes(path)?)
}

/// How many bytes more than they take in the file a GGUF model's quantized tensors take in
/// the CPU kernels' layout: little for most types, but the codebook types (IQ1_*, IQ2_*,
/// IQ3_*, TQ*) are held as 2- to 4-bit level indices with a scale per 16 elements, 1.3–2.3×
/// their size in the file. 0 when the file cannot be read (loading reports why).
pub fn gguf_growth_bytes(path: &Path) -> u64 {
    let Ok(file) = kiln_models::gguf::GgufFile::open(path) else { return 0 };
    let growth = |t: &kiln_models::gguf::GgufTensorInfo| -> Option<u64> {
        let ty = kiln_kernels::GgmlType::from_gguf_id(t.type_id)?;
        let cols = usize::try_from(*t.dims.first()?).ok()?;
        let elems = t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))?;
        let rows = usize::try_from(elems).ok()? / cols.max(1);
        let held = kiln_kernels::QuantMatrix::held_bytes(ty, rows, cols)?;
        Some(held.saturating_sub(t.num_bytes) as u64)
    };
    file.tensors().iter().filter_map(growth).sum()
}

/// Refuses weights of `needed` bytes when `available` (memory the system can give, if known)
/// cannot hold them.
pub fn check_fits(needed: u64, available: Option<u64>, what: &Path) -> anyhow::Result<()> {
    let gib = |b: u64| b as f64 / f64::from(1 << 30);
    match available {
        Some(available) if needed > available => bail!(
            "the weights of {} take {:.2} GiB, more than the {:.2} GiB of memory available \
             (MemAvailable); kiln holds every weight in memory (a mixture of experts: every \
             expert): free memory or use a smaller quantization of the model",
            what.display(),
            gib(needed),
            gib(available)
        ),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_larger_than_the_memory_are_refused_with_the_numbers() {
        let path = Path::new("model.gguf");
        check_fits(1 << 30, Some(2 << 30), path).unwrap();
        check_fits(1 << 30, None, path).unwrap();
        let msg = check_fits(3 << 30, Some(2 << 30), path).unwrap_err().to_string();
        assert!(msg.contains("take 3.00 GiB, more than the 2.00 GiB"), "{msg}");
    }

    #[test]
    fn a_split_gguf_counts_all_its_files() {
        let dir = std::env::temp_dir().join(format!("kiln-fit-split-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for (no, len) in [(1, 10), (2, 20), (3, 30)] {
            std::fs::write(dir.join(format!("m-{no:05}-of-00003.gguf")), vec![0u8; len]).unwrap();
        }
        std::fs::write(dir.join("single.gguf"), [0u8; 7]).unwrap();
        assert_eq!(weight_file_bytes(&dir.join("m-00001-of-00003.gguf")).unwrap(), 60);
        assert_eq!(weight_file_bytes(&dir.join("single.gguf")).unwrap(), 7);
        // A real file: the codebook types count what their layout adds.
        let fixtures =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf_types");
        let iq1 = fixtures.join("tiny-IQ1_M-IQ1_S.gguf");
        let stored = std::fs::metadata(&iq1).unwrap().len();
        let growth = gguf_growth_bytes(&iq1);
        assert!(growth > stored / 4, "{growth} of {stored}");
        assert_eq!(weight_file_bytes(&iq1).unwrap(), stored + growth);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_directory_counts_its_safetensors() {
        let dir = std::env::temp_dir().join(format!("kiln-memory-fit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("a.safetensors"), [0u8; 100]).unwrap();
        std::fs::write(dir.join("b.safetensors"), [0u8; 50]).unwrap();
        std::fs::write(dir.join("tokenizer.json"), [0u8; 1000]).unwrap();
        assert_eq!(weight_file_bytes(&dir).unwrap(), 150);
        assert_eq!(weight_file_bytes(&dir.join("a.safetensors")).unwrap(), 100);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The AWQ fixture: its 4-bit `qweight`s grow by 3/8 as Q5_0.
    #[test]
    fn a_packed_checkpoint_counts_its_repacked_size() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models/awq");
        let files: u64 =
            ["model.safetensors", "dequantized.safetensors", "reference_logits.safetensors"]
                .iter()
                .map(|f| std::fs::metadata(dir.join(f)).unwrap().len())
                .sum();
        // 2 layers of q/k/v/o (64·64, 32·64, 32·64, 64·64) and gate/up/down (128·64 ×3)
        // inputs·outputs at 4 bits.
        let qweight_bytes = 2 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3) / 2;
        assert_eq!(weight_file_bytes(&dir).unwrap(), files + qweight_bytes * 3 / 8);
    }
}
