//! FP8 storage of the attention K/V cache (`--kv-fp8`): every key and value row of one token and one KV
//! head is stored as `head_dim` e4m3 bytes plus one f32 scale.
//!
//! # The format
//! - **e4m3** is OCP FP8 E4M3 ("e4m3fn", torch's `float8_e4m3fn`, CUDA's `__NV_E4M3`): 1 sign bit, 4
//!   exponent bits (bias 7), 3 mantissa bits; no infinities; `0x7F`/`0xFF` are NaN; the largest finite
//!   value is ±448, the smallest subnormal 2⁻⁹.
//! - **Scale** of a row `x` (one token, one KV head, `head_dim` values): [`row_scale`]`(amax)`, with
//!   `amax = max |x_i|` (NaNs ignored); `amax / 448` rounded to nearest f32, or 1 where that is not a
//!   positive finite number (a row of zeros, an underflow, an infinite or all-NaN row). So a scale is
//!   never 0, infinite or NaN.
//! - **Encoding** of a value: [`encode_e4m3`]`(x / scale)`, the f32 quotient correctly rounded (IEEE
//!   division), then rounded to the nearest e4m3 value, ties to even mantissa; magnitudes above 448
//!   (rounding of the quotient can reach 448·(1 + 2⁻²³), infinities) saturate to ±448; NaN becomes
//!   `0x7F`. This is what `cvt.rn.satfinite.e4m3x2.f32` does on the GPU.
//! - **Decoding**: [`decode_e4m3`]`(byte) · scale`, one f32 multiplication (correctly rounded). Every
//!   e4m3 value is exact in f32 (and in f16, which the GPU decodes through).
//!
//! # Guarantees
//! - A row's bytes and scale are a function of that row's values alone: the stored cache does not depend
//!   on the batch, on the other heads or tokens, on how a prompt was split into calls, or on whether a
//!   prefix came from the prefix cache. Dequantized values are a function of (byte, scale) alone.
//! - The CPU functions here and the CUDA kernels (`kernels/kv_fp8.cu`, [`crate::cuda_kv_fp8`]) give the
//!   same bits for the same input (each step is an IEEE-exact max, a correctly rounded division or
//!   multiplication, and the e4m3 rounding above); `prism cuda-check` verifies it on the device.
//! - Error: a stored value differs from its input by at most half an e4m3 step at the row's scale: at
//!   most 2⁻⁴ of the value (3 mantissa bits) where `|x| / scale ≥ 2⁻⁶`, at most `2⁻¹⁰ · scale` below
//!   that, and never more than [`max_abs_error`]`(amax) = 16 · scale ≈ amax / 28`.

use candle_core::{DType, Device, Tensor};

use crate::error::{ModelError, Result};

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The NaN encoding written for a NaN input (`0x7F`; `0xFF` decodes to NaN too).
pub const E4M3_NAN: u8 = 0x7F;

/// How the attention layers store keys and values ([`crate::LoadOptions::kv_storage`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KvStorage {
    /// As computed: the activation dtype (f32 on the CPU), or bf16 on CUDA where the flash kernel serves
    /// the head dim (its operand dtype). The default.
    #[default]
    Native,
    /// e4m3 bytes with one f32 scale per token and KV head (this module's format): 1 + 4/head_dim bytes
    /// a value instead of 2 (bf16) or 4 (f32). On CUDA it needs compute capability 8.9 or newer.
    Fp8,
}

impl KvStorage {
    /// `native` or `fp8` (for logs and reports).
    pub fn as_str(self) -> &'static str {
        match self {
            KvStorage::Native => "native",
            KvStorage::Fp8 => "fp8",
        }
    }

    /// Whether the cache is e4m3 with per-row scales.
    pub fn is_fp8(self) -> bool {
        self == KvStorage::Fp8
    }
}

/// The scale of a row whose largest magnitude is `amax`: `amax / 448` (f32, correctly rounded) when
/// that is positive and finite, else 1 (a row of zeros, an underflowing `amax`, or a non-finite one).
pub fn row_scale(amax: f32) -> f32 {
    let s = amax / E4M3_MAX;
    if s > 0.0 && s.is_finite() {
        s
    } else {
        1.0
    }
}

/// `max |x_i|` of a row, ignoring NaNs (`f32::max` returns the non-NaN operand; 0 for an empty or
/// all-NaN row). Exact and independent of the order of the elements.
pub fn row_amax(row: &[f32]) -> f32 {
    row.iter().fold(0.0f32, |m, &x| m.max(x.abs()))
}

