//! The decision procedure: render every question, read the letters through a [`LetterModel`], think
//! when unsure (v1.1 AutoThink), turn the read-outs into answers.
//!
//! - v1: one read-out per question. A choice with one option answers itself (probability 1, no prompt);
//!   a choice with more than 26 options is read in wide-choice rounds.
//! - v1.1 (both families): with `none_check` a choice question gets the none option, an extra last
//!   option worded by the release (`decision_config.json` `none_option.text`); its probability is the
//!   answer's `none_probability`, and with `allow_none` the answer's `choice` is `null` when it is more
//!   likely than every listed option. (A one-option choice is then read too: the option or none.)
//! - v1.1 AutoThink: after the first read-out a question thinks when `think_mode` is `always`, or `auto`
//!   and the read-out's top probability is below `gate`: its thought is decoded
//!   ([`LetterModel::think`]), the letters are read again after it and the answer is
//!   `mix · p_after + (1 − mix) · p_first`. Questions read in wide-choice rounds do not think.
//! - v1.1 Instant: every prompt is read twice, with the options in the given order and reversed (the none
//!   option stays last), and the two read-outs are averaged per option; it never thinks.
//!
//! A v1 or Instant model refuses `think_mode: "always"` (422). Images need the engine with a vision
//! model ([`DecisionTask::with_images`], called by `crate::engine` after decoding them;
//! [`render_request_with_images`] places them without a model); [`decide`] and [`render_request`] read
//! text only and refuse them (422).

use std::time::Instant;

use crate::config::{DecisionConfig, Family};
use crate::error::{DecisionError, FieldError, FieldPath, ModelError};
use crate::model::{LetterLogits, LetterModel, LetterPrompt, ThoughtOutcome, ThoughtRequest};
use crate::readout::{
    argmax, choice_confidence, expected_score, score_confidence, softmax, WideChoice,
};
use crate::render::{evidence, option_labels, user_text, Evidence, SYSTEM_PROMPT};
use crate::request::{DecisionRequest, Question, QuestionType, ThinkMode};
use crate::response::{
    Answer, AnswerDetails, AnswerTimings, ChoiceAnswer, DecisionResponse, NoulAnswer, OrderedMap,
    ScoreAnswer, Usage,
};
use crate::thought::{seed_from_request, StopReason};

/// The option id the none option carries in a [`LetterPrompt`]'s `option_ids`. It starts with a control
/// character, so it is never a client's id.
pub const NONE_OPTION_ID: &str = "\u{0}none";

/// How a question is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// A choice with a single option: probability 1, no prompt.
    SelfAnswered,
    /// One prompt (2 to 26 options; two prompts for Instant).
    Single,
    /// More than 26 options: group rounds, then a final round.
    Wide,
}

/// A question's prompts as `prism render` shows them.
#[derive(Debug, Clone, PartialEq)]
pub struct RenderedQuestion {
    pub name: String,
    pub kind: QuestionType,
    pub mode: ReadMode,
    /// The prompt (Single), the first-round group prompts (Wide; the later rounds depend on the
    /// read-outs), or nothing (SelfAnswered). Instant reads each twice: the given order, then reversed.
    pub prompts: Vec<LetterPrompt>,
}

/// Refuses what this engine or this model cannot do (422), naming the field.
/// `images_ready`: the request's images were decoded for a model with a vision tower (the engine's
/// [`DecisionTask::with_images`]); otherwise a request with images is refused.
fn check_supported(
    request: &DecisionRequest,
    family: Family,
    images_ready: bool,
) -> Result<(), DecisionError> {
    let mut errors = Vec::new();
    if !request.images.is_empty() && !images_ready {
        errors.push(FieldError::unanswerable(
            FieldPath::root().key("images"),
            "not_supported",
            "images need a vision model (an mmproj file) and the engine (`prism serve`); this path reads \
             text only",
        ));
    }
    if request.think_mode == ThinkMode::Always && !family.thinks() {
        errors.push(FieldError::unanswerable(
            FieldPath::root().key("think_mode"),
            "not_supported",
            format!(
                "this model is a {family} model, which does not think: think_mode \"always\" needs a v1.1 \
                 AutoThink model (use \"auto\" or \"never\")"
            ),
        ));
    }
    if errors.is_empty() {
        Ok(())
    } else {
        Err(crate::error::FieldErrors(errors).into())
    }
}

