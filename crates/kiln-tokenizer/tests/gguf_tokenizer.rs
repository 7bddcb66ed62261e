//! Tokenizers built from GGUF metadata ([`GgufVocab`]):
//! - `"llama"` (SentencePiece-style BPE) on a handmade vocabulary: merge order by score, ties,
//!   byte fallback, special-token splitting, BOS/space prefix, decoding and streaming;
//! - `"gpt2"` (byte-level BPE) rebuilt from the vocab and merges of the committed llama3/qwen2
//!   `tokenizer.json` fixtures, against `tokenizers`' own encoding of those files;

#![allow(clippy::unwrap_used)] // test helpers panic on broken fixtures by design

use std::path::PathBuf;

use kiln_tokenizer::{GgufVocab, Tokenizer};
use serde_json::Value;

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const BYTE: i32 = 6;

/// A small SentencePiece vocabulary: specials, the 256 byte tokens, then scored pieces.
fn spm_vocab(pieces: &[(&str, f32)], add_space_prefix: bool) -> GgufVocab {
    let specials = [
        ("<unk>", UNKNOWN),
        ("<s>", CONTROL),
        ("</s>", CONTROL),
        ("<start_of_turn>", CONTROL),
        ("<end_of_turn>", CONTROL),
        ("\n", USER_DEFINED),
    ];
    let mut tokens = Vec::new();
    let mut types = Vec::new();
    let mut scores = Vec::new();
    for (t, ty) in specials {
        tokens.push(t.to_owned());
        types.push(ty);
        scores.push(-1000.0);
    }
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(BYTE);
        scores.push(0.0);
    }
    for &(t, score) in pieces {
        tokens.push(t.to_owned());
        types.push(NORMAL);
        scores.push(score);
    }
    GgufVocab {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: Some(true),
        add_space_prefix: Some(add_space_prefix),
        ..GgufVocab::default()
    }
}

const BYTES: u32 = 6; // id of <0x00>

fn byte(b: u8) -> u32 {
    BYTES + u32::from(b)
}

/// Pieces get ids from 262 on, in order.
const PIECES: [(&str, f32); 12] = [
    ("a", -1.0),   // 262
    ("b", -1.0),   // 263
    ("c", -1.0),   // 264
    ("ab", -5.0),  // 265
    ("bc", -2.0),  // 266
    ("aa", -3.0),  // 267
    ("▁", -1.0),   // 268
    ("h", -1.0),   // 269
    ("i", -1.0),   // 270
    ("hi", -2.0),  // 271
    ("▁hi", -1.5), // 272
    ("é", -1.0),   // 273
];

fn spm(add_space_prefix: bool) -> Tokenizer {
    Tokenizer::from_gguf_vocab(spm_vocab(&PIECES, add_space_prefix)).unwrap()
}

#[test]
fn spm_merges_the_highest_scoring_pair_first() {
    let tok = spm(false);
    // "bc" (-2) beats "ab" (-5); there is no "abc", so a + bc.
    assert_eq!(tok.encode("abc", false).unwrap(), [262, 266]);
    assert_eq!(tok.encode("ab", false).unwrap(), [265]);
    // Equal scores: the leftmost pair merges first.
    assert_eq!(tok.encode("aaa", false).unwrap(), [267, 262]);
    assert_eq!(tok.encode("aaaa", false).unwrap(), [267, 267]);
    // Spaces become '▁' and merge like any character.
    assert_eq!(tok.encode("hi hi", false).unwrap(), [271, 272]);
}

#[test]
fn spm_falls_back_to_byte_tokens() {
    let tok = spm(false);
    assert_eq!(tok.encode("é", false).unwrap(), [273]);
    let euro = "€".as_bytes().iter().map(|&b| byte(b)).collect::<Vec<_>>();
    assert_eq!(tok.encode("€", false).unwrap(), euro);
    let smile = [byte(0xF0), byte(0x9F), byte(0x98), byte(0x80)];
    assert_eq!(tok.encode("a😀", false).unwrap(), [&[262][..], &smile].concat());
    // Without byte tokens, unknown characters become <unk>.
    let mut vocab = spm_vocab(&PIECES, false);
    for ty in vocab.token_types.as_mut().unwrap() {
        if *ty == BYTE {
            *ty = NORMAL;
        }
    }
    for t in &mut vocab.tokens[BYTES as usize..BYTES as usize + 256] {
        t.insert(0, '#');
    }
    let tok = Tokenizer::from_gguf_vocab(vocab).unwrap();
    assert_eq!(tok.encode("a€", false).unwrap(), [262, 0, 0, 0]);
}

