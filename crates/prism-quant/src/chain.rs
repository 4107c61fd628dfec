//! The **chained** Q8_0 block reduction: a candidate for the int8 contract, measured against the
//! current one (step 4 of the crate docs) and not yet the engine's arithmetic.
//!
//! # Why
//!
//! The current contract costs every output two FP32 instructions per block of 32 products (`f32(D_b)`
//! by the magic-number subtraction, then `fma(d_b, ·, acc)`), issued by the same schedulers as the
//! tensor-core MMAs: that caps an H200 at ~470 TOPS whatever the MMA instruction
//! (`kernels/bench/imma_rate.cu`, docs/benchmarks.md). The chained form needs **one** FFMA per output
//! and block: the same loop measured 637–738 TOPS with `wgmma` (2026-11-30, sixth session).
//!
//! # The arithmetic
//!
//! Within each part (the same four parts as the current contract, [`crate::kernel::part_bounds`]), the
//! blocks are taken in **groups** of up to [`CHAIN`] consecutive blocks from the part's start (the last
//! group of a part may be shorter). For a group of blocks `g0 .. g1`:
//!
//! 1. `S_j = Σ_{b=g0..=j} D_b`, the exact i32 prefix sums of the block sums (`|S_j| ≤ 8 · 520,192 <
//!    2^22`). A tensor core accumulating the group's blocks into one i32 register starting from the bits
//!    `0x4B400000` holds `0x4B400000 + S_j`, whose float value is `f_j = 1.5·2^23 + S_j` exactly.
//! 2. Coefficients `c_j = d_j − d_{j+1}` (one f32 subtraction) for `j < g1 − 1`, `c_{g1−1} = d_{g1−1}`:
//!    by summation by parts `Σ_j c_j·S_j = Σ_j d_j·D_j`, and `Σ_j c_j = d_{g0}`.
//! 3. `acc = fma(c_j, f_j, acc)` for `j = g0 .. g1 − 1` (one instruction an output and block), then
//!    `acc = acc + corr_g` with `corr_g = −d_{g0} · 1.5·2^23` (exact in f32: an f16 times 3·2^22), which
//!    removes the bias the magic number added.
//! 4. Parts start from `+0.0`, are combined by the same tree and multiplied by the activation scale as
//!    in the current contract.
//!
//! Every step is a fixed sequence of IEEE operations that depends only on the output element and `nb`,
//! so the result is as batch-invariant as the current contract and a device reproduces it bit for bit.
//! It is not the same value: the running sum carries the bias `(d_{g0} − d_{j+1})·1.5·2^23` inside a
//! group, so its roundings are coarser. Against the exact sum (tests below, random Q8_0 rows): errors
//! of 5e-5 – 1.2e-4 of one block term's RMS (the current contract: 5e-7 – 5e-6), i.e. ~1e-5 of an
//! output at K = 5120 — far below the int8 activations' own quantization error.

use crate::activation::{ActivationScale, QuantizedRows};
use crate::error::{QuantError, Result};
use crate::kernel::{combine_parts, part_bounds, quantize_for, PARTS};
use crate::weight::{QuantWeight, WeightFormat};

/// Blocks per chain group: 8 · 32 · 127 · 128 < 2^22, so the prefix sums stay inside the magic number's
/// exact range.
pub const CHAIN: usize = 8;

/// The magic number `1.5·2^23` as float bits; `f32::from_bits(MAGIC_BITS + s)` is `1.5·2^23 + s` for
/// `|s| < 2^22`.
pub const MAGIC_BITS: i32 = 0x4B40_0000;
const MAGIC: f32 = 12_582_912.0;

/// The chain groups of a row of `nb` blocks, part by part: `(first block, end)` in reduction order.
/// A device kernel numbers them the same way ([`group_index`]).
pub fn groups(nb: usize) -> Vec<(usize, usize)> {
    let bounds = part_bounds(nb);
    let mut out = Vec::new();
    for p in 0..PARTS {
        let mut b = bounds[p];
        while b < bounds[p + 1] {
            let e = (b + CHAIN).min(bounds[p + 1]);
            out.push((b, e));
            b = e;
        }
    }
    out
}

/// The index (in [`groups`]) of the group that holds block `b` of part `p`: the groups of the earlier
/// parts, then `(b − part start) / CHAIN`. The same integer arithmetic as the CUDA kernel's.
pub fn group_index(nb: usize, p: usize, b: usize) -> usize {
    let bounds = part_bounds(nb);
    let before: usize = (0..p)
        .map(|q| (bounds[q + 1] - bounds[q]).div_ceil(CHAIN))
        .sum();
    before + (b - bounds[p]) / CHAIN
}

