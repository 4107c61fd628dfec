//! The model side of the engine: one forward pass over groups of prompts that share an evidence prefix.
//!
//! The step loop ([`super::step`]) decides *what* runs in a pass; a [`PassModel`] only runs it. A pass is
//! a list of [`GroupInput`]s: each starts from a saved state (a prefix-cache entry, or the request's own
//! evidence state) or from an empty sequence, runs its `prefix` tokens, and then continues every
//! [`Branch`] from the state right after the prefix. A group with no branches is a chunk of a long
//! evidence prefix, computed over several passes so that it never holds the others back.

use std::sync::Mutex;

use crate::image_input::DecodedImage;
use crate::model::{LetterPrompt, ModelError};
use crate::vision::ImageConfig;

/// One question's tokens on top of its group's prefix, and how many letters (`A`..) to read at its end.
#[derive(Debug, Clone, Copy)]
pub struct Branch<'a> {
    /// The branch's own tokens (at least one).
    pub tokens: &'a [u32],
    /// Letters to read at the last token: the logits of `A`.. for this many options (1 to 26).
    pub letters: usize,
}

/// One evidence group of a pass.
#[derive(Debug)]
pub struct GroupInput<'a, S> {
    /// The saved state the group continues (`start_tokens` tokens already in it), or `None` for a new
    /// sequence.
    pub start: Option<&'a S>,
    /// Tokens to run from the start before branching; may be empty when `start` is set.
    pub prefix: &'a [u32],
    /// The continuations that branch after the prefix.
    pub branches: Vec<Branch<'a>>,
    /// Whether the state after the prefix is wanted back ([`GroupOutput::state`]).
    pub want_state: bool,
    /// Whether the next-token logits at the prefix's last token are wanted back
    /// ([`GroupOutput::next_logits`]; a thought's decode step), and how many of the best: `Some(k)`
    /// asks for candidates that include the `k` best logits, `Some(0)` for the whole vocabulary. Needs
    /// a non-empty prefix.
    pub want_logits: Option<usize>,
    /// The request's images when the prefix holds some of their pad tokens: the model replaces those
    /// tokens' embeddings with the vision tower's output and gives the prefix its 3-axis positions.
    /// `None` for text.
    pub images: Option<PrefixImages<'a>>,
}

/// A group prefix's part of a request's images.
#[derive(Debug, Clone, Copy)]
pub struct PrefixImages<'a> {
    pub images: &'a RequestImages,
    /// Where the prefix starts in the request's evidence tokens (a chunk of a long evidence starts
    /// past 0).
    pub offset: usize,
}

/// A request's decoded images and what its evidence needs of them: shared by every pass that computes
/// some of the evidence (chunks), so the vision tower runs once per request
/// ([`RequestImages::embeddings`]).
#[derive(Debug)]
pub struct RequestImages {
    /// The images in prompt order.
    pub images: Vec<DecodedImage>,
    /// The 3-axis M-RoPE position of every evidence token ([`crate::vision::mrope_positions`]).
    pub positions: Vec<prism_model::Position3>,
    /// The evidence tokens that are image pads, increasing: the `k`-th takes row `k` of the images'
    /// embeddings stacked in order.
    pub pad_rows: Vec<usize>,
    /// SHA-256 over the images' own SHA-256 digests in order: with the evidence tokens, the prefix
    /// cache's key (two images with the same pad tokens never share a state).
    pub digest: [u8; 32],
    embeddings: Mutex<Option<candle_core::Tensor>>,
}

impl RequestImages {
    pub fn new(
        images: Vec<DecodedImage>,
        positions: Vec<prism_model::Position3>,
        pad_rows: Vec<usize>,
    ) -> Self {
        use sha2::{Digest, Sha256};
        let mut hasher = Sha256::new();
        for image in &images {
            hasher.update(image.sha256);
        }
        RequestImages {
            images,
            positions,
            pad_rows,
            digest: hasher.finalize().into(),
            embeddings: Mutex::new(None),
        }
    }

    /// The images' embeddings stacked in order (`[pad_rows.len(), width]`): computed by `compute` the
    /// first time they are asked for, then kept for the rest of the request's evidence.
    pub fn embeddings<E>(
        &self,
        compute: impl FnOnce(&[DecodedImage]) -> Result<candle_core::Tensor, E>,
    ) -> Result<candle_core::Tensor, E> {
        let mut kept = self
            .embeddings
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(tensor) = kept.as_ref() {
            return Ok(tensor.clone());
        }
        let tensor = compute(&self.images)?;
        *kept = Some(tensor.clone());
        Ok(tensor)
    }

    /// Whether the tower has run for these images.
    pub fn has_embeddings(&self) -> bool {
        self.embeddings
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_some()
    }
}

/// What a pass returns for one group.
#[derive(Debug)]
pub struct GroupOutput<S> {
    /// The state after the prefix, when it was asked for.
    pub state: Option<S>,
    /// Per branch, in order, the letter logits (`letters` of them).
    pub logits: Vec<Vec<f64>>,
    /// The next-token logits after the prefix, when they were asked for.
    pub next_logits: Option<NextLogits>,
}

