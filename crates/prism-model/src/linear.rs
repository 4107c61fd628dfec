//! A projection of the decoder: `y = x · Wᵀ` on the float path or on the exact integer path.
//!
//! - [`Linear::Dense`]: a float matrix through the batch-invariant [`crate::ops::linear`] (f32, bf16,
//!   f64 precisions, and float tensors of a quantized file).
//! - [`Linear::Quant`]: the file's Q8_0 weights re-blocked per row and run of 128, or its own K-quant
//!   blocks, with int8 activations at dynamic per-(row, run) scales ([`prism_quant::QuantMatmul`],
//!   exact integer run sums, fixed reduction order).
//! - [`Linear::Simulated`]: a dense matmul whose input is first rewritten by an [`InputTransform`] (for
//!   experiments that simulate activation formats on the float path, e.g. llama.cpp's).
//!
//! [`FusedLinear`] runs several projections of the same input (a DeltaNet layer's qkv | z | β | α, an
//! attention layer's q | k | v, the MLP's gate | up) as one weight whose rows are the parts' rows in a
//! fixed order, so the input is read (and on the integer path quantized) once per GEMM instead of once
//! per part. Each output column depends only on its own weight row and the input row (on the integer
//! path the activation scales come from the input row alone, so the parts share them), so every part's
//! columns are bit for bit its own product's.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use prism_quant::QuantMatmul;

use crate::ops;
use crate::tensor_parallel::AllReduce;

/// Rewrites a projection's input `[n, in]` (f32) before a [`Linear::Simulated`] matmul.
pub type InputTransform = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

#[derive(Clone)]
pub enum Linear {
    /// `[out, in]` float matrix.
    Dense(Tensor),
    /// Quantized weight; the activations are quantized per row and run of 128 on each call.
    Quant(QuantMatmul),
    /// `[out, in]` float matrix whose input goes through `transform` first.
    Simulated {
        weight: Tensor,
        transform: Arc<InputTransform>,
    },
    /// Device `device`'s share of a tensor-parallel product split over its input columns on the
    /// integer contract's part boundaries ([`QuantMatmul::share_of_device`]): it multiplies the
    /// device's columns of the input and `reduce` adds every device's share up the single-device
    /// tree, so each device gets the whole product, bit for bit one device's.
    Share {
        share: QuantMatmul,
        reduce: Arc<dyn AllReduce>,
        device: usize,
    },
}

impl std::fmt::Debug for Linear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Linear::Dense(w) => f.debug_tuple("Dense").field(w).finish(),
            Linear::Quant(op) => f.debug_tuple("Quant").field(op).finish(),
            Linear::Simulated { weight, .. } => f
                .debug_struct("Simulated")
                .field("weight", weight)
                .finish_non_exhaustive(),
            Linear::Share { share, device, .. } => f
                .debug_struct("Share")
                .field("share", share)
                .field("device", device)
                .finish_non_exhaustive(),
        }
    }
}

