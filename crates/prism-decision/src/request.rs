//! The `/v1/systemone` request: parsing and validation (spec §2 and §3).
//!
//! The body is read with [`crate::pyjson`] so the evidence keeps Python's key order and number forms. Every
//! problem found is reported with its field path; see [`crate::error`] for the 400 / 422 split.

use serde::{Deserialize, Serialize};

use crate::error::{DecisionError, FieldError, FieldErrors, FieldPath};
use crate::pyjson::{self, py_strip, PyObject, PyValue};

/// Most images in one request (spec §2).
pub const MAX_IMAGES: usize = 8;

/// The refusals (422) of `object`'s keys that are not among `known`, each under its key below `path`.
pub fn unknown_fields<'a>(
    object: &'a PyObject,
    known: &'a [&str],
    path: &'a FieldPath,
) -> impl Iterator<Item = FieldError> + 'a {
    object.keys().filter(|key| !known.contains(key)).map(|key| {
        FieldError::malformed(
            path.key(key),
            "extra_forbidden",
            format!("unknown field `{key}`"),
        )
    })
}

/// The refusal (422) of a request with `count` images, more than [`MAX_IMAGES`], under `path`; `None`
/// for a count allowed.
pub fn too_many_images(path: FieldPath, count: usize) -> Option<FieldError> {
    (count > MAX_IMAGES).then(|| {
        FieldError::unanswerable(
            path,
            "too_many_images",
            format!("at most {MAX_IMAGES} images per request, got {count}"),
        )
    })
}
/// Fewest and most levels of a score question.
pub const MIN_SCORE_LEVELS: usize = 2;
pub const MAX_SCORE_LEVELS: usize = 10;
/// Longest option id, in characters.
pub const MAX_OPTION_ID_CHARS: usize = 200;
/// Most options of one choice question. Past 26 a choice is read in wide-choice rounds (one prompt per
/// group of 25); past this bound the request is refused (422) rather than run as hundreds of prompts.
pub const MAX_CHOICE_OPTIONS: usize = 2000;
/// The instructions a noul question gets when it has none (spec §3).
pub const DEFAULT_NOUL_INSTRUCTIONS: &str = "Which answer fits the evidence?";

/// The type of a question (`bool` is an alias of `noul`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum QuestionType {
    Choice,
    Noul,
    Score,
}

impl QuestionType {
    pub fn as_str(self) -> &'static str {
        match self {
            QuestionType::Choice => "choice",
            QuestionType::Noul => "noul",
            QuestionType::Score => "score",
        }
    }
}

/// `think_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ThinkMode {
    /// Think when the first read-out's top probability is below `gate` (v1.1 AutoThink).
    Auto,
    Never,
    Always,
}

/// One option of a question, in the client's order.
#[derive(Debug, Clone, PartialEq)]
pub struct QuestionOption {
    /// The id the answer reports: a choice's key, `true`/`false` for a noul, `0`..`n-1` for a score.
    pub id: String,
    /// The option's description as sent (a string or any JSON value); `None` when it has none.
    pub description: Option<PyValue>,
}

/// A validated question.
#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    /// The question's key in `questions` (answers are keyed by it).
    pub name: String,
    pub kind: QuestionType,
    /// The text after `Question: `: the instructions stripped of surrounding whitespace (JSON text when
    /// they were an object or array), or the noul default.
    pub instructions: String,
    /// The options in order: a choice's criteria order, `true` then `false` for a noul, levels lowest first
    /// for a score. A choice may have 1 option (answered without the model) or more than 26 (wide choice).
    pub options: Vec<QuestionOption>,
}

/// The request defaults a server may change (`--gate`, `--none-check`, `--allow-none`); [`Default`] gives
/// the spec's.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestDefaults {
    pub think_mode: ThinkMode,
    pub gate: f64,
    pub mix: f64,
    pub think_budget: u32,
    pub none_check: bool,
    pub allow_none: bool,
}

impl Default for RequestDefaults {
    fn default() -> Self {
        RequestDefaults {
            think_mode: ThinkMode::Auto,
            gate: 0.6,
            mix: 0.75,
            think_budget: 4096,
            none_check: true,
            allow_none: true,
        }
    }
}

