//! Quantization of f32 data into ggml block formats, reproducing llama.cpp's reference quantizers
//! (`quantize_row_*_ref` in ggml-quants.c, i.e. what `llama-quantize` does without an importance matrix).
//!
//! The arithmetic follows the reference step by step in f32: same expressions, same evaluation order,
//! no fused multiply-adds (llama.cpp builds these functions into ggml-base, without FMA code generation),
//! and `nearest_int` is the reference's add-a-magic-number rounding (ties to even). The goal is
//! byte-identical output, which the fixture tests check against `llama-quantize`'s files.

use half::f16;

use crate::error::{GgufError, Result};
use crate::types::{GgmlType, QK_K};

/// Quantizes `values` to `ty`. `values.len()` must be a whole number of blocks.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    quantize_into(ty, values, &mut out)?;
    Ok(out)
}

/// Quantizes `values` to `ty`, appending the bytes to `out`.
pub fn quantize_into(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let block_size = ty.block_size();
    if !ty.can_quantize() {
        return Err(GgufError::UnsupportedType {
            tensor: "f32 data to quantize".to_string(),
            ty,
        });
    }
    if values.len() % block_size != 0 {
        return Err(GgufError::PartialBlock {
            what: "f32 data to quantize".to_string(),
            ty,
            n_elements: values.len(),
            block_size,
        });
    }
    out.reserve(values.len() / block_size * ty.type_size());
    match ty {
        GgmlType::F32 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
        GgmlType::F16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_bits().to_le_bytes())),
        GgmlType::BF16 => values
            .iter()
            .for_each(|v| out.extend_from_slice(&f32_to_bf16(*v).to_le_bytes())),
        GgmlType::Q8_0 => {
            for block in values
                .chunks_exact(32)
                .filter_map(|b| <&[f32; 32]>::try_from(b).ok())
            {
                out.extend_from_slice(&quantize_block_q8_0(block));
            }
        }
        GgmlType::Q4_K => {
            for block in values
                .chunks_exact(QK_K)
                .filter_map(|b| <&[f32; QK_K]>::try_from(b).ok())
            {
                out.extend_from_slice(&quantize_block_q4_k(block));
            }
        }
        GgmlType::Q6_K => {
            for block in values
                .chunks_exact(QK_K)
                .filter_map(|b| <&[f32; QK_K]>::try_from(b).ok())
            {
                out.extend_from_slice(&quantize_block_q6_k(block));
            }
        }
        // `can_quantize` was checked above.
        _ => {
            return Err(GgufError::UnsupportedType {
                tensor: "f32 data to quantize".to_string(),
                ty,
            })
        }
    }
    Ok(())
}

/// f32 → bf16 as ggml rounds it: NaNs stay NaN (forced quiet), everything else rounds to nearest even.
pub fn f32_to_bf16(v: f32) -> u16 {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 64) as u16;
    }
    ((u64::from(bits) + u64::from(0x7fff + ((bits >> 16) & 1))) >> 16) as u16
}