/// Renders every question of a request (no model needed).
pub fn render_request(
    request: &DecisionRequest,
    config: &DecisionConfig,
) -> Result<Vec<RenderedQuestion>, DecisionError> {
    render_questions(request, config, None)
}

/// [`render_request`] for a request whose images take `image_tokens` pad tokens each (in order, one
/// per image: [`crate::image_input::DecodedImage::tokens`]), placed in the evidence by spec §3's rules.
pub fn render_request_with_images(
    request: &DecisionRequest,
    config: &DecisionConfig,
    image_tokens: &[usize],
) -> Result<Vec<RenderedQuestion>, DecisionError> {
    check_image_count(request, image_tokens)?;
    render_questions(request, config, Some(image_tokens))
}

/// One pad-token count per image of the request (the caller's decoding of them).
fn check_image_count(
    request: &DecisionRequest,
    image_tokens: &[usize],
) -> Result<(), DecisionError> {
    if image_tokens.len() != request.images.len() {
        return Err(DecisionError::ModelOutput(format!(
            "{} image token counts for {} images",
            image_tokens.len(),
            request.images.len()
        )));
    }
    Ok(())
}

fn render_questions(
    request: &DecisionRequest,
    config: &DecisionConfig,
    image_tokens: Option<&[usize]>,
) -> Result<Vec<RenderedQuestion>, DecisionError> {
    config.validate()?;
    check_supported(request, config.family, image_tokens.is_some())?;
    let state = evidence(&request.state, image_tokens.unwrap_or_default())?;
    Ok(request
        .questions
        .iter()
        .enumerate()
        .map(|(index, question)| {
            let task = Task::new(index, question, request, config);
            let mode = match &task.wide {
                None => ReadMode::SelfAnswered,
                Some(wide) if wide.groups().len() == 1 => ReadMode::Single,
                Some(_) => ReadMode::Wide,
            };
            RenderedQuestion {
                name: question.name.clone(),
                kind: question.kind,
                mode,
                prompts: task.prompts(question, &state),
            }
        })
        .collect())
}

/// One question in flight.
struct Task {
    /// Index of the question in the request.
    question: usize,
    /// The option lines and ids in letter order; the none option last when it is read.
    labels: Vec<String>,
    ids: Vec<String>,
    /// Whether the last letter is the none option.
    none: bool,
    /// Instant: every prompt read in both orders.
    both_orders: bool,
    temperature: f64,
    /// `None` for a self-answered question.
    wide: Option<WideChoice>,
    /// The answer's probabilities (per letter), once known.
    probabilities: Option<Vec<f64>>,
    prompts_read: usize,
    think: Think,
    first: Option<Vec<f64>>,
    after: Option<Vec<f64>>,
    thought: Option<ThoughtSummary>,
    /// When the first read-out came back.
    read_at: Option<Instant>,
}

/// Where a question stands with thinking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Think {
    /// It will not think.
    No,
    /// It may think, after its first read-out.
    Maybe,
    /// It thinks: its thought is to be handed out.
    Wanted,
    /// Its thought is being decoded.
    Asked,
    /// It thought.
    Done,
}

struct ThoughtSummary {
    text: String,
    tokens: u64,
    stop: StopReason,
    ms: f64,
}

