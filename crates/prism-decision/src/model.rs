//! The model side of the decision procedure, as one small trait: "give me the letter logits of these
//! prompts". Everything else (rendering, read-out, wide-choice rounds, confidences, the response) is
//! model-free and lives in this crate, so it is testable with a fake model and embeddable by any Rust
//! service that brings its own [`LetterModel`].

pub use crate::error::ModelError;

/// One question's prompt, before the chat template.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterPrompt {
    /// The system message.
    pub system: String,
    /// The user message (evidence, question, lettered options).
    pub user: String,
    /// The option ids in letter order: option `A` is `option_ids[0]`. 1 to 26 of them.
    pub option_ids: Vec<String>,
}

/// The model's answer for a batch of prompts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LetterLogits {
    /// Per prompt, in the order given, the next-token logits of the letters `A`.. for its
    /// `option_ids.len()` options, read at the last prompt position (after the chat template's assistant
    /// prefix with thinking off). f64 so that exact fakes and f32 models both fit without loss.
    pub logits: Vec<Vec<f64>>,
    /// Input tokens this call accounts for (the model decides how shared prefixes count); summed into
    /// the response's `usage.input_tokens`.
    pub input_tokens: u64,
    /// Tokens generated (0 for a plain read-out); summed into `usage.output_tokens`.
    pub output_tokens: u64,
}

/// A decision model reduced to its read-out.
///
/// `letter_logits` gets every prompt that is ready at one step of the procedure: all questions of a request
/// in one call (so an implementation can run their shared evidence prefix once and branch), then one call
/// per further wide-choice round. Object-safe, so services can hold a `Box<dyn LetterModel>`.
pub trait LetterModel {
    /// The model's name, reported in the response's `model`.
    fn model_name(&self) -> &str;

    /// The letter logits of each prompt (see [`LetterLogits`]). A prompt the model cannot take (too long)
    /// is reported as [`ModelError::PromptTooLong`] with its index in `prompts`.
    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError>;
}

impl<M: LetterModel + ?Sized> LetterModel for &mut M {
    fn model_name(&self) -> &str {
        (**self).model_name()
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        (**self).letter_logits(prompts)
    }
}

impl<M: LetterModel + ?Sized> LetterModel for Box<M> {
    fn model_name(&self) -> &str {
        (**self).model_name()
    }

    fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
        (**self).letter_logits(prompts)
    }
}
