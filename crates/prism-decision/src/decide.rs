//! The v1 decision procedure: render every question, read the letters through a [`LetterModel`], turn the
//! read-outs into answers.
//!
//! v1 semantics: one read-out per question. A choice with one option answers itself (probability 1,
//! no prompt); a choice with more than 26 options is read in wide-choice rounds. Not implemented yet, and
//! refused or ignored openly rather than faked:
//! - AutoThink: `think_mode: "always"` is refused (422); `auto` and `never` give the single read-out (a v1
//!   model never thinks), and `gate`, `mix`, `think_budget`, `return_thought` have no effect;
//! - the none option (v1.1): `none_check` and `allow_none` are accepted and have no effect; answers carry
//!   no `none_probability`;
//! - images: any image is refused (422) as the engine has no vision tower yet.

use std::time::Instant;

use crate::config::DecisionConfig;
use crate::error::{DecisionError, FieldError, FieldPath, ModelError};
use crate::model::{LetterLogits, LetterModel, LetterPrompt};
use crate::readout::{
    argmax, choice_confidence, expected_score, score_confidence, softmax, WideChoice,
};
use crate::render::{option_labels, render_options, state_text};
use crate::request::{DecisionRequest, Question, QuestionType, ThinkMode};
use crate::response::{
    Answer, AnswerDetails, ChoiceAnswer, DecisionResponse, NoulAnswer, OrderedMap, ScoreAnswer,
    Usage,
};

/// How a question is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadMode {
    /// A choice with a single option: probability 1, no prompt.
    SelfAnswered,
    /// One prompt (2 to 26 options).
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
    /// read-outs), or nothing (SelfAnswered).
    pub prompts: Vec<LetterPrompt>,
}

