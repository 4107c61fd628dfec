//! `prism logits`: the flags and the printing; the run is `prism_decision::logits`.

use std::io::Write;

use anyhow::{Context, Result};
use prism_decision::logits::{argmax, LogitsOptions};
use serde::Serialize;

use crate::LogitsArgs;

/// The read-out letters.
const LETTERS: [&str; 26] = [
    "A", "B", "C", "D", "E", "F", "G", "H", "I", "J", "K", "L", "M", "N", "O", "P", "Q", "R", "S",
    "T", "U", "V", "W", "X", "Y", "Z",
];

pub fn run(args: &LogitsArgs) -> Result<()> {
    let run = prism_decision::logits::run(&LogitsOptions {
        gguf: args.gguf.clone(),
        hf_dir: args.hf_dir.clone(),
        model_dir: args.model_dir.clone(),
        prompt_file: args.prompt_file.clone(),
        tokens: args.tokens.clone(),
        precision: args.precision.clone(),
    })?;
    if let Some(note) = &run.note {
        eprintln!("{note}");
    }
    let (prompts, logits, letter_ids) = (&run.prompts, &run.logits, &run.letter_ids);
    let mut out = std::io::stdout().lock();
    for (i, (prompt, row)) in prompts.iter().zip(logits).enumerate() {
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
