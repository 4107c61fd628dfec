//! The integer matmul as a candle custom op.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::activation::ActivationScale;
use crate::kernel;
use crate::weight::QuantWeight;

/// `y = x · Wᵀ` for an f32 activation `x: [m, k]` and a quantized weight `W: [n, k]` with the static
/// activation scale of this linear input; returns f32 `[m, n]`. The CPU forward is
/// [`kernel::matmul`], the reference. A device kernel must return the same bits.
#[derive(Debug, Clone)]
pub struct QuantMatmul {
    pub weight: Arc<QuantWeight>,
    pub scale: ActivationScale,
    /// The weight's copy on the GPU, uploaded on the first product there and shared by clones.
    #[cfg(feature = "cuda")]
    device_weight: Arc<std::sync::Mutex<Option<Arc<crate::cuda::CudaQuantWeight>>>>,
}

impl QuantMatmul {
    pub fn new(weight: Arc<QuantWeight>, scale: ActivationScale) -> Self {
        Self {
            weight,
            scale,
            #[cfg(feature = "cuda")]
            device_weight: Arc::default(),
        }
    }

    /// Applies the op to `x: [m, k]` (made contiguous first). On a CUDA device this runs
    /// [`crate::cuda::matmul`], which returns the CPU reference's bits.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            let weight = {
                let mut slot = self.device_weight.lock().unwrap_or_else(|e| e.into_inner());
                match slot.as_ref() {
                    Some(w) => w.clone(),
                    None => {
                        let w = Arc::new(crate::cuda::CudaQuantWeight::upload(&self.weight, dev)?);
                        *slot = Some(w.clone());
                        w
                    }
                }
            };
            return crate::cuda::matmul(&x.contiguous()?, &weight, &self.scale);
        }
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// Uploads the weight to `device` now (at load time) rather than on the first product.
    #[cfg(feature = "cuda")]
    pub fn upload_to(&self, device: &candle_core::CudaDevice) -> candle_core::Result<()> {
        let mut slot = self.device_weight.lock().unwrap_or_else(|e| e.into_inner());
        if slot.is_none() {
            *slot = Some(Arc::new(crate::cuda::CudaQuantWeight::upload(&self.weight, device)?));
        }
        Ok(())
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
        let y = kernel::matmul(x, m, w, &self.scale)
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
            "integer matmul of {:?}: the CUDA kernel is not written yet (the CPU op is the reference)",
            self.weight.name()
        )))
    }
}
