//! Static activation ranges for the integer path (int8 / w4a8), measured once per model file.
//!
//! The model runs a fixed set of prompts at bf16 ([`Precision::Bf16`], the batch-invariant CPU path or
//! its device twin) with every projection recording the largest |x| of its input ([`RangeRecorder`]).
//! Each projection's input then gets the static int8 scale `absmax / 127` ([`ActivationScale`]); because
//! the scale is fixed, a row's quantization never depends on the other rows of a batch (zero or padding
//! rows included).
//!
//! The result is cached as a small JSON file named after a key of the model file ([`model_key`]) in
//! `PRISM_CACHE_DIR`, else `$XDG_CACHE_HOME/prism`, else `~/.cache/prism` ([`default_cache_dir`]).
//!
//! **The key** hashes (SHA-256) the file's length, every metadata key and value, every tensor's name,
//! type, shape and offset, and 4 KiB at the start, middle and end of every tensor's data — about 12 KiB
//! per tensor, so a 30 GB file is keyed in milliseconds (a full hash would read all 30 GB at every
//! start). It is safe for its purpose: two different checkpoints (another training run, fine-tune or
//! quantization) differ in essentially every weight block, so they cannot share the sampled bytes, and
//! the header pins architecture, shapes and types; only a hand edit confined to unsampled bytes would
//! go unnoticed (delete the cache file then). The key also covers [`CALIBRATION_VERSION`] and the
//! prompt set's name, so changing either recalibrates.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Tensor};
use prism_gguf::GgufFile;
use prism_quant::ActivationScale;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};
use crate::qwen35::{BatchItem, LoadOptions, Qwen35Model};
use crate::weights::{Precision, WeightLoader};

/// Bump when the calibration procedure changes (older cache files are then ignored).
pub const CALIBRATION_VERSION: u32 = 1;

/// Bytes sampled at the start, middle and end of each tensor for the model key.
const SAMPLE: usize = 4096;

/// The static input ranges of one model's projections.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub version: u32,
    /// [`model_key`] of the file the ranges were measured on.
    pub model_key: String,
    /// Which prompts were run (a name chosen by whoever owns the prompt list).
    pub prompt_set: String,
    pub n_prompts: usize,
    pub n_tokens: usize,
    /// Largest |x| seen at each projection's input, keyed by the weight's GGUF name.
    pub ranges: BTreeMap<String, f32>,
}

impl Calibration {
    /// The int8 scale of the input of projection `linear` (a weight's GGUF name).
    pub fn scale(&self, linear: &str) -> Result<ActivationScale> {
        let absmax = self.ranges.get(linear).copied().ok_or_else(|| {
            ModelError::Calibration(format!("no activation range for {linear:?}"))
        })?;
        ActivationScale::from_absmax(absmax).map_err(|source| ModelError::Quant {
            name: linear.to_string(),
            source,
        })
    }

    /// The one int8 scale of an input that the projections `linears` share (the parts of a fused
    /// projection run as one GEMM on one quantized input). Calibration records every part's range
    /// under its own name from the same tensor, so the ranges are equal and so is this scale to each
    /// part's own. A cache whose ranges for one group differ (edited, or made by another procedure)
    /// gets the largest of them: no part's input is clipped tighter than its own range allows.
    pub fn shared_scale(&self, linears: &[&str]) -> Result<ActivationScale> {
        let mut widest: Option<(f32, &str)> = None;
        for &name in linears {
            // Each range is checked on its own first (missing, non-finite or ≤ 0 names that part).
            self.scale(name)?;
            let absmax = self.ranges.get(name).copied().unwrap_or_default();
            if widest.is_none_or(|(w, _)| absmax > w) {
                widest = Some((absmax, name));
            }
        }
        let (absmax, name) = widest
            .ok_or_else(|| ModelError::Calibration("a shared scale of no projections".into()))?;
        ActivationScale::from_absmax(absmax).map_err(|source| ModelError::Quant {
            name: name.to_string(),
            source,
        })
    }

    /// Writes the JSON file (through a temporary file and a rename, so a reader never sees half).
    pub fn save(&self, path: &Path) -> Result<()> {
        let io = |e: std::io::Error| {
            ModelError::Calibration(format!("cannot write {}: {e}", path.display()))
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| ModelError::Calibration(e.to_string()))?;
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ModelError::Calibration(format!("cannot read {}: {e}", path.display())))?;
        serde_json::from_str(&text)
            .map_err(|e| ModelError::Calibration(format!("{}: {e}", path.display())))
    }
}

/// Collects the largest |x| per projection input while a model runs (calibration).
#[derive(Debug, Default)]
pub struct RangeRecorder {
    ranges: Mutex<BTreeMap<String, f32>>,
}

impl RangeRecorder {
    pub fn record(&self, name: &str, x: &Tensor) -> candle_core::Result<()> {
        self.record_all(&[name.to_string()], x)
    }

    /// Records `x` as the input of each of `names` (the parts of a fused projection share their input).
    pub fn record_all(&self, names: &[String], x: &Tensor) -> candle_core::Result<()> {
        let absmax = x
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_dtype(DType::F32)?
            .to_scalar::<f32>()?;
        if !absmax.is_finite() {
            candle_core::bail!("calibration: the input of {names:?} is not finite ({absmax})");
        }
        let mut ranges = self
            .ranges
            .lock()
            .map_err(|_| candle_core::Error::Msg("calibration recorder poisoned".into()))?;
        for name in names {
            let entry = ranges.entry(name.clone()).or_insert(0.0);
            *entry = entry.max(absmax);
        }
        Ok(())
    }

