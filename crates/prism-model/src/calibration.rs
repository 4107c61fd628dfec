//! Static activation ranges for the integer path (int8 / w4a8), measured once per model file.
//!
//! The model runs a fixed set of prompts at bf16 ([`Precision::Bf16`], the batch-invariant CPU path or
//! its device twin) with every projection recording a histogram of its input's magnitudes
//! ([`RangeRecorder`], [`MagnitudeHistogram`]). Each projection's input then gets the static int8 scale
//! `range / 127` ([`ActivationScale`]), where `range` is the one with the smallest squared quantization
//! error over the calibration inputs (rounding of the values inside it plus clipping of those beyond
//! it). Taking the largest |x| instead wastes resolution on heavy-tailed inputs (the DeltaNet output
//! projection's, the MLP down projection's: a few values 20–40× the RMS) and grows with every
//! calibration token; on the tiny fixture the smallest-error range cut the logit error by about a
//! third (docs/correctness.md). Because the scale is fixed, a row's quantization never depends on the
//! other rows of a batch (zero or padding rows included).
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

/// Bump when the calibration procedure changes (older cache files are then ignored). 2: ranges chosen
/// by the smallest quantization error instead of the largest |x|.
pub const CALIBRATION_VERSION: u32 = 2;

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
    /// The int8 range of each projection's input (its scale is `range / 127`), keyed by the weight's
    /// GGUF name: the range with the smallest quantization error over the calibration inputs
    /// ([`MagnitudeHistogram::mse_range`]).
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

/// Experiment hook of a [`RangeRecorder`]: sees each recorded input after it is recorded (the names of
/// the projections reading it, the tensor). See [`RangeRecorder::with_observer`].
pub type InputObserver = dyn Fn(&[String], &Tensor) -> candle_core::Result<()> + Send + Sync;

/// Collects, per projection input, the largest |x| and a [`MagnitudeHistogram`] while a model runs
/// (calibration).
#[derive(Default)]
pub struct RangeRecorder {
    ranges: Mutex<BTreeMap<String, f32>>,
    histograms: Mutex<BTreeMap<String, MagnitudeHistogram>>,
    observer: Option<Arc<InputObserver>>,
}

impl std::fmt::Debug for RangeRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeRecorder")
            .field("ranges", &self.ranges)
            .field("observer", &self.observer.is_some())
            .finish_non_exhaustive()
    }
}

impl RangeRecorder {
    /// A recorder that also hands every recorded input to `observer`, after recording it. For
    /// experiments on a [`recording_model`]: the observer may collect the inputs, or rewrite them in
    /// place (candle's `inplace_op1`) to simulate another activation format, since the projection
    /// multiplies the very tensor it recorded.
    pub fn with_observer(observer: Arc<InputObserver>) -> Self {
        Self {
            observer: Some(observer),
            ..Self::default()
        }
    }

    pub fn record(&self, name: &str, x: &Tensor) -> candle_core::Result<()> {
        self.record_all(&[name.to_string()], x)
    }

    /// Records `x` as the input of each of `names` (the parts of a fused projection share their input).
    pub fn record_all(&self, names: &[String], x: &Tensor) -> candle_core::Result<()> {
        let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let mut histogram = MagnitudeHistogram::default();
        if let Err(value) = histogram.add(&values) {
            candle_core::bail!("calibration: the input of {names:?} is not finite ({value})");
        }
        {
            let mut ranges = self
                .ranges
                .lock()
                .map_err(|_| candle_core::Error::Msg("calibration recorder poisoned".into()))?;
            for name in names {
                let entry = ranges.entry(name.clone()).or_insert(0.0);
                *entry = entry.max(histogram.absmax());
            }
        }
        {
            let mut histograms = self
                .histograms
                .lock()
                .map_err(|_| candle_core::Error::Msg("calibration recorder poisoned".into()))?;
            for name in names {
                histograms
                    .entry(name.clone())
                    .or_default()
                    .merge(&histogram);
            }
        }
        if let Some(observer) = &self.observer {
            observer(names, x)?;
        }
        Ok(())
    }