fn fp16_bits(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

fn fp16_round_trip(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Round to nearest, ties to even, by adding 1.5·2^23 (the reference's `nearest_int`; valid for
/// |x| < 2^22, which every caller guarantees for finite data).
#[inline]
fn nearest_int(x: f32) -> i32 {
    let biased = x + 12_582_912.0;
    (biased.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// Q8_0: `d = max|x| / 127`, `q = round(x / d)` (half away from zero, like C's `roundf`).
pub fn quantize_block_q8_0(x: &[f32; 32]) -> [u8; 34] {
    let amax = x
        .iter()
        .fold(0f32, |acc, v| if acc > v.abs() { acc } else { v.abs() });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = [0u8; 34];
    out[..2].copy_from_slice(&fp16_bits(d));
    for (q, v) in out[2..].iter_mut().zip(x) {
        *q = (v * id).round() as i8 as u8;
    }
    out
}

/// Scale and min search of one Q4_K sub-block (the reference's `make_qkx2_quants`): fits
/// `x ≈ scale·L + min` with `L ∈ [0, nmax]`, trying `nstep + 1` candidate scales around the min/max one
/// and keeping the one with the smallest weighted squared error. Returns `(scale, -min)` and leaves the
/// levels in `levels`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants<const N: usize>(
    nmax: i32,
    x: &[f32; N],
    weights: &[f32; N],
    levels: &mut [u8; N],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..N {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        levels.fill(0);
        return (0.0, -min);
    }
    let error_of = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0f32;
    for i in 0..N {
        let l = nearest_int(iscale * (x[i] - min));
        levels[i] = l.clamp(0, nmax) as u8;
        let diff = scale * levels[i] as f32 + min - x[i];
        best_error += weights[i] * error_of(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut aux = [0u8; N];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for i in 0..N {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0f32;
            for i in 0..N {
                let diff = this_scale * aux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * error_of(diff);
            }
            if cur_error < best_error {
                *levels = aux;
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K (the reference's `quantize_row_q4_K_ref`): eight sub-blocks of 32 get a 4-bit level set each from
/// [`make_qkx2_quants`] (weights `rms(x) + |x|`), their scales and mins are quantized to 6 bits against the
/// block's fp16 `d` and `dmin`, and the levels are recomputed with the rounded scales.
pub fn quantize_block_q4_k(x: &[f32; QK_K]) -> [u8; 144] {
    let mut levels = [0u8; QK_K];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut max_scale = 0f32;
    let mut max_min = 0f32;
    for j in 0..8 {
        let mut sub = [0f32; 32];
        sub.copy_from_slice(&x[32 * j..32 * j + 32]);
        let sum_x2 = sub.iter().fold(0f32, |acc, v| acc + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let weights = sub.map(|v| av_x + v.abs());
        let mut sub_levels = [0u8; 32];
        let (scale, min) =
            make_qkx2_quants(15, &sub, &weights, &mut sub_levels, -1.0, 0.1, 20, false);
        levels[32 * j..32 * j + 32].copy_from_slice(&sub_levels);
        scales[j] = scale;
        mins[j] = min;
        if scale > max_scale {
            max_scale = scale;
        }
        if min > max_min {
            max_min = min;
        }
    }

    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // The reference stores nearest_int into a uint8_t before clamping, hence the wrapping cast.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | ((lm & 0x0F) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let d_bits = fp16_bits(max_scale / 63.0);
    let dmin_bits = fp16_bits(max_min / 63.0);
    let d_block = f16::from_bits(u16::from_le_bytes(d_bits)).to_f32();
    let dmin_block = f16::from_bits(u16::from_le_bytes(dmin_bits)).to_f32();

    for j in 0..8 {
        let (sc, m) = crate::blocks::scale_min_k4(j, &packed);
        let d = d_block * sc as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin_block * m as f32;
        for i in 32 * j..32 * j + 32 {
            levels[i] = nearest_int((x[i] + dm) / d).clamp(0, 15) as u8;
        }
    }

    let mut out = [0u8; 144];
    out[0..2].copy_from_slice(&d_bits);
    out[2..4].copy_from_slice(&dmin_bits);
    out[4..16].copy_from_slice(&packed);
    for c in 0..4 {
        for l in 0..32 {
            out[16 + 32 * c + l] = levels[64 * c + l] | (levels[64 * c + 32 + l] << 4);
        }
    }
    out
}

/// Below this a group counts as all zeros (the reference's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// Symmetric scale search of one Q6_K sub-block (the reference's `make_qx_quants` with `rmse_type = 1`
/// and no importance weights): levels `L ∈ [-nmax, nmax)`, weights `x²`, 19 candidate scales. Returns the
/// scale; `levels` get `L + nmax`.
fn make_qx_quants_rmse1<const N: usize>(nmax: i32, x: &[f32; N], levels: &mut [i8; N]) -> f32 {
    let mut max = 0f32;
    let mut amax = 0f32;
    for &v in x {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        levels.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0f32;
    let mut suml2 = 0f32;
    for i in 0..N {
        let l = level(iscale, x[i]);
        levels[i] = (l + nmax) as i8;
        let w = x[i] * x[i];
        let lf = l as f32;
        sumlx += w * x[i] * lf;
        suml2 += w * lf * lf;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let lf = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * lf;
            suml2 += w * lf * lf;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..N {
                levels[i] = (nmax + level(iscale, x[i])) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K (the reference's `quantize_row_q6_K_ref`): sixteen sub-blocks of 16 get a scale each from
/// [`make_qx_quants_rmse1`], the scales are quantized to int8 against the block's fp16 `d`, and the
/// 6-bit levels are recomputed with the rounded scales.
// Follows the reference's own Q6_K function, as `quantize_block_q4_k` follows its Q4_K one: alike in
// their opening, the two differ in sub-block sizes, level search and packing.
pub fn quantize_block_q6_k(x: &[f32; QK_K]) -> [u8; 210] {
    let mut levels = [0i8; QK_K];
    let mut scales = [0f32; 16];
    let mut max_scale = 0f32;
    let mut max_abs_scale = 0f32;
    for ib in 0..16 {
        let mut sub = [0f32; 16];
        sub.copy_from_slice(&x[16 * ib..16 * ib + 16]);
        let mut sub_levels = [0i8; 16];
        let scale = make_qx_quants_rmse1(32, &sub, &mut sub_levels);
        levels[16 * ib..16 * ib + 16].copy_from_slice(&sub_levels);
        scales[ib] = scale;
        let abs_scale = scale.abs();
        if abs_scale > max_abs_scale {
            max_abs_scale = abs_scale;
            max_scale = scale;
        }
    }

    let mut out = [0u8; 210];
    if max_abs_scale < GROUP_MAX_EPS {
        // An all-zero block: every byte zero, d = +0.
        return out;
    }

    let iscale = -128.0 / max_scale;
    let d_bits = fp16_bits(1.0 / iscale);
    let d_block = fp16_round_trip(1.0 / iscale);
    let mut block_scales = [0i8; 16];
    for (s, &scale) in block_scales.iter_mut().zip(&scales) {
        *s = nearest_int(iscale * scale).min(127) as i8;
    }
    for (j, &block_scale) in block_scales.iter().enumerate() {
        let d = d_block * block_scale as f32;
        if d == 0.0 {
            continue;
        }
        for i in 16 * j..16 * j + 16 {
            levels[i] = (nearest_int(x[i] / d).clamp(-32, 31) + 32) as i8;
        }
    }

    let level = |i: usize| levels[i] as u8;
    for half in 0..2 {
        let base = 128 * half;
        for l in 0..32 {
            let (q1, q2, q3, q4) = (
                level(base + l),
                level(base + l + 32),
                level(base + l + 64),
                level(base + l + 96),
            );
            out[64 * half + l] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            out[64 * half + l + 32] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            out[128 + 32 * half + l] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    for (o, s) in out[192..208].iter_mut().zip(&block_scales) {
        *o = *s as u8;
    }
    out[208..210].copy_from_slice(&d_bits);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        // 1 + 2^-8 lies exactly between bf16 1.0 (0x3F80) and 1.0078125 (0x3F81): ties go to even.
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0), 0x3F80);
        // 1 + 3·2^-8 lies between 0x3F81 and 0x3F82: the even one is 0x3F82.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0), 0x3F82);
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0 + 1.0 / 65536.0), 0x3F81);
        assert_eq!(f32_to_bf16(-2.0), 0xC000);
        // A signalling NaN whose payload sits in the low half stays a NaN.
        let nan = f32_to_bf16(f32::from_bits(0x7F80_0001));
        assert_eq!(nan & 0x7F80, 0x7F80);
        assert_ne!(nan & 0x007F, 0);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7F80);
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(nearest_int(0.5), 0);
        assert_eq!(nearest_int(1.5), 2);
        assert_eq!(nearest_int(2.5), 2);
        assert_eq!(nearest_int(-1.5), -2);
        assert_eq!(nearest_int(-0.4), 0);
        assert_eq!(nearest_int(31.49), 31);
    }

    #[test]
    fn all_zero_blocks_quantize_to_zero_and_partial_blocks_are_refused() {
        assert_eq!(quantize_block_q6_k(&[0.0; QK_K]), [0u8; 210]);
        let q4 = quantize_block_q4_k(&[0.0; QK_K]);
        assert!(q4.iter().all(|&b| b == 0));
        assert_eq!(quantize_block_q8_0(&[0.0; 32]), [0u8; 34]);
        assert!(matches!(
            quantize(GgmlType::Q4_K, &[0.0; 255]),
            Err(GgufError::PartialBlock { .. })
        ));
        assert!(matches!(
            quantize(GgmlType::Q5_K, &[0.0; 256]),
            Err(GgufError::UnsupportedType { .. })
        ));
    }
}
