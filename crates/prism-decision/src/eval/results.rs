//! Each item's answers, the run's summary (`results.json`) and the comparison of two runs.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::metrics::{calibration, decision, Bin, Metrics, Scored};
use super::suite::SuiteItem;
use crate::pyjson::{self, PyValue};
use crate::request::QuestionType;

/// A JSON object whose entries keep their order: the response's
/// [`OrderedMap`](crate::response::OrderedMap), read back as well as written.
pub use crate::response::OrderedMap as Ordered;

/// What became of an item.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ItemStatus {
    /// Every question answered.
    Answered,
    /// The engine or server refused the request (e.g. a 422); not in the metrics.
    Refused,
    /// No usable answer (a transport error, a 5xx, a response without an answer); not in the metrics.
    Failed,
}

/// One question's answer and label.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuestionResult {
    #[serde(rename = "type")]
    pub kind: QuestionType,
    /// The label's option id (`"true"`/`"false"` for a noul, `"0"`.. for a score); `null` unlabelled.
    pub label: Option<String>,
    /// The most likely option (a noul: `"true"` at P(true) ≥ 0.5).
    pub decision: String,
    /// Whether the decision is the label (`null` unlabelled).
    pub correct: Option<bool>,
    /// Every option's probability, in the question's order (a noul: P(true), and P(false) = 1 − P(true)).
    pub probabilities: Ordered<f64>,
    /// A score's expected level Σ i·p_i (computed from `probabilities`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_level: Option<f64>,
}

impl QuestionResult {
    fn values(&self) -> Vec<f64> {
        self.probabilities.0.iter().map(|(_, p)| *p).collect()
    }

    /// The labelled question for the metrics.
    pub fn scored(&self) -> Option<Scored> {
        let label = self.label.as_deref()?;
        let index = self.probabilities.0.iter().position(|(k, _)| k == label)?;
        Some(Scored {
            kind: self.kind,
            probabilities: self.values(),
            label: index,
        })
    }
}

/// One item of the run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ItemResult {
    pub id: String,
    /// Its line in the suite.
    pub line: usize,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<String>,
    pub status: ItemStatus,
    /// Why it was refused or failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Each question's answer, in the request's order (empty unless answered).
    #[serde(default)]
    pub answers: Ordered<QuestionResult>,
}

impl ItemResult {
    /// An item without answers.
    pub fn not_answered(item: &SuiteItem, status: ItemStatus, error: String) -> ItemResult {
        ItemResult {
            id: item.id.clone(),
            line: item.line,
            tags: item.tags.clone(),
            status,
            error: Some(error),
            answers: Ordered::default(),
        }
    }
}

/// Why a response body gives no answers, or a results file cannot be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ResultsError {
    #[error("the response is not JSON: {0}")]
    NotJson(String),
    #[error("the response has no answer for question {question:?}")]
    MissingAnswer { question: String },
    #[error("question {question:?}: {message}")]
    BadAnswer { question: String, message: String },
    #[error("not a prism eval results.json: {0}")]
    BadResults(String),
}

fn number(value: Option<&PyValue>) -> Option<f64> {
    value.and_then(PyValue::as_f64).filter(|p| p.is_finite())
}

