//! Small helpers for launching our CUDA kernels on candle tensors, shared by prism-quant's integer GEMM
//! and prism-model's decoder kernels: contiguous views of a tensor's `CudaSlice` held under its storage
//! guard, uninitialized output buffers wrapped back into tensors, and launch-error conversion.

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor};

/// A kernel-launch (driver or cuBLAS) error as a candle error.
pub fn launch_err<E: std::error::Error + Send + Sync + 'static>(e: E) -> candle_core::Error {
    candle_core::Error::Cuda(Box::new(e))
}

/// `x` as a kernel's `int` argument, or an error naming `what`.
pub fn i32_arg(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x)
        .map_err(|_| candle_core::Error::Msg(format!("{what} = {x} does not fit in i32")))
}

/// The CUDA device `t` lives on.
pub fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("expected a CUDA tensor, found one on {other:?}"),
    }
}

/// A read guard on a tensor's CUDA storage plus the element range of its (contiguous) layout.
pub struct Input<'a> {
    guard: candle_core::StorageRef<'a>,
    start: usize,
    end: usize,
    name: &'static str,
}

impl<'a> Input<'a> {
    pub fn new(t: &'a Tensor, dtype: DType, name: &'static str) -> Result<Self> {
        if t.dtype() != dtype {
            bail!("{name}: expected {dtype:?}, found {:?}", t.dtype());
        }
        let (guard, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("{name} must be contiguous");
        };
        Ok(Self {
            guard,
            start,
            end,
            name,
        })
    }

    pub fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
        match &*self.guard {
            Storage::Cuda(cs) => Ok(cs.as_cuda_slice::<T>()?.slice(self.start..self.end)),
            _ => bail!("{} is not on a CUDA device", self.name),
        }
    }
}

/// An uninitialized device buffer of `len` elements (at least one) for a kernel to fill.
pub fn alloc<T: DeviceRepr>(dev: &CudaDevice, len: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the callers' kernels write every element before anything reads it.
    unsafe { dev.alloc::<T>(len.max(1)) }
}

/// A filled device buffer as a contiguous tensor of `shape`.
pub fn wrap<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(slice, dev.clone());
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

