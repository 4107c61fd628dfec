//! The host side of the CUDA integer matmul (`kernels/quant_gemm.cu`, launched by `cuda.rs` under the
//! `cuda` feature), kept free of CUDA so CI tests it: which kernel instantiation runs a format, its tile
//! and shared memory, how many part groups a launch splits the reduction into, the shape checks, and
//! the flat arrays a [`QuantWeight`] uploads.
//!
//! The part groups: a launch with `G` groups (1, 2 or 4) gives each CTA `4 / G` of the reduction's four
//! parts; `G > 1` writes per-group partial results that a second kernel folds with the documented tree.
//! The arithmetic of every output is the same for every `G` (the tests below replay the kernel's walk
//! on the CPU and compare with [`crate::kernel::matmul_quantized`] bit for bit), so `G` is only a
//! question of filling the GPU: small `M · N` (decode) gets more CTAs from splitting `K`.

use crate::error::{QuantError, Result};
use crate::weight::{QuantWeight, WeightFormat};

/// Threads per CTA of the tensor-core kernels (4 warps, 2 × 2, each 32 × 32 outputs).
pub const TC_THREADS: u32 = 128;
/// Threads per CTA of the plain one-thread-per-output kernel and of the element-wise kernels.
pub const SIMT_THREADS: u32 = 256;

/// Which kernel computes the integer matmul. Every choice returns the same bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GemmKernel {
    /// Tensor cores, part groups chosen from the shape ([`part_groups`]).
    #[default]
    Auto,
    /// Tensor cores with a fixed number of part groups (1, 2 or 4).
    TensorCore { part_groups: u32 },
    /// One thread per output, plain integer loops: the second oracle.
    Simt,
}

/// One tensor-core kernel instantiation (must match the template arguments in quant_gemm.cu).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TilePlan {
    /// The `extern "C"` name in quant_gemm.cu.
    pub kernel: &'static str,
    /// Activation rows per CTA.
    pub bm: usize,
    /// Weight rows (outputs) per CTA.
    pub bn: usize,
    /// Bytes of the reduction per pipeline stage.
    pub bk: usize,
    pub stages: usize,
    /// Dynamic shared memory of a CTA.
    pub smem_bytes: usize,
}

/// The `Smem<FMT, BM, BN>::STAGE` size of quant_gemm.cu: A and B tiles, the block scales and, for the
/// K-quants, the sub-block scales / mins / activation sums of one stage, rounded up to 128 bytes.
fn stage_bytes(format: WeightFormat, bm: usize, bn: usize, bk: usize) -> usize {
    let blocks_per_stage = bk / format.block_len();
    let mut bytes = bm * bk + bn * bk + 4 * blocks_per_stage * bn;
    match format {
        WeightFormat::Q8_0 => {}
        WeightFormat::Q4K | WeightFormat::Q5K => bytes += 4 * bn + 8 * bn + 8 * bn + 4 * bm * 8,
        WeightFormat::Q6K => bytes += 16 * bn,
    }
    bytes.div_ceil(128) * 128
}

/// The kernel instantiation for a weight format.
pub fn tile_plan(format: WeightFormat) -> TilePlan {
    let (kernel, bk, stages) = match format {
        WeightFormat::Q8_0 => ("qgemm_q8_0_64x64", 128, 4),
        WeightFormat::Q4K | WeightFormat::Q5K => ("qgemm_k32_64x64", 256, 3),
        WeightFormat::Q6K => ("qgemm_q6k_64x64", 256, 3),
    };
    let (bm, bn) = (64, 64);
    TilePlan {
        kernel,
        bm,
        bn,
        bk,
        stages,
        smem_bytes: stages * stage_bytes(format, bm, bn, bk),
    }
}

/// The `fmt` argument of the plain kernel (`FMT_*` in quant_gemm.cu).
pub fn simt_format_code(format: WeightFormat) -> i32 {
    match format {
        WeightFormat::Q8_0 => 0,
        WeightFormat::Q4K | WeightFormat::Q5K => 1,
        WeightFormat::Q6K => 2,
    }
}

