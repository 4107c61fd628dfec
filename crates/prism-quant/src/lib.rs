//! W8A8 int8 and W4A8 formats and the exact integer matmuls.
//!
//! Not built yet: the int8 path is a later issue. This crate exists so that the layering
//! (gguf → quant → model → decision → server/cli) is fixed from the start.
