//! ggml block formats: dequantization to f32.
//!
//! Each `dequantize_row_*` function reproduces ggml's reference `dequantize_row_*` (ggml-quants.c) bit for
//! bit: the same f32 operations in the same order, never fused (Rust does not contract `a*b - c` into an
//! FMA). For example the K-quants compute `d1 = d*sc` and `m1 = dmin*m` once per sub-block and then
//! `d1*q - m1` per element, and Q6_K computes `(d*sc)*q`.
//!
//! The row functions take whole blocks: they convert `min(bytes / type_size, out / block_size)` blocks and
//! leave the rest untouched. [`dequantize`] and [`dequantize_into`] check the lengths first and are the
//! entry points for data that comes from a file.

use half::f16;

use crate::error::{GgufError, Result};
use crate::types::{GgmlType, QK_K};

/// Dequantizes `n_elements` values of type `ty` held in `bytes` (which must be exactly their size).
pub fn dequantize(ty: GgmlType, bytes: &[u8], n_elements: usize) -> Result<Vec<f32>> {
    dequantize_named("data", ty, bytes, n_elements)
}

/// Dequantizes into `out`; `bytes` must hold exactly `out.len()` values of type `ty`.
pub fn dequantize_into(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    dequantize_into_named("data", ty, bytes, out)
}

pub(crate) fn dequantize_named(
    what: &str,
    ty: GgmlType,
    bytes: &[u8],
    n_elements: usize,
) -> Result<Vec<f32>> {
    // Lengths are checked before the output is allocated, so a wrong count cannot allocate more than
    // the input bytes justify.
    check_lengths(what, ty, bytes.len(), n_elements)?;
    let mut out = vec![0f32; n_elements];
    dequantize_into_named(what, ty, bytes, &mut out)?;
    Ok(out)
}

fn dequantize_into_named(what: &str, ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    check_lengths(what, ty, bytes.len(), out.len())?;
    match ty {
        GgmlType::F32 => dequantize_row_f32(bytes, out),
        GgmlType::F16 => dequantize_row_f16(bytes, out),
        GgmlType::BF16 => dequantize_row_bf16(bytes, out),
        GgmlType::Q4_0 => dequantize_row_q4_0(bytes, out),
        GgmlType::Q4_1 => dequantize_row_q4_1(bytes, out),
        GgmlType::Q5_0 => dequantize_row_q5_0(bytes, out),
        GgmlType::Q5_1 => dequantize_row_q5_1(bytes, out),
        GgmlType::Q8_0 => dequantize_row_q8_0(bytes, out),
        GgmlType::Q2_K => dequantize_row_q2_k(bytes, out),
        GgmlType::Q3_K => dequantize_row_q3_k(bytes, out),
        GgmlType::Q4_K => dequantize_row_q4_k(bytes, out),
        GgmlType::Q5_K => dequantize_row_q5_k(bytes, out),
        GgmlType::Q6_K => dequantize_row_q6_k(bytes, out),
        other => {
            return Err(GgufError::UnsupportedType {
                tensor: what.to_string(),
                ty: other,
            })
        }
    }
    Ok(())
}

/// `n_elements` must be whole blocks and `n_bytes` exactly their size.
fn check_lengths(what: &str, ty: GgmlType, n_bytes: usize, n_elements: usize) -> Result<()> {
    let block_size = ty.block_size();
    if n_elements % block_size != 0 {
        return Err(GgufError::PartialBlock {
            what: what.to_string(),
            ty,
            n_elements,
            block_size,
        });
    }
    let expected = (n_elements / block_size).checked_mul(ty.type_size());
    if expected != Some(n_bytes) {
        return Err(GgufError::ByteLength {
            what: what.to_string(),
            ty,
            n_elements,
            expected: expected.unwrap_or(usize::MAX),
            actual: n_bytes,
        });
    }
    Ok(())
}

#[inline]
fn fp16(lo: u8, hi: u8) -> f32 {
    f16::from_bits(u16::from_le_bytes([lo, hi])).to_f32()
}

/// Pairs each block of `bytes` (as a fixed-size array, so indexing inside it is checked at compile time)
/// with its `QK` outputs.
#[inline]
fn blocks_mut<'a, const BYTES: usize, const QK: usize>(
    bytes: &'a [u8],
    out: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8; BYTES], &'a mut [f32; QK])> {
    bytes
        .chunks_exact(BYTES)
        .zip(out.chunks_exact_mut(QK))
        .filter_map(|(b, y)| {
            let b: &[u8; BYTES] = b.try_into().ok()?;
            let y: &mut [f32; QK] = y.try_into().ok()?;
            Some((b, y))
        })
}

pub fn dequantize_row_f32(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<4, 1>(bytes, out) {
        y[0] = f32::from_le_bytes(*b);
    }
}

pub fn dequantize_row_f16(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<2, 1>(bytes, out) {
        y[0] = fp16(b[0], b[1]);
    }
}

