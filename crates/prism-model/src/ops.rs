//! Small element-wise and normalisation helpers built from candle ops.
//!
//! Everything here runs on whatever device the tensors live on; the formulas follow transformers'
//! Qwen3.5 code so that an f32 run reproduces its numbers to rounding. On CUDA (f32 activations) the
//! norms, SwiGLU and the gates run as fused kernels ([`crate::cuda`]) that read column ranges of the
//! fused projections in place and, through the `_as` / `out` variants, write bf16 for a bf16 GEMM; the
//! candle formulation here is their CPU twin, unchanged.

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

/// [`rms_norm`] with its result in `out`: on CUDA an f32 norm writes bf16 itself (rounded to nearest
/// even, like the cast) when the next consumer is a bf16 GEMM; elsewhere the result is cast.
pub fn rms_norm_as(x: &Tensor, weight: &Tensor, eps: f64, out: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::rms_norm_as(x, weight, eps, out);
    }
    to_dtype(rms_norm(x, weight, eps)?, out)
}

/// The residual add and the norm after it: returns `(x + residual, rms_norm(x + residual))`, the norm
/// in `out` (see [`rms_norm_as`]). On CUDA one kernel reads both inputs once; the sum is the same f32
/// addition as a separate add, and the norm the same as [`rms_norm`] of it, bit for bit.
pub fn add_rms_norm(
    x: &Tensor,
    residual: &Tensor,
    weight: &Tensor,
    eps: f64,
    out: DType,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 && residual.dtype() == DType::F32 {
        return crate::cuda::add_rms_norm(x, residual, weight, eps, out);
    }
    let sum = (x + residual)?;
    let normed = to_dtype(rms_norm(&sum, weight, eps)?, out)?;
    Ok((sum, normed))
}

fn to_dtype(t: Tensor, dtype: DType) -> Result<Tensor> {
    if t.dtype() == dtype {
        Ok(t)
    } else {
        t.to_dtype(dtype)
    }
}

/// The DeltaNet output norm: normalise, then multiply by the plain weight, then by `SiLU(gate)`.
pub fn gated_rms_norm(x: &Tensor, gate: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::gated_rms_norm(x, gate, weight, eps);
    }
    rms_norm(x, weight, eps)?.mul(&gate.silu()?)
}