/// The group that a device stage of blocks `b .. b + cnt` (inside one part, as the kernels' stages
/// always are) closes, if it closes one: the twin of `chain_group_end` in kernels/quant_gemm.cu, whose
/// chained tile adds a group's correction at the end of the stage that closes it.
pub fn stage_group_end(nb: usize, b: usize, cnt: usize) -> Option<usize> {
    let bounds = part_bounds(nb);
    let mut base = 0;
    for p in 0..PARTS {
        let (s, e) = (bounds[p], bounds[p + 1]);
        if b >= s && b < e {
            let end = b + cnt;
            return ((end - s) % CHAIN == 0 || end == e).then(|| base + (end - 1 - s) / CHAIN);
        }
        base += (e - s).div_ceil(CHAIN);
    }
    None
}

/// The per-row tables of the chained reduction of a Q8_0 weight: the coefficients `c` (`[rows][nb]`,
/// the layout of the block scales) and the group corrections (`[rows][groups]`).
#[derive(Debug, Clone, PartialEq)]
pub struct ChainTables {
    pub coef: Vec<f32>,
    pub corr: Vec<f32>,
    pub blocks_per_row: usize,
    pub groups_per_row: usize,
}

impl ChainTables {
    /// The tables of a Q8_0 weight (other formats: an error — their blocks are 256 long and the
    /// contract's epilogue is already one per 256 products).
    pub fn new(w: &QuantWeight) -> Result<Self> {
        if w.format() != WeightFormat::Q8_0 {
            return Err(QuantError::Input(format!(
                "{}: the chained reduction is for Q8_0 weights, not {:?}",
                w.name(),
                w.format()
            )));
        }
        let nb = w.blocks_per_row();
        let gs = groups(nb);
        let mut coef = Vec::with_capacity(w.rows() * nb);
        let mut corr = Vec::with_capacity(w.rows() * gs.len());
        for n in 0..w.rows() {
            let d = w.row_d(n);
            for &(g0, g1) in &gs {
                for j in g0..g1 {
                    coef.push(if j + 1 < g1 { d[j] - d[j + 1] } else { d[j] });
                }
                corr.push(-(d[g0] * MAGIC));
            }
        }
        Ok(Self {
            coef,
            corr,
            blocks_per_row: nb,
            groups_per_row: gs.len(),
        })
    }

    fn row_coef(&self, n: usize) -> &[f32] {
        &self.coef[n * self.blocks_per_row..(n + 1) * self.blocks_per_row]
    }

    fn row_corr(&self, n: usize) -> &[f32] {
        &self.corr[n * self.groups_per_row..(n + 1) * self.groups_per_row]
    }
}

/// `1.5·2^23 + s` from the bits a tensor core leaves in an i32 accumulator started at [`MAGIC_BITS`].
#[inline(always)]
fn biased(s: i32) -> f32 {
    debug_assert!(s.abs() < 1 << 22);
    f32::from_bits(MAGIC_BITS.wrapping_add(s) as u32)
}

/// One output before the activation scale, by the chained reduction (see the module docs).
pub fn row_dot_chained(w: &QuantWeight, t: &ChainTables, n: usize, qa: &[i8]) -> f32 {
    let (q, coef, corr) = (w.row_q(n), t.row_coef(n), t.row_corr(n));
    let bounds = part_bounds(t.blocks_per_row);
    let mut parts = [0f32; PARTS];
    let mut g = 0;
    for (p, part) in parts.iter_mut().enumerate() {
        let mut acc = 0f32;
        let mut b = bounds[p];
        while b < bounds[p + 1] {
            let end = (b + CHAIN).min(bounds[p + 1]);
            let mut s = 0i32;
            for j in b..end {
                s += q[32 * j..32 * j + 32]
                    .iter()
                    .zip(&qa[32 * j..32 * j + 32])
                    .map(|(&w, &a)| i32::from(w) * i32::from(a))
                    .sum::<i32>();
                acc = coef[j].mul_add(biased(s), acc);
            }
            acc += corr[g];
            g += 1;
            b = end;
        }
        *part = acc;
    }
    combine_parts(parts)
}

/// `y = x · Wᵀ` by the chained reduction: the reference of the chained device tile. Rows are
/// independent, as in [`crate::kernel::matmul`].
pub fn matmul_chained(
    x: &[f32],
    m: usize,
    w: &QuantWeight,
    t: &ChainTables,
    scale: &ActivationScale,
) -> Result<Vec<f32>> {
    let qx = quantize_for(x, m, w, scale)?;
    Ok(matmul_quantized_chained(&qx, w, t, scale))
}

