//! [`PromptFormat`]: tokenizer + chat template + the letter ids, checked at load (spec §3).

use std::path::{Path, PathBuf};

use super::{ChatMessage, ChatTemplate, ChatTemplateError, RenderOptions, TemplateOrigin};
use crate::tokenizer::{
    read_file, PromptTokenizer, SpecialTokenIds, TokenizerConfig, TokenizerError,
};

/// The answer letters, in option order.
pub const LETTERS: [char; 26] = [
    'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 'J', 'K', 'L', 'M', 'N', 'O', 'P', 'Q', 'R', 'S',
    'T', 'U', 'V', 'W', 'X', 'Y', 'Z',
];

/// How the generation prompt ends with thinking off (spec §3); the letter is read right after it.
pub const NO_THINK_GENERATION_SUFFIX: &str = "<think>\n\n</think>\n\n";

/// How the generation prompt ends with thinking on (spec §3, AutoThink).
pub const THINK_GENERATION_SUFFIX: &str = "<think>\n";

/// The conversation used for the load-time checks: the v1 system prompt and a user turn shaped
/// like a rendered question (the checks only look at what follows the generation prompt).
const PROBE_SYSTEM: &str =
    "Apply the criterion to the evidence. Choose exactly one listed option. Answer with its letter only.";
const PROBE_USER: &str =
    "Evidence:\n(none)\n\nQuestion: Which option fits?\nOptions:\nA) yes\nB) no";

// One variant a source of failure: alike in shape only to the other error enums (`ChatTemplateError`,
// `EngineDecideError`), each wrapping its own sources.
#[derive(Debug, thiserror::Error)]
pub enum PromptFormatError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] ChatTemplateError),
    #[error("no tokenizer: {dir}/tokenizer.json does not exist and no GGUF was given")]
    NoTokenizer { dir: PathBuf },
    #[error("the tokenizer has no {token} token, which the Qwen3.5 prompt format needs")]
    MissingSpecialToken { token: &'static str },
    #[error(
        "the chat template ({origin}) with thinking off must end the generation prompt with {expected:?}, \
         but the prompt ends with {tail:?}"
    )]
    GenerationPromptSuffix {
        origin: TemplateOrigin,
        expected: &'static str,
        tail: String,
    },
    #[error(
        "letter {letter} is not one token right after the thinking-off prefix: appending it changes the \
         prompt's ids from position {diverges_at} on, to {tail:?}"
    )]
    LetterNotOneToken {
        letter: char,
        diverges_at: usize,
        tail: Vec<u32>,
    },
    #[error("letter_token_ids has {found} ids; it needs the 26 letters A..Z")]
    LetterCount { found: usize },
    #[error("letter_token_ids gives {letter} the id {configured}, but the tokenizer's id for {letter} is {tokenizer}")]
    LetterIdMismatch {
        letter: char,
        configured: u32,
        tokenizer: u32,
    },
    #[error("{path}: {message}")]
    BadGenerationConfig { path: PathBuf, message: String },
}

/// A rendered prompt and its ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RenderedPrompt {
    pub text: String,
    pub ids: Vec<u32>,
}

/// Everything the engine needs to turn messages into prompt ids and read letters: the tokenizer,
/// the chat template, the 26 letter ids and the end-of-generation ids. Built once per model; the
/// checks of spec §3 run when it is built.
#[derive(Debug)]
pub struct PromptFormat {
    tokenizer: PromptTokenizer,
    template: ChatTemplate,
    letter_ids: [u32; 26],
    supports_thinking: bool,
}

