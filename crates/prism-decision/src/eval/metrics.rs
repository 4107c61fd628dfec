//! The metrics of `prism eval`, each defined as scikit-learn computes it (the tests compare them with
//! scikit-learn's own output on fixed probability sets, `tests/fixtures/eval/sklearn_metrics.json`).
//!
//! A labelled question is a [`Scored`]: its options' probabilities in the question's order and the index
//! of the label. Its decision is the most likely option (the first on a tie, as the read-out's `choice`);
//! a noul (options `true`, `false`) decides `true` when P(true) ≥ 0.5.
//!
//! - accuracy: the share of decisions equal to the label;
//! - Brier score: Σ_k (p_k − y_k)² over the question's options, halved when it has fewer than 3 options —
//!   `sklearn.metrics.brier_score_loss` with its default `scale_by_half="auto"`, so a noul's is
//!   (P(true) − y)² as for any binary problem;
//! - log loss: −ln p_label with p clipped to [ε, 1 − ε] (ε = f64's machine epsilon), as
//!   `sklearn.metrics.log_loss`;
//! - expected calibration error (ECE) of the top-label confidence (the decision's probability) against
//!   "the decision is the label": `bins` equal-width bins over [0, 1], a value on an inner edge going to the
//!   lower bin (`sklearn.calibration.calibration_curve`'s `np.searchsorted` of the inner edges
//!   `np.linspace(0, 1, bins + 1)`), ECE = Σ over non-empty bins of count / n · |accuracy − mean
//!   confidence|;
//! - for score questions, the mean absolute error of the expected level Σ_i i·p_i against the label.

use serde::{Deserialize, Serialize};

use crate::request::QuestionType;

/// One labelled question's answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    pub kind: QuestionType,
    /// The options' probabilities, in the question's option order (a noul: P(true), P(false)).
    pub probabilities: Vec<f64>,
    /// Index of the label among the options.
    pub label: usize,
}

impl Scored {
    /// The decision: the most likely option (the first on a tie); a noul's is `true` (0) at P(true) ≥ 0.5.
    pub fn decision(&self) -> usize {
        decision(self.kind, &self.probabilities)
    }

    pub fn correct(&self) -> bool {
        self.decision() == self.label
    }

    /// The decision's probability (top-label confidence).
    pub fn confidence(&self) -> f64 {
        self.probabilities
            .get(self.decision())
            .copied()
            .unwrap_or(0.0)
    }

    /// Σ_k (p_k − y_k)², halved below 3 options (scikit-learn's `scale_by_half="auto"`).
    pub fn brier(&self) -> f64 {
        let sum: f64 = self
            .probabilities
            .iter()
            .enumerate()
            .map(|(k, &p)| {
                let y = if k == self.label { 1.0 } else { 0.0 };
                (y - p) * (y - p)
            })
            .sum();
        if self.probabilities.len() < 3 {
            sum / 2.0
        } else {
            sum
        }
    }

    /// −ln p_label, p clipped to [ε, 1 − ε].
    pub fn log_loss(&self) -> f64 {
        let p = self
            .probabilities
            .get(self.label)
            .copied()
            .unwrap_or(0.0)
            .clamp(f64::EPSILON, 1.0 - f64::EPSILON);
        -p.ln()
    }

    /// A score question's expected level Σ_i i·p_i.
    pub fn expected_level(&self) -> Option<f64> {
        (self.kind == QuestionType::Score).then(|| {
            self.probabilities
                .iter()
                .enumerate()
                .map(|(i, &p)| i as f64 * p)
                .sum()
        })
    }
}

/// The decision for a probability vector (see [`Scored::decision`]).
pub fn decision(kind: QuestionType, probabilities: &[f64]) -> usize {
    if kind == QuestionType::Noul {
        return if probabilities.first().copied().unwrap_or(0.0) >= 0.5 {
            0
        } else {
            1
        };
    }
    let mut best = 0;
    for (i, &p) in probabilities.iter().enumerate() {
        if p > probabilities[best] {
            best = i;
        }
    }
    best
}

/// One equal-width bin of the reliability diagram.
// A field list: alike in shape only to other structs' plain fields (`Metrics` below, ...).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bin {
    /// The bin's lower and upper edge.
    pub lo: f64,
    pub hi: f64,
    /// Questions whose confidence fell in it.
    pub count: usize,
    /// Their mean confidence and their accuracy (`null` when empty): scikit-learn's `prob_pred` and
    /// `prob_true`.
    pub confidence: Option<f64>,
    pub accuracy: Option<f64>,
}

