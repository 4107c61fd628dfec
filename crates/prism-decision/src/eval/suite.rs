//! Labelled suites: one JSON object a line.
//!
//! Prism's own format (README, "`prism eval`"):
//!
//! ```json
//! {"id": "t1", "request": {a /v1/systemone request}, "labels": {"team": "billing", "urgent": true, "mood": 2}, "tags": ["billing"]}
//! ```
//!
//! `id` a string or an integer, unique in the suite; `request` a request as the API takes it (validated
//! here with the API's own rules); `labels` (optional) maps a question key to its label: an option id
//! (choice), `true`/`false` (noul) or a level index from 0 (score) — unlabelled questions are answered and
//! compared but not scored; `tags` (optional) a list of strings. Any other field is an error.
//!
//! A line of a `sys1bench` manifest (its generators' output and its canary file: `task_id`, `state`,
//! `questions` with `ground_truth` in each question) is read too, and turned into the request sys1bench's
//! own TypeSafe adapter (`adapters/jev_typesafe.py`) sends: a noul without criteria, a choice's options as
//! `{key: description or null}` (plus its abstain option when `allow_abstain`), a score's levels as the list
//! of their descriptions (`"level N"` when empty), the score label being the position of the
//! `ground_truth` level. Its id is sys1bench's `row_id()` and its tags are its domain, `tier:T` and
//! `lang:L`.

use std::collections::HashMap;

use crate::error::DecisionError;
use crate::pyjson::{self, PyObject, PyValue};
use crate::request::{DecisionRequest, QuestionType, RequestDefaults};

/// A bad suite line: its line number (from 1), the field at fault, and what is wrong.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("line {line}: {field}: {message}")]
pub struct SuiteError {
    pub line: usize,
    pub field: String,
    pub message: String,
}

/// One question of an item, as the request asks it.
// A field list: alike in shape only to other structs' plain fields (`GgufVocabulary`'s, ...).
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteQuestion {
    pub name: String,
    pub kind: QuestionType,
    /// Option ids in order (`true`, `false` for a noul; `0`.. for a score).
    pub options: Vec<String>,
    /// The label's index among `options`.
    pub label: Option<usize>,
}

/// One labelled request.
// A field list: alike in shape only to other structs' plain fields (a request's, the loadgen options).
#[derive(Debug, Clone, PartialEq)]
pub struct SuiteItem {
    /// Line number in the suite file (from 1).
    pub line: usize,
    pub id: String,
    /// The request object (for the in-process engine).
    pub request: PyValue,
    /// The request's body as sent to a server (`json.dumps` of `request`).
    pub body: String,
    pub questions: Vec<SuiteQuestion>,
    pub tags: Vec<String>,
}

impl SuiteItem {
    /// The request, validated (it was validated when the line was read).
    pub fn decision_request(&self) -> Result<DecisionRequest, DecisionError> {
        DecisionRequest::from_json(&self.request, &RequestDefaults::default())
    }
}

/// A suite file read.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Suite {
    pub items: Vec<SuiteItem>,
    /// Bad lines passed over (only with `skip_bad`).
    pub skipped: Vec<SuiteError>,
}

fn error(line: usize, field: impl Into<String>, message: impl Into<String>) -> SuiteError {
    SuiteError {
        line,
        field: field.into(),
        message: message.into(),
    }
}

/// Reads a suite: every non-blank line an item. A bad line is an error, or with `skip_bad` is kept in
/// [`Suite::skipped`] and passed over. Duplicate ids are bad lines (the second one).
pub fn parse_suite(text: &str, skip_bad: bool) -> Result<Suite, SuiteError> {
    let mut suite = Suite::default();
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (index, line) in text.lines().enumerate() {
        let number = index + 1;
        if line.trim().is_empty() {
            continue;
        }
        let parsed = parse_line(number, line).and_then(|item| match seen.get(&item.id) {
            Some(&first) => Err(error(
                number,
                "id",
                format!("{:?} is already the id of line {first}", item.id),
            )),
            None => Ok(item),
        });
        match parsed {
            Ok(item) => {
                seen.insert(item.id.clone(), number);
                suite.items.push(item);
            }
            Err(bad) if skip_bad => suite.skipped.push(bad),
            Err(bad) => return Err(bad),
        }
    }
    Ok(suite)
}

const FIELDS: &[&str] = &["id", "request", "labels", "tags"];

