//! The tokenizer vocabulary stored in a GGUF (`tokenizer.ggml.*`, see qwen35-reference §3.6).

use std::collections::HashMap;

use prism_gguf::{GgufFile, MetadataValue};
use tokenizers::models::bpe::{Merges, Vocab};

use super::TokenizerError;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufTokenType {
    Normal,
    Unknown,
    /// A special added token (`<|im_start|>`).
    Control,
    /// A non-special added token (`<think>`), still matched as one token in text.
    UserDefined,
    /// A padding id with no token (`[PAD248077]`).
    Unused,
    Byte,
}

impl GgufTokenType {
    pub fn from_code(code: i64) -> Option<Self> {
        Some(match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => return None,
        })
    }
}

/// A GGUF's tokenizer metadata, read out of the file.
// One field a metadata key: alike in shape only to other structs' plain fields.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocabulary {
    /// `tokenizer.ggml.model`; only "gpt2" (byte-level BPE) is supported.
    pub model: String,
    /// `tokenizer.ggml.pre`; only "qwen35" is supported.
    pub pre: String,
    /// `tokenizer.ggml.tokens`, index = id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`, raw codes, one per token.
    pub token_types: Vec<i64>,
    /// `tokenizer.ggml.merges`, `"a b"` in the byte-level alphabet, highest priority first.
    pub merges: Vec<String>,
    pub eos_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    pub add_bos_token: bool,
}

/// The pieces `tokenizers` needs: the BPE vocabulary (normal tokens and added tokens at their
/// ids), the merges, and the added tokens `(id, content, special)`.
pub(crate) struct BpeParts {
    pub vocab: Vocab,
    pub merges: Merges,
    pub added: Vec<(u32, String, bool)>,
}

impl GgufVocabulary {
    pub const MODEL: &'static str = "tokenizer.ggml.model";
    pub const PRE: &'static str = "tokenizer.ggml.pre";
    pub const TOKENS: &'static str = "tokenizer.ggml.tokens";
    pub const TOKEN_TYPE: &'static str = "tokenizer.ggml.token_type";
    pub const MERGES: &'static str = "tokenizer.ggml.merges";
    pub const EOS: &'static str = "tokenizer.ggml.eos_token_id";
    pub const PAD: &'static str = "tokenizer.ggml.padding_token_id";
    pub const ADD_BOS: &'static str = "tokenizer.ggml.add_bos_token";

