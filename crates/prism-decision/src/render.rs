//! Prompt rendering for StartLux-Decision v1 (spec §3), checked against the reference renderer's golden
//! cases (`tests/fixtures/decision-golden`).
//!
//! A question becomes two chat messages: the fixed system text and
//! `Evidence:\n{state}\n\nQuestion: {instructions}\nOptions:\nA) ...\nB) ...`. The chat template (with
//! thinking off) is applied later, by the model side.

use crate::error::FieldError;
use crate::error::FieldPath;
use crate::model::{ImageSlot, LetterPrompt};
use crate::pyjson::{dumps, is_py_space, py_strip, PyInt, PyObject, PyValue};
use crate::request::{Question, QuestionType};

/// The system message of every decision prompt.
pub const SYSTEM_PROMPT: &str =
    "Apply the criterion to the evidence. Choose exactly one listed option. Answer with its letter only.";

/// The option letters, in order; one prompt has at most 26 options.
pub const LETTERS: [char; 26] = [
    'A', 'B', 'C', 'D', 'E', 'F', 'G', 'H', 'I', 'J', 'K', 'L', 'M', 'N', 'O', 'P', 'Q', 'R', 'S',
    'T', 'U', 'V', 'W', 'X', 'Y', 'Z',
];

/// Fewest and most options in one prompt.
pub const MIN_PROMPT_OPTIONS: usize = 2;
pub const MAX_PROMPT_OPTIONS: usize = 26;

/// Arrays at least this long have their items annotated with their index.
pub const ANNOTATE_MIN_LEN: usize = 8;

/// What the evidence shows when it is empty or blank.
pub const EMPTY_STATE: &str = "(none)";

/// The evidence text: a string as is; `null`, `{}` and `[]` as empty; anything else as Python's
/// `json.dumps(x, ensure_ascii=False)` of [`annotate_long_arrays`]`(x)`. Empty or blank text becomes
/// `(none)`.
pub fn state_text(state: &PyValue) -> String {
    let text = match state {
        PyValue::Str(text) => text.clone(),
        PyValue::Null => String::new(),
        PyValue::Object(object) if object.is_empty() => String::new(),
        PyValue::Array(items) if items.is_empty() => String::new(),
        other => dumps(&annotate_long_arrays(other)),
    };
    if py_strip(&text).is_empty() {
        EMPTY_STATE.to_string()
    } else {
        text
    }
}

