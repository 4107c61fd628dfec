//! The exact integer matmul on the CPU: the reference every other implementation must equal bit for bit.
//!
//! For activation row `a` (quantized, see [`crate::activation`]) and weight row `n`, each block `b` of
//! the reduction gives exact integers
//!
//! ```text
//! D_b = Σ_j sc_j · Σ_{i∈j} q_i · qa_i        (Q8_0: sc = 1, one sub-block)
//! M_b = Σ_j m_j  · Σ_{i∈j} qa_i              (Q4_K, Q5_K only)
//! ```
//!
//! then the blocks are combined in f32 in a fixed order that depends only on the number of blocks
//! ([`part_bounds`]) — see the crate docs for the full specification.

use rayon::prelude::*;

use crate::activation::{quantize_rows, ActivationScale, QuantizedRows};
use crate::error::{QuantError, Result};
use crate::weight::{QuantWeight, WeightFormat};

/// The reduction over blocks is split into this many contiguous parts (so tensor parallelism over 1, 2
/// or 4 devices, each owning whole parts, computes exactly the single-device result).
pub const PARTS: usize = 4;

/// Block boundaries of the parts: part `p` is blocks `bounds[p]..bounds[p + 1]` with
/// `bounds[p] = ⌊p · n_blocks / 4⌋`. Parts may be empty (fewer than 4 blocks).
pub fn part_bounds(n_blocks: usize) -> [usize; PARTS + 1] {
    std::array::from_fn(|p| p * n_blocks / PARTS)
}

/// The fixed combination of the part sums: `(p0 + p1) + (p2 + p3)`.
#[inline(always)]
pub fn combine_parts(p: [f32; PARTS]) -> f32 {
    (p[0] + p[1]) + (p[2] + p[3])
}

/// `Σ w_i · a_i` over exactly `N` elements, in i32 (exact for the formats' ranges).
#[inline(always)]
fn isum<const N: usize>(w: &[i8], a: &[i8]) -> i32 {
    let (w, a) = (&w[..N], &a[..N]);
    let mut s = 0i32;
    for i in 0..N {
        s += i32::from(w[i]) * i32::from(a[i]);
    }
    s
}

/// The integer sums `(D_b, M_b)` of block `b` of weight row `n` against one quantized activation row
/// `qa` (`sums`: its sums per 32 elements, needed by Q4_K/Q5_K only). `M_b` is 0 for formats without
/// mins.
pub fn block_sums(w: &QuantWeight, n: usize, b: usize, qa: &[i8], sums: &[i32]) -> (i32, i32) {
    let (q, sc, m) = (w.row_q(n), w.row_sub_scales(n), w.row_sub_mins(n));
    match w.format() {
        WeightFormat::Q8_0 => block_q8_0(q, qa, b),
        WeightFormat::Q4K | WeightFormat::Q5K => block_k32(q, sc, m, qa, sums, b),
        WeightFormat::Q6K => block_q6_k(q, sc, qa, b),
    }
}

#[inline(always)]
fn block_q8_0(q: &[i8], qa: &[i8], b: usize) -> (i32, i32) {
    (isum::<32>(&q[32 * b..], &qa[32 * b..]), 0)
}

#[inline(always)]
fn block_k32(q: &[i8], sc: &[i8], m: &[i8], qa: &[i8], sums: &[i32], b: usize) -> (i32, i32) {
    // Fixed-length views of the block, so the loops below have no bounds checks.
    let (q, qa) = (&q[256 * b..256 * b + 256], &qa[256 * b..256 * b + 256]);
    let (sc, m, sums) = (
        &sc[8 * b..8 * b + 8],
        &m[8 * b..8 * b + 8],
        &sums[8 * b..8 * b + 8],
    );
    let (mut d, mut mn) = (0i32, 0i32);
    for j in 0..8 {
        d += i32::from(sc[j]) * isum::<32>(&q[32 * j..], &qa[32 * j..]);
        mn += i32::from(m[j]) * sums[j];
    }
    (d, mn)
}

#[inline(always)]
fn block_q6_k(q: &[i8], sc: &[i8], qa: &[i8], b: usize) -> (i32, i32) {
    let (q, qa, sc) = (
        &q[256 * b..256 * b + 256],
        &qa[256 * b..256 * b + 256],
        &sc[16 * b..16 * b + 16],
    );
    let mut d = 0i32;
    for j in 0..16 {
        d += i32::from(sc[j]) * isum::<16>(&q[16 * j..], &qa[16 * j..]);
    }
    (d, 0)
}

/// One output before the activation scale: the parts of the block reduction, each accumulated from
/// +0.0 in increasing block order with `acc = fma(d_b, f32(D_b), acc)` then (mins formats)
/// `acc = fma(−dmin_b, f32(M_b), acc)`, combined by [`combine_parts`].
#[inline(always)]
fn reduce_blocks<F: Fn(usize) -> (i32, i32)>(d: &[f32], dmin: &[f32], mins: bool, sums: F) -> f32 {
    let bounds = part_bounds(d.len());
    let mut parts = [0f32; PARTS];
    for (p, part) in parts.iter_mut().enumerate() {
        let mut acc = 0f32;
        for b in bounds[p]..bounds[p + 1] {
            let (db, mb) = sums(b);
            // i32 → f32 rounds to nearest even when |D_b| > 2^24 (possible only for K-quants).
            acc = d[b].mul_add(db as f32, acc);
            if mins {
                acc = (-dmin[b]).mul_add(mb as f32, acc);
            }
        }
        *part = acc;
    }
    combine_parts(parts)
}