/// Next-token logits: the whole vocabulary's (`ids` `None`: `values[t]` is token `t`'s), or candidates
/// that include the `k` best asked for, with their token ids.
#[derive(Debug, Clone, PartialEq)]
pub struct NextLogits {
    pub values: Vec<f32>,
    pub ids: Option<Vec<u32>>,
}

/// A model that runs passes for the engine.
///
/// The promise the engine builds on (and tests): a branch's logits depend only on the tokens of its
/// whole sequence (start state's tokens, prefix, branch), not on the other groups of the pass, on where
/// the sequence was split into prefix and branch, or on whether the start state came from a cache. The
/// decoder of `prism-model` keeps it bit for bit on the CPU and on the integer path on a GPU; the bf16
/// GPU path keeps it only approximately (cuBLAS chooses its reduction by shape).
pub trait PassModel: Send {
    /// A sequence's saved state after some tokens (cheap to clone: reference-counted tensors).
    type State: Clone + Send + 'static;

    /// The model's name, reported in every response's `model`.
    fn model_name(&self) -> &str;

    /// Runs one pass. On error no state handed in is changed, and the engine retries the pass's
    /// requests one at a time so that one bad request cannot fail the others.
    fn run_pass(
        &mut self,
        groups: &[GroupInput<'_, Self::State>],
    ) -> Result<Vec<GroupOutput<Self::State>>, ModelError>;

    /// Memory a saved state holds, in bytes (what the prefix cache's byte budget counts).
    fn state_bytes(&self, state: &Self::State) -> usize;

    /// The model's device memory in use and in all, in bytes, asked after each pass (`None`, the default:
    /// not on a GPU).
    fn device_memory(&self) -> Option<(u64, u64)> {
        None
    }

    /// Images the model's vision tower has encoded so far and the seconds it spent on them, asked
    /// after each pass (`None`, the default: no vision tower).
    fn vision_totals(&self) -> Option<(u64, f64)> {
        None
    }
}

/// Turns a prompt into the token ids the model reads (chat template with thinking off, tokenizer). The
/// engine calls it on the submitting thread, never on the step loop's, so a huge prompt cannot stall
/// the passes of others.
pub trait PromptEncoder: Send + Sync {
    fn encode(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError>;

    /// [`Self::encode`] of each prompt, in order (a request's prompts, which share their evidence).
    /// The default encodes them one by one in parallel; an encoder may encode what they share once,
    /// giving the same ids.
    fn encode_many(&self, prompts: &[LetterPrompt]) -> Vec<Result<Vec<u32>, ModelError>> {
        use rayon::prelude::*;
        prompts.par_iter().map(|p| self.encode(p)).collect()
    }

    /// The longest text one token stands for, in UTF-8 bytes, when every prompt's user message reaches
    /// the tokenizer whole: then a prompt's evidence and instructions alone bound its token count from
    /// below, and the engine refuses a request that bound already puts over a limit without rendering
    /// or tokenizing it ([`super::min_prompt_tokens`]). `None` (the default): no such bound.
    fn max_token_bytes(&self) -> Option<usize> {
        None
    }

    /// A prompt's token ids with thinking on (the chat template's assistant turn opens `<think>\n`),
    /// for a thought. The default: [`ModelError::CannotThink`].
    fn encode_thinking(&self, prompt: &LetterPrompt) -> Result<Vec<u32>, ModelError> {
        let _ = prompt;
        Err(ModelError::CannotThink)
    }

    /// The tokens that end and close a thought; `None` (the default): this model cannot think.
    fn thought_markers(&self) -> Option<ThoughtMarkers> {
        None
    }

    /// The image preprocessing of the model's vision tower; `None` (the default): the model has none,
    /// and a request with images is refused (422).
    fn image_config(&self) -> Option<ImageConfig> {
        None
    }

    /// The `<|image_pad|>` token id, which [`Self::encode`] repeats once per merged patch of each
    /// image ([`crate::model::ImageSlot::tokens`]); `None` when the model has no vision tower.
    fn image_pad(&self) -> Option<u32> {
        None
    }

    /// Token ids back to text (a thought's), special tokens left out.
    fn decode(&self, tokens: &[u32]) -> String {
        let _ = tokens;
        String::new()
    }
}

/// The tokens around a thought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThoughtMarkers {
    /// `</think>`: the model closes its thought.
    pub end_think: u32,
    /// Tokens that end the model's turn (a thought that reaches one is closed in its place).
    pub end_of_sequence: Vec<u32>,
    /// Fed after a `</think>` the model wrote: the blank line the chat template puts after a thought
    /// (`\n\n`).
    pub after_end: Vec<u32>,
    /// Fed to close a thought the model did not close: `\n</think>\n\n`.
    pub close: Vec<u32>,
}
