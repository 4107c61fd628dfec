//! Static int8 quantization of activations.
//!
//! One scale per linear input, fixed at calibration: `scale = absmax / 127` and `inv_scale = 127 /
//! absmax`, both f32 computed once on the host (IEEE division, round to nearest even) and handed to any
//! kernel as exact f32 bits. An element is quantized as
//!
//! ```text
//! q = clamp(rint(x · inv_scale), −127, 127)
//! ```
//!
//! with one IEEE f32 multiplication (no FMA, nothing fused), `rint` rounding half to even, and the clamp
//! after rounding. A CUDA kernel reproduces it with `__fmul_rn` + `rintf` + `fminf/fmaxf`. Inputs must be
//! finite: a NaN or ±∞ activation means the model diverged, and [`quantize_row`] reports it instead of
//! hiding it behind a clamp. Each row is quantized on its own, so padding or zero rows cannot affect
//! other rows.

use crate::error::{QuantError, Result};

/// The largest quantized magnitude (symmetric range: −128 is never produced).
pub const QMAX: f32 = 127.0;

/// The static int8 scale of one linear input.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationScale {
    absmax: f32,
    scale: f32,
    inv_scale: f32,
}

impl ActivationScale {
    /// From the largest |x| seen at calibration. It must be finite and large enough that `127 / absmax`
    /// is finite.
    pub fn from_absmax(absmax: f32) -> Result<Self> {
        let scale = absmax / QMAX;
        let inv_scale = QMAX / absmax;
        if !(absmax.is_finite() && absmax > 0.0 && inv_scale.is_finite() && scale > 0.0) {
            return Err(QuantError::BadActivationRange { absmax });
        }
        Ok(Self {
            absmax,
            scale,
            inv_scale,
        })
    }

    pub fn absmax(&self) -> f32 {
        self.absmax
    }

    /// `absmax / 127`: what one quantization step is worth; multiplies the matmul's result.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// `127 / absmax`: multiplies each input before rounding.
    pub fn inv_scale(&self) -> f32 {
        self.inv_scale
    }
}

/// One finite value: `clamp(rint(x · inv_scale), −127, 127)`.
#[inline(always)]
pub fn quantize_value(x: f32, inv_scale: f32) -> i8 {
    (x * inv_scale).round_ties_even().clamp(-QMAX, QMAX) as i8
}

/// Quantizes one row into `out` (same length). On a non-finite input returns its column.
pub fn quantize_row(x: &[f32], scale: &ActivationScale, out: &mut [i8]) -> Result<(), usize> {
    let inv = scale.inv_scale;
    let mut all_finite = true;
    for (q, &v) in out.iter_mut().zip(x) {
        all_finite &= v.is_finite();
        *q = quantize_value(v, inv);
    }
    if all_finite {
        Ok(())
    } else {
        Err(x.iter().position(|v| !v.is_finite()).unwrap_or(0))
    }
}

/// `rows` rows of `cols` activations, quantized, with the sums of each run of `group` quantized
/// values when the weight format needs them (the mins term of Q4_K/Q5_K).
#[derive(Debug, Clone)]
pub struct QuantizedRows {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    /// `rows · cols / group` sums (empty when not asked for).
    pub group_sums: Vec<i32>,
    pub group: usize,
}

impl QuantizedRows {
    pub fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }

    pub fn row_sums(&self, r: usize) -> &[i32] {
        if self.group == 0 {
            return &[];
        }
        let per_row = self.cols / self.group;
        self.group_sums
            .get(r * per_row..(r + 1) * per_row)
            .unwrap_or(&[])
    }
}

/// Quantizes `x` (`rows × cols`, row-major). `group`: 0 for no sums, else the run length to sum
/// (`cols` must be a multiple of it).
pub fn quantize_rows(
    x: &[f32],
    rows: usize,
    cols: usize,
    scale: &ActivationScale,
    group: usize,
) -> Result<QuantizedRows> {
    if x.len() != rows * cols || (group != 0 && cols % group != 0) {
        return Err(QuantError::Input(format!(
            "{} activations for {rows} rows of {cols} (sum groups of {group})",
            x.len()
        )));
    }
    let mut q = vec![0i8; rows * cols];
    for (r, (xr, qr)) in x
        .chunks_exact(cols.max(1))
        .zip(q.chunks_exact_mut(cols.max(1)))
        .enumerate()
    {
        quantize_row(xr, scale, qr).map_err(|col| QuantError::NonFiniteActivation {
            row: r,
            col,
            value: xr[col],
        })?;
    }
    let group_sums = if group == 0 {
        Vec::new()
    } else {
        q.chunks_exact(group)
            .map(|g| g.iter().map(|&v| i32::from(v)).sum())
            .collect()
    };
    Ok(QuantizedRows {
        rows,
        cols,
        q,
        group_sums,
        group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even_and_clamped() {
        // absmax 127 → inv_scale 1: the products are exact and show the rounding rule.
        let s = ActivationScale::from_absmax(127.0).unwrap();
        assert_eq!((s.scale(), s.inv_scale()), (1.0, 1.0));
        let x = [
            0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.4, 200.0, -1e30, 0.49999997,
        ];
        let mut q = [0i8; 11];
        quantize_row(&x, &s, &mut q).unwrap();
        assert_eq!(q, [0, 2, 2, 0, -2, -2, 126, 127, 127, -127, 0]);
    }

    #[test]
    fn non_finite_inputs_and_ranges_are_refused() {
        let s = ActivationScale::from_absmax(2.0).unwrap();
        let mut q = [0i8; 3];
        assert_eq!(quantize_row(&[1.0, f32::NAN, 0.0], &s, &mut q), Err(1));
        assert_eq!(quantize_row(&[f32::INFINITY, 1.0, 0.0], &s, &mut q), Err(0));
        let err = quantize_rows(&[0.0, 1.0, f32::NEG_INFINITY, 0.0], 2, 2, &s, 0).unwrap_err();
        assert!(matches!(
            err,
            QuantError::NonFiniteActivation { row: 1, col: 0, .. }
        ));
        for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY, 1e-38] {
            assert!(
                ActivationScale::from_absmax(bad).is_err(),
                "absmax {bad} accepted"
            );
        }
    }

    #[test]
    fn group_sums_are_the_sums_of_the_quantized_values() {
        let s = ActivationScale::from_absmax(127.0).unwrap();
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.0).collect();
        let r = quantize_rows(&x, 2, 4, &s, 2).unwrap();
        assert_eq!(r.group_sums, vec![-5, -1, 3, 7]);
        assert_eq!(r.row_sums(1), &[3, 7]);
    }
}