/// [`gated_rms_norm`] of `x: [n, h, d]` with the gate given as rows `[n, h·d]` (e.g. a column range of
/// a fused projection, read in place on CUDA); returns `[n, h·d]` in `out` (see [`rms_norm_as`]).
pub fn gated_rms_norm_rows(
    x: &Tensor,
    gate: &Tensor,
    weight: &Tensor,
    eps: f64,
    out: DType,
) -> Result<Tensor> {
    let (n, h, d) = x.dims3()?;
    if gate.dims() != [n, h * d] {
        candle_core::bail!(
            "gated norm: gate {:?} does not fit x {:?}",
            gate.dims(),
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::gated_rms_norm_rows(x, gate, weight, eps, out);
    }
    let y = gated_rms_norm(x, &gate.reshape((n, h, d))?, weight, eps)?.reshape((n, h * d))?;
    to_dtype(y, out)
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

/// [`l2_norm`] of `x`, then times `scale` (candle's `x * scale`: f32 multiply, then + 0). On CUDA one
/// kernel with the same operations.
pub fn l2_norm_scaled(x: &Tensor, eps: f64, scale: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return crate::cuda::l2_norm_scaled(x, eps, scale);
    }
    l2_norm(x, eps)? * scale
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

/// The DeltaNet gates from the projections' `b, a: [n, h]` (column ranges of the fused projection):
/// `β = σ(b)` and `g = softplus(a + dt_bias) · ssm_a`, both `[n, h]`. On CUDA one kernel (the same
/// operations in the same order as [`sigmoid`] and [`softplus`]) reads `b` and `a` in place.
pub fn delta_net_gates(
    b: &Tensor,
    a: &Tensor,
    dt_bias: &Tensor,
    ssm_a: &Tensor,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if b.device().is_cuda() && b.dtype() == DType::F32 {
        return crate::cuda::delta_net_gates(b, a, dt_bias, ssm_a);
    }
    let beta = sigmoid(b)?;
    let g = softplus(&a.broadcast_add(dt_bias)?)?.broadcast_mul(ssm_a)?;
    Ok((beta, g))
}

/// The attention output gate `attn · σ(gate)`: `attn: [n, h·d]`, `gate: [n, h, d]` (e.g. the gate
/// halves of the `[query | gate]` projection, read in place on CUDA); returns `[n, h·d]` in `out`
/// (see [`rms_norm_as`]).
pub fn sigmoid_gate(attn: &Tensor, gate: &Tensor, out: DType) -> Result<Tensor> {
    let (n, h, d) = gate.dims3()?;
    if attn.dims() != [n, h * d] {
        candle_core::bail!(
            "attention gate {:?} does not fit the output {:?}",
            gate.dims(),
            attn.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if attn.device().is_cuda() && attn.dtype() == DType::F32 && gate.dtype() == DType::F32 {
        return crate::cuda::sigmoid_gate(attn, gate, out);
    }
    let gate = gate.contiguous()?.reshape((n, h * d))?;
    to_dtype(attn.mul(&sigmoid(&gate)?)?, out)
}

/// `x · Wᵀ` for a packed activation `x: [N, in]` and a weight `W: [out, in]` (PyTorch / GGUF row layout).
///
/// On the CPU every output is one dot product in a fixed order ([`crate::matmul`]), so a row's result
/// does not depend on the other rows in the call. bf16 weights: the activation is rounded to bf16 (or
/// comes in bf16, see [`crate::linear::Linear::input_dtype`]) and the product accumulates in f32
/// (exact widening, f32 output). On other devices this falls back to
/// candle's matmul, which is not batch-invariant.
pub fn linear(x: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if x.device().is_cpu() {
        let x = match (x.dtype(), weight.dtype()) {
            (DType::F32, DType::BF16) => x.to_dtype(DType::BF16)?.to_dtype(DType::F32)?,
            // An activation already in bf16: the same operand as a rounded f32 one.
            (DType::BF16, DType::BF16) => x.to_dtype(DType::F32)?,
            _ => x.contiguous()?,
        };
        return x.apply_op2_no_bwd(&weight.contiguous()?, &RowInvariantMatmul);
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda()
        && matches!(x.dtype(), DType::F32 | DType::BF16)
        && weight.dtype() == DType::BF16
        && x.rank() == 2
    {
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
/// `0..f` and `up` in `f..2f`; returns `silu(gate) · up`, `[n, f]`: candle's `silu` then `mul`, element
/// by element (on CUDA, [`swiglu_as`] fuses them).
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

/// [`swiglu`] with its result in `out` (see [`rms_norm_as`]). On CUDA one kernel reads `gate_up: [n, 2f]`
/// in place (any row stride) and computes `silu(gate) · up` with candle's two roundings.
pub fn swiglu_as(gate_up: &Tensor, f: usize, out: DType) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if gate_up.device().is_cuda() && gate_up.dtype() == DType::F32 && gate_up.rank() == 2 {
        return crate::cuda::swiglu(gate_up, f, out);
    }
    to_dtype(swiglu(gate_up, f)?, out)
}

/// Where a kernel finds the rows of a strided tensor read in place as rows of `d` contiguous elements:
/// row `r` starts `(r / inner)·outer + (r % inner)·inner_stride` elements after the layout's start offset.
/// A contiguous tensor is `inner = 1, outer = d`; a column range of a fused projection output `[n, w]`
/// has `outer` = the full row width; a head-strided view `[n, h, d]` (the query half of attention's
/// `[query | gate]` heads) has `inner = h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowMap {
    pub rows: usize,
    pub inner: usize,
    pub inner_stride: usize,
    pub outer: usize,
    /// Elements from the first row's start to one past the last row's end (0 when there are no rows).
    pub span: usize,
}

/// The [`RowMap`] of a layout (`dims`, `strides`) read as rows of `d` elements: the last dimension
/// must be a multiple of `d` with unit stride, and the dimensions before it must fold into at most two
/// strided levels. `None` otherwise (the caller makes the tensor contiguous first).
pub fn row_map(dims: &[usize], strides: &[usize], d: usize) -> Option<RowMap> {
    let (&last, lead) = dims.split_last()?;
    // The rows' elements must be adjacent.
    if d == 0
        || last % d != 0
        || strides.len() != dims.len()
        || (last > 1 && strides[dims.len() - 1] != 1)
    {
        return None;
    }
    // Leading levels (size, stride), outermost first, size-1 levels dropped; a last dimension holding
    // several rows adds the level (last / d, d).
    let mut levels: Vec<(usize, usize)> =
        lead.iter().copied().zip(strides.iter().copied()).collect();
    if last > d {
        levels.push((last / d, d));
    }
    let rows: usize = levels.iter().map(|l| l.0).product();
    levels.retain(|l| l.0 != 1);
    // Fold a level into the one before it when they step through memory as one.
    let mut folded: Vec<(usize, usize)> = Vec::with_capacity(levels.len());
    for (n, st) in levels {
        match folded.last_mut() {
            Some(prev) if prev.1 == n.checked_mul(st)? => *prev = (prev.0.checked_mul(n)?, st),
            _ => folded.push((n, st)),
        }
    }
    let span = if rows == 0 {
        0
    } else {
        folded
            .iter()
            .try_fold(d, |acc, &(n, st)| acc.checked_add((n - 1).checked_mul(st)?))?
    };
    let (inner, inner_stride, outer) = match folded.as_slice() {
        [] => (1, 0, d),
        [(_, st)] => (1, 0, *st),
        [(_, outer), (n, st)] => (*n, *st, *outer),
        _ => return None,
    };
    Some(RowMap {
        rows,
        inner,
        inner_stride,
        outer,
        span,
    })
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

    /// Every element of `t` read through `row_map` of its layout equals the element in row order.
    fn check_row_map(t: &Tensor, d: usize) {
        let map = row_map(t.dims(), t.stride(), d).expect("a row map");
        let (storage, layout) = t.storage_and_layout();
        let all = match &*storage {
            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => v.clone(),
            _ => panic!("f32 CPU tensor expected"),
        };
        let start = layout.start_offset();
        let want = values(t);
        assert_eq!(map.rows * d, want.len());
        let mut max_end = 0;
        for r in 0..map.rows {
            let at = start + (r / map.inner) * map.outer + (r % map.inner) * map.inner_stride;
            max_end = max_end.max(at + d);
            assert_eq!(
                &all[at..at + d],
                &want[r * d..(r + 1) * d],
                "row {r} of {:?}",
                t.dims()
            );
        }
        assert_eq!(max_end, start + map.span, "span of {:?}", t.dims());
    }

    #[test]
    fn row_maps_address_the_rows_of_strided_views() {
        let n = 7 * 3 * 2 * 10;
        let base = Tensor::from_vec(
            (0..n).map(|i| i as f32).collect::<Vec<_>>(),
            (7, 60),
            &Device::Cpu,
        )
        .unwrap();
        // Contiguous, a column range (a fused part), a head-strided half, a single row.
        check_row_map(&base, 60);
        check_row_map(&base, 20);
        check_row_map(&base.narrow(1, 5, 20).unwrap(), 20);
        check_row_map(&base.narrow(1, 20, 40).unwrap(), 10);
        let heads = base.reshape((7, 3, 20)).unwrap();
        check_row_map(&heads.narrow(2, 0, 10).unwrap(), 10);
        check_row_map(&heads.narrow(2, 10, 10).unwrap(), 10);
        check_row_map(
            &heads.narrow(0, 2, 1).unwrap().narrow(2, 10, 10).unwrap(),
            10,
        );
        check_row_map(&base.narrow(0, 6, 1).unwrap().narrow(1, 3, 5).unwrap(), 5);
        // Levels that step through memory as one fold: [7, 2, 2, 5] at strides [60, 20, 10, 1] is
        // rows of 10 apart in 7 groups of 4.
        let cube = base
            .reshape((7, 3, 2, 10))
            .unwrap()
            .narrow(3, 0, 5)
            .unwrap()
            .narrow(1, 0, 2)
            .unwrap();
        check_row_map(&cube, 5);
        // Three strided levels do not fold into two; a transposed row is not unit-stride. (Built like
        // the cube above: each case spells out its view.)
        let cube = base
            .reshape((7, 3, 4, 5))
            .unwrap()
            .narrow(1, 0, 2)
            .unwrap()
            .narrow(2, 0, 2)
            .unwrap();
        assert_eq!(row_map(cube.dims(), cube.stride(), 5), None);
        let t = base.t().unwrap();
        assert_eq!(row_map(t.dims(), t.stride(), 7), None);
        assert_eq!(
            row_map(&[4, 6], &[6, 1], 4),
            None,
            "6 is not a multiple of 4"
        );
        assert_eq!(
            row_map(&[0, 6], &[6, 1], 6).map(|m| (m.rows, m.span)),
            Some((0, 0))
        );
    }

    #[test]
    fn fused_variants_equal_their_parts_on_the_cpu() {
        let dev = Device::Cpu;
        let t = |n: usize, seed: f32| -> Vec<f32> {
            (0..n)
                .map(|i| ((i as f32 + seed) * 0.37).sin() * 3.0)
                .collect()
        };
        let x = Tensor::from_vec(t(40, 0.0), (5, 8), &dev).unwrap();
        let r = Tensor::from_vec(t(40, 3.0), (5, 8), &dev).unwrap();
        let w = Tensor::from_vec(t(8, 7.0), 8, &dev).unwrap();
        let bits = |t: &Tensor| {
            values(&t.to_dtype(DType::F32).unwrap())
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        let (sum, normed) = add_rms_norm(&x, &r, &w, 1e-6, DType::F32).unwrap();
        let want_sum = (&x + &r).unwrap();
        assert_eq!(bits(&sum), bits(&want_sum));
        assert_eq!(bits(&normed), bits(&rms_norm(&want_sum, &w, 1e-6).unwrap()));
        let (_, normed16) = add_rms_norm(&x, &r, &w, 1e-6, DType::BF16).unwrap();
        assert_eq!(normed16.dtype(), DType::BF16);
        assert_eq!(
            bits(&normed16),
            bits(&normed.to_dtype(DType::BF16).unwrap())
        );

        // Gates: β = σ(b), g = softplus(a + bias)·ssm_a, from column ranges of one projection.
        let proj = Tensor::from_vec(t(5 * 6, 1.0), (5, 6), &dev).unwrap();
        let (b, a) = (proj.narrow(1, 0, 3).unwrap(), proj.narrow(1, 3, 3).unwrap());
        let bias = Tensor::from_vec(t(3, 2.0), 3, &dev).unwrap();
        let ssm_a = Tensor::from_vec(vec![-0.5f32, -1.0, -2.0], 3, &dev).unwrap();
        let (beta, g) = delta_net_gates(&b, &a, &bias, &ssm_a).unwrap();
        assert_eq!(bits(&beta), bits(&sigmoid(&b).unwrap()));
        let want_g = softplus(&a.broadcast_add(&bias).unwrap())
            .unwrap()
            .broadcast_mul(&ssm_a)
            .unwrap();
        assert_eq!(bits(&g), bits(&want_g));

        // Attention gate from the gate halves of [query | gate] heads.
        let qg = Tensor::from_vec(t(5 * 2 * 8, 4.0), (5, 2, 8), &dev).unwrap();
        let gate = qg.narrow(2, 4, 4).unwrap();
        let attn = Tensor::from_vec(t(5 * 8, 5.0), (5, 8), &dev).unwrap();
        let got = sigmoid_gate(&attn, &gate, DType::F32).unwrap();
        let want = attn
            .mul(&sigmoid(&gate.contiguous().unwrap().reshape((5, 8)).unwrap()).unwrap())
            .unwrap();
        assert_eq!(bits(&got), bits(&want));
        assert!(sigmoid_gate(&attn, &qg, DType::F32).is_err());

        // Gated norm with the gate as rows of a wider projection.
        let o = Tensor::from_vec(t(5 * 2 * 4, 6.0), (5, 2, 4), &dev).unwrap();
        let wide = Tensor::from_vec(t(5 * 11, 9.0), (5, 11), &dev).unwrap();
        let z = wide.narrow(1, 2, 8).unwrap();
        let got =
            gated_rms_norm_rows(&o, &z, &w.narrow(0, 0, 4).unwrap(), 1e-6, DType::F32).unwrap();
        let want = gated_rms_norm(
            &o,
            &z.reshape((5, 2, 4)).unwrap(),
            &w.narrow(0, 0, 4).unwrap(),
            1e-6,
        )
        .unwrap();
        assert_eq!(got.dims(), &[5, 8]);
        assert_eq!(bits(&got), bits(&want.reshape((5, 8)).unwrap()));

        // SwiGLU in bf16 is the f32 result rounded.
        let gu = Tensor::from_vec(t(5 * 8, 8.0), (5, 8), &dev).unwrap();
        let f32_out = swiglu(&gu, 4).unwrap();
        assert_eq!(
            bits(&swiglu_as(&gu, 4, DType::BF16).unwrap()),
            bits(&f32_out.to_dtype(DType::BF16).unwrap())
        );
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