/// `x` rounded to the nearest e4m3 value (ties to even mantissa), saturated to ±448; NaN gives
/// [`E4M3_NAN`]. The sign of a zero is kept (`-0.0` → `0x80`).
pub fn encode_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign = ((x.to_bits() >> 24) & 0x80) as u8;
    let a = x.abs();
    if a > E4M3_MAX {
        return sign | 0x7E;
    }
    // Below 2⁻⁶ (the smallest normal): multiples of 2⁻⁹. a · 2⁹ is exact (a power-of-two scaling of
    // a value far from the f32 limits), so this is one rounding, ties to even; 8 rounds up into the
    // smallest normal, whose encoding is 0x08 = 8.
    if a < 1.0 / 64.0 {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: keep 3 of the f32's 23 mantissa bits, rounding the other 20 to nearest, ties to even. A
    // carry out of the mantissa moves to the next exponent; a ≤ 448 cannot round past 448.
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127; // -6..=8
    let mant = bits & 0x7F_FFFF;
    let (mut e, mut m) = (exp, mant >> 20);
    let rest = mant & 0xF_FFFF;
    const HALF: u32 = 0x8_0000;
    if rest > HALF || (rest == HALF && m & 1 == 1) {
        m += 1;
        if m == 8 {
            m = 0;
            e += 1;
        }
    }
    sign | (((e + 7) as u8) << 3) | m as u8
}

/// The value of an e4m3 byte (exact in f32); NaN for `0x7F` and `0xFF`.
pub fn decode_e4m3(b: u8) -> f32 {
    let e = i32::from((b >> 3) & 0xF);
    let m = i32::from(b & 7);
    let magnitude = if e == 0xF && m == 7 {
        f32::NAN
    } else if e == 0 {
        m as f32 / 512.0
    } else {
        // (8 + m) · 2^(e − 10): an integer below 16 times a power of two, exact.
        (8 + m) as f32 * f32::from_bits(((e - 10 + 127) as u32) << 23)
    };
    if b & 0x80 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Quantizes one row: writes its e4m3 bytes into `out` (same length) and returns its scale.
pub fn quantize_row(row: &[f32], out: &mut [u8]) -> f32 {
    let scale = row_scale(row_amax(row));
    for (o, &x) in out.iter_mut().zip(row) {
        *o = encode_e4m3(x / scale);
    }
    scale
}

/// Dequantizes one row: `out[i] = decode(bytes[i]) · scale`.
pub fn dequantize_row(bytes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(bytes) {
        *o = decode_e4m3(b) * scale;
    }
}

/// The largest |x − dequantize(quantize(x))| for any value `x` of a row whose largest magnitude is
/// `amax`: half the e4m3 step at the top binade, `amax · 2⁻⁴` (values near 448·scale are multiples of
/// 32·scale), a bound on the rounding of every element of the row.
pub fn max_abs_error(amax: f32) -> f32 {
    row_scale(amax) * 16.0
}

/// Quantizes a tensor of rows `[..., d]` (any float dtype; rows are converted to f32 first, exactly for
/// bf16 and f32): returns the e4m3 bytes (`U8`, the input's shape) and the scales (`F32`, the input's
/// shape without its last dim), on the input's device. On CUDA the kernel of [`crate::cuda_kv_fp8`]
/// runs (same bits); on the CPU [`quantize_row`] per row.
pub fn quantize(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let dims = x.dims().to_vec();
    let Some((&d, lead)) = dims.split_last() else {
        return Err(ModelError::InvalidInput(
            "fp8 KV: cannot quantize a scalar".into(),
        ));
    };
    if x.device().is_cuda() {
        return quantize_cuda(x);
    }
    let rows: usize = lead.iter().product();
    let values = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let mut bytes = vec![0u8; rows * d];
    let mut scales = vec![0f32; rows];
    if d > 0 {
        for ((row, out), s) in values
            .chunks_exact(d)
            .zip(bytes.chunks_exact_mut(d))
            .zip(scales.iter_mut())
        {
            *s = quantize_row(row, out);
        }
    } else {
        scales.iter_mut().for_each(|s| *s = 1.0);
    }
    let device = x.device();
    Ok((
        Tensor::from_vec(bytes, dims.as_slice(), device)?,
        Tensor::from_vec(scales, lead, device)?,
    ))
}

/// Dequantizes e4m3 bytes `[..., d]` (`U8`) with their scales `[...]` (`F32`) into `dtype` (f32, bf16
/// or f64 — each value is computed in f32, `decode(byte) · scale`, then converted). On CUDA the kernel
/// of [`crate::cuda_kv_fp8`] runs (same bits).
pub fn dequantize(bytes: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    let dims = bytes.dims();
    let Some((&d, lead)) = dims.split_last() else {
        return Err(ModelError::InvalidInput(
            "fp8 KV: cannot dequantize a scalar".into(),
        ));
    };
    if bytes.dtype() != DType::U8 || scales.dtype() != DType::F32 || scales.dims() != lead {
        return Err(ModelError::InvalidInput(format!(
            "fp8 KV: bytes {:?} {:?} and scales {:?} {:?} do not fit (expected u8 [..., d] and f32 [...])",
            bytes.dtype(),
            bytes.dims(),
            scales.dtype(),
            scales.dims()
        )));
    }
    if bytes.device().is_cuda() {
        return dequantize_cuda(bytes, scales, dtype);
    }
    let b = bytes.flatten_all()?.to_vec1::<u8>()?;
    let s = scales.flatten_all()?.to_vec1::<f32>()?;
    let mut out = vec![0f32; b.len()];
    if d > 0 {
        for ((row, o), &scale) in b.chunks_exact(d).zip(out.chunks_exact_mut(d)).zip(&s) {
            dequantize_row(row, scale, o);
        }
    }
    let t = Tensor::from_vec(out, dims, bytes.device())?;
    Ok(if dtype == DType::F32 {
        t
    } else {
        t.to_dtype(dtype)?
    })
}

#[cfg(feature = "cuda")]
fn quantize_cuda(x: &Tensor) -> Result<(Tensor, Tensor)> {
    Ok(crate::cuda_kv_fp8::quantize(x)?)
}

#[cfg(not(feature = "cuda"))]
fn quantize_cuda(_: &Tensor) -> Result<(Tensor, Tensor)> {
    Err(ModelError::InvalidInput(
        "fp8 KV: this build has no CUDA support".into(),
    ))
}

#[cfg(feature = "cuda")]
fn dequantize_cuda(bytes: &Tensor, scales: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(crate::cuda_kv_fp8::dequantize(bytes, scales, dtype)?)
}

#[cfg(not(feature = "cuda"))]
fn dequantize_cuda(_: &Tensor, _: &Tensor, _: DType) -> Result<Tensor> {
    Err(ModelError::InvalidInput(
        "fp8 KV: this build has no CUDA support".into(),
    ))
}

/// Checks that `device` can hold an fp8 KV cache: the CPU always can; a CUDA device needs compute
/// capability 8.9 or newer (Ada, Hopper and later: the generations with e4m3 conversions in hardware,
/// which the kernels use); other devices cannot. The error says which GPU and why.
pub fn check_device(device: &Device) -> Result<()> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(_) => check_cuda(device),
        other => Err(ModelError::Unsupported(format!(
            "--kv-fp8 runs on the CPU and on CUDA GPUs of compute capability 8.9 or newer, not on {other:?}"
        ))),
    }
}