impl Task {
    fn new(
        index: usize,
        question: &Question,
        request: &DecisionRequest,
        config: &DecisionConfig,
    ) -> Self {
        let family = config.family;
        let none =
            family.has_none_option() && request.none_check && question.kind == QuestionType::Choice;
        let mut labels = option_labels(question);
        let mut ids: Vec<String> = question.options.iter().map(|o| o.id.clone()).collect();
        if none {
            labels.push(config.none_option.text.clone());
            ids.push(NONE_OPTION_ID.to_string());
        }
        let n = labels.len();
        let self_answered = n == 1;
        let wide = (!self_answered).then(|| WideChoice::new(n, &config.wide_choice));
        let single = wide.as_ref().is_some_and(|w| w.groups().len() == 1);
        let think = if family.thinks()
            && single
            && request.think_mode != ThinkMode::Never
            && request.think_budget > 0
        {
            Think::Maybe
        } else {
            Think::No
        };
        Task {
            question: index,
            labels,
            ids,
            none,
            both_orders: family == Family::Instant,
            temperature: config.temperature(question.kind),
            wide,
            probabilities: self_answered.then(|| vec![1.0]),
            prompts_read: 0,
            think,
            first: self_answered.then(|| vec![1.0]),
            after: None,
            thought: None,
            read_at: None,
        }
    }

    /// Whether the task waits for letter read-outs.
    fn reading(&self) -> bool {
        self.wide.is_some()
            && self.probabilities.is_none()
            && matches!(self.think, Think::No | Think::Maybe)
            && self.first.is_none()
    }

    /// The letters at `indices` in that order as a prompt.
    fn render(&self, question: &Question, state: &Evidence, indices: &[usize]) -> LetterPrompt {
        let shown: Vec<&str> = indices.iter().map(|&i| self.labels[i].as_str()).collect();
        LetterPrompt {
            system: SYSTEM_PROMPT.to_string(),
            user: user_text(&state.text, &question.instructions, &shown),
            option_ids: indices.iter().map(|&i| self.ids[i].clone()).collect(),
            images: state.user_slots(),
        }
    }

    /// A group's letters reversed, the none option kept last.
    fn reversed(&self, group: &[usize]) -> Vec<usize> {
        let none = self.none.then(|| self.labels.len() - 1);
        let mut order: Vec<usize> = group
            .iter()
            .rev()
            .copied()
            .filter(|&i| Some(i) != none)
            .collect();
        if let Some(none) = none.filter(|n| group.contains(n)) {
            order.push(none);
        }
        order
    }

    fn prompts(&self, question: &Question, state: &Evidence) -> Vec<LetterPrompt> {
        if !self.reading() {
            return Vec::new();
        }
        let Some(wide) = &self.wide else {
            return Vec::new();
        };
        let mut prompts = Vec::new();
        for group in wide.groups() {
            prompts.push(self.render(question, state, group));
            if self.both_orders {
                prompts.push(self.render(question, state, &self.reversed(group)));
            }
        }
        prompts
    }

    /// Letter-order read-outs of the current round's prompts → one probability vector per group (Instant:
    /// the two orders averaged per option).
    fn per_group(&self, read_outs: Vec<Vec<f64>>) -> Vec<Vec<f64>> {
        if !self.both_orders {
            return read_outs;
        }
        let groups = self.wide.as_ref().map(|w| w.groups()).unwrap_or_default();
        groups
            .iter()
            .zip(read_outs.chunks(2))
            .map(|(group, pair)| {
                let reversed = self.reversed(group);
                group
                    .iter()
                    .enumerate()
                    .map(|(j, option)| {
                        let r = reversed.iter().position(|o| o == option).unwrap_or(j);
                        let backward = pair.get(1).and_then(|p| p.get(r)).copied();
                        let forward = pair[0][j];
                        backward.map_or(forward, |b| (forward + b) / 2.0)
                    })
                    .collect()
            })
            .collect()
    }

    /// The read-out of the whole question is in: think, or answer.
    fn read_done(&mut self, probabilities: Vec<f64>, request: &DecisionRequest) {
        self.read_at = Some(Instant::now());
        if self.think == Think::Maybe {
            let top = probabilities.iter().copied().fold(0.0, f64::max);
            if request.think_mode == ThinkMode::Always || top < request.gate {
                self.think = Think::Wanted;
                self.first = Some(probabilities);
                return;
            }
            self.think = Think::No;
        }
        self.first = Some(probabilities.clone());
        self.probabilities = Some(probabilities);
    }
}

/// Identifies a thought handed out by [`DecisionTask::next_thoughts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ThoughtId(usize);

impl ThoughtId {
    pub(crate) fn new(index: usize) -> Self {
        ThoughtId(index)
    }
}

