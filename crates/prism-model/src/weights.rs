//! Loading tensors by name from a GGUF file, with every shape checked against the configuration.
//!
//! The reference path dequantizes every tensor (BF16, Q8_0, Q4_K, Q6_K, …) to f32 with `prism-gguf`'s
//! bit-exact llama.cpp dequantization. Matrices can then be kept in f32 or rounded to bf16.
//!
//! The integer precisions ([`Precision::Int8`], [`Precision::W4a8`]) keep each quantized projection as
//! a [`prism_quant::QuantWeight`] (Q8_0 re-blocked once per row and run of 128; K-quants as stored);
//! activations are quantized per row and run on each call, so nothing is measured beforehand. Float
//! tensors of such a file stay dense. On a CUDA device each quantized weight is uploaded as it is
//! loaded.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Tensor};
use prism_gguf::{GgmlType, GgufError, GgufFile, TensorInfo};
use prism_quant::{Q8Scales, QuantMatmul, QuantWeight, WeightFormat};
use rayon::prelude::*;

use crate::error::{ModelError, Result};
use crate::hf::HfWeights;
use crate::linear::{FusedLinear, FusedPart, InputTransform, Linear};

/// Arithmetic of the forward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// Weights dequantized to f32, all arithmetic in f32: the reference path.
    F32,
    /// Matrices rounded to bf16; activations are rounded to bf16 at each matmul, which widens both
    /// exactly to f32, accumulates in f32 and returns f32. Norms, the delta rule, attention and
    /// residuals stay f32.
    Bf16,
    /// Everything in f64: not a serving mode, but the ground truth that tests measure the f32 path's
    /// rounding against.
    F64,
    /// W8A8: Q8_0 weights re-blocked to int8 with one scale per row and run of 128, int8 activations
    /// with dynamic per-(row, run) scales, exact integer sums ([`prism_quant`]). Everything else as
    /// [`Precision::F32`]. CPU only for now.
    Int8,
    /// W4A8: the file's K-quant weights on their own sub-block scales and mins (Q8_0 tensors as in
    /// [`Precision::Int8`]), int8 activations; otherwise as [`Precision::Int8`].
    W4a8,
}

impl Precision {
    /// `f32`, `bf16`, `f64`, `int8` or `w4a8` (`auto` needs the file: [`Precision::resolve`]).
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f64" => Ok(Precision::F64),
            "int8" => Ok(Precision::Int8),
            "w4a8" => Ok(Precision::W4a8),
            other => Err(ModelError::UnsupportedPrecision(other.to_string())),
        }
    }

    /// [`Precision::parse`], plus `auto`: the precision the file's weights call for
    /// ([`Precision::auto_for`]).
    pub fn resolve(s: &str, gguf: &GgufFile) -> Result<Self> {
        if s == "auto" {
            Self::auto_for(gguf)
        } else {
            Self::parse(s)
        }
    }

    /// `auto`: a file with K-quant weights (Q4_K_M and the like) runs [`Precision::W4a8`], a file whose
    /// quantized weights are all Q8_0 runs [`Precision::Int8`], a float file [`Precision::Bf16`].
    pub fn auto_for(gguf: &GgufFile) -> Result<Self> {
        let mut precision = Precision::Bf16;
        for info in gguf.tensors() {
            match info.ggml_type {
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {}
                GgmlType::Q8_0 => {
                    if precision == Precision::Bf16 {
                        precision = Precision::Int8;
                    }
                }
                ty if WeightFormat::from_ggml(ty).is_some() => precision = Precision::W4a8,
                ty => {
                    return Err(ModelError::PrecisionMismatch {
                        precision: "auto".into(),
                        name: info.name.clone(),
                        reason: format!("{ty:?} has no integer kernel (Q8_0, Q4_K, Q5_K, Q6_K do)"),
                    })
                }
            }
        }
        Ok(precision)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F64 => "f64",
            Precision::Int8 => "int8",
            Precision::W4a8 => "w4a8",
        }
    }

    /// Whether quantized projections run on the exact integer path.
    pub fn is_integer(self) -> bool {
        matches!(self, Precision::Int8 | Precision::W4a8)
    }

    /// The dtype matrices are stored in (the float tensors of a quantized file, and the embedding).
    pub fn matrix_dtype(self) -> DType {
        match self {
            Precision::F32 | Precision::Int8 | Precision::W4a8 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F64 => DType::F64,
        }
    }

    /// The dtype of activations, norms, states and everything that is not a matrix.
    pub fn activation_dtype(self) -> DType {
        match self {
            Precision::F32 | Precision::Bf16 | Precision::Int8 | Precision::W4a8 => DType::F32,
            Precision::F64 => DType::F64,
        }
    }
}