#[cfg(feature = "cuda")]
fn check_cuda(device: &Device) -> Result<()> {
    let (major, minor) = crate::cuda_kv_fp8::compute_capability(device)?;
    if (major, minor) < (8, 9) {
        return Err(ModelError::Unsupported(format!(
            "--kv-fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper: e4m3 conversions in \
             hardware); this GPU is {major}.{minor}. Run without --kv-fp8 (bf16 keys and values)"
        )));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn check_cuda(_: &Device) -> Result<()> {
    Err(ModelError::Unsupported(
        "--kv-fp8 on CUDA: this build has no CUDA support".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_byte_round_trips() {
        for b in 0..=255u8 {
            let v = decode_e4m3(b);
            if b & 0x7F == 0x7F {
                assert!(v.is_nan(), "{b:#04x}");
                assert_eq!(encode_e4m3(v), E4M3_NAN);
            } else {
                assert_eq!(encode_e4m3(v), b, "{b:#04x} = {v}");
            }
        }
    }

    #[test]
    fn scales_are_never_zero_or_non_finite() {
        for amax in [0.0, f32::MIN_POSITIVE / 1e6, f32::INFINITY, f32::NAN] {
            assert_eq!(row_scale(amax), 1.0, "{amax}");
        }
        assert_eq!(row_scale(448.0), 1.0);
        assert_eq!(row_scale(896.0), 2.0);
        let mut out = [0u8; 3];
        assert_eq!(quantize_row(&[0.0, -0.0, 0.0], &mut out), 1.0);
        assert_eq!(out, [0x00, 0x80, 0x00]);
    }
}
