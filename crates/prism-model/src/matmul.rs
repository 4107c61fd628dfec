//! Batch-invariant matrix products for the CPU reference path.
//!
//! candle's CPU matmul (the `gemm` crate) picks its kernel, tiling and reduction split by matrix shape, so
//! the same activation row rounds differently depending on how many other rows share the call. That would
//! make a request's logits depend on what it was batched with. Here every output element is one dot
//! product with a fixed accumulation order that depends only on the reduction length:
//!
//! - element `i` of the reduction goes to lane `i mod 8`, each lane accumulates in increasing `i` with a
//!   fused multiply-add (`mul_add`: one rounding, the same on every CPU and SIMD width);
//! - the 8 lanes are summed by a fixed tree, `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
//!
//! Tiling, blocking, threading and SIMD width only decide which outputs are computed together, never how
//! one is computed, so a row's result depends only on that row and the weight: bit-identical whatever the
//! number of rows, the thread count or the machine (x86-64 with AVX2+FMA, or any CPU through the portable
//! path, which is slow where `mul_add` has no hardware instruction).
//!
//! On CUDA, [`crate::ops::linear`] runs bf16 weights through cuBLAS (f32 result) and other float
//! weights through candle's matmul; neither is batch-invariant. The integer path
//! ([`crate::linear::Linear::Quant`]) is, on the GPU as on the CPU.

use std::ops::{Add, Div, Mul, Neg, Sub};

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape};
use half::bf16;
use rayon::prelude::*;

/// Lanes of a dot product: reduction element `i` accumulates in lane `i mod LANES`.
pub const LANES: usize = 8;

/// The float types the kernels compute in (f32 for the reference and bf16 paths, f64 for ground truth).
pub trait Float:
    Copy
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    /// `self · b + c` with one rounding.
    fn fma(self, b: Self, c: Self) -> Self;
    fn exp(self) -> Self;
    fn from_f64(x: f64) -> Self;
    /// Exact.
    fn to_f64(self) -> f64;
    /// [`dot_portable`], with SIMD where the CPU has it (same bits).
    fn dot(a: &[Self], b: &[Self]) -> Self;
    /// `y_i ← alpha · x_i + y_i` (fused), element by element.
    fn axpy(alpha: Self, x: &[Self], y: &mut [Self]);
}

/// `Float` for f32 and f64: the same methods, each type's own conversions and SIMD dot product.
macro_rules! impl_float {
    ($t:ident, $simd_dot:ident, |$x:ident| $from_f64:expr, |$y:ident| $to_f64:expr) => {
        impl Float for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = $t::NEG_INFINITY;
            #[inline(always)]
            fn fma(self, b: Self, c: Self) -> Self {
                self.mul_add(b, c)
            }
            #[inline(always)]
            fn exp(self) -> Self {
                $t::exp(self)
            }
            #[inline(always)]
            fn from_f64($x: f64) -> Self {
                $from_f64
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                let $y = self;
                $to_f64
            }
            #[inline]
            fn dot(a: &[Self], b: &[Self]) -> Self {
                #[cfg(target_arch = "x86_64")]
                if has_avx2_fma() {
                    // SAFETY: the CPU has the features.
                    return unsafe { x86::$simd_dot(a, b) };
                }
                dot_portable(a, b)
            }
            #[inline]
            fn axpy(alpha: Self, x: &[Self], y: &mut [Self]) {
                #[cfg(target_arch = "x86_64")]
                if has_avx2_fma() {
                    // SAFETY: the CPU has the features.
                    return unsafe { x86::axpy(alpha, x, y) };
                }
                axpy_portable(alpha, x, y)
            }
        }
    };
}

impl_float!(f32, dot_f32, |x| x as f32, |y| f64::from(y));
impl_float!(f64, dot_f64, |x| x, |y| y);

/// A stored weight element, widened exactly to the compute type.
pub trait Widen<T>: Copy + Send + Sync {
    fn widen(self) -> T;
}

impl Widen<f32> for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }
}

impl Widen<f64> for f64 {
    #[inline(always)]
    fn widen(self) -> f64 {
        self
    }
}