/// Elements one task of [`dequantize_parallel`] converts (rounded to whole blocks): large enough that
/// rayon's per-task cost vanishes, small enough that a 1 GB tensor spreads over every core.
const DEQUANT_TASK_ELEMENTS: usize = 1 << 16;

/// `info`'s data as f32, exactly [`GgufFile::dequantize_info`]'s values, computed by rayon over runs of
/// whole blocks. ggml's block formats are independent block by block (each block carries its own
/// scales), so cutting the data at block boundaries gives the same bits; a 27B model's embedding alone
/// is 1.27 G values, which one thread took seconds to convert. Anything the one-call path would refuse
/// (a type without a dequantizer, a partial block, a byte length that does not match) goes through it
/// unchanged, so the error is the same too.
fn dequantize_parallel(gguf: &GgufFile, info: &TensorInfo) -> Result<Vec<f32>, GgufError> {
    let ty = info.ggml_type;
    let bytes = gguf.tensor_bytes(info);
    let (block, block_bytes) = (ty.block_size(), ty.type_size());
    let n = usize::try_from(info.n_elements()).ok().filter(|&n| {
        ty.can_dequantize()
            && block > 0
            && n % block == 0
            && (n / block).checked_mul(block_bytes) == Some(bytes.len())
    });
    let n = match n {
        Some(n) if n > DEQUANT_TASK_ELEMENTS => n,
        _ => return gguf.dequantize_info(info),
    };
    let blocks_per_task = (DEQUANT_TASK_ELEMENTS / block).max(1);
    let mut values = vec![0f32; n];
    values
        .par_chunks_mut(blocks_per_task * block)
        .zip(bytes.par_chunks(blocks_per_task * block_bytes))
        .try_for_each(|(out, data)| prism_gguf::blocks::dequantize_into(ty, data, out))?;
    Ok(values)
}

/// Held by a loader thread while it works on a GPU: one thread at a time does a load's device work
/// (copies from host memory, casts, concatenations, and the frees of their inputs), while the host
/// work (reading and dequantizing the file, rounding to bf16, shape checks) runs on every loader
/// thread. On an H200 (2026-11-30) bf16 loads whose loader threads each did their own device work
/// stopped making progress near their end (GPU idle, most loader threads running in user and kernel
/// time, one waiting on a thread it had started), from 8 threads every time; neither a lock around
/// the copies alone nor eager CUDA module loading prevented it. With this lock (and bf16 rounded on
/// the host) 9B and 27B bf16 loads from 8 threads complete, 9B ones from 4 / 8 / 16 threads in
/// 10.3 / 10.7 / 7.3 s against 14.3 s from one, with the same answers (docs/optimization-log.md,
/// history: the eighth session of 2026-11-30; the stall's cause, found later, was a loader thread's
/// exit: `qwen35::loader_pool`). The lock stays: one thread's device work at a time costs little next
/// to the host work.
/// Every kernel launch and device free of a load happens under it (a layer's tensors are built from
/// values prepared on the host: see [`WeightLoader::activation_tensor_transposed`]); only the integer
/// path's weight uploads (`QuantMatmul::prepare`: host-to-device copies, no launch, no free) run
/// outside it, on each loader thread.
static DEVICE_WORK: Mutex<()> = Mutex::new(());

