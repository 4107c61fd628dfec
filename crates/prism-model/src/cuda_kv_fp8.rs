//! The CUDA twins of [`crate::kv_fp8::quantize`] and [`crate::kv_fp8::dequantize`]
//! (`kernels/kv_fp8.cu`): the same bytes, scales and dequantized values, bit for bit (checked by
//! `prism cuda-check`), and the device check behind `--kv-fp8` ([`compute_capability`]).

use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};
use candle_core::{bail, DType, Device, Result, Tensor};
use prism_quant::cuda_launch::PushArg;
use prism_quant::cuda_launch::{alloc, cuda_device, i32_arg, launch_err, load_kernel, wrap, Input};

const KV_FP8_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/kv_fp8.fatbin"));

/// Rows (warps) per block of the quantize kernel.
const QUANTIZE_ROWS_PER_BLOCK: u32 = 8;
/// Threads per block of the dequantize kernel.
const DEQUANTIZE_THREADS: u32 = 256;

/// The compute capability `(major, minor)` of a CUDA device.
pub fn compute_capability(device: &Device) -> Result<(i32, i32)> {
    let Device::Cuda(dev) = device else {
        bail!("compute capability: {device:?} is not a CUDA device");
    };
    dev.cuda_stream()
        .context()
        .compute_capability()
        .map_err(launch_err)
}

/// Quantizes rows `[..., d]` (f32 or bf16; other float dtypes are converted to f32 first) on the GPU:
/// returns the e4m3 bytes (`U8`, same shape) and one f32 scale per row (the shape without its last
/// dim) — [`crate::kv_fp8::quantize`]'s bits.
pub fn quantize(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let dev = cuda_device(x)?;
    let dims = x.dims().to_vec();
    let Some((&d, lead)) = dims.split_last() else {
        bail!("fp8 KV (cuda): cannot quantize a scalar");
    };
    let rows: usize = lead.iter().product();
    let x = match x.dtype() {
        DType::F32 | DType::BF16 => x.contiguous()?,
        _ => x.to_dtype(DType::F32)?,
    };
    let q = alloc::<u8>(&dev, rows * d)?;
    let scales = alloc::<f32>(&dev, rows)?;
    if rows > 0 {
        let (rows_i, d_i) = (i32_arg(rows, "rows")?, i32_arg(d, "row length")?);
        let blocks = u32::try_from(rows.div_ceil(QUANTIZE_ROWS_PER_BLOCK as usize))
            .map_err(|_| candle_core::Error::Msg(format!("fp8 KV: {rows} rows are too many")))?;
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (32 * QUANTIZE_ROWS_PER_BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let kernel = if x.dtype() == DType::BF16 {
            "kv_fp8_quantize_bf16"
        } else {
            "kv_fp8_quantize_f32"
        };
        let func = load_kernel(&dev, "prism_kv_fp8", KV_FP8_IMAGE, kernel)?;
        let input = Input::new(&x, x.dtype(), "fp8 KV input")?;
        let mut b = func.builder();
        let (vf, vb);
        if x.dtype() == DType::BF16 {
            vb = input.view::<half::bf16>()?;
            b.arg(&vb);
        } else {
            vf = input.view::<f32>()?;
            b.arg(&vf);
        }
        b.arg(&q).arg(&scales).arg(&rows_i).arg(&d_i);
        // SAFETY: x holds rows·d elements of the kernel's input type; q rows·d bytes, scales rows
        // floats; one warp per row, warps past `rows` return at once.
        unsafe { b.launch(cfg) }.map_err(launch_err)?;
    }
    Ok((wrap(q, &dev, dims.as_slice()), wrap(scales, &dev, lead)))
}

/// Dequantizes e4m3 bytes `[..., d]` with their scales `[...]` on the GPU into f32 or bf16 (f64: the
/// f32 values, converted) — [`crate::kv_fp8::dequantize`]'s bits.
pub fn dequantize(bytes: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    let dev = cuda_device(bytes)?;
    let dims = bytes.dims().to_vec();
    let Some((&d, lead)) = dims.split_last() else {
        bail!("fp8 KV (cuda): cannot dequantize a scalar");
    };
    if bytes.dtype() != DType::U8 || scales.dtype() != DType::F32 || scales.dims() != lead {
        bail!(
            "fp8 KV (cuda): bytes {:?} {:?} and scales {:?} {:?} do not fit",
            bytes.dtype(),
            bytes.dims(),
            scales.dtype(),
            scales.dims()
        );
    }
    let (bytes, scales) = (bytes.contiguous()?, scales.contiguous()?);
    if dtype == DType::BF16 {
        let y = alloc::<half::bf16>(&dev, bytes.elem_count())?;
        dequantize_launch(&bytes, &scales, &y, d, true)?;
        return Ok(wrap(y, &dev, dims.as_slice()));
    }
    let y = alloc::<f32>(&dev, bytes.elem_count())?;
    dequantize_launch(&bytes, &scales, &y, d, false)?;
    let t = wrap(y, &dev, dims.as_slice());
    if dtype == DType::F32 {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// One launch of `kv_fp8_dequantize` writing `y` (bf16 when `bf16`, else f32).
fn dequantize_launch<T: DeviceRepr>(
    bytes: &Tensor,
    scales: &Tensor,
    y: &CudaSlice<T>,
    d: usize,
    bf16: bool,
) -> Result<()> {
    let dev = cuda_device(bytes)?;
    let n = bytes.elem_count();
    if n == 0 || d == 0 {
        return Ok(());
    }
    let blocks = u32::try_from(n.div_ceil(DEQUANTIZE_THREADS as usize)).map_err(|_| {
        candle_core::Error::Msg(format!("fp8 KV: {n} values are too many for one launch"))
    })?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (DEQUANTIZE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let func = load_kernel(&dev, "prism_kv_fp8", KV_FP8_IMAGE, "kv_fp8_dequantize")?;
    let (ib, is) = (
        Input::new(bytes, DType::U8, "fp8 KV bytes")?,
        Input::new(scales, DType::F32, "fp8 KV scales")?,
    );
    let (vb, vs) = (ib.view::<u8>()?, is.view::<f32>()?);
    let (bf16_i, n_i, d_i) = (i32::from(bf16), n as i64, i32_arg(d, "row length")?);
    let mut b = func.builder();
    b.arg(&vb).arg(&vs).arg(y).arg(&bf16_i).arg(&n_i).arg(&d_i);
    // SAFETY: bytes hold n values, scales n / d, y n elements of the type `bf16` says.
    unsafe { b.launch(cfg) }.map_err(launch_err)?;
    Ok(())
}
