//! The integer matmul as a candle custom op.
//!
//! Non-finite inputs: [`kernel::matmul`] refuses the call, naming the tensor, the row and the element
//! ([`crate::QuantError::NonFiniteActivation`]); the forward pass fails at that projection.
//!
//! On a CUDA tensor [`QuantMatmul::forward`] runs [`crate::cuda::matmul`] (feature `cuda`; a row with a
//! non-finite input becomes NaN there instead of an error), with the weight put on the device by
//! [`QuantMatmul::prepare`] at load (or on first use). Its bits are the CPU reference's (`prism
//! cuda-check` compares every output on the device).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::kernel::{self, PartSpan};
use crate::weight::{QuantWeight, WeightInfo};

/// `y = x · Wᵀ` for an f32 activation `x: [m, k]` and a quantized weight `W: [n, k]`, the activations
/// quantized per row and run of 128 from their own values; returns f32 `[m, n]`. The forward is
/// [`kernel::matmul`], the reference.
#[derive(Debug, Clone)]
pub struct QuantMatmul {
    info: WeightInfo,
    weight: Arc<QuantWeight>,
    /// `Some`: the weight holds the runs of these parts of a longer reduction, and the product is this
    /// device's share of a tensor-parallel product ([`kernel::matmul_share`]; on a GPU
    /// [`crate::cuda::matmul_share`], the same bits).
    share: Option<PartSpan>,
    /// The weight's copy on a GPU, uploaded on the first product there and shared by clones.
    #[cfg(feature = "cuda")]
    device_weight: Arc<std::sync::Mutex<Option<Arc<crate::cuda::CudaQuantWeight>>>>,
}

impl QuantMatmul {
    pub fn new(weight: Arc<QuantWeight>) -> Self {
        Self {
            info: weight.info(),
            weight,
            share: None,
            #[cfg(feature = "cuda")]
            device_weight: Arc::default(),
        }
    }

    /// Name, format and shape of the weight.
    pub fn info(&self) -> &WeightInfo {
        &self.info
    }

    /// The weight's tensor name (for errors).
    pub fn name(&self) -> &str {
        &self.info.name
    }

    /// Outputs.
    pub fn rows(&self) -> usize {
        self.info.rows
    }

    /// The weight.
    pub fn weight(&self) -> &Arc<QuantWeight> {
        &self.weight
    }

    /// The same product restricted to the weight rows `rows`, in that order (e.g. the letters of a
    /// read-out). Every output depends only on its own row, so the results are bit-identical to those
    /// columns of the full product.
    pub fn select_rows(&self, rows: &[u32]) -> crate::Result<Self> {
        let mut op = Self::new(Arc::new(self.weight.select_rows(rows)?));
        op.share = self.share.clone();
        Ok(op)
    }

    /// Device `device` of `devices`' share of this product, whose reduction is split on part
    /// boundaries ([`PartSpan::of_device`]): the weight's columns of the device's runs, the product
    /// [`kernel::matmul_share`] of the same columns of the input. Where the part boundaries are not
    /// on the format's blocks, [`QuantWeight::select_cols`] refuses.
    pub fn share_of_device(&self, device: usize, devices: usize) -> crate::Result<Self> {
        if self.share.is_some() {
            return Err(crate::QuantError::Input(format!(
                "{:?} is already a share of a product",
                self.name()
            )));
        }
        let span = PartSpan::of_device(crate::run_count(self.weight.cols()), device, devices)?;
        let runs = span.runs();
        let cols = runs.start * crate::RUN..(runs.end * crate::RUN).min(self.weight.cols());
        let mut op = Self::new(Arc::new(self.weight.select_cols(cols)?));
        op.share = Some(span);
        Ok(op)
    }

    /// The parts this product's share holds (`None`: the whole product).
    pub fn share(&self) -> Option<&PartSpan> {
        self.share.as_ref()
    }

