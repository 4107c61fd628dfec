//! The read-out arithmetic (spec §2, §3): letter softmax with the question type's temperature, TypeSafe's
//! confidences, the expected score, and the wide-choice rounds for choices of more than 26 options.
//! Everything is f64.

use std::ops::Range;

use crate::config::WideChoiceConfig;
use crate::render::MAX_PROMPT_OPTIONS;

/// `softmax(logits / temperature)`, computed stably (the largest scaled logit is subtracted first).
pub fn softmax(logits: &[f64], temperature: f64) -> Vec<f64> {
    let scaled: Vec<f64> = logits.iter().map(|&logit| logit / temperature).collect();
    let max = scaled.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let exps: Vec<f64> = scaled.iter().map(|&x| (x - max).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.iter().map(|&e| e / sum).collect()
}

/// Index of the largest probability; the first one on a tie.
pub fn argmax(probabilities: &[f64]) -> usize {
    let mut best = 0;
    for (i, &p) in probabilities.iter().enumerate() {
        if p > probabilities[best] {
            best = i;
        }
    }
    best
}

/// TypeSafe's choice confidence: `(p_max - 1/n) / (1 - 1/n)`; 1 for a single option.
pub fn choice_confidence(probabilities: &[f64]) -> f64 {
    let n = probabilities.len();
    if n <= 1 {
        return 1.0;
    }
    let uniform = 1.0 / n as f64;
    (probabilities[argmax(probabilities)] - uniform) / (1.0 - uniform)
}

/// TypeSafe's score confidence: `max(0, 1 - D_mode / D_uniform)`, where `D_mode = Σ p_i |i - mode|` is the
/// expected distance in levels from the most likely level and `D_uniform = Σ |i - mid| / n` the same for an
/// even spread around the middle level `mid = (n - 1) / 2`. 1 for fewer than 2 levels.
pub fn score_confidence(probabilities: &[f64]) -> f64 {
    let n = probabilities.len();
    if n < 2 {
        return 1.0;
    }
    let mode = argmax(probabilities) as f64;
    let d_mode: f64 = probabilities
        .iter()
        .enumerate()
        .map(|(i, &p)| p * (i as f64 - mode).abs())
        .sum();
    let middle = (n as f64 - 1.0) / 2.0;
    let d_uniform = (0..n).map(|i| (i as f64 - middle).abs()).sum::<f64>() / n as f64;
    (1.0 - d_mode / d_uniform).max(0.0)
}

/// The expected score `Σ i · p_i`.
pub fn expected_score(probabilities: &[f64]) -> f64 {
    probabilities
        .iter()
        .enumerate()
        .map(|(i, &p)| i as f64 * p)
        .sum()
}

/// Splits `0..n` into `ceil(n / group)` contiguous groups whose sizes differ by at most one (the larger
/// ones first).
pub fn near_equal_groups(n: usize, group: usize) -> Vec<Range<usize>> {
    if n == 0 {
        return Vec::new();
    }
    let count = n.div_ceil(group.max(1));
    let (size, extra) = (n / count, n % count);
    let mut start = 0;
    (0..count)
        .map(|g| {
            let len = size + usize::from(g < extra);
            let range = start..start + len;
            start += len;
            range
        })
        .collect()
}

/// One finished group round of a wide choice.
#[derive(Debug, Clone)]
struct WideRound {
    /// The options read in this round (indices into the question's options, ascending).
    candidates: Vec<usize>,
    /// Each candidate's probability within its group.
    first: Vec<f64>,
    /// Whether each candidate went on to the next round.
    kept: Vec<bool>,
}

/// The read-out of one choice in rounds, driven by its caller: ask [`WideChoice::groups`] which option
/// sets to read, read each as one prompt, give the probabilities to [`WideChoice::feed`], repeat until it
/// returns the final distribution.
///
/// With at most 26 options there is a single, final round. With more, the options are split into near-equal
/// groups of at most `group`; each group is read and its top `keep` go on (in their original order) to the
/// next round, which is again split if it still has more than 26. The options of the final round share
/// `1 - residual` by their final read-out; at every group round the options that did not go on share
/// `residual` of what that round passed down, in proportion to their probabilities within their group.
#[derive(Debug, Clone)]
pub struct WideChoice {
    config: WideChoiceConfig,
    n: usize,
    rounds: Vec<WideRound>,
    candidates: Vec<usize>,
    groups: Vec<Vec<usize>>,
}

impl WideChoice {
    /// Starts the read-out of `n` options (n >= 1). `config` must be valid ([`crate::DecisionConfig::validate`]).
    pub fn new(n: usize, config: &WideChoiceConfig) -> Self {
        let mut wide = WideChoice {
            config: config.clone(),
            n,
            rounds: Vec::new(),
            candidates: (0..n).collect(),
            groups: Vec::new(),
        };
        wide.groups = wide.split();
        wide
    }

    fn split(&self) -> Vec<Vec<usize>> {
        if self.candidates.len() <= MAX_PROMPT_OPTIONS {
            return vec![self.candidates.clone()];
        }
        near_equal_groups(self.candidates.len(), self.config.group)
            .into_iter()
            .map(|range| self.candidates[range].to_vec())
            .collect()
    }

    /// The option sets to read in this round, each one prompt (indices into the options, in letter order).
    /// A single set means this is the final round.
    pub fn groups(&self) -> &[Vec<usize>] {
        &self.groups
    }

    /// Gives this round's probabilities (one vector per group, in [`WideChoice::groups`] order) and returns
    /// the final probabilities of all `n` options when this was the last round.
    pub fn feed(&mut self, probabilities: &[Vec<f64>]) -> Result<Option<Vec<f64>>, String> {
        if probabilities.len() != self.groups.len()
            || probabilities
                .iter()
                .zip(&self.groups)
                .any(|(p, g)| p.len() != g.len())
        {
            return Err(format!(
                "wide choice: expected read-outs of sizes {:?}, got {:?}",
                self.groups.iter().map(Vec::len).collect::<Vec<_>>(),
                probabilities.iter().map(Vec::len).collect::<Vec<_>>()
            ));
        }
        if self.groups.len() == 1 {
            return Ok(Some(self.compose(&probabilities[0])));
        }
        let mut first = vec![0.0; self.n];
        let mut kept = vec![false; self.n];
        for (group, p) in self.groups.iter().zip(probabilities) {
            let mut order: Vec<usize> = (0..group.len()).collect();
            // Stable: on equal probabilities the earlier option goes on.
            order.sort_by(|&a, &b| p[b].total_cmp(&p[a]));
            for &position in order.iter().take(self.config.keep) {
                kept[group[position]] = true;
            }
            for (position, &option) in group.iter().enumerate() {
                first[option] = p[position];
            }
        }
        let round = WideRound {
            candidates: self.candidates.clone(),
            first: self.candidates.iter().map(|&c| first[c]).collect(),
            kept: self.candidates.iter().map(|&c| kept[c]).collect(),
        };
        let next: Vec<usize> = self
            .candidates
            .iter()
            .copied()
            .filter(|&c| kept[c])
            .collect();
        if next.len() >= self.candidates.len() {
            return Err(format!(
                "wide choice: a round of {} options kept them all",
                self.candidates.len()
            ));
        }
        self.rounds.push(round);
        self.candidates = next;
        self.groups = self.split();
        Ok(None)
    }

    /// Unwinds the rounds from the final read-out to the probabilities of all options.
    fn compose(&self, last: &[f64]) -> Vec<f64> {
        let residual = self.config.residual;
        let mut p = vec![0.0; self.n];
        for (&option, &q) in self.candidates.iter().zip(last) {
            p[option] = q;
        }
        for round in self.rounds.iter().rev() {
            let left_behind: f64 = round
                .first
                .iter()
                .zip(&round.kept)
                .filter(|(_, &kept)| !kept)
                .map(|(&f, _)| f)
                .sum();
            let behind_count = round.kept.iter().filter(|&&kept| !kept).count();
            for ((&option, &first), &kept) in
                round.candidates.iter().zip(&round.first).zip(&round.kept)
            {
                p[option] = if kept {
                    p[option] * (1.0 - residual)
                } else if left_behind > 0.0 {
                    residual * first / left_behind
                } else {
                    // Every left-behind probability underflowed to zero: share the residual evenly.
                    residual / behind_count as f64
                };
            }
        }
        p
    }
}