/// How many part groups a tensor-core launch of `m × n` outputs uses on a GPU with `sm_count`
/// multiprocessors: 1 when the output tiles alone give every SM two CTAs, else 2 or 4 (each doubling
/// the CTAs by splitting the reduction).
pub fn part_groups(plan: &TilePlan, m: usize, n: usize, sm_count: usize) -> u32 {
    let ctas = m.div_ceil(plan.bm) * n.div_ceil(plan.bn);
    let want = 2 * sm_count.max(1);
    if ctas >= want {
        1
    } else if 2 * ctas >= want {
        2
    } else {
        4
    }
}

/// The checks every launch makes before touching the device: the reduction is whole blocks, the sizes
/// fit the kernels' `int` arguments and the grid, and `part_groups` is 1, 2 or 4.
pub fn check_launch(
    w_name: &str,
    format: WeightFormat,
    m: usize,
    n: usize,
    k: usize,
    groups: u32,
) -> Result<()> {
    let block = format.block_len();
    if k == 0 || k % block != 0 {
        return Err(QuantError::PartialBlock {
            tensor: w_name.to_string(),
            ty: format.ggml_type(),
            cols: k,
            block,
        });
    }
    let fits = |x: usize| i32::try_from(x).is_ok();
    let total = m.checked_mul(n.max(k)).and_then(|x| x.checked_mul(4));
    if !fits(m) || !fits(n) || !fits(k) || total.is_none() || n.div_ceil(64) > 65_535 {
        return Err(QuantError::Input(format!(
            "CUDA matmul of {w_name:?}: {m} × {k} activations by {n} outputs exceed the kernels' index range"
        )));
    }
    if !matches!(groups, 1 | 2 | 4) {
        return Err(QuantError::Input(format!(
            "CUDA matmul of {w_name:?}: {groups} part groups (1, 2 or 4)"
        )));
    }
    Ok(())
}

/// A [`QuantWeight`]'s arrays as the device stores them: row-major `[rows, ·]`, signed bytes as `u8`
/// bits (candle has no i8), block scales f32. Absent arrays (Q8_0 has no sub-block scales, only
/// Q4_K/Q5_K have mins) are empty.
#[derive(Debug, Clone, PartialEq)]
pub struct FlatWeight {
    pub q: Vec<u8>,
    pub sub_scales: Vec<u8>,
    pub sub_mins: Vec<u8>,
    pub d: Vec<f32>,
    pub dmin: Vec<f32>,
}

