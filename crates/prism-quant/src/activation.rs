//! Dynamic int8 quantization of activations: one scale per row and run of [`RUN`] columns, from that
//! run's own values.
//!
//! For run `r` of a row (columns `128·r .. min(128·r + 128, K)`): `amax = max |x_i|` over the run. If
//! `amax < AMAX_MIN` (2⁻¹²⁰) the run is all zeros with scale 0; otherwise
//!
//! ```text
//! sa  = amax / 127          (one IEEE f32 division)
//! inv = 127 / amax          (one IEEE f32 division)
//! q   = clamp(rint(x · inv), −127, 127)
//! ```
//!
//! with one IEEE f32 multiplication (nothing fused), `rint` rounding half to even and the clamp after
//! rounding. A CUDA kernel reproduces it with `__fdiv_rn`, `__fmul_rn`, `rintf`, `fminf/fmaxf`. The
//! threshold keeps `inv` finite (127 · 2¹²⁰ < f32::MAX), so no run ever multiplies by ∞. Inputs must be
//! finite: a NaN or ±∞ activation means the model diverged, and [`quantize_row`] reports it instead of
//! hiding it behind a clamp. Each row is quantized on its own, so padding or other rows cannot affect
//! it.

use rayon::prelude::*;

use crate::error::{QuantError, Result};

/// The largest quantized magnitude (symmetric range: −128 is never produced).
pub const QMAX: f32 = 127.0;

/// Columns per run: one activation scale (and one Q8_0 weight scale) per row and run.
pub const RUN: usize = 128;

/// Runs whose largest |x| is below this (2⁻¹²⁰) quantize to zeros with scale 0.
pub const AMAX_MIN: f32 = f32::from_bits((127 - 120) << 23);

/// Runs of a row of `cols` columns: `⌈cols / 128⌉`.
pub const fn run_count(cols: usize) -> usize {
    cols.div_ceil(RUN)
}

/// The scale `sa` and the multiplier `inv` of a run whose largest |x| is `amax` (finite, ≥ 0).
#[inline(always)]
pub fn run_scale(amax: f32) -> (f32, f32) {
    if amax < AMAX_MIN {
        (0.0, 0.0)
    } else {
        (amax / QMAX, QMAX / amax)
    }
}

/// One finite value: `clamp(rint(x · inv), −127, 127)`.
#[inline(always)]
pub fn quantize_value(x: f32, inv: f32) -> i8 {
    (x * inv).round_ties_even().clamp(-QMAX, QMAX) as i8
}

/// Quantizes one row: `q` gets its `cols` int8 values, `scales` its `⌈cols / 128⌉` run scales `sa`. On
/// a non-finite input returns its column (the outputs are then unspecified).
pub fn quantize_row(x: &[f32], q: &mut [i8], scales: &mut [f32]) -> Result<(), usize> {
    if let Some(col) = x.iter().position(|v| !v.is_finite()) {
        return Err(col);
    }
    for ((xr, qr), s) in x.chunks(RUN).zip(q.chunks_mut(RUN)).zip(scales.iter_mut()) {
        // The maximum of finite values is exact and independent of the order.
        let amax = xr.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (sa, inv) = run_scale(amax);
        *s = sa;
        for (qi, &v) in qr.iter_mut().zip(xr) {
            *qi = quantize_value(v, inv);
        }
    }
    Ok(())
}

/// `rows` rows of `cols` activations, quantized, with one scale per row and run, and the sums of each
/// run of `group` quantized values when the weight format needs them (the mins term of Q4_K/Q5_K).
// A field list: alike in shape only to other structs' plain fields.
#[derive(Debug, Clone)]
pub struct QuantizedRows {
    pub rows: usize,
    pub cols: usize,
    pub q: Vec<i8>,
    /// `rows · ⌈cols / 128⌉` run scales `sa`, row-major.
    pub scales: Vec<f32>,
    /// `rows · cols / group` sums (empty when not asked for).
    pub group_sums: Vec<i32>,
    pub group: usize,
}