/// The decision procedure for one request as a resumable task: it says which prompts it needs read
/// ([`DecisionTask::next_prompts`]) and which thoughts decoded ([`DecisionTask::next_thoughts`]), takes
/// the results back ([`DecisionTask::feed`], [`DecisionTask::feed_thought`]) and, when nothing is left,
/// gives the response ([`DecisionTask::finish`]).
///
/// It never calls a model itself, so whoever drives it decides how prompts are computed: [`decide`]
/// reads them with a [`LetterModel`] one step at a time; the engine (`crate::engine`) packs the ready
/// prompts and thought steps of many requests into shared forward passes. The answers depend only on
/// the logits and thoughts fed back, so both give the same response for the same model outputs.
pub struct DecisionTask {
    request: DecisionRequest,
    config: DecisionConfig,
    state: Evidence,
    tasks: Vec<Task>,
    usage: Usage,
    /// Per prompt handed out by the last `next_prompts` and not yet fed back: the task it belongs to.
    pending: Vec<usize>,
    started: Instant,
    first_pass: Option<Instant>,
}

impl DecisionTask {
    /// Validates what this engine and model support and renders the first prompts. Fails with the same
    /// errors [`decide`] gives (422 for what the model cannot answer).
    pub fn new(request: DecisionRequest, config: &DecisionConfig) -> Result<Self, DecisionError> {
        Self::build(request, config, None)
    }

    /// [`Self::new`] for a request whose images were decoded for a vision model: `image_tokens` are
    /// their pad-token counts in order (one per image of the request). The images are placed in the
    /// evidence by spec §3's rules ([`crate::render::evidence`]; marks that do not match the images are
    /// a 422 naming `state`).
    pub fn with_images(
        request: DecisionRequest,
        config: &DecisionConfig,
        image_tokens: &[usize],
    ) -> Result<Self, DecisionError> {
        check_image_count(&request, image_tokens)?;
        Self::build(request, config, Some(image_tokens))
    }

    fn build(
        request: DecisionRequest,
        config: &DecisionConfig,
        image_tokens: Option<&[usize]>,
    ) -> Result<Self, DecisionError> {
        let started = Instant::now();
        config.validate()?;
        check_supported(&request, config.family, image_tokens.is_some())?;
        let state = evidence(&request.state, image_tokens.unwrap_or_default())?;
        let tasks = request
            .questions
            .iter()
            .enumerate()
            .map(|(i, q)| Task::new(i, q, &request, config))
            .collect();
        Ok(DecisionTask {
            request,
            config: config.clone(),
            state,
            tasks,
            usage: Usage::default(),
            pending: Vec::new(),
            started,
            first_pass: None,
        })
    }

    /// The request this task answers.
    pub fn request(&self) -> &DecisionRequest {
        &self.request
    }

    /// The evidence every prompt of this task shows, with its images' places.
    pub fn evidence(&self) -> &Evidence {
        &self.state
    }

    /// Records when the first model work for this request started (the end of its queueing; the
    /// answers' `timings.queue_ms`). Later calls are ignored.
    pub fn mark_first_pass(&mut self, at: Instant) {
        self.first_pass.get_or_insert(at);
    }

    /// Every prompt that is ready now (all questions' prompts first, then each further wide-choice
    /// round), in a fixed order. Empty when nothing is to be read now. The prompts stay pending until
    /// [`Self::feed`] gets their logits; asking again before that returns the same prompts.
    pub fn next_prompts(&mut self) -> Vec<LetterPrompt> {
        let mut prompts = Vec::new();
        let mut owners = Vec::new();
        for (t, task) in self.tasks.iter().enumerate() {
            for prompt in task.prompts(&self.request.questions[task.question], &self.state) {
                prompts.push(prompt);
                owners.push(t);
            }
        }
        self.pending = owners;
        prompts
    }

