//! The model side of the decision procedure, as one small trait: "give me the letter logits of these
//! prompts". Everything else (rendering, read-out, wide-choice rounds, confidences, the response) is
//! model-free and lives in this crate, so it is testable with a fake model and embeddable by any Rust
//! service that brings its own [`LetterModel`].

pub use crate::error::ModelError;

/// One question's prompt, before the chat template.
// A field list: alike in shape only to other structs' plain fields.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LetterPrompt {
    /// The system message.
    pub system: String,
    /// The user message (evidence, question, lettered options).
    pub user: String,
    /// The option ids in letter order: option `A` is `option_ids[0]`. 1 to 26 of them.
    pub option_ids: Vec<String>,
    /// The images in the user message, in order (empty for a text prompt): the message is then text
    /// and image parts, an image part at each slot's byte offset.
    pub images: Vec<ImageSlot>,
}

/// Where an image goes in a prompt's user message and how many pad tokens it takes (one per merged
/// patch of the resized image).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageSlot {
    /// Byte offset in [`LetterPrompt::user`] (a char boundary; slots in increasing order).
    pub at: usize,
    /// The image's pad tokens.
    pub tokens: usize,
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

/// A thought to decode (v1.1 AutoThink): the question's prompt with thinking on, decoded until the
/// model closes the thought, the budget is spent or the loop detector stops it; then the thought is
/// closed and the letters are read again.
#[derive(Debug, Clone, PartialEq)]
pub struct ThoughtRequest {
    /// The question's name (for errors).
    pub question: String,
    /// The prompt of the first read-out (the same system and user message; the chat template is
    /// rendered with thinking on).
    pub prompt: LetterPrompt,
    /// The most tokens the thought may decode (at least 1).
    pub budget: usize,
    /// The thought's seed; `None`: derived from the thinking prompt's tokens
    /// ([`crate::thought::seed_from_tokens`]).
    pub seed: Option<u64>,
    pub sampling: crate::config::SamplingConfig,
    pub loop_detector: crate::config::LoopDetectorConfig,
}

/// A decoded thought and the read-out after it.
#[derive(Debug, Clone, PartialEq)]
pub struct ThoughtOutcome {
    /// The letter logits after the thought (as many as the prompt has options).
    pub logits: Vec<f64>,
    /// The tokens the model decoded (the closing `</think>` included when it wrote it).
    pub tokens: Vec<u32>,
    /// The thought as text (without the closing `</think>`).
    pub text: String,
    pub stop: crate::thought::StopReason,
    /// Tokens read that are not decoded: the thinking prompt and the closing tokens.
    pub input_tokens: u64,
    /// Wall time from the thought's first pass to its read-out, in milliseconds.
    pub ms: f64,
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

    /// Decodes thoughts and reads the letters after each (v1.1 AutoThink), one outcome per request in
    /// order. The default: this model cannot think ([`ModelError::CannotThink`]).
    fn think(&mut self, thoughts: &[ThoughtRequest]) -> Result<Vec<ThoughtOutcome>, ModelError> {
        let _ = thoughts;
        Err(ModelError::CannotThink)
    }
}

/// `&mut M` and `Box<M>` are letter models wherever `M` is: every method forwarded.
macro_rules! forward_letter_model {
    ($($holder:ty),+) => {$(
        impl<M: LetterModel + ?Sized> LetterModel for $holder {
            fn model_name(&self) -> &str {
                (**self).model_name()
            }

            fn letter_logits(&mut self, prompts: &[LetterPrompt]) -> Result<LetterLogits, ModelError> {
                (**self).letter_logits(prompts)
            }

            fn think(
                &mut self,
                thoughts: &[ThoughtRequest],
            ) -> Result<Vec<ThoughtOutcome>, ModelError> {
                (**self).think(thoughts)
            }
        }
    )+};
}

forward_letter_model!(&mut M, Box<M>);