impl Widen<f32> for bf16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        // bf16 is the top half of an f32: the shift is exact (and vectorizes, unlike a library call).
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
}

/// The fixed lane-combining tree.
#[inline(always)]
pub fn reduce_lanes<T: Float>(a: &[T; LANES]) -> T {
    let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    (s[0] + s[2]) + (s[1] + s[3])
}

/// `Σ a_i b_i` in the fixed lane order: the definition every kernel here reproduces bit for bit.
#[inline(always)]
pub fn dot_portable<T: Float>(a: &[T], b: &[T]) -> T {
    let n = a.len().min(b.len());
    let mut acc = [T::ZERO; LANES];
    let full = n / LANES * LANES;
    for (ca, cb) in a[..full]
        .chunks_exact(LANES)
        .zip(b[..full].chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[l] = ca[l].fma(cb[l], acc[l]);
        }
    }
    for i in full..n {
        let l = i - full;
        acc[l] = a[i].fma(b[i], acc[l]);
    }
    reduce_lanes(&acc)
}

/// `Σ a_i b_i` over the common length, in the order of [`dot_portable`].
#[inline(always)]
pub fn dot<T: Float>(a: &[T], b: &[T]) -> T {
    T::dot(a, b)
}

/// `y_i ← alpha · x_i + y_i` over the common length.
#[inline(always)]
pub fn axpy<T: Float>(alpha: T, x: &[T], y: &mut [T]) {
    T::axpy(alpha, x, y)
}

#[inline(always)]
fn axpy_portable<T: Float>(alpha: T, x: &[T], y: &mut [T]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y = alpha.fma(x, *y);
    }
}

/// `Σ a_i` in the fixed lane order.
#[inline(always)]
pub fn sum<T: Float>(a: &[T]) -> T {
    let mut acc = [T::ZERO; LANES];
    let full = a.len() / LANES * LANES;
    for c in a[..full].chunks_exact(LANES) {
        for l in 0..LANES {
            acc[l] = acc[l] + c[l];
        }
    }
    for (l, &x) in a[full..].iter().enumerate() {
        acc[l] = acc[l] + x;
    }
    reduce_lanes(&acc)
}

/// Rows of `x` per register tile, and rows of `w`.
const MR: usize = 3;
const NR: usize = 4;
// The x86 tiles spell out their 3 + 4 row pointers.
const _: () = assert!(MR == 3 && NR == 4);

/// A register tile of `MR × NR` dot products of length `k`, each in the fixed order of [`dot`].
pub trait TileKernel<W: Widen<Self>>: Float {
    /// The portable version (any CPU).
    #[inline(always)]
    fn tile(xs: [&[Self]; MR], ws: [&[W]; NR], k: usize) -> [[Self; NR]; MR] {
        tile_portable(xs, ws, k)
    }

    /// Whether [`Self::tile_simd`] can run on this CPU: every SIMD tile kernel needs AVX2 and FMA.
    fn simd_available() -> bool {
        #[cfg(target_arch = "x86_64")]
        return has_avx2_fma();
        #[cfg(not(target_arch = "x86_64"))]
        return false;
    }

    /// The same arithmetic with explicit SIMD. Only called when [`Self::simd_available`].
    ///
    /// # Safety
    /// The CPU must support the instructions the implementation uses, and every row slice must hold at
    /// least `k` elements (they are read through raw pointers).
    #[inline(always)]
    unsafe fn tile_simd(xs: [&[Self]; MR], ws: [&[W]; NR], k: usize) -> [[Self; NR]; MR] {
        tile_portable(xs, ws, k)
    }
}

#[inline(always)]
fn tile_portable<T: Float, W: Widen<T>>(xs: [&[T]; MR], ws: [&[W]; NR], k: usize) -> [[T; NR]; MR] {
    let mut acc = [[[T::ZERO; LANES]; NR]; MR];
    let full = k / LANES * LANES;
    for base in (0..full).step_by(LANES) {
        for i in 0..MR {
            for j in 0..NR {
                for l in 0..LANES {
                    acc[i][j][l] = xs[i][base + l].fma(ws[j][base + l].widen(), acc[i][j][l]);
                }
            }
        }
    }
    finish_tile(xs, ws, k, acc)
}