impl QuantizedRows {
    pub fn row(&self, r: usize) -> &[i8] {
        &self.q[r * self.cols..(r + 1) * self.cols]
    }

    /// The run scales of row `r`.
    pub fn row_scales(&self, r: usize) -> &[f32] {
        let runs = run_count(self.cols);
        &self.scales[r * runs..(r + 1) * runs]
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

/// One task of [`quantize_rows`]: its rows' inputs, values and scales.
type RowsTask<'a> = ((&'a [f32], &'a mut [i8]), &'a mut [f32]);

/// Rows per rayon task of [`quantize_rows`].
const QUANT_TASK_ROWS: usize = 16;

/// Quantizes `x` (`rows × cols`, row-major), each row on its own. `group`: 0 for no sums, else the run
/// length to sum (`cols` must be a multiple of it). A non-finite input is
/// [`QuantError::NonFiniteActivation`] naming the first such row (and its first such column).
pub fn quantize_rows(x: &[f32], rows: usize, cols: usize, group: usize) -> Result<QuantizedRows> {
    if x.len() != rows * cols || (group != 0 && cols % group != 0) {
        return Err(QuantError::Input(format!(
            "{} activations for {rows} rows of {cols} (sum groups of {group})",
            x.len()
        )));
    }
    let runs = run_count(cols);
    let mut q = vec![0i8; rows * cols];
    let mut scales = vec![0f32; rows * runs];
    if cols > 0 {
        let task = |(t, ((xs, qs), ss)): (usize, RowsTask<'_>)| {
            for (i, ((xr, qr), sr)) in xs
                .chunks_exact(cols)
                .zip(qs.chunks_exact_mut(cols))
                .zip(ss.chunks_exact_mut(runs))
                .enumerate()
            {
                quantize_row(xr, qr, sr).map_err(|col| QuantError::NonFiniteActivation {
                    row: t * QUANT_TASK_ROWS + i,
                    col,
                    value: xr[col],
                })?;
            }
            Ok(())
        };
        let tasks: Vec<_> = x
            .chunks(QUANT_TASK_ROWS * cols)
            .zip(q.chunks_mut(QUANT_TASK_ROWS * cols))
            .zip(scales.chunks_mut(QUANT_TASK_ROWS * runs))
            .enumerate()
            .collect();
        // Rows are independent; the error reported is the first bad row's either way.
        let results: Vec<Result<()>> = if rows * cols >= 1 << 16 {
            tasks.into_par_iter().map(task).collect()
        } else {
            tasks.into_iter().map(task).collect()
        };
        results.into_iter().collect::<Result<()>>()?;
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
        scales,
        group_sums,
        group,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_half_to_even_and_clamped() {
        // A run whose largest |x| is 127 has inv = 1: the products are exact and show the rounding rule.
        let x = [
            0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.0, -127.0, 0.49999997, -126.5,
        ];
        let (mut q, mut s) = ([0i8; 11], [0f32; 1]);
        quantize_row(&x, &mut q, &mut s).unwrap();
        assert_eq!(q, [0, 2, 2, 0, -2, -2, 126, 127, -127, 0, -126]);
        assert_eq!(s, [1.0]);
    }

    #[test]
    fn each_run_has_its_own_scale() {
        // Two runs: the first with max 254 (inv 0.5), the second (shorter) with max 1.27.
        let mut x = vec![0f32; RUN + 3];
        x[5] = -254.0;
        x[6] = 3.0; // 1.5 → 2 (ties to even)
        x[7] = 1.0; // 0.5 → 0
        x[RUN] = 1.27;
        x[RUN + 1] = 0.005; // 0.5 → 0 (0.005 · 100.0 rounds to 0.5 in f32)
        x[RUN + 2] = -0.635; // −63.5 → −64
        let (mut q, mut s) = (vec![0i8; RUN + 3], [0f32; 2]);
        quantize_row(&x, &mut q, &mut s).unwrap();
        assert_eq!((q[5], q[6], q[7]), (-127, 2, 0));
        assert_eq!(s[0], 254.0f32 / 127.0);
        assert_eq!(s[1], 1.27f32 / 127.0);
        let inv = 127.0f32 / 1.27;
        assert_eq!(q[RUN], 127);
        assert_eq!(q[RUN + 1], quantize_value(0.005, inv));
        assert_eq!(q[RUN + 2], quantize_value(-0.635, inv));
        assert_eq!(q[RUN + 2], (-0.635f32 * inv).round_ties_even() as i8);
    }

    #[test]
    fn tiny_and_zero_runs_are_zero_with_scale_zero() {
        let below = AMAX_MIN / 2.0;
        assert_eq!(AMAX_MIN, 2f32.powi(-120));
        let x = [below, -below, 0.0, 0.0];
        let (mut q, mut s) = ([1i8; 4], [1f32; 1]);
        quantize_row(&x, &mut q, &mut s).unwrap();
        assert_eq!((q, s), ([0; 4], [0.0]));
        // At the threshold the multiplier is finite and the run keeps its values.
        let (sa, inv) = run_scale(AMAX_MIN);
        assert!(inv.is_finite() && sa > 0.0);
        quantize_row(&[AMAX_MIN, -AMAX_MIN / 2.0, 0.0, 0.0], &mut q, &mut s).unwrap();
        assert_eq!(q, [127, -64, 0, 0]);
    }

    #[test]
    fn non_finite_inputs_are_refused() {
        let (mut q, mut s) = ([0i8; 3], [0f32; 1]);
        assert_eq!(quantize_row(&[1.0, f32::NAN, 0.0], &mut q, &mut s), Err(1));
        assert_eq!(
            quantize_row(&[f32::INFINITY, 1.0, 0.0], &mut q, &mut s),
            Err(0)
        );
        let err = quantize_rows(&[0.0, 1.0, f32::NEG_INFINITY, 0.0], 2, 2, 0).unwrap_err();
        assert!(matches!(
            err,
            QuantError::NonFiniteActivation { row: 1, col: 0, .. }
        ));
        // Many rows (the parallel path): the first bad row is named.
        let mut x = vec![0.5f32; 300 * 256];
        x[257 * 256 + 9] = f32::NAN;
        x[290 * 256] = f32::INFINITY;
        let err = quantize_rows(&x, 300, 256, 32).unwrap_err();
        assert!(matches!(
            err,
            QuantError::NonFiniteActivation {
                row: 257,
                col: 9,
                ..
            }
        ));
    }

    #[test]
    fn group_sums_are_the_sums_of_the_quantized_values() {
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.0).collect();
        let r = quantize_rows(&x, 2, 4, 2).unwrap();
        // Row 0: max 3 → inv 127/3; row 1: max 4 → inv 127/4.
        let want: Vec<i8> = x[..4]
            .iter()
            .map(|&v| quantize_value(v, 127.0 / 3.0))
            .chain(x[4..].iter().map(|&v| quantize_value(v, 127.0 / 4.0)))
            .collect();
        assert_eq!(r.q, want);
        let sums: Vec<i32> = want
            .chunks(2)
            .map(|g| i32::from(g[0]) + i32::from(g[1]))
            .collect();
        assert_eq!(r.group_sums, sums);
        assert_eq!(r.row_sums(1), &sums[2..]);
        assert_eq!(r.row_scales(1), &[4.0f32 / 127.0]);
    }

    #[test]
    fn a_row_does_not_depend_on_the_other_rows() {
        let cols = 3 * RUN + 64;
        let row: Vec<f32> = (0..cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let alone = quantize_rows(&row, 1, cols, 32).unwrap();
        let mut x = Vec::new();
        for k in 0..40 {
            if k == 23 {
                x.extend_from_slice(&row);
            } else {
                x.extend((0..cols).map(|i| (i * k) as f32 * 1e3));
            }
        }
        let many = quantize_rows(&x, 40, cols, 32).unwrap();
        assert_eq!(many.row(23), alone.row(0));
        assert_eq!(many.row_scales(23), alone.row_scales(0));
        assert_eq!(many.row_sums(23), alone.row_sums(0));
    }
}