/// The unscaled output for weight row `n` and quantized activation row `qa` (with its 32-element sums
/// for Q4_K/Q5_K). Multiply by the activation scale to get `y`.
#[inline(always)]
pub fn row_dot(w: &QuantWeight, n: usize, qa: &[i8], sums: &[i32]) -> f32 {
    let (q, sc, m) = (w.row_q(n), w.row_sub_scales(n), w.row_sub_mins(n));
    let (d, dmin) = (w.row_d(n), w.row_dmin(n));
    match w.format() {
        WeightFormat::Q8_0 => reduce_blocks(d, dmin, false, |b| block_q8_0(q, qa, b)),
        WeightFormat::Q4K | WeightFormat::Q5K => {
            reduce_blocks(d, dmin, true, |b| block_k32(q, sc, m, qa, sums, b))
        }
        WeightFormat::Q6K => reduce_blocks(d, dmin, false, |b| block_q6_k(q, sc, qa, b)),
    }
}

/// The sum-group length the format needs from the activations (0: none).
fn sum_group(format: WeightFormat) -> usize {
    if format.has_mins() {
        format.sub_len()
    } else {
        0
    }
}

/// Quantizes `x` (`m × w.cols()`, row-major f32) with `scale` for `w`.
pub fn quantize_for(
    x: &[f32],
    m: usize,
    w: &QuantWeight,
    scale: &ActivationScale,
) -> Result<QuantizedRows> {
    if x.len() != m * w.cols() {
        return Err(QuantError::InputWidth {
            tensor: w.name().to_string(),
            expected: w.cols(),
            found: x.len().checked_div(m).unwrap_or(0),
        });
    }
    quantize_rows(x, m, w.cols(), scale, sum_group(w.format()))
}

/// Outputs per task, and activation rows per tile inside a task.
const STRIP: usize = 32;
const ROW_TILE: usize = 16;

/// `y = x · Wᵀ` on the integer path: `x` is `m × w.cols()` f32 (row-major), the result `m × w.rows()`.
/// Every output is [`row_dot`] of its own activation row and weight row times `scale.scale()`, so the
/// result of a row does not depend on `m`, the other rows, the tiling or the threads.
pub fn matmul(x: &[f32], m: usize, w: &QuantWeight, scale: &ActivationScale) -> Result<Vec<f32>> {
    let qx = quantize_for(x, m, w, scale)?;
    Ok(matmul_quantized(&qx, w, scale))
}

/// [`matmul`] from already quantized activations (which must have `w.cols()` columns and, for
/// Q4_K/Q5_K weights, their 32-element sums).
pub fn matmul_quantized(qx: &QuantizedRows, w: &QuantWeight, scale: &ActivationScale) -> Vec<f32> {
    matmul_quantized_with(qx, w, scale, has_avx2_fma())
}

/// [`matmul_quantized`] with the AVX2 build of the loops (`simd`, only where the CPU has AVX2 and FMA)
/// or the portable one; tests check that both give the same bits.
pub fn matmul_quantized_with(
    qx: &QuantizedRows,
    w: &QuantWeight,
    scale: &ActivationScale,
    simd: bool,
) -> Vec<f32> {
    let simd = simd && has_avx2_fma();
    let (m, n) = (qx.rows, w.rows());
    let s = scale.scale();
    let mut out = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return out;
    }
    let strip = |n0: usize| -> Vec<f32> {
        let n1 = (n0 + STRIP).min(n);
        let mut buf = vec![0f32; m * (n1 - n0)];
        if simd {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                strip_avx2(qx, w, s, (n0, n1), &mut buf)
            };
        } else {
            strip_portable(qx, w, s, (n0, n1), &mut buf);
        }
        buf
    };
    let starts: Vec<usize> = (0..n).step_by(STRIP).collect();
    let work = m * n * w.cols();
    let bufs: Vec<Vec<f32>> = if work >= 1 << 18 && rayon::current_num_threads() > 1 {
        starts.par_iter().map(|&n0| strip(n0)).collect()
    } else {
        starts.iter().map(|&n0| strip(n0)).collect()
    };
    for (&n0, buf) in starts.iter().zip(&bufs) {
        let width = (n0 + STRIP).min(n) - n0;
        for r in 0..m {
            out[r * n + n0..r * n + n0 + width].copy_from_slice(&buf[r * width..(r + 1) * width]);
        }
    }
    out
}

/// Outputs `n0..n1` of every activation row into `buf` (`m × (n1 − n0)`, row-major).
#[inline(always)]
fn strip_portable(
    qx: &QuantizedRows,
    w: &QuantWeight,
    s: f32,
    (n0, n1): (usize, usize),
    buf: &mut [f32],
) {
    let (m, width) = (qx.rows, n1 - n0);
    for r0 in (0..m).step_by(ROW_TILE) {
        let r1 = (r0 + ROW_TILE).min(m);
        for nn in n0..n1 {
            for r in r0..r1 {
                buf[r * width + nn - n0] = row_dot(w, nn, qx.row(r), qx.row_sums(r)) * s;
            }
        }
    }
}

/// [`strip_portable`] compiled for AVX2 + FMA: the integer sums vectorize, `mul_add` is one
/// instruction. Integer sums are exact and `mul_add` is a fused multiply-add either way, so the bits
/// are those of the portable code.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn strip_avx2(
    qx: &QuantizedRows,
    w: &QuantWeight,
    s: f32,
    range: (usize, usize),
    buf: &mut [f32],
) {
    strip_portable(qx, w, s, range, buf)
}

/// Whether this CPU runs the AVX2 + FMA build of the loops.
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}