/// The tail (`k mod 8` elements, lanes `0..`) in scalar form, then the lane tree.
#[inline(always)]
fn finish_tile<T: Float, W: Widen<T>>(
    xs: [&[T]; MR],
    ws: [&[W]; NR],
    k: usize,
    mut acc: [[[T; LANES]; NR]; MR],
) -> [[T; NR]; MR] {
    let full = k / LANES * LANES;
    for idx in full..k {
        let l = idx - full;
        for i in 0..MR {
            for j in 0..NR {
                acc[i][j][l] = xs[i][idx].fma(ws[j][idx].widen(), acc[i][j][l]);
            }
        }
    }
    let mut out = [[T::ZERO; NR]; MR];
    for i in 0..MR {
        for j in 0..NR {
            out[i][j] = reduce_lanes(&acc[i][j]);
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    //! AVX2 + FMA versions of the tiles: one 8-lane register per output, `vfmadd` per lane, so lane `l`
    //! sees exactly the fused multiply-adds of the portable loop.
    use super::{axpy_portable, finish_tile, reduce_lanes, Float, LANES, MR, NR};
    use half::bf16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let full = n / LANES * LANES;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < full {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc,
            );
            i += LANES;
        }
        let mut lanes = [0f32; LANES];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        for i in full..n {
            lanes[i - full] = a[i].mul_add(b[i], lanes[i - full]);
        }
        reduce_lanes(&lanes)
    }

    // `dot_f32`'s loop for f64: the intrinsics are per type (8 lanes in one register there, two of 4
    // here), so each type has its own body.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot_f64(a: &[f64], b: &[f64]) -> f64 {
        let n = a.len().min(b.len());
        let full = n / LANES * LANES;
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        let mut i = 0;
        while i < full {
            lo = _mm256_fmadd_pd(
                _mm256_loadu_pd(a.as_ptr().add(i)),
                _mm256_loadu_pd(b.as_ptr().add(i)),
                lo,
            );
            hi = _mm256_fmadd_pd(
                _mm256_loadu_pd(a.as_ptr().add(i + 4)),
                _mm256_loadu_pd(b.as_ptr().add(i + 4)),
                hi,
            );
            i += LANES;
        }
        let mut lanes = [0f64; LANES];
        _mm256_storeu_pd(lanes.as_mut_ptr(), lo);
        _mm256_storeu_pd(lanes.as_mut_ptr().add(4), hi);
        for i in full..n {
            lanes[i - full] = a[i].mul_add(b[i], lanes[i - full]);
        }
        reduce_lanes(&lanes)
    }

    /// Element-wise, so vectorizing cannot change a result; compiled with FMA so `mul_add` is one
    /// instruction.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy<T: Float>(alpha: T, x: &[T], y: &mut [T]) {
        axpy_portable(alpha, x, y)
    }

    #[inline(always)]
    unsafe fn store(acc: [[__m256; NR]; MR]) -> [[[f32; LANES]; NR]; MR] {
        let mut out = [[[0f32; LANES]; NR]; MR];
        for i in 0..MR {
            for j in 0..NR {
                _mm256_storeu_ps(out[i][j].as_mut_ptr(), acc[i][j]);
            }
        }
        out
    }

    /// The f32 tile over weights of type `$w`, each 8 weights at `$p` read into f32 lanes by `$load`
    /// (spliced into the loop, not a closure: it runs under the function's target features): one loop
    /// for f32 and bf16 weights.
    macro_rules! tile_f32_over {
        ($name:ident, $w:ty, |$p:ident| $load:block) => {
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $name(xs: [&[f32]; MR], ws: [&[$w]; NR], k: usize) -> [[f32; NR]; MR] {
                let full = k / LANES * LANES;
                let mut acc = [[_mm256_setzero_ps(); NR]; MR];
                let xp = [xs[0].as_ptr(), xs[1].as_ptr(), xs[2].as_ptr()];
                let wp = [
                    ws[0].as_ptr(),
                    ws[1].as_ptr(),
                    ws[2].as_ptr(),
                    ws[3].as_ptr(),
                ];
                let mut base = 0;
                while base < full {
                    // 12 accumulators + 3 activations + 1 weight: the 16 registers, no spills.
                    let mut xv = [_mm256_setzero_ps(); MR];
                    for i in 0..MR {
                        xv[i] = _mm256_loadu_ps(xp[i].add(base));
                    }
                    for j in 0..NR {
                        let wv = {
                            let $p = wp[j].add(base);
                            $load
                        };
                        for i in 0..MR {
                            acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
                        }
                    }
                    base += LANES;
                }
                finish_tile(xs, ws, k, store(acc))
            }
        };
    }

    tile_f32_over!(tile_f32, f32, |p| { _mm256_loadu_ps(p) });
    // bf16 → f32 is the upper half of the f32: widen to 32 bits, shift left by 16.
    tile_f32_over!(tile_f32_bf16, bf16, |p| {
        let raw = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16))
    });

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn tile_f64(xs: [&[f64]; MR], ws: [&[f64]; NR], k: usize) -> [[f64; NR]; MR] {
        // Lanes 0–3 of an output in one register, 4–7 in another. Two passes of two weight rows each
        // keep the 12 accumulators + 3 operands within the 16 registers.
        let full = k / LANES * LANES;
        let xp = [xs[0].as_ptr(), xs[1].as_ptr(), xs[2].as_ptr()];
        let mut acc = [[[0f64; LANES]; NR]; MR];
        for half in 0..2 {
            let wp = [ws[2 * half].as_ptr(), ws[2 * half + 1].as_ptr()];
            let mut lo = [[_mm256_setzero_pd(); 2]; MR];
            let mut hi = [[_mm256_setzero_pd(); 2]; MR];
            let mut base = 0;
            while base < full {
                for j in 0..2 {
                    let wl = _mm256_loadu_pd(wp[j].add(base));
                    let wh = _mm256_loadu_pd(wp[j].add(base + 4));
                    for i in 0..MR {
                        lo[i][j] = _mm256_fmadd_pd(_mm256_loadu_pd(xp[i].add(base)), wl, lo[i][j]);
                        hi[i][j] =
                            _mm256_fmadd_pd(_mm256_loadu_pd(xp[i].add(base + 4)), wh, hi[i][j]);
                    }
                }
                base += LANES;
            }
            for i in 0..MR {
                for j in 0..2 {
                    _mm256_storeu_pd(acc[i][2 * half + j].as_mut_ptr(), lo[i][j]);
                    _mm256_storeu_pd(acc[i][2 * half + j].as_mut_ptr().add(4), hi[i][j]);
                }
            }
        }
        finish_tile(xs, ws, k, acc)
    }
}