/// A validated `/v1/systemone` request.
#[derive(Debug, Clone, PartialEq)]
pub struct DecisionRequest {
    /// The evidence, exactly as sent.
    pub state: PyValue,
    /// The questions in the client's order.
    pub questions: Vec<Question>,
    /// The images in order, each with its field path (`images[i]`; the server adds the SDK's
    /// `assets`). Not decoded here: [`crate::image_input::decode_image`] does that (the engine, on the
    /// submitting thread).
    pub images: Vec<crate::image_input::RequestImage>,
    // `think_mode` to `allow_none`: the fields of [`RequestDefaults`] as this request resolved them (its
    // own value, else the server's default); a field list kept flat like the JSON it comes from.
    pub think_mode: ThinkMode,
    pub gate: f64,
    pub mix: f64,
    pub think_budget: u32,
    pub none_check: bool,
    pub allow_none: bool,
    pub return_details: bool,
    pub return_thought: bool,
    /// The seed of the request's thoughts (each question's is this mixed with its name); without one a
    /// thought's seed comes from its prompt's tokens. Either way the same request gets the same thoughts.
    pub seed: Option<u64>,
    /// TypeSafe clients name a model; it is accepted and not checked (one server serves one model).
    pub model: Option<String>,
    /// Top-level fields this engine does not know, ignored (forward compatibility, as the reference
    /// API does); the server lists them in the response's `x_notes`.
    pub ignored_fields: Vec<String>,
}

const REQUEST_FIELDS: &[&str] = &[
    "state",
    "questions",
    "images",
    "think_mode",
    "gate",
    "mix",
    "think_budget",
    "none_check",
    "allow_none",
    "return_details",
    "return_thought",
    "seed",
    "model",
];

const QUESTION_FIELDS: &[&str] = &["type", "instructions", "question", "criteria", "options"];

impl DecisionRequest {
    /// Parses and validates a request body (JSON bytes).
    pub fn parse(body: &[u8], defaults: &RequestDefaults) -> Result<Self, DecisionError> {
        let value = pyjson::parse_bytes(body)?;
        Self::from_json(&value, defaults)
    }

