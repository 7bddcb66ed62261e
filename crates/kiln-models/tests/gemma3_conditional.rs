//! Gemma 3's multimodal checkpoints (`Gemma3ForConditionalGeneration`, the 4B/12B/27B models):
//! the text model runs from their layout. The gemma3 fixture is rewritten as such a checkpoint
//! (its settings as `text_config`, with the keys transformers' `Gemma3TextConfig` defaults
//! left out; its tensors under the Hub's `language_model.model.` prefix and transformers 5's
//! `model.language_model.`; a vision tower beside them) and must give transformers' logits of
//! the text model, as the plain fixture does. (transformers 5.23's own
//! `Gemma3ForConditionalGeneration` with these text weights and a tiny vision tower gives the
//! fixture's reference logits within 5.2e-5 on text-only input, saves the text model under
//! `language_model.model.`, and its `Gemma3TextConfig` defaults are the ones kiln fills in.)

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use common::{Runner, assert_rows_close, cases, cpu, fixture};
use kiln_models::load_model;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use serde_json::{Value, json};

/// The keys of the fixture's config that equal `Gemma3TextConfig`'s defaults, left out of
/// `text_config` as the Hub's checkpoints leave them.
const AT_DEFAULT: [(&str, f64); 3] =
    [("rms_norm_eps", 1e-6), ("rope_local_base_freq", 10_000.0), ("rope_theta", 1_000_000.0)];

/// Writes the gemma3 fixture as a `Gemma3ForConditionalGeneration` directory with its text
/// model under `model` and its (tied) head nowhere.
fn conditional(dir: &Path, model: &str) -> PathBuf {
    let src = fixture("gemma3");
    let out = dir.join(model.trim_end_matches('.'));
    std::fs::create_dir_all(&out).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(file), out.join(file)).unwrap();
    }
    let mut text: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let obj = text.as_object_mut().unwrap();
    obj.remove("architectures");
    obj.insert("model_type".into(), json!("gemma3_text"));
    for (key, default) in AT_DEFAULT {
        assert_eq!(obj.remove(key).and_then(|v| v.as_f64()), Some(default), "{key}");
    }
    let config = json!({
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 8},
        "mm_tokens_per_image": 4,
    });
    std::fs::write(out.join("config.json"), config.to_string()).unwrap();

    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&bytes).unwrap();
    let vision = vec![0u8; 4 * 4 * 4];
    let mut views: HashMap<String, TensorView<'_>> = tensors
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let renamed = format!("{model}{}", name.strip_prefix("model.").unwrap());
            (renamed, view)
        })
        .collect();
    views.insert(
        "vision_tower.vision_model.embeddings.patch_embedding.weight".into(),
        TensorView::new(Dtype::F32, vec![4, 4], &vision).unwrap(),
    );
    safetensors::serialize_to_file(views, None, &out.join("model.safetensors")).unwrap();
    out
}

#[test]
fn the_text_model_of_a_conditional_checkpoint_gives_transformers_logits() {
    let dir = std::env::temp_dir().join(format!("kiln-gemma3-conditional-{}", std::process::id()));
    for layout in ["language_model.model.", "model.language_model."] {
        let path = conditional(&dir, layout);
        let mut runner = Runner::with(load_model(&path, &cpu()).unwrap());
        for (i, case) in cases("gemma3", Some(runner.vocab())).iter().enumerate() {
            let tokens: Vec<u32> =
                case.prompt_ids.iter().chain(&case.greedy_ids).copied().collect();
            let got = runner.one_shot(&tokens);
            assert_rows_close(&got, &case.logits, 1e-3, &format!("{layout} case {i}"));
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_conditional_checkpoint_without_a_text_config_is_refused() {
    let dir = std::env::temp_dir().join(format!("kiln-gemma3-no-text-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = json!({"architectures": ["Gemma3ForConditionalGeneration"]});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = load_model(&dir, &cpu()).err().unwrap().to_string();
    assert!(e.contains("text_config"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