/// Reads one line (`line` is its number, for errors).
pub fn parse_line(line: usize, text: &str) -> Result<SuiteItem, SuiteError> {
    let value = pyjson::parse(text).map_err(|e| error(line, "line", format!("not JSON: {e}")))?;
    let Some(object) = value.as_object() else {
        return Err(error(
            line,
            "line",
            format!("must be a JSON object, got {}", value.type_name()),
        ));
    };
    if !object.contains_key("request") && object.contains_key("task_id") {
        return sys1bench_item(line, object);
    }
    for key in object.keys() {
        if !FIELDS.contains(&key) {
            return Err(error(
                line,
                key,
                format!("unknown field (a suite line has {})", FIELDS.join(", ")),
            ));
        }
    }
    let id = match object.get("id") {
        Some(PyValue::Str(id)) if !id.is_empty() => id.clone(),
        Some(PyValue::Int(id)) => id.as_str().to_string(),
        Some(other) => {
            return Err(error(
                line,
                "id",
                format!(
                    "must be a non-empty string or an integer, got {}",
                    other.dumps()
                ),
            ))
        }
        None => return Err(error(line, "id", "missing")),
    };
    // Shaped like the `id` match above, but each field accepts its own types and says so in its own
    // message; only the error arms repeat.
    let request = match object.get("request") {
        Some(request @ PyValue::Object(_)) => request.clone(),
        Some(other) => {
            return Err(error(
                line,
                "request",
                format!(
                    "must be a /v1/systemone request object, got {}",
                    other.type_name()
                ),
            ))
        }
        None => return Err(error(line, "request", "missing")),
    };
    let tags = match object.get("tags") {
        None | Some(PyValue::Null) => Vec::new(),
        Some(PyValue::Array(tags)) => tags
            .iter()
            .enumerate()
            .map(|(i, tag)| match tag {
                PyValue::Str(tag) if !tag.is_empty() => Ok(tag.clone()),
                other => Err(error(
                    line,
                    format!("tags[{i}]"),
                    format!("must be a non-empty string, got {}", other.dumps()),
                )),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => {
            return Err(error(
                line,
                "tags",
                format!("must be a list of strings, got {}", other.type_name()),
            ))
        }
    };
    let mut questions = questions_of(line, &request)?;
    match object.get("labels") {
        None | Some(PyValue::Null) => {}
        Some(PyValue::Object(labels)) => {
            for (key, label) in labels.iter() {
                let field = format!("labels.{key}");
                let Some(question) = questions.iter_mut().find(|q| q.name == key) else {
                    return Err(error(
                        line,
                        field,
                        format!(
                            "the request has no question {key:?} (its questions: {})",
                            names(&questions)
                        ),
                    ));
                };
                question.label = Some(label_index(line, &field, question, label)?);
            }
        }
        Some(other) => {
            return Err(error(
                line,
                "labels",
                format!(
                    "must be an object {{question key: label}}, got {}",
                    other.type_name()
                ),
            ))
        }
    }
    let body = request.dumps();
    Ok(SuiteItem {
        line,
        id,
        request,
        body,
        questions,
        tags,
    })
}

fn names(questions: &[SuiteQuestion]) -> String {
    questions
        .iter()
        .map(|q| format!("{:?}", q.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The request's questions, validated by the API's own rules (a request the API refuses is a bad line).
fn questions_of(line: usize, request: &PyValue) -> Result<Vec<SuiteQuestion>, SuiteError> {
    let parsed = DecisionRequest::from_json(request, &RequestDefaults::default()).map_err(|e| {
        let field = match &e {
            DecisionError::Request(errors) => errors
                .0
                .first()
                .map(|f| format!("request.{}", f.path))
                .unwrap_or_else(|| "request".to_string()),
            _ => "request".to_string(),
        };
        error(line, field, format!("the API would refuse it: {e}"))
    })?;
    Ok(parsed
        .questions
        .iter()
        .map(|q| SuiteQuestion {
            name: q.name.clone(),
            kind: q.kind,
            options: q.options.iter().map(|o| o.id.clone()).collect(),
            label: None,
        })
        .collect())
}

fn label_index(
    line: usize,
    field: &str,
    question: &SuiteQuestion,
    label: &PyValue,
) -> Result<usize, SuiteError> {
    let found = match (question.kind, label) {
        (QuestionType::Choice, PyValue::Str(id)) => question.options.iter().position(|o| o == id),
        (QuestionType::Noul, PyValue::Bool(flag)) => Some(if *flag { 0 } else { 1 }),
        (QuestionType::Score, PyValue::Int(level)) => level
            .to_u64()
            .and_then(|l| usize::try_from(l).ok())
            .filter(|&l| l < question.options.len()),
        _ => {
            let wanted = match question.kind {
                QuestionType::Choice => "an option id (a string)",
                QuestionType::Noul => "true or false",
                QuestionType::Score => "a level index (an integer from 0)",
            };
            return Err(error(
                line,
                field,
                format!(
                    "a {} question's label must be {wanted}, got {}",
                    question.kind.as_str(),
                    label.dumps()
                ),
            ));
        }
    };
    found.ok_or_else(|| {
        let message = match question.kind {
            QuestionType::Score => format!(
                "level {} is not one of the question's {} levels (0 to {})",
                label.dumps(),
                question.options.len(),
                question.options.len().saturating_sub(1)
            ),
            _ => format!(
                "{} is not one of the question's options ({})",
                label.dumps(),
                question.options.join(", ")
            ),
        };
        error(line, field, message)
    })
}

fn str_field<'a>(object: &'a PyObject, key: &str) -> Option<&'a str> {
    object.get(key).and_then(PyValue::as_str)
}

/// A sys1bench manifest row (`sys1bench.schemas.TaskItem`) as a suite item.
fn sys1bench_item(line: usize, object: &PyObject) -> Result<SuiteItem, SuiteError> {
    let task_id = str_field(object, "task_id")
        .filter(|t| !t.is_empty())
        .ok_or_else(|| error(line, "task_id", "must be a non-empty string"))?;
    let state = object
        .get("state")
        .ok_or_else(|| error(line, "state", "missing"))?;
    let Some(questions) = object.get("questions").and_then(PyValue::as_object) else {
        return Err(error(line, "questions", "must be an object"));
    };
    let mut request_questions = PyObject::new();
    let mut labels: Vec<(String, PyValue)> = Vec::new();
    let mut framings: Vec<(String, String)> = Vec::new();
    for (key, question) in questions.iter() {
        let field = format!("questions.{key}");
        let Some(question) = question.as_object() else {
            return Err(error(line, field, "must be an object"));
        };
        let kind = str_field(question, "type")
            .ok_or_else(|| error(line, format!("{field}.type"), "must be a string"))?;
        let instructions = question
            .get("instructions")
            .cloned()
            .ok_or_else(|| error(line, format!("{field}.instructions"), "missing"))?;
        framings.push((
            key.to_string(),
            str_field(question, "framing_id")
                .unwrap_or("f0")
                .to_string(),
        ));
        let criteria = match question.get("criteria") {
            Some(PyValue::Array(list)) => list.as_slice(),
            None | Some(PyValue::Null) => &[],
            Some(other) => {
                return Err(error(
                    line,
                    format!("{field}.criteria"),
                    format!("must be a list, got {}", other.type_name()),
                ))
            }
        };
        let entry = |i: usize, name: &str| -> Result<&PyObject, SuiteError> {
            criteria[i].as_object().ok_or_else(|| {
                error(
                    line,
                    format!("{field}.criteria[{i}]"),
                    format!("must be an object {{\"{name}\": ..., \"description\": ...}}"),
                )
            })
        };
        let truth = question
            .get("ground_truth")
            .filter(|v| **v != PyValue::Null);
        let mut out = PyObject::new();
        out.insert("type".into(), PyValue::Str(kind.to_string()));
        out.insert("instructions".into(), instructions);
        match kind {
            "noul" => {
                if let Some(truth) = truth {
                    if !matches!(truth, PyValue::Bool(_)) {
                        return Err(error(
                            line,
                            format!("{field}.ground_truth"),
                            "a noul's ground_truth must be true or false",
                        ));
                    }
                    labels.push((key.to_string(), truth.clone()));
                }
            }
            "choice" => {
                let mut options = PyObject::new();
                for i in 0..criteria.len() {
                    let option = entry(i, "key")?;
                    let id = str_field(option, "key").ok_or_else(|| {
                        error(
                            line,
                            format!("{field}.criteria[{i}].key"),
                            "must be a string",
                        )
                    })?;
                    let description = str_field(option, "description")
                        .filter(|d| !d.is_empty())
                        .map_or(PyValue::Null, |d| PyValue::Str(d.to_string()));
                    options.insert(id.to_string(), description);
                }
                if question.get("allow_abstain") == Some(&PyValue::Bool(true)) {
                    let abstain = str_field(question, "abstain_key").unwrap_or("none_of_the_above");
                    options.insert(
                        abstain.to_string(),
                        PyValue::Str("None of the listed options applies.".into()),
                    );
                }
                out.insert("criteria".into(), PyValue::Object(options));
                if let Some(truth) = truth {
                    labels.push((key.to_string(), truth.clone()));
                }
            }
            "score" => {
                let mut levels = Vec::new();
                let mut descriptions = Vec::new();
                for i in 0..criteria.len() {
                    let level = entry(i, "level")?;
                    let value = match level.get("level") {
                        Some(PyValue::Int(v)) => v.to_i64(),
                        _ => None,
                    }
                    .ok_or_else(|| {
                        error(
                            line,
                            format!("{field}.criteria[{i}].level"),
                            "must be an integer",
                        )
                    })?;
                    levels.push(value);
                    descriptions.push(PyValue::Str(
                        str_field(level, "description")
                            .filter(|d| !d.is_empty())
                            .map_or_else(|| format!("level {value}"), str::to_string),
                    ));
                }
                out.insert("criteria".into(), PyValue::Array(descriptions));
                if let Some(truth) = truth {
                    let position = match truth {
                        PyValue::Int(v) => {
                            v.to_i64().and_then(|v| levels.iter().position(|&l| l == v))
                        }
                        _ => None,
                    }
                    .ok_or_else(|| {
                        error(
                            line,
                            format!("{field}.ground_truth"),
                            format!("{} is not one of the levels {levels:?}", truth.dumps()),
                        )
                    })?;
                    labels.push((key.to_string(), PyValue::Int(position.into())));
                }
            }
            other => {
                return Err(error(
                    line,
                    format!("{field}.type"),
                    format!("unknown question type {other:?} (choice, noul or score)"),
                ))
            }
        }
        request_questions.insert(key.to_string(), PyValue::Object(out));
    }
    let mut request = PyObject::new();
    request.insert("state".into(), state.clone());
    request.insert("questions".into(), PyValue::Object(request_questions));
    let request = PyValue::Object(request);
    // sys1bench's `TaskItem.row_id()`: task, permutation, and each question's framing, by key.
    framings.sort();
    let permutation = str_field(object, "permutation_id").unwrap_or("p0");
    let id = std::iter::once(task_id.to_string())
        .chain(std::iter::once(permutation.to_string()))
        .chain(framings.iter().map(|(k, f)| format!("{k}:{f}")))
        .collect::<Vec<_>>()
        .join("|");
    let mut tags = Vec::new();
    if let Some(domain) = str_field(object, "domain") {
        tags.push(domain.to_string());
    }
    if let Some(tier) = str_field(object, "tier") {
        tags.push(format!("tier:{tier}"));
    }
    tags.push(format!(
        "lang:{}",
        str_field(object, "language").unwrap_or("en")
    ));
    let mut questions = questions_of(line, &request)?;
    for (key, label) in &labels {
        let field = format!("questions.{key}.ground_truth");
        if let Some(question) = questions.iter_mut().find(|q| &q.name == key) {
            question.label = Some(label_index(line, &field, question, label)?);
        }
    }
    let body = request.dumps();
    Ok(SuiteItem {
        line,
        id,
        request,
        body,
        questions,
        tags,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"id": "a", "request": {"state": "x", "questions": {"t": {"type": "choice", "instructions": "?", "criteria": {"b": null, "c": null}}, "u": {"type": "noul", "instructions": "?"}, "m": {"type": "score", "instructions": "?", "criteria": ["lo", "mid", "hi"]}}}, "labels": {"t": "c", "u": false, "m": 2}, "tags": ["x"]}"#;

    #[test]
    fn a_good_line() {
        let item = parse_line(1, GOOD).unwrap();
        assert_eq!(item.id, "a");
        let labels: Vec<_> = item.questions.iter().map(|q| q.label).collect();
        assert_eq!(labels, [Some(1), Some(1), Some(2)]);
        assert_eq!(item.tags, ["x"]);
    }

    #[test]
    fn bad_lines_name_line_and_field() {
        let cases = [
            (GOOD.replace("\"c\", \"u\"", "\"z\", \"u\""), "labels.t"),
            (GOOD.replace("\"u\": false", "\"u\": \"no\""), "labels.u"),
            (GOOD.replace("\"m\": 2", "\"m\": 3"), "labels.m"),
            (GOOD.replace("\"labels\"", "\"label\""), "label"),
            (GOOD.replace("\"id\": \"a\", ", ""), "id"),
            (GOOD.replace("\"m\": 2}", "\"m\": 2, \"q\": 1}"), "labels.q"),
            (
                GOOD.replace("\"tags\": [\"x\"]", "\"tags\": [1]"),
                "tags[0]",
            ),
            (
                GOOD.replace("\"type\": \"noul\"", "\"type\": \"box\""),
                "request.questions.u.type",
            ),
            ("[1]".to_string(), "line"),
            ("{\"id\": ".to_string(), "line"),
        ];
        for (text, field) in cases {
            let e = parse_line(7, &text).unwrap_err();
            assert_eq!((e.line, e.field.as_str()), (7, field), "{e}");
        }
    }

    #[test]
    fn skip_bad_and_duplicates() {
        let text = format!("{GOOD}\n\nnot json\n{GOOD}\n");
        let e = parse_suite(&text, false).unwrap_err();
        assert_eq!(e.line, 3);
        let suite = parse_suite(&text, true).unwrap();
        assert_eq!(suite.items.len(), 1);
        assert_eq!(
            suite
                .skipped
                .iter()
                .map(|e| (e.line, e.field.as_str()))
                .collect::<Vec<_>>(),
            [(3, "line"), (4, "id")]
        );
    }
}
