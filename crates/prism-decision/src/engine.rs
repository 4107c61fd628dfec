//! The real model behind [`LetterModel`]: the release's chat template and tokenizer in front of the
//! Qwen3.5 decoder of `prism-model`.
//!
//! One call of [`LetterModel::letter_logits`] gets every prompt of a request that is ready at that step.
//! They are chat-templated with thinking off, tokenized, and run as one batch whose common evidence prefix
//! is computed once (the decoder branches its states there). Only the output-head rows of the letters
//! `A`..`Z` are computed: the read-out needs 26 rows, not the whole vocabulary.

use std::path::{Path, PathBuf};

use prism_gguf::{GgufError, GgufFile};
use prism_model::{LoadOptions, Qwen35Model};

use crate::chat_template::{ChatMessage, PromptFormat, PromptFormatError};
use crate::config::{ConfigError, DecisionConfig};
use crate::model::{LetterLogits, LetterModel, LetterPrompt, ModelError};

/// Why a decision model could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot read the model file {path}: {source}")]
    Gguf { path: PathBuf, source: GgufError },
    #[error("model directory {dir}: {source}")]
    PromptFormat {
        dir: PathBuf,
        source: PromptFormatError,
    },
    #[error(transparent)]
    DecisionConfig(#[from] ConfigError),
    #[error("decision_config.json's letter_token_ids disagree with the tokenizer: {0}")]
    LetterTokenIds(PromptFormatError),
    #[error("cannot load the decoder from {path}: {source}")]
    Model {
        path: PathBuf,
        source: prism_model::ModelError,
    },
    #[error("letter {letter} is token {id}, outside the model's {vocab_size} output rows")]
    LetterOutsideVocabulary {
        letter: char,
        id: u32,
        vocab_size: usize,
    },
}

/// Where a decision model comes from: its GGUF file and, optionally, the release's model directory
/// (`tokenizer.json`, chat template, `config.json`, `decision_config.json`). Without a directory the
/// tokenizer and chat template come from the GGUF itself and the decision config takes its defaults.
#[derive(Debug, Clone)]
pub struct ModelSource {
    pub gguf: PathBuf,
    pub model_dir: Option<PathBuf>,
}

/// A loaded decision model: the [`LetterModel`] and the decision config that goes with it.
pub struct LoadedDecisionModel {
    pub model: DecoderLetterModel,
    pub config: DecisionConfig,
}

/// [`LetterModel`] over the Qwen3.5 decoder.
pub struct DecoderLetterModel {
    name: String,
    decoder: Qwen35Model,
    format: PromptFormat,
    max_prompt_tokens: usize,
}

impl DecoderLetterModel {
    /// Loads the GGUF, the prompt format (tokenizer, chat template, the spec's load-time checks) and the
    /// decision config, and checks them against each other. `max_prompt_tokens` is the longest prompt
    /// accepted; longer ones are refused as [`ModelError::PromptTooLong`] (HTTP 422).
    pub fn load(
        source: &ModelSource,
        options: &LoadOptions,
        max_prompt_tokens: usize,
    ) -> Result<LoadedDecisionModel, EngineError> {
        let gguf = GgufFile::open(&source.gguf).map_err(|e| EngineError::Gguf {
            path: source.gguf.clone(),
            source: e,
        })?;
        // A directory that does not exist has no files in it: everything then comes from the GGUF.
        let dir = source.model_dir.clone().unwrap_or_default();
        let format = PromptFormat::load_from_model_dir(&dir, Some(&gguf)).map_err(|e| {
            EngineError::PromptFormat {
                dir: dir.clone(),
                source: e,
            }
        })?;
        let config = match &source.model_dir {
            Some(dir) => DecisionConfig::from_model_dir(dir)?,
            None => DecisionConfig::default(),
        };
        if let Some(ids) = &config.letter_token_ids {
            format
                .check_letter_token_ids(ids)
                .map_err(EngineError::LetterTokenIds)?;
        }
        let mut options = options.clone();
        if options.hf_config.is_none() {
            options.hf_config = source
                .model_dir
                .as_ref()
                .map(|d| d.join("config.json"))
                .filter(|p| p.is_file());
        }
        let decoder = Qwen35Model::from_gguf(&gguf, &options).map_err(|e| EngineError::Model {
            path: source.gguf.clone(),
            source: e,
        })?;
        let vocab_size = decoder.vocab_size();
        for (letter, &id) in ('A'..='Z').zip(format.letter_ids().iter()) {
            if id as usize >= vocab_size {
                return Err(EngineError::LetterOutsideVocabulary {
                    letter,
                    id,
                    vocab_size,
                });
            }
        }
        let name = model_name(&gguf, &source.gguf);
        Ok(LoadedDecisionModel {
            model: DecoderLetterModel {
                name,
                decoder,
                format,
                max_prompt_tokens,
            },
            config,
        })
    }