/// [`matmul_chained`] from quantized activations.
pub fn matmul_quantized_chained(
    qx: &QuantizedRows,
    w: &QuantWeight,
    t: &ChainTables,
    scale: &ActivationScale,
) -> Vec<f32> {
    use rayon::prelude::*;
    let (m, n, s) = (qx.rows, w.rows(), scale.scale());
    let mut out = vec![0f32; m * n];
    out.par_chunks_mut(n.max(1))
        .enumerate()
        .for_each(|(r, row)| {
            for (nn, y) in row.iter_mut().enumerate() {
                *y = row_dot_chained(w, t, nn, qx.row(r)) * s;
            }
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{matmul_quantized, row_dot};
    use crate::quantize_rows;
    use prism_gguf::quantize::quantize;
    use prism_gguf::GgmlType;

    struct Lcg(u64);
    impl Lcg {
        fn next(&mut self) -> f32 {
            self.0 = self
                .0
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn weight(n: usize, k: usize, seed: u64) -> QuantWeight {
        let mut rng = Lcg(seed);
        let v: Vec<f32> = (0..n * k).map(|_| rng.next() * 0.05).collect();
        let bytes = quantize(GgmlType::Q8_0, &v).expect("quantize");
        QuantWeight::from_gguf("w", GgmlType::Q8_0, &bytes, n, k).expect("weight")
    }

    #[test]
    fn groups_cover_each_part_in_order() {
        for nb in [1usize, 3, 4, 7, 8, 9, 20, 32, 80, 160, 192, 544] {
            let gs = groups(nb);
            let bounds = part_bounds(nb);
            let mut next = 0;
            for (i, &(g0, g1)) in gs.iter().enumerate() {
                assert_eq!(g0, next, "nb {nb}");
                assert!(g1 > g0 && g1 - g0 <= CHAIN, "nb {nb}");
                // A group never straddles a part boundary.
                let p = (0..PARTS)
                    .find(|&p| bounds[p] <= g0 && g0 < bounds[p + 1])
                    .unwrap();
                assert!(g1 <= bounds[p + 1], "nb {nb}");
                assert_eq!(group_index(nb, p, g0), i, "nb {nb}");
                assert_eq!(group_index(nb, p, g1 - 1), i, "nb {nb}");
                next = g1;
            }
            assert_eq!(next, nb);
        }
    }

    /// The kernel walks each part in stages of 4 blocks (the last one shorter): every group ends at the
    /// end of a stage, and the stages that close groups close them in order.
    #[test]
    fn device_stages_close_every_group_at_a_stage_end() {
        const BPS: usize = 4;
        for nb in 1usize..=200 {
            let bounds = part_bounds(nb);
            let mut closed = Vec::new();
            for p in 0..PARTS {
                let mut b = bounds[p];
                while b < bounds[p + 1] {
                    let cnt = BPS.min(bounds[p + 1] - b);
                    if let Some(g) = stage_group_end(nb, b, cnt) {
                        closed.push((g, b + cnt));
                    }
                    b += cnt;
                }
            }
            let want: Vec<(usize, usize)> = groups(nb)
                .iter()
                .enumerate()
                .map(|(i, &(_, e))| (i, e))
                .collect();
            assert_eq!(closed, want, "nb {nb}");
        }
    }

    #[test]
    fn tables_telescope_to_the_first_scale() {
        let w = weight(5, 32 * 40, 3);
        let t = ChainTables::new(&w).unwrap();
        let gs = groups(w.blocks_per_row());
        for n in 0..w.rows() {
            let d = w.row_d(n);
            for (g, &(g0, g1)) in gs.iter().enumerate() {
                let sum: f64 = (g0..g1)
                    .map(|j| f64::from(t.coef[n * t.blocks_per_row + j]))
                    .sum();
                assert_eq!(sum, f64::from(d[g0]), "row {n} group {g}");
                assert_eq!(
                    t.corr[n * t.groups_per_row + g],
                    -(d[g0] * MAGIC),
                    "row {n} group {g}"
                );
                // The correction is exact: d (an f16) times 3·2^22.
                assert_eq!(
                    f64::from(t.corr[n * t.groups_per_row + g]),
                    -f64::from(d[g0]) * 12_582_912.0
                );
            }
        }
    }

    /// The chained result is within a small multiple of 2^-14 of the exact sum's scale, as is the current
    /// contract's (closer): both against the f64 sum of `d_b · D_b`.
    #[test]
    fn chained_is_close_to_the_exact_sum() {
        for (k, seed) in [(1024usize, 1u64), (5120, 2), (2560, 3), (32 * 9, 4)] {
            let (m, n) = (6, 24);
            let w = weight(n, k, seed);
            let t = ChainTables::new(&w).unwrap();
            let mut rng = Lcg(seed + 100);
            let x: Vec<f32> = (0..m * k).map(|_| rng.next() * 3.0).collect();
            let scale = ActivationScale::from_absmax(2.5).unwrap();
            let qx = quantize_rows(&x, m, k, &scale, 0).unwrap();
            let (mut worst_chain, mut worst_plain) = (0f64, 0f64);
            for r in 0..m {
                let qa = qx.row(r);
                for nn in 0..n {
                    let (q, d) = (w.row_q(nn), w.row_d(nn));
                    let mut exact = 0f64;
                    let mut mag = 0f64;
                    for b in 0..k / 32 {
                        let db: i32 = (0..32)
                            .map(|i| i32::from(q[32 * b + i]) * i32::from(qa[32 * b + i]))
                            .sum();
                        exact += f64::from(d[b]) * f64::from(db);
                        mag += (f64::from(d[b]) * f64::from(db)).powi(2);
                    }
                    let rms = (mag / (k / 32) as f64).sqrt().max(1e-30);
                    let chained = f64::from(row_dot_chained(&w, &t, nn, qa));
                    let plain = f64::from(row_dot(&w, nn, qa, &[]));
                    worst_chain = worst_chain.max((chained - exact).abs() / rms);
                    worst_plain = worst_plain.max((plain - exact).abs() / rms);
                }
            }
            // Errors relative to the RMS of one block's term d_b·D_b (measured 2026-11-30: chained
            // 5e-5 – 1.2e-4, current contract 5e-7 – 5e-6; an output is ~√nb such terms).
            assert!(
                worst_chain < 2f64.powi(-11),
                "K {k}: chained {worst_chain:e}"
            );
            assert!(worst_plain < 2f64.powi(-16), "K {k}: plain {worst_plain:e}");
            assert!(
                worst_chain > 0.0,
                "K {k}: the chained form is expected to round"
            );
        }
    }

    /// At the extremes (every product 127 · −128 or 127 · 127, 8 blocks a group) the prefix sums stay
    /// inside the magic number's exact range and the result is the exact integer sum times the scales.
    #[test]
    fn extreme_blocks_stay_exact() {
        let (n, k) = (2usize, 32 * 16);
        let mut bytes = Vec::new();
        for row in 0..n {
            for _ in 0..k / 32 {
                bytes.extend_from_slice(&half::f16::from_f32(1.0).to_bits().to_le_bytes());
                let q: i8 = if row == 0 { -128 } else { 127 };
                bytes.extend(std::iter::repeat_n(q as u8, 32));
            }
        }
        let w = QuantWeight::from_gguf("x", GgmlType::Q8_0, &bytes, n, k).unwrap();
        let t = ChainTables::new(&w).unwrap();
        let scale = ActivationScale::from_absmax(127.0).unwrap();
        let x = vec![127f32; k];
        let qx = quantize_rows(&x, 1, k, &scale, 0).unwrap();
        let want = [-128.0 * 127.0 * k as f32, 127.0 * 127.0 * k as f32];
        for (nn, want) in want.iter().enumerate() {
            assert_eq!(row_dot_chained(&w, &t, nn, qx.row(0)), *want, "row {nn}");
        }
        let plain = matmul_quantized(&qx, &w, &scale);
        let chained = matmul_quantized_chained(&qx, &w, &t, &scale);
        assert_eq!(plain, chained);
    }

    #[test]
    fn rows_are_independent() {
        let (n, k) = (9, 32 * 44);
        let w = weight(n, k, 8);
        let t = ChainTables::new(&w).unwrap();
        let mut rng = Lcg(77);
        let x: Vec<f32> = (0..7 * k).map(|_| rng.next()).collect();
        let scale = ActivationScale::from_absmax(0.8).unwrap();
        let all = matmul_chained(&x, 7, &w, &t, &scale).unwrap();
        for r in 0..7 {
            let one = matmul_chained(&x[r * k..(r + 1) * k], 1, &w, &t, &scale).unwrap();
            assert_eq!(one, all[r * n..(r + 1) * n], "row {r}");
        }
    }

    #[test]
    fn other_formats_are_refused() {
        let v = vec![0.01f32; 256 * 2];
        let bytes = quantize(GgmlType::Q4_K, &v).unwrap();
        let w = QuantWeight::from_gguf("k", GgmlType::Q4_K, &bytes, 2, 256).unwrap();
        let e = ChainTables::new(&w).unwrap_err().to_string();
        assert!(e.contains("Q8_0"), "{e}");
    }
}