    /// The thoughts to decode now (questions whose first read-out says to think), each handed out once.
    pub fn next_thoughts(&mut self) -> Vec<(ThoughtId, ThoughtRequest)> {
        let mut thoughts = Vec::new();
        for t in 0..self.tasks.len() {
            if self.tasks[t].think != Think::Wanted {
                continue;
            }
            self.tasks[t].think = Think::Asked;
            let task = &self.tasks[t];
            let question = &self.request.questions[task.question];
            let all: Vec<usize> = (0..task.labels.len()).collect();
            thoughts.push((
                ThoughtId(t),
                ThoughtRequest {
                    question: question.name.clone(),
                    prompt: task.render(question, &self.state, &all),
                    budget: self.request.think_budget as usize,
                    seed: self
                        .request
                        .seed
                        .map(|seed| seed_from_request(seed, &question.name)),
                    sampling: self.config.thought_sampling.clone(),
                    loop_detector: self.config.loop_detector.clone(),
                },
            ));
        }
        thoughts
    }

    /// True when every question has its probabilities.
    pub fn is_done(&self) -> bool {
        self.tasks.iter().all(|t| t.probabilities.is_some())
    }

    /// The read-outs of the prompts last returned by [`Self::next_prompts`], in their order.
    pub fn feed(&mut self, read: LetterLogits) -> Result<(), DecisionError> {
        let owners = std::mem::take(&mut self.pending);
        if read.logits.len() != owners.len() {
            return Err(DecisionError::ModelOutput(format!(
                "{} read-outs for {} prompts",
                read.logits.len(),
                owners.len()
            )));
        }
        self.usage.input_tokens += read.input_tokens;
        self.usage.output_tokens += read.output_tokens;

        let mut per_task: Vec<Vec<Vec<f64>>> = vec![Vec::new(); self.tasks.len()];
        // The expected letter count of each prompt: its group's size in the current round.
        let mut seen = vec![0usize; self.tasks.len()];
        for (index, (logits, &t)) in read.logits.iter().zip(&owners).enumerate() {
            let task = &self.tasks[t];
            let question = &self.request.questions[task.question];
            let group = if task.both_orders {
                seen[t] / 2
            } else {
                seen[t]
            };
            let expected = task
                .wide
                .as_ref()
                .and_then(|w| w.groups().get(group))
                .map(Vec::len)
                .unwrap_or(0);
            seen[t] += 1;
            if logits.len() != expected {
                return Err(DecisionError::ModelOutput(format!(
                    "question {:?}: expected {expected} letter logits, got {logits:?}",
                    question.name
                )));
            }
            if logits.iter().any(|l| !l.is_finite()) {
                return Err(DecisionError::NonFiniteLogits {
                    question: question.name.clone(),
                    prompt: index,
                    logits: logits.clone(),
                });
            }
            per_task[t].push(softmax(logits, task.temperature));
        }
        for (task, read_outs) in self.tasks.iter_mut().zip(per_task) {
            if read_outs.is_empty() {
                continue;
            }
            task.prompts_read += read_outs.len();
            let per_group = task.per_group(read_outs);
            let Some(wide) = task.wide.as_mut() else {
                continue;
            };
            let name = &self.request.questions[task.question].name;
            if let Some(final_probabilities) = wide
                .feed(&per_group)
                .map_err(|e| DecisionError::ModelOutput(format!("question {name:?}: {e}")))?
            {
                task.read_done(final_probabilities, &self.request);
            }
        }
        Ok(())
    }

    /// A thought handed out by [`Self::next_thoughts`] is decoded: mixes the read-out after it with the
    /// first (`mix · p_after + (1 − mix) · p_first`).
    pub fn feed_thought(
        &mut self,
        id: ThoughtId,
        outcome: ThoughtOutcome,
    ) -> Result<(), DecisionError> {
        let mix = self.request.mix;
        let Some(task) = self.tasks.get_mut(id.0).filter(|t| t.think == Think::Asked) else {
            return Err(DecisionError::ModelOutput(format!(
                "a thought for question #{} that was not asked for",
                id.0
            )));
        };
        let name = &self.request.questions[task.question].name;
        if outcome.logits.len() != task.labels.len() {
            return Err(DecisionError::ModelOutput(format!(
                "question {name:?}: expected {} letter logits after the thought, got {:?}",
                task.labels.len(),
                outcome.logits
            )));
        }
        if outcome.logits.iter().any(|l| !l.is_finite()) {
            return Err(DecisionError::NonFiniteLogits {
                question: name.clone(),
                prompt: 0,
                logits: outcome.logits,
            });
        }
        let after = softmax(&outcome.logits, task.temperature);
        let first = task.first.clone().unwrap_or_default();
        let mixed = after
            .iter()
            .zip(&first)
            .map(|(a, f)| mix * a + (1.0 - mix) * f)
            .collect();
        self.usage.input_tokens += outcome.input_tokens;
        self.usage.output_tokens += outcome.tokens.len() as u64;
        task.prompts_read += 1;
        task.after = Some(after);
        task.probabilities = Some(mixed);
        task.think = Think::Done;
        task.thought = Some(ThoughtSummary {
            text: outcome.text,
            tokens: outcome.tokens.len() as u64,
            stop: outcome.stop,
            ms: outcome.ms,
        });
        Ok(())
    }

