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
use crate::model::{LetterModel, LetterPrompt};
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
        .map(|question| {
            let task = Task::new(question, config);
            let mode = match &task.wide {
                None => ReadMode::SelfAnswered,
                Some(wide) if wide.groups().len() == 1 => ReadMode::Single,
                Some(_) => ReadMode::Wide,
            };
            RenderedQuestion {
                name: question.name.clone(),
                kind: question.kind,
                mode,
                prompts: task.prompts(&state),
            }
        })
        .collect())
}

/// One question in flight.
struct Task<'a> {
    question: &'a Question,
    labels: Vec<String>,
    temperature: f64,
    /// `None` for a self-answered question.
    wide: Option<WideChoice>,
    probabilities: Option<Vec<f64>>,
    prompts_read: usize,
}

impl<'a> Task<'a> {
    fn new(question: &'a Question, config: &DecisionConfig) -> Self {
        let n = question.options.len();
        let self_answered = question.kind == QuestionType::Choice && n == 1;
        Task {
            question,
            labels: option_labels(question),
            temperature: config.temperature(question.kind),
            wide: (!self_answered).then(|| WideChoice::new(n, &config.wide_choice)),
            probabilities: self_answered.then(|| vec![1.0]),
            prompts_read: 0,
        }
    }

    fn prompts(&self, state: &str) -> Vec<LetterPrompt> {
        match (&self.wide, &self.probabilities) {
            (Some(wide), None) => wide
                .groups()
                .iter()
                .map(|group| render_options(state, self.question, &self.labels, group))
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// Answers a request with `model`.
pub fn decide(
    request: &DecisionRequest,
    config: &DecisionConfig,
    model: &mut dyn LetterModel,
) -> Result<DecisionResponse, DecisionError> {
    let start = Instant::now();
    config.validate()?;
    check_supported(request, true)?;
    let state = state_text(&request.state);
    let mut tasks: Vec<Task> = request
        .questions
        .iter()
        .map(|q| Task::new(q, config))
        .collect();
    let mut usage = Usage::default();

    // One model call per step: all questions' prompts first, then each further wide-choice round.
    loop {
        let mut prompts = Vec::new();
        let mut owners = Vec::new();
        for (t, task) in tasks.iter().enumerate() {
            for prompt in task.prompts(&state) {
                prompts.push(prompt);
                owners.push(t);
            }
        }
        if prompts.is_empty() {
            break;
        }
        let read = model
            .letter_logits(&prompts)
            .map_err(|error| model_error(error, &owners, &tasks))?;
        if read.logits.len() != prompts.len() {
            return Err(DecisionError::ModelOutput(format!(
                "{} read-outs for {} prompts",
                read.logits.len(),
                prompts.len()
            )));
        }
        usage.input_tokens += read.input_tokens;
        usage.output_tokens += read.output_tokens;

        let mut per_task: Vec<Vec<Vec<f64>>> = vec![Vec::new(); tasks.len()];
        for (index, ((prompt, logits), &t)) in
            prompts.iter().zip(&read.logits).zip(&owners).enumerate()
        {
            let task = &tasks[t];
            if logits.len() != prompt.option_ids.len() {
                return Err(DecisionError::ModelOutput(format!(
                    "question {:?}: expected {} letter logits, got {:?}",
                    task.question.name,
                    prompt.option_ids.len(),
                    logits
                )));
            }
            if logits.iter().any(|l| !l.is_finite()) {
                return Err(DecisionError::NonFiniteLogits {
                    question: task.question.name.clone(),
                    prompt: index,
                    logits: logits.clone(),
                });
            }
            per_task[t].push(softmax(logits, task.temperature));
        }
        for (task, read_outs) in tasks.iter_mut().zip(per_task) {
            if read_outs.is_empty() {
                continue;
            }
            task.prompts_read += read_outs.len();
            let Some(wide) = task.wide.as_mut() else {
                continue;
            };
            let name = &task.question.name;
            if let Some(final_probabilities) = wide
                .feed(&read_outs)
                .map_err(|e| DecisionError::ModelOutput(format!("question {name:?}: {e}")))?
            {
                task.probabilities = Some(final_probabilities);
            }
        }
    }

    let answers = tasks
        .iter()
        .map(|task| {
            let probabilities = task.probabilities.clone().unwrap_or_default();
            (
                task.question.name.clone(),
                answer(task, &probabilities, request.return_details),
            )
        })
        .collect();
    Ok(DecisionResponse {
        answers: OrderedMap(answers),
        usage,
        model: model.model_name().to_string(),
        latency_ms: start.elapsed().as_secs_f64() * 1e3,
    })
}

/// A prompt the model cannot take becomes a 422 naming its question; anything else is internal.
fn model_error(error: ModelError, owners: &[usize], tasks: &[Task]) -> DecisionError {
    if let ModelError::PromptTooLong {
        prompt,
        tokens,
        limit,
    } = error
    {
        if let Some(&t) = owners.get(prompt) {
            return FieldError::unanswerable(
                FieldPath::root()
                    .key("questions")
                    .key(&tasks[t].question.name),
                "prompt_too_long",
                format!("the prompt has {tokens} tokens, more than this server's limit of {limit}"),
            )
            .into();
        }
    }
    DecisionError::Model(error)
}

fn answer(task: &Task, probabilities: &[f64], return_details: bool) -> Answer {
    let question = task.question;
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