    /// Validates a parsed request body, reporting every problem found.
    pub fn from_json(body: &PyValue, defaults: &RequestDefaults) -> Result<Self, DecisionError> {
        let root = FieldPath::root();
        let mut errors = Vec::new();
        let mut ignored_fields = Vec::new();
        let Some(object) = body.as_object() else {
            return Err(FieldError::malformed(
                root,
                "type_error",
                format!("the body must be a JSON object, got {}", body.type_name()),
            )
            .into());
        };
        for key in object.keys() {
            if key == "assets" {
                errors.push(FieldError::unanswerable(
                    root.key(key),
                    "not_supported",
                    "`assets` is not supported: send images as `images` (base64 strings or data URIs)",
                ));
            } else if !REQUEST_FIELDS.contains(&key) {
                // Forward compatibility, as the reference API: ignored, and said so in `x_notes`.
                ignored_fields.push(key.to_string());
            }
        }

        let state = match object.get("state") {
            Some(state) => state.clone(),
            None => {
                errors.push(FieldError::malformed(
                    root.key("state"),
                    "missing",
                    "field required",
                ));
                PyValue::Null
            }
        };

        let mut questions = Vec::new();
        match object.get("questions") {
            None | Some(PyValue::Null) => errors.push(FieldError::malformed(
                root.key("questions"),
                "missing",
                "field required",
            )),
            Some(PyValue::Object(specs)) => {
                if specs.is_empty() {
                    errors.push(FieldError::malformed(
                        root.key("questions"),
                        "value_error",
                        "at least one question is required",
                    ));
                }
                for (name, spec) in specs.iter() {
                    let path = root.key("questions").key(name);
                    if let Some(question) = parse_question(&path, name, spec, &mut errors) {
                        questions.push(question);
                    }
                }
            }
            Some(other) => errors.push(FieldError::malformed(
                root.key("questions"),
                "type_error",
                format!(
                    "must be an object (question name -> question), got {}",
                    other.type_name()
                ),
            )),
        }

        let mut images = Vec::new();
        match object.get("images") {
            None | Some(PyValue::Null) => {}
            Some(PyValue::Array(items)) => {
                for (i, item) in items.iter().enumerate() {
                    match item {
                        PyValue::Str(image) => images.push(crate::image_input::RequestImage {
                            data: crate::image_input::ImageData::Encoded(image.clone()),
                            path: root.key("images").index(i),
                        }),
                        other => errors.push(FieldError::malformed(
                            root.key("images").index(i),
                            "type_error",
                            format!(
                                "an image must be a base64 string or data URI, got {}",
                                other.type_name()
                            ),
                        )),
                    }
                }
                errors.extend(too_many_images(root.key("images"), items.len()));
            }
            Some(other) => errors.push(FieldError::malformed(
                root.key("images"),
                "type_error",
                format!(
                    "must be a list of base64 strings or data URIs, got {}",
                    other.type_name()
                ),
            )),
        }

        let think_mode = optional(
            object,
            "think_mode",
            defaults.think_mode,
            &mut errors,
            "value_error",
            "must be \"auto\", \"never\" or \"always\"",
            |value| match value {
                PyValue::Str(mode) if mode == "auto" => Some(ThinkMode::Auto),
                PyValue::Str(mode) if mode == "never" => Some(ThinkMode::Never),
                PyValue::Str(mode) if mode == "always" => Some(ThinkMode::Always),
                _ => None,
            },
        );
        let gate = unit_number(object, "gate", defaults.gate, &mut errors);
        let mix = unit_number(object, "mix", defaults.mix, &mut errors);
        let think_budget = optional(
            object,
            "think_budget",
            defaults.think_budget,
            &mut errors,
            "value_error",
            "must be a non-negative integer (tokens)",
            |value| match value {
                PyValue::Int(int) => int.to_i64().and_then(|v| u32::try_from(v).ok()),
                _ => None,
            },
        );
        let none_check = flag(object, "none_check", defaults.none_check, &mut errors);
        let allow_none = flag(object, "allow_none", defaults.allow_none, &mut errors);
        let return_details = flag(object, "return_details", false, &mut errors);
        let return_thought = flag(object, "return_thought", false, &mut errors);
        let seed = optional(
            object,
            "seed",
            None,
            &mut errors,
            "value_error",
            "must be an integer from 0 to 2^64 - 1",
            |value| match value {
                PyValue::Int(int) => int.to_u64().map(Some),
                _ => None,
            },
        );
        let model = match object.get("model") {
            None | Some(PyValue::Null) => None,
            Some(PyValue::Str(name)) => Some(name.clone()),
            Some(other) => {
                errors.push(FieldError::malformed(
                    root.key("model"),
                    "type_error",
                    format!("must be a string, got {}", other.type_name()),
                ));
                None
            }
        };

        if !errors.is_empty() {
            return Err(FieldErrors(errors).into());
        }
        Ok(DecisionRequest {
            state,
            questions,
            images,
            think_mode,
            gate,
            mix,
            think_budget,
            none_check,
            allow_none,
            return_details,
            return_thought,
            seed,
            model,
            ignored_fields,
        })
    }
}

/// A number in [0, 1] (`gate`, `mix`).
fn unit_number(object: &PyObject, key: &str, default: f64, errors: &mut Vec<FieldError>) -> f64 {
    optional(
        object,
        key,
        default,
        errors,
        "value_error",
        "must be a number from 0 to 1",
        |value| value.as_f64().filter(|number| (0.0..=1.0).contains(number)),
    )
}

/// A boolean (`none_check`, `return_details`, ...).
fn flag(object: &PyObject, key: &str, default: bool, errors: &mut Vec<FieldError>) -> bool {
    optional(
        object,
        key,
        default,
        errors,
        "type_error",
        "must be true or false",
        |value| match value {
            PyValue::Bool(value) => Some(*value),
            _ => None,
        },
    )
}

