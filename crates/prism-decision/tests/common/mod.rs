//! Shared test helpers: the golden file and fake letter models.
#![allow(dead_code)]

use std::path::PathBuf;

use prism_decision::pyjson::{self, PyValue};
use prism_decision::{LetterLogits, LetterModel, LetterPrompt, ModelError};

pub fn fixture_path(relative: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(relative)
}

/// `golden.json`, read with our Python-compatible parser so its number forms survive.
pub fn golden() -> PyValue {
    let path = fixture_path("decision-golden/golden.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    pyjson::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn get<'a>(value: &'a PyValue, key: &str) -> &'a PyValue {
    value
        .as_object()
        .and_then(|o| o.get(key))
        .unwrap_or_else(|| panic!("no key {key:?} in {value}"))
}

pub fn list(value: &PyValue) -> &[PyValue] {
    match value {
        PyValue::Array(items) => items,
        other => panic!("not a list: {other}"),
    }
}

/// The golden read-out cases' fake model: `int(sha1(id).hexdigest()[:8], 16) / 2**32 * 8 - 4`.
pub fn sha_logit(id: &str) -> f64 {
    let digest = sha1_smol::Sha1::from(id.as_bytes()).digest().bytes();
    let top = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    top as f64 / 4294967296.0 * 8.0 - 4.0
}

/// A fake model whose letter logit for an option is [`sha_logit`] of its id. Records every call.
#[derive(Default)]
pub struct ShaModel {
    /// The prompts of each call.
    pub calls: Vec<Vec<LetterPrompt>>,
    pub tokens_per_prompt: u64,
}

impl LetterModel for ShaModel {
    fn model_name(&self) -> &str {
        "sha1-fake"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        self.calls.push(prompts.to_vec());
        Ok(LetterLogits {
            logits: prompts
                .iter()
                .map(|p| p.option_ids.iter().map(|id| sha_logit(id)).collect())
                .collect(),
            input_tokens: self.tokens_per_prompt * prompts.len() as u64,
            output_tokens: 0,
        })
    }
}

/// A fake model that returns fixed logits for every prompt, truncated to the prompt's option count.
pub struct FixedModel {
    pub logits: Vec<f64>,
    pub calls: usize,
}

impl LetterModel for FixedModel {
    fn model_name(&self) -> &str {
        "fixed-fake"
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        self.calls += 1;
        Ok(LetterLogits {
            logits: prompts
                .iter()
                .map(|p| self.logits[..p.option_ids.len()].to_vec())
                .collect(),
            input_tokens: 10 * prompts.len() as u64,
            output_tokens: 0,
        })
    }
}

/// Relative difference, with an absolute floor for values near zero.
pub fn rel_diff(got: f64, want: f64) -> f64 {
    (got - want).abs() / want.abs().max(1e-300)
}