/// Refuses what this engine cannot do yet (422), naming the field.
fn check_supported(request: &DecisionRequest, reading: bool) -> Result<(), DecisionError> {
    let mut errors = Vec::new();
    if !request.images.is_empty() {
        errors.push(FieldError::unanswerable(
            FieldPath::root().key("images"),
            "not_supported",
            "images need a vision model (an mmproj file); this engine has no vision support yet",
        ));
    }
    if reading && request.think_mode == ThinkMode::Always {
        errors.push(FieldError::unanswerable(
            FieldPath::root().key("think_mode"),
            "not_supported",
            "thinking (AutoThink) is not implemented in this engine yet: use think_mode \"auto\" or \"never\" \
             (one read-out per question)",
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
    config.validate()?;
    check_supported(request, false)?;
    let state = state_text(&request.state);
    Ok(request
        .questions
        .iter()
        .enumerate()
        .map(|(index, question)| {
            let task = Task::new(index, question, config);
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
    labels: Vec<String>,
    temperature: f64,
    /// `None` for a self-answered question.
    wide: Option<WideChoice>,
    probabilities: Option<Vec<f64>>,
    prompts_read: usize,
}

impl Task {
    fn new(index: usize, question: &Question, config: &DecisionConfig) -> Self {
        let n = question.options.len();
        let self_answered = question.kind == QuestionType::Choice && n == 1;
        Task {
            question: index,
            labels: option_labels(question),
            temperature: config.temperature(question.kind),
            wide: (!self_answered).then(|| WideChoice::new(n, &config.wide_choice)),
            probabilities: self_answered.then(|| vec![1.0]),
            prompts_read: 0,
        }
    }

    fn prompts(&self, question: &Question, state: &str) -> Vec<LetterPrompt> {
        match (&self.wide, &self.probabilities) {
            (Some(wide), None) => wide
                .groups()
                .iter()
                .map(|group| render_options(state, question, &self.labels, group))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// The decision procedure for one request as a resumable task: it says which prompts it needs read
/// ([`DecisionTask::next_prompts`]), takes their letter logits back ([`DecisionTask::feed`]) and, when
/// nothing is left to read, gives the response ([`DecisionTask::finish`]).
///
/// It never calls a model itself, so whoever drives it decides how prompts are computed: [`decide`]
/// reads them with a [`LetterModel`] one step at a time; the engine (`crate::engine`) packs the ready
/// prompts of many requests into shared forward passes. The answers depend only on the logits fed
/// back, so both give the same response for the same logits.
pub struct DecisionTask {
    request: DecisionRequest,
    state: String,
    tasks: Vec<Task>,
    usage: Usage,
    /// Per prompt handed out by the last `next_prompts` and not yet fed back: the task it belongs to.
    pending: Vec<usize>,
    started: Instant,
}

impl DecisionTask {
    /// Validates what this engine supports and renders the first prompts. Fails with the same errors
    /// [`decide`] gives (422 for what the engine cannot answer).
    pub fn new(request: DecisionRequest, config: &DecisionConfig) -> Result<Self, DecisionError> {
        let started = Instant::now();
        config.validate()?;
        check_supported(&request, true)?;
        let state = state_text(&request.state);
        let tasks = request
            .questions
            .iter()
            .enumerate()
            .map(|(i, q)| Task::new(i, q, config))
            .collect();
        Ok(DecisionTask {
            request,
            state,
            tasks,
            usage: Usage::default(),
            pending: Vec::new(),
            started,
        })
    }

    /// The request this task answers.
    pub fn request(&self) -> &DecisionRequest {
        &self.request
    }

    /// Every prompt that is ready now (all questions' prompts first, then each further wide-choice
    /// round), in a fixed order. Empty when the task is done. The prompts stay pending until
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
            let expected = task
                .wide
                .as_ref()
                .and_then(|w| w.groups().get(seen[t]))
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
            let Some(wide) = task.wide.as_mut() else {
                continue;
            };
            let name = &self.request.questions[task.question].name;
            if let Some(final_probabilities) = wide
                .feed(&read_outs)
                .map_err(|e| DecisionError::ModelOutput(format!("question {name:?}: {e}")))?
            {
                task.probabilities = Some(final_probabilities);
            }
        }
        Ok(())
    }

    /// A model error for the prompts last handed out: a prompt the model cannot take becomes a 422
    /// naming its question; anything else is internal.
    pub fn model_error(&self, error: ModelError) -> DecisionError {
        if let ModelError::PromptTooLong {
            prompt,
            tokens,
            limit,
        } = error
        {
            if let Some(&t) = self.pending.get(prompt) {
                return prompt_too_long(
                    &self.request.questions[self.tasks[t].question].name,
                    tokens,
                    limit,
                );
            }
        }
        DecisionError::Model(error)
    }

    /// The response (answers in the request's question order). `latency_ms` is the time since the task
    /// was made.
    pub fn finish(self, model_name: &str) -> DecisionResponse {
        let return_details = self.request.return_details;
        let answers = self
            .tasks
            .iter()
            .map(|task| {
                let question = &self.request.questions[task.question];
                let probabilities = task.probabilities.clone().unwrap_or_default();
                (
                    question.name.clone(),
                    answer(task, question, &probabilities, return_details),
                )
            })
            .collect();
        DecisionResponse {
            answers: OrderedMap(answers),
            usage: self.usage,
            model: model_name.to_string(),
            latency_ms: self.started.elapsed().as_secs_f64() * 1e3,
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
/// wide-choice round).
pub fn decide(
    request: &DecisionRequest,
    config: &DecisionConfig,
    model: &mut dyn LetterModel,
) -> Result<DecisionResponse, DecisionError> {
    let mut task = DecisionTask::new(request.clone(), config)?;
    loop {
        let prompts = task.next_prompts();
        if prompts.is_empty() {
            break;
        }
        let read = model
            .letter_logits(&prompts)
            .map_err(|error| task.model_error(error))?;
        task.feed(read)?;
    }
    Ok(task.finish(model.model_name()))
}

fn answer(task: &Task, question: &Question, probabilities: &[f64], return_details: bool) -> Answer {
    let by_id = || -> OrderedMap<f64> {
        OrderedMap(
            question
                .options
                .iter()
                .zip(probabilities)
                .map(|(o, &p)| (o.id.clone(), p))
                .collect(),
        )
    };
    let details = return_details.then(|| AnswerDetails {
        first: by_id(),
        prompts: task.prompts_read,
    });
    match question.kind {
        QuestionType::Choice => Answer::Choice(ChoiceAnswer {
            choice: question
                .options
                .get(argmax(probabilities))
                .map(|o| o.id.clone())
                .unwrap_or_default(),
            confidence: choice_confidence(probabilities),
            probabilities: by_id(),
            none_probability: None,
            details,
        }),
        // Options are [true, false]: P(yes) is the first.
        QuestionType::Noul => Answer::Noul(NoulAnswer {
            noul: probabilities.first().copied().unwrap_or(0.0),
            details,
        }),
        QuestionType::Score => Answer::Score(ScoreAnswer {
            score: expected_score(probabilities),
            confidence: score_confidence(probabilities),
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
            probabilities: by_id(),
            details,
        }),
    }
}
