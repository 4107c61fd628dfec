//! GGUF reading, ggml block formats and GGUF writing.
//!
//! - [`GgufFile`] memory-maps a GGUF (v2 or v3), validates every count, length, dimension and offset
//!   before use, and hands out metadata, tensor infos and tensor bytes.
//! - [`blocks`] dequantizes ggml block formats to f32 exactly as ggml's reference code does.
//! - [`GgufWriter`] streams GGUF v3 files: header first, then tensor data piece by piece.
//! - [`quantize`] reproduces llama.cpp's reference quantizers (Q8_0, Q4_K, Q6_K; F16/BF16 rounding).
//!
//! Shapes are in ggml `ne` order throughout: `dims[0]` is the contiguous (row) dimension.

pub mod blocks;
mod error;
pub mod info;
mod metadata;
pub mod quantize;
mod reader;
mod types;
mod writer;

pub use error::{GgufError, Result};
pub use metadata::{MetadataType, MetadataValue};
pub use reader::{GgufFile, TensorInfo, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS};
pub use types::{GgmlType, QK_K};
pub use writer::{GgufWriter, TensorDataWriter, GGUF_WRITE_VERSION};