impl Linear {
    /// `x: [n, in]` → `[n, out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // The integer path takes f32 activations and returns f32.
        let f32_input = || -> Result<Tensor> {
            if x.dtype() == DType::F32 {
                Ok(x.clone())
            } else {
                x.to_dtype(DType::F32)
            }
        };
        match self {
            Linear::Dense(w) => ops::linear(x, w),
            Linear::Quant(op) => op.forward(&f32_input()?),
            Linear::Simulated { weight, transform } => ops::linear(&transform(x)?, weight),
            Linear::Share {
                share,
                reduce,
                device,
            } => reduce.all_reduce(*device, share.forward(&f32_input()?)?),
        }
    }

    /// Device `device` of `devices`' share of this product: its input columns of the device's parts
    /// of the integer contract's reduction (whether those are its heads' columns,
    /// [`crate::tensor_parallel`] checks), reduced by `reduce`. Only the integer path splits
    /// bit-exactly: a float weight is refused.
    pub fn share_of_device(
        &self,
        device: usize,
        devices: usize,
        reduce: Arc<dyn AllReduce>,
    ) -> crate::Result<Linear> {
        match self {
            Linear::Quant(op) => Ok(Linear::Share {
                share: op.share_of_device(device, devices).map_err(|source| {
                    crate::ModelError::Quant {
                        name: op.name().to_string(),
                        source,
                    }
                })?,
                reduce,
                device,
            }),
            _ => Err(crate::ModelError::InvalidInput(
                "tensor parallelism splits products on the integer path only (int8, w4a8): this \
                 projection is a float matrix"
                    .into(),
            )),
        }
    }

    /// `swiglu(gate_up) · Wᵀ` (`gate_up: [n, 2f]`): [`crate::ops::swiglu_as`] in the dtype this
    /// projection reads, then [`Linear::forward`]; on the integer path on a GPU the two in one
    /// ([`QuantMatmul::forward_swiglu`]: the same bits, the SwiGLU formed as the activations are
    /// quantized).
    pub fn forward_swiglu(&self, gate_up: &Tensor, f: usize) -> Result<Tensor> {
        if let Linear::Quant(op) = self {
            if let Some(y) = op.forward_swiglu(gate_up, f)? {
                return Ok(y);
            }
        }
        let h = crate::ops::swiglu_as(gate_up, f, self.input_dtype(gate_up.dtype()))?;
        self.forward(&h)
    }

    /// `gated_rms_norm_rows(x, gate, weight) · Wᵀ` (`x: [n, h, d]`, `gate: [n, h·d]`): the DeltaNet
    /// output norm in the dtype this projection reads, then [`Linear::forward`]; on the integer path on a
    /// GPU with heads of 128 the two in one ([`QuantMatmul::forward_gated_norm`]: the same bits, the
    /// norm formed as the activations are quantized).
    pub fn forward_gated_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        if let Linear::Quant(op) = self {
            if let Some(y) = op.forward_gated_norm(x, gate, weight, eps)? {
                return Ok(y);
            }
        }
        let y = crate::ops::gated_rms_norm_rows(x, gate, weight, eps, self.input_dtype(x.dtype()))?;
        self.forward(&y)
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
                Linear::Quant(
                    op.select_rows(rows)
                        .map_err(|source| crate::ModelError::Quant {
                            name: op.name().to_string(),
                            source,
                        })?,
                )
            }
            Linear::Simulated { weight, transform } => Linear::Simulated {
                weight: pick(weight)?,
                transform: transform.clone(),
            },
            Linear::Share { .. } => {
                return Err(crate::ModelError::InvalidInput(
                    "a tensor-parallel share of a product has no rows to select".into(),
                ))
            }
        })
    }

    /// Outputs.
    pub fn out_features(&self) -> usize {
        match self {
            Linear::Dense(w) | Linear::Simulated { weight: w, .. } => w.dims()[0],
            Linear::Quant(op) | Linear::Share { share: op, .. } => op.rows(),
        }
    }

    /// Whether this projection runs on the integer path.
    pub fn is_quantized(&self) -> bool {
        matches!(self, Linear::Quant(_) | Linear::Share { .. })
    }

    /// The dtype this projection wants its input in when the activations are `act`: bf16 for a bf16
    /// weight multiplied on CUDA (cuBLAS reads bf16 operands, so the producer writes them rounded,
    /// instead of a separate cast of its f32 output), else `act`. The integer path and simulations
    /// always take the f32 activation.
    pub fn input_dtype(&self, act: DType) -> DType {
        match self {
            Linear::Dense(w)
                if act == DType::F32 && w.dtype() == DType::BF16 && w.device().is_cuda() =>
            {
                DType::BF16
            }
            _ => act,
        }
    }
}

/// A projection's input: rows ready to multiply, or the RMS norm of a residual stream's next value
/// `x + residual` (`residual` `None`: of `x` itself) that is not yet formed. [`FusedLinear::forward_input`]
/// forms the sum and the norm with [`crate::ops::add_rms_norm`] / [`crate::ops::rms_norm_as`] first, except
/// on the integer path on CUDA, where the product's activation quantizer forms them
/// (`QuantMatmul::forward_add_norm`: the same bits).
#[derive(Debug, Clone, Copy)]
pub enum ProjInput<'a> {
    Rows(&'a Tensor),
    Norm {
        x: &'a Tensor,
        residual: Option<&'a Tensor>,
        weight: &'a Tensor,
        eps: f64,
    },
}

