//! Errors of the decision procedure and the API's error body.
//!
//! A request is refused with **400** when it is malformed (wrong types, missing or blank fields, bad
//! option ids) and with **422** when it is well-formed but the model cannot answer it (a score with more
//! than 10 levels, a prompt longer than the server's limit, images without a vision model, a feature this
//! engine does not have yet). Every field error names its place in the body, as TypeSafe's API does:
//! `loc = ["body", "questions", "team", "criteria"]`.

use std::fmt;

use serde::Serialize;

use crate::pyjson::JsonError;

/// One step of a field path: an object key or an array index.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum LocPart {
    Key(String),
    Index(usize),
}

/// A place in the request body, e.g. `questions.team.criteria` or `images[3]`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FieldPath(pub Vec<LocPart>);

impl FieldPath {
    pub fn root() -> Self {
        FieldPath(Vec::new())
    }

    /// This path extended by an object key.
    pub fn key(&self, key: &str) -> Self {
        let mut parts = self.0.clone();
        parts.push(LocPart::Key(key.to_string()));
        FieldPath(parts)
    }

    /// This path extended by an array index.
    pub fn index(&self, index: usize) -> Self {
        let mut parts = self.0.clone();
        parts.push(LocPart::Index(index));
        FieldPath(parts)
    }

    /// The path as TypeSafe's `loc`: `["body", ...]`.
    pub fn loc(&self) -> Vec<LocPart> {
        std::iter::once(LocPart::Key("body".to_string()))
            .chain(self.0.iter().cloned())
            .collect()
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("body");
        }
        for (i, part) in self.0.iter().enumerate() {
            match part {
                LocPart::Key(key) if i == 0 => write!(f, "{key}")?,
                LocPart::Key(key) => write!(f, ".{key}")?,
                LocPart::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// Whether a refused request is malformed (400) or beyond what the model can answer (422).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// 400: the body does not follow the API.
    Malformed,
    /// 422: a valid request that this model or engine cannot answer.
    Unanswerable,
    /// 400: a field's *data* cannot be read (an image that is not base64 or does not decode), as issue
    /// #22 asks for images.
    BadData,
}

impl ErrorClass {
    pub fn status(self) -> u16 {
        match self {
            // The reference API (and the TypeSafe SDK's `HTTPValidationError`) answers every
            // validation failure with 422; the class stays in the `type` of each detail.
            ErrorClass::Malformed => 422,
            ErrorClass::Unanswerable => 422,
            ErrorClass::BadData => 400,
        }
    }
}

/// One thing wrong with a request, at one place in its body.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    pub path: FieldPath,
    pub message: String,
    /// A machine-readable code for the `type` of the error body (`missing`, `type_error`, `value_error`,
    /// `too_many_levels`, `not_supported`, `prompt_too_long`, ...).
    pub code: &'static str,
    pub class: ErrorClass,
}

impl FieldError {
    pub fn malformed(path: FieldPath, code: &'static str, message: impl Into<String>) -> Self {
        FieldError {
            path,
            message: message.into(),
            code,
            class: ErrorClass::Malformed,
        }
    }

    pub fn unanswerable(path: FieldPath, code: &'static str, message: impl Into<String>) -> Self {
        FieldError {
            path,
            message: message.into(),
            code,
            class: ErrorClass::Unanswerable,
        }
    }

    /// A field whose data cannot be read (400; see [`ErrorClass::BadData`]).
    pub fn bad_data(path: FieldPath, code: &'static str, message: impl Into<String>) -> Self {
        FieldError {
            path,
            message: message.into(),
            code,
            class: ErrorClass::BadData,
        }
    }
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// Every field error found in one request (never empty when returned as an error).
#[derive(Debug, Clone, PartialEq)]
pub struct FieldErrors(pub Vec<FieldError>);

impl FieldErrors {
    /// Malformed if anything is (422, as the reference API), else bad data if any (400), else
    /// unanswerable (422).
    pub fn class(&self) -> ErrorClass {
        if self.0.iter().any(|e| e.class == ErrorClass::Malformed) {
            ErrorClass::Malformed
        } else if self.0.iter().any(|e| e.class == ErrorClass::BadData) {
            ErrorClass::BadData
        } else {
            ErrorClass::Unanswerable
        }
    }
}

impl fmt::Display for FieldErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The first error of the deciding class leads: a 400 names a malformed field first.
        let class = self.class();
        let lead = self.0.iter().find(|e| e.class == class).or(self.0.first());
        match lead {
            Some(first) => write!(f, "{first}")?,
            None => write!(f, "invalid request")?,
        }
        if self.0.len() > 1 {
            write!(f, " (and {} more)", self.0.len() - 1)?;
        }
        Ok(())
    }
}