    /// A model error for the prompts or thoughts last handed out: a prompt the model cannot take becomes
    /// a 422 naming its question, a model that cannot think a 422 naming `think_mode`; anything else is
    /// internal.
    pub fn model_error(&self, error: ModelError) -> DecisionError {
        match error {
            ModelError::PromptTooLong {
                prompt,
                tokens,
                limit,
            } => match self.pending.get(prompt) {
                Some(&t) => prompt_too_long(
                    &self.request.questions[self.tasks[t].question].name,
                    tokens,
                    limit,
                ),
                None => DecisionError::Model(ModelError::PromptTooLong {
                    prompt,
                    tokens,
                    limit,
                }),
            },
            ModelError::CannotThink => FieldError::unanswerable(
                FieldPath::root().key("think_mode"),
                "not_supported",
                "this model cannot decode thoughts (its chat template has no thinking mode): use \
                 think_mode \"never\"",
            )
            .into(),
            other => DecisionError::Model(other),
        }
    }

    /// The response (answers in the request's question order). `latency_ms` is the time since the task
    /// was made.
    pub fn finish(self, model_name: &str) -> DecisionResponse {
        let now = Instant::now();
        let first_pass = self.first_pass.unwrap_or(self.started);
        let ms =
            |from: Instant, to: Instant| to.saturating_duration_since(from).as_secs_f64() * 1e3;
        let return_details = self.request.return_details;
        let return_thought = self.request.return_thought;
        let answers = self
            .tasks
            .iter()
            .map(|task| {
                let question = &self.request.questions[task.question];
                let timings = AnswerTimings {
                    queue_ms: ms(self.started, first_pass),
                    read_ms: task.read_at.map_or(0.0, |at| ms(first_pass, at)),
                    thought_ms: task.thought.as_ref().map_or(0.0, |t| t.ms),
                    total_ms: ms(self.started, now),
                };
                (
                    question.name.clone(),
                    answer(
                        task,
                        question,
                        &self.request,
                        timings,
                        return_details,
                        return_thought,
                    ),
                )
            })
            .collect();
        DecisionResponse {
            answers: OrderedMap(answers),
            usage: self.usage,
            model: model_name.to_string(),
            latency_ms: ms(self.started, now),
        }
    }
}

/// The 422 for a question whose prompt is longer than the server takes.
pub fn prompt_too_long(question: &str, tokens: usize, limit: usize) -> DecisionError {
    FieldError::unanswerable(
        FieldPath::root().key("questions").key(question),
        "prompt_too_long",
        format!("the prompt has {tokens} tokens, more than this server's limit of {limit}"),
    )
    .into()
}