/// `TileKernel<$w>` for `$t`: the x86 SIMD tile `$simd` there, the portable one elsewhere.
macro_rules! impl_tile_kernel {
    ($($t:ty, $w:ty, $simd:ident);+ $(;)?) => {$(
        impl TileKernel<$w> for $t {
            #[inline(always)]
            unsafe fn tile_simd(xs: [&[$t]; MR], ws: [&[$w]; NR], k: usize) -> [[$t; NR]; MR] {
                #[cfg(target_arch = "x86_64")]
                return x86::$simd(xs, ws, k);
                #[cfg(not(target_arch = "x86_64"))]
                return tile_portable(xs, ws, k);
            }
        }
    )+};
}

impl_tile_kernel!(
    f32, f32, tile_f32;
    f32, bf16, tile_f32_bf16;
    f64, f64, tile_f64;
);

/// One block: rows `m0..m1` of `x` against rows `n0..n1` of `w`, written row-major into `out`
/// (`(m1 − m0) × (n1 − n0)`). Short tiles at the edges repeat their last row; the duplicates are computed
/// identically and dropped.
fn block<T: TileKernel<W>, W: Widen<T>>(
    x: &[T],
    w: &[W],
    k: usize,
    (m0, m1): (usize, usize),
    (n0, n1): (usize, usize),
    out: &mut [T],
) {
    let simd = T::simd_available();
    let width = n1 - n0;
    for n in (n0..n1).step_by(NR) {
        let ws: [&[W]; NR] = std::array::from_fn(|j| {
            let r = (n + j).min(n1 - 1);
            &w[r * k..(r + 1) * k]
        });
        for m in (m0..m1).step_by(MR) {
            let xs: [&[T]; MR] = std::array::from_fn(|i| {
                let r = (m + i).min(m1 - 1);
                &x[r * k..(r + 1) * k]
            });
            let y = if simd {
                // SAFETY: `simd_available` checked the CPU features; every row slice has length `k`.
                unsafe { T::tile_simd(xs, ws, k) }
            } else {
                T::tile(xs, ws, k)
            };
            let cols = (n1 - n).min(NR);
            for (i, row) in y.iter().enumerate().take((m1 - m).min(MR)) {
                let o = (m + i - m0) * width + (n - n0);
                out[o..o + cols].copy_from_slice(&row[..cols]);
            }
        }
    }
}