    /// Puts the weight on `device` now rather than on the first product there (nothing to do on the
    /// CPU). The loader calls it so a model's first pass does not upload every weight.
    pub fn prepare(&self, device: &candle_core::Device) -> candle_core::Result<()> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = device {
            self.device_weight(dev)?;
        }
        #[cfg(not(feature = "cuda"))]
        let _ = device;
        Ok(())
    }

    /// The weight on `dev`, uploaded on the first call.
    #[cfg(feature = "cuda")]
    fn device_weight(
        &self,
        dev: &candle_core::cuda_backend::CudaDevice,
    ) -> candle_core::Result<Arc<crate::cuda::CudaQuantWeight>> {
        let mut slot = self.device_weight.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some(w) => Ok(w.clone()),
            None => {
                let w = Arc::new(crate::cuda::CudaQuantWeight::upload(&self.weight, dev)?);
                *slot = Some(w.clone());
                Ok(w)
            }
        }
    }

    /// Applies the op to `x: [m, k]` (made contiguous first): [`kernel::matmul`] on the CPU,
    /// [`crate::cuda::matmul`] on a CUDA device.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            let w = self.device_weight(dev)?;
            return match &self.share {
                Some(span) => crate::cuda::matmul_share(x, &w, span),
                None => crate::cuda::matmul(x, &w),
            };
        }
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// `swiglu(gate_up) · Wᵀ` fused on a CUDA device ([`crate::cuda::matmul_swiglu`]: the SwiGLU formed
    /// by the activation quantizer, the bits of prism-model's SwiGLU then [`QuantMatmul::forward`]);
    /// `None` elsewhere, where the caller applies its SwiGLU and then [`QuantMatmul::forward`].
    pub fn forward_swiglu(
        &self,
        gate_up: &Tensor,
        f: usize,
    ) -> candle_core::Result<Option<Tensor>> {
        if self.share.is_some() {
            // A share is one device's part of a product: nothing to fuse it with here.
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = gate_up.device() {
            if gate_up.dtype() == candle_core::DType::F32 {
                let w = self.device_weight(dev)?;
                return crate::cuda::matmul_swiglu(gate_up, f, &w).map(Some);
            }
        }
        let _ = (gate_up, f);
        Ok(None)
    }

    /// `gated_rms_norm(x, gate, weight) · Wᵀ` fused on a CUDA device for heads of 128 values
    /// ([`crate::cuda::matmul_gated_norm`]: the norm formed by the activation quantizer, the bits of
    /// prism-model's CUDA gated norm then [`QuantMatmul::forward`]); `None` elsewhere or for other head
    /// sizes, where the caller applies its norm and then [`QuantMatmul::forward`].
    // The parameters of prism-model's `Linear::forward_gated_norm`, which calls this one first.
    pub fn forward_gated_norm(
        &self,
        x: &Tensor,
        gate: &Tensor,
        weight: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Option<Tensor>> {
        if self.share.is_some() {
            // A share is one device's part of a product: nothing to fuse it with here.
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            let f32 = candle_core::DType::F32;
            let heads_of_128 = x.dims().len() == 3 && x.dims()[2] == crate::activation::RUN;
            if x.dtype() == f32 && gate.dtype() == f32 && weight.dtype() == f32 && heads_of_128 {
                let w = self.device_weight(dev)?;
                return crate::cuda::matmul_gated_norm(x, gate, weight, eps, &w).map(Some);
            }
        }
        let _ = (x, gate, weight, eps);
        Ok(None)
    }
}

impl QuantMatmul {
    /// `rms_norm(x + residual) · Wᵀ` fused on a CUDA device ([`crate::cuda::matmul_add_norm`]: the
    /// residual add and the norm formed by the activation quantizer, the bits of prism-model's CUDA
    /// `add_rms_norm` then [`QuantMatmul::forward`]), returning the sum `x + residual` (when a residual
    /// is given) and the product; `None` elsewhere, or where that kernel does not take the rows, where
    /// the caller adds, normalizes and then calls [`QuantMatmul::forward`].
    pub fn forward_add_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        eps: f64,
    ) -> candle_core::Result<Option<(Option<Tensor>, Tensor)>> {
        if self.share.is_some() {
            return Ok(None);
        }
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            let f32 = candle_core::DType::F32;
            if x.dtype() == f32
                && residual.is_none_or(|r| r.dtype() == f32)
                && weight.dtype() == f32
                && x.rank() == 2
            {
                let w = self.device_weight(dev)?;
                return crate::cuda::matmul_add_norm(x, residual, weight, eps, &w);
            }
        }
        let _ = (x, residual, weight, eps);
        Ok(None)
    }
}

impl CustomOp1 for QuantMatmul {
    fn name(&self) -> &'static str {
        "prism-quant-matmul"
    }

    fn cpu_fwd(
        &self,
        storage: &CpuStorage,
        layout: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = layout.shape().dims2()?;
        let w = &self.weight;
        if k != w.cols() {
            candle_core::bail!(
                "integer matmul: x is [{m}, {k}] but {:?} takes {} inputs",
                w.name(),
                w.cols()
            );
        }
        let x = match storage {
            CpuStorage::F32(x) => match layout.contiguous_offsets() {
                Some((start, end)) => &x[start..end],
                None => candle_core::bail!("integer matmul: x must be contiguous"),
            },
            other => candle_core::bail!(
                "integer matmul: x must be f32, not {:?}",
                candle_core::backend::BackendStorage::dtype(other)
            ),
        };
        let y = match &self.share {
            None => kernel::matmul(x, m, w),
            Some(span) => kernel::matmul_share(x, m, w, span),
        }
        .map_err(|e| candle_core::Error::Msg(format!("{:?}: {e}", w.name())))?;
        Ok((CpuStorage::F32(y), Shape::from((m, w.rows()))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _storage: &candle_core::CudaStorage,
        _layout: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        Err(candle_core::Error::Msg(format!(
            "integer matmul of {:?}: on CUDA it runs through QuantMatmul::forward, not as a candle op",
            self.info.name
        )))
    }
}