/// Reads each question's probabilities from a `/v1/systemone` response body (parsed with Python's
/// float semantics, so a body and the in-process response it was printed from give the same numbers).
pub fn answers_from_response(item: &SuiteItem, body: &[u8]) -> Result<ItemResult, ResultsError> {
    let value = pyjson::parse_bytes(body).map_err(|e| ResultsError::NotJson(e.to_string()))?;
    let answers = value
        .as_object()
        .and_then(|o| o.get("answers"))
        .and_then(PyValue::as_object)
        .ok_or_else(|| ResultsError::NotJson("no \"answers\" object".into()))?;
    let mut out = Vec::new();
    for question in &item.questions {
        let bad = |message: String| ResultsError::BadAnswer {
            question: question.name.clone(),
            message,
        };
        let answer = answers
            .get(&question.name)
            .and_then(PyValue::as_object)
            .ok_or_else(|| ResultsError::MissingAnswer {
                question: question.name.clone(),
            })?;
        let kind = answer.get("type").and_then(PyValue::as_str);
        if kind != Some(question.kind.as_str()) {
            return Err(bad(format!(
                "answered as type {kind:?}, asked as {}",
                question.kind.as_str()
            )));
        }
        let probabilities: Vec<(String, f64)> = match question.kind {
            QuestionType::Noul => {
                let p =
                    number(answer.get("noul")).ok_or_else(|| bad("no number \"noul\"".into()))?;
                vec![("true".into(), p), ("false".into(), 1.0 - p)]
            }
            QuestionType::Choice | QuestionType::Score => {
                let map = answer
                    .get("probabilities")
                    .and_then(PyValue::as_object)
                    .ok_or_else(|| bad("no \"probabilities\" object".into()))?;
                question
                    .options
                    .iter()
                    .map(|id| {
                        number(map.get(id))
                            .map(|p| (id.clone(), p))
                            .ok_or_else(|| bad(format!("no probability for option {id:?}")))
                    })
                    .collect::<Result<_, _>>()?
            }
        };
        let values: Vec<f64> = probabilities.iter().map(|(_, p)| *p).collect();
        let decided = decision(question.kind, &values);
        let label = question.label;
        out.push((
            question.name.clone(),
            QuestionResult {
                kind: question.kind,
                label: label.map(|l| question.options[l].clone()),
                decision: question.options[decided].clone(),
                correct: label.map(|l| l == decided),
                expected_level: (question.kind == QuestionType::Score)
                    .then(|| values.iter().enumerate().map(|(i, p)| i as f64 * p).sum()),
                probabilities: Ordered(probabilities),
            },
        ));
    }
    Ok(ItemResult {
        id: item.id.clone(),
        line: item.line,
        tags: item.tags.clone(),
        status: ItemStatus::Answered,
        error: None,
        answers: Ordered(out),
    })
}

/// The run's numbers (`results.json`'s `summary`).
// A field list of counts and rates: alike in shape only to other structs' plain fields (the suite's,
// a request's, the loadgen options).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Every suite item was run (false after Ctrl-C: a partial report).
    pub complete: bool,
    /// Items in the suite (bad lines skipped with `--skip-bad` not counted).
    pub suite_items: usize,
    /// Items answered.
    pub items: usize,
    pub refused: usize,
    pub failed: usize,
    /// Items not run (Ctrl-C).
    pub not_run: usize,
    /// Labelled questions answered (what the metrics are over).
    pub questions: usize,
    pub unlabelled_questions: usize,
    // From here the overall [`Metrics`]' fields, in the order results.json has always listed them
    // (its `items` counts only labelled items, this one all answered): a field list, not shared logic.
    pub correct: usize,
    pub accuracy: Option<f64>,
    pub ece: Option<f64>,
    pub brier: Option<f64>,
    pub log_loss: Option<f64>,
    pub score_mae: Option<f64>,
    /// Bins of the ECE and the reliability diagram.
    pub bins: usize,
    /// Every bin of all labelled questions' top-label confidence.
    pub reliability: Vec<Bin>,
    /// The metrics of each question type present (`choice`, `noul`, `score`).
    pub by_type: BTreeMap<String, Metrics>,
    /// The metrics of each tag's items.
    pub by_tag: BTreeMap<String, Metrics>,
}