/// Answers a request with `model`: a [`DecisionTask`] driven one model call per step (all questions'
/// prompts in one call, so the model can share their evidence prefix, then one call per further
/// wide-choice round, then the thoughts in one [`LetterModel::think`] call).
pub fn decide(
    request: &DecisionRequest,
    config: &DecisionConfig,
    model: &mut dyn LetterModel,
) -> Result<DecisionResponse, DecisionError> {
    let mut task = DecisionTask::new(request.clone(), config)?;
    task.mark_first_pass(Instant::now());
    loop {
        let prompts = task.next_prompts();
        if !prompts.is_empty() {
            let read = model
                .letter_logits(&prompts)
                .map_err(|error| task.model_error(error))?;
            task.feed(read)?;
            continue;
        }
        let thoughts = task.next_thoughts();
        if thoughts.is_empty() {
            break;
        }
        let requests: Vec<ThoughtRequest> = thoughts.iter().map(|(_, r)| r.clone()).collect();
        let outcomes = model
            .think(&requests)
            .map_err(|error| task.model_error(error))?;
        if outcomes.len() != thoughts.len() {
            return Err(DecisionError::ModelOutput(format!(
                "{} thoughts for {} asked",
                outcomes.len(),
                thoughts.len()
            )));
        }
        for ((id, _), outcome) in thoughts.into_iter().zip(outcomes) {
            task.feed_thought(id, outcome)?;
        }
    }
    Ok(task.finish(model.model_name()))
}

/// Per listed option, its probability; and the none option's, when it was read.
fn split_none(task: &Task, probabilities: &[f64]) -> (Vec<f64>, Option<f64>) {
    if task.none {
        let n = probabilities.len().saturating_sub(1);
        (probabilities[..n].to_vec(), probabilities.get(n).copied())
    } else {
        (probabilities.to_vec(), None)
    }
}

fn answer(
    task: &Task,
    question: &Question,
    request: &DecisionRequest,
    timings: AnswerTimings,
    return_details: bool,
    return_thought: bool,
) -> Answer {
    let probabilities = task.probabilities.clone().unwrap_or_default();
    let by_id = |p: &[f64]| -> OrderedMap<f64> {
        OrderedMap(
            question
                .options
                .iter()
                .zip(p)
                .map(|(o, &p)| (o.id.clone(), p))
                .collect(),
        )
    };
    let (listed, none_probability) = split_none(task, &probabilities);
    let details = return_details.then(|| {
        let (first, first_none) = split_none(task, task.first.as_deref().unwrap_or_default());
        let after = task.after.as_deref().map(|a| split_none(task, a));
        AnswerDetails {
            first: by_id(&first),
            first_none,
            after_thought: after.as_ref().map(|(a, _)| by_id(a)),
            after_thought_none: after.and_then(|(_, n)| n),
            thought_tokens: task.thought.as_ref().map(|t| t.tokens),
            stop_reason: task.thought.as_ref().map(|t| t.stop),
            prompts: task.prompts_read,
            timings,
        }
    });
    let thought = if return_thought {
        task.thought.as_ref().map(|t| t.text.clone())
    } else {
        None
    };
    match question.kind {
        QuestionType::Choice => {
            let best = argmax(&listed);
            let letters = probabilities.len().max(1) as f64;
            let (choice, p_chosen) = match none_probability {
                Some(none) if request.allow_none && listed.iter().all(|&p| none > p) => {
                    (None, none)
                }
                _ => (
                    question.options.get(best).map(|o| o.id.clone()),
                    listed.get(best).copied().unwrap_or(1.0),
                ),
            };
            let confidence = if none_probability.is_some() {
                ((p_chosen - 1.0 / letters) / (1.0 - 1.0 / letters)).max(0.0)
            } else {
                choice_confidence(&listed)
            };
            Answer::Choice(ChoiceAnswer {
                choice,
                confidence,
                probabilities: by_id(&listed),
                none_probability,
                thought,
                details,
            })
        }
        // Options are [true, false]: P(yes) is the first.
        QuestionType::Noul => Answer::Noul(NoulAnswer {
            noul: listed.first().copied().unwrap_or(0.0),
            thought,
            details,
        }),
        QuestionType::Score => Answer::Score(ScoreAnswer {
            score: expected_score(&listed),
            confidence: score_confidence(&listed),
            legend: OrderedMap(
                question
                    .options
                    .iter()
                    .map(|o| {
                        (
                            o.id.clone(),
                            o.description
                                .clone()
                                .unwrap_or(crate::pyjson::PyValue::Null),
                        )
                    })
                    .collect(),
            ),
            probabilities: by_id(&listed),
            thought,
            details,
        }),
    }
}