impl ProjInput<'_> {
    /// The rows the projection reads (`x` of a pending norm: the same shape).
    pub fn rows(&self) -> &Tensor {
        match self {
            ProjInput::Rows(x) | ProjInput::Norm { x, .. } => x,
        }
    }
}

/// Where one part of a [`FusedLinear`] lies in the outputs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FusedPart {
    /// The weight's GGUF name.
    pub name: String,
    /// Which of [`FusedLinear::gemms`] computes it.
    pub gemm: usize,
    /// Its first column in that GEMM's output.
    pub offset: usize,
    /// Its columns (the weight's rows).
    pub len: usize,
}

/// Projections of one input run as few GEMMs as their storage allows (see the module docs).
///
/// Parts keep their documented order. In the float precisions (and simulations) all parts are one
/// GEMM. On the integer path a GEMM holds the parts of one weight format, in their order, and float
/// parts of a quantized file share one dense GEMM: a Q4_K_M file's `attn_v` or `attn_qkv` may be Q6_K
/// next to Q4_K siblings (llama-quantize's mix), and one weight has one format.
#[derive(Debug, Clone)]
pub struct FusedLinear {
    /// The GEMMs, each over the concatenated rows of its parts.
    pub gemms: Vec<Linear>,
    /// The parts in their documented order.
    pub parts: Vec<FusedPart>,
}

impl FusedLinear {
    /// Runs every GEMM once on `x: [n, in]`; [`FusedOutput::part`] gives each part's `[n, len]`.
    pub fn forward(&self, x: &Tensor) -> Result<FusedOutput<'_>> {
        let outs = self
            .gemms
            .iter()
            .map(|g| g.forward(x))
            .collect::<Result<Vec<_>>>()?;
        Ok(FusedOutput { fused: self, outs })
    }

    /// [`FusedLinear::forward`] of `input`, a pending norm formed first (see [`ProjInput`]); returns the
    /// outputs and, for a norm of `x + residual`, that sum (the residual stream's next value).
    pub fn forward_input(
        &self,
        input: &ProjInput<'_>,
    ) -> Result<(FusedOutput<'_>, Option<Tensor>)> {
        let (x, residual, weight, eps) = match *input {
            ProjInput::Rows(x) => return Ok((self.forward(x)?, None)),
            ProjInput::Norm {
                x,
                residual,
                weight,
                eps,
            } => (x, residual, weight, eps),
        };
        // The integer path on a GPU: the activation quantizer forms the sum and the norm itself (the
        // same bits as `add_rms_norm` then `forward`), when the parts are one GEMM.
        if let [Linear::Quant(op)] = self.gemms.as_slice() {
            if let Some((sum, y)) = op.forward_add_norm(x, residual, weight, eps)? {
                return Ok((
                    FusedOutput {
                        fused: self,
                        outs: vec![y],
                    },
                    sum,
                ));
            }
        }
        let dtype = self.input_dtype(x.dtype());
        let (sum, h) = crate::profile::time("norm", x.device(), || -> Result<_> {
            match residual {
                Some(r) => {
                    let (sum, h) = ops::add_rms_norm(x, r, weight, eps, dtype)?;
                    Ok((Some(sum), h))
                }
                None => Ok((None, ops::rms_norm_as(x, weight, eps, dtype)?)),
            }
        })?;
        Ok((self.forward(&h)?, sum))
    }

    /// The same projections restricted to rows `rows[i]` of part `i` (indices within the part, in
    /// that order), e.g. one device's heads. Every output depends only on its own weight row, so each
    /// kept output has the bits of the whole projection's.
    pub fn select_part_rows(&self, rows: &[Vec<u32>]) -> crate::Result<FusedLinear> {
        if rows.len() != self.parts.len() {
            return Err(crate::ModelError::InvalidInput(format!(
                "a fused projection of {} parts given rows of {}",
                self.parts.len(),
                rows.len()
            )));
        }
        let mut parts = Vec::with_capacity(self.parts.len());
        let mut gemms = Vec::with_capacity(self.gemms.len());
        for (g, gemm) in self.gemms.iter().enumerate() {
            let mut picked: Vec<u32> = Vec::new();
            for (part, kept) in self.parts.iter().zip(rows) {
                if part.gemm != g {
                    continue;
                }
                if let Some(&bad) = kept.iter().find(|&&r| r as usize >= part.len) {
                    return Err(crate::ModelError::InvalidInput(format!(
                        "{}: row {bad} of a part of {} rows",
                        part.name, part.len
                    )));
                }
                parts.push(FusedPart {
                    name: part.name.clone(),
                    gemm: g,
                    offset: picked.len(),
                    len: kept.len(),
                });
                picked.extend(kept.iter().map(|&r| r + part.offset as u32));
            }
            gemms.push(gemm.select_rows(&picked)?);
        }
        // The parts in their documented order (the loop above went GEMM by GEMM).
        let order: Vec<&str> = self.parts.iter().map(|p| p.name.as_str()).collect();
        parts.sort_by_key(|p| order.iter().position(|n| *n == p.name));
        Ok(FusedLinear { gemms, parts })
    }

    /// Outputs of all parts together.
    pub fn out_features(&self) -> usize {
        self.parts.iter().map(|p| p.len).sum()
    }

    /// Whether any of the GEMMs runs on the integer path.
    pub fn is_quantized(&self) -> bool {
        self.gemms.iter().any(Linear::is_quantized)
    }

    /// [`Linear::input_dtype`] of all its GEMMs: bf16 only when every one of them takes bf16.
    pub fn input_dtype(&self, act: DType) -> DType {
        let all_bf16 =
            !self.gemms.is_empty() && self.gemms.iter().all(|g| g.input_dtype(act) == DType::BF16);
        if all_bf16 {
            DType::BF16
        } else {
            act
        }
    }
}

