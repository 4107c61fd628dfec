//! The integer matmul as a candle custom op.
//!
//! # Non-finite inputs: CPU and CUDA differ in *where* they are reported
//!
//! - **CPU** (the reference): [`kernel::matmul`] refuses the call, naming the tensor, the row and the
//!   element ([`crate::QuantError::NonFiniteActivation`]); the forward pass fails at that projection.
//! - **CUDA** (default, [`NonFiniteMode::Poison`]): no stream synchronization per GEMM. Every output of
//!   a row whose input holds a NaN or ±∞ becomes NaN; the other rows keep their bits. The NaN flows
//!   through that sequence's own later operations to its logits, and the read-out reports the affected
//!   prompt (prism-decision's `DecisionError::NonFiniteLogits`); the other sequences of the batch are
//!   unaffected.
//! - **CUDA with `PRISM_QGEMM_NONFINITE=error`** ([`NonFiniteMode::Error`]): the CPU's behaviour (the
//!   same error, same row and element), at the cost of one synchronization per GEMM: for finding the
//!   first projection that diverged.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor};

use crate::activation::ActivationScale;
use crate::kernel;
use crate::weight::{QuantWeight, WeightInfo};

/// The environment variable that picks [`NonFiniteMode`] on CUDA (read once per process).
pub const NONFINITE_ENV: &str = "PRISM_QGEMM_NONFINITE";

/// What a CUDA [`QuantMatmul::forward`] does with an input row holding a NaN or ±∞.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NonFiniteMode {
    /// The row's outputs become NaN; nothing is read back (no synchronization).
    #[default]
    Poison,
    /// The call fails with the CPU's error (reads the row flags back: one synchronization per GEMM).
    Error,
}

/// The mode named by [`NONFINITE_ENV`]'s value (`None`: unset). Anything but `poison` / `error` (any
/// case, surrounding blanks ignored, empty = unset) is an error naming the variable and the value.
pub fn parse_nonfinite_mode(value: Option<&str>) -> crate::Result<NonFiniteMode> {
    match value.map(|v| v.trim().to_ascii_lowercase()).as_deref() {
        None | Some("") | Some("poison") => Ok(NonFiniteMode::Poison),
        Some("error") => Ok(NonFiniteMode::Error),
        Some(other) => Err(crate::QuantError::Input(format!(
            "{NONFINITE_ENV}={other:?}: expected \"poison\" (NaN rows, the default) or \"error\" \
             (refuse the call, one synchronization per GEMM)"
        ))),
    }
}

/// The mode of this process: [`NONFINITE_ENV`], read once. A bad value is an error on every call.
pub fn nonfinite_mode() -> crate::Result<NonFiniteMode> {
    static MODE: std::sync::OnceLock<std::result::Result<NonFiniteMode, String>> =
        std::sync::OnceLock::new();
    MODE.get_or_init(|| {
        let value = match std::env::var(NONFINITE_ENV) {
            Ok(v) => Some(v),
            Err(std::env::VarError::NotPresent) => None,
            Err(std::env::VarError::NotUnicode(v)) => Some(v.to_string_lossy().into_owned()),
        };
        parse_nonfinite_mode(value.as_deref()).map_err(|e| e.to_string())
    })
    .clone()
    .map_err(crate::QuantError::Input)
}

/// `y = x · Wᵀ` for an f32 activation `x: [m, k]` and a quantized weight `W: [n, k]` with the static
/// activation scale of this linear input; returns f32 `[m, n]`. The CPU forward is
/// [`kernel::matmul`], the reference. A device kernel must return the same bits.
///
/// The weight's numbers live on the host ([`QuantMatmul::new`]: the CPU product, and a copy uploaded
/// to a GPU on the first product there) or on a GPU only ([`QuantMatmul::from_device`]: what a model
/// load for a GPU makes, so that the host does not keep a second copy of the weights).
#[derive(Debug, Clone)]
pub struct QuantMatmul {
    info: WeightInfo,
    /// The weight on the host (`None` when it was loaded straight to a GPU).
    host: Option<Arc<QuantWeight>>,
    pub scale: ActivationScale,
    /// The weight's copy on the GPU, uploaded at load or on the first product there and shared by
    /// clones.
    #[cfg(feature = "cuda")]
    device_weight: Arc<std::sync::Mutex<Option<Arc<crate::cuda::CudaQuantWeight>>>>,
}

impl QuantMatmul {
    pub fn new(weight: Arc<QuantWeight>, scale: ActivationScale) -> Self {
        Self {
            info: weight.info(),
            host: Some(weight),
            scale,
            #[cfg(feature = "cuda")]
            device_weight: Arc::default(),
        }
    }