    /// Reads the vocabulary keys. Missing model/pre/tokens/token_type/merges is an error; the
    /// EOS/pad ids and `add_bos_token` are optional.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        Self::from_metadata(|key| gguf.get(key))
    }

    /// As [`Self::from_gguf`], from any key → value lookup.
    pub fn from_metadata<'a>(
        get: impl Fn(&str) -> Option<&'a MetadataValue>,
    ) -> Result<Self, TokenizerError> {
        let required = |key: &'static str| get(key).ok_or(TokenizerError::MissingGgufKey { key });
        let string = |key: &'static str, v: &MetadataValue| -> Result<String, TokenizerError> {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| TokenizerError::BadGgufValue {
                    key,
                    message: format!("expected a string, found {}", v.type_name()),
                })
        };
        let array = |key: &'static str| -> Result<&'a [MetadataValue], TokenizerError> {
            let v = required(key)?;
            v.as_array().ok_or_else(|| TokenizerError::BadGgufValue {
                key,
                message: format!("expected an array, found {}", v.type_name()),
            })
        };
        let strings = |key: &'static str| -> Result<Vec<String>, TokenizerError> {
            array(key)?
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| TokenizerError::BadGgufValue {
                            key,
                            message: format!("element {i} is {}, not a string", v.type_name()),
                        })
                })
                .collect()
        };
        let optional_id = |key: &'static str| -> Result<Option<u32>, TokenizerError> {
            match get(key) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|id| u32::try_from(id).ok())
                    .map(Some)
                    .ok_or_else(|| TokenizerError::BadGgufValue {
                        key,
                        message: format!("expected a token id, found {}", v.type_name()),
                    }),
            }
        };

        let model = string(Self::MODEL, required(Self::MODEL)?)?;
        let pre = string(Self::PRE, required(Self::PRE)?)?;
        let tokens = strings(Self::TOKENS)?;
        let token_types = array(Self::TOKEN_TYPE)?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_i64().ok_or_else(|| TokenizerError::BadGgufValue {
                    key: Self::TOKEN_TYPE,
                    message: format!("element {i} is {}, not an integer", v.type_name()),
                })
            })
            .collect::<Result<Vec<i64>, _>>()?;
        let merges = strings(Self::MERGES)?;
        let add_bos_token = match get(Self::ADD_BOS) {
            None => false,
            Some(v) => v.as_bool().ok_or_else(|| TokenizerError::BadGgufValue {
                key: Self::ADD_BOS,
                message: format!("expected a bool, found {}", v.type_name()),
            })?,
        };
        let out = Self {
            model,
            pre,
            tokens,
            token_types,
            merges,
            eos_token_id: optional_id(Self::EOS)?,
            padding_token_id: optional_id(Self::PAD)?,
            add_bos_token,
        };
        out.validate()?;
        if out.add_bos_token {
            // transformers' Qwen3_5Tokenizer has no BOS token; a prompt never starts with one.
            tracing::warn!(
                "{} is true in the GGUF; Qwen3.5 prompts get no BOS, ignoring it",
                Self::ADD_BOS
            );
        }
        Ok(out)
    }

    fn validate(&self) -> Result<(), TokenizerError> {
        if self.model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel {
                found: self.model.clone(),
                expected: "\"gpt2\" (byte-level BPE)",
            });
        }
        if self.pre != "qwen35" {
            return Err(TokenizerError::UnsupportedPreTokenizer {
                found: self.pre.clone(),
            });
        }
        if self.tokens.len() != self.token_types.len() {
            return Err(TokenizerError::TokenTypeCountMismatch {
                tokens: self.tokens.len(),
                token_types: self.token_types.len(),
            });
        }
        if u32::try_from(self.tokens.len()).is_err() {
            return Err(TokenizerError::BadGgufValue {
                key: Self::TOKENS,
                message: format!("{} tokens do not fit 32-bit ids", self.tokens.len()),
            });
        }
        for (what, id) in [
            (Self::EOS, self.eos_token_id),
            (Self::PAD, self.padding_token_id),
        ] {
            if let Some(id) = id {
                if id as usize >= self.tokens.len() {
                    return Err(TokenizerError::IdOutOfRange {
                        what: what.to_string(),
                        id: id as u64,
                        vocab_size: self.tokens.len(),
                    });
                }
            }
        }
        Ok(())
    }

    /// Splits the vocabulary into the BPE part and the added tokens, and checks the merges.
    pub(crate) fn bpe_parts(&self) -> Result<BpeParts, TokenizerError> {
        self.validate()?;
        let mut vocab = Vocab::default();
        let mut added = Vec::new();
        let mut first_id: HashMap<&str, u32> = HashMap::with_capacity(self.tokens.len());
        for (index, (token, &code)) in self.tokens.iter().zip(&self.token_types).enumerate() {
            let id = index as u32;
            let kind = GgufTokenType::from_code(code);
            let special = match kind {
                Some(GgufTokenType::Normal) => None,
                Some(GgufTokenType::Control) => Some(true),
                Some(GgufTokenType::UserDefined) => Some(false),
                Some(GgufTokenType::Unused) => continue,
                _ => {
                    return Err(TokenizerError::UnsupportedTokenType {
                        id,
                        token: token.clone(),
                        token_type: code,
                    })
                }
            };
            if let Some(first) = first_id.insert(token.as_str(), id) {
                return Err(TokenizerError::DuplicateToken {
                    token: token.clone(),
                    first,
                    second: id,
                });
            }
            // Added tokens also go into the BPE vocabulary at their own ids, so the added
            // vocabulary finds them there instead of numbering them itself; no merge produces them.
            vocab.insert(token.clone(), id);
            if let Some(special) = special {
                if token.is_empty() {
                    return Err(TokenizerError::UnsupportedTokenType {
                        id,
                        token: token.clone(),
                        token_type: code,
                    });
                }
                added.push((id, token.clone(), special));
            }
        }
        // Byte-level BPE silently drops a byte it has no token for; refuse such a vocabulary.
        if let Some(byte) = (0..=255u8)
            .find(|&b| !vocab.contains_key(&super::byte_level::byte_to_char(b).to_string()))
        {
            return Err(TokenizerError::MissingByteToken { byte });
        }
        let mut merges = Merges::with_capacity(self.merges.len());
        for (index, merge) in self.merges.iter().enumerate() {
            let bad = |reason: String| TokenizerError::BadMerge {
                index,
                merge: merge.clone(),
                reason,
            };
            let mut parts = merge.split(' ');
            let (Some(left), Some(right), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(bad("expected two tokens separated by one space".into()));
            };
            for part in [left, right] {
                if !vocab.contains_key(part) {
                    return Err(bad(format!("{part:?} is not in the vocabulary")));
                }
            }
            let joined = format!("{left}{right}");
            if !vocab.contains_key(&joined) {
                return Err(bad(format!(
                    "the merged token {joined:?} is not in the vocabulary"
                )));
            }
            merges.push((left.to_string(), right.to_string()));
        }
        Ok(BpeParts {
            vocab,
            merges,
            added,
        })
    }
}