/// What the model side can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ModelError {
    /// A prompt is longer than the engine accepts (`--max-tokens`): the request gets a 422.
    #[error("prompt {prompt} has {tokens} tokens, more than the limit of {limit}")]
    PromptTooLong {
        prompt: usize,
        tokens: usize,
        limit: usize,
    },
    /// The device had no memory for the pass (HTTP 503: the server keeps serving; a smaller request or a
    /// later retry may fit).
    #[error("the GPU has no memory left for this request: {0}")]
    OutOfMemory(String),
    /// The model cannot decode thoughts (its chat template has no thinking mode, or the model is a
    /// read-out only [`crate::model::LetterModel`]): a request that needs one gets a 422.
    #[error("this model cannot decode thoughts")]
    CannotThink,
    /// Anything else (device, kernel, tokenizer): an internal error.
    #[error("{0}")]
    Backend(String),
}

/// Why `decide` or the request parser failed.
#[derive(Debug, thiserror::Error)]
pub enum DecisionError {
    /// The body is not JSON, or holds a string that is not text (a lone surrogate escape) (422).
    #[error("{}", json_message(.0))]
    Json(#[from] JsonError),
    /// The request is malformed (400) or unanswerable (422); see [`FieldErrors::class`].
    #[error("{0}")]
    Request(FieldErrors),
    /// The model failed (500).
    #[error("the model failed: {0}")]
    Model(ModelError),
    /// The model answered something the read-out cannot use (wrong number of logits) (500).
    #[error("the model returned an unusable read-out: {0}")]
    ModelOutput(String),
    /// A prompt's letter logits hold a NaN or ±∞: the forward pass diverged for that prompt (500). On
    /// CUDA the integer path does not stop at the projection whose input went non-finite (that would
    /// cost a stream synchronization per matmul): it makes that sequence's rows NaN, which reach its
    /// logits and are refused here, naming the question. Other prompts of the batch are unaffected.
    /// (The CPU integer path fails earlier, at the projection, as [`DecisionError::Model`].)
    #[error(
        "question {question:?}: the model's letter logits for prompt {prompt} of this step are not finite \
         ({logits:?}): its forward pass diverged (NaN or infinity)"
    )]
    NonFiniteLogits {
        /// The question whose prompt diverged.
        question: String,
        /// The prompt's index in the model call that returned it.
        prompt: usize,
        /// The letter logits as returned.
        logits: Vec<f64>,
    },
    /// The decision config is unusable (500).
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

/// A JSON error as the API's message: the field first when it has one.
fn json_message(error: &JsonError) -> String {
    match &error.path {
        Some(path) => format!("{path}: {error}"),
        None => format!("the request body is not valid JSON: {error}"),
    }
}

impl From<FieldError> for DecisionError {
    fn from(error: FieldError) -> Self {
        DecisionError::Request(FieldErrors(vec![error]))
    }
}

impl From<FieldErrors> for DecisionError {
    fn from(errors: FieldErrors) -> Self {
        DecisionError::Request(errors)
    }
}

impl DecisionError {
    /// The HTTP status the API answers with.
    pub fn status(&self) -> u16 {
        match self {
            DecisionError::Json(_) => 422,
            DecisionError::Request(errors) => errors.class().status(),
            DecisionError::Model(ModelError::OutOfMemory(_)) => 503,
            DecisionError::Model(_)
            | DecisionError::ModelOutput(_)
            | DecisionError::NonFiniteLogits { .. }
            | DecisionError::Config(_) => 500,
        }
    }

    /// The field errors, when the request itself was refused.
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            DecisionError::Request(errors) => &errors.0,
            _ => &[],
        }
    }

    /// The API's error body: `{"error": message, "detail": [{"loc": [...], "msg": ..., "type": ...}]}`.
    pub fn body(&self) -> ErrorBody {
        let detail = match self {
            DecisionError::Json(error) => vec![match &error.path {
                // Valid JSON whose string is not text: the value's path, as for any other bad field.
                Some(path) => ErrorDetail {
                    loc: path.loc(),
                    msg: error.to_string(),
                    kind: "string_unicode".into(),
                },
                None => ErrorDetail {
                    loc: vec![LocPart::Key("body".into()), LocPart::Index(error.offset)],
                    msg: error.to_string(),
                    kind: "json_invalid".into(),
                },
            }],
            DecisionError::Request(errors) => errors
                .0
                .iter()
                .map(|e| ErrorDetail {
                    loc: e.path.loc(),
                    msg: e.message.clone(),
                    kind: e.code.into(),
                })
                .collect(),
            _ => Vec::new(),
        };
        ErrorBody {
            error: self.to_string(),
            detail,
        }
    }
}

/// The JSON body of an error response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    pub error: String,
    pub detail: Vec<ErrorDetail>,
}

/// One entry of an error body's `detail`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorDetail {
    pub loc: Vec<LocPart>,
    pub msg: String,
    #[serde(rename = "type")]
    pub kind: String,
}
