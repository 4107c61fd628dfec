//! `decision_config.json`: the read-out settings a model release ships.
//!
//! Every field is optional; an absent file or field takes the documented default:
//! - `temperature_by_type`: `{"choice": 1.0, "noul": 1.0, "score": 1.0}` (`bool` is accepted for `noul`);
//! - `letter_token_ids`: absent (the tokenizer's own ids of `A`..`Z` are used and checked);
//! - `wide_choice`: `{"group": 25, "keep": 3, "residual": 0.001}` (spec §3).
//!
//! Unknown fields are ignored (a v1.1 release carries more, e.g. the none option's wording).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::request::QuestionType;

/// The file name inside a model directory.
pub const DECISION_CONFIG_FILE: &str = "decision_config.json";

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct DecisionConfig {
    /// The read-out divides each question type's letter logits by its temperature before the softmax.
    pub temperature_by_type: TemperatureByType,
    /// Token ids of the letters `A`..`Z` (as single tokens right after the assistant prefix), when the
    /// release lists them.
    pub letter_token_ids: Option<Vec<u32>>,
    /// How a choice with more than 26 options is read in rounds.
    pub wide_choice: WideChoiceConfig,
}

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
        let config: DecisionConfig =
            serde_json::from_str(&text).map_err(|source| ConfigError::Json {
                path: path.into(),
                source,
            })?;
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
