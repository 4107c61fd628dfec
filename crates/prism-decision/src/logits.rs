//! `prism logits`' model run: the decoder (from a GGUF file, or a Hugging Face checkpoint for parity
//! work) on a batch of prompts (token ids, or one chat-templated text), each prompt's last-position
//! logits, and the read-out letters' rows when the tokenizer loads.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use prism_gguf::GgufFile;
use prism_model::{LoadOptions, Precision, Qwen35Model};

use crate::chat_template::PromptFormat;

/// `prism logits`' flags.
// Plain optional fields: alike in shape only to the other option structs (`InProcess`, `TokenizerConfig`).
#[derive(Clone, Debug, Default)]
pub struct LogitsOptions {
    pub gguf: Option<PathBuf>,
    pub hf_dir: Option<PathBuf>,
    pub model_dir: Option<PathBuf>,
    pub prompt_file: Option<PathBuf>,
    pub tokens: Option<PathBuf>,
    pub precision: String,
}

/// Each prompt's tokens and last-position logits.
pub struct LogitsRun {
    pub prompts: Vec<Vec<u32>>,
    pub logits: Vec<Vec<f32>>,
    /// The letters A–Z's token ids, when the tokenizer and chat template loaded.
    pub letter_ids: Option<Vec<u32>>,
    /// Why there are no letter rows.
    pub note: Option<String>,
}

/// Loads the model and runs `args`' prompts as one batch (shared prefix once).
pub fn run(args: &LogitsOptions) -> Result<LogitsRun> {
    // Exactly one weight source: a GGUF file, or (for parity work) a Hugging Face checkpoint directory.
    let gguf = match (&args.gguf, &args.hf_dir) {
        (Some(path), None) => {
            Some(GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?)
        }
        (None, Some(_)) => None,
        _ => bail!("give exactly one of --gguf FILE and --hf-dir DIR"),
    };
    // `auto` reads the file's weight types (Q8_0 → int8, K-quants → w4a8, float → bf16).
    let precision = match &gguf {
        Some(gguf) => Precision::resolve(&args.precision, gguf)?,
        None => Precision::parse(&args.precision)?,
    };
    // The tokenizer and chat template: the model directory's files (an --hf-dir is one), else the GGUF's
    // own vocabulary. They give text prompts their ids and the read-out its letter rows (with the spec's
    // load checks).
    let model_dir = args
        .model_dir
        .clone()
        .or_else(|| args.hf_dir.clone())
        .unwrap_or_default();
    let format = PromptFormat::load_from_model_dir(&model_dir, gguf.as_ref());
    let prompts = match (&args.tokens, &args.prompt_file) {
        (Some(path), _) => read_token_file(path)?,
        (None, Some(path)) => {
            let format = format.as_ref().map_err(|e| {
                anyhow::anyhow!(
                    "--prompt-file {} needs the tokenizer, which did not load: {e}",
                    path.display()
                )
            })?;
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let ids = format
                .encode(&text)
                .with_context(|| format!("tokenizing {}", path.display()))?;
            if ids.is_empty() {
                bail!("{}: the prompt is empty", path.display());
            }
            vec![ids]
        }
        (None, None) => {
            bail!("give --tokens FILE (a JSON array of token-id arrays) or --prompt-file FILE")
        }
    };

    let hf_config = args
        .model_dir
        .as_ref()
        .map(|d| d.join("config.json"))
        .filter(|p| p.is_file());
    let options = LoadOptions {
        precision,
        hf_config,
        ..LoadOptions::default()
    };
    let model = match (&gguf, &args.gguf, &args.hf_dir) {
        (Some(gguf), Some(path), _) => Qwen35Model::from_gguf(gguf, &options)
            .with_context(|| format!("loading the model from {}", path.display()))?,
        (None, _, Some(dir)) => Qwen35Model::from_hf_dir(dir, &options)
            .with_context(|| format!("loading the model from {}", dir.display()))?,
        _ => bail!("give exactly one of --gguf FILE and --hf-dir DIR"),
    };
    let letter_ids: Option<Vec<u32>> = match &format {
        Ok(format) => Some(format.letter_ids().to_vec()),
        Err(_) => None,
    };
    let note = match &format {
        Ok(_) => None,
        Err(e) => Some(format!(
            "note: no tokenizer/chat template ({e}); letter_logits are omitted"
        )),
    };
    if let Some(&id) = letter_ids
        .iter()
        .flatten()
        .find(|&&id| id as usize >= model.vocab_size())
    {
        bail!(
            "letter token {id} is outside the model's {} output rows",
            model.vocab_size()
        );
    }

    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let hidden = model.last_hidden_shared_prefix(&refs)?;
    let logits: Vec<Vec<f32>> = model.logits(&hidden)?.to_vec2()?;
    Ok(LogitsRun {
        prompts,
        logits,
        letter_ids,
        note,
    })
}

/// Index of the largest logit (the first one on ties); `None` if any logit is NaN.
pub fn argmax(row: &[f32]) -> Option<usize> {
    if row.iter().any(|v| v.is_nan()) {
        return None;
    }
    row.iter()
        .enumerate()
        .fold(None, |best: Option<(usize, f32)>, (i, &v)| match best {
            Some((_, b)) if b >= v => best,
            _ => Some((i, v)),
        })
        .map(|(i, _)| i)
}

/// A JSON array of token-id arrays.
pub fn read_token_file(path: &Path) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{}: not valid JSON", path.display()))?;
    let prompts = value.as_array().with_context(|| {
        format!(
            "{}: expected a JSON array of token-id arrays",
            path.display()
        )
    })?;
    if prompts.is_empty() {
        bail!("{}: no prompts", path.display());
    }
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let ids = p.as_array().with_context(|| {
                format!(
                    "{}: prompt {i} is not an array of token ids",
                    path.display()
                )
            })?;
            ids.iter()
                .enumerate()
                .map(|(j, id)| {
                    id.as_u64()
                        .and_then(|v| u32::try_from(v).ok())
                        .with_context(|| {
                            format!(
                                "{}: prompt {i}, token {j}: {id} is not a token id",
                                path.display()
                            )
                        })
                })
                .collect()
        })
        .collect()
}