impl PromptFormat {
    /// Loads from a model directory and/or its GGUF:
    /// - tokenizer: `dir/tokenizer.json` (+ `tokenizer_config.json`), else the GGUF's vocabulary;
    /// - template: `dir/chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`, else
    ///   the GGUF's `tokenizer.chat_template`;
    /// - end-of-generation ids: `<|im_end|>`, `<|endoftext|>`, the tokenizer's EOS and
    ///   `generation_config.json`'s `eos_token_id` when present.
    ///
    /// `dir` may lack any of these files when `gguf` is given.
    pub fn load_from_model_dir(
        dir: &Path,
        gguf: Option<&prism_gguf::GgufFile>,
    ) -> Result<Self, PromptFormatError> {
        let config = TokenizerConfig::read(&dir.join("tokenizer_config.json"))?;
        let mut tokenizer = if dir.join("tokenizer.json").is_file() {
            PromptTokenizer::from_model_dir_with_config(dir, config.as_ref())?
        } else if let Some(gguf) = gguf {
            let mut tokenizer = PromptTokenizer::from_gguf(gguf)?;
            tokenizer.add_config_eos(dir, config.as_ref(), "GGUF vocabulary")?;
            tokenizer
        } else {
            return Err(PromptFormatError::NoTokenizer {
                dir: dir.to_path_buf(),
            });
        };
        let generation_eos =
            read_generation_config_eos(&dir.join("generation_config.json"), &tokenizer)?;
        tokenizer.add_eos_ids(&generation_eos);
        let template = ChatTemplate::load(dir, config.as_ref(), gguf)?;
        Self::new(tokenizer, template)
    }

    /// Puts a tokenizer and a template together and runs the load-time checks: the thinking-off
    /// generation prompt ends with `<think>\n\n</think>\n\n`, and each letter A–Z is one token
    /// right after it.
    pub fn new(
        tokenizer: PromptTokenizer,
        template: ChatTemplate,
    ) -> Result<Self, PromptFormatError> {
        let special = tokenizer.special_tokens();
        for (token, id) in [
            (SpecialTokenIds::IM_START, special.im_start),
            (SpecialTokenIds::IM_END, special.im_end),
            (SpecialTokenIds::THINK, special.think),
            (SpecialTokenIds::END_THINK, special.end_think),
        ] {
            if id.is_none() {
                return Err(PromptFormatError::MissingSpecialToken { token });
            }
        }
        let probe = [
            ChatMessage::system(PROBE_SYSTEM),
            ChatMessage::user(PROBE_USER),
        ];
        let prefix = template.render(
            &probe,
            RenderOptions {
                add_generation_prompt: true,
                enable_thinking: false,
            },
        )?;
        if !prefix.ends_with(NO_THINK_GENERATION_SUFFIX) {
            return Err(PromptFormatError::GenerationPromptSuffix {
                origin: template.origin().clone(),
                expected: NO_THINK_GENERATION_SUFFIX,
                tail: tail_chars(&prefix, 40),
            });
        }
        let letter_ids = letter_ids_after(&tokenizer, &prefix)?;
        let thinking = template.render(
            &probe,
            RenderOptions {
                add_generation_prompt: true,
                enable_thinking: true,
            },
        )?;
        let supports_thinking = thinking.ends_with(THINK_GENERATION_SUFFIX);
        if !supports_thinking {
            tracing::warn!(
                "chat template ({}): with thinking on the generation prompt does not end with {:?}; thoughts are unavailable",
                template.origin(),
                THINK_GENERATION_SUFFIX
            );
        }
        Ok(Self {
            tokenizer,
            template,
            letter_ids,
            supports_thinking,
        })
    }

    /// Renders a conversation with the generation prompt (thinking off: ends in
    /// `<think>\n\n</think>\n\n`; on: `<think>\n`).
    pub fn render_chat(
        &self,
        messages: &[ChatMessage],
        enable_thinking: bool,
    ) -> Result<String, PromptFormatError> {
        Ok(self.template.render(
            messages,
            RenderOptions {
                add_generation_prompt: true,
                enable_thinking,
            },
        )?)
    }

