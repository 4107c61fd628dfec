//! Thoughts on the engine: one [`ThoughtRun`] per question that thinks, advanced one pass at a time.
//!
//! A run reads its thinking prompt (from the request's evidence state when it has one), then decodes
//! one token per pass: each pass gives it the next-token logits of the token it fed, and the
//! [`Sampler`] picks the next one. It stops at `</think>`, at an end-of-sequence token, at the budget,
//! at the server's longest sequence or when the [`LoopDetector`] sees runaway repetition; then it
//! closes the thought (`</think>` and the blank line the chat template puts after a thought) and reads
//! the letters once more.
//!
//! Every decision here depends only on the logits handed back and the seed, so on the exact paths a
//! thought's tokens do not depend on what else was in its passes.

use std::time::Instant;

use super::pass::{Branch, GroupInput, GroupOutput, PassModel, PromptEncoder, ThoughtMarkers};
use crate::decide::ThoughtId;
use crate::error::ModelError;
use crate::model::{ThoughtOutcome, ThoughtRequest};
use crate::thought::{seed_from_tokens, LoopDetector, Sampler, StopReason};

/// What a run does in its next pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Read the thinking prompt.
    Prefill,
    /// Feed the last sampled token.
    Decode,
    /// Feed the closing tokens and read the letters.
    Close,
    /// Finished: the outcome is ready.
    Done,
}

/// One question's thought in progress. `S` is the model's sequence state.
pub(crate) struct ThoughtRun<S> {
    pub(crate) id: ThoughtId,
    question: String,
    letters: usize,
    /// The thinking prompt's tokens.
    prompt: Vec<u32>,
    budget: usize,
    max_tokens: usize,
    markers: ThoughtMarkers,
    sampler: Sampler,
    detector: LoopDetector,
    /// Decoded tokens; all but the last are in `state`.
    generated: Vec<u32>,
    state: Option<S>,
    pub(crate) phase: Phase,
    stop: Option<StopReason>,
    /// The tokens fed in the close pass.
    close: Vec<u32>,
    started: Option<Instant>,
    outcome: Option<ThoughtOutcome>,
    /// Decoded tokens that are thought text (without a closing `</think>` or end of sequence).
    thought_len: usize,
}

impl<S: Clone> ThoughtRun<S> {
    /// A run for `request`; `max_tokens` is the server's longest sequence (`--max-tokens`).
    pub(crate) fn new(
        id: ThoughtId,
        request: &ThoughtRequest,
        encoder: &dyn PromptEncoder,
        max_tokens: usize,
    ) -> Result<Self, ModelError> {
        let markers = encoder.thought_markers().ok_or(ModelError::CannotThink)?;
        let prompt = encoder.encode_thinking(&request.prompt)?;
        if prompt.is_empty() {
            return Err(ModelError::Backend(
                "the thinking prompt has no tokens".into(),
            ));
        }
        let seed = request.seed.unwrap_or_else(|| seed_from_tokens(&prompt));
        Ok(ThoughtRun {
            id,
            question: request.question.clone(),
            letters: request.prompt.option_ids.len(),
            prompt,
            budget: request.budget.max(1),
            max_tokens,
            markers,
            sampler: Sampler::new(request.sampling.clone(), seed),
            detector: LoopDetector::new(request.loop_detector.clone()),
            generated: Vec::new(),
            state: None,
            phase: Phase::Prefill,
            stop: None,
            close: Vec::new(),
            started: None,
            outcome: None,
            thought_len: 0,
        })
    }

    /// The thinking prompt's tokens.
    pub(crate) fn prompt(&self) -> &[u32] {
        &self.prompt
    }

    /// Tokens the next pass computes for this run, when it starts from `evidence` tokens already
    /// computed (prefill only).
    pub(crate) fn next_tokens(&self, evidence: usize) -> usize {
        match self.phase {
            Phase::Prefill => self.prompt.len() - evidence,
            Phase::Decode => 1,
            Phase::Close => self.close.len(),
            Phase::Done => 0,
        }
    }

    /// Whether the run holds a sequence state (a seat of `--think-seqs`).
    pub(crate) fn holds_state(&self) -> bool {
        matches!(self.phase, Phase::Decode | Phase::Close)
    }

