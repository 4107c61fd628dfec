//! AutoThink's thought decoding, model-free: the seeded sampler, the loop detector, stop reasons and the
//! seeds of a question's thought.
//!
//! Everything here depends only on the logits handed in and on the seed, so a thought is reproducible:
//! on the exact paths (the CPU, and the integer path on a GPU) a question's logits do not depend on what
//! else runs, hence neither does its thought.

use serde::Serialize;

use crate::config::{LoopDetectorConfig, SamplingConfig};

/// Why a thought ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// The model closed the thought itself (`</think>`).
    EndOfThought,
    /// The model ended its turn (an end-of-sequence token) inside the thought.
    EndOfSequence,
    /// `think_budget` tokens were decoded.
    Budget,
    /// The loop detector saw runaway repetition.
    Loop,
    /// The sequence reached the server's longest prompt (`--max-tokens`).
    Length,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::EndOfThought => "end_of_thought",
            StopReason::EndOfSequence => "end_of_sequence",
            StopReason::Budget => "budget",
            StopReason::Loop => "loop",
            StopReason::Length => "length",
        }
    }
}

/// 64-bit mixing function (SplitMix64's finalizer): a bijection that spreads every input bit.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01B3);
    }
    hash
}

/// The seed of a question's thought given the request's `seed`: the request seed mixed with the
/// question's name, so that two questions of one request get different thoughts.
pub fn seed_from_request(seed: u64, question: &str) -> u64 {
    mix64(seed ^ mix64(fnv1a(question.bytes())))
}

/// The seed of a thought when the request gave none: a hash of the thinking prompt's tokens, so the same
/// prompt always gets the same thought.
pub fn seed_from_tokens(tokens: &[u32]) -> u64 {
    mix64(fnv1a(tokens.iter().flat_map(|t| t.to_le_bytes())))
}

/// Draws thought tokens from logits: temperature, then `top_k`, `min_p` and `top_p` cuts, then one draw
/// with the `step`-th uniform number of the seed's stream. The candidates are ordered by logit, ties by
/// token id, and every sum runs in that fixed order in f64, so the draw is a function of
/// (logits, settings, seed, step) alone.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplingConfig,
    seed: u64,
    step: u64,
}

/// Why no token could be drawn.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    #[error("no logits to sample from")]
    Empty,
    #[error("the logits hold no finite value (the forward pass diverged)")]
    NotFinite,
}

impl Sampler {
    pub fn new(config: SamplingConfig, seed: u64) -> Self {
        Sampler {
            config,
            seed,
            step: 0,
        }
    }

    /// Tokens drawn so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The `step`-th uniform number in [0, 1) of the seed's stream.
    pub fn uniform(seed: u64, step: u64) -> f64 {
        let bits = mix64(seed ^ mix64(step.wrapping_add(0x5851_F42D_4C95_7F2D)));
        (bits >> 11) as f64 / (1u64 << 53) as f64
    }

    /// How many of a row's best logits a draw needs: 1 when greedy, `top_k` (0: the whole row).
    pub fn needs(&self) -> usize {
        if self.config.temperature == 0.0 {
            1
        } else {
            self.config.top_k
        }
    }

    /// Draws the next token from a whole row of logits (`logits[t]` is token `t`'s).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        self.draw(logits, None)
    }

    /// Draws the next token from candidates (`values[i]` is token `ids[i]`'s) that include the row's
    /// [`Self::needs`] best logits: the same token as from the whole row.
    pub fn sample_candidates(&mut self, values: &[f32], ids: &[u32]) -> Result<u32, SampleError> {
        if values.len() != ids.len() {
            return Err(SampleError::Empty);
        }
        self.draw(values, Some(ids))
    }

    /// NaN logits are never drawn; a non-finite row is an error.
    fn draw(&mut self, logits: &[f32], ids: Option<&[u32]>) -> Result<u32, SampleError> {
        let step = self.step;
        self.step += 1;
        if logits.is_empty() {
            return Err(SampleError::Empty);
        }
        let greedy = self.config.temperature == 0.0;
        let k = if greedy {
            1
        } else if self.config.top_k == 0 {
            logits.len()
        } else {
            self.config.top_k
        };
        let candidates = best_tokens(logits, ids, k);
        if candidates.is_empty() {
            return Err(SampleError::NotFinite);
        }
        if greedy || candidates.len() == 1 {
            return Ok(candidates[0].1);
        }
        let top = f64::from(candidates[0].0);
        let temperature = self.config.temperature;
        let mut weights: Vec<f64> = candidates
            .iter()
            .map(|&(l, _)| ((f64::from(l) - top) / temperature).exp())
            .collect();
        // min_p: relative to the top token's weight (which is 1).
        if self.config.min_p > 0.0 {
            let keep = weights
                .iter()
                .take_while(|&&w| w >= self.config.min_p)
                .count();
            weights.truncate(keep.max(1));
        }
        let total: f64 = weights.iter().sum();
        if self.config.top_p < 1.0 {
            let mut sum = 0.0;
            let mut keep = weights.len();
            for (i, w) in weights.iter().enumerate() {
                sum += w;
                if sum >= self.config.top_p * total {
                    keep = i + 1;
                    break;
                }
            }
            weights.truncate(keep.max(1));
        }
        let total: f64 = weights.iter().sum();
        let target = Self::uniform(self.seed, step) * total;
        let mut sum = 0.0;
        for (i, w) in weights.iter().enumerate() {
            sum += w;
            if target < sum {
                return Ok(candidates[i].1);
            }
        }
        Ok(candidates[weights.len() - 1].1)
    }
}