    /// Renders with explicit options.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        options: RenderOptions,
    ) -> Result<String, PromptFormatError> {
        Ok(self.template.render(messages, options)?)
    }

    /// [`Self::render_chat`] then [`Self::encode`].
    pub fn render_and_encode(
        &self,
        messages: &[ChatMessage],
        enable_thinking: bool,
    ) -> Result<RenderedPrompt, PromptFormatError> {
        let text = self.render_chat(messages, enable_thinking)?;
        let ids = self.encode(&text)?;
        Ok(RenderedPrompt { text, ids })
    }

    /// Text → ids (special tokens in the text are single ids; nothing is prepended).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, PromptFormatError> {
        Ok(self.tokenizer.encode(text)?)
    }

    /// [`Self::encode`] of each text, their common beginning encoded once
    /// ([`crate::tokenizer::PromptTokenizer::encode_sharing`]).
    pub fn encode_sharing(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>, PromptFormatError> {
        Ok(self.tokenizer.encode_sharing(texts)?)
    }

    // Thin methods like the ones around it, alike in shape only: each forwards to its own part.
    pub fn decode(
        &self,
        ids: &[u32],
        skip_special_tokens: bool,
    ) -> Result<String, PromptFormatError> {
        Ok(self.tokenizer.decode(ids, skip_special_tokens)?)
    }

    /// The ids of `A`..`Z` as read at the last prompt position (the read-out's only rows).
    pub fn letter_ids(&self) -> &[u32; 26] {
        &self.letter_ids
    }

    /// The id of one letter `A`..`Z`.
    pub fn letter_id(&self, letter: char) -> Option<u32> {
        LETTERS
            .iter()
            .position(|&l| l == letter)
            .map(|i| self.letter_ids[i])
    }

    /// Compares `letter_token_ids` of `decision_config.json` with the tokenizer's letter ids.
    pub fn check_letter_token_ids(&self, configured: &[u32]) -> Result<(), PromptFormatError> {
        if configured.len() != LETTERS.len() {
            return Err(PromptFormatError::LetterCount {
                found: configured.len(),
            });
        }
        for ((&letter, &configured), &tokenizer) in
            LETTERS.iter().zip(configured).zip(&self.letter_ids)
        {
            if configured != tokenizer {
                return Err(PromptFormatError::LetterIdMismatch {
                    letter,
                    configured,
                    tokenizer,
                });
            }
        }
        Ok(())
    }

    /// Ids that end generation, ascending.
    pub fn eos_ids(&self) -> &[u32] {
        self.tokenizer.eos_ids()
    }

    pub fn special_tokens(&self) -> &SpecialTokenIds {
        self.tokenizer.special_tokens()
    }

    /// Whether the thinking-on generation prompt ends with `<think>\n` (AutoThink needs it).
    pub fn supports_thinking(&self) -> bool {
        self.supports_thinking
    }

    pub fn tokenizer(&self) -> &PromptTokenizer {
        &self.tokenizer
    }

    pub fn template(&self) -> &ChatTemplate {
        &self.template
    }
}

/// For each letter L: tokens(prefix + L) must be tokens(prefix) followed by exactly one id.
fn letter_ids_after(
    tokenizer: &PromptTokenizer,
    prefix: &str,
) -> Result<[u32; 26], PromptFormatError> {
    let base = tokenizer.encode(prefix)?;
    let mut ids = [0u32; 26];
    for (slot, &letter) in ids.iter_mut().zip(LETTERS.iter()) {
        let mut text = String::with_capacity(prefix.len() + 1);
        text.push_str(prefix);
        text.push(letter);
        let with_letter = tokenizer.encode(&text)?;
        let common = base
            .iter()
            .zip(&with_letter)
            .take_while(|(a, b)| a == b)
            .count();
        if common != base.len() || with_letter.len() != base.len() + 1 {
            return Err(PromptFormatError::LetterNotOneToken {
                letter,
                diverges_at: common,
                tail: with_letter[common..].to_vec(),
            });
        }
        *slot = with_letter[base.len()];
    }
    Ok(ids)
}

/// `eos_token_id` of `generation_config.json` (an id or a list); empty when the file is absent.
fn read_generation_config_eos(
    path: &Path,
    tokenizer: &PromptTokenizer,
) -> Result<Vec<u32>, PromptFormatError> {
    let bytes = match read_file(path) {
        Ok(bytes) => bytes,
        Err(TokenizerError::MissingFile { .. }) => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let bad = |message: String| PromptFormatError::BadGenerationConfig {
        path: path.to_path_buf(),
        message,
    };
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    let raw: Vec<&serde_json::Value> = match value.get("eos_token_id") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(serde_json::Value::Array(items)) => items.iter().collect(),
        Some(single) => vec![single],
    };
    raw.into_iter()
        .map(|v| {
            let id = v
                .as_u64()
                .and_then(|id| u32::try_from(id).ok())
                .ok_or_else(|| bad(format!("eos_token_id entry {v} is not a token id")))?;
            if tokenizer.id_to_token(id).is_none() {
                return Err(bad(format!("eos_token_id {id} is not in the vocabulary")));
            }
            Ok(id)
        })
        .collect()
}

fn tail_chars(text: &str, n: usize) -> String {
    let count = text.chars().count();
    text.chars().skip(count.saturating_sub(n)).collect()
}