/// Whether `work` multiply-adds are worth spreading over rayon's pool. With a one-thread pool the caller
/// computes (several callers would otherwise queue on that one worker), and small jobs stay on the caller
/// too. Only the speed depends on this, never a result.
pub(crate) fn use_threads(work: usize) -> bool {
    work >= 1 << 18 && rayon::current_num_threads() > 1
}

/// `x · wᵀ` for row-major `x: [m, k]` and `w: [n, k]`; returns row-major `[m, n]`. Every element is
/// [`dot`] of its two rows, bit for bit.
pub fn matmul_xwt<T: TileKernel<W>, W: Widen<T>>(
    x: &[T],
    w: &[W],
    m: usize,
    n: usize,
    k: usize,
) -> Vec<T> {
    assert!(
        x.len() >= m * k && w.len() >= n * k,
        "matmul_xwt: short input"
    );
    let mut out = vec![T::ZERO; m * n];
    if m == 0 || n == 0 {
        return out;
    }
    // Blocks of weight rows small enough to stay in L2 while every activation row passes over them.
    let bytes_per_row = k * std::mem::size_of::<W>();
    let nb = ((256 * 1024) / bytes_per_row.max(1)).clamp(NR, 512) / NR * NR;
    let mb = 16 * MR;
    let tasks: Vec<((usize, usize), (usize, usize))> = (0..m)
        .step_by(mb)
        .flat_map(|m0| {
            (0..n)
                .step_by(nb)
                .map(move |n0| ((m0, (m0 + mb).min(m)), (n0, (n0 + nb).min(n))))
        })
        .collect();
    if tasks.len() == 1 {
        block(x, w, k, tasks[0].0, tasks[0].1, &mut out);
        return out;
    }
    let run = |&(ms, ns): &((usize, usize), (usize, usize))| {
        let mut buf = vec![T::ZERO; (ms.1 - ms.0) * (ns.1 - ns.0)];
        block(x, w, k, ms, ns, &mut buf);
        buf
    };
    let results: Vec<Vec<T>> = if use_threads(m * n * k) {
        tasks.par_iter().map(run).collect()
    } else {
        tasks.iter().map(run).collect()
    };
    for (((m0, m1), (n0, n1)), buf) in tasks.iter().zip(&results) {
        let width = n1 - n0;
        for r in *m0..*m1 {
            let src = &buf[(r - m0) * width..(r - m0 + 1) * width];
            out[r * n + n0..r * n + n1].copy_from_slice(src);
        }
    }
    out
}

/// candle op: `x · wᵀ` for `x: [m, k]` (f32 or f64) and `w: [n, k]` (the same dtype, or bf16 with f32 `x`).
pub struct RowInvariantMatmul;

fn contiguous<'a, T>(v: &'a [T], l: &Layout, what: &str) -> Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&v[start..end]),
        None => candle_core::bail!("row-invariant matmul: {what} must be contiguous"),
    }
}