/// The optional top-level field `key`: `default` when it is absent or null, else what `read` makes of
/// its value. A value `read` refuses (`None`) is reported as a `code` error, "`must`, got <its JSON>",
/// and gives `default`.
fn optional<T>(
    object: &PyObject,
    key: &str,
    default: T,
    errors: &mut Vec<FieldError>,
    code: &'static str,
    must: &str,
    read: impl FnOnce(&PyValue) -> Option<T>,
) -> T {
    match object.get(key) {
        None | Some(PyValue::Null) => default,
        Some(value) => read(value).unwrap_or_else(|| {
            errors.push(FieldError::malformed(
                FieldPath::root().key(key),
                code,
                format!("{must}, got {}", value.dumps()),
            ));
            default
        }),
    }
}

impl Question {
    /// Validates one question spec, as it would appear under `questions.<name>`.
    pub fn from_json(name: &str, spec: &PyValue) -> Result<Question, FieldErrors> {
        let mut errors = Vec::new();
        let path = FieldPath::root().key("questions").key(name);
        match parse_question(&path, name, spec, &mut errors) {
            Some(question) if errors.is_empty() => Ok(question),
            _ => Err(FieldErrors(errors)),
        }
    }
}

/// Looks a field up under its name or its alias; both at once is an error. Returns the key used.
fn aliased<'a>(
    object: &'a PyObject,
    path: &FieldPath,
    name: &'static str,
    alias: &'static str,
    errors: &mut Vec<FieldError>,
) -> (&'static str, Option<&'a PyValue>) {
    let primary = object.get(name).filter(|v| **v != PyValue::Null);
    let secondary = object.get(alias).filter(|v| **v != PyValue::Null);
    match (primary, secondary) {
        (Some(value), Some(_)) => {
            errors.push(FieldError::malformed(
                path.key(alias),
                "value_error",
                format!("give `{name}` or its alias `{alias}`, not both"),
            ));
            (name, Some(value))
        }
        (Some(value), None) => (name, Some(value)),
        (None, Some(value)) => (alias, Some(value)),
        (None, None) => (
            if object.contains_key(alias) {
                alias
            } else {
                name
            },
            None,
        ),
    }
}

/// Validates one question, pushing its errors; `None` when it is unusable.
fn parse_question(
    path: &FieldPath,
    name: &str,
    spec: &PyValue,
    errors: &mut Vec<FieldError>,
) -> Option<Question> {
    let Some(object) = spec.as_object() else {
        errors.push(FieldError::malformed(
            path.clone(),
            "type_error",
            format!("a question must be an object, got {}", spec.type_name()),
        ));
        return None;
    };
    let errors_before = errors.len();
    errors.extend(unknown_fields(object, QUESTION_FIELDS, path));
    let kind = match object.get("type") {
        None => {
            errors.push(FieldError::malformed(
                path.key("type"),
                "missing",
                "field required (choice, noul or score)",
            ));
            return None;
        }
        Some(PyValue::Str(kind)) => match kind.as_str() {
            "choice" => QuestionType::Choice,
            "noul" | "bool" => QuestionType::Noul,
            "score" => QuestionType::Score,
            "box" => {
                errors.push(FieldError::unanswerable(
                    path.key("type"),
                    "not_supported",
                    "box questions are not supported by decision models (choice, noul or score)",
                ));
                return None;
            }
            other => {
                errors.push(FieldError::malformed(
                    path.key("type"),
                    "value_error",
                    format!("unknown question type {other:?} (expected choice, noul or score)"),
                ));
                return None;
            }
        },
        Some(other) => {
            errors.push(FieldError::malformed(
                path.key("type"),
                "type_error",
                format!("must be a string, got {}", other.type_name()),
            ));
            return None;
        }
    };

    let (instructions_key, instructions) =
        aliased(object, path, "instructions", "question", errors);
    let instructions = match instructions {
        None => None,
        Some(PyValue::Str(text)) => Some(py_strip(text).to_string()),
        Some(value @ (PyValue::Object(_) | PyValue::Array(_))) => Some(value.dumps()),
        Some(other) => {
            errors.push(FieldError::malformed(
                path.key(instructions_key),
                "type_error",
                format!(
                    "instructions must be a string (or a JSON object or array), got {}",
                    other.type_name()
                ),
            ));
            Some(String::new())
        }
    }
    .filter(|text| !text.is_empty());
    let instructions = match (instructions, kind) {
        (Some(text), _) => text,
        (None, QuestionType::Noul) => DEFAULT_NOUL_INSTRUCTIONS.to_string(),
        (None, _) => {
            if !errors[errors_before..]
                .iter()
                .any(|e| e.path == path.key(instructions_key))
            {
                errors.push(FieldError::malformed(
                    path.key(instructions_key),
                    "missing",
                    "instructions required: a non-blank string",
                ));
            }
            String::new()
        }
    };

    let (criteria_key, criteria) = aliased(object, path, "criteria", "options", errors);
    let criteria_path = path.key(criteria_key);
    let options = match kind {
        QuestionType::Choice => choice_options(&criteria_path, criteria, errors),
        QuestionType::Noul => noul_options(&criteria_path, criteria, errors),
        QuestionType::Score => score_options(&criteria_path, criteria, errors),
    };
    if errors.len() > errors_before {
        return None;
    }
    Some(Question {
        name: name.to_string(),
        kind,
        instructions,
        options,
    })
}

