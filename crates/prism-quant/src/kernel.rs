//! The exact integer matmul on the CPU: the reference every other implementation must equal bit for bit.
//!
//! For activation row `a` (quantized per run of 128, see [`crate::activation`]) and weight row `n`,
//! each run `r` of the reduction gives exact integers
//!
//! ```text
//! I_r = Σ_j sc_j · Σ_{i∈j} q_i · qa_i        (Q8_0: sc = 1, the run is one sub-block)
//! M_r = Σ_j m_j  · Σ_{i∈j} qa_i              (Q4_K, Q5_K only)
//! ```
//!
//! promoted once per run, `acc = fma(f32(I_r), sa_r · sw_r, acc)` (then the mins term), the runs
//! combined in f32 in a fixed order that depends only on the number of runs ([`part_bounds`]) — see
//! the crate docs for the full specification.

use std::ops::Range;

use rayon::prelude::*;

use crate::activation::{quantize_rows, run_count, QuantizedRows, RUN};
use crate::error::{QuantError, Result};
use crate::weight::{QuantWeight, WeightFormat};

/// The reduction over runs is split into this many contiguous parts (so tensor parallelism over 1, 2
/// or 4 devices, each owning whole parts, computes exactly the single-device result).
pub const PARTS: usize = 4;

/// Run boundaries of the parts: part `p` is runs `bounds[p]..bounds[p + 1]` with
/// `bounds[p] = ⌊p · n_runs / 4⌋`. Parts may be empty (fewer than 4 runs).
pub fn part_bounds(n_runs: usize) -> [usize; PARTS + 1] {
    std::array::from_fn(|p| p * n_runs / PARTS)
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

/// `Σ w_i · a_i` over the shorter of the two slices (a Q8_0 row's short last run).
#[inline(always)]
fn isum_short(w: &[i8], a: &[i8]) -> i32 {
    w.iter()
        .zip(a)
        .map(|(&x, &y)| i32::from(x) * i32::from(y))
        .sum()
}

/// The integer sums `(I_r, M_r)` of run `r` of weight row `n` against one quantized activation row
/// `qa` (`sums`: its sums per 32 elements, needed by Q4_K/Q5_K only). `M_r` is 0 for formats without
/// mins.
pub fn run_sums(w: &QuantWeight, n: usize, r: usize, qa: &[i8], sums: &[i32]) -> (i32, i32) {
    let (q, sc, m) = (w.row_q(n), w.row_sub_scales(n), w.row_sub_mins(n));
    match w.format() {
        WeightFormat::Q8_0 => run_q8_0(q, qa, r),
        WeightFormat::Q4K | WeightFormat::Q5K => run_k32(q, sc, m, qa, sums, r),
        WeightFormat::Q6K => run_q6_k(q, sc, qa, r),
    }
}

#[inline(always)]
fn run_q8_0(q: &[i8], qa: &[i8], r: usize) -> (i32, i32) {
    let start = RUN * r;
    if start + RUN <= q.len() {
        (isum::<RUN>(&q[start..], &qa[start..]), 0)
    } else {
        (isum_short(&q[start..], &qa[start..]), 0)
    }
}

/// Q4_K / Q5_K: run `r` is sub-blocks `4r .. 4r + 4` of 32 (half of block `r / 2`).
#[inline(always)]
fn run_k32(q: &[i8], sc: &[i8], m: &[i8], qa: &[i8], sums: &[i32], r: usize) -> (i32, i32) {
    // Fixed-length views of the run, so the loops below have no bounds checks.
    let (q, qa) = (&q[RUN * r..RUN * r + RUN], &qa[RUN * r..RUN * r + RUN]);
    let (sc, m, sums) = (
        &sc[4 * r..4 * r + 4],
        &m[4 * r..4 * r + 4],
        &sums[4 * r..4 * r + 4],
    );
    let (mut d, mut mn) = (0i32, 0i32);
    for j in 0..4 {
        d += i32::from(sc[j]) * isum::<32>(&q[32 * j..], &qa[32 * j..]);
        mn += i32::from(m[j]) * sums[j];
    }
    (d, mn)
}

/// Q6_K: run `r` is sub-blocks `8r .. 8r + 8` of 16 (half of block `r / 2`).
#[inline(always)]
fn run_q6_k(q: &[i8], sc: &[i8], qa: &[i8], r: usize) -> (i32, i32) {
    let (q, qa, sc) = (
        &q[RUN * r..RUN * r + RUN],
        &qa[RUN * r..RUN * r + RUN],
        &sc[8 * r..8 * r + 8],
    );
    let mut d = 0i32;
    for j in 0..8 {
        d += i32::from(sc[j]) * isum::<16>(&q[16 * j..], &qa[16 * j..]);
    }
    (d, 0)
}

/// One part of an output: from +0.0 over `runs` in increasing order, `acc = fma(f32(I_r), sa_r · w_r,
/// acc)` then (mins formats) `acc = fma(f32(M_r), sa_r · (−wmin_r), acc)`, where `w_r`, `wmin_r` are
/// the run's weight factors.
#[inline(always)]
fn accumulate_runs<F, W>(sa: &[f32], runs: Range<usize>, mins: bool, factors: W, sums: F) -> f32
where
    F: Fn(usize) -> (i32, i32),
    W: Fn(usize) -> (f32, f32),
{
    let mut acc = 0f32;
    for r in runs {
        let (i, mn) = sums(r);
        let (wr, wmin) = factors(r);
        // i32 → f32 rounds to nearest even when |I_r| > 2^24 (Q5_K, Q6_K only).
        acc = (i as f32).mul_add(sa[r] * wr, acc);
        if mins {
            acc = (mn as f32).mul_add(sa[r] * -wmin, acc);
        }
    }
    acc
}

/// The part of the output of weight row `n` and quantized activation row `qa` (run scales `sa`,
/// 32-element sums for Q4_K/Q5_K) over the runs `runs` (a range of `0..⌈cols/128⌉`): what one device
/// of a tensor-parallel split computes for the runs it holds.
#[inline(always)]
pub fn row_part(
    w: &QuantWeight,
    n: usize,
    qa: &[i8],
    sa: &[f32],
    sums: &[i32],
    runs: Range<usize>,
) -> f32 {
    let (q, sc, m) = (w.row_q(n), w.row_sub_scales(n), w.row_sub_mins(n));
    let (d, dmin) = (w.row_d(n), w.row_dmin(n));
    match w.format() {
        WeightFormat::Q8_0 => {
            accumulate_runs(sa, runs, false, |r| (d[r], 0.0), |r| run_q8_0(q, qa, r))
        }
        WeightFormat::Q4K | WeightFormat::Q5K => accumulate_runs(
            sa,
            runs,
            true,
            |r| (d[r / 2], dmin[r / 2]),
            |r| run_k32(q, sc, m, qa, sums, r),
        ),
        WeightFormat::Q6K => accumulate_runs(
            sa,
            runs,
            false,
            |r| (d[r / 2], 0.0),
            |r| run_q6_k(q, sc, qa, r),
        ),
    }
}

/// The output for weight row `n` and quantized activation row `qa` with its run scales `sa` (and its
/// 32-element sums for Q4_K/Q5_K): the four [`row_part`]s of [`part_bounds`], combined by
/// [`combine_parts`].
#[inline(always)]
pub fn row_dot(w: &QuantWeight, n: usize, qa: &[i8], sa: &[f32], sums: &[i32]) -> f32 {
    let bounds = part_bounds(sa.len());
    combine_parts(std::array::from_fn(|p| {
        row_part(w, n, qa, sa, sums, bounds[p]..bounds[p + 1])
    }))
}

/// The sum-group length the format needs from the activations (0: none).
fn sum_group(format: WeightFormat) -> usize {
    if format.has_mins() {
        format.sub_len()
    } else {
        0
    }
}

/// Quantizes `x` (`m × w.cols()`, row-major f32) for `w`: per row and run, with the 32-element sums
/// when the format has mins.
pub fn quantize_for(x: &[f32], m: usize, w: &QuantWeight) -> Result<QuantizedRows> {
    if x.len() != m * w.cols() {
        return Err(QuantError::InputWidth {
            tensor: w.name().to_string(),
            expected: w.cols(),
            found: x.len().checked_div(m).unwrap_or(0),
        });
    }
    quantize_rows(x, m, w.cols(), sum_group(w.format()))
}

/// The parts of a product's reduction that one device of a tensor-parallel split holds: parts
/// `parts` of the [`part_bounds`] of a reduction of `total_runs` runs, its weight and activations the
/// columns of exactly those runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartSpan {
    /// Runs of the whole reduction (over every device).
    pub total_runs: usize,
    /// The parts held: one, two (`0..2` or `2..4`) or all four.
    pub parts: Range<usize>,
}

