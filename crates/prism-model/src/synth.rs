//! Random-weight Qwen3.5 models with the real shapes (0.8B … 27B), written as llama.cpp would write them.
//!
//! A [`SynthSpec`] names a released size ([`SynthSize`]), a file type ([`SynthFileType`]: BF16, Q8_0 or
//! Q4_K_M), a seed and optionally fewer layers. [`SynthSpec::tensors`] lists every tensor a llama.cpp
//! `qwen35` GGUF of that size has — real names, dims (ggml order) and storage types, including the
//! Q4_K / Q6_K mix `llama-quantize` picks for Q4_K_M — in `llama-quantize`'s order (non-block tensors by
//! name, then each block in layer order with its tensors by name). [`SynthSpec::metadata`] gives the
//! `general.*` / `qwen35.*` keys; the tokenizer keys come from the caller (prism-decision builds them).
//!
//! [`write_gguf`] streams the file: the tensors are cut into fixed chunks, a batch of chunks is generated
//! and quantized in parallel (rayon), and a writer thread appends the finished bytes through
//! [`prism_gguf::GgufWriter`] while the next batch is computed. Nothing larger than a batch is in memory,
//! so a 27B BF16 file (54 GB) can be written on a machine with less RAM than that.
//!
//! Values are a pure function of (seed, tensor name, element index): a counter-based generator
//! (SplitMix64's finalizer over `key + i·γ`) gives each element its own 64-bit hash, so the bytes do not
//! depend on the chunk size, the batch size or the number of threads.
//!
//! The weights are drawn like an initialization, so that a forward pass stays finite and its softmax is
//! neither flat nor one-hot: matrices ~ N(0, 0.02²) (Irwin–Hall sum of four uniforms, ±3.5σ), the
//! stored RMSNorm scales (`1 + w` in GGUF) ~ N(1, 0.02²), the DeltaNet conv taps U(−0.5, 0.5) (PyTorch's
//! default bound for 4 taps), `ssm_a = −A` with `A ~ U(1, 16)` (transformers' `A_log` init) and
//! `ssm_dt.bias = softplus⁻¹(dt)` with `dt` log-uniform in [0.001, 0.1] (Mamba's `dt` init).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;

use prism_gguf::{GgmlType, GgufError, GgufWriter, MetadataValue};
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::{interval_layer_kinds, LayerKind, Qwen35Config, ARCHITECTURE};

/// What can go wrong describing or writing a synthetic model.
#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("unknown model size {0:?} (known: 0.8b, 2b, 4b, 9b, 27b)")]
    UnknownSize(String),
    #[error("unknown file type {0:?} (known: bf16, q8_0, q4_k_m)")]
    UnknownFileType(String),
    #[error("invalid synthetic model: {field}: {reason}")]
    InvalidSpec { field: &'static str, reason: String },
    #[error("cannot create {path}: {source}")]
    Create {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("the writer thread stopped without a result")]
    WriterLost,
}

/// The released dense Qwen3.5 sizes (qwen35-reference §1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthSize {
    B0_8,
    B2,
    B4,
    B9,
    B27,
}

impl SynthSize {
    pub const ALL: [SynthSize; 5] = [Self::B0_8, Self::B2, Self::B4, Self::B9, Self::B27];

    /// `0.8b`, `2b`, `4b`, `9b`, `27b` (case-insensitive, the `b` optional).
    pub fn parse(s: &str) -> Result<Self, SynthError> {
        let lower = s.trim().to_ascii_lowercase();
        let bare = lower.strip_suffix('b').unwrap_or(&lower);
        Self::ALL
            .into_iter()
            .find(|size| size.label().trim_end_matches('B') == bare)
            .ok_or_else(|| SynthError::UnknownSize(s.to_string()))
    }

    /// The size label as Qwen writes it (`0.8B`).
    pub fn label(self) -> &'static str {
        match self {
            Self::B0_8 => "0.8B",
            Self::B2 => "2B",
            Self::B4 => "4B",
            Self::B9 => "9B",
            Self::B27 => "27B",
        }
    }

    /// (hidden, layers, ffn, attention heads, KV heads, DeltaNet value heads, tied embeddings).
    fn widths(self) -> (usize, usize, usize, usize, usize, usize, bool) {
        match self {
            Self::B0_8 => (1024, 24, 3584, 8, 2, 16, true),
            Self::B2 => (2048, 24, 6144, 8, 2, 16, true),
            Self::B4 => (2560, 32, 9216, 16, 4, 32, true),
            Self::B9 => (4096, 32, 12288, 16, 4, 32, false),
            Self::B27 => (5120, 64, 17408, 24, 4, 48, false),
        }
    }

    /// Whether the output head is the embedding matrix (no `output.weight`).
    pub fn tied_embeddings(self) -> bool {
        self.widths().6
    }

    /// The decoder configuration of this size, all layers.
    pub fn config(self) -> Qwen35Config {
        let (d, layers, ffn, n_h, n_kv, n_v, _) = self.widths();
        Qwen35Config {
            vocab_size: QWEN35_PADDED_VOCAB,
            hidden_size: d,
            intermediate_size: ffn,
            n_layers: layers,
            n_mtp_layers: 0,
            layer_kinds: interval_layer_kinds(layers, FULL_ATTENTION_INTERVAL),
            n_heads: n_h,
            n_kv_heads: n_kv,
            head_dim: 256,
            rotary_dim: 64,
            rope_theta: 1e7,
            mrope_sections: [11, 11, 10],
            // GGUF stores it as f32; keep the value a file reads back as.
            rms_norm_eps: f64::from(1e-6f32),
            conv_kernel: 4,
            linear_key_heads: 16,
            linear_value_heads: n_v,
            linear_key_head_dim: 128,
            linear_value_head_dim: 128,
            context_length: 262_144,
        }
    }
}