#[test]
fn spm_cuts_out_special_tokens_and_adds_bos() {
    let tok = spm(false);
    let text = "<start_of_turn>hi\nhi<end_of_turn>\n";
    assert_eq!(tok.encode(text, true).unwrap(), [1, 3, 271, 5, 271, 4, 5]);
    assert_eq!(tok.encode(text, false).unwrap(), [3, 271, 5, 271, 4, 5]);
    // An explicit BOS in the text is not doubled.
    assert_eq!(tok.encode("<s>hi", true).unwrap(), [1, 271]);
    assert_eq!(tok.encode("", true).unwrap(), [1]);
    assert_eq!(tok.encode("", false).unwrap(), [] as [u32; 0]);
    // With add_space_prefix, '▁' starts the text and every fragment after a special token.
    let tok = spm(true);
    assert_eq!(tok.encode("hi<end_of_turn>hi", true).unwrap(), [1, 272, 4, 272]);
    assert_eq!(tok.encode("\nhi", false).unwrap(), [5, 272]);
}

#[test]
fn spm_decode_round_trips() {
    let texts = ["hi hi", " hi", "a€b😀é", "abc aaa\nhi", "<start_of_turn>hi<end_of_turn>"];
    let tok = spm(false);
    for text in texts {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids[1..], false).unwrap(), text);
        let stripped = text.replace("<start_of_turn>", "").replace("<end_of_turn>", "");
        assert_eq!(tok.decode(&ids, true).unwrap(), stripped);
    }
    // With add_space_prefix the '▁' added at the start is dropped again; the ones added after
    // special tokens stay (as in llama.cpp).
    let tok = spm(true);
    for text in &texts[..3] {
        assert_eq!(tok.decode(&tok.encode(text, true).unwrap(), true).unwrap(), *text);
    }
    let ids = tok.encode("abc\nhi", false).unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "abc\n hi");
    let tok = spm(false);
    assert_eq!(tok.decode(&[1, 271, 2], false).unwrap(), "<s>hi</s>");
    assert_eq!(tok.decode(&[byte(0xE2), 271], false).unwrap(), "\u{FFFD}hi");
    assert_eq!(tok.eos_token_ids(), [2, 4]);
    assert_eq!(tok.bos_token_id(), Some(1));
}

/// Feeds `ids` through a decode stream; returns every step's output.
fn stream(tok: &Tokenizer, ids: &[u32], skip_special: bool) -> Vec<Option<String>> {
    let mut s = tok.decode_stream(skip_special);
    ids.iter().map(|&id| s.step(id).unwrap()).collect()
}

#[test]
fn spm_stream_never_splits_a_character() {
    let tok = spm(true);
    let ids = tok.encode("hi €😀!", true).unwrap();
    let got = stream(&tok, &ids, true);
    let some = |s: &str| Some(s.to_owned());
    // BOS, "▁hi" (leading space stripped), "▁", 3 + 4 byte tokens, "!" as a byte token.
    let mut want = vec![None, some("hi"), some(" "), None, None, some("€"), None, None, None];
    want.extend([some("😀"), some("!")]);
    assert_eq!(got, want);
    let joined: String = got.into_iter().flatten().collect();
    assert_eq!(joined, tok.decode(&ids, true).unwrap());
}

#[test]
fn eog_ids_include_end_texts_of_any_type() {
    let mut vocab = spm_vocab(&[("<|im_end|>", 0.0), ("<|eot_id|>", 0.0)], false);
    vocab.eos = Some(1);
    vocab.eot = Some(3);
    let types = vocab.token_types.as_mut().unwrap();
    types[262] = USER_DEFINED;
    let tok = Tokenizer::from_gguf_vocab(vocab).unwrap();
    // eos 1, eot 3, "</s>" 2, "<end_of_turn>" 4, "<|im_end|>" 262, "<|eot_id|>" 263.
    assert_eq!(tok.eos_token_ids(), [1, 2, 3, 4, 262, 263]);
    // They count as control tokens now: skipped when decoding without specials.
    assert_eq!(tok.decode(&[262, byte(b'i')], true).unwrap(), "i");
}

#[test]
fn bad_vocabularies_are_errors() {
    let err = |v: GgufVocab| Tokenizer::from_gguf_vocab(v).err().unwrap();
    let mut v = spm_vocab(&PIECES, false);
    v.scores.as_mut().unwrap().pop();
    assert!(err(v).contains("scores"));
    let mut v = spm_vocab(&PIECES, false);
    v.eos = Some(100_000);
    assert!(err(v).contains("eos_token_id"));
    let mut v = spm_vocab(&PIECES, false);
    v.model = "t5".into();
    assert!(err(v).contains("t5"));
    // A WordPiece vocabulary too small for BERT's default [CLS] id, without one named.
    let tokens = vec!["[PAD]".into(), "\u{2581}a".into()];
    let v = GgufVocab { model: "bert".into(), tokens, ..GgufVocab::default() };
    assert!(err(v).contains("bos_token_id"));
    let mut v = gpt2_vocab("llama3", "llama-bpe");
    v.pre = Some("made-up".into());
    assert!(err(v).contains("made-up"));
    let mut v = gpt2_vocab("llama3", "llama-bpe");
    v.merges = None;
    assert!(err(v).contains("merges"));
    assert!(err(GgufVocab { model: "llama".into(), ..GgufVocab::default() }).contains("empty"));
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(name)
        .join("tokenizer.json")
}