/// The summary of `items` (in suite order) from a suite of `suite_items`.
pub fn summarize(suite_items: usize, items: &[ItemResult], bins: usize) -> Summary {
    let bins = bins.max(1);
    // (item index, the labelled question, the item's tags)
    type Entry<'a> = (usize, Scored, &'a [String]);
    let mut all: Vec<Entry> = Vec::new();
    let mut unlabelled = 0;
    for (i, item) in items.iter().enumerate() {
        if item.status != ItemStatus::Answered {
            continue;
        }
        for (_, answer) in &item.answers.0 {
            match answer.scored() {
                Some(scored) => all.push((i, scored, &item.tags)),
                None => unlabelled += 1,
            }
        }
    }
    let subset = |keep: &dyn Fn(&Entry) -> bool| -> Metrics {
        let chosen: Vec<&Entry> = all.iter().filter(|e| keep(e)).collect();
        let distinct: BTreeSet<usize> = chosen.iter().map(|e| e.0).collect();
        let scored: Vec<&Scored> = chosen.iter().map(|e| &e.1).collect();
        Metrics::of(&scored, distinct.len(), bins)
    };
    let overall = subset(&|_| true);
    let mut by_type = BTreeMap::new();
    for kind in [
        QuestionType::Choice,
        QuestionType::Noul,
        QuestionType::Score,
    ] {
        if all.iter().any(|e| e.1.kind == kind) {
            by_type.insert(kind.as_str().to_string(), subset(&|e| e.1.kind == kind));
        }
    }
    let tags: BTreeSet<&str> = all
        .iter()
        .flat_map(|e| e.2.iter().map(String::as_str))
        .collect();
    let mut by_tag = BTreeMap::new();
    for tag in tags {
        by_tag.insert(tag.to_string(), subset(&|e| e.2.iter().any(|t| t == tag)));
    }
    let pairs: Vec<(f64, bool)> = all
        .iter()
        .map(|e| (e.1.confidence(), e.1.correct()))
        .collect();
    let count = |status| items.iter().filter(|i| i.status == status).count();
    Summary {
        complete: items.len() == suite_items,
        suite_items,
        items: count(ItemStatus::Answered),
        refused: count(ItemStatus::Refused),
        failed: count(ItemStatus::Failed),
        not_run: suite_items.saturating_sub(items.len()),
        questions: overall.questions,
        unlabelled_questions: unlabelled,
        correct: overall.correct,
        accuracy: overall.accuracy,
        ece: overall.ece,
        brier: overall.brier,
        log_loss: overall.log_loss,
        score_mae: overall.score_mae,
        bins,
        reliability: calibration(&pairs, bins),
        by_type,
        by_tag,
    }
}

/// A question whose decision differs between two runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Flip {
    pub id: String,
    pub question: String,
    /// This run's decision and its probability.
    pub decision: String,
    pub p: f64,
    /// The other run's decision and its probability.
    pub other_decision: String,
    pub other_p: f64,
    /// The label, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
}

/// Agreement and probability drift between this run and another (`--compare`).
// A field list: alike in shape only to other structs' plain fields (a request's, a model segment's).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The other run's file.
    pub other: String,
    /// Questions answered in both runs with the same options (what the rest is over).
    pub questions: usize,
    /// Of them, questions decided the same.
    pub agreeing: usize,
    pub agreement: Option<f64>,
    /// |Δp| over every option of those questions (a noul's P(true) only).
    pub mean_abs_dp: Option<f64>,
    pub max_abs_dp: Option<f64>,
    /// Where the largest |Δp| is: item id, question, option.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_abs_dp_at: Option<(String, String, String)>,
    /// Every question whose decision differs, in this run's order.
    pub flipped: Vec<Flip>,
    /// Questions answered here but not there, and there but not here.
    pub only_here: usize,
    pub only_other: usize,
    /// Questions in both with different option lists (not compared).
    pub mismatched: usize,
}

/// Compares this run's answered items with another run's, matched by item id and question key.
pub fn compare(other_name: &str, this: &[ItemResult], other: &[ItemResult]) -> Comparison {
    let answered = |items: &[ItemResult]| -> Vec<(String, String, QuestionResult)> {
        items
            .iter()
            .filter(|i| i.status == ItemStatus::Answered)
            .flat_map(|i| {
                i.answers
                    .0
                    .iter()
                    .map(move |(q, a)| (i.id.clone(), q.clone(), a.clone()))
            })
            .collect()
    };
    let here = answered(this);
    let there: HashMap<(String, String), QuestionResult> = answered(other)
        .into_iter()
        .map(|(id, q, a)| ((id, q), a))
        .collect();
    let mut out = Comparison {
        other: other_name.to_string(),
        questions: 0,
        agreeing: 0,
        agreement: None,
        mean_abs_dp: None,
        max_abs_dp: None,
        max_abs_dp_at: None,
        flipped: Vec::new(),
        only_here: 0,
        only_other: 0,
        mismatched: 0,
    };
    let (mut sum, mut n, mut max) = (0.0f64, 0usize, None::<f64>);
    let mut matched = 0usize;
    for (id, question, a) in &here {
        let Some(b) = there.get(&(id.clone(), question.clone())) else {
            out.only_here += 1;
            continue;
        };
        matched += 1;
        let keys = |r: &QuestionResult| -> Vec<String> {
            r.probabilities.0.iter().map(|(k, _)| k.clone()).collect()
        };
        // A file read from disk may hold anything: questions without options are not compared.
        if a.kind != b.kind || keys(a) != keys(b) || a.probabilities.0.is_empty() {
            out.mismatched += 1;
            continue;
        }
        out.questions += 1;
        let (pa, pb) = (a.values(), b.values());
        let (da, db) = (decision(a.kind, &pa), decision(b.kind, &pb));
        if da == db {
            out.agreeing += 1;
        } else {
            out.flipped.push(Flip {
                id: id.clone(),
                question: question.clone(),
                decision: a.probabilities.0[da].0.clone(),
                p: pa[da],
                other_decision: b.probabilities.0[db].0.clone(),
                other_p: pb[db],
                label: a.label.clone(),
            });
        }
        let compared = if a.kind == QuestionType::Noul {
            1
        } else {
            pa.len()
        };
        for k in 0..compared {
            let d = (pa[k] - pb[k]).abs();
            sum += d;
            n += 1;
            if max.is_none_or(|m| d > m) {
                max = Some(d);
                out.max_abs_dp_at =
                    Some((id.clone(), question.clone(), a.probabilities.0[k].0.clone()));
            }
        }
    }
    out.only_other = there.len() - matched;
    out.agreement = (out.questions > 0).then(|| out.agreeing as f64 / out.questions as f64);
    out.mean_abs_dp = (n > 0).then(|| sum / n as f64);
    out.max_abs_dp = max;
    out
}