/// Rows of the embedding and output head of every released size (248,077 tokens padded).
pub const QWEN35_PADDED_VOCAB: usize = 248_320;

/// Every released size has a full-attention layer after each three DeltaNet layers.
pub const FULL_ATTENTION_INTERVAL: usize = 4;

/// The file types llama.cpp publishes Qwen3.5 in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SynthFileType {
    Bf16,
    Q8_0,
    Q4KM,
}

impl SynthFileType {
    pub fn parse(s: &str) -> Result<Self, SynthError> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "bf16" => Ok(Self::Bf16),
            "q8_0" | "q8" => Ok(Self::Q8_0),
            "q4_k_m" | "q4km" => Ok(Self::Q4KM),
            _ => Err(SynthError::UnknownFileType(s.to_string())),
        }
    }

    /// `BF16`, `Q8_0`, `Q4_K_M`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4KM => "Q4_K_M",
        }
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    pub fn ftype(self) -> u32 {
        match self {
            Self::Bf16 => 32,
            Self::Q8_0 => 7,
            Self::Q4KM => 15,
        }
    }
}

/// How a tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Init {
    /// Approximately N(mean, std²): the Irwin–Hall sum of four uniforms, scaled (bounded at ±3.46σ).
    Normal { mean: f32, std: f32 },
    /// Uniform in `[lo, hi)`.
    Uniform { lo: f32, hi: f32 },
    /// `softplus⁻¹(dt)` with `dt` log-uniform in `[lo, hi)`: a DeltaNet `dt_bias`.
    InverseSoftplusLogUniform { lo: f32, hi: f32 },
}

impl Init {
    /// [`Init::Normal`] of `mean` and `std`.
    pub const fn normal(mean: f32, std: f32) -> Init {
        Init::Normal { mean, std }
    }
}

/// One tensor of the planned file.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthTensor {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub init: Init,
}

impl SynthTensor {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A synthetic model: its configuration, head tying, file type and seed.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    /// `general.name`.
    pub name: String,
    /// `general.size_label`.
    pub size_label: String,
    pub config: Qwen35Config,
    pub tied_embeddings: bool,
    /// Append the multi-token-prediction block as layer `n_layers` (what current converters do).
    pub mtp: bool,
    pub file_type: SynthFileType,
    pub seed: u64,
}

/// An [`SynthError::InvalidSpec`] for `field` where `n` is 0.
pub(crate) fn at_least_one(field: &'static str, n: usize) -> Result<(), SynthError> {
    if n == 0 {
        return Err(SynthError::InvalidSpec {
            field,
            reason: "must be at least 1".into(),
        });
    }
    Ok(())
}

const MATRIX_STD: f32 = 0.02;
const NORM: Init = Init::normal(1.0, MATRIX_STD);
const MATRIX: Init = Init::normal(0.0, MATRIX_STD);

impl SynthSpec {
    /// A released size with all its layers, no MTP block.
    pub fn new(size: SynthSize, file_type: SynthFileType, seed: u64) -> Self {
        Self {
            name: format!(
                "Qwen3.5-{} synthetic (random weights, seed {seed})",
                size.label()
            ),
            size_label: size.label().to_string(),
            config: size.config(),
            tied_embeddings: size.tied_embeddings(),
            mtp: false,
            file_type,
            seed,
        }
    }

    /// Keeps the first `n_layers` layers (widths unchanged; layer kinds by the same interval rule, so
    /// 4 layers are 3 DeltaNet + 1 attention).
    pub fn with_layers(mut self, n_layers: usize) -> Result<Self, SynthError> {
        at_least_one("layers", n_layers)?;
        self.config.n_layers = n_layers;
        self.config.layer_kinds = interval_layer_kinds(n_layers, FULL_ATTENTION_INTERVAL);
        Ok(self)
    }

