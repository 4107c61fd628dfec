//! The `/v1/systemone` response (spec §2), serialised with serde:
//! `{"answers": {name: answer, ...}, "usage": {"input_tokens": n, "output_tokens": m}, "model": name,
//! "x_latency_ms": t}`, answers in the request's question order.

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::pyjson::PyValue;

/// A JSON object that keeps its entries' order.
#[derive(Debug, Clone, PartialEq)]
pub struct OrderedMap<V>(pub Vec<(String, V)>);

impl<V> Default for OrderedMap<V> {
    fn default() -> Self {
        OrderedMap(Vec::new())
    }
}

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

impl<'de, V: Deserialize<'de>> Deserialize<'de> for OrderedMap<V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OrderedVisitor<V>(std::marker::PhantomData<V>);
        impl<'de, V: Deserialize<'de>> Visitor<'de> for OrderedVisitor<V> {
            type Value = OrderedMap<V>;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let mut entries = Vec::new();
                while let Some((key, value)) = map.next_entry::<String, V>()? {
                    entries.push((key, value));
                }
                Ok(OrderedMap(entries))
            }
        }
        deserializer.deserialize_map(OrderedVisitor(std::marker::PhantomData))
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
    /// The most likely option (the first on a tie); `null` (v1.1, `allow_none`) when the none option is
    /// more likely than every listed one.
    pub choice: Option<String>,
    /// `(p − 1/m) / (1 − 1/m)` for the chosen letter's probability `p` among the prompt's `m` letters
    /// (the none option counts as one when it is read).
    pub confidence: f64,
    /// Every listed option's probability, in the criteria's order. With the none option these and
    /// `none_probability` sum to 1.
    pub probabilities: OrderedMap<f64>,
    /// v1.1's none option (`none_check`); absent in v1 and when it was not read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub none_probability: Option<f64>,
    /// The thought's text (`return_thought`, when the question thought).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thought: Option<String>,
    /// `return_details`; an extension field, serialized as `x_details`.
    #[serde(rename = "x_details", skip_serializing_if = "Option::is_none")]
    pub details: Option<AnswerDetails>,
}

/// `{"type": "noul", "noul": P(yes)}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NoulAnswer {
    pub noul: f64,
    /// The thought's text (`return_thought`, when the question thought).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thought: Option<String>,
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
    // `thought` and `details` end every answer type, as they do above: each type spells out its own
    // JSON object, field by field in the spec's order.
    /// The thought's text (`return_thought`, when the question thought).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thought: Option<String>,
    /// `return_details`; an extension field, serialized as `x_details`.
    #[serde(rename = "x_details", skip_serializing_if = "Option::is_none")]
    pub details: Option<AnswerDetails>,
}

/// `return_details`: the answer's read-outs. Every question has its first read-out (`first`); a question
/// that thought (v1.1 AutoThink) also has the read-out after the thought and the thought's facts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AnswerDetails {
    /// The first read-out's probabilities keyed by option id (`true`/`false` for a noul, `"0"`.. for a
    /// score).
    pub first: OrderedMap<f64>,
    /// The none option's probability in the first read-out (when it was read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_none: Option<f64>,
    /// The read-out after the thought, keyed like `first`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_thought: Option<OrderedMap<f64>>,
    /// The none option's probability after the thought.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub after_thought_none: Option<f64>,
    /// Tokens the thought decoded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub thought_tokens: Option<u64>,
    /// Why the thought ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<crate::thought::StopReason>,
    /// Prompts read for this answer (0 for a single option, several for a wide choice, two per group
    /// for Instant).
    pub prompts: usize,
    /// Where the time went, in milliseconds.
    pub timings: AnswerTimings,
}

/// An answer's timings, in milliseconds: `queue` (submission to the first pass of the request),
/// `read` (from then to this question's first read-out), `thought` (decoding its thought and reading
/// again; 0 without one) and `total` (submission to the answer).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize)]
pub struct AnswerTimings {
    pub queue_ms: f64,
    pub read_ms: f64,
    pub thought_ms: f64,
    pub total_ms: f64,
}