impl PartSpan {
    /// The span of device `device` of `devices` (1, 2 or 4): parts `device·4/devices ..
    /// (device+1)·4/devices`.
    pub fn of_device(total_runs: usize, device: usize, devices: usize) -> Result<Self> {
        if !matches!(devices, 1 | 2 | 4) || device >= devices {
            return Err(QuantError::Input(format!(
                "a tensor-parallel split is over 1, 2 or 4 devices (device {device} of {devices})"
            )));
        }
        Ok(Self {
            total_runs,
            parts: device * PARTS / devices..(device + 1) * PARTS / devices,
        })
    }

    /// The global runs the span holds.
    pub fn runs(&self) -> Range<usize> {
        let b = part_bounds(self.total_runs);
        b[self.parts.start]..b[self.parts.end]
    }

    /// The span's runs as the four parts of a kernel that always adds four parts by
    /// [`combine_parts`] (the GPU's): the span's own parts' bounds, counted from its first run, then
    /// empty parts up to four. An empty part sums to +0.0, and `x + 0.0` is `x` for every part sum
    /// (none is -0.0: a sum starts at +0.0, and round-to-nearest gives -0.0 only for -0.0 + -0.0), so
    /// `(p0 + p1) + (p2 + p3)` over these parts is [`matmul_share`]'s combination, bit for bit.
    pub fn local_bounds(&self) -> [usize; PARTS + 1] {
        let (b, held) = (part_bounds(self.total_runs), self.runs());
        std::array::from_fn(|i| {
            if i < self.parts.len() {
                b[self.parts.start + i] - held.start
            } else {
                held.len()
            }
        })
    }