    fn check(&self) -> Result<(), SynthError> {
        let invalid = |field, reason: String| SynthError::InvalidSpec { field, reason };
        self.config
            .validate()
            .map_err(|e| invalid("config", e.to_string()))?;
        if self.config.n_mtp_layers != 0 {
            return Err(invalid(
                "config.n_mtp_layers",
                "use `mtp` to add the MTP block".into(),
            ));
        }
        let cfg = &self.config;
        let rows = [
            ("hidden_size", cfg.hidden_size),
            ("intermediate_size", cfg.intermediate_size),
            ("value width", cfg.linear_value_dim()),
            ("attention output width", cfg.n_heads * cfg.head_dim),
        ];
        for (what, len) in rows {
            if len % prism_gguf::QK_K != 0 {
                return Err(invalid(
                    "config",
                    format!(
                        "{what} {len} is not a multiple of {} (one K-quant block)",
                        prism_gguf::QK_K
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Blocks in the file: the main layers plus the MTP block.
    pub fn block_count(&self) -> usize {
        self.config.n_layers + usize::from(self.mtp)
    }

    /// Every tensor of the file, in `llama-quantize`'s order, with its storage type.
    pub fn tensors(&self) -> Vec<SynthTensor> {
        let cfg = &self.config;
        let d = cfg.hidden_size as u64;
        let vocab = cfg.vocab_size as u64;
        let ffn = cfg.intermediate_size as u64;
        let head = cfg.head_dim as u64;
        let q_out = 2 * cfg.n_heads as u64 * head;
        let kv_out = cfg.n_kv_heads as u64 * head;
        let attn_in = cfg.n_heads as u64 * head;
        let conv_dim = cfg.conv_dim() as u64;
        let value_dim = cfg.linear_value_dim() as u64;
        let n_v = cfg.linear_value_heads as u64;
        let kernel = cfg.conv_kernel as u64;
        let dk = cfg.linear_key_head_dim as u64;

        // Storage class of a weight; `pick` turns it into a ggml type for the file type.
        #[derive(Clone, Copy)]
        enum Class {
            /// 1-D tensors, `ssm_conv1d`: F32 in every file.
            Plain,
            /// A quantizable matrix with the default type.
            Matrix,
            /// `attn_v` / `attn_qkv` (one shared counter) and `ffn_down`: Q6_K on some layers in Q4_K_M.
            MoreBits(bool),
            Output,
            Embedding,
        }
        let pick = |class: Class| -> GgmlType {
            match (self.file_type, class) {
                (_, Class::Plain) => GgmlType::F32,
                (SynthFileType::Bf16, _) => GgmlType::BF16,
                (SynthFileType::Q8_0, _) => GgmlType::Q8_0,
                (SynthFileType::Q4KM, Class::Matrix) => GgmlType::Q4_K,
                (SynthFileType::Q4KM, Class::MoreBits(more)) => {
                    if more {
                        GgmlType::Q6_K
                    } else {
                        GgmlType::Q4_K
                    }
                }
                (SynthFileType::Q4KM, Class::Output) => GgmlType::Q6_K,
                // llama-quantize: the embedding doubles as the output head when there is no output.weight.
                (SynthFileType::Q4KM, Class::Embedding) => {
                    if self.tied_embeddings {
                        GgmlType::Q6_K
                    } else {
                        GgmlType::Q4_K
                    }
                }
            }
        };
        let tensor = |name: String, dims: Vec<u64>, class: Class, init: Init| SynthTensor {
            name,
            dims,
            ty: pick(class),
            init,
        };

        let mut out = Vec::new();
        let mut top = Vec::new();
        if !self.tied_embeddings {
            top.push(tensor(
                "output.weight".into(),
                vec![d, vocab],
                Class::Output,
                MATRIX,
            ));
        }
        top.push(tensor(
            "output_norm.weight".into(),
            vec![d],
            Class::Plain,
            NORM,
        ));
        top.push(tensor(
            "token_embd.weight".into(),
            vec![d, vocab],
            Class::Embedding,
            MATRIX,
        ));
        top.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(top);

        // llama-quantize's use_more_bits(i, n): the first and last eighth of the layers, and every third
        // one in between.
        let more_bits = |i: usize, n: usize| i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
        let n_blocks = self.block_count();
        let (mut v_counter, mut down_counter) = (0usize, 0usize);
        for block in 0..n_blocks {
            let kind = cfg
                .layer_kinds
                .get(block)
                .copied()
                .unwrap_or(LayerKind::Attention);
            let n = |s: &str| format!("blk.{block}.{s}");
            // The tensor lists are data: one row a tensor as llama.cpp names and shapes it.
            let mut layer = vec![
                tensor(n("attn_norm.weight"), vec![d], Class::Plain, NORM),
                tensor(n("post_attention_norm.weight"), vec![d], Class::Plain, NORM),
                tensor(n("ffn_gate.weight"), vec![d, ffn], Class::Matrix, MATRIX),
                tensor(n("ffn_up.weight"), vec![d, ffn], Class::Matrix, MATRIX),
                tensor(
                    n("ffn_down.weight"),
                    vec![ffn, d],
                    Class::MoreBits(more_bits(down_counter, n_blocks)),
                    MATRIX,
                ),
            ];
            down_counter += 1;
            let v_more = Class::MoreBits(more_bits(v_counter, n_blocks));
            v_counter += 1;
            match kind {
                LayerKind::Attention => layer.extend([
                    tensor(n("attn_q.weight"), vec![d, q_out], Class::Matrix, MATRIX),
                    tensor(n("attn_k.weight"), vec![d, kv_out], Class::Matrix, MATRIX),
                    tensor(n("attn_v.weight"), vec![d, kv_out], v_more, MATRIX),
                    tensor(
                        n("attn_output.weight"),
                        vec![attn_in, d],
                        Class::Matrix,
                        MATRIX,
                    ),
                    tensor(n("attn_q_norm.weight"), vec![head], Class::Plain, NORM),
                    tensor(n("attn_k_norm.weight"), vec![head], Class::Plain, NORM),
                ]),
                LayerKind::DeltaNet => layer.extend([
                    tensor(n("attn_qkv.weight"), vec![d, conv_dim], v_more, MATRIX),
                    tensor(
                        n("attn_gate.weight"),
                        vec![d, value_dim],
                        Class::Matrix,
                        MATRIX,
                    ),
                    tensor(n("ssm_alpha.weight"), vec![d, n_v], Class::Matrix, MATRIX),
                    tensor(n("ssm_beta.weight"), vec![d, n_v], Class::Matrix, MATRIX),
                    tensor(
                        n("ssm_out.weight"),
                        vec![value_dim, d],
                        Class::Matrix,
                        MATRIX,
                    ),
                    tensor(
                        n("ssm_conv1d.weight"),
                        vec![kernel, conv_dim],
                        Class::Plain,
                        Init::Uniform { lo: -0.5, hi: 0.5 },
                    ),
                    tensor(
                        n("ssm_a"),
                        vec![n_v],
                        Class::Plain,
                        Init::Uniform {
                            lo: -16.0,
                            hi: -1.0,
                        },
                    ),
                    tensor(
                        n("ssm_dt.bias"),
                        vec![n_v],
                        Class::Plain,
                        Init::InverseSoftplusLogUniform { lo: 1e-3, hi: 0.1 },
                    ),
                    tensor(n("ssm_norm.weight"), vec![dk], Class::Plain, NORM),
                ]),
            }
            if block >= cfg.n_layers {
                layer.extend([
                    tensor(
                        n("nextn.eh_proj.weight"),
                        vec![2 * d, d],
                        Class::Matrix,
                        MATRIX,
                    ),
                    tensor(n("nextn.enorm.weight"), vec![d], Class::Plain, NORM),
                    tensor(n("nextn.hnorm.weight"), vec![d], Class::Plain, NORM),
                    tensor(
                        n("nextn.shared_head_norm.weight"),
                        vec![d],
                        Class::Plain,
                        NORM,
                    ),
                ]);
            }
            layer.sort_by(|a, b| a.name.cmp(&b.name));
            out.extend(layer);
        }
        out
    }

    /// The `general.*` and `qwen35.*` keys a converted Qwen3.5 file has (in the converter's order). The
    /// tokenizer keys are not included; `general.quantization_version` and `general.file_type` come last
    /// (see [`Self::trailing_metadata`]).
    pub fn metadata(&self) -> Vec<(String, MetadataValue)> {
        let cfg = &self.config;
        let k = |name: &str| format!("{ARCHITECTURE}.{name}");
        let u = |v: usize| MetadataValue::U32(v as u32);
        let mut m = vec![
            (
                "general.architecture".to_string(),
                MetadataValue::String(ARCHITECTURE.into()),
            ),
            (
                "general.type".to_string(),
                MetadataValue::String("model".into()),
            ),
            (
                "general.name".to_string(),
                MetadataValue::String(self.name.clone()),
            ),
            (
                "general.size_label".to_string(),
                MetadataValue::String(self.size_label.clone()),
            ),
            (k("block_count"), u(self.block_count())),
            (k("context_length"), u(cfg.context_length)),
            (k("embedding_length"), u(cfg.hidden_size)),
            (k("feed_forward_length"), u(cfg.intermediate_size)),
            (k("attention.head_count"), u(cfg.n_heads)),
            (k("attention.head_count_kv"), u(cfg.n_kv_heads)),
            (
                k("rope.dimension_sections"),
                MetadataValue::Array(
                    cfg.mrope_sections
                        .iter()
                        .map(|&s| MetadataValue::I32(s as i32))
                        .chain([MetadataValue::I32(0)])
                        .collect(),
                ),
            ),
            (
                k("rope.freq_base"),
                MetadataValue::F32(cfg.rope_theta as f32),
            ),
            (
                k("attention.layer_norm_rms_epsilon"),
                MetadataValue::F32(cfg.rms_norm_eps as f32),
            ),
            (k("attention.key_length"), u(cfg.head_dim)),
            (k("attention.value_length"), u(cfg.head_dim)),
            (k("ssm.conv_kernel"), u(cfg.conv_kernel)),
            (k("ssm.state_size"), u(cfg.linear_key_head_dim)),
            (k("ssm.group_count"), u(cfg.linear_key_heads)),
            (k("ssm.time_step_rank"), u(cfg.linear_value_heads)),
            (k("ssm.inner_size"), u(cfg.linear_value_dim())),
            (
                k("attention.recurrent_layers"),
                MetadataValue::Array(
                    (0..self.block_count())
                        .map(|i| {
                            MetadataValue::Bool(
                                cfg.layer_kinds.get(i) == Some(&LayerKind::DeltaNet),
                            )
                        })
                        .collect(),
                ),
            ),
            (k("full_attention_interval"), u(FULL_ATTENTION_INTERVAL)),
            (k("rope.dimension_count"), u(cfg.rotary_dim)),
        ];
        if self.mtp {
            m.push((k("nextn_predict_layers"), u(1)));
        }
        m
    }

    /// The keys llama-quantize writes last.
    pub fn trailing_metadata(&self) -> Vec<(String, MetadataValue)> {
        vec![
            ("general.quantization_version".into(), MetadataValue::U32(2)),
            (
                "general.file_type".into(),
                MetadataValue::U32(self.file_type.ftype()),
            ),
        ]
    }

    /// A Hugging Face `config.json` (`Qwen3_5ForCausalLM`, text only) describing the same decoder, which
    /// [`Qwen35Config::check_hf_config`] accepts.
    pub fn hf_config_json(&self, eos_token_id: Option<u32>) -> Value {
        let cfg = &self.config;
        let layer_types: Vec<&str> = cfg.layer_kinds.iter().map(|k| k.hf_name()).collect();
        let mut config = json!({
            "architectures": ["Qwen3_5ForCausalLM"],
            "attention_bias": false,
            "attention_dropout": 0.0,
            "bos_token_id": null,
            "dtype": "bfloat16",
            "eos_token_id": eos_token_id,
            "head_dim": cfg.head_dim,
            "hidden_act": "silu",
            "hidden_size": cfg.hidden_size,
            "initializer_range": MATRIX_STD,
            "intermediate_size": cfg.intermediate_size,
            "layer_types": layer_types,
            "linear_conv_kernel_dim": cfg.conv_kernel,
            "linear_key_head_dim": cfg.linear_key_head_dim,
            "linear_num_key_heads": cfg.linear_key_heads,
            "linear_num_value_heads": cfg.linear_value_heads,
            "linear_value_head_dim": cfg.linear_value_head_dim,
            "max_position_embeddings": cfg.context_length,
            "model_type": "qwen3_5_text",
            "num_attention_heads": cfg.n_heads,
            "num_hidden_layers": cfg.n_layers,
            "num_key_value_heads": cfg.n_kv_heads,
            "pad_token_id": null,
            "rms_norm_eps": cfg.rms_norm_eps,
            "rope_parameters": {
                "mrope_interleaved": true,
                "mrope_section": cfg.mrope_sections,
                "partial_rotary_factor": cfg.rotary_dim as f64 / cfg.head_dim as f64,
                "rope_theta": cfg.rope_theta,
                "rope_type": "default"
            },
            "tie_word_embeddings": self.tied_embeddings,
            "use_cache": true,
            "vocab_size": cfg.vocab_size
        });
        if self.mtp {
            config["mtp_num_hidden_layers"] = json!(1);
        }
        config
    }
}

// ---------------------------------------------------------------------------------------------------
// Values
// ---------------------------------------------------------------------------------------------------

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function: a bijective 64-bit mixer.
#[inline]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The stream key of one tensor: the seed and the tensor's name, hashed (FNV-1a, then mixed).
pub fn tensor_key(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    mix64(mix64(seed ^ GOLDEN_GAMMA) ^ h)
}

/// Fills `out` with the values of elements `start..start + out.len()` of the tensor with stream `key`.
pub fn fill_values(init: Init, key: u64, start: u64, out: &mut [f32]) {
    let hash =
        |i: usize| mix64(key.wrapping_add((start + i as u64 + 1).wrapping_mul(GOLDEN_GAMMA)));
    // 24 random bits → [0, 1).
    let unit = |h: u64| (h >> 40) as f32 * (1.0 / (1u64 << 24) as f32);
    match init {
        Init::Normal { mean, std } => {
            // Four 16-bit uniforms: the sum has mean 2 and variance 4/12.
            let scale = std * 3f32.sqrt() / 65536.0;
            for (i, v) in out.iter_mut().enumerate() {
                let h = hash(i);
                let sum = (h & 0xffff) + ((h >> 16) & 0xffff) + ((h >> 32) & 0xffff) + (h >> 48);
                *v = mean + (sum as f32 - 2.0 * 65536.0) * scale;
            }
        }
        Init::Uniform { lo, hi } => {
            for (i, v) in out.iter_mut().enumerate() {
                *v = lo + (hi - lo) * unit(hash(i));
            }
        }
        Init::InverseSoftplusLogUniform { lo, hi } => {
            let (ln_lo, ln_hi) = (lo.ln(), hi.ln());
            for (i, v) in out.iter_mut().enumerate() {
                let dt = (ln_lo + (ln_hi - ln_lo) * unit(hash(i))).exp();
                // softplus⁻¹(dt) = ln(e^dt − 1) = dt + ln(1 − e^−dt)
                *v = dt + (-(-dt).exp_m1()).ln();
            }
        }
    }
}

/// The values of a whole tensor (tests and small tensors).
pub fn tensor_values(spec: &SynthSpec, tensor: &SynthTensor) -> Vec<f32> {
    let mut out = vec![0f32; tensor.n_elements() as usize];
    fill_values(
        tensor.init,
        tensor_key(spec.seed, &tensor.name),
        0,
        &mut out,
    );
    out
}

// ---------------------------------------------------------------------------------------------------
// Writing
// ---------------------------------------------------------------------------------------------------

/// Elements generated and quantized as one piece of work (a multiple of every block size).
const CHUNK_ELEMENTS: u64 = 1 << 20;
/// Chunks computed in parallel before their bytes go to the writer thread.
const BATCH_CHUNKS: usize = 64;

/// Where a write stands, passed to the progress callback after each batch.
#[derive(Debug, Clone)]
pub struct SynthProgress<'a> {
    /// Bytes of tensor data computed so far (and handed to the writer).
    pub bytes_done: u64,
    pub bytes_total: u64,
    pub tensors_done: usize,
    pub tensors_total: usize,
    /// The tensor the batch ended in.
    pub tensor: &'a str,
}

/// What was written.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSummary {
    pub n_tensors: usize,
    pub n_elements: u64,
    /// Size of the whole file.
    pub file_bytes: u64,
}

/// Writes the GGUF of `spec` to `path`. `tokenizer_metadata` goes after the model keys (the tokenizer
/// vocabulary, merges and chat template). `progress` is called after each batch of chunks.
pub fn write_gguf(
    path: &Path,
    spec: &SynthSpec,
    tokenizer_metadata: Vec<(String, MetadataValue)>,
    progress: impl FnMut(&SynthProgress<'_>),
) -> Result<SynthSummary, SynthError> {
    write_file(path, |out| {
        write_gguf_to(out, spec, tokenizer_metadata, progress)
    })
}

/// Creates `path` and has `write` fill it through a buffer, flushed at the end; `write`'s summary.
pub(crate) fn write_file(
    path: &Path,
    write: impl FnOnce(
        std::io::BufWriter<std::fs::File>,
    ) -> Result<(std::io::BufWriter<std::fs::File>, SynthSummary), SynthError>,
) -> Result<SynthSummary, SynthError> {
    let create = |source| SynthError::Create {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::create(path).map_err(create)?;
    let (mut out, summary) = write(std::io::BufWriter::with_capacity(8 << 20, file))?;
    out.flush().map_err(create)?;
    Ok(summary)
}

/// As [`write_gguf`], into any sink; returns it with the summary.
pub fn write_gguf_to<W: Write + Send>(
    out: W,
    spec: &SynthSpec,
    tokenizer_metadata: Vec<(String, MetadataValue)>,
    progress: impl FnMut(&SynthProgress<'_>),
) -> Result<(W, SynthSummary), SynthError> {
    spec.check()?;
    let metadata = spec
        .metadata()
        .into_iter()
        .chain(tokenizer_metadata)
        .chain(spec.trailing_metadata());
    write_tensors_to(out, metadata, &spec.tensors(), spec.seed, progress)
}

/// Writes a GGUF of `metadata` (in order) and `tensors` (in order, each value drawn from `seed` and the
/// tensor's name as [`fill_values`] does) to `out`; returns it with the summary. What [`write_gguf_to`]
/// and the synthetic mmproj ([`crate::synth_vision`]) both use: the same bytes whatever the chunking
/// and the number of threads.
pub fn write_tensors_to<W: Write + Send>(
    out: W,
    metadata: impl IntoIterator<Item = (String, MetadataValue)>,
    tensors: &[SynthTensor],
    seed: u64,
    mut progress: impl FnMut(&SynthProgress<'_>),
) -> Result<(W, SynthSummary), SynthError> {
    let mut writer = GgufWriter::new();
    for (key, value) in metadata {
        writer.add_metadata(key, value)?;
    }
    for t in tensors {
        writer.add_tensor(t.name.clone(), &t.dims, t.ty)?;
    }
    let planned = writer.planned_tensors()?;
    let bytes_total: u64 = planned.iter().map(|t| t.n_bytes()).sum();
    // The work list: (tensor, first element, elements) in file order.
    let jobs: Vec<(usize, u64, u64)> = tensors
        .iter()
        .enumerate()
        .flat_map(|(t, tensor)| {
            let total = tensor.n_elements();
            (0..total.div_ceil(CHUNK_ELEMENTS)).map(move |c| {
                let start = c * CHUNK_ELEMENTS;
                (t, start, CHUNK_ELEMENTS.min(total - start))
            })
        })
        .collect();
    let keys: Vec<u64> = tensors.iter().map(|t| tensor_key(seed, &t.name)).collect();

    let out = CountingWriter {
        inner: out,
        count: 0,
    };
    let data = writer.write_header(out)?;
    std::thread::scope(|scope| {
        let (send, receive) = sync_channel::<Vec<Vec<u8>>>(1);
        let writer_thread = scope.spawn(move || -> Result<CountingWriter<W>, GgufError> {
            let mut data = data;
            for batch in receive {
                for piece in batch {
                    data.write_bytes(&piece)?;
                }
            }
            data.finish()
        });
        let mut bytes_done = 0u64;
        for batch in jobs.chunks(BATCH_CHUNKS) {
            let pieces: Vec<Vec<u8>> = batch
                .par_iter()
                .map(|&(t, start, len)| -> Result<Vec<u8>, GgufError> {
                    let tensor = &tensors[t];
                    let mut values = vec![0f32; len as usize];
                    fill_values(tensor.init, keys[t], start, &mut values);
                    let mut bytes = Vec::new();
                    prism_gguf::quantize::quantize_into(tensor.ty, &values, &mut bytes)?;
                    Ok(bytes)
                })
                .collect::<Result<_, _>>()?;
            bytes_done += pieces.iter().map(|p| p.len() as u64).sum::<u64>();
            if send.send(pieces).is_err() {
                // The writer stopped: its error is returned below.
                break;
            }
            if let Some(&(t, _, _)) = batch.last() {
                progress(&SynthProgress {
                    bytes_done,
                    bytes_total,
                    tensors_done: t,
                    tensors_total: tensors.len(),
                    tensor: &tensors[t].name,
                });
            }
        }
        drop(send);
        let out = writer_thread.join().map_err(|_| SynthError::WriterLost)??;
        let summary = SynthSummary {
            n_tensors: tensors.len(),
            n_elements: tensors.iter().map(SynthTensor::n_elements).sum(),
            file_bytes: out.count,
        };
        Ok((out.inner, summary))
    })
}

/// Counts the bytes that pass through (the file size, whatever the sink).
struct CountingWriter<W> {
    inner: W,
    count: u64,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.count += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LoadOptions, Qwen35Model};
    use prism_gguf::GgufFile;

    fn fixture(name: &str) -> GgufFile {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/qwen35-tiny")
            .join(name);
        GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// A spec with the tiny fixture's configuration (read from its GGUF) and head (untied).
    fn tiny_spec(file_type: SynthFileType, seed: u64) -> SynthSpec {
        let config = Qwen35Config::from_gguf(&fixture("tiny-Q8_0.gguf")).unwrap();
        SynthSpec {
            name: "tiny synthetic".into(),
            size_label: "7.4M".into(),
            config,
            tied_embeddings: false,
            mtp: false,
            file_type,
            seed,
        }
    }

    fn listing(
        tensors: impl Iterator<Item = (String, Vec<u64>, GgmlType)>,
    ) -> Vec<(String, Vec<u64>, GgmlType)> {
        tensors.collect()
    }

    #[test]
    fn planned_tensors_are_what_llama_cpp_wrote_for_the_tiny_fixture() {
        // tiny-{BF16,Q8_0,Q4_K_M}.gguf were made by llama.cpp's converter and llama-quantize: same names,
        // dims and per-tensor types (the Q4_K_M Q4_K/Q6_K mix included); Q8_0 and Q4_K_M in the same
        // order (llama-quantize's). The converter's BF16 order differs; compare that one as a set. (A
        // table of the fixture files, as tests/parallel_load.rs and int8_accuracy.rs have: each test asks
        // its own thing of them.)
        for (file, ty) in [
            ("tiny-BF16.gguf", SynthFileType::Bf16),
            ("tiny-Q8_0.gguf", SynthFileType::Q8_0),
            ("tiny-Q4_K_M.gguf", SynthFileType::Q4KM),
        ] {
            let gguf = fixture(file);
            let theirs = listing(
                gguf.tensors()
                    .iter()
                    .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type)),
            );
            let ours = listing(
                tiny_spec(ty, 0)
                    .tensors()
                    .into_iter()
                    .map(|t| (t.name, t.dims, t.ty)),
            );
            assert_eq!(ours.len(), 109, "{file}");
            if ty == SynthFileType::Bf16 {
                let sorted = |mut v: Vec<(String, Vec<u64>, GgmlType)>| {
                    v.sort_by(|a, b| a.0.cmp(&b.0));
                    v
                };
                assert_eq!(sorted(ours), sorted(theirs), "{file}");
            } else {
                assert_eq!(ours, theirs, "{file}");
            }
        }
    }

    #[test]
    fn real_sizes_have_the_reference_shapes() {
        // qwen35-reference §1.1 derived widths: q_proj out, k/v out, o_proj in, conv_dim, value_dim, and
        // the tied sizes (0.8B/2B/4B) have no output.weight.
        let derived = [
            (SynthSize::B0_8, 4096, 512, 2048, 6144, 2048, 24),
            (SynthSize::B2, 4096, 512, 2048, 6144, 2048, 24),
            (SynthSize::B4, 8192, 1024, 4096, 8192, 4096, 32),
            (SynthSize::B9, 8192, 1024, 4096, 8192, 4096, 32),
            (SynthSize::B27, 12288, 1024, 6144, 10240, 6144, 64),
        ];
        for (size, q_out, kv_out, o_in, conv, value, layers) in derived {
            let spec = SynthSpec::new(size, SynthFileType::Bf16, 0);
            spec.check().unwrap();
            let tensors = spec.tensors();
            let dims = |name: &str| -> Vec<u64> {
                tensors
                    .iter()
                    .find(|t| t.name == name)
                    .unwrap_or_else(|| panic!("{size:?}: no {name}"))
                    .dims
                    .clone()
            };
            let d = spec.config.hidden_size as u64;
            assert_eq!(dims("blk.3.attn_q.weight"), vec![d, q_out], "{size:?}");
            assert_eq!(dims("blk.3.attn_v.weight"), vec![d, kv_out], "{size:?}");
            assert_eq!(dims("blk.3.attn_output.weight"), vec![o_in, d], "{size:?}");
            assert_eq!(dims("blk.0.attn_qkv.weight"), vec![d, conv], "{size:?}");
            assert_eq!(dims("blk.0.ssm_conv1d.weight"), vec![4, conv], "{size:?}");
            assert_eq!(dims("blk.0.ssm_out.weight"), vec![value, d], "{size:?}");
            assert_eq!(dims("token_embd.weight"), vec![d, 248_320], "{size:?}");
            let last = layers - 1;
            assert_eq!(
                dims(&format!("blk.{last}.attn_q.weight"))[1],
                q_out,
                "{size:?}: last layer is attention"
            );
            assert!(!tensors
                .iter()
                .any(|t| t.name.starts_with(&format!("blk.{layers}."))));
            let tied = matches!(size, SynthSize::B0_8 | SynthSize::B2 | SynthSize::B4);
            assert_eq!(
                tensors.iter().any(|t| t.name == "output.weight"),
                !tied,
                "{size:?}"
            );
            // 3 top-level (2 tied) + 14 per DeltaNet layer + 11 per attention layer.
            let expected = 3 - usize::from(tied) + 14 * layers * 3 / 4 + 11 * layers / 4;
            assert_eq!(tensors.len(), expected, "{size:?}");
        }
    }

    #[test]
    fn two_b_bf16_adds_up_to_the_published_file_size() {
        // qwen35-reference §1.4: unsloth's Qwen3.5-2B BF16 GGUF is 3,775,709,216 bytes. Our tensor data
        // (aligned as in the file) must leave about the ~11 MB a 248k-token vocabulary header takes
        // (our own 0.8B file's header is 10.94 MB); with the MTP block it would not fit at all.
        let published = 3_775_709_216u64;
        let data = |mtp: bool| -> u64 {
            let mut spec = SynthSpec::new(SynthSize::B2, SynthFileType::Bf16, 0);
            spec.mtp = mtp;
            spec.tensors()
                .iter()
                .map(|t| t.ty.bytes_for(t.n_elements()).unwrap().next_multiple_of(32))
                .sum()
        };
        let header = published - data(false);
        assert!(
            (10_900_000..11_100_000).contains(&header),
            "header would be {header} bytes"
        );
        assert!(data(true) > published);
    }

    #[test]
    fn q4_k_m_mix_follows_use_more_bits_and_the_tied_head() {
        // 24 layers: use_more_bits(i, 24) holds for i < 3, i >= 21 and i = 5, 8, …, 20.
        let more = [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23];
        let spec = SynthSpec::new(SynthSize::B0_8, SynthFileType::Q4KM, 0);
        let tensors = spec.tensors();
        let ty = |name: String| {
            tensors
                .iter()
                .find(|t| t.name == name)
                .map(|t| t.ty)
                .unwrap()
        };
        for i in 0..24 {
            let v = if (i + 1) % 4 == 0 {
                "attn_v"
            } else {
                "attn_qkv"
            };
            let want = if more.contains(&i) {
                GgmlType::Q6_K
            } else {
                GgmlType::Q4_K
            };
            assert_eq!(ty(format!("blk.{i}.{v}.weight")), want, "layer {i}");
            assert_eq!(ty(format!("blk.{i}.ffn_down.weight")), want, "layer {i}");
            assert_eq!(ty(format!("blk.{i}.ffn_up.weight")), GgmlType::Q4_K);
        }
        // Tied: the embedding is the output head, so Q6_K (reference §5.1); untied 9B: Q4_K + Q6_K output.
        assert_eq!(ty("token_embd.weight".into()), GgmlType::Q6_K);
        let nine = SynthSpec::new(SynthSize::B9, SynthFileType::Q4KM, 0).tensors();
        let ty9 = |name: &str| nine.iter().find(|t| t.name == name).map(|t| t.ty).unwrap();
        assert_eq!(
            (ty9("token_embd.weight"), ty9("output.weight")),
            (GgmlType::Q4_K, GgmlType::Q6_K)
        );
        // With the MTP block the counters run over L + 1 blocks and the block has its nextn tensors.
        let mut mtp = SynthSpec::new(SynthSize::B0_8, SynthFileType::Q4KM, 0);
        mtp.mtp = true;
        let with_mtp = mtp.tensors();
        assert_eq!(with_mtp.len(), tensors.len() + 11 + 4);
        let eh = with_mtp
            .iter()
            .find(|t| t.name == "blk.24.nextn.eh_proj.weight")
            .unwrap();
        assert_eq!(eh.dims, vec![2048, 1024]);
        // use_more_bits(24, 25): 24 >= 7·25/8 = 21.
        assert_eq!(
            with_mtp
                .iter()
                .find(|t| t.name == "blk.24.attn_v.weight")
                .unwrap()
                .ty,
            GgmlType::Q6_K
        );
    }

    #[test]
    fn values_depend_only_on_seed_name_and_index() {
        let init = Init::Normal {
            mean: 0.0,
            std: 0.02,
        };
        let key = tensor_key(7, "blk.0.ffn_up.weight");
        let mut whole = vec![0f32; 10_000];
        fill_values(init, key, 0, &mut whole);
        let mut pieces = vec![0f32; 10_000];
        for (i, piece) in pieces.chunks_mut(777).enumerate() {
            fill_values(init, key, (i * 777) as u64, piece);
        }
        assert_eq!(whole, pieces);
        let mut other = vec![0f32; 10_000];
        fill_values(init, tensor_key(8, "blk.0.ffn_up.weight"), 0, &mut other);
        assert_ne!(whole, other);
        fill_values(init, tensor_key(7, "blk.0.ffn_gate.weight"), 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn value_distributions_are_as_documented() {
        let n = 1 << 20;
        let mut v = vec![0f32; n];
        fill_values(
            Init::Normal {
                mean: 1.0,
                std: 0.02,
            },
            tensor_key(1, "a"),
            0,
            &mut v,
        );
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n as f64;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n as f64;
        assert!((mean - 1.0).abs() < 1e-4, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 2e-4, "std {}", var.sqrt());
        assert!(v
            .iter()
            .all(|&x| (x - 1.0).abs() <= 0.02 * 3f32.sqrt() * 2.0 + 1e-6));
        fill_values(
            Init::Uniform {
                lo: -16.0,
                hi: -1.0,
            },
            tensor_key(1, "b"),
            0,
            &mut v,
        );
        assert!(v.iter().all(|&x| (-16.0..-1.0).contains(&x)));
        fill_values(
            Init::InverseSoftplusLogUniform { lo: 1e-3, hi: 0.1 },
            tensor_key(1, "c"),
            0,
            &mut v,
        );
        let softplus = |x: f32| (1.0 + f64::from(x).exp()).ln();
        assert!(v
            .iter()
            .all(|&x| (0.999e-3..=0.1001).contains(&softplus(x))));
    }

    #[test]
    fn written_file_reads_back_and_runs_finite() {
        let spec = tiny_spec(SynthFileType::Q4KM, 3);
        let write = |spec: &SynthSpec, threads: usize| -> Vec<u8> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            let mut calls = 0;
            let (bytes, summary) = pool
                .install(|| write_gguf_to(Vec::new(), spec, Vec::new(), |_| calls += 1))
                .unwrap();
            assert!(calls >= 1);
            assert_eq!(summary.file_bytes, bytes.len() as u64);
            assert_eq!(summary.n_tensors, 109);
            bytes
        };
        let bytes = write(&spec, 2);
        assert_eq!(bytes, write(&spec, 1), "thread count changed the bytes");
        let mut reseeded = spec.clone();
        reseeded.seed = 4;
        assert_ne!(bytes, write(&reseeded, 2));

        let gguf = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(Qwen35Config::from_gguf(&gguf).unwrap(), spec.config);
        assert_eq!(
            gguf.get("general.file_type").and_then(|v| v.as_u64()),
            Some(15)
        );
        // Every tensor's bytes are the reference quantizer's bytes of the generated values.
        for t in spec.tensors() {
            let expected = prism_gguf::quantize::quantize(t.ty, &tensor_values(&spec, &t)).unwrap();
            assert!(
                gguf.tensor_data(&t.name).unwrap() == expected.as_slice(),
                "{}",
                t.name
            );
        }
        let model = Qwen35Model::from_gguf(&gguf, &LoadOptions::default()).unwrap();
        let tokens: Vec<u32> = (0..150u32)
            .map(|i| i.wrapping_mul(2_654_435_761) % 4129)
            .collect();
        let hidden = model.last_hidden(&[tokens.as_slice()]).unwrap();
        let logits: Vec<f32> = model
            .logits(&hidden)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(logits.len(), 4129);
        assert!(logits.iter().all(|x| x.is_finite()));
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let sum: f64 = logits.iter().map(|&x| f64::from(x - max).exp()).sum();
        let top = 1.0 / sum;
        // Neither flat nor one-hot: the random model still prefers some tokens.
        assert!(top > 2.0 / 4129.0 && top < 0.99, "top probability {top}");
    }

    #[test]
    fn bad_specs_are_typed_errors() {
        assert!(matches!(
            SynthSize::parse("3b"),
            Err(SynthError::UnknownSize(_))
        ));
        assert_eq!(SynthSize::parse("0.8B").unwrap(), SynthSize::B0_8);
        assert_eq!(SynthSize::parse("27b").unwrap(), SynthSize::B27);
        assert!(matches!(
            SynthFileType::parse("q5_k"),
            Err(SynthError::UnknownFileType(_))
        ));
        assert_eq!(SynthFileType::parse("Q4_K_M").unwrap(), SynthFileType::Q4KM);
        let spec = SynthSpec::new(SynthSize::B0_8, SynthFileType::Q8_0, 0);
        assert!(matches!(
            spec.clone().with_layers(0),
            Err(SynthError::InvalidSpec {
                field: "layers",
                ..
            })
        ));
        let four = spec.with_layers(4).unwrap();
        assert_eq!(
            four.config.layer_kinds,
            [
                LayerKind::DeltaNet,
                LayerKind::DeltaNet,
                LayerKind::DeltaNet,
                LayerKind::Attention
            ]
        );
        let mut odd = four;
        odd.config.intermediate_size = 1000;
        assert!(matches!(
            write_gguf_to(Vec::new(), &odd, Vec::new(), |_| ()),
            Err(SynthError::InvalidSpec { .. })
        ));
    }
}
