//! The one error type of the crate. Every variant names what is wrong: which key, which tensor, which
//! field, at which byte offset.

use std::path::PathBuf;

use crate::GgmlType;

/// Everything that can go wrong reading, dequantizing or writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("GGUF write failed: {source}")]
    Write {
        #[source]
        source: std::io::Error,
    },

    #[error("truncated GGUF: {what} at byte offset {offset} needs {needed} bytes, only {available} remain")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\" (47 47 55 46)")]
    BadMagic { found: [u8; 4] },

    #[error("unsupported GGUF version {version} (this reader handles versions 2 and 3)")]
    UnsupportedVersion { version: u32 },

    #[error("GGUF file is big-endian (version field reads {raw:#010x}, byte-swapped {swapped}); only little-endian files are supported")]
    BigEndian { raw: u32, swapped: u32 },

    #[error("metadata key {key:?} (at byte offset {offset}): unknown value type id {type_id}")]
    InvalidValueType {
        key: String,
        offset: u64,
        type_id: u32,
    },

    #[error("tensor {tensor:?}: unknown ggml type id {type_id}")]
    InvalidType { tensor: String, type_id: u32 },

    #[error("unknown ggml type id {type_id}")]
    UnknownTypeId { type_id: u32 },

    #[error("metadata key {key:?} (at byte offset {offset}): arrays nested deeper than {max_depth} levels")]
    NestingTooDeep {
        key: String,
        offset: u64,
        max_depth: usize,
    },

    #[error("metadata key {key:?}: bool byte at offset {offset} is {byte:#04x}, expected 0 or 1")]
    InvalidBool { key: String, offset: u64, byte: u8 },

    #[error("metadata key {key:?} appears more than once")]
    DuplicateKey { key: String },

    #[error("tensor name {name:?} appears more than once")]
    DuplicateTensor { name: String },

    #[error("tensor {tensor:?} has {n_dims} dimensions; at most 4 are allowed")]
    TooManyDims { tensor: String, n_dims: u32 },

    #[error("tensor {tensor:?}: dimension {index} is {value}; every dimension must be between 1 and 2^63-1")]
    BadDimension {
        tensor: String,
        index: usize,
        value: u64,
    },

    #[error("tensor {tensor:?}: element count or byte size overflows")]
    SizeOverflow { tensor: String },

    #[error(
        "tensor {tensor:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },

    #[error("tensor {tensor:?}: data [{start}, {end}) lies outside the file ({file_len} bytes)")]
    OutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error("tensors {first:?} and {second:?} overlap in the data section")]
    Overlap { first: String, second: String },

    #[error("tensor {tensor:?}: row length ne0 = {ne0} is not a multiple of the {ty} block size {block_size}")]
    NotBlockMultiple {
        tensor: String,
        ty: GgmlType,
        ne0: u64,
        block_size: usize,
    },

    #[error("{what} at byte offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    #[error("general.alignment is {value}; it must be a non-zero power-of-two u32")]
    BadAlignment { value: String },

    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },

    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },

    #[error("tensor {tensor:?}: row {row} is out of range (it has {n_rows} rows)")]
    RowOutOfRange {
        tensor: String,
        row: u64,
        n_rows: u64,
    },

    #[error("no tensor named {name:?}")]
    UnknownTensor { name: String },

    #[error("tensor {tensor:?}: ggml type {ty} is not supported here")]
    UnsupportedType { tensor: String, ty: GgmlType },

    #[error("{what}: {ty} data of {n_elements} elements needs {expected} bytes, got {actual}")]
    ByteLength {
        what: String,
        ty: GgmlType,
        n_elements: usize,
        expected: usize,
        actual: usize,
    },

    #[error("{what}: {n_elements} elements is not a multiple of the {ty} block size {block_size}")]
    PartialBlock {
        what: String,
        ty: GgmlType,
        n_elements: usize,
        block_size: usize,
    },

    #[error("GGUF writer: {message}")]
    Writer { message: String },
}

/// Shorthand used throughout the crate.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