    /// The pass input of this run. `evidence`: a state after the first `n` tokens of the prompt
    /// (the request's evidence), used by the prefill.
    pub(crate) fn input<'a>(&'a self, evidence: Option<(&'a S, usize)>) -> GroupInput<'a, S> {
        match self.phase {
            Phase::Prefill => {
                let (start, from) = match evidence {
                    Some((state, n)) if n < self.prompt.len() => (Some(state), n),
                    _ => (None, 0),
                };
                GroupInput {
                    start,
                    prefix: &self.prompt[from..],
                    branches: Vec::new(),
                    want_state: true,
                    want_logits: Some(self.sampler.needs()),
                    // A thought starts from its request's evidence state, which holds the images
                    // (the engine keeps it until the request is answered).
                    images: None,
                }
            }
            Phase::Decode => GroupInput {
                start: self.state.as_ref(),
                prefix: std::slice::from_ref(self.generated.last().unwrap_or(&0)),
                branches: Vec::new(),
                want_state: true,
                want_logits: Some(self.sampler.needs()),
                images: None,
            },
            Phase::Close | Phase::Done => GroupInput {
                start: self.state.as_ref(),
                prefix: &[],
                branches: vec![Branch {
                    tokens: &self.close,
                    letters: self.letters,
                }],
                want_state: false,
                want_logits: None,
                images: None,
            },
        }
    }

    /// Marks the start of its first pass.
    pub(crate) fn mark_started(&mut self, at: Instant) {
        self.started.get_or_insert(at);
    }

    /// Takes the output of the pass that ran [`Self::input`]. Returns the outcome once done.
    pub(crate) fn apply(&mut self, output: GroupOutput<S>) -> Result<(), ModelError> {
        match self.phase {
            Phase::Prefill | Phase::Decode => {
                let state = output.state.ok_or_else(|| {
                    ModelError::Backend("a thought step returned no state".into())
                })?;
                let logits = output.next_logits.ok_or_else(|| {
                    ModelError::Backend("a thought step returned no logits".into())
                })?;
                self.state = Some(state);
                let token = match &logits.ids {
                    None => self.sampler.sample(&logits.values),
                    Some(ids) => self.sampler.sample_candidates(&logits.values, ids),
                }
                .map_err(|e| {
                    ModelError::Backend(format!("question {:?}: thought: {e}", self.question))
                })?;
                self.generated.push(token);
                self.phase = Phase::Decode;
                self.check_stop(token);
            }
            Phase::Close => {
                let logits = output.logits.into_iter().next().ok_or_else(|| {
                    ModelError::Backend("the read-out after a thought is missing".into())
                })?;
                self.state = None;
                self.phase = Phase::Done;
                let stop = self.stop.unwrap_or(StopReason::Budget);
                let thought: &[u32] = match stop {
                    StopReason::EndOfThought | StopReason::EndOfSequence => {
                        &self.generated[..self.generated.len().saturating_sub(1)]
                    }
                    _ => &self.generated,
                };
                // The closing tokens hold the last decoded token, except after an end of sequence
                // (which is not fed).
                let decoded_in_close = usize::from(stop != StopReason::EndOfSequence);
                let input_tokens = (self.prompt.len() + self.close.len() - decoded_in_close) as u64;
                self.thought_len = thought.len();
                self.outcome = Some(ThoughtOutcome {
                    logits,
                    tokens: self.generated.clone(),
                    text: String::new(),
                    stop,
                    input_tokens,
                    ms: self
                        .started
                        .map_or(0.0, |s| s.elapsed().as_secs_f64() * 1e3),
                });
            }
            Phase::Done => {}
        }
        Ok(())
    }

    fn check_stop(&mut self, token: u32) {
        let markers = &self.markers;
        let stop = if token == markers.end_think {
            Some(StopReason::EndOfThought)
        } else if markers.end_of_sequence.contains(&token) {
            Some(StopReason::EndOfSequence)
        } else if self.detector.push(token).is_some() {
            Some(StopReason::Loop)
        } else if self.generated.len() >= self.budget {
            Some(StopReason::Budget)
        } else if self.prompt.len() + self.generated.len() + markers.close.len() >= self.max_tokens
        {
            Some(StopReason::Length)
        } else {
            None
        };
        let Some(stop) = stop else {
            return;
        };
        self.stop = Some(stop);
        self.phase = Phase::Close;
        self.close = match stop {
            // `</think>` is fed, then the blank line after it.
            StopReason::EndOfThought => {
                let mut close = vec![token];
                close.extend_from_slice(&markers.after_end);
                close
            }
            // The end-of-sequence token is not fed: the thought is closed in its place.
            StopReason::EndOfSequence => markers.close.clone(),
            _ => {
                let mut close = vec![token];
                close.extend_from_slice(&markers.close);
                close
            }
        };
    }

    /// The outcome, once [`Phase::Done`], its text decoded by `encoder`.
    pub(crate) fn take_outcome(&mut self, encoder: &dyn PromptEncoder) -> Option<ThoughtOutcome> {
        let mut outcome = self.outcome.take()?;
        outcome.text = encoder.decode(&self.generated[..self.thought_len]);
        Some(outcome)
    }
}

/// Decodes thoughts without an engine: all runs advance together, one pass per step, each from its
/// own prompt (no evidence shared). [`crate::decide`]'s path for a [`PassModel`].
pub fn think_alone<M: PassModel>(
    model: &mut M,
    encoder: &dyn PromptEncoder,
    requests: &[ThoughtRequest],
    max_tokens: usize,
) -> Result<Vec<ThoughtOutcome>, ModelError> {
    let mut runs = requests
        .iter()
        .enumerate()
        .map(|(i, r)| ThoughtRun::<M::State>::new(ThoughtId::new(i), r, encoder, max_tokens))
        .collect::<Result<Vec<_>, _>>()?;
    let started = Instant::now();
    for run in &mut runs {
        run.mark_started(started);
    }
    let mut outcomes: Vec<Option<ThoughtOutcome>> = vec![None; runs.len()];
    loop {
        let live: Vec<usize> = (0..runs.len())
            .filter(|&i| runs[i].phase != Phase::Done)
            .collect();
        if live.is_empty() {
            break;
        }
        let outputs = {
            let inputs: Vec<GroupInput<'_, M::State>> =
                live.iter().map(|&i| runs[i].input(None)).collect();
            model.run_pass(&inputs)?
        };
        if outputs.len() != live.len() {
            return Err(ModelError::Backend(format!(
                "the model returned {} groups for a pass of {}",
                outputs.len(),
                live.len()
            )));
        }
        for (&i, output) in live.iter().zip(outputs) {
            runs[i].apply(output)?;
            if let Some(outcome) = runs[i].take_outcome(encoder) {
                outcomes[i] = Some(outcome);
            }
        }
    }
    outcomes
        .into_iter()
        .map(|o| o.ok_or_else(|| ModelError::Backend("a thought did not finish".into())))
        .collect()
}
