//! `prism logits`: run the decoder on a batch of prompts and print last-position logits.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use prism_decision::chat_template::PromptFormat;
use prism_gguf::GgufFile;
use prism_model::{LoadOptions, Precision, Qwen35Model};
use serde::Serialize;

use crate::LogitsArgs;

/// The read-out letters.
const LETTERS: [&str; 26] = [
    "A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P", "Q", "R", "S",
    "T", "U", "V", "W", "X", "Y", "Z",
];

pub fn run(args: &LogitsArgs) -> Result<()> {
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
        Err(e) => {
            eprintln!("note: no tokenizer/chat template ({e}); letter_logits are omitted");
            None
        }
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

    let mut out = std::io::stdout().lock();
    for (i, (prompt, row)) in prompts.iter().zip(&logits).enumerate() {
        let argmax = argmax(row).with_context(|| format!("prompt {i}: logits contain NaN"))?;
        let letters: Option<Vec<f32>> = letter_ids
            .as_ref()
            .map(|ids| ids.iter().map(|&id| row[id as usize]).collect());
        if args.json {
            let line = JsonLine {
                n_tokens: prompt.len(),
                letter_logits: letters,
                argmax,
                logits: args.full.then_some(row.as_slice()),
            };
            writeln!(out, "{}", serde_json::to_string(&line)?)?;
        } else {
            writeln!(
                out,
                "prompt {i}: {} tokens, argmax {argmax} (logit {:.6})",
                prompt.len(),
                row[argmax]
            )?;
            if let Some(l) = &letters {
                let shown: Vec<String> = LETTERS
                    .iter()
                    .zip(l)
                    .map(|(c, v)| format!("{c}={v:.4}"))
                    .collect();
                writeln!(out, "  letters: {}", shown.join(" "))?;
            }
            if args.full {
                let all: Vec<String> = row.iter().map(|v| format!("{v:.6}")).collect();
                writeln!(out, "  logits: {}", all.join(" "))?;
            }
        }
    }
    Ok(())
}

/// One `--json` output line. f32 values serialize in their shortest round-trip form.
#[derive(Serialize)]
struct JsonLine<'a> {
    n_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    letter_logits: Option<Vec<f32>>,
    argmax: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    logits: Option<&'a [f32]>,
}

/// Index of the largest logit (the first one on ties); `None` if any logit is NaN.
fn argmax(row: &[f32]) -> Option<usize> {
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
fn read_token_file(path: &Path) -> Result<Vec<Vec<u32>>> {
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