/// `results.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalResults {
    /// The file format's version (1).
    pub prism_eval: u32,
    /// The suite file.
    pub suite: String,
    /// How the run was made (model, precision, device or URL, time, rate): free-form, for people.
    #[serde(default)]
    pub run: serde_json::Value,
    pub summary: Summary,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compare: Option<Comparison>,
    /// Bad lines passed over with `--skip-bad`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped_lines: Vec<String>,
    /// Every item run, in suite order.
    pub items: Vec<ItemResult>,
}

impl EvalResults {
    /// Reads a `results.json` (floats parsed exactly, as Python does).
    pub fn from_bytes(bytes: &[u8]) -> Result<EvalResults, ResultsError> {
        let value =
            pyjson::parse_bytes(bytes).map_err(|e| ResultsError::BadResults(e.to_string()))?;
        let value =
            serde_json::to_value(&value).map_err(|e| ResultsError::BadResults(e.to_string()))?;
        serde_json::from_value(value).map_err(|e| ResultsError::BadResults(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(id: &str, probabilities: Vec<(&str, f64)>) -> ItemResult {
        ItemResult {
            id: id.into(),
            line: 1,
            tags: Vec::new(),
            status: ItemStatus::Answered,
            error: None,
            answers: Ordered(vec![(
                "q".into(),
                QuestionResult {
                    kind: QuestionType::Choice,
                    label: None,
                    decision: String::new(),
                    correct: None,
                    probabilities: Ordered(
                        probabilities
                            .into_iter()
                            .map(|(k, p)| (k.to_string(), p))
                            .collect(),
                    ),
                    expected_level: None,
                },
            )]),
        }
    }

    #[test]
    fn compare_counts_flips_drift_and_unmatched_questions() {
        let here = [
            item("a", vec![("x", 0.6), ("y", 0.4)]),
            item("b", vec![("x", 0.2), ("y", 0.8)]),
            item("c", vec![]),
            item("d", vec![("x", 1.0)]),
        ];
        let there = [
            item("a", vec![("x", 0.4), ("y", 0.6)]),
            item("b", vec![("x", 0.1), ("y", 0.9)]),
            item("c", vec![]),
            item("e", vec![("x", 1.0)]),
        ];
        let c = compare("other", &here, &there);
        assert_eq!((c.questions, c.agreeing, c.mismatched), (2, 1, 1));
        assert_eq!((c.only_here, c.only_other), (1, 1));
        assert_eq!(c.flipped.len(), 1);
        assert_eq!(
            (
                c.flipped[0].decision.as_str(),
                c.flipped[0].other_decision.as_str()
            ),
            ("x", "y")
        );
        let max = c.max_abs_dp.unwrap();
        assert!((max - 0.2).abs() < 1e-12);
        assert!((c.mean_abs_dp.unwrap() - 0.15).abs() < 1e-12);
    }
}
