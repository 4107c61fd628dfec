//! The crate's error type. Every variant names what is wrong: which tensor, which row, which value.

use prism_gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum QuantError {
    #[error(
        "tensor {tensor:?} is {ty:?}: the integer path runs Q8_0, Q4_K, Q5_K and Q6_K weights \
         (float tensors stay on the float matmul)"
    )]
    UnsupportedType { tensor: String, ty: GgmlType },

    #[error(
        "tensor {tensor:?}: a row of {cols} elements is not a whole number of {ty:?} blocks of {block}"
    )]
    PartialBlock {
        tensor: String,
        ty: GgmlType,
        cols: usize,
        block: usize,
    },

    #[error(
        "tensor {tensor:?}: {rows} rows of {cols} {ty:?} elements need {expected} bytes, got {actual}"
    )]
    ByteLength {
        tensor: String,
        ty: GgmlType,
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },

    #[error("tensor {tensor:?}: size overflows ({rows} rows of {cols} elements)")]
    SizeOverflow {
        tensor: String,
        rows: usize,
        cols: usize,
    },

    #[error("tensor {tensor:?}: row {row} does not exist ({rows} rows)")]
    RowOutOfRange {
        tensor: String,
        row: usize,
        rows: usize,
    },

    #[error("cannot concatenate the rows of {first:?} ({first_format:?}) and {other:?} ({other_format:?}): one fused weight has one format")]
    ConcatFormat {
        first: String,
        first_format: crate::weight::WeightFormat,
        other: String,
        other_format: crate::weight::WeightFormat,
    },

    #[error("cannot concatenate the rows of {first:?} ({first_cols} inputs) and {other:?} ({other_cols} inputs): the inputs differ")]
    ConcatCols {
        first: String,
        first_cols: usize,
        other: String,
        other_cols: usize,
    },

    #[error("concatenating rows: no weights given")]
    ConcatEmpty,

    #[error("tensor {tensor:?}: row {row}, the Q8_0 block at element {col} has the scale {value} (not finite)")]
    NonFiniteScale {
        tensor: String,
        row: usize,
        col: usize,
        value: f32,
    },

    #[error(
        "activation row {row}, element {col} is {value}: int8 quantization needs finite inputs"
    )]
    NonFiniteActivation { row: usize, col: usize, value: f32 },

    #[error("int8 matmul: the input has {found} elements per row, the weight {tensor:?} takes {expected}")]
    InputWidth {
        tensor: String,
        expected: usize,
        found: usize,
    },

    #[error("int8 matmul: {0}")]
    Input(String),
}

pub type Result<T, E = QuantError> = std::result::Result<T, E>;