    /// Whether the span is one of [`Self::of_device`]'s: one part, an aligned pair or all four.
    pub(crate) fn is_subtree(&self) -> bool {
        let (a, z) = (self.parts.start, self.parts.end);
        z <= PARTS && (z == a + 1 || (z == a + 2 && a % 2 == 0) || (a, z) == (0, PARTS))
    }
}

/// The share of a tensor-parallel product that the device holding `span` computes: for each output,
/// its parts' sums ([`row_part`], each over its own runs from +0.0) combined as the single-device tree
/// combines them below their common node — one part as it is, two as `p_a + p_b`, four by
/// [`combine_parts`]. Adding the devices' shares up that tree (`s0 + s1`, or `(s0 + s1) + (s2 + s3)`)
/// gives the single-device product's bits. `x: [m, w.cols()]` holds the span's columns and `w` the
/// span's columns of the whole weight (e.g. [`QuantWeight::select_cols`]).
pub fn matmul_share(x: &[f32], m: usize, w: &QuantWeight, span: &PartSpan) -> Result<Vec<f32>> {
    let runs = span.runs();
    if !span.is_subtree() || run_count(w.cols()) != runs.len() {
        return Err(QuantError::Input(format!(
            "{:?}: parts {:?} of a reduction of {} runs are runs {runs:?}, but the weight holds {} runs",
            w.name(),
            span.parts,
            span.total_runs,
            run_count(w.cols())
        )));
    }
    let qx = quantize_for(x, m, w)?;
    let b = part_bounds(span.total_runs);
    let local = |p: usize| b[p] - runs.start..b[p + 1] - runs.start;
    let n = w.rows();
    let cell = |i: usize| {
        let (r, o) = (i / n, i % n);
        let part = |p: usize| row_part(w, o, qx.row(r), qx.row_scales(r), qx.row_sums(r), local(p));
        let p0 = span.parts.start;
        match span.parts.len() {
            1 => part(p0),
            2 => part(p0) + part(p0 + 1),
            _ => combine_parts(std::array::from_fn(part)),
        }
    };
    Ok((0..m * n).into_par_iter().map(cell).collect())
}