    pub fn ranges(&self) -> BTreeMap<String, f32> {
        self.ranges.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

/// The cache key of a model file (see the module docs): hex SHA-256.
pub fn model_key(gguf: &GgufFile) -> String {
    let mut h = Sha256::new();
    h.update(format!("prism-calibration-v{CALIBRATION_VERSION}\n").as_bytes());
    h.update(gguf.file_len().to_le_bytes());
    for (key, value) in gguf.metadata() {
        h.update(key.as_bytes());
        h.update(format!("={value:?}\n").as_bytes());
    }
    for info in gguf.tensors() {
        h.update(
            format!(
                "{} {:?} {:?} {}\n",
                info.name, info.ggml_type, info.dims, info.offset
            )
            .as_bytes(),
        );
        let data = gguf.tensor_bytes(info);
        if data.len() <= 3 * SAMPLE {
            h.update(data);
        } else {
            let mid = data.len() / 2 - SAMPLE / 2;
            h.update(&data[..SAMPLE]);
            h.update(&data[mid..mid + SAMPLE]);
            h.update(&data[data.len() - SAMPLE..]);
        }
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// `PRISM_CACHE_DIR`, else `$XDG_CACHE_HOME/prism`, else `$HOME/.cache/prism`.
pub fn default_cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("PRISM_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("prism")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("prism")))
}

/// The cache file of a model key and prompt set in `dir`.
pub fn cache_path(dir: &Path, model_key: &str, prompt_set: &str) -> PathBuf {
    let set: String = prompt_set
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let short = model_key.get(..32).unwrap_or(model_key);
    dir.join(format!("calibration-{short}-{set}.json"))
}

/// Runs `prompts` through the model at bf16 and records every projection's input range. Each prompt
/// runs alone from a fresh state (the result does not depend on batching anyway); the output head's
/// input is recorded at every position.
pub fn calibrate(
    gguf: &GgufFile,
    options: &LoadOptions,
    prompts: &[Vec<u32>],
    prompt_set: &str,
) -> Result<Calibration> {
    if prompts.is_empty() {
        return Err(ModelError::Calibration("no calibration prompts".into()));
    }
    let recorder = Arc::new(RangeRecorder::default());
    let options = LoadOptions {
        precision: Precision::Bf16,
        ..options.clone()
    };
    let loader =
        WeightLoader::new(gguf, &options.device, Precision::Bf16).with_recorder(recorder.clone());
    let model = Qwen35Model::from_loader(gguf, &loader, &options)?;
    let mut n_tokens = 0;
    for (i, prompt) in prompts.iter().enumerate() {
        let mut state = model.new_state()?;
        let out = model
            .forward(&mut [BatchItem::new(&mut state, prompt)])
            .map_err(|e| ModelError::Calibration(format!("prompt {i}: {e}")))?;
        // One row is enough to pass every position's final hidden state through the head's recorder.
        model.logits_for_rows(&out.hidden, &[0])?;
        n_tokens += prompt.len();
    }
    Ok(Calibration {
        version: CALIBRATION_VERSION,
        model_key: model_key(gguf),
        prompt_set: prompt_set.to_string(),
        n_prompts: prompts.len(),
        n_tokens,
        ranges: recorder.ranges(),
    })
}

/// The calibration of `gguf` from the cache in `cache_dir` if it is there and matches, else measured
/// with [`calibrate`] (with a log line saying so) and written to the cache. `cache_dir = None`: no
/// cache at all.
pub fn load_or_calibrate(
    gguf: &GgufFile,
    options: &LoadOptions,
    prompts: &[Vec<u32>],
    prompt_set: &str,
    cache_dir: Option<&Path>,
) -> Result<Calibration> {
    let key = model_key(gguf);
    let path = cache_dir.map(|d| cache_path(d, &key, prompt_set));
    if let Some(path) = path.as_deref().filter(|p| p.is_file()) {
        match Calibration::load(path) {
            Ok(c)
                if c.version == CALIBRATION_VERSION
                    && c.model_key == key
                    && c.prompt_set == prompt_set =>
            {
                tracing::debug!("activation ranges from {}", path.display());
                return Ok(c);
            }
            Ok(_) => tracing::warn!(
                "{} is for another model or version: recalibrating",
                path.display()
            ),
            Err(e) => tracing::warn!("ignoring the calibration cache: {e}"),
        }
    }
    let file = gguf
        .path()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "the model".into());
    let tokens: usize = prompts.iter().map(Vec::len).sum();
    tracing::info!(
        "calibrating int8 activation ranges of {file}: {} built-in prompts ({tokens} tokens) at bf16, once per model file{}",
        prompts.len(),
        path.as_deref()
            .map(|p| format!("; cached in {}", p.display()))
            .unwrap_or_default()
    );
    let started = std::time::Instant::now();
    let calibration = calibrate(gguf, options, prompts, prompt_set)?;
    tracing::info!(
        "calibrated {} projection inputs in {:.1} s",
        calibration.ranges.len(),
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &path {
        if let Err(e) = calibration.save(path) {
            tracing::warn!("could not cache the calibration: {e}");
        }
    }
    Ok(calibration)
}