/// Annotates, at every depth, each array of [`ANNOTATE_MIN_LEN`] or more items: an object item `o` becomes
/// `{"_index": i, **o}` (an `_index` key of its own keeps the first position and its own value, as in a
/// Python dict), any other item `v` becomes `{"_index": i, "value": v}`. Items are annotated inside first.
pub fn annotate_long_arrays(value: &PyValue) -> PyValue {
    match value {
        PyValue::Array(items) => {
            let annotated = items.iter().map(annotate_long_arrays);
            if items.len() < ANNOTATE_MIN_LEN {
                return PyValue::Array(annotated.collect());
            }
            PyValue::Array(
                annotated
                    .enumerate()
                    .map(|(i, item)| {
                        let mut object = PyObject::new();
                        object.insert("_index".to_string(), PyValue::Int(PyInt::from(i)));
                        match item {
                            PyValue::Object(fields) => {
                                for (key, field) in fields.iter() {
                                    object.insert(key.to_string(), field.clone());
                                }
                            }
                            other => object.insert("value".to_string(), other),
                        }
                        PyValue::Object(object)
                    })
                    .collect(),
            )
        }
        PyValue::Object(object) => PyValue::Object(
            object
                .iter()
                .map(|(key, item)| (key.to_string(), annotate_long_arrays(item)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// A description as prompt text: a string stripped of surrounding whitespace, any other JSON value as
/// `json.dumps` (not annotated). `None` when there is no description or it is blank.
fn description_text(description: Option<&PyValue>) -> Option<String> {
    let text = match description? {
        PyValue::Str(text) => py_strip(text).to_string(),
        other => dumps(other),
    };
    (!text.is_empty()).then_some(text)
}

/// Whether a description merely repeats a label: equal ignoring case, whitespace and `_` — but not `-`
/// (the release's renderer shows id `opt2` with description `OPT-2` as `opt2: OPT-2`; spec §3).
fn same_text(a: &str, b: &str) -> bool {
    let normalize = |text: &str| -> String {
        text.chars()
            .filter(|&c| !is_py_space(c) && c != '_')
            .flat_map(char::to_lowercase)
            .collect()
    };
    normalize(a) == normalize(b)
}

/// Whether a choice id is only a position marker: a single letter or a number, optionally in
/// parentheses or brackets, followed by `)`, `.` or `:`, or after `option`/`opt`/`choice`
/// (`A`, `(b)`, `3.`, `option_2`, `opt 1`). Such ids are hidden when every option has a description.
pub fn is_bare_id(id: &str) -> bool {
    let mut rest = py_strip(id);
    rest = rest.strip_prefix(['(', '[']).unwrap_or(rest);
    rest = rest.strip_suffix([')', ']', '.', ':']).unwrap_or(rest);
    let bare = |core: &str| {
        let mut chars = core.chars();
        match (chars.next(), chars.next()) {
            (Some(c), None) if c.is_ascii_alphabetic() => true,
            (Some(_), _) => core.chars().all(|c| c.is_ascii_digit()),
            (None, _) => false,
        }
    };
    if bare(rest) {
        return true;
    }
    let lower = rest.to_ascii_lowercase();
    for prefix in ["option", "choice", "opt"] {
        if lower.starts_with(prefix) && rest.is_char_boundary(prefix.len()) {
            let core = &rest[prefix.len()..];
            let core = core.strip_prefix([' ', '_', '-']).unwrap_or(core);
            if bare(core) {
                return true;
            }
        }
    }
    false
}

/// Each option's text after its letter, in option order (spec §3 option lines).
pub fn option_labels(question: &Question) -> Vec<String> {
    let descriptions: Vec<Option<String>> = question
        .options
        .iter()
        .map(|option| description_text(option.description.as_ref()))
        .collect();
    match question.kind {
        QuestionType::Choice => {
            let hide_ids = question.options.iter().all(|option| is_bare_id(&option.id))
                && descriptions.iter().all(Option::is_some);
            question
                .options
                .iter()
                .zip(&descriptions)
                .map(|(option, description)| match description {
                    Some(text) if hide_ids => text.clone(),
                    Some(text) if !same_text(text, &option.id) => format!("{}: {text}", option.id),
                    _ => option.id.clone(),
                })
                .collect()
        }
        QuestionType::Noul | QuestionType::Score => question
            .options
            .iter()
            .zip(&descriptions)
            .map(|(option, description)| {
                let label = match (question.kind, option.id.as_str()) {
                    (QuestionType::Noul, "true") => "yes",
                    (QuestionType::Noul, _) => "no",
                    _ => option.id.as_str(),
                };
                match description {
                    Some(text) if !same_text(text, label) && !same_text(text, &option.id) => {
                        format!("{label}: {text}")
                    }
                    _ => label.to_string(),
                }
            })
            .collect(),
    }
}

/// The user message: evidence, question and one lettered line per label.
pub fn user_text(state_text: &str, instructions: &str, labels: &[&str]) -> String {
    let mut text = format!("Evidence:\n{state_text}\n\nQuestion: {instructions}\nOptions:");
    for (letter, label) in LETTERS.iter().zip(labels) {
        text.push('\n');
        text.push(*letter);
        text.push_str(") ");
        text.push_str(label);
    }
    text
}

/// Renders the prompt of `question` over the options at `indices` (in that letter order), given the
/// question's [`option_labels`]. At most 26 indices, each in range (the caller's invariant).
pub fn render_options(
    state_text: &str,
    question: &Question,
    labels: &[String],
    indices: &[usize],
) -> LetterPrompt {
    let shown: Vec<&str> = indices
        .iter()
        .filter_map(|&i| labels.get(i).map(String::as_str))
        .collect();
    LetterPrompt {
        system: SYSTEM_PROMPT.to_string(),
        user: user_text(state_text, &question.instructions, &shown),
        option_ids: indices
            .iter()
            .filter_map(|&i| question.options.get(i).map(|o| o.id.clone()))
            .collect(),
        images: Vec::new(),
    }
}

/// A prompt with the given evidence and a question no request asks (its text starts with a control
/// character): its tokens share with every real prompt about this evidence exactly the part before the
/// question. The engine branches there and keys its prefix cache on those tokens.
pub fn evidence_probe(evidence: &Evidence) -> LetterPrompt {
    LetterPrompt {
        system: SYSTEM_PROMPT.to_string(),
        user: user_text(&evidence.text, "\u{1}", &["\u{1}", "\u{1}"]),
        option_ids: vec!["\u{1}".into(), "\u{1}".into()],
        images: evidence.user_slots(),
    }
}

/// What `{state}` becomes in the user message: the evidence text and where its images go.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Evidence {
    pub text: String,
    /// The images in order; `at` is a byte offset in [`Self::text`].
    pub images: Vec<ImageSlot>,
}

/// The user message starts with this, then the evidence.
pub const EVIDENCE_PREFIX: &str = "Evidence:\n";

/// Where the next image goes in a string state (spec §3).
pub const IMAGE_MARK: &str = "<image>";

impl Evidence {
    /// The evidence of a text-only request ([`state_text`]).
    pub fn text_only(state: &PyValue) -> Self {
        Evidence {
            text: state_text(state),
            images: Vec::new(),
        }
    }

    /// The image slots as offsets in the user message ([`user_text`] puts the evidence after
    /// [`EVIDENCE_PREFIX`]).
    pub fn user_slots(&self) -> Vec<ImageSlot> {
        self.images
            .iter()
            .map(|slot| ImageSlot {
                at: slot.at + EVIDENCE_PREFIX.len(),
                tokens: slot.tokens,
            })
            .collect()
    }
}

/// The evidence of a request whose images take `image_tokens` pad tokens each, placed as the official
/// package does (spec §3):
/// - a string state with [`IMAGE_MARK`]s: each mark is where the next image goes (the marks are
///   removed); the number of marks must equal the number of images, else a 422 naming `state`;
/// - otherwise one image goes first, followed by `\n\n` and the state text (when the state is not
///   empty), and several go first as lines `Image 1: <image>` … joined by `\n`, then `\n\n` and the
///   state text.
///
/// Without images this is [`Evidence::text_only`] (marks in the text stay text).
pub fn evidence(state: &PyValue, image_tokens: &[usize]) -> Result<Evidence, FieldError> {
    if image_tokens.is_empty() {
        return Ok(Evidence::text_only(state));
    }
    if let PyValue::Str(text) = state {
        let marks = text.matches(IMAGE_MARK).count();
        if marks > 0 {
            if marks != image_tokens.len() {
                return Err(FieldError::unanswerable(
                    FieldPath::root().key("state"),
                    "image_marks",
                    format!(
                        "the state has {marks} {IMAGE_MARK} mark(s) for {} image(s): each mark is where \
                         the next image goes, so their numbers must be equal (or leave the marks out to \
                         put the images first)",
                        image_tokens.len()
                    ),
                ));
            }
            let mut out = String::with_capacity(text.len());
            let mut images = Vec::with_capacity(marks);
            for (k, piece) in text.split(IMAGE_MARK).enumerate() {
                if k > 0 {
                    images.push(ImageSlot {
                        at: out.len(),
                        tokens: image_tokens[k - 1],
                    });
                }
                out.push_str(piece);
            }
            return Ok(Evidence { text: out, images });
        }
    }
    let rest = state_text(state);
    let blank = match state {
        PyValue::Str(text) => py_strip(text).is_empty(),
        _ => rest == EMPTY_STATE,
    };
    let mut text = String::new();
    let mut images = Vec::with_capacity(image_tokens.len());
    if let [tokens] = image_tokens {
        images.push(ImageSlot {
            at: 0,
            tokens: *tokens,
        });
    } else {
        for (i, &tokens) in image_tokens.iter().enumerate() {
            if i > 0 {
                text.push('\n');
            }
            text.push_str(&format!("Image {}: ", i + 1));
            images.push(ImageSlot {
                at: text.len(),
                tokens,
            });
        }
    }
    if !blank {
        text.push_str("\n\n");
        text.push_str(&rest);
    }
    Ok(Evidence { text, images })
}

/// Renders a question as one prompt, as the reference renderer does: it refuses fewer than 2 or more than
/// 26 options (the engine answers a single option without the model and reads wider choices in rounds,
/// see [`crate::decide`]).
pub fn render_prompt(state_text: &str, question: &Question) -> Result<LetterPrompt, FieldError> {
    let n = question.options.len();
    if !(MIN_PROMPT_OPTIONS..=MAX_PROMPT_OPTIONS).contains(&n) {
        return Err(FieldError::malformed(
            FieldPath::root()
                .key("questions")
                .key(&question.name)
                .key("criteria"),
            "value_error",
            format!(
                "one prompt takes {MIN_PROMPT_OPTIONS} to {MAX_PROMPT_OPTIONS} options, got {n}"
            ),
        ));
    }
    let labels = option_labels(question);
    let indices: Vec<usize> = (0..n).collect();
    Ok(render_options(state_text, question, &labels, &indices))
}