/// Outputs per task, and activation rows per tile inside a task.
const STRIP: usize = 32;
const ROW_TILE: usize = 16;

/// `y = x · Wᵀ` on the integer path: `x` is `m × w.cols()` f32 (row-major), the result `m × w.rows()`.
/// Every output is [`row_dot`] of its own activation row (its values and run scales) and weight row,
/// so the result of a row does not depend on `m`, the other rows, the tiling or the threads.
pub fn matmul(x: &[f32], m: usize, w: &QuantWeight) -> Result<Vec<f32>> {
    let qx = quantize_for(x, m, w)?;
    matmul_quantized(&qx, w)
}

/// [`matmul`] from already quantized activations (which must have `w.cols()` columns and, for
/// Q4_K/Q5_K weights, their 32-element sums: [`QuantError::InputWidth`] / [`QuantError::Input`]).
pub fn matmul_quantized(qx: &QuantizedRows, w: &QuantWeight) -> Result<Vec<f32>> {
    matmul_quantized_with(qx, w, has_avx2_fma())
}

/// [`matmul_quantized`] with the AVX2 build of the loops (`simd`, only where the CPU has AVX2 and FMA)
/// or the portable one; tests check that both give the same bits.
pub fn matmul_quantized_with(qx: &QuantizedRows, w: &QuantWeight, simd: bool) -> Result<Vec<f32>> {
    if qx.cols != w.cols() {
        return Err(QuantError::InputWidth {
            tensor: w.name().to_string(),
            expected: w.cols(),
            found: qx.cols,
        });
    }
    let group = sum_group(w.format());
    let runs = run_count(qx.cols);
    if qx.q.len() != qx.rows * qx.cols
        || qx.scales.len() != qx.rows * runs
        || (group != 0 && (qx.group != group || qx.group_sums.len() != qx.rows * qx.cols / group))
    {
        return Err(QuantError::Input(format!(
            "quantized activations for {:?} are inconsistent: {} values, {} scales, sums of {} ({} \
             of them) for {} rows of {}",
            w.name(),
            qx.q.len(),
            qx.scales.len(),
            qx.group,
            qx.group_sums.len(),
            qx.rows,
            qx.cols
        )));
    }
    let simd = simd && has_avx2_fma();
    let (m, n) = (qx.rows, w.rows());
    let mut out = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return Ok(out);
    }
    let strip = |n0: usize| -> Vec<f32> {
        let n1 = (n0 + STRIP).min(n);
        let mut buf = vec![0f32; m * (n1 - n0)];
        if simd {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            #[cfg(target_arch = "x86_64")]
            unsafe {
                strip_avx2(qx, w, (n0, n1), &mut buf)
            };
        } else {
            strip_portable(qx, w, (n0, n1), &mut buf);
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
    Ok(out)
}

/// Outputs `n0..n1` of every activation row into `buf` (`m × (n1 − n0)`, row-major).
#[inline(always)]
fn strip_portable(qx: &QuantizedRows, w: &QuantWeight, (n0, n1): (usize, usize), buf: &mut [f32]) {
    let (m, width) = (qx.rows, n1 - n0);
    for r0 in (0..m).step_by(ROW_TILE) {
        let r1 = (r0 + ROW_TILE).min(m);
        for nn in n0..n1 {
            for r in r0..r1 {
                buf[r * width + nn - n0] =
                    row_dot(w, nn, qx.row(r), qx.row_scales(r), qx.row_sums(r));
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
unsafe fn strip_avx2(qx: &QuantizedRows, w: &QuantWeight, range: (usize, usize), buf: &mut [f32]) {
    strip_portable(qx, w, range, buf)
}

/// Whether this CPU runs the AVX2 + FMA build of the loops.
pub fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    return false;
}