    /// The largest |x| seen at each projection's input.
    pub fn ranges(&self) -> BTreeMap<String, f32> {
        self.ranges.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The magnitude histogram of each projection's input.
    pub fn histograms(&self) -> BTreeMap<String, MagnitudeHistogram> {
        self.histograms
            .lock()
            .map(|h| h.clone())
            .unwrap_or_default()
    }

    /// The range of each projection's input that minimizes its int8 quantization error
    /// ([`MagnitudeHistogram::mse_range`]): what [`calibrate`] stores.
    pub fn mse_ranges(&self) -> BTreeMap<String, f32> {
        self.histograms()
            .iter()
            .map(|(name, h)| (name.clone(), h.mse_range()))
            .collect()
    }
}

/// Bits of an f32 dropped to get its [`MagnitudeHistogram`] bin: the 8 exponent bits and the top 4
/// mantissa bits remain, so each octave is split into 16 bins (each at most 6.25 % wide).
const BIN_SHIFT: u32 = 19;
/// Bins of a [`MagnitudeHistogram`]: every finite |x| (sign bit clear) has an index below this.
const BINS: usize = 1 << (31 - BIN_SHIFT);

/// Count, Σ|x| and Σx² of the values in one bin.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct MagnitudeBin {
    count: u64,
    sum: f64,
    sum_sq: f64,
}

/// The magnitudes |x| of one projection input over a calibration run, in bins of the top bits of the
/// f32 (16 per octave, fixed edges: merging two histograms is exact and order-free up to f64 sums).
/// Each bin keeps its count, Σ|x| and Σx², which make the clipping error of whole bins exact.
#[derive(Debug, Clone, PartialEq)]
pub struct MagnitudeHistogram {
    bins: Vec<MagnitudeBin>,
    absmax: f32,
}

impl Default for MagnitudeHistogram {
    fn default() -> Self {
        Self {
            bins: vec![MagnitudeBin::default(); BINS],
            absmax: 0.0,
        }
    }
}

/// Lower edge of bin `i`.
fn bin_low(i: usize) -> f64 {
    f64::from(f32::from_bits((i as u32) << BIN_SHIFT))
}

impl MagnitudeHistogram {
    /// Adds `values`; on a non-finite one, returns it (the histogram is then left unchanged).
    pub fn add(&mut self, values: &[f32]) -> std::result::Result<(), f32> {
        if let Some(&bad) = values.iter().find(|v| !v.is_finite()) {
            return Err(bad);
        }
        for &v in values {
            let a = v.abs();
            let bin = &mut self.bins[(a.to_bits() >> BIN_SHIFT) as usize];
            let a64 = f64::from(a);
            bin.count += 1;
            bin.sum += a64;
            bin.sum_sq += a64 * a64;
            self.absmax = self.absmax.max(a);
        }
        Ok(())
    }

    pub fn merge(&mut self, other: &MagnitudeHistogram) {
        for (a, b) in self.bins.iter_mut().zip(&other.bins) {
            a.count += b.count;
            a.sum += b.sum;
            a.sum_sq += b.sum_sq;
        }
        self.absmax = self.absmax.max(other.absmax);
    }

    pub fn count(&self) -> u64 {
        self.bins.iter().map(|b| b.count).sum()
    }

    /// The largest |x| added.
    pub fn absmax(&self) -> f32 {
        self.absmax
    }

    /// Σ (x − q(x))² over the added values for int8 quantization at range `c` (step `Δ = c / 127`,
    /// values beyond `c` clamped to it), estimated from the bins: a bin at or above `c` is clipped
    /// (exact: `Σx² − 2cΣ|x| + n·c²`), a bin below `Δ/2` rounds to zero (exact: `Σx²`), any other
    /// bin below `c` has the rounding error of a value spread over several steps, `n·Δ²/12`.
    pub fn quantization_error(&self, c: f64) -> f64 {
        let step = c / f64::from(prism_quant::QMAX);
        let rounding = step * step / 12.0;
        let mut err = 0.0;
        for (i, b) in self.bins.iter().enumerate() {
            if b.count == 0 {
                continue;
            }
            let n = b.count as f64;
            let (low, high) = (bin_low(i), bin_low(i + 1));
            err += if low >= c {
                (b.sum_sq - 2.0 * c * b.sum + n * c * c).max(0.0)
            } else if high <= step / 2.0 {
                b.sum_sq
            } else if low >= step / 2.0 {
                n * rounding
            } else {
                b.sum_sq.min(n * rounding)
            };
        }
        err
    }

