//! How a text becomes tokens (`data.tokenizer`): one token per byte, or a byte-level BPE,
//! GPT-2's scheme, learned from the run's own training text with Hugging Face's
//! `tokenizers` and kept as the `tokenizer.json` that `transformers` reads.
//!
//! ```text
//!   bytes:    token = the byte's value; 256 tokens, as many tokens as bytes
//!   bpe:      text -> pieces (GPT-2's pre-tokenizer: words, numbers, punctuation runs,
//!                     each with the space before it)
//!                  -> each piece's bytes, each byte one of 256 base tokens
//!                  -> the learned merges applied, earliest learned first
//!   learning: base = the 256 bytes; count every adjacent pair of tokens over the
//!             training text's pieces; the most frequent pair becomes a new token (its
//!             merge is recorded); repeat until vocab tokens, or no pair occurs twice
//! ```
//!
//! A BPE of V tokens fits more text in seq_len tokens than bytes do (about 2 bytes per
//! token at V = 512 on the Shakespeare text), so a token's loss is not a byte's: compare
//! tokenizers by loss per byte, the loss per token times tokens per byte.

use std::str::FromStr;

use distlab_common::TokenizerKind;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerBuilder};

/// The file a BPE is kept in, next to the model (Hugging Face's name).
pub const TOKENIZER_FILE: &str = "tokenizer.json";

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("could not learn a byte-level BPE of {vocab} tokens: {message}")]
    Learn { vocab: usize, message: String },
    #[error("not a tokenizer.json distlab reads: {0}")]
    Unreadable(String),
    #[error("the tokenizer could not encode the text: {0}")]
    Encode(String),
}

/// A text's tokenizer.
#[derive(Clone)]
pub enum TextTokenizer {
    Bytes,
    Bpe(Box<tokenizers::Tokenizer>),
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TextTokenizer::Bytes => write!(f, "Bytes"),
            TextTokenizer::Bpe(t) => write!(f, "Bpe({} tokens)", t.get_vocab_size(true)),
        }
    }
}

impl TextTokenizer {
    /// The tokenizer of `kind` for a run whose training text is `text` (a BPE is learned
    /// from it: the same text and vocab give the same merges, every time).
    pub fn learn(kind: TokenizerKind, text: &[u8], vocab: usize) -> Result<Self, TokenizerError> {
        match kind {
            TokenizerKind::Bytes => Ok(TextTokenizer::Bytes),
            TokenizerKind::Bpe => learn_bpe(&String::from_utf8_lossy(text), vocab),
        }
    }

    /// A BPE kept as tokenizer.json.
    pub fn from_json(json: &str) -> Result<Self, TokenizerError> {
        let tokenizer = tokenizers::Tokenizer::from_str(json).map_err(|e| TokenizerError::Unreadable(e.to_string()))?;
        Ok(TextTokenizer::Bpe(Box::new(tokenizer)))
    }

    /// tokenizer.json (None for bytes: a token is a byte, there is nothing to keep).
    pub fn to_json(&self) -> Option<String> {
        match self {
            TextTokenizer::Bytes => None,
            TextTokenizer::Bpe(t) => t.to_string(false).ok(),
        }
    }

    /// How many tokens it can make (the ids are 0..this).
    pub fn vocab_size(&self) -> usize {
        match self {
            TextTokenizer::Bytes => 256,
            TextTokenizer::Bpe(t) => t.get_vocab_size(true),
        }
    }

    pub fn encode(&self, text: &[u8]) -> Result<Vec<u32>, TokenizerError> {
        match self {
            TextTokenizer::Bytes => Ok(text.iter().map(|&b| u32::from(b)).collect()),
            TextTokenizer::Bpe(t) => t
                .encode(String::from_utf8_lossy(text).as_ref(), false)
                .map(|encoding| encoding.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode(e.to_string())),
        }
    }