impl FlatWeight {
    pub fn new(w: &QuantWeight) -> Self {
        let mut f = FlatWeight {
            q: Vec::with_capacity(w.rows() * w.cols()),
            sub_scales: Vec::new(),
            sub_mins: Vec::new(),
            d: Vec::new(),
            dmin: Vec::new(),
        };
        let as_bytes = |v: &[i8]| v.iter().map(|&x| x as u8).collect::<Vec<u8>>();
        for n in 0..w.rows() {
            f.q.extend(as_bytes(w.row_q(n)));
            f.sub_scales.extend(as_bytes(w.row_sub_scales(n)));
            f.sub_mins.extend(as_bytes(w.row_sub_mins(n)));
            f.d.extend_from_slice(w.row_d(n));
            f.dmin.extend_from_slice(w.row_dmin(n));
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::activation::{ActivationScale, QuantizedRows};
    use crate::kernel::{block_sums, matmul_quantized, quantize_for};
    use prism_gguf::quantize::quantize;

    struct Rng(u64);
    impl Rng {
        fn next_f32(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    fn weight(format: WeightFormat, rows: usize, cols: usize, rng: &mut Rng) -> QuantWeight {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.next_f32() * 0.05).collect();
        let ty = format.ggml_type();
        QuantWeight::from_gguf("w", ty, &quantize(ty, &values).unwrap(), rows, cols).unwrap()
    }

    /// The tensor-core kernel's walk for one output, replayed on the CPU: part groups of `4 / g` parts,
    /// stages of `plan.bk / block` blocks from the group's first block, parts closed when a block at or
    /// past their end comes (empty ones included), Q8_0's `f32(D_b)` through the 1.5·2^23 bit trick, the
    /// `lo` / pair / `s` tree, and for g > 1 the combine kernel's fold.
    fn kernel_walk(
        qx: &QuantizedRows,
        w: &QuantWeight,
        scale: f32,
        m: usize,
        n: usize,
        g: usize,
    ) -> f32 {
        let plan = tile_plan(w.format());
        let bps = plan.bk / w.format().block_len();
        let nb = w.blocks_per_row();
        let (qa, sums) = (qx.row(m), qx.row_sums(m));
        let (d, dmin) = (w.row_d(n), w.row_dmin(n));
        let mut group_out = Vec::new();
        for z in 0..g {
            let (p_begin, p_end) = (z * 4 / g, (z + 1) * 4 / g);
            let (b_begin, b_end) = (p_begin * nb / 4, p_end * nb / 4);
            let (mut acc, mut lo, mut s) = (0f32, 0f32, 0f32);
            let mut part = p_begin;
            let mut finish = |part: usize, acc: &mut f32| {
                if g == 4 {
                    s = *acc;
                } else if part % 2 == 0 {
                    lo = *acc;
                } else {
                    let pair = lo + *acc;
                    s = if g == 1 && part == 3 { s + pair } else { pair };
                }
                *acc = 0.0;
            };
            let n_stages = (b_end - b_begin).div_ceil(bps);
            for it in 0..n_stages {
                for blk in 0..bps {
                    let b = b_begin + it * bps + blk;
                    if b >= b_end {
                        break;
                    }
                    while b >= (part + 1) * nb / 4 {
                        finish(part, &mut acc);
                        part += 1;
                    }
                    let (db, mb) = block_sums(w, n, b, qa, sums);
                    let dbf = if w.format() == WeightFormat::Q8_0 {
                        let bits = 0x4B40_0000i32.wrapping_add(db);
                        f32::from_bits(bits as u32) - 12_582_912.0
                    } else {
                        db as f32
                    };
                    acc = d[b].mul_add(dbf, acc);
                    if w.format().has_mins() {
                        acc = (-dmin[b]).mul_add(mb as f32, acc);
                    }
                }
            }
            while part < p_end {
                finish(part, &mut acc);
                part += 1;
            }
            group_out.push(s);
        }
        match g {
            1 => group_out[0] * scale,
            2 => (group_out[0] + group_out[1]) * scale,
            _ => ((group_out[0] + group_out[1]) + (group_out[2] + group_out[3])) * scale,
        }
    }

    #[test]
    fn the_kernel_walk_gives_the_reference_bits_for_every_part_grouping() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        // Block counts that leave parts empty (1..3 blocks), uneven parts, and stage tails.
        let shapes = [
            (WeightFormat::Q8_0, 32),
            (WeightFormat::Q8_0, 96),
            (WeightFormat::Q8_0, 160),
            (WeightFormat::Q8_0, 32 * 37),
            (WeightFormat::Q4K, 256),
            (WeightFormat::Q4K, 768),
            (WeightFormat::Q4K, 1280),
            (WeightFormat::Q6K, 512),
            (WeightFormat::Q6K, 1536),
        ];
        for (format, k) in shapes {
            let (m, n) = (3, 5);
            let w = weight(format, n, k, &mut rng);
            // Large activations so that Q8_0's block sums reach far beyond 2^16.
            let x: Vec<f32> = (0..m * k).map(|_| rng.next_f32() * 4.0).collect();
            let scale = ActivationScale::from_absmax(4.0).unwrap();
            let qx = quantize_for(&x, m, &w, &scale).unwrap();
            let want = matmul_quantized(&qx, &w, &scale);
            for g in [1, 2, 4] {
                for r in 0..m {
                    for c in 0..n {
                        let got = kernel_walk(&qx, &w, scale.scale(), r, c, g);
                        assert_eq!(
                            got.to_bits(),
                            want[r * n + c].to_bits(),
                            "{format:?} K={k} G={g} output ({r}, {c}): {got} vs {}",
                            want[r * n + c]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_q8_0_bit_trick_is_the_exact_conversion_over_the_whole_block_sum_range() {
        // |D_b| ≤ 128 · 127 · 32 = 520,192 for Q8_0; the trick is exact below 2^22.
        let limit = 128 * 127 * 32;
        for db in (-limit..=limit).step_by(7).chain([-limit, -1, 0, 1, limit]) {
            let via_bits = f32::from_bits(0x4B40_0000i32.wrapping_add(db) as u32) - 12_582_912.0;
            assert_eq!(via_bits.to_bits(), (db as f32).to_bits(), "D_b = {db}");
        }
    }

    #[test]
    fn tile_plans_match_the_kernel_instantiations_and_fit_the_gpu() {
        let q8 = tile_plan(WeightFormat::Q8_0);
        // 64×128 A + 64×128 B + 4 blocks × 64 f32 scales = 17,408 bytes a stage, 4 stages.
        assert_eq!(
            (q8.bm, q8.bn, q8.bk, q8.stages, q8.smem_bytes),
            (64, 64, 128, 4, 4 * 17_408)
        );
        let q4 = tile_plan(WeightFormat::Q4K);
        // 2 × 64×256 + d, dmin (64 f32 each) + scales, mins (64×8 bytes each) + sums (64×8 i32).
        assert_eq!(q4.smem_bytes, 3 * (32_768 + 256 + 256 + 512 + 512 + 2_048));
        assert_eq!(tile_plan(WeightFormat::Q5K), q4);
        let q6 = tile_plan(WeightFormat::Q6K);
        assert_eq!(q6.smem_bytes, 3 * (32_768 + 256 + 1_024));
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let p = tile_plan(format);
            // Whole blocks per stage, and within the 227 KiB a CTA may opt in to on sm_90 (163 KiB sm_80).
            assert_eq!(p.bk % format.block_len(), 0);
            assert!(
                p.smem_bytes <= 163 * 1024,
                "{format:?}: {} bytes",
                p.smem_bytes
            );
        }
    }

    #[test]
    fn part_groups_split_the_reduction_only_when_the_tiles_do_not_fill_the_gpu() {
        let p = tile_plan(WeightFormat::Q8_0);
        // Decode on a 132-SM H200: 80 tiles of 64 outputs for N = 5120 → 4 groups.
        assert_eq!(part_groups(&p, 1, 5120, 132), 4);
        // 2 × 80 = 160 tiles: 2 groups bring 320 ≥ 264 CTAs.
        assert_eq!(part_groups(&p, 128, 5120, 132), 2);
        assert_eq!(part_groups(&p, 4096, 17408, 132), 1);
    }

    #[test]
    fn launches_refuse_partial_blocks_and_bad_groupings() {
        assert!(check_launch("w", WeightFormat::Q8_0, 7, 3584, 1024, 1).is_ok());
        assert!(matches!(
            check_launch("w", WeightFormat::Q8_0, 7, 3584, 1000, 1),
            Err(QuantError::PartialBlock {
                cols: 1000,
                block: 32,
                ..
            })
        ));
        assert!(matches!(
            check_launch("w", WeightFormat::Q6K, 7, 3584, 1024 + 32, 1),
            Err(QuantError::PartialBlock { block: 256, .. })
        ));
        assert!(check_launch("w", WeightFormat::Q4K, 7, 64, 256, 3).is_err());
        assert!(check_launch("w", WeightFormat::Q4K, 1 << 31, 64, 256, 1).is_err());
    }

    #[test]
    fn the_flat_arrays_are_the_rows_in_order() {
        let mut rng = Rng(7);
        for format in [WeightFormat::Q8_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let (rows, cols) = (3, 512);
            let w = weight(format, rows, cols, &mut rng);
            let f = FlatWeight::new(&w);
            let subs = cols / format.sub_len();
            let blocks = cols / format.block_len();
            assert_eq!(f.q.len(), rows * cols);
            assert_eq!(f.d.len(), rows * blocks);
            assert_eq!(
                f.sub_scales.len(),
                if format.has_sub_scales() {
                    rows * subs
                } else {
                    0
                }
            );
            assert_eq!(
                f.sub_mins.len(),
                if format.has_mins() { rows * subs } else { 0 }
            );
            assert_eq!(
                f.dmin.len(),
                if format.has_mins() { rows * blocks } else { 0 }
            );
            for n in 0..rows {
                // The kernels read element k of row n at n·cols + k, and reinterpret the byte as i8.
                for (k, &q) in w.row_q(n).iter().enumerate() {
                    assert_eq!(f.q[n * cols + k] as i8, q);
                }
                for (j, &s) in w.row_sub_scales(n).iter().enumerate() {
                    assert_eq!(f.sub_scales[n * subs + j] as i8, s);
                }
                for (j, &mn) in w.row_sub_mins(n).iter().enumerate() {
                    assert_eq!(f.sub_mins[n * subs + j] as i8, mn);
                }
                assert_eq!(&f.d[n * blocks..(n + 1) * blocks], w.row_d(n));
                if format.has_mins() {
                    assert_eq!(&f.dmin[n * blocks..(n + 1) * blocks], w.row_dmin(n));
                }
            }
        }
    }
}