/// Checks an option id: non-empty, not blank, at most 200 characters, on one line.
fn check_option_id(id: &str, path: &FieldPath, errors: &mut Vec<FieldError>) -> bool {
    let problem = if py_strip(id).is_empty() {
        Some("must not be empty or blank".to_string())
    } else if id.chars().count() > MAX_OPTION_ID_CHARS {
        Some(format!(
            "must be at most {MAX_OPTION_ID_CHARS} characters, got {}",
            id.chars().count()
        ))
    } else if id.contains(['\n', '\r']) {
        Some("must not contain a line break".to_string())
    } else {
        None
    };
    match problem {
        Some(problem) => {
            errors.push(FieldError::malformed(
                path.clone(),
                "value_error",
                format!("bad option id {id:?}: {problem}"),
            ));
            false
        }
        None => true,
    }
}

fn choice_options(
    path: &FieldPath,
    criteria: Option<&PyValue>,
    errors: &mut Vec<FieldError>,
) -> Vec<QuestionOption> {
    let mut options = Vec::new();
    match criteria {
        None => {
            errors.push(FieldError::malformed(
                path.clone(),
                "missing",
                "criteria required: {option_id: description} or a list of ids",
            ));
            return options;
        }
        Some(PyValue::Object(map)) => {
            for (id, description) in map.iter() {
                if check_option_id(id, &path.key(id), errors) {
                    let description = (*description != PyValue::Null).then(|| description.clone());
                    options.push(QuestionOption {
                        id: id.to_string(),
                        description,
                    });
                }
            }
        }
        Some(PyValue::Array(ids)) => {
            let mut seen = std::collections::HashSet::new();
            for (i, item) in ids.iter().enumerate() {
                let item_path = path.index(i);
                match item {
                    PyValue::Str(id) => {
                        if !check_option_id(id, &item_path, errors) {
                            continue;
                        }
                        if !seen.insert(id.as_str()) {
                            errors.push(FieldError::malformed(
                                item_path,
                                "value_error",
                                format!("duplicate option id {id:?}"),
                            ));
                            continue;
                        }
                        options.push(QuestionOption {
                            id: id.clone(),
                            description: None,
                        });
                    }
                    other => errors.push(FieldError::malformed(
                        item_path,
                        "type_error",
                        format!("an option id must be a string, got {}", other.type_name()),
                    )),
                }
            }
        }
        Some(other) => {
            errors.push(FieldError::malformed(
                path.clone(),
                "type_error",
                format!(
                    "must be an object {{option_id: description}} or a list of ids, got {}",
                    other.type_name()
                ),
            ));
            return options;
        }
    }
    let count = criteria.map(|c| match c {
        PyValue::Object(map) => map.len(),
        PyValue::Array(items) => items.len(),
        _ => 0,
    });
    if count == Some(0) {
        errors.push(FieldError::malformed(
            path.clone(),
            "value_error",
            "a choice needs at least one option",
        ));
    } else if options.len() > MAX_CHOICE_OPTIONS {
        errors.push(FieldError::unanswerable(
            path.clone(),
            "too_many_options",
            format!(
                "at most {MAX_CHOICE_OPTIONS} options per choice, got {}",
                options.len()
            ),
        ));
    }
    options
}