/// The inner and outer edges as `np.linspace(0, 1, bins + 1)` computes them (`i * (1 / bins)`, the last
/// exactly 1).
fn edges(bins: usize) -> Vec<f64> {
    let step = 1.0 / bins as f64;
    let mut edges: Vec<f64> = (0..=bins).map(|i| i as f64 * step).collect();
    if let Some(last) = edges.last_mut() {
        *last = 1.0;
    }
    edges
}

/// The bin of a confidence: the number of inner edges strictly below it (`np.searchsorted`, side left).
pub fn bin_of(confidence: f64, edges: &[f64]) -> usize {
    let inner = &edges[1..edges.len() - 1];
    inner.partition_point(|&e| e < confidence)
}

/// The reliability bins of (confidence, correct) pairs, all `bins` of them (empty ones included).
pub fn calibration(pairs: &[(f64, bool)], bins: usize) -> Vec<Bin> {
    let bins = bins.max(1);
    let edges = edges(bins);
    let mut sums = vec![0.0f64; bins];
    let mut hits = vec![0.0f64; bins];
    let mut counts = vec![0usize; bins];
    for &(confidence, correct) in pairs {
        let b = bin_of(confidence, &edges);
        sums[b] += confidence;
        hits[b] += if correct { 1.0 } else { 0.0 };
        counts[b] += 1;
    }
    (0..bins)
        .map(|b| Bin {
            lo: edges[b],
            hi: edges[b + 1],
            count: counts[b],
            confidence: (counts[b] > 0).then(|| sums[b] / counts[b] as f64),
            accuracy: (counts[b] > 0).then(|| hits[b] / counts[b] as f64),
        })
        .collect()
}

/// Σ over non-empty bins of count / n · |accuracy − confidence|; `None` without questions.
pub fn ece(bins: &[Bin]) -> Option<f64> {
    let n: usize = bins.iter().map(|b| b.count).sum();
    if n == 0 {
        return None;
    }
    Some(
        bins.iter()
            .filter_map(|b| match (b.accuracy, b.confidence) {
                (Some(a), Some(c)) => Some(b.count as f64 / n as f64 * (a - c).abs()),
                _ => None,
            })
            .sum(),
    )
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in values {
        sum += v;
        n += 1;
    }
    (n > 0).then(|| sum / n as f64)
}

/// The metrics of a set of labelled questions (overall, one type, or one tag).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    /// Items with at least one labelled question in the set.
    pub items: usize,
    /// Labelled questions.
    pub questions: usize,
    /// Decisions equal to the label.
    pub correct: usize,
    /// The rest are `null` for an empty set.
    pub accuracy: Option<f64>,
    pub ece: Option<f64>,
    pub brier: Option<f64>,
    pub log_loss: Option<f64>,
    /// Mean absolute error of the expected level, over the set's score questions (`null` without any).
    pub score_mae: Option<f64>,
}

impl Metrics {
    /// The metrics of `questions` (in a fixed order: sums run in it), which belong to `items` items.
    pub fn of(questions: &[&Scored], items: usize, bins: usize) -> Metrics {
        let correct = questions.iter().filter(|q| q.correct()).count();
        let pairs: Vec<(f64, bool)> = questions
            .iter()
            .map(|q| (q.confidence(), q.correct()))
            .collect();
        Metrics {
            items,
            questions: questions.len(),
            correct,
            accuracy: (!questions.is_empty()).then(|| correct as f64 / questions.len() as f64),
            ece: ece(&calibration(&pairs, bins)),
            brier: mean(questions.iter().map(|q| q.brier())),
            log_loss: mean(questions.iter().map(|q| q.log_loss())),
            score_mae: mean(questions.iter().filter_map(|q| {
                q.expected_level()
                    .map(|level| (level - q.label as f64).abs())
            })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edge_values_go_to_the_lower_bin_as_in_numpy() {
        let e = edges(10);
        assert_eq!(bin_of(0.0, &e), 0);
        assert_eq!(bin_of(0.1, &e), 0);
        assert_eq!(bin_of(0.1000001, &e), 1);
        assert_eq!(bin_of(1.0, &e), 9);
        // np.linspace(0, 1, 11)[3] is 0.30000000000000004, so 0.3 itself is in bin 2.
        assert_eq!(e[3], 0.30000000000000004);
        assert_eq!(bin_of(0.3, &e), 2);
    }

    #[test]
    fn noul_decides_true_at_one_half() {
        let s = Scored {
            kind: QuestionType::Noul,
            probabilities: vec![0.5, 0.5],
            label: 0,
        };
        assert!(s.correct());
        assert_eq!(s.confidence(), 0.5);
        assert_eq!(s.brier(), 0.25);
    }
}
