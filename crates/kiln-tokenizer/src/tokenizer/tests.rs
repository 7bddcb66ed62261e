use std::path::PathBuf;

use super::{GgufVocab, Tokenizer};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/models").join(name)
}

#[test]
fn token_text_of_hf_special_tokens() {
    // Expected texts are those of the fixture's tokenizer_config.json / tokenizer.json.
    let (tok, _) = Tokenizer::from_dir(&fixture("gemma3")).unwrap();
    assert_eq!(tok.bos_token_id(), Some(2));
    assert_eq!(tok.token_text(2).as_deref(), Some("<bos>"));
    assert_eq!(tok.token_text(4).as_deref(), Some("<start_of_turn>"));
    assert_eq!(tok.eos_token_id(), Some(1));
    assert_eq!(tok.token_text(1).as_deref(), Some("<eos>"));
    assert_eq!(tok.token_text(1_000_000), None);

    // qwen2: generation_config.json adds <|endoftext|> (500), which sorts before the
    // configured <|im_end|> (502); eos_token_id keeps the configured one.
    let (tok, _) = Tokenizer::from_dir(&fixture("qwen2")).unwrap();
    assert_eq!(tok.eos_token_ids(), &[500, 502]);
    assert_eq!(tok.eos_token_id(), Some(502));
    assert_eq!(tok.token_text(502).as_deref(), Some("<|im_end|>"));
    assert_eq!(tok.bos_token_id(), None);
}

#[test]
fn token_text_of_spm_vocab() {
    let tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<0x41>", "\u{2581}hi"];
    let vocab = GgufVocab {
        model: "llama".into(),
        tokens: tokens.iter().map(|t| (*t).to_owned()).collect(),
        token_types: Some(vec![2, 3, 3, 3, 6, 1]),
        ..GgufVocab::default()
    };
    let tok = Tokenizer::from_gguf_vocab(vocab).unwrap();
    // llama defaults: BOS 1, EOS 2.
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.eos_token_id(), Some(2));
    for (id, text) in tokens.iter().enumerate() {
        assert_eq!(tok.token_text(id as u32).as_deref(), Some(*text));
    }
    assert_eq!(tok.token_text(tokens.len() as u32), None);
}
