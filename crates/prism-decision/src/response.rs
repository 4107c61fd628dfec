//! The `/v1/systemone` response (spec §2), serialised with serde:
//! `{"answers": {name: answer, ...}, "usage": {"input_tokens": n, "output_tokens": m}, "model": name,
//! "x_latency_ms": t}`, answers in the request's question order.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

use crate::pyjson::PyValue;

/// A JSON object that keeps its entries' order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct OrderedMap<V>(pub Vec<(String, V)>);

impl<V> OrderedMap<V> {
    pub fn get(&self, key: &str) -> Option<&V> {
        self.0.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &V)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }
}

impl<V: Serialize> Serialize for OrderedMap<V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecisionResponse {
    pub answers: OrderedMap<Answer>,
    pub usage: Usage,
    pub model: String,
    /// Wall time of the decision procedure (rendering, model calls, read-out), in milliseconds.
    /// Serialized as `x_latency_ms`: an extension field (the reference API has none).
    #[serde(rename = "x_latency_ms")]
    pub latency_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Usage {
    pub input_tokens: u64,
    pub output_tokens: u64,
}

/// One question's answer, tagged by `type`.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Answer {
    Choice(ChoiceAnswer),
    Noul(NoulAnswer),
    Score(ScoreAnswer),
}

/// `{"type": "choice", "choice": id, "confidence": c, "probabilities": {id: p, ...}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChoiceAnswer {
    /// The most likely option (the first on a tie).
    pub choice: String,
    pub confidence: f64,
    /// Every option's probability, in the criteria's order.
    pub probabilities: OrderedMap<f64>,
    /// v1.1's none option; absent in v1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub none_probability: Option<f64>,
    /// `return_details`; an extension field, serialized as `x_details`.
    #[serde(rename = "x_details", skip_serializing_if = "Option::is_none")]
    pub details: Option<AnswerDetails>,
}

/// `{"type": "noul", "noul": P(yes)}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NoulAnswer {
    pub noul: f64,
    /// `return_details`; an extension field, serialized as `x_details`.
    #[serde(rename = "x_details", skip_serializing_if = "Option::is_none")]
    pub details: Option<AnswerDetails>,
}

/// `{"type": "score", "score": Σ i·p_i, "confidence": c, "legend": {"0": level, ...}, "probabilities": {"0": p, ...}}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScoreAnswer {
    pub score: f64,
    pub confidence: f64,
    /// Each level's description as sent, keyed `"0"`..`"n-1"`.
    pub legend: OrderedMap<PyValue>,
    pub probabilities: OrderedMap<f64>,
    /// `return_details`; an extension field, serialized as `x_details`.
    #[serde(rename = "x_details", skip_serializing_if = "Option::is_none")]
    pub details: Option<AnswerDetails>,
}

/// `return_details`: the answer's read-outs. v1 has one read-out per question (`first`); `after_thought`
/// comes with AutoThink (v1.1).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AnswerDetails {
    /// The read-out's probabilities keyed by option id (`true`/`false` for a noul, `"0"`.. for a score).
    pub first: OrderedMap<f64>,
    /// Prompts read for this answer (0 for a single option, several for a wide choice).
    pub prompts: usize,
}