    /// The tokenizer, chat template and letter ids in use.
    pub fn prompt_format(&self) -> &PromptFormat {
        &self.format
    }

    /// The decoder.
    pub fn decoder(&self) -> &Qwen35Model {
        &self.decoder
    }

    /// The longest prompt accepted, in tokens.
    pub fn max_prompt_tokens(&self) -> usize {
        self.max_prompt_tokens
    }

    /// A prompt's token ids: system and user message through the chat template with thinking off, so the
    /// text ends in the assistant prefix `<think>\n\n</think>\n\n` where the letter is read.
    pub fn prompt_tokens(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, PromptFormatError> {
        let messages = [
            ChatMessage::system(prompt.system.as_str()),
            ChatMessage::user(prompt.user.as_str()),
        ];
        Ok(self.format.render_and_encode(&messages, false)?.ids)
    }
}

impl LetterModel for DecoderLetterModel {
    fn model_name(&self) -> &str {
        &self.name
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        let mut token_prompts = Vec::with_capacity(prompts.len());
        for (index, prompt) in prompts.iter().enumerate() {
            let n_letters = prompt.option_ids.len();
            if n_letters == 0 || n_letters > 26 {
                return Err(ModelError::Backend(format!(
                    "prompt {index} has {n_letters} options; the read-out takes 1 to 26"
                )));
            }
            let ids = self
                .prompt_tokens(prompt)
                .map_err(|e| ModelError::Backend(format!("prompt {index}: {e}")))?;
            if ids.len() > self.max_prompt_tokens {
                return Err(ModelError::PromptTooLong {
                    prompt: index,
                    tokens: ids.len(),
                    limit: self.max_prompt_tokens,
                });
            }
            token_prompts.push(ids);
        }
        let refs: Vec<&[u32]> = token_prompts.iter().map(Vec::as_slice).collect();
        let rows = self
            .decoder
            .last_position_rows(&refs, self.format.letter_ids())
            .map_err(|e| ModelError::Backend(e.to_string()))?;
        let logits = rows
            .into_iter()
            .zip(prompts)
            .map(|(row, prompt)| {
                row.into_iter()
                    .take(prompt.option_ids.len())
                    .map(f64::from)
                    .collect()
            })
            .collect();
        // Usage counts every prompt's whole length, as a client would count it; that a shared evidence
        // prefix is computed once is the engine's saving, not the client's.
        let input_tokens = token_prompts.iter().map(|p| p.len() as u64).sum();
        Ok(LetterLogits {
            logits,
            input_tokens,
            output_tokens: 0,
        })
    }
}

/// The model's name for responses: the GGUF's `general.name`, else the file name without `.gguf`.
fn model_name(gguf: &GgufFile, path: &Path) -> String {
    if let Some(name) = gguf.get("general.name").and_then(|v| v.as_str()) {
        if !name.trim().is_empty() {
            return name.trim().to_string();
        }
    }
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".to_string())
}