/// The GGUF metadata a converter would write for the fixture's `tokenizer.json`.
fn gpt2_vocab(name: &str, pre: &str) -> GgufVocab {
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap();
    let model = &json["model"];
    let mut tokens: Vec<String> = Vec::new();
    let mut types = Vec::new();
    let mut put = |id: usize, text: &str, ty: i32| {
        if tokens.len() <= id {
            tokens.resize(id + 1, String::new());
            types.resize(id + 1, NORMAL);
        }
        text.clone_into(&mut tokens[id]);
        types[id] = ty;
    };
    for (text, id) in model["vocab"].as_object().unwrap() {
        put(id.as_u64().unwrap() as usize, text, NORMAL);
    }
    for t in json["added_tokens"].as_array().unwrap() {
        let ty = if t["special"].as_bool().unwrap() { CONTROL } else { USER_DEFINED };
        put(t["id"].as_u64().unwrap() as usize, t["content"].as_str().unwrap(), ty);
    }
    let merges = model["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Value::String(s) => s.clone(),
            pair => format!("{} {}", pair[0].as_str().unwrap(), pair[1].as_str().unwrap()),
        })
        .collect();
    let id_of = |t: &str| tokens.iter().position(|x| x == t).map(|i| i as u32);
    let bos = id_of("<|begin_of_text|>");
    let eos = id_of("<|end_of_text|>").or_else(|| id_of("<|endoftext|>"));
    GgufVocab {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        token_types: Some(types),
        merges: Some(merges),
        bos,
        eos,
        add_bos: Some(bos.is_some()),
        tokens,
        ..GgufVocab::default()
    }
}

const TRICKY: [&str; 16] = [
    "Hello world",
    "  leading and trailing spaces   ",
    "numbers 1234567 and 3.14159, 1,000,000",
    "don't I'll we've they're it's WE'RE YOU'D",
    "unicode: héllo wörld 日本語 한국어 😀🎉 ﬁ",
    "line1\nline2\n\n\nline3\r\nend\n",
    "tabs\tand\u{a0}nbsp  \t \n  x",
    "$$$!!!...??? (a+b)*c=d; x->y",
    "   ",
    "",
    "a\n \n b",
    "def f(x):\n    return x ** 2\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "ÀÉÎÕÜ ÇÑ ßẞ ǅ",
    "mixed123abc456 7b 13B-model_v2.1",
];

#[test]
fn gpt2_matches_tokenizers_on_the_fixtures() {
    for (name, pre) in [("llama3", "llama-bpe"), ("qwen2", "qwen2")] {
        let hf = tokenizers::Tokenizer::from_file(fixture(name)).unwrap();
        let ours = Tokenizer::from_gguf_vocab(gpt2_vocab(name, pre)).unwrap();
        for text in TRICKY {
            let mut want = hf.encode(text, true).unwrap().get_ids().to_vec();
            // An explicit BOS in the text: transformers adds a second one, we do not.
            if want.len() > 1 && want[0] == want[1] && Some(want[0]) == ours.bos_token_id() {
                want.remove(0);
            }
            let got = ours.encode(text, true).unwrap();
            assert_eq!(got, want, "{name}: {text:?}");
            for skip in [false, true] {
                let want = hf.decode(&want, skip).unwrap();
                assert_eq!(ours.decode(&got, skip).unwrap(), want, "{name}: {text:?}");
                let streamed: String = stream(&ours, &got, skip).into_iter().flatten().collect();
                assert_eq!(streamed, want, "{name} stream: {text:?}");
            }
        }
    }
}

#[test]
fn stream_equals_decode_for_hf_directories() {
    for name in ["llama3", "llama2", "mistral", "qwen2", "qwen3", "gemma3"] {
        let dir = fixture(name).parent().unwrap().to_owned();
        let (tok, _) = Tokenizer::from_dir(&dir).unwrap();
        for text in TRICKY {
            let ids = tok.encode(text, true).unwrap();
            for skip in [false, true] {
                let streamed: String = stream(&tok, &ids, skip).into_iter().flatten().collect();
                assert_eq!(streamed, tok.decode(&ids, skip).unwrap(), "{name}: {text:?}");
            }
        }
    }
}

#[test]
fn gpt2_end_of_generation_ids() {
    let llama3 = Tokenizer::from_gguf_vocab(gpt2_vocab("llama3", "llama-bpe")).unwrap();
    assert_eq!(llama3.eos_token_ids(), [501, 504]); // <|end_of_text|>, <|eot_id|>
    let qwen2 = Tokenizer::from_gguf_vocab(gpt2_vocab("qwen2", "qwen2")).unwrap();
    assert_eq!(qwen2.eos_token_ids(), [500, 502]); // <|endoftext|>, <|im_end|>
    assert_eq!(qwen2.encode("hi", true).unwrap(), qwen2.encode("hi", false).unwrap());
}