    /// The text of `tokens` (bytes that are not UTF-8, as a token cut in the middle of a
    /// character leaves them, become replacement characters); None when a token is not
    /// one of this tokenizer's.
    pub fn decode(&self, tokens: &[u32]) -> Option<String> {
        match self {
            TextTokenizer::Bytes => {
                let bytes: Option<Vec<u8>> = tokens.iter().map(|&t| u8::try_from(t).ok()).collect();
                bytes.map(|b| String::from_utf8_lossy(&b).into_owned())
            }
            TextTokenizer::Bpe(t) => {
                if tokens.iter().any(|&id| id as usize >= t.get_vocab_size(true)) {
                    return None;
                }
                t.decode(tokens, false).ok()
            }
        }
    }
}

/// GPT-2's byte-level BPE (no prefix space: a text's first word is cut as it stands)
/// learned from `text` until it has `vocab` tokens or no pair occurs twice.
fn learn_bpe(text: &str, vocab: usize) -> Result<TextTokenizer, TokenizerError> {
    let failed = |e: &dyn std::fmt::Display| TokenizerError::Learn { vocab, message: e.to_string() };
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab)
        .min_frequency(2)
        .show_progress(false)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tokenizer =
        TokenizerBuilder::<BPE, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>::new()
            .with_model(BPE::default())
            .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false).into()))
            .with_decoder(Some(ByteLevelDecoder::default().into()))
            .build()
            .map_err(|e| failed(&e))?;
    tokenizer.train(&mut trainer, std::iter::once(text.to_string())).map_err(|e| failed(&e))?;
    // What a run uses is what it keeps: the learned tokenizer goes through its JSON.
    let json = tokenizer.to_string(false).map_err(|e| failed(&e))?;
    TextTokenizer::from_json(&json)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "the cat sat on the mat; the cat ate the rat. That cat! \u{e9}t\u{e9} \u{1f408}\n";

    /// Every text comes back from its tokens, bytes or BPE, the unseen and the non-ASCII
    /// included; the BPE's merges make fewer tokens than bytes.
    #[test]
    fn text_round_trips_and_bpe_makes_fewer_tokens() {
        let text = TEXT.repeat(20);
        let bpe = TextTokenizer::learn(TokenizerKind::Bpe, text.as_bytes(), 300).unwrap();
        // It stops short of 300 when no pair occurs twice any more (every word whole).
        assert!((257..=300).contains(&bpe.vocab_size()), "{}", bpe.vocab_size());
        for sample in [TEXT, "zebra \u{3b1}\u{3b2}\u{3b3} 12345 ~~", ""] {
            for tokenizer in [&TextTokenizer::Bytes, &bpe] {
                let tokens = tokenizer.encode(sample.as_bytes()).unwrap();
                assert_eq!(tokenizer.decode(&tokens).unwrap(), sample);
            }
        }
        let bytes = TextTokenizer::Bytes.encode(TEXT.as_bytes()).unwrap().len();
        let merged = bpe.encode(TEXT.as_bytes()).unwrap().len();
        assert!(merged * 2 < bytes, "{merged} BPE tokens for {bytes} bytes");
        assert_eq!(bpe.decode(&[bpe.vocab_size() as u32]), None);
        assert_eq!(TextTokenizer::Bytes.decode(&[256]), None);
    }

    /// The same text and vocab learn the same tokenizer (every rank learns its own), and
    /// the kept JSON reads back as it.
    #[test]
    fn learning_is_reproducible_and_the_json_reads_back() {
        let text = TEXT.repeat(10);
        let a = TextTokenizer::learn(TokenizerKind::Bpe, text.as_bytes(), 280).unwrap();
        let b = TextTokenizer::learn(TokenizerKind::Bpe, text.as_bytes(), 280).unwrap();
        let json = a.to_json().unwrap();
        assert_eq!(json, b.to_json().unwrap());
        let read = TextTokenizer::from_json(&json).unwrap();
        assert_eq!(read.encode(TEXT.as_bytes()).unwrap(), a.encode(TEXT.as_bytes()).unwrap());
        assert!(TextTokenizer::from_json("{}").is_err());
        assert_eq!(TextTokenizer::Bytes.to_json(), None);
    }
}