// The trait's own signatures, as `CausalAttention`'s `CustomOp3` impl in attention.rs has them.
impl CustomOp2 for RowInvariantMatmul {
    fn name(&self) -> &'static str {
        "row-invariant-matmul"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("row-invariant matmul: x is [{m}, {k}] but w is [{n}, {k2}]");
        }
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => CpuStorage::F32(matmul_xwt(
                contiguous(x, l1, "x")?,
                contiguous(w, l2, "w")?,
                m,
                n,
                k,
            )),
            (CpuStorage::F32(x), CpuStorage::BF16(w)) => CpuStorage::F32(matmul_xwt(
                contiguous(x, l1, "x")?,
                contiguous(w, l2, "w")?,
                m,
                n,
                k,
            )),
            (CpuStorage::F64(x), CpuStorage::F64(w)) => CpuStorage::F64(matmul_xwt(
                contiguous(x, l1, "x")?,
                contiguous(w, l2, "w")?,
                m,
                n,
                k,
            )),
            (a, b) => candle_core::bail!(
                "row-invariant matmul: unsupported dtypes {:?} × {:?}",
                candle_core::backend::BackendStorage::dtype(a),
                candle_core::backend::BackendStorage::dtype(b)
            ),
        };
        Ok((out, Shape::from((m, n))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pseudo_random(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Every element of `matmul_xwt` is `dot_portable` of its rows, bit for bit, and any subset of rows
    /// gives the same bits as inside the full batch.
    fn check_row_invariance<T: TileKernel<T> + Widen<T> + std::fmt::Debug>(
        x: &[T],
        w: &[T],
        m: usize,
        n: usize,
        k: usize,
    ) {
        let y = matmul_xwt(x, w, m, n, k);
        for r in 0..m {
            for c in 0..n {
                let want = dot_portable(&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]);
                assert!(
                    y[r * n + c] == want,
                    "({r}, {c}): {:?} vs {want:?}",
                    y[r * n + c]
                );
                assert!(dot(&x[r * k..(r + 1) * k], &w[c * k..(c + 1) * k]) == want);
            }
        }
        for (start, len) in [(0, 1), (5, 2), (17, 3), (m - 3, 3), (1, m - 1)] {
            let part = matmul_xwt(&x[start * k..(start + len) * k], w, len, n, k);
            assert!(
                part == y[start * n..(start + len) * n],
                "rows {start}..{}",
                start + len
            );
        }
    }

    #[test]
    fn every_element_is_the_reference_dot_product_whatever_the_shape() {
        // k = 37 and 64: full lane blocks with and without a tail; n = 70, m = 53: edge tiles in both
        // directions and several blocks, so threads and tiling are exercised.
        for k in [37, 64] {
            let (m, n) = (53, 70);
            let x = pseudo_random(m * k, 1);
            let w = pseudo_random(n * k, 2);
            check_row_invariance(&x, &w, m, n, k);
            let x64: Vec<f64> = x.iter().map(|&v| f64::from(v) / 3.0).collect();
            let w64: Vec<f64> = w.iter().map(|&v| f64::from(v) / 7.0).collect();
            check_row_invariance(&x64, &w64, m, n, k);
            // Close to the exact value.
            let y = matmul_xwt(&x, &w, 1, 1, k);
            let exact: f64 = (0..k).map(|i| f64::from(x[i]) * f64::from(w[i])).sum();
            assert!((f64::from(y[0]) - exact).abs() < 1e-5);
        }
    }

    #[test]
    fn bf16_weights_widen_exactly() {
        let (m, n, k) = (4, 5, 64);
        let x = pseudo_random(m * k, 3);
        let w = pseudo_random(n * k, 4);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wf: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        assert_eq!(matmul_xwt(&x, &wb, m, n, k), matmul_xwt(&x, &wf, m, n, k));
    }

    #[test]
    fn sum_and_dot_ignore_trailing_zeros() {
        let a = pseudo_random(29, 5);
        let b = pseudo_random(29, 6);
        let mut a0 = a.clone();
        let mut b0 = b.clone();
        a0.extend([0.0; 11]);
        b0.extend([0.0; 11]);
        assert_eq!(dot(&a, &b).to_bits(), dot(&a0, &b0).to_bits());
        assert_eq!(sum(&a).to_bits(), sum(&a0).to_bits());
    }
}
