//! `decision_config.json`: the read-out settings a model release ships.
//!
//! Every field is optional; an absent file or field takes the documented default (the schema, with
//! examples, is in `docs/decision-config.md`):
//! - `family`: which release family the model is — `"v1"` (the default, and what a file without the
//!   field means), `"v1.1"` (AutoThink; `"v1.1-autothink"` is accepted too) or `"v1.1-instant"`;
//! - `temperature_by_type`: `{"choice": 1.0, "noul": 1.0, "score": 1.0}` (`bool` is accepted for `noul`);
//! - `letter_token_ids`: absent (the tokenizer's own ids of `A`..`Z` are used and checked);
//! - `wide_choice`: `{"group": 25, "keep": 3, "residual": 0.001}` (spec §3);
//! - `none_option` (v1.1): `{"text": "None of the above"}`, the wording of the extra last option;
//! - `thought_sampling` (v1.1 AutoThink): `{"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}`,
//!   how thought tokens are sampled (temperature 0: greedy);
//! - `loop_detector` (v1.1 AutoThink): `{"max_period": 128, "min_repeats": 4, "min_span": 64}`, when a
//!   thought is stopped as runaway repetition ([`crate::thought::LoopDetector`]).
//!
//! Unknown fields are ignored with a warning (a later release may carry more), so an old engine still
//! loads a newer release's file; every known field is checked, and a bad one is an error naming it.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::request::QuestionType;

/// The file name inside a model directory.
pub const DECISION_CONFIG_FILE: &str = "decision_config.json";

/// The release family of a model: what its decision procedure is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Family {
    /// StartLux-Decision v1: one read-out per question.
    #[default]
    #[serde(rename = "v1")]
    V1,
    /// v1.1 AutoThink: a read-out, and when unsure a thought and a second read-out; the none option.
    #[serde(rename = "v1.1", alias = "v1.1-autothink")]
    AutoThink,
    /// v1.1 Instant: one pass per question, the options read in both orders; the none option.
    #[serde(rename = "v1.1-instant")]
    Instant,
}

impl Family {
    /// The name `decision_config.json` and `/v1/models` use.
    pub fn as_str(self) -> &'static str {
        match self {
            Family::V1 => "v1",
            Family::AutoThink => "v1.1",
            Family::Instant => "v1.1-instant",
        }
    }

    /// Whether the family has the none option (`none_check`, `allow_none`).
    pub fn has_none_option(self) -> bool {
        matches!(self, Family::AutoThink | Family::Instant)
    }

    /// Whether the family thinks (`think_mode` `auto` / `always`).
    pub fn thinks(self) -> bool {
        self == Family::AutoThink
    }
}

impl std::fmt::Display for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionConfig {
    /// The release family (v1 when the file or the field is absent).
    pub family: Family,
    /// The read-out divides each question type's letter logits by its temperature before the softmax.
    pub temperature_by_type: TemperatureByType,
    /// Token ids of the letters `A`..`Z` (as single tokens right after the assistant prefix), when the
    /// release lists them.
    pub letter_token_ids: Option<Vec<u32>>,
    /// How a choice with more than 26 options is read in rounds.
    pub wide_choice: WideChoiceConfig,
    /// The none option's wording (v1.1).
    pub none_option: NoneOptionConfig,
    /// How thought tokens are sampled (v1.1 AutoThink).
    pub thought_sampling: SamplingConfig,
    /// When a thought is stopped as runaway repetition (v1.1 AutoThink).
    pub loop_detector: LoopDetectorConfig,
}

/// The none option: an extra last option of every choice question (v1.1).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct NoneOptionConfig {
    /// The option line's text (after its letter).
    pub text: String,
}

impl Default for NoneOptionConfig {
    fn default() -> Self {
        NoneOptionConfig {
            text: "None of the above".into(),
        }
    }
}

/// Sampling of thought tokens: the logits are divided by `temperature`, cut to the `top_k` most likely
/// tokens, to those with at least `min_p` times the top token's probability, and to the smallest set
/// whose probability reaches `top_p`; one token is drawn from what is left. `temperature` 0 is greedy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingConfig {
    pub temperature: f64,
    /// 0: no cut.
    pub top_k: usize,
    pub top_p: f64,
    pub min_p: f64,
}

impl Default for SamplingConfig {
    /// Qwen3's recommended settings for thinking.
    fn default() -> Self {
        SamplingConfig {
            temperature: 0.6,
            top_k: 20,
            top_p: 0.95,
            min_p: 0.0,
        }
    }
}

/// A thought is runaway repetition when its last tokens repeat a unit of at most `max_period` tokens at
/// least `min_repeats` times in a row, over at least `min_span` tokens.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LoopDetectorConfig {
    pub max_period: usize,
    pub min_repeats: usize,
    pub min_span: usize,
}

impl Default for LoopDetectorConfig {
    fn default() -> Self {
        LoopDetectorConfig {
            max_period: 128,
            min_repeats: 4,
            min_span: 64,
        }
    }
}

/// The top-level fields this engine knows (others are ignored with a warning).
const KNOWN_FIELDS: &[&str] = &[
    "family",
    "temperature_by_type",
    "letter_token_ids",
    "wide_choice",
    "none_option",
    "thought_sampling",
    "loop_detector",
];

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TemperatureByType {
    pub choice: f64,
    #[serde(alias = "bool")]
    pub noul: f64,
    pub score: f64,
}

impl Default for TemperatureByType {
    fn default() -> Self {
        TemperatureByType {
            choice: 1.0,
            noul: 1.0,
            score: 1.0,
        }
    }
}