/// The `k` best finite logits as (logit, token id), best first, ties by the smaller id: one pass over the
/// row keeping a sorted buffer of `k` (a whole sort only when `k` is the whole row).
fn best_tokens(logits: &[f32], ids: Option<&[u32]>, k: usize) -> Vec<(f32, u32)> {
    // `a` ranks before `b`.
    let before = |a: &(f32, u32), b: &(f32, u32)| a.0 > b.0 || (a.0 == b.0 && a.1 < b.1);
    let id = |i: usize| ids.map_or(i as u32, |ids| ids[i]);
    let finite = logits
        .iter()
        .enumerate()
        .filter(|(_, l)| l.is_finite())
        .map(|(i, &l)| (l, id(i)));
    if k >= logits.len() / 8 {
        let mut all: Vec<(f32, u32)> = finite.collect();
        all.sort_unstable_by(|a, b| {
            b.0.partial_cmp(&a.0)
                .unwrap_or(std::cmp::Ordering::Equal)
                .then(a.1.cmp(&b.1))
        });
        all.truncate(k);
        return all;
    }
    let mut best: Vec<(f32, u32)> = Vec::with_capacity(k + 1);
    for candidate in finite {
        if best.len() == k && !before(&candidate, &best[k - 1]) {
            continue;
        }
        let at = best.partition_point(|b| before(b, &candidate));
        best.insert(at, candidate);
        best.truncate(k);
    }
    best
}

/// A runaway repetition the detector saw: the last `span` tokens repeat a unit of `period` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repetition {
    pub period: usize,
    pub span: usize,
}

/// Watches a thought token by token for runaway repetition: its last tokens repeating a unit of at most
/// `max_period` tokens at least `min_repeats` times in a row over at least `min_span` tokens.
///
/// For every period `p` it keeps how many tokens in a row at the end equal the token `p` before them,
/// so each token costs `max_period` comparisons and the detector never rescans the thought.
#[derive(Debug, Clone)]
pub struct LoopDetector {
    config: LoopDetectorConfig,
    /// The last `max_period` tokens, a ring.
    recent: Vec<u32>,
    seen: usize,
    /// `runs[p - 1]`: the trailing tokens that equal the token `p` before them.
    runs: Vec<usize>,
}

impl LoopDetector {
    pub fn new(config: LoopDetectorConfig) -> Self {
        let periods = config.max_period.max(1);
        LoopDetector {
            recent: vec![0; periods],
            seen: 0,
            runs: vec![0; periods],
            config,
        }
    }

