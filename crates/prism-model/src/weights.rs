//! Loading tensors by name from a GGUF file, with every shape checked against the configuration.
//!
//! The reference path dequantizes every tensor (BF16, Q8_0, Q4_K, Q6_K, …) to f32 with `prism-gguf`'s
//! bit-exact llama.cpp dequantization. Matrices can then be kept in f32 or rounded to bf16.

use candle_core::{DType, Device, Tensor};
use prism_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::hf::HfWeights;

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
}

impl Precision {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f64" => Ok(Precision::F64),
            other => Err(ModelError::UnsupportedPrecision(other.to_string())),
        }
    }

    /// The dtype matrices are stored in.
    pub fn matrix_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16 => DType::BF16,
            Precision::F64 => DType::F64,
        }
    }

    /// The dtype of activations, norms, states and everything that is not a matrix.
    pub fn activation_dtype(self) -> DType {
        match self {
            Precision::F32 | Precision::Bf16 => DType::F32,
            Precision::F64 => DType::F64,
        }
    }
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
}

impl<'a> WeightLoader<'a> {
    pub fn new(gguf: &'a GgufFile, device: &Device, precision: Precision) -> Self {
        Self {
            source: WeightSource::Gguf(gguf),
            device: device.clone(),
            precision,
        }
    }

    /// Reads an HF checkpoint by GGUF names ([`HfWeights`] does the conversion).
    pub fn from_hf(hf: &'a HfWeights<'a>, device: &Device, precision: Precision) -> Self {
        Self {
            source: WeightSource::Hf(hf),
            device: device.clone(),
            precision,
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
        let gguf = match self.source {
            WeightSource::Gguf(gguf) => gguf,
            WeightSource::Hf(hf) => {
                let values = hf.gguf_values(name, ne)?;
                let shape: Vec<usize> = ne.iter().rev().copied().collect();
                return Ok(Tensor::from_vec(values, shape, &self.device)?);
            }
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
        let values = gguf
            .dequantize(name)
            .map_err(|source| ModelError::TensorRead {
                name: name.to_string(),
                source,
            })?;
        let shape: Vec<usize> = ne.iter().rev().copied().collect();
        let expected_len: usize = shape.iter().product();
        if values.len() != expected_len {
            return Err(ModelError::DequantizedLength {
                name: name.to_string(),
                expected: expected_len,
                found: values.len(),
            });
        }
        Ok(Tensor::from_vec(values, shape, &self.device)?)
    }

    /// A 1-D tensor of `len` elements (norm weights, per-head scalars), in the activation dtype.
    pub fn vector(&self, name: &str, len: usize) -> Result<Tensor> {
        self.activation_tensor(name, &[len])
    }

    /// [`Self::f32_tensor`] converted to the activation dtype.
    pub fn activation_tensor(&self, name: &str, ne: &[usize]) -> Result<Tensor> {
        Ok(self
            .f32_tensor(name, ne)?
            .to_dtype(self.precision.activation_dtype())?)
    }

    /// A linear-layer weight with `rows` outputs of `cols` inputs: GGUF `[cols, rows]`, returned as
    /// `[rows, cols]` in the precision's matrix dtype.
    pub fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Tensor> {
        let t = self.f32_tensor(name, &[cols, rows])?;
        Ok(t.to_dtype(self.precision.matrix_dtype())?)
    }
}
