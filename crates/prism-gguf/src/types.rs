//! ggml tensor types: ids as stored in GGUF, block geometry, names.

use std::fmt;

use crate::error::{GgufError, Result};

/// A ggml tensor type, as stored in a GGUF tensor-info record.
///
/// All ids that current ggml defines are known so that a file using an exotic type still opens (its
/// tensors fail only when dequantized). Ids ggml retired (4, 5, 31–33) are rejected.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    I8,
    I16,
    I32,
    I64,
    F64,
    IQ1_M,
    BF16,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
    Q1_0,
}

/// Super-block size of the K-quants.
pub const QK_K: usize = 256;

/// (type, id, elements per block, bytes per block, name). Geometry as in ggml's type traits. Rows of
/// data, alike in shape by nature.
const TYPE_TABLE: &[(GgmlType, u32, usize, usize, &str)] = &[
    (GgmlType::F32, 0, 1, 4, "F32"),
    (GgmlType::F16, 1, 1, 2, "F16"),
    (GgmlType::Q4_0, 2, 32, 18, "Q4_0"),
    (GgmlType::Q4_1, 3, 32, 20, "Q4_1"),
    (GgmlType::Q5_0, 6, 32, 22, "Q5_0"),
    (GgmlType::Q5_1, 7, 32, 24, "Q5_1"),
    (GgmlType::Q8_0, 8, 32, 34, "Q8_0"),
    (GgmlType::Q8_1, 9, 32, 36, "Q8_1"),
    (GgmlType::Q2_K, 10, QK_K, 84, "Q2_K"),
    (GgmlType::Q3_K, 11, QK_K, 110, "Q3_K"),
    (GgmlType::Q4_K, 12, QK_K, 144, "Q4_K"),
    (GgmlType::Q5_K, 13, QK_K, 176, "Q5_K"),
    (GgmlType::Q6_K, 14, QK_K, 210, "Q6_K"),
    (GgmlType::Q8_K, 15, QK_K, 292, "Q8_K"),
    (GgmlType::IQ2_XXS, 16, QK_K, 66, "IQ2_XXS"),
    (GgmlType::IQ2_XS, 17, QK_K, 74, "IQ2_XS"),
    (GgmlType::IQ3_XXS, 18, QK_K, 98, "IQ3_XXS"),
    (GgmlType::IQ1_S, 19, QK_K, 50, "IQ1_S"),
    (GgmlType::IQ4_NL, 20, 32, 18, "IQ4_NL"),
    (GgmlType::IQ3_S, 21, QK_K, 110, "IQ3_S"),
    (GgmlType::IQ2_S, 22, QK_K, 82, "IQ2_S"),
    (GgmlType::IQ4_XS, 23, QK_K, 136, "IQ4_XS"),
    (GgmlType::I8, 24, 1, 1, "I8"),
    (GgmlType::I16, 25, 1, 2, "I16"),
    (GgmlType::I32, 26, 1, 4, "I32"),
    (GgmlType::I64, 27, 1, 8, "I64"),
    (GgmlType::F64, 28, 1, 8, "F64"),
    (GgmlType::IQ1_M, 29, QK_K, 56, "IQ1_M"),
    (GgmlType::BF16, 30, 1, 2, "BF16"),
    (GgmlType::TQ1_0, 34, QK_K, 54, "TQ1_0"),
    (GgmlType::TQ2_0, 35, QK_K, 66, "TQ2_0"),
    (GgmlType::MXFP4, 39, 32, 17, "MXFP4"),
    (GgmlType::NVFP4, 40, 64, 36, "NVFP4"),
    (GgmlType::Q1_0, 41, 128, 18, "Q1_0"),
];

impl GgmlType {
    /// Every known type, in id order.
    pub fn all() -> impl Iterator<Item = GgmlType> {
        TYPE_TABLE.iter().map(|row| row.0)
    }

    fn row(self) -> &'static (GgmlType, u32, usize, usize, &'static str) {
        // The table lists every variant exactly once (checked by a unit test), so the search cannot miss;
        // the fallback row only keeps this function total.
        TYPE_TABLE
            .iter()
            .find(|row| row.0 == self)
            .unwrap_or(&TYPE_TABLE[0])
    }

    /// The type with GGUF/ggml id `v`.
    pub fn from_u32(v: u32) -> Result<Self> {
        TYPE_TABLE
            .iter()
            .find(|row| row.1 == v)
            .map(|row| row.0)
            .ok_or(GgufError::UnknownTypeId { type_id: v })
    }

    /// The GGUF/ggml id.
    pub fn as_u32(self) -> u32 {
        self.row().1
    }

    /// Elements per block.
    pub fn block_size(self) -> usize {
        self.row().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.row().3
    }

    /// ggml's name, e.g. `"Q4_K"`.
    pub fn name(self) -> &'static str {
        self.row().4
    }

    /// Parses ggml's name (`"Q8_0"`, case-insensitive).
    pub fn from_name(name: &str) -> Option<Self> {
        TYPE_TABLE
            .iter()
            .find(|row| row.4.eq_ignore_ascii_case(name))
            .map(|row| row.0)
    }

    /// Whether [`crate::blocks::dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K
        )
    }

    /// Whether [`crate::quantize::quantize`] can produce this type from f32 data.
    pub fn can_quantize(self) -> bool {
        use GgmlType::*;
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_K | Q6_K)
    }

    /// Bytes taken by `n_elements` elements, or `None` if `n_elements` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if n_elements % bs != 0 {
            return None;
        }
        (n_elements / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_ids_and_names_are_unique_and_round_trip() {
        for (i, row) in TYPE_TABLE.iter().enumerate() {
            for other in &TYPE_TABLE[i + 1..] {
                assert_ne!(row.0, other.0);
                assert_ne!(row.1, other.1);
                assert_ne!(row.4, other.4);
            }
            assert_eq!(GgmlType::from_u32(row.1).unwrap(), row.0);
            assert_eq!(row.0.as_u32(), row.1);
            assert_eq!(GgmlType::from_name(row.4), Some(row.0));
        }
        for retired in [4u32, 5, 31, 32, 33, 36, 1000] {
            assert!(
                matches!(GgmlType::from_u32(retired), Err(GgufError::UnknownTypeId { type_id }) if type_id == retired)
            );
        }
    }

    #[test]
    fn geometry_matches_the_reference_block_layouts() {
        // Byte layouts of qwen35-reference.md §5: (type, values a block, bytes a block).
        for (ty, block, bytes) in [
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q4_K, 256, 144),
            (GgmlType::Q5_K, 256, 176),
            (GgmlType::Q6_K, 256, 210),
        ] {
            assert_eq!((ty.block_size(), ty.type_size()), (block, bytes), "{ty:?}");
        }
        assert_eq!(GgmlType::BF16.as_u32(), 30);
    }
}