    /// The range whose int8 quantization error ([`Self::quantization_error`]) is smallest, among the
    /// largest |x| and the bin edges below it (down to 2⁻¹² of it); on a tie, the larger range. A
    /// heavy tail — a few values far beyond the rest — costs every other value resolution under
    /// `absmax / 127`; this trades the tail's clipping against that resolution. Zero if no value
    /// was nonzero.
    pub fn mse_range(&self) -> f32 {
        let absmax = f64::from(self.absmax);
        if absmax <= 0.0 {
            return 0.0;
        }
        let top = (self.absmax.to_bits() >> BIN_SHIFT) as usize;
        let mut best = (self.quantization_error(absmax), absmax);
        let lowest = absmax / 4096.0;
        for i in (0..=top).rev() {
            let c = bin_low(i);
            if c < lowest {
                break;
            }
            if c >= absmax {
                continue;
            }
            let err = self.quantization_error(c);
            if err < best.0 {
                best = (err, c);
            }
        }
        best.1 as f32
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

/// A model whose projections are dense at `options.precision` and record their inputs into
/// `recorder` (calibration, or experiments on the activation format with
/// [`RangeRecorder::with_observer`]).
pub fn recording_model(
    gguf: &GgufFile,
    options: &LoadOptions,
    recorder: Arc<RangeRecorder>,
) -> Result<Qwen35Model> {
    let loader =
        WeightLoader::new(gguf, &options.device, options.precision).with_recorder(recorder);
    Qwen35Model::from_loader(gguf, &loader, options)
}

/// Runs `prompts` through the model at bf16, records every projection's input and stores the range
/// with the smallest int8 quantization error over them ([`MagnitudeHistogram::mse_range`]). Each
/// prompt runs alone from a fresh state (the result does not depend on batching anyway); the output
/// head's input is recorded at every position.
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
    let model = recording_model(gguf, &options, recorder.clone())?;
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
    // The bf16 model's device memory back to the driver before the integer model is loaded.
    drop(model);
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = &options.device {
        crate::cuda::release_cached_memory(dev)?;
    }
    Ok(Calibration {
        version: CALIBRATION_VERSION,
        model_key: model_key(gguf),
        prompt_set: prompt_set.to_string(),
        n_prompts: prompts.len(),
        n_tokens,
        ranges: recorder.mse_ranges(),
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic standard normals (xorshift64* + Box–Muller).
    fn normals(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut uniform = move || {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            ((s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let (u, v) = (uniform(), uniform());
                ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
            })
            .collect()
    }

    /// Σ (x − q(x))² computed value by value with the quantizer of prism-quant.
    fn exact_error(values: &[f32], range: f32) -> f64 {
        let scale = ActivationScale::from_absmax(range).unwrap();
        values
            .iter()
            .map(|&x| {
                let q = prism_quant::activation::quantize_value(x, scale.inv_scale());
                let d = f64::from(x) - f64::from(q) * f64::from(scale.scale());
                d * d
            })
            .sum()
    }

    fn histogram(values: &[f32]) -> MagnitudeHistogram {
        let mut h = MagnitudeHistogram::default();
        h.add(values).unwrap();
        h
    }

    #[test]
    fn bins_split_each_octave_in_16_and_merging_equals_adding() {
        let values = normals(10_000, 1);
        let h = histogram(&values);
        assert_eq!(h.count(), 10_000);
        assert_eq!(h.absmax(), values.iter().fold(0f32, |m, x| m.max(x.abs())));
        for (i, b) in h.bins.iter().enumerate().filter(|(_, b)| b.count > 0) {
            // Every bin's mean magnitude lies inside its edges, which are 1/16 octave apart.
            let mean = b.sum / b.count as f64;
            assert!(bin_low(i) <= mean && mean < bin_low(i + 1), "bin {i}");
            let width = bin_low(i + 1) / bin_low(i);
            assert!(width <= 1.0 + 1.0 / 16.0 + 1e-12, "bin {i}: {width}");
        }
        let mut merged = histogram(&values[..3_000]);
        merged.merge(&histogram(&values[3_000..]));
        assert_eq!(merged.count(), h.count());
        assert_eq!(merged.absmax(), h.absmax());
        for (a, b) in merged.bins.iter().zip(&h.bins) {
            assert_eq!(a.count, b.count);
            assert!((a.sum_sq - b.sum_sq).abs() <= 1e-9 * b.sum_sq.max(1.0));
        }
        // Zeros and the largest finite value have bins; a non-finite value is refused untouched.
        let mut edge = histogram(&[0.0, -0.0, f32::MAX, -f32::MIN_POSITIVE]);
        assert_eq!((edge.count(), edge.absmax()), (4, f32::MAX));
        assert!(matches!(edge.add(&[1.0, f32::NAN]), Err(v) if v.is_nan()));
        assert_eq!(edge.count(), 4);
        assert!(matches!(edge.add(&[f32::INFINITY]), Err(v) if v == f32::INFINITY));
    }

    #[test]
    fn the_estimated_error_follows_the_exact_one() {
        // A Gaussian bulk with a heavy tail (0.1 % of the values at 10–40 σ), like the DeltaNet and MLP
        // down projection inputs of the fixture.
        let mut values = normals(200_000, 7);
        for (i, v) in values.iter_mut().enumerate().filter(|(i, _)| i % 1000 == 0) {
            *v *= 10.0 + (i % 31_000) as f32 / 1000.0;
        }
        let h = histogram(&values);
        for frac in [1.0f32, 0.8, 0.5, 0.3, 0.15, 0.05] {
            // Candidate ranges are bin edges (or the largest |x|).
            let c = if frac == 1.0 {
                h.absmax()
            } else {
                bin_low((((h.absmax() * frac).to_bits()) >> BIN_SHIFT) as usize) as f32
            };
            let (est, exact) = (h.quantization_error(f64::from(c)), exact_error(&values, c));
            assert!(
                (est / exact - 1.0).abs() < 0.05,
                "range {c}: estimated {est}, exact {exact}"
            );
        }
    }

    #[test]
    fn the_chosen_range_is_the_best_one_on_a_fine_grid() {
        let mut heavy = normals(100_000, 3);
        for v in heavy.iter_mut().step_by(997) {
            *v *= 25.0;
        }
        for (what, values) in [("gaussian", normals(100_000, 5)), ("heavy tail", heavy)] {
            let h = histogram(&values);
            let chosen = h.mse_range();
            let best = (1..=400)
                .map(|i| exact_error(&values, h.absmax() * i as f32 / 400.0))
                .fold(f64::INFINITY, f64::min);
            let got = exact_error(&values, chosen);
            assert!(
                got <= best * 1.03,
                "{what}: range {chosen} error {got}, best on the grid {best}"
            );
            assert!(chosen <= h.absmax() && chosen > 0.0, "{what}: {chosen}");
            if what == "heavy tail" {
                // The tail is clipped: resolution for the bulk is worth more.
                let at_absmax = exact_error(&values, h.absmax());
                assert!(
                    chosen < 0.8 * h.absmax(),
                    "{what}: {chosen} of {}",
                    h.absmax()
                );
                assert!(got < 0.8 * at_absmax, "{what}: {got} vs {at_absmax}");
            }
        }
        // Uniform values have no tail worth clipping: the largest |x| stays.
        let uniform: Vec<f32> = (0..10_001).map(|i| i as f32 / 5_000.0 - 1.0).collect();
        assert_eq!(histogram(&uniform).mse_range(), 1.0);
        assert_eq!(MagnitudeHistogram::default().mse_range(), 0.0);
        assert_eq!(histogram(&[0.0, 0.0]).mse_range(), 0.0);
    }

    #[test]
    fn the_recorder_keeps_the_largest_value_and_a_histogram_per_name() {
        let recorder = RangeRecorder::default();
        let x = Tensor::new(&[[1.0f32, -3.0], [0.5, 2.0]], &candle_core::Device::Cpu).unwrap();
        let names = ["a".to_string(), "b".to_string()];
        recorder.record_all(&names, &x).unwrap();
        recorder.record("a", &(x.clone() * 2.0).unwrap()).unwrap();
        let ranges = recorder.ranges();
        assert_eq!((ranges["a"], ranges["b"]), (6.0, 3.0));
        let h = recorder.histograms();
        assert_eq!((h["a"].count(), h["b"].count()), (8, 4));
        let mse = recorder.mse_ranges();
        assert!(
            mse["a"] > 0.0 && mse["a"] <= 6.0 && mse["b"] <= 3.0,
            "{mse:?}"
        );
        let bad = Tensor::new(&[[1.0f32, f32::NAN]], &candle_core::Device::Cpu).unwrap();
        let err = recorder.record("c", &bad).unwrap_err();
        assert!(err.to_string().contains("\"c\""), "{err}");
        assert!(!recorder.ranges().contains_key("c"));

        // The observer sees each input after it was recorded and may rewrite it in place.
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let observed =
            RangeRecorder::with_observer(Arc::new(move |names: &[String], x: &Tensor| {
                log.lock()
                    .unwrap()
                    .push((names.to_vec(), x.dims().to_vec()));
                Ok(())
            }));
        observed.record_all(&names, &x).unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![(names.to_vec(), vec![2, 2])]);
        assert_eq!(observed.ranges()["b"], 3.0);
    }
}