/// Wide-choice rounds: near-equal groups of at most `group` options, the top `keep` of each go on to the
/// next round, and the options left behind share `residual` of the probability.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct WideChoiceConfig {
    pub group: usize,
    pub keep: usize,
    pub residual: f64,
}

impl Default for WideChoiceConfig {
    fn default() -> Self {
        WideChoiceConfig {
            group: 25,
            keep: 3,
            residual: 1e-3,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a valid decision config: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("decision config field `{field}`: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

impl DecisionConfig {
    /// Reads `decision_config.json` from a model directory; the defaults if the directory has none.
    pub fn from_model_dir(dir: &Path) -> Result<Self, ConfigError> {
        let path = dir.join(DECISION_CONFIG_FILE);
        if !path.exists() {
            // Normal for a directory without one (the bundled demo model): the documented defaults.
            tracing::debug!(
                "{} does not exist: the decision config's defaults apply",
                path.display()
            );
            return Ok(DecisionConfig::default());
        }
        Self::load(&path)
    }

    /// Reads and checks a decision config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.into(),
            source,
        })?;
        let config = Self::from_json_text(&text).map_err(|e| match e {
            ConfigError::Json { source, .. } => ConfigError::Json {
                path: path.into(),
                source,
            },
            other => other,
        })?;
        Ok(config)
    }

    /// Parses and checks a decision config's JSON text (unknown top-level fields are logged and
    /// ignored).
    pub fn from_json_text(text: &str) -> Result<Self, ConfigError> {
        let json = |source| ConfigError::Json {
            path: PathBuf::from(DECISION_CONFIG_FILE),
            source,
        };
        let value: serde_json::Value = serde_json::from_str(text).map_err(json)?;
        if let Some(object) = value.as_object() {
            for key in object.keys() {
                if !KNOWN_FIELDS.contains(&key.as_str()) {
                    tracing::warn!("{DECISION_CONFIG_FILE}: unknown field `{key}` ignored");
                }
            }
        }
        let config: DecisionConfig = serde_json::from_value(value).map_err(json)?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the values the read-out relies on.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let temperatures = [
            (
                "temperature_by_type.choice",
                self.temperature_by_type.choice,
            ),
            ("temperature_by_type.noul", self.temperature_by_type.noul),
            ("temperature_by_type.score", self.temperature_by_type.score),
        ];
        for (field, value) in temperatures {
            if !(value.is_finite() && value > 0.0) {
                return Err(ConfigError::Invalid {
                    field,
                    message: format!("must be a positive number, got {value}"),
                });
            }
        }
        if let Some(ids) = &self.letter_token_ids {
            if ids.len() < 26 {
                return Err(ConfigError::Invalid {
                    field: "letter_token_ids",
                    message: format!("needs the 26 letters A..Z, got {} ids", ids.len()),
                });
            }
        }
        let wide = &self.wide_choice;
        if !(2..=26).contains(&wide.group) {
            return Err(ConfigError::Invalid {
                field: "wide_choice.group",
                message: format!("must be 2..=26, got {}", wide.group),
            });
        }
        // keep <= group / 2 makes every round strictly smaller than the last (keep * ceil(n / group) < n
        // for all n > 26), so the rounds always end.
        if wide.keep == 0 || wide.keep * 2 > wide.group {
            return Err(ConfigError::Invalid {
                field: "wide_choice.keep",
                message: format!("must be 1..={}, got {}", wide.group / 2, wide.keep),
            });
        }
        if !(wide.residual.is_finite() && (0.0..1.0).contains(&wide.residual)) {
            return Err(ConfigError::Invalid {
                field: "wide_choice.residual",
                message: format!("must be in [0, 1), got {}", wide.residual),
            });
        }
        if self.none_option.text.trim().is_empty() || self.none_option.text.contains('\n') {
            return Err(ConfigError::Invalid {
                field: "none_option.text",
                message: format!(
                    "must be one non-blank line, got {:?}",
                    self.none_option.text
                ),
            });
        }
        let sampling = &self.thought_sampling;
        if !(sampling.temperature.is_finite() && sampling.temperature >= 0.0) {
            return Err(ConfigError::Invalid {
                field: "thought_sampling.temperature",
                message: format!("must be a number >= 0, got {}", sampling.temperature),
            });
        }
        if !(sampling.top_p.is_finite() && sampling.top_p > 0.0 && sampling.top_p <= 1.0) {
            return Err(ConfigError::Invalid {
                field: "thought_sampling.top_p",
                message: format!("must be in (0, 1], got {}", sampling.top_p),
            });
        }
        if !(sampling.min_p.is_finite() && (0.0..1.0).contains(&sampling.min_p)) {
            return Err(ConfigError::Invalid {
                field: "thought_sampling.min_p",
                message: format!("must be in [0, 1), got {}", sampling.min_p),
            });
        }
        let detector = &self.loop_detector;
        if detector.max_period == 0 || detector.max_period > 4096 {
            return Err(ConfigError::Invalid {
                field: "loop_detector.max_period",
                message: format!("must be 1..=4096, got {}", detector.max_period),
            });
        }
        if detector.min_repeats < 2 {
            return Err(ConfigError::Invalid {
                field: "loop_detector.min_repeats",
                message: format!("must be at least 2, got {}", detector.min_repeats),
            });
        }
        if detector.min_span == 0 {
            return Err(ConfigError::Invalid {
                field: "loop_detector.min_span",
                message: "must be at least 1".into(),
            });
        }
        Ok(())
    }

    /// The read-out temperature of a question type.
    pub fn temperature(&self, kind: QuestionType) -> f64 {
        match kind {
            QuestionType::Choice => self.temperature_by_type.choice,
            QuestionType::Noul => self.temperature_by_type.noul,
            QuestionType::Score => self.temperature_by_type.score,
        }
    }
}