    /// Takes the next token; the repetition it completes, if any (the shortest period first).
    pub fn push(&mut self, token: u32) -> Option<Repetition> {
        let periods = self.runs.len();
        for p in 1..=periods.min(self.seen) {
            let before = self.recent[(self.seen - p) % periods];
            let run = &mut self.runs[p - 1];
            *run = if before == token { *run + 1 } else { 0 };
        }
        self.recent[self.seen % periods] = token;
        self.seen += 1;
        (1..=periods.min(self.seen)).find_map(|p| {
            let span = self.runs[p - 1] + p;
            (self.runs[p - 1] > 0
                && span >= self.config.min_span
                && span / p >= self.config.min_repeats)
                .then_some(Repetition { period: p, span })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detector(max_period: usize, min_repeats: usize, min_span: usize) -> LoopDetector {
        LoopDetector::new(LoopDetectorConfig {
            max_period,
            min_repeats,
            min_span,
        })
    }

    #[test]
    fn a_repeated_unit_is_caught_once_it_covers_the_span() {
        let mut d = detector(8, 3, 12);
        let unit = [5u32, 6, 7, 8];
        let mut caught = None;
        for (i, &t) in unit.iter().cycle().take(40).enumerate() {
            if let Some(r) = d.push(t) {
                caught = Some((i + 1, r));
                break;
            }
        }
        // 12 tokens = three copies of the unit.
        assert_eq!(
            caught,
            Some((
                12,
                Repetition {
                    period: 4,
                    span: 12
                }
            ))
        );
    }

    #[test]
    fn varied_text_is_not_a_loop() {
        let mut d = detector(16, 3, 8);
        for t in 0..1000u32 {
            assert_eq!(d.push(t % 97 + t / 97), None, "token {t}");
        }
    }

    #[test]
    fn sampling_is_a_function_of_seed_and_step() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let config = SamplingConfig::default();
        let draw = |seed| {
            let mut s = Sampler::new(config.clone(), seed);
            (0..50)
                .map(|_| s.sample(&logits).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // top_k = 20 keeps only the 20 best tokens (ties by id): every draw is among them.
        let mut order: Vec<u32> = (0..100).collect();
        order.sort_by(|&a, &b| {
            logits[b as usize]
                .partial_cmp(&logits[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        let best: Vec<u32> = order[..20].to_vec();
        assert!(draw(9).iter().all(|t| best.contains(t)));
    }

    #[test]
    fn the_streaming_top_k_is_the_sorted_prefix() {
        let logits: Vec<f32> = (0..5000u32)
            .map(|i| ((i.wrapping_mul(2_654_435_761) >> 7) % 1000) as f32 * 0.01)
            .collect();
        let mut sorted: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (l, i as u32))
            .collect();
        sorted.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
        for k in [1, 2, 20, 100, 5000] {
            assert_eq!(best_tokens(&logits, None, k), sorted[..k], "k = {k}");
        }
        assert_eq!(
            best_tokens(&[f32::NAN, 1.0, f32::INFINITY, 1.0], None, 3),
            [(1.0, 1), (1.0, 3)]
        );
        // Candidates with their ids: the same best as the whole row when they include them.
        let ids: Vec<u32> = (0..5000).rev().collect();
        let values: Vec<f32> = ids.iter().map(|&i| logits[i as usize]).collect();
        assert_eq!(best_tokens(&values, Some(&ids), 20), sorted[..20]);
    }

    #[test]
    fn greedy_and_degenerate_rows() {
        let greedy = SamplingConfig {
            temperature: 0.0,
            ..SamplingConfig::default()
        };
        let mut s = Sampler::new(greedy, 1);
        assert_eq!(s.sample(&[0.5, 2.0, 2.0, f32::NAN]).unwrap(), 1);
        let mut s = Sampler::new(SamplingConfig::default(), 1);
        assert_eq!(
            s.sample(&[f32::NAN, f32::NEG_INFINITY]),
            Err(SampleError::NotFinite)
        );
        assert_eq!(s.sample(&[]), Err(SampleError::Empty));
        // top_p small: only the top token survives.
        let tight = SamplingConfig {
            top_p: 1e-9,
            ..SamplingConfig::default()
        };
        let mut s = Sampler::new(tight, 3);
        for _ in 0..20 {
            assert_eq!(s.sample(&[1.0, 3.0, 2.9]).unwrap(), 1);
        }
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with weights e^0 : e^(-ln 3) = 3 : 1 at temperature 1.
        let config = SamplingConfig {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
        };
        let mut s = Sampler::new(config, 42);
        let logits = [0.0f32, -(3.0f32).ln()];
        let n = 20_000;
        let zeros = (0..n).filter(|_| s.sample(&logits).unwrap() == 0).count();
        let share = zeros as f64 / n as f64;
        assert!((share - 0.75).abs() < 0.015, "{share}");
    }

    #[test]
    fn seeds_differ_by_question_and_prompt() {
        assert_ne!(seed_from_request(1, "a"), seed_from_request(1, "b"));
        assert_ne!(seed_from_request(1, "a"), seed_from_request(2, "a"));
        assert_eq!(seed_from_tokens(&[1, 2, 3]), seed_from_tokens(&[1, 2, 3]));
        assert_ne!(seed_from_tokens(&[1, 2, 3]), seed_from_tokens(&[1, 2, 4]));
    }
}
