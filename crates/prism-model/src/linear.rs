//! A projection of the decoder: `y = x · Wᵀ` on the float path or on the exact integer path.
//!
//! - [`Linear::Dense`]: a float matrix through the batch-invariant [`crate::ops::linear`] (f32, bf16,
//!   f64 precisions, and float tensors of a quantized file).
//! - [`Linear::Quant`]: the file's own Q8_0 / K-quant blocks with int8 activations at this input's
//!   static scale ([`prism_quant::QuantMatmul`], exact integer block sums, fixed reduction order).
//! - [`Linear::Recording`]: calibration — a dense matmul that also records the largest |x| it sees.

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use prism_quant::QuantMatmul;

use crate::calibration::RangeRecorder;
use crate::ops;

#[derive(Debug, Clone)]
pub enum Linear {
    /// `[out, in]` float matrix.
    Dense(Tensor),
    /// Quantized weight + the static activation scale of its input.
    Quant(QuantMatmul),
    /// A dense matrix whose input range is recorded under `name` (the weight's GGUF name).
    Recording {
        weight: Tensor,
        name: String,
        recorder: Arc<RangeRecorder>,
    },
}

impl Linear {
    /// `x: [n, in]` → `[n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Linear::Dense(w) => ops::linear(x, w),
            Linear::Quant(op) => {
                // The integer path takes f32 activations and returns f32.
                let x = if x.dtype() == DType::F32 {
                    x.clone()
                } else {
                    x.to_dtype(DType::F32)?
                };
                op.forward(&x)
            }
            Linear::Recording {
                weight,
                name,
                recorder,
            } => {
                recorder.record(name, x)?;
                ops::linear(x, weight)
            }
        }
    }

    /// The same projection restricted to output rows `rows` (e.g. the letters of a read-out). Every
    /// output depends only on its own weight row, so the results are bit-identical to those columns of
    /// the full product.
    pub fn select_rows(&self, rows: &[u32]) -> crate::Result<Linear> {
        let pick = |w: &Tensor| -> Result<Tensor> {
            let idx = Tensor::from_vec(rows.to_vec(), rows.len(), w.device())?;
            w.index_select(&idx, 0)
        };
        Ok(match self {
            Linear::Dense(w) => Linear::Dense(pick(w)?),
            Linear::Quant(op) => {
                let weight =
                    op.weight
                        .select_rows(rows)
                        .map_err(|source| crate::ModelError::Quant {
                            name: op.weight.name().to_string(),
                            source,
                        })?;
                Linear::Quant(QuantMatmul::new(Arc::new(weight), op.scale))
            }
            Linear::Recording {
                weight,
                name,
                recorder,
            } => Linear::Recording {
                weight: pick(weight)?,
                name: name.clone(),
                recorder: recorder.clone(),
            },
        })
    }

    /// Outputs.
    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense(w) | Linear::Recording { weight: w, .. } => w.dims()[0],
            Linear::Quant(op) => op.weight.rows(),
        }
    }

    /// Whether this projection runs on the integer path.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Linear::Quant(_))
    }
}