/// The GEMM outputs of one [`FusedLinear::forward`].
#[derive(Debug, Clone)]
pub struct FusedOutput<'a> {
    fused: &'a FusedLinear,
    outs: Vec<Tensor>,
}

impl FusedOutput<'_> {
    /// Part `i`, `[n, len_i]`: a column range (a view, not a copy) of its GEMM's output.
    pub fn part(&self, i: usize) -> Result<Tensor> {
        let p = self.fused.parts.get(i).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fused projection: no part {i} (it has {})",
                self.fused.parts.len()
            ))
        })?;
        self.gemm_output(p)?.narrow(1, p.offset, p.len)
    }

    /// Part `i` as `[n, heads, d]` heads of `d` columns: a view of its GEMM's output when the part
    /// starts on a multiple of `d` of a contiguous output whose width is one too (so the kernels that
    /// take row maps read it in place); otherwise a reshaped copy.
    pub fn part_heads(&self, i: usize, heads: usize, d: usize) -> Result<Tensor> {
        let p = self.fused.parts.get(i).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fused projection: no part {i} (it has {})",
                self.fused.parts.len()
            ))
        })?;
        let out = self.gemm_output(p)?;
        let (n, width) = out.dims2()?;
        if d > 0 && p.len == heads * d && p.offset % d == 0 && width % d == 0 && out.is_contiguous()
        {
            return out
                .reshape((n, width / d, d))?
                .narrow(1, p.offset / d, heads);
        }
        self.part(i)?.reshape((n, heads, d))
    }

    fn gemm_output(&self, p: &FusedPart) -> Result<&Tensor> {
        self.outs.get(p.gemm).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "fused projection: part {:?} names GEMM {} of {}",
                p.name,
                p.gemm,
                self.outs.len()
            ))
        })
    }

    /// Parts `range` side by side, `[n, Σ len]`: a view when they are adjacent in one GEMM's output
    /// (always, unless the integer path had to split them by format), else a concatenation.
    pub fn parts(&self, range: Range<usize>) -> Result<Tensor> {
        let parts = self.fused.parts.get(range.clone()).unwrap_or(&[]);
        let (first, last) = match (parts.first(), parts.last()) {
            (Some(f), Some(l)) => (f, l),
            _ => candle_core::bail!(
                "fused projection: no parts {range:?} (it has {})",
                self.fused.parts.len()
            ),
        };
        let adjacent = parts
            .windows(2)
            .all(|w| w[1].gemm == w[0].gemm && w[1].offset == w[0].offset + w[0].len);
        if adjacent {
            let len = last.offset + last.len - first.offset;
            return self.gemm_output(first)?.narrow(1, first.offset, len);
        }
        let pieces = range.map(|i| self.part(i)).collect::<Result<Vec<_>>>()?;
        Tensor::cat(&pieces, 1)
    }
}
