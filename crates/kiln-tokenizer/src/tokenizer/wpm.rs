//! WordPiece of GGUF `"bert"` vocabularies (BERT encoders as llama.cpp converts them), built as
//! a `tokenizers::Tokenizer` so the Hugging Face backend serves it.
//!
//! llama.cpp's converter writes each WordPiece token in "phantom space" form: a word-initial
//! token gets `▁` in front, a continuation loses its `##`, control tokens stay as they are.
//! This undoes that (`▁x` → `x`, `x` → `##x`), so greedy longest-match WordPiece over BERT's
//! normaliser and pre-tokenizer splits text as llama.cpp's WPM tokenizer does: lower case and
//! accents stripped unless `tokenizer.ggml.normalizer.*` say otherwise, words split at
//! whitespace, punctuation and CJK characters, a word with a piece outside the vocabulary is
//! the unknown token. `[CLS] text [SEP]` (a pair: `[CLS] a [SEP] b [SEP]`, `b` of type 1)
//! comes from the post-processor; control tokens are matched whole in the input, as
//! transformers matches BERT's special tokens.

use tokenizers::AddedToken;
use tokenizers::decoders::wordpiece::WordPiece as WordPieceDecoder;
// WordPiece's own vocabulary alias is private; BPE's names the same map type.
use tokenizers::models::bpe::Vocab;
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::template::TemplateProcessing;

use super::gguf_vocab::{GgufVocab, TokenKind};

/// The phantom space llama.cpp puts before a word-initial token.
const PHANTOM: char = '\u{2581}';

/// llama.cpp's default ids of a `"bert"` vocabulary: `[CLS]`, `[SEP]`, `[UNK]`.
const DEFAULT_CLS: u32 = 101;
const DEFAULT_SEP: u32 = 102;
const DEFAULT_UNK: u32 = 100;

/// Builds the HF tokenizer of a `"bert"` vocabulary; `kinds` has one entry per token.
pub(crate) fn build(
    vocab: &GgufVocab,
    kinds: &[TokenKind],
) -> Result<tokenizers::Tokenizer, String> {
    let n = vocab.tokens.len() as u32;
    let id = |given: Option<u32>, default: u32, what: &str| {
        given.or((default < n).then_some(default)).ok_or_else(|| {
            format!("a bert vocabulary of {n} tokens needs tokenizer.ggml.{what}_token_id")
        })
    };
    let (cls, sep) = (id(vocab.bos, DEFAULT_CLS, "bos")?, id(vocab.sep, DEFAULT_SEP, "seperator")?);
    let unk = id(vocab.unk, DEFAULT_UNK, "unknown")?;
    let mut pieces = Vocab::with_capacity(vocab.tokens.len());
    for (i, (token, kind)) in vocab.tokens.iter().zip(kinds).enumerate() {
        let piece = match token.strip_prefix(PHANTOM) {
            _ if matches!(kind, TokenKind::Control | TokenKind::Unknown) => token.clone(),
            Some(word_start) => word_start.to_string(),
            None => format!("##{token}"),
        };
        if pieces.insert(piece, i as u32).is_some() {
            return Err(format!("tokenizer.ggml.tokens[{i}] `{token}` repeats an earlier token"));
        }
    }
    let text = |id: u32| vocab.tokens[id as usize].clone();
    let model = WordPiece::builder()
        .vocab(pieces)
        .unk_token(text(unk))
        .continuing_subword_prefix("##".into())
        .max_input_chars_per_word(usize::MAX)
        .build()
        .map_err(|e| format!("building the WordPiece model: {e}"))?;
    let lowercase = vocab.lowercase.unwrap_or(true);
    let strip_accents = vocab.strip_accents.unwrap_or(lowercase);
    let mut tok = tokenizers::Tokenizer::new(model);
    tok.with_normalizer(Some(BertNormalizer::new(true, true, Some(strip_accents), lowercase)));
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    tok.with_decoder(Some(WordPieceDecoder::default()));
    let (cls_text, sep_text) = (text(cls), text(sep));
    let template = TemplateProcessing::builder()
        .try_single(format!("{cls_text}:0 $A:0 {sep_text}:0"))
        .and_then(|b| b.try_pair(format!("{cls_text}:0 $A:0 {sep_text}:0 $B:1 {sep_text}:1")))
        .map_err(|e| format!("the [CLS] / [SEP] template: {e}"))?
        .special_tokens(vec![(cls_text, cls), (sep_text, sep)])
        .build()
        .map_err(|e| format!("the [CLS] / [SEP] template: {e}"))?;
    tok.with_post_processor(Some(template));
    let special: Vec<AddedToken> = vocab
        .tokens
        .iter()
        .zip(kinds)
        .filter(|(t, k)| !t.is_empty() && k.is_special())
        .map(|(t, _)| AddedToken::from(t.clone(), true))
        .collect();
    tok.add_special_tokens(&special);
    Ok(tok)
}