    /// The product of a weight already on a GPU (no host copy: the CPU forward refuses it).
    #[cfg(feature = "cuda")]
    pub fn from_device(weight: crate::cuda::CudaQuantWeight, scale: ActivationScale) -> Self {
        Self {
            info: weight.info(),
            host: None,
            scale,
            device_weight: Arc::new(std::sync::Mutex::new(Some(Arc::new(weight)))),
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

    /// The weight on the host, if this product keeps one ([`QuantMatmul::new`]).
    pub fn host_weight(&self) -> Option<&Arc<QuantWeight>> {
        self.host.as_ref()
    }

    /// The same product restricted to the weight rows `rows`, in that order (e.g. the letters of a
    /// read-out): on the host when the weight is there, else gathered on its GPU. Every output
    /// depends only on its own row, so the results are bit-identical to those columns of the full
    /// product.
    pub fn select_rows(&self, rows: &[u32]) -> crate::Result<Self> {
        if let Some(host) = &self.host {
            return Ok(Self::new(Arc::new(host.select_rows(rows)?), self.scale));
        }
        #[cfg(feature = "cuda")]
        {
            let on_device = self
                .device_weight
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            if let Some(w) = on_device {
                if let Some(&row) = rows.iter().find(|&&r| r as usize >= self.info.rows) {
                    return Err(crate::QuantError::RowOutOfRange {
                        tensor: self.info.name.clone(),
                        row: row as usize,
                        rows: self.info.rows,
                    });
                }
                let selected = w.select_rows(rows).map_err(|e| {
                    crate::QuantError::Input(format!("{:?}: rows on the GPU: {e}", self.info.name))
                })?;
                return Ok(Self::from_device(selected, self.scale));
            }
        }
        Err(self.no_host_weight())
    }

    fn no_host_weight(&self) -> crate::QuantError {
        crate::QuantError::Input(format!(
            "integer matmul of {:?}: the weight was loaded onto a GPU only and has no host copy \
             (load the model for the CPU to run it there)",
            self.info.name
        ))
    }

    /// Applies the op to `x: [m, k]` (made contiguous first). On a CUDA device this runs
    /// [`crate::cuda::matmul_poisoned`] (or, with [`NonFiniteMode::Error`], [`crate::cuda::matmul`]),
    /// which returns the CPU reference's bits for every row of finite inputs; see the module docs for
    /// rows that are not.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let candle_core::Device::Cuda(dev) = x.device() {
            let weight = self.device_weight(dev)?;
            let x = x.contiguous()?;
            return match nonfinite_mode().map_err(candle_core::Error::wrap)? {
                NonFiniteMode::Poison => crate::cuda::matmul_poisoned(&x, &weight, &self.scale),
                NonFiniteMode::Error => crate::cuda::matmul(&x, &weight, &self.scale),
            };
        }
        x.contiguous()?.apply_op1_no_bwd(self)
    }

    /// The weight on `dev`: uploaded at load, or now from the host copy on first use.
    #[cfg(feature = "cuda")]
    fn device_weight(
        &self,
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<Arc<crate::cuda::CudaQuantWeight>> {
        let mut slot = self.device_weight.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = slot.as_ref() {
            return Ok(w.clone());
        }
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| candle_core::Error::wrap(self.no_host_weight()))?;
        let w = Arc::new(crate::cuda::CudaQuantWeight::upload(host, dev)?);
        *slot = Some(w.clone());
        Ok(w)
    }

    /// Whether a producer kernel on `dev` may quantize this product's input itself and hand it to
    /// [`QuantMatmul::forward_quantized`]: on CUDA with non-finite inputs poisoning their rows (the
    /// default). The eager-error mode needs the f32 input to name the offending value, so it keeps the
    /// unfused path.
    pub fn takes_quantized_input(&self, dev: &candle_core::Device) -> bool {
        dev.is_cuda() && matches!(nonfinite_mode(), Ok(NonFiniteMode::Poison))
    }

    /// Whether this product's input needs the per-32 sums (formats with mins: Q4_K, Q5_K).
    pub fn wants_sums(&self) -> bool {
        self.info.format.has_mins()
    }

    /// The product of activations a producer kernel already quantized at [`QuantMatmul::scale`] (the
    /// bytes of `crate::cuda::quantize_activations`): a row holding a non-finite input is NaN, every
    /// other row has the CPU reference's bits (see [`QuantMatmul::takes_quantized_input`]).
    #[cfg(feature = "cuda")]
    pub fn forward_quantized(
        &self,
        qx: &crate::cuda::DeviceQuantized,
        dev: &candle_core::CudaDevice,
    ) -> candle_core::Result<Tensor> {
        let weight = self.device_weight(dev)?;
        crate::cuda::matmul_quantized_poisoned(qx, &weight, &self.scale, dev)
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
        let w = match &self.host {
            Some(w) => w,
            None => return Err(candle_core::Error::wrap(self.no_host_weight())),
        };
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
            "integer matmul of {:?}: on CUDA it runs through QuantMatmul::forward, not as a candle op",
            self.info.name
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonfinite_mode_values() {
        for (value, want) in [
            (None, NonFiniteMode::Poison),
            (Some(""), NonFiniteMode::Poison),
            (Some(" Poison "), NonFiniteMode::Poison),
            (Some("error"), NonFiniteMode::Error),
            (Some("ERROR"), NonFiniteMode::Error),
        ] {
            assert_eq!(parse_nonfinite_mode(value).unwrap(), want, "{value:?}");
        }
        let msg = parse_nonfinite_mode(Some("panic")).unwrap_err().to_string();
        assert!(
            msg.contains(NONFINITE_ENV) && msg.contains("\"panic\""),
            "{msg}"
        );
    }
}