/// bf16 is the upper half of an f32.
pub fn dequantize_row_bf16(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<2, 1>(bytes, out) {
        y[0] = f32::from_bits(u32::from(u16::from_le_bytes(*b)) << 16);
    }
}

/// Q4_0: d @0, qs[16] @2; `x = (nibble - 8) * d`.
pub fn dequantize_row_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<18, 32>(bytes, out) {
        let d = fp16(b[0], b[1]);
        for j in 0..16 {
            let q = b[2 + j];
            y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            y[j + 16] = ((q >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// Q4_1: d @0, m @2, qs[16] @4; `x = nibble * d + m`.
pub fn dequantize_row_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<20, 32>(bytes, out) {
        let d = fp16(b[0], b[1]);
        let m = fp16(b[2], b[3]);
        for j in 0..16 {
            let q = b[4 + j];
            y[j] = (q & 0x0F) as f32 * d + m;
            y[j + 16] = (q >> 4) as f32 * d + m;
        }
    }
}

/// Elements `j` and `j + 16` of a Q5_0 or Q5_1 block (`j < 16`): the nibbles of `q` with their fifth
/// bits, bits `j` and `j + 16` of `qh`.
fn q5_pair(q: u8, qh: u32, j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) & 1) as u8;
    let h1 = ((qh >> (j + 16)) & 1) as u8;
    ((q & 0x0F) | (h0 << 4), (q >> 4) | (h1 << 4))
}

/// Q5_0: d @0, qh u32 @2, qs[16] @6; fifth bit of element j is bit j of qh; `x = (q - 16) * d`.
pub fn dequantize_row_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<22, 32>(bytes, out) {
        let d = fp16(b[0], b[1]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        for j in 0..16 {
            let (lo, hi) = q5_pair(b[6 + j], qh, j);
            y[j] = (lo as i32 - 16) as f32 * d;
            y[j + 16] = (hi as i32 - 16) as f32 * d;
        }
    }
}

/// Q5_1: d @0, m @2, qh u32 @4, qs[16] @8; `x = q * d + m`.
pub fn dequantize_row_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<24, 32>(bytes, out) {
        let d = fp16(b[0], b[1]);
        let m = fp16(b[2], b[3]);
        let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
        for j in 0..16 {
            let (lo, hi) = q5_pair(b[8 + j], qh, j);
            y[j] = lo as f32 * d + m;
            y[j + 16] = hi as f32 * d + m;
        }
    }
}

/// Q8_0: d @0, qs int8[32] @2; `x = q * d`.
pub fn dequantize_row_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<34, 32>(bytes, out) {
        let d = fp16(b[0], b[1]);
        for j in 0..32 {
            y[j] = (b[2 + j] as i8) as f32 * d;
        }
    }
}

/// Q2_K: scales[16] @0 (low nibble scale, high nibble min), qs[64] @16, d @80, dmin @82.
pub fn dequantize_row_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<84, QK_K>(bytes, out) {
        let d = fp16(b[80], b[81]);
        let dmin = fp16(b[82], b[83]);
        let mut is = 0;
        let mut o = 0;
        for half in 0..2 {
            let q = &b[16 + 32 * half..16 + 32 * half + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let sc = b[is];
                    is += 1;
                    let dl = d * (sc & 0x0F) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    for &qb in &q[16 * part..16 * part + 16] {
                        y[o] = dl * ((qb >> shift) & 3) as f32 - ml;
                        o += 1;
                    }
                }
            }
        }
    }
}

/// Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96 (16 six-bit signed scales), d @108.
pub fn dequantize_row_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<110, QK_K>(bytes, out) {
        let d_all = fp16(b[108], b[109]);
        let packed = &b[96..108];
        let mut scales = [0i32; 16];
        for (j, s) in scales.iter_mut().enumerate() {
            let low = if j < 8 {
                packed[j] & 0x0F
            } else {
                packed[j - 8] >> 4
            };
            let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
            *s = i32::from(low | (high << 4)) - 32;
        }
        let hmask = &b[0..32];
        let mut is = 0;
        let mut o = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &b[32 + 32 * half..32 + 32 * half + 32];
            for shift in [0u32, 2, 4, 6] {
                for part in 0..2 {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in 16 * part..16 * part + 16 {
                        let low = ((q[l] >> shift) & 3) as i32;
                        let sub = if hmask[l] & m != 0 { 0 } else { 4 };
                        y[o] = dl * (low - sub) as f32;
                        o += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block's 12 packed scale bytes.
#[inline]
pub fn scale_min_k4(j: usize, packed: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (packed[j] & 63, packed[j + 4] & 63)
    } else {
        let j = j & 7;
        (
            (packed[j + 4] & 0x0F) | ((packed[j - 4] >> 6) << 4),
            (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4),
        )
    }
}

/// The scale and min of both halves of 64-value chunk `c` of a Q4_K or Q5_K block: `d·sc` and `dmin·m`.
fn chunk_scales(c: usize, d: f32, dmin: f32, packed: &[u8; 12]) -> [(f32, f32); 2] {
    [2 * c, 2 * c + 1].map(|j| {
        let (sc, m) = scale_min_k4(j, packed);
        (d * sc as f32, dmin * m as f32)
    })
}

fn k4_scales(b: &[u8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    packed.copy_from_slice(&b[4..16]);
    packed
}

/// Q4_K: d @0, dmin @2, scales[12] @4, qs[128] @16. Four chunks of 64: low nibbles of 32 bytes, then
/// their high nibbles, each with its own scale and min.
pub fn dequantize_row_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<144, QK_K>(bytes, out) {
        let d = fp16(b[0], b[1]);
        let dmin = fp16(b[2], b[3]);
        let packed = k4_scales(b);
        for c in 0..4 {
            let [(d1, m1), (d2, m2)] = chunk_scales(c, d, dmin, &packed);
            let q = &b[16 + 32 * c..16 + 32 * c + 32];
            let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
            for l in 0..32 {
                lo[l] = d1 * (q[l] & 0x0F) as f32 - m1;
                hi[l] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

/// Q5_K: d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48. As Q4_K with a fifth bit from qh.
pub fn dequantize_row_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<176, QK_K>(bytes, out) {
        let d = fp16(b[0], b[1]);
        let dmin = fp16(b[2], b[3]);
        let packed = k4_scales(b);
        let qh = &b[16..48];
        for c in 0..4 {
            let [(d1, m1), (d2, m2)] = chunk_scales(c, d, dmin, &packed);
            let u1 = 1u8 << (2 * c);
            let u2 = 2u8 << (2 * c);
            let ql = &b[48 + 32 * c..48 + 32 * c + 32];
            let (lo, hi) = y[64 * c..64 * c + 64].split_at_mut(32);
            for l in 0..32 {
                let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
                lo[l] = d1 * ((ql[l] & 0x0F) + h1) as f32 - m1;
                hi[l] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
        }
    }
}

/// Q6_K: ql[128] @0, qh[64] @128, scales int8[16] @192, d @208 (last). Two halves of 128 elements; 16
/// consecutive outputs share one scale; `x = (d * sc) * (q - 32)`.
pub fn dequantize_row_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (b, y) in blocks_mut::<210, QK_K>(bytes, out) {
        let d = fp16(b[208], b[209]);
        for n in 0..2 {
            let ql = &b[64 * n..64 * n + 64];
            let qh = &b[128 + 32 * n..128 + 32 * n + 32];
            let sc = &b[192 + 8 * n..192 + 8 * n + 8];
            let y = &mut y[128 * n..128 * n + 128];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
                y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
                y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
                y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_lengths_are_typed_errors() {
        // The error of `n` values of type `ty` from `bytes` zero bytes.
        let error = |ty, bytes: usize, n| dequantize(ty, &vec![0u8; bytes], n).unwrap_err();
        assert!(matches!(
            error(GgmlType::Q8_0, 34, 31),
            GgufError::PartialBlock { .. }
        ));
        for (ty, bytes, n) in [
            (GgmlType::Q8_0, 33, 32),
            (GgmlType::Q4_K, 145, 256),
            (GgmlType::F32, 8, usize::MAX),
        ] {
            assert!(matches!(error(ty, bytes, n), GgufError::ByteLength { .. }));
        }
        assert!(matches!(
            error(GgmlType::IQ2_XXS, 66, 256),
            GgufError::UnsupportedType { .. }
        ));
    }

    #[test]
    fn q8_0_block_by_hand() {
        // d = 0.5 (f16 0x3800), q = -128..=-97 → x = q/2.
        let mut block = vec![0x00, 0x38];
        block.extend((0..32).map(|j| (-128i32 + j) as i8 as u8));
        let y = dequantize(GgmlType::Q8_0, &block, 32).unwrap();
        for (j, v) in y.iter().enumerate() {
            assert_eq!(*v, (-128.0 + j as f32) * 0.5);
        }
    }

    #[test]
    fn q4_k_scale_unpack_follows_the_bit_layout() {
        // Sub-block 5: scale = low nibble of byte 9 | (top two bits of byte 1) << 4,
        //              min   = high nibble of byte 9 | (top two bits of byte 5) << 4.
        let mut packed = [0u8; 12];
        packed[1] = 0b10_000000;
        packed[5] = 0b01_000000;
        packed[9] = 0x3A;
        assert_eq!(
            scale_min_k4(5, &packed),
            (0x0A | (0b10 << 4), 0x03 | (0b01 << 4))
        );
        packed[2] = 0b00_111111;
        packed[6] = 0b00_101010;
        assert_eq!(scale_min_k4(2, &packed), (63, 42));
    }
}
