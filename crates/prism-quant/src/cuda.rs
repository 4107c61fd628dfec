//! The integer matmul on CUDA (feature `cuda`): launchers for `kernels/quant_gemm.cu`, a first simple
//! version of the contract in [`crate`]'s docs (one warp per activation run, one thread per output).
//!
//! [`CudaQuantWeight::upload`] puts a [`QuantWeight`]'s arrays on the device; [`matmul`] quantizes an f32
//! activation per (row, run of 128) and runs the integer GEMM. Every output of a row with finite inputs
//! is meant to have the CPU reference's bits ([`crate::kernel::matmul`]); `prism cuda-check` compares them
//! on the device. **Not yet validated on a GPU**: the model does not run it (an integer precision on CUDA
//! still refuses to load, [`crate::CUDA_REBUILT`]) until that check has passed.
//!
//! A row whose input holds a NaN or ±∞ is not reported (that would need a synchronization): the
//! quantizer flags the row and every output of that row is NaN; the other rows keep their bits.

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Device, Result, Tensor};

use crate::activation::run_count;
use crate::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};
use crate::weight::{QuantWeight, WeightFormat, WeightInfo};

/// The kernels as a fatbin (kernels/build_ptx.rs).
const IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/quant_gemm.fatbin"));
const MODULE: &str = "prism_quant_gemm";
/// Threads per block of both kernels.
const THREADS: u32 = 128;

/// A [`QuantWeight`] on a CUDA device: its arrays as they are on the host (row-major), the bytes as
/// `U8` (read as int8 by the kernels), the scales as `F32`. An array the format does not have holds one
/// unused element.
#[derive(Debug, Clone)]
pub struct CudaQuantWeight {
    info: WeightInfo,
    q: Tensor,
    sub_scales: Tensor,
    sub_mins: Tensor,
    d: Tensor,
    dmin: Tensor,
}

impl CudaQuantWeight {
    /// Copies `w`'s arrays to `device`.
    pub fn upload(w: &QuantWeight, device: &CudaDevice) -> Result<Self> {
        let dev = Device::Cuda(device.clone());
        let bytes = |v: &[i8]| -> Result<Tensor> {
            let mut b: Vec<u8> = v.iter().map(|&x| x as u8).collect();
            if b.is_empty() {
                b.push(0);
            }
            let n = b.len();
            Tensor::from_vec(b, n, &dev)
        };
        let floats = |v: &[f32]| -> Result<Tensor> {
            let mut f = v.to_vec();
            if f.is_empty() {
                f.push(0.0);
            }
            let n = f.len();
            Tensor::from_vec(f, n, &dev)
        };
        let a = w.arrays();
        Ok(Self {
            info: w.info(),
            q: bytes(a.q)?,
            sub_scales: bytes(a.sub_scales)?,
            sub_mins: bytes(a.sub_mins)?,
            d: floats(a.d)?,
            dmin: floats(a.dmin)?,
        })
    }

    /// Name, format and shape.
    pub fn info(&self) -> &WeightInfo {
        &self.info
    }
}

/// `y = x · Wᵀ` for `x: [m, k]` f32 on `w`'s device: `[m, n]` f32, each output of a finite row with the
/// CPU reference's bits, each output of a row holding a NaN or ±∞ NaN.
pub fn matmul(x: &Tensor, w: &CudaQuantWeight) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let x = x.contiguous()?;
    let (m, k) = x.dims2()?;
    let (n, info) = (w.info.rows, &w.info);
    if k != info.cols {
        bail!(
            "integer matmul: x is [{m}, {k}] but {:?} takes {} inputs",
            info.name,
            info.cols
        );
    }
    let runs = run_count(k);
    let want_sums = info.format.has_mins();
    let qa = alloc::<u8>(&dev, m * k)?;
    let sa = alloc::<f32>(&dev, m * runs)?;
    let sums = alloc::<i32>(&dev, if want_sums { m * k / 32 } else { 1 })?;
    let bad = dev.alloc_zeros::<u32>(m.max(1))?;
    let y = alloc::<f32>(&dev, m * n)?;
    if m == 0 || n == 0 {
        return Ok(wrap(y, &dev, (m, n)));
    }
    let (m_i, n_i, k_i) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "outputs")?,
        i32_arg(k, "inputs")?,
    );
    let grid = |units: usize, what: &str| -> Result<u32> {
        u32::try_from(units.div_ceil(THREADS as usize))
            .map_err(|_| candle_core::Error::Msg(format!("{what}: too many for one launch")))
    };
    {
        let xi = Input::new(&x, DType::F32, "integer matmul input")?;
        let xv = xi.view::<f32>()?;
        let func = load_kernel(&dev, MODULE, IMAGE, "quantize_act_run128")?;
        let cfg = LaunchConfig {
            grid_dim: (grid(32 * m * runs, "activation runs")?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let want = i32::from(want_sums);
        let mut b = func.builder();
        b.arg(&xv).arg(&m_i).arg(&k_i).arg(&qa).arg(&sa).arg(&sums);
        b.arg(&want).arg(&bad);
        // SAFETY: x holds m·k f32; qa m·k bytes, sa m·runs f32, sums m·k/32 i32 when asked, bad m u32.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    let name = match info.format {
        WeightFormat::Q8_0 => "qgemm_run128_q8_0",
        WeightFormat::Q4K | WeightFormat::Q5K => "qgemm_run128_k32",
        WeightFormat::Q6K => "qgemm_run128_q6k",
    };
    if m > 65_535 {
        bail!("integer matmul: {m} rows are more than one launch takes (65,535)");
    }
    let (wq, wsc, wmn) = (
        Input::new(&w.q, DType::U8, "weight bytes")?,
        Input::new(&w.sub_scales, DType::U8, "sub-block scales")?,
        Input::new(&w.sub_mins, DType::U8, "sub-block mins")?,
    );
    let (wd, wdm) = (
        Input::new(&w.d, DType::F32, "scales")?,
        Input::new(&w.dmin, DType::F32, "min scales")?,
    );
    let (wq, wsc, wmn) = (wq.view::<u8>()?, wsc.view::<u8>()?, wmn.view::<u8>()?);
    let (wd, wdm) = (wd.view::<f32>()?, wdm.view::<f32>()?);
    let func = load_kernel(&dev, MODULE, IMAGE, name)?;
    let cfg = LaunchConfig {
        grid_dim: (grid(n, "outputs")?, m as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut b = func.builder();
    b.arg(&qa).arg(&sa).arg(&sums).arg(&bad);
    b.arg(&wq).arg(&wd).arg(&wdm).arg(&wsc).arg(&wmn);
    b.arg(&m_i).arg(&n_i).arg(&k_i).arg(&y);
    // SAFETY: the activation buffers as written above; the weight arrays as uploaded (row-major, the
    // layout of QuantWeight); y holds m·n f32.
    unsafe { b.launch(cfg) }.map_err(launch_err)?;
    Ok(wrap(y, &dev, (m, n)))
}