/// `work` run under [`DEVICE_WORK`] when `device` is a GPU. `work` should own the tensors it
/// consumes, so that their device memory is freed under the lock too.
fn on_device<R>(device: &Device, work: impl FnOnce() -> Result<R>) -> Result<R> {
    if device.is_cpu() {
        return work();
    }
    // The lock guards no data, so a panic elsewhere while it was held leaves nothing inconsistent.
    let _one_thread_on_the_device = DEVICE_WORK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    work()
}

/// Where the tensors come from. Both give GGUF names and layouts.
enum WeightSource<'a> {
    Gguf(&'a GgufFile),
    /// A Hugging Face safetensors checkpoint, converted to the GGUF layout as it is read.
    Hf(&'a HfWeights<'a>),
}

/// Reads named tensors out of one GGUF file (or an HF checkpoint seen through GGUF names) onto a device.
pub struct WeightLoader<'a> {
    source: WeightSource<'a>,
    device: Device,
    precision: Precision,
    /// How Q8_0 weights are re-blocked on the integer path.
    q8_scales: Q8Scales,
    /// Simulation: every projection dense, its input rewritten by this first.
    transform: Option<Arc<InputTransform>>,
    /// Simulation: the dense weights of quantized tensors are the integer path's (Q8_0 re-blocked,
    /// [`QuantWeight::dequantize_row`]) instead of the file's dequantized values.
    simulate_on_integer_weights: bool,
}

impl<'a> WeightLoader<'a> {
    pub fn new(gguf: &'a GgufFile, device: &Device, precision: Precision) -> Self {
        Self {
            source: WeightSource::Gguf(gguf),
            device: device.clone(),
            precision,
            q8_scales: Q8Scales::PerRun,
            transform: None,
            simulate_on_integer_weights: false,
        }
    }

    /// The Q8_0 scale granularity of the integer path (default [`Q8Scales::PerRun`], the contract's;
    /// [`Q8Scales::PerRow`] to measure against).
    pub fn with_q8_scales(mut self, q8_scales: Q8Scales) -> Self {
        self.q8_scales = q8_scales;
        self
    }

    /// Makes every projection a dense one ([`Linear::Simulated`]) whose input goes through
    /// `transform` first (experiments that simulate activation formats).
    pub fn with_input_transform(mut self, transform: Arc<InputTransform>) -> Self {
        self.transform = Some(transform);
        self
    }

    /// With [`Self::with_input_transform`]: the simulated projections multiply the integer path's
    /// weights (Q8_0 re-blocked per [`Self::with_q8_scales`], K-quants as stored), dequantized, instead
    /// of the file's values — to separate an activation format's error from the weights'.
    pub fn simulating_on_integer_weights(mut self) -> Self {
        self.simulate_on_integer_weights = true;
        self
    }

    /// A simulated projection's dense weight: the file's values, or the integer path's.
    fn simulated_matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        if !self.simulate_on_integer_weights {
            return self.matrix(name, rows, cols);
        }
        let Some(weight) = self.quant_weight(name, rows, cols)? else {
            return self.matrix(name, rows, cols);
        };
        let mut values = Vec::with_capacity(rows * cols);
        for n in 0..rows {
            values.extend(
                weight
                    .dequantize_row(n)
                    .map_err(|source| ModelError::Quant {
                        name: name.to_string(),
                        source,
                    })?,
            );
        }
        on_device(&self.device, || {
            Ok(Tensor::from_vec(values, (rows, cols), &self.device)?
                .to_dtype(self.precision.matrix_dtype())?)
        })
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// Whether [`Self::linear`] gives plain dense matrices (no integer path, no simulation).
    pub fn linear_is_dense(&self) -> bool {
        self.transform.is_none() && !self.precision.is_integer()
    }

