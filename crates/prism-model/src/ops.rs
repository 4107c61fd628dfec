//! Small element-wise and normalisation helpers built from candle ops.
//!
//! Everything here runs on whatever device the tensors live on; the formulas follow transformers'
//! Qwen3.5 code so that an f32 run reproduces its numbers to rounding.

use candle_core::{DType, Result, Tensor, D};

use crate::matmul::RowInvariantMatmul;

/// `x / sqrt(mean(x²) + eps) · weight` over the last axis.
///
/// GGUF files already store `1 + w` for Qwen3.5's zero-centred norms, so `weight` is used as is.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::rms_norm(x, weight, eps);
    }
    let mean_square = x.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_rms = (mean_square + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv_rms)?.broadcast_mul(weight)
}

/// The DeltaNet output norm: normalise, then multiply by the plain weight, then by `SiLU(gate)`.
pub fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::gated_rms_norm(x, gate, weight, eps);
    }
    rms_norm(x, weight, eps)?.mul(&gate.silu()?)
}

/// `x · rsqrt(Σx² + eps)` over the last axis (transformers' / FLA's l2norm, eps under the root).
pub fn l2_norm(x: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::l2_norm(x, eps);
    }
    let sum_square = x.sqr()?.sum_keepdim(D::Minus1)?;
    let inv_norm = (sum_square + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv_norm)
}

/// The logistic function `1 / (1 + e^{-x})`; saturates to exactly 0 and 1 instead of producing NaN.
pub fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// `ln(1 + eˣ)`, written as `max(x, 0) + ln(1 + e^{-|x|})` so that it never overflows. The absolute error
/// is at most one f32 ulp of 1, which is all the decay `g = a·softplus(·)` needs.
pub fn softplus(x: &Tensor) -> Result<Tensor> {
    let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    x.relu()?.add(&tail)
}

/// `x · Wᵀ` for a packed activation `x: [N, in]` and a weight `W: [out, in]` (PyTorch / GGUF row layout).
///
/// On the CPU every output is one dot product in a fixed order ([`crate::matmul`]), so a row's result
/// does not depend on the other rows in the call. bf16 weights: the activation is rounded to bf16 and
/// the product accumulates in f32 (exact widening, f32 output). On other devices this falls back to
/// candle's matmul, which is not batch-invariant.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        let x = match (x.dtype(), weight.dtype()) {
            (DType::F32, DType::BF16) => x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
            _ => x.contiguous()?,
        };
        return x.apply_op2_no_bwd(&weight.contiguous()?, &RowInvariantMatmul);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 && weight.dtype() == DType::BF16 && x.rank() == 2 {
        return crate::cuda::linear_bf16(x, weight);
    }
    let wt = weight.t()?;
    if x.dtype() == weight.dtype() {
        x.matmul(&wt)
    } else {
        // Reduced-precision weights: run the product in the weight's dtype, hand back the activation dtype.
        x.to_dtype(weight.dtype())?.matmul(&wt)?.to_dtype(x.dtype())
    }
}

/// The MLP's SwiGLU on the fused gate | up projection: `gate_up: [n, 2·f]` holds `gate` in columns
/// `0..f` and `up` in `f..2f`; returns `silu(gate) · up`, `[n, f]`. The one place a fused device
/// kernel would go; the CPU arithmetic is candle's `silu` then `mul`, element by element.
pub fn swiglu(gate_up: &Tensor, f: usize) -> Result<Tensor> {
    let width = gate_up.dim(D::Minus1)?;
    if width != 2 * f {
        candle_core::bail!("swiglu: gate | up has {width} columns, not 2 × {f}");
    }
    gate_up
        .narrow(D::Minus1, 0, f)?
        .silu()?
        .mul(&gate_up.narrow(D::Minus1, f, f)?)
}

/// Softmax over the last axis (f32 or f64, like its input), subtracting the row maximum first (as torch does).
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    let exp = x.broadcast_sub(&max)?.exp()?;
    let sum = exp.sum_keepdim(D::Minus1)?;
    exp.broadcast_div(&sum)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn values(t: &Tensor) -> Vec<f32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn softplus_matches_the_definition_and_does_not_overflow() {
        let xs = [-100.0f32, -20.0, -3.0, -0.5, 0.0, 0.7, 5.0, 30.0, 100.0];
        let t = Tensor::new(&xs[..], &Device::Cpu).unwrap();
        let got = values(&softplus(&t).unwrap());
        for (x, y) in xs.iter().zip(got) {
            let want = (*x as f64).exp().ln_1p();
            let want = if *x > 30.0 { *x as f64 } else { want };
            assert!(
                (y as f64 - want).abs() < 2e-7 * want.max(1.0),
                "softplus({x}) = {y}, want {want}"
            );
        }
    }

    #[test]
    fn sigmoid_saturates() {
        let t = Tensor::new(&[-200.0f32, 0.0, 200.0], &Device::Cpu).unwrap();
        assert_eq!(values(&sigmoid(&t).unwrap()), vec![0.0, 0.5, 1.0]);
    }

    #[test]
    fn swiglu_of_the_fused_halves_is_silu_gate_times_up() {
        let (n, f) = (3, 5);
        let vals = |seed: f32| -> Vec<f32> {
            (0..n * f)
                .map(|i| ((i as f32 + seed) * 0.77).sin() * 6.0)
                .collect()
        };
        let gate = Tensor::from_vec(vals(0.0), (n, f), &Device::Cpu).unwrap();
        let up = Tensor::from_vec(vals(9.0), (n, f), &Device::Cpu).unwrap();
        let gate_up = Tensor::cat(&[&gate, &up], 1).unwrap();
        let want = gate.silu().unwrap().mul(&up).unwrap();
        let got = swiglu(&gate_up, f).unwrap();
        let to_bits = |t: &Tensor| values(t).iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(got.dims(), &[n, f]);
        assert_eq!(to_bits(&got), to_bits(&want));
        assert!(swiglu(&gate_up, f + 1).is_err());
    }

    #[test]
    fn rms_norm_and_l2_norm_follow_their_formulas() {
        let x = Tensor::new(&[[3.0f32, 4.0], [0.0, 0.0]], &Device::Cpu).unwrap();
        let w = Tensor::new(&[2.0f32, 1.0], &Device::Cpu).unwrap();
        let y = values(&rms_norm(&x, &w, 0.0).unwrap());
        let rms = (12.5f32).sqrt();
        assert!((y[0] - 6.0 / rms).abs() < 1e-6 && (y[1] - 4.0 / rms).abs() < 1e-6);
        let l2 = values(&l2_norm(&x, 1e-6).unwrap());
        assert!((l2[0] - 0.6).abs() < 1e-6 && (l2[1] - 0.8).abs() < 1e-6);
        assert_eq!(&l2[2..], &[0.0, 0.0]);
    }
}