fn noul_options(
    path: &FieldPath,
    criteria: Option<&PyValue>,
    errors: &mut Vec<FieldError>,
) -> Vec<QuestionOption> {
    let mut yes = None;
    let mut no = None;
    match criteria {
        None => {}
        Some(PyValue::Object(map)) => {
            for (key, description) in map.iter() {
                let description = (*description != PyValue::Null).then(|| description.clone());
                match key {
                    "true" => yes = description,
                    "false" => no = description,
                    other => errors.push(FieldError::malformed(
                        path.key(other),
                        "value_error",
                        format!("bad option id {other:?}: noul criteria keys must be exactly \"true\" and \"false\""),
                    )),
                }
            }
        }
        Some(other) => errors.push(FieldError::malformed(
            path.clone(),
            "type_error",
            format!(
                "noul criteria must be an object {{\"true\": description, \"false\": description}}, got {}",
                other.type_name()
            ),
        )),
    }
    vec![
        QuestionOption {
            id: "true".into(),
            description: yes,
        },
        QuestionOption {
            id: "false".into(),
            description: no,
        },
    ]
}

fn score_options(
    path: &FieldPath,
    criteria: Option<&PyValue>,
    errors: &mut Vec<FieldError>,
) -> Vec<QuestionOption> {
    let levels: Vec<(FieldPath, &PyValue)> = match criteria {
        None => {
            errors.push(FieldError::malformed(
                path.clone(),
                "missing",
                "criteria required: a list of levels, lowest first",
            ));
            return Vec::new();
        }
        Some(PyValue::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, item)| (path.index(i), item))
            .collect(),
        Some(PyValue::Object(map)) => {
            // A dict is ordered by numeric key ("0", "1", "2.5"); when any key is not a number the client's
            // order is kept (the reference keeps {"b": .., "a": ..} as given).
            let mut entries: Vec<(&str, &PyValue)> = map.iter().collect();
            let numbers: Option<Vec<f64>> = entries
                .iter()
                .map(|(key, _)| key.trim().parse::<f64>().ok().filter(|n| n.is_finite()))
                .collect();
            if let Some(numbers) = numbers {
                let mut order: Vec<usize> = (0..entries.len()).collect();
                order.sort_by(|&a, &b| numbers[a].total_cmp(&numbers[b]));
                entries = order.into_iter().map(|i| entries[i]).collect();
            }
            entries
                .into_iter()
                .map(|(key, item)| (path.key(key), item))
                .collect()
        }
        Some(other) => {
            errors.push(FieldError::malformed(
                path.clone(),
                "type_error",
                format!(
                    "score criteria must be a list of levels (lowest first) or an object keyed by level, got {}",
                    other.type_name()
                ),
            ));
            return Vec::new();
        }
    };
    let mut options = Vec::new();
    for (i, (level_path, level)) in levels.iter().enumerate() {
        if **level == PyValue::Null {
            errors.push(FieldError::malformed(
                level_path.clone(),
                "value_error",
                "a score level needs a description",
            ));
            continue;
        }
        options.push(QuestionOption {
            id: i.to_string(),
            description: Some((*level).clone()),
        });
    }
    if levels.len() < MIN_SCORE_LEVELS {
        errors.push(FieldError::malformed(
            path.clone(),
            "value_error",
            format!(
                "a score needs {MIN_SCORE_LEVELS} to {MAX_SCORE_LEVELS} levels, got {}",
                levels.len()
            ),
        ));
    } else if levels.len() > MAX_SCORE_LEVELS {
        errors.push(FieldError::unanswerable(
            path.clone(),
            "too_many_levels",
            format!(
                "the model cannot answer a score with more than {MAX_SCORE_LEVELS} levels, got {}",
                levels.len()
            ),
        ));
    }
    options
}
