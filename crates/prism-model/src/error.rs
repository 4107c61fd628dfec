//! The crate's error type. Every variant names what is wrong: which key, tensor, field or prompt.

use std::path::PathBuf;

use prism_gguf::GgufError;

pub type Result<T, E = ModelError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),

    #[error("tensor {name:?}: {source}")]
    TensorRead {
        name: String,
        #[source]
        source: GgufError,
    },

    #[error("GGUF architecture is {found:?}; this decoder runs \"qwen35\" (dense Qwen3.5)")]
    UnsupportedArchitecture { found: String },

    #[error("metadata key {key:?} is missing")]
    MissingMetadata { key: String },

    // Variants of a name and a reason, alike in shape: each says what failed in its own words.
    #[error("metadata key {key:?}: {reason}")]
    BadMetadata { key: String, reason: String },

    #[error("invalid model configuration: {field}: {reason}")]
    InvalidConfig { field: String, reason: String },

    #[error("cannot use config.json {path}: {reason}")]
    ConfigJson { path: PathBuf, reason: String },

    #[error("config.json disagrees with the GGUF on {field}: GGUF has {gguf}, config.json has {config_json}")]
    ConfigMismatch {
        field: String,
        gguf: String,
        config_json: String,
    },

    #[error("tensor {name:?} is missing from the GGUF")]
    MissingTensor { name: String },

    #[error("tensor {name:?} has shape {found:?} (ggml ne order), expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },

    #[error("tensor {name:?}: dequantized to {found} values, expected {expected}")]
    DequantizedLength {
        name: String,
        expected: usize,
        found: usize,
    },

    /// A layer whose loading did not end with a result of its own (the loader panicked, or its worker
    /// thread was lost); errors of the layer's tensors are reported as themselves.
    #[error("decoder layer {layer} could not be loaded: {reason}")]
    LayerLoad { layer: usize, reason: String },

    #[error("prompt {index} has no tokens")]
    EmptyPrompt { index: usize },

    #[error("prompt {index}, token {position}: id {token} is outside the vocabulary (size {vocab_size})")]
    TokenOutOfRange {
        index: usize,
        position: usize,
        token: u32,
        vocab_size: usize,
    },

    #[error("output row id {row} is outside the vocabulary (size {vocab_size})")]
    RowOutOfRange { row: u32, vocab_size: usize },

    #[error("invalid input: {0}")]
    InvalidInput(String),

    #[error(
        "unsupported precision {0:?}: use \"auto\", \"int8\", \"w4a8\", \"bf16\", \"f32\" or \"f64\""
    )]
    UnsupportedPrecision(String),

    #[error("precision {precision} cannot run tensor {name:?}: {reason}")]
    PrecisionMismatch {
        precision: String,
        name: String,
        reason: String,
    },

    #[error("tensor {name:?}: {source}")]
    Quant {
        name: String,
        #[source]
        source: prism_quant::QuantError,
    },

    /// A feature the device or build cannot run (e.g. `--kv-fp8` on a GPU below compute capability
    /// 8.9); the message says what and why.
    #[error("{0}")]
    Unsupported(String),

    /// An image's patch grid the vision tower cannot run (`[t, h, w]` in patches).
    #[error("image grid {grid:?} (t, h, w in patches): {reason}")]
    ImageGrid { grid: [usize; 3], reason: String },

    /// An image's pixel values whose shape is not the one its grid needs.
    #[error("image pixels have shape {found:?}; the grid {grid:?} needs {expected:?}")]
    ImagePixels {
        grid: [usize; 3],
        expected: [usize; 2],
        found: Vec<usize>,
    },

    /// Image pad runs of a prompt that do not match the images' embeddings (count or length).
    #[error("image pads: {reason}")]
    ImagePads { reason: String },

    /// A batch item's input-embedding rows that cannot replace its token embeddings.
    #[error("prompt {index}: embedding rows: {reason}")]
    EmbeddingRows { index: usize, reason: String },

    #[error(transparent)]
    Hf(#[from] crate::hf::HfError),

    #[error("tensor computation failed: {0}")]
    Candle(#[from] candle_core::Error),
}