    /// Reads an HF checkpoint by GGUF names ([`HfWeights`] does the conversion).
    pub fn from_hf(hf: &'a HfWeights<'a>, device: &Device, precision: Precision) -> Self {
        Self {
            source: WeightSource::Hf(hf),
            device: device.clone(),
            precision,
            q8_scales: Q8Scales::PerRun,
            transform: None,
            simulate_on_integer_weights: false,
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        match self.source {
            WeightSource::Gguf(gguf) => gguf.tensor_info(name).is_some(),
            WeightSource::Hf(hf) => hf.contains(name),
        }
    }

    /// The tensor `name`, which must have exactly `ne` (ggml order, `ne[0]` contiguous). Returned with the
    /// dims reversed (row-major), in f32.
    pub fn f32_tensor(&self, name: &str, ne: &[usize]) -> Result<Tensor> {
        let values = self.f32_values(name, ne)?;
        let shape: Vec<usize> = ne.iter().rev().copied().collect();
        on_device(&self.device, || {
            Ok(Tensor::from_vec(values, shape, &self.device)?)
        })
    }

    /// [`Self::f32_tensor`]'s values in host memory (row-major, `Π ne` of them).
    fn f32_values(&self, name: &str, ne: &[usize]) -> Result<Vec<f32>> {
        let gguf = match self.source {
            WeightSource::Gguf(gguf) => gguf,
            WeightSource::Hf(hf) => return hf.gguf_values(name, ne),
        };
        let info = gguf
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let expected: Vec<u64> = ne.iter().map(|&d| d as u64).collect();
        if info.dims != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected,
                found: info.dims.clone(),
            });
        }
        let values = dequantize_parallel(gguf, info).map_err(|source| ModelError::TensorRead {
            name: name.to_string(),
            source,
        })?;
        let expected_len: usize = ne.iter().product();
        if values.len() != expected_len {
            return Err(ModelError::DequantizedLength {
                name: name.to_string(),
                expected: expected_len,
                found: values.len(),
            });
        }
        Ok(values)
    }

    /// A 1-D tensor of `len` elements (norm weights, per-head scalars), in the activation dtype.
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        self.activation_tensor(name, &[len])
    }

    /// [`Self::f32_tensor`] converted to the activation dtype.
    pub fn activation_tensor(&self, name: &str, ne: &[usize]) -> Result<Tensor> {
        let t = self.f32_tensor(name, ne)?;
        on_device(&self.device, move || {
            Ok(t.to_dtype(self.precision.activation_dtype())?)
        })
    }

    /// The 2-D tensor `name` of exactly `ne` = `[inner, outer]` (ggml order) transposed: `[inner, outer]`
    /// row-major, in the activation dtype. Transposed in host memory, so that the device sees one upload
    /// and one cast under [`DEVICE_WORK`] and nothing else (a transposing copy on the device would be a
    /// kernel launch and a free outside the lock).
    pub fn activation_tensor_transposed(&self, name: &str, ne: [usize; 2]) -> Result<Tensor> {
        let [inner, outer] = ne;
        let values = self.f32_values(name, &ne)?;
        let mut transposed = vec![0f32; values.len()];
        for (o, row) in values.chunks_exact(inner.max(1)).enumerate() {
            for (i, &v) in row.iter().enumerate() {
                transposed[i * outer + o] = v;
            }
        }
        drop(values);
        on_device(&self.device, || {
            let t = Tensor::from_vec(transposed, (inner, outer), &self.device)?;
            Ok(t.to_dtype(self.precision.activation_dtype())?)
        })
    }

    /// A linear-layer weight with `rows` outputs of `cols` inputs: GGUF `[cols, rows]`, returned as
    /// `[rows, cols]` in the precision's matrix dtype.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let dtype = self.precision.matrix_dtype();
        if dtype == DType::BF16 {
            // Rounded on the host, over all cores (candle's CPU cast is one thread), with the
            // rounding candle's casts use (round to nearest even, `bf16::from_f32` on the CPU,
            // `__float2bfloat16` on a GPU): half the bytes of an f32 copy, and no cast on the device.
            let values = self.f32_values(name, &[cols, rows])?;
            let rounded: Vec<half::bf16> = values
                .par_iter()
                .with_min_len(DEQUANT_TASK_ELEMENTS)
                .map(|&v| half::bf16::from_f32(v))
                .collect();
            drop(values);
            return on_device(&self.device, || {
                Ok(Tensor::from_vec(rounded, (rows, cols), &self.device)?)
            });
        }
        let t = self.f32_tensor(name, &[cols, rows])?;
        on_device(&self.device, move || Ok(t.to_dtype(dtype)?))
    }

    /// The matrices `parts` (name, rows), all of `cols` inputs, stacked row-wise in that order:
    /// `[Σ rows, cols]` in the precision's matrix dtype. Each part goes to the device in the matrix
    /// dtype and the stacking happens there, so the device holds at most one group's parts plus the
    /// stacked matrix at a time (the host never builds the f32 concatenation, which on a 27B model
    /// was tens of GB of copies).
    fn stacked_matrix(&self, parts: &[(&str, usize)], cols: usize) -> Result<Tensor> {
        if let [(name, rows)] = parts {
            return self.matrix(name, *rows, cols);
        }
        let mut loaded = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            loaded.push(self.matrix(name, rows, cols)?);
        }
        on_device(&self.device, move || {
            let stacked = Tensor::cat(&loaded, 0)?;
            drop(loaded);
            Ok(stacked)
        })
    }

    /// The projections `parts` (GGUF name, rows), all reading the same `cols` inputs, as one
    /// [`FusedLinear`] whose parts keep the given order. Each part is loaded as [`Self::linear`] would
    /// load it (shape checks, integer path or dense), then the parts that can share a weight are
    /// stacked: all of them in the float precisions; on the integer path those of one weight format
    /// (and the float ones together).
    pub fn fused_linear(&self, parts: &[(&str, usize)], cols: usize) -> Result<FusedLinear> {
        if parts.is_empty() {
            return Err(ModelError::InvalidInput(
                "a fused projection needs at least one part".into(),
            ));
        }
        let whole = |gemm: Linear| {
            let mut offset = 0;
            let parts = parts
                .iter()
                .map(|&(name, len)| {
                    offset += len;
                    FusedPart {
                        name: name.to_string(),
                        gemm: 0,
                        offset: offset - len,
                        len,
                    }
                })
                .collect();
            FusedLinear {
                gemms: vec![gemm],
                parts,
            }
        };
        if let Some(transform) = &self.transform {
            let weight = if self.simulate_on_integer_weights {
                let mut loaded = Vec::with_capacity(parts.len());
                for &(name, rows) in parts {
                    loaded.push(self.simulated_matrix(name, rows, cols)?);
                }
                on_device(&self.device, move || {
                    let stacked = Tensor::cat(&loaded, 0)?;
                    drop(loaded);
                    Ok(stacked)
                })?
            } else {
                self.stacked_matrix(parts, cols)?
            };
            return Ok(whole(Linear::Simulated {
                weight,
                transform: transform.clone(),
            }));
        }
        if !self.precision.is_integer() {
            return Ok(whole(Linear::Dense(self.stacked_matrix(parts, cols)?)));
        }

        // Integer path: one GEMM per storage (a weight format, or float), in order of first appearance.
        let mut weights: Vec<Option<QuantWeight>> = Vec::with_capacity(parts.len());
        for &(name, rows) in parts {
            weights.push(self.quant_weight(name, rows, cols)?);
        }
        let storage = |w: &Option<QuantWeight>| w.as_ref().map(QuantWeight::format);
        let mut groups: Vec<(Option<WeightFormat>, Vec<usize>)> = Vec::new();
        for (i, w) in weights.iter().enumerate() {
            match groups.iter_mut().find(|(s, _)| *s == storage(w)) {
                Some((_, members)) => members.push(i),
                None => groups.push((storage(w), vec![i])),
            }
        }
        let mut placed: Vec<Option<FusedPart>> = vec![None; parts.len()];
        let mut gemms = Vec::with_capacity(groups.len());
        for (gemm, (format, members)) in groups.into_iter().enumerate() {
            let mut offset = 0;
            for &i in &members {
                let (name, len) = parts[i];
                placed[i] = Some(FusedPart {
                    name: name.to_string(),
                    gemm,
                    offset,
                    len,
                });
                offset += len;
            }
            let group: Vec<(&str, usize)> = members.iter().map(|&i| parts[i]).collect();
            let group_names: Vec<&str> = group.iter().map(|&(n, _)| n).collect();
            gemms.push(match format {
                None => Linear::Dense(self.stacked_matrix(&group, cols)?),
                Some(_) => {
                    // Take the parts out so each is freed once stacked.
                    let taken: Vec<QuantWeight> =
                        members.iter().filter_map(|&i| weights[i].take()).collect();
                    let weight = match <[QuantWeight; 1]>::try_from(taken) {
                        Ok([one]) => one,
                        Err(taken) => {
                            let refs: Vec<&QuantWeight> = taken.iter().collect();
                            QuantWeight::concat_rows(&refs).map_err(|source| ModelError::Quant {
                                name: group_names.join("+"),
                                source,
                            })?
                        }
                    };
                    self.quant_linear(weight, &group_names.join("+"))?
                }
            });
        }
        let parts = placed
            .into_iter()
            .enumerate()
            .map(|(i, p)| {
                p.ok_or_else(|| {
                    ModelError::InvalidInput(format!("fused projection: part {i} was not placed"))
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FusedLinear { gemms, parts })
    }

    /// The projection `name` with `rows` outputs of `cols` inputs (GGUF `[cols, rows]`): on the integer
    /// path when the precision is integer and the tensor is quantized, dense otherwise (see [`Linear`]).
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        if let Some(transform) = &self.transform {
            return Ok(Linear::Simulated {
                weight: self.simulated_matrix(name, rows, cols)?,
                transform: transform.clone(),
            });
        }
        if !self.precision.is_integer() {
            return Ok(Linear::Dense(self.matrix(name, rows, cols)?));
        }
        match self.quant_weight(name, rows, cols)? {
            Some(weight) => self.quant_linear(weight, name),
            None => Ok(Linear::Dense(self.matrix(name, rows, cols)?)),
        }
    }

    /// `weight` as a projection, put on the loader's device now (a CUDA device: uploaded).
    fn quant_linear(&self, weight: QuantWeight, name: &str) -> Result<Linear> {
        let op = QuantMatmul::new(Arc::new(weight));
        op.prepare(&self.device)
            .map_err(|e| e.context(format!("{name}: putting the integer weight on the device")))?;
        Ok(Linear::Quant(op))
    }

    /// The quantized weight `name` (`None` for a float tensor, which stays dense).
    fn quant_weight(&self, name: &str, rows: usize, cols: usize) -> Result<Option<QuantWeight>> {
        let mismatch = |reason: String| ModelError::PrecisionMismatch {
            precision: self.precision.as_str().into(),
            name: name.to_string(),
            reason,
        };
        let gguf = match self.source {
            WeightSource::Gguf(gguf) => gguf,
            WeightSource::Hf(_) => {
                return Err(mismatch(
                    "the integer path runs a GGUF file's quantized blocks; a Hugging Face checkpoint has none"
                        .into(),
                ))
            }
        };
        let info = gguf
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let expected = vec![cols as u64, rows as u64];
        if info.dims != expected {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                expected,
                found: info.dims.clone(),
            });
        }
        let format = match info.ggml_type {
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => return Ok(None),
            ty => WeightFormat::from_ggml(ty).ok_or_else(|| {
                mismatch(format!(
                    "{ty:?} has no integer kernel (Q8_0, Q4_K, Q5_K and Q6_K do)"
                ))
            })?,
        };
        if self.precision == Precision::Int8 && format != WeightFormat::Q8_0 {
            return Err(mismatch(format!(
                "int8 runs Q8_0 weights and this one is {:?}; use w4a8 (or auto) for K-quant files",
                info.ggml_type
            )));
        }
        let weight = QuantWeight::from_gguf_with(
            name,
            info.ggml_type,
            gguf.tensor_bytes(info),
            rows,
            cols,
            self.q8_scales,
        )
        .map_err(|source| ModelError::Quant {
            name: name.to_string(),
            source,
        })?;
        Ok(Some(weight))
    }
}
