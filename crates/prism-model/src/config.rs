//! The text-decoder hyper-parameters, read from GGUF metadata (`qwen35.*`) and optionally cross-checked
//! against the Hugging Face `config.json` of the same model.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use prism_gguf::{GgufFile, MetadataValue};
use serde_json::Value;

use crate::error::{ModelError, Result};

/// The GGUF architecture name this crate runs.
pub const ARCHITECTURE: &str = "qwen35";

/// What a decoder layer mixes tokens with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (linear attention with a recurrent state).
    DeltaNet,
    /// Gated full softmax attention (KV cache).
    Attention,
}

impl LayerKind {
    /// Its name in a Hugging Face `config.json`'s `layer_types`.
    pub fn hf_name(self) -> &'static str {
        match self {
            LayerKind::DeltaNet => "linear_attention",
            LayerKind::Attention => "full_attention",
        }
    }

    /// The kind a `layer_types` entry names ([`LayerKind::hf_name`]'s inverse).
    pub fn from_hf_name(name: &str) -> Option<LayerKind> {
        [LayerKind::DeltaNet, LayerKind::Attention]
            .into_iter()
            .find(|kind| kind.hf_name() == name)
    }
}

/// Hyper-parameters of a dense Qwen3.5 text decoder.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen35Config {
    /// Rows of the embedding and of the output head (the padded vocabulary).
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// SwiGLU width.
    pub intermediate_size: usize,
    /// Main decoder layers (what the forward pass runs).
    pub n_layers: usize,
    /// Multi-token-prediction blocks appended after the main layers in the file (`nextn_predict_layers`);
    /// never run here.
    pub n_mtp_layers: usize,
    /// One entry per main layer.
    pub layer_kinds: Vec<LayerKind>,
    /// Full-attention query heads.
    pub n_heads: usize,
    /// Full-attention key/value heads.
    pub n_kv_heads: usize,
    /// Full-attention head width (256 for every released size; not `hidden_size / n_heads`).
    pub head_dim: usize,
    /// Dims of each head that rotate (`head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    pub rope_theta: f64,
    /// M-RoPE sections `[T, H, W]` in frequency pairs.
    pub mrope_sections: [usize; 3],
    pub rms_norm_eps: f64,
    /// Causal depthwise conv width of the DeltaNet layers.
    pub conv_kernel: usize,
    /// DeltaNet key (and query) heads, `n_k`.
    pub linear_key_heads: usize,
    /// DeltaNet value heads, `n_v` (a multiple of `n_k`).
    pub linear_value_heads: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub context_length: usize,
}

/// Anything metadata can be looked up in: a [`GgufFile`], or a map (for tests and tools).
pub trait Metadata {
    fn meta(&self, key: &str) -> Option<&MetadataValue>;
}

impl Metadata for GgufFile {
    fn meta(&self, key: &str) -> Option<&MetadataValue> {
        self.get(key)
    }
}

impl Metadata for HashMap<String, MetadataValue> {
    fn meta(&self, key: &str) -> Option<&MetadataValue> {
        self.get(key)
    }
}

impl Metadata for BTreeMap<String, MetadataValue> {
    fn meta(&self, key: &str) -> Option<&MetadataValue> {
        self.get(key)
    }
}

/// Reads and parses a Hugging Face `config.json`.
pub fn read_hf_config(path: &Path) -> Result<Value> {
    let err = |reason: String| ModelError::ConfigJson {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
    if !json.is_object() {
        return Err(err("not a JSON object".into()));
    }
    Ok(json)
}

/// The text part of a `config.json`: `text_config` of a multimodal config, else the whole object.
pub fn hf_text_config(json: &Value) -> &Value {
    json.get("text_config")
        .filter(|v| v.is_object())
        .unwrap_or(json)
}

/// The layer pattern when no per-layer list is given (transformers' rule, which llama.cpp follows):
/// layer `i` is full attention iff `(i + 1) % interval == 0`. `interval` must be positive.
pub(crate) fn interval_layer_kinds(n_layers: usize, interval: usize) -> Vec<LayerKind> {
    (0..n_layers)
        .map(|i| {
            if (i + 1) % interval == 0 {
                LayerKind::Attention
            } else {
                LayerKind::DeltaNet
            }
        })
        .collect()
}

fn key(name: &str) -> String {
    format!("{ARCHITECTURE}.{name}")
}

fn bad(key: &str, reason: impl Into<String>) -> ModelError {
    ModelError::BadMetadata {
        key: key.to_string(),
        reason: reason.into(),
    }
}

fn invalid(field: &str, reason: impl Into<String>) -> ModelError {
    ModelError::InvalidConfig {
        field: field.to_string(),
        reason: reason.into(),
    }
}

fn opt_usize(meta: &dyn Metadata, key: &str) -> Result<Option<usize>> {
    match meta.meta(key) {
        None => Ok(None),
        Some(v) => {
            let n = v.as_u64().ok_or_else(|| {
                bad(
                    key,
                    format!(
                        "expected a non-negative integer, found {}",
                        v.full_type_name()
                    ),
                )
            })?;
            usize::try_from(n)
                .map(Some)
                .map_err(|_| bad(key, format!("{n} does not fit in usize")))
        }
    }
}

fn req_usize(meta: &dyn Metadata, key: &str) -> Result<usize> {
    opt_usize(meta, key)?.ok_or_else(|| ModelError::MissingMetadata {
        key: key.to_string(),
    })
}

fn req_f64(meta: &dyn Metadata, key: &str) -> Result<f64> {
    let v = meta.meta(key).ok_or_else(|| ModelError::MissingMetadata {
        key: key.to_string(),
    })?;
    let x = v.as_f64().ok_or_else(|| {
        bad(
            key,
            format!("expected a float, found {}", v.full_type_name()),
        )
    })?;
    if !x.is_finite() {
        return Err(bad(key, format!("{x} is not finite")));
    }
    Ok(x)
}

fn opt_array<'a>(meta: &'a dyn Metadata, key: &str) -> Result<Option<&'a [MetadataValue]>> {
    match meta.meta(key) {
        None => Ok(None),
        Some(v) => v.as_array().map(Some).ok_or_else(|| {
            bad(
                key,
                format!("expected an array, found {}", v.full_type_name()),
            )
        }),
    }
}

impl Qwen35Config {
    /// Reads the configuration of a `qwen35` GGUF. The vocabulary size is the row count of
    /// `token_embd.weight` (checked against `tokenizer.ggml.tokens` when that is present).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let name = "token_embd.weight";
        let info = gguf
            .tensor_info(name)
            .ok_or_else(|| ModelError::MissingTensor { name: name.into() })?;
        let vocab = match info.dims.as_slice() {
            [_, rows] => {
                usize::try_from(*rows).map_err(|_| invalid("vocab_size", format!("{rows} rows")))?
            }
            other => {
                return Err(ModelError::InvalidConfig {
                    field: "vocab_size".into(),
                    reason: format!("{name} has shape {other:?}, expected two dimensions"),
                })
            }
        };
        Self::from_metadata(gguf, vocab)
    }

    /// Reads the configuration from `qwen35.*` metadata; `vocab_size` comes from the embedding tensor.
    pub fn from_metadata(meta: &dyn Metadata, vocab_size: usize) -> Result<Self> {
        let arch_key = "general.architecture";
        let arch = meta
            .meta(arch_key)
            .ok_or_else(|| ModelError::MissingMetadata {
                key: arch_key.into(),
            })?;
        let arch = arch
            .as_str()
            .ok_or_else(|| bad(arch_key, "expected a string"))?;
        if arch != ARCHITECTURE {
            return Err(ModelError::UnsupportedArchitecture {
                found: arch.to_string(),
            });
        }
        let tokens_key = "tokenizer.ggml.tokens";
        if let Some(tokens) = opt_array(meta, tokens_key)? {
            if tokens.len() != vocab_size {
                return Err(bad(
                    tokens_key,
                    format!(
                        "{} tokens, but token_embd.weight has {vocab_size} rows",
                        tokens.len()
                    ),
                ));
            }
        }

        let block_count = req_usize(meta, &key("block_count"))?;
        let n_mtp_layers = opt_usize(meta, &key("nextn_predict_layers"))?.unwrap_or(0);
        if n_mtp_layers >= block_count {
            return Err(bad(
                &key("nextn_predict_layers"),
                format!("{n_mtp_layers} MTP blocks leave no main layer out of block_count {block_count}"),
            ));
        }
        let n_layers = block_count - n_mtp_layers;

        let interval_key = key("full_attention_interval");
        let interval = opt_usize(meta, &interval_key)?.unwrap_or(4);
        let recurrent_key = key("attention.recurrent_layers");
        let layer_kinds = match opt_array(meta, &recurrent_key)? {
            Some(flags) => {
                if flags.len() != block_count && flags.len() != n_layers {
                    return Err(bad(
                        &recurrent_key,
                        format!("{} entries; expected block_count {block_count} or {n_layers} main layers", flags.len()),
                    ));
                }
                flags[..n_layers]
                    .iter()
                    .enumerate()
                    .map(|(i, f)| match f {
                        MetadataValue::Bool(true) => Ok(LayerKind::DeltaNet),
                        MetadataValue::Bool(false) => Ok(LayerKind::Attention),
                        other => Err(bad(
                            &recurrent_key,
                            format!("entry {i} is {}, expected bool", other.full_type_name()),
                        )),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                if interval == 0 {
                    return Err(bad(&interval_key, "must be at least 1"));
                }
                interval_layer_kinds(n_layers, interval)
            }
        };

        let sections_key = key("rope.dimension_sections");
        let sections =
            opt_array(meta, &sections_key)?.ok_or_else(|| ModelError::MissingMetadata {
                key: sections_key.clone(),
            })?;
        let sections: Vec<usize> = sections
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(
                            &sections_key,
                            format!("entry {i} is not a non-negative integer"),
                        )
                    })
            })
            .collect::<Result<_>>()?;
        if sections.len() < 3 {
            return Err(bad(
                &sections_key,
                format!("{} entries, expected 3 or 4", sections.len()),
            ));
        }

        let head_dim = req_usize(meta, &key("attention.key_length"))?;
        let value_length = req_usize(meta, &key("attention.value_length"))?;
        if value_length != head_dim {
            return Err(invalid(
                "attention.value_length",
                format!(
                    "{value_length} differs from key_length {head_dim}; Qwen3.5 uses one head_dim"
                ),
            ));
        }
        let linear_key_heads = req_usize(meta, &key("ssm.group_count"))?;
        let linear_value_heads = req_usize(meta, &key("ssm.time_step_rank"))?;
        let inner = req_usize(meta, &key("ssm.inner_size"))?;
        if linear_value_heads == 0 || inner % linear_value_heads != 0 {
            return Err(invalid(
                "ssm.inner_size",
                format!("{inner} is not a multiple of the {linear_value_heads} value heads"),
            ));
        }

        let cfg = Self {
            vocab_size,
            hidden_size: req_usize(meta, &key("embedding_length"))?,
            intermediate_size: req_usize(meta, &key("feed_forward_length"))?,
            n_layers,
            n_mtp_layers,
            layer_kinds,
            n_heads: req_usize(meta, &key("attention.head_count"))?,
            n_kv_heads: req_usize(meta, &key("attention.head_count_kv"))?,
            head_dim,
            rotary_dim: req_usize(meta, &key("rope.dimension_count"))?,
            rope_theta: req_f64(meta, &key("rope.freq_base"))?,
            mrope_sections: [sections[0], sections[1], sections[2]],
            rms_norm_eps: req_f64(meta, &key("attention.layer_norm_rms_epsilon"))?,
            conv_kernel: req_usize(meta, &key("ssm.conv_kernel"))?,
            linear_key_heads,
            linear_value_heads,
            linear_key_head_dim: req_usize(meta, &key("ssm.state_size"))?,
            linear_value_head_dim: inner / linear_value_heads,
            context_length: opt_usize(meta, &key("context_length"))?.unwrap_or(0),
        };
        let extra_sections: usize = sections[3..].iter().sum();
        if cfg.mrope_sections.iter().sum::<usize>() + extra_sections != cfg.rotary_dim / 2 {
            return Err(invalid(
                "rope.dimension_sections",
                format!(
                    "{sections:?} does not add up to rotary_dim / 2 = {}",
                    cfg.rotary_dim / 2
                ),
            ));
        }
        cfg.validate()?;
        Ok(cfg)
    }

    /// Internal consistency of the sizes.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("n_layers", self.n_layers),
            ("n_heads", self.n_heads),
            ("n_kv_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_key_heads", self.linear_key_heads),
            ("linear_value_heads", self.linear_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, "must be positive"));
            }
        }
        if self.layer_kinds.len() != self.n_layers {
            return Err(invalid(
                "layer_kinds",
                format!(
                    "{} entries for {} layers",
                    self.layer_kinds.len(),
                    self.n_layers
                ),
            ));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return Err(invalid(
                "n_heads",
                format!(
                    "{} is not a multiple of n_kv_heads {}",
                    self.n_heads, self.n_kv_heads
                ),
            ));
        }
        if self.linear_value_heads % self.linear_key_heads != 0 {
            return Err(invalid(
                "linear_value_heads",
                format!(
                    "{} is not a multiple of linear_key_heads {}",
                    self.linear_value_heads, self.linear_key_heads
                ),
            ));
        }
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(invalid(
                "rotary_dim",
                format!(
                    "{} must be even, positive and at most head_dim {}",
                    self.rotary_dim, self.head_dim
                ),
            ));
        }
        if self.conv_kernel < 2 {
            return Err(invalid(
                "conv_kernel",
                format!("{} (need at least 2)", self.conv_kernel),
            ));
        }
        if !(0.0..1.0).contains(&self.rms_norm_eps) || self.rms_norm_eps == 0.0 {
            return Err(invalid(
                "rms_norm_eps",
                format!("{} is not in (0, 1)", self.rms_norm_eps),
            ));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 1.0 {
            return Err(invalid(
                "rope_theta",
                format!("{} must be above 1", self.rope_theta),
            ));
        }
        Ok(())
    }

    /// DeltaNet query/key width `n_k · dk`.
    pub fn linear_key_dim(&self) -> usize {
        self.linear_key_heads * self.linear_key_head_dim
    }

    /// DeltaNet value width `n_v · dv`.
    pub fn linear_value_dim(&self) -> usize {
        self.linear_value_heads * self.linear_value_head_dim
    }

    /// Channels of the DeltaNet conv: `[q | k | v]`.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_key_dim() + self.linear_value_dim()
    }

    /// An upper estimate of the device bytes one token of a forward pass holds at the pass's peak, for
    /// sizing passes from free memory: the residual stream with its normed copy and the widest layer's
    /// intermediates — the SwiGLU's gate|up, product and quantized copy, a DeltaNet layer's projections,
    /// conv output and chunk states (one `dk × dv` state per head and 64 tokens), or an attention
    /// layer's gated query, keys and values — all counted as f32, plus the K/V rows (bf16) the token
    /// leaves in every attention layer. Not a bound on the pool's fragmentation; callers keep a margin.
    pub fn pass_bytes_per_token(&self) -> usize {
        let stream = 3 * self.hidden_size;
        let mlp = 4 * self.intermediate_size;
        let projections = self.conv_dim() + self.linear_value_dim() + 2 * self.linear_value_heads;
        let chunk_states =
            self.linear_value_heads * self.linear_key_head_dim * self.linear_value_head_dim / 64;
        let delta = 2 * projections + chunk_states + 64 * self.linear_value_heads;
        let attention = 2 * self.n_heads * self.head_dim + 2 * self.n_kv_heads * self.head_dim;
        let widest = mlp.max(delta).max(attention);
        let attention_layers = self
            .layer_kinds
            .iter()
            .filter(|kind| **kind == LayerKind::Attention)
            .count();
        let kv_rows = attention_layers * 2 * self.n_kv_heads * self.head_dim * 2;
        (stream + widest) * 4 + kv_rows
    }

    /// Reads `config.json` (multimodal `text_config` or a flat text config) and checks it against this
    /// configuration.
    pub fn check_hf_config_file(&self, path: &Path) -> Result<()> {
        self.check_hf_config(&read_hf_config(path)?)
    }

    /// Compares every field `config.json` states with what the GGUF says; fields it leaves out are not
    /// checked. A disagreement is a [`ModelError::ConfigMismatch`] naming the field.
    pub fn check_hf_config(&self, json: &Value) -> Result<()> {
        let text = hf_text_config(json);
        let mismatch = |field: &str, gguf: String, hf: &Value| ModelError::ConfigMismatch {
            field: field.to_string(),
            gguf,
            config_json: hf.to_string(),
        };
        // The fields of `validate`'s list above under config.json's names (with the conv kernel too):
        // two tables, each in its own names.
        let ints = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.n_layers),
            ("num_attention_heads", self.n_heads),
            ("num_key_value_heads", self.n_kv_heads),
            ("head_dim", self.head_dim),
            ("linear_conv_kernel_dim", self.conv_kernel),
            ("linear_num_key_heads", self.linear_key_heads),
            ("linear_num_value_heads", self.linear_value_heads),
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
        ];
        for (field, ours) in ints {
            if let Some(v) = text.get(field) {
                if v.as_u64() != Some(ours as u64) {
                    return Err(mismatch(field, ours.to_string(), v));
                }
            }
        }
        // GGUF stores eps and theta as f32.
        let close = |a: f64, b: f64| (a - b).abs() <= 1e-6 * a.abs().max(b.abs());
        if let Some(v) = text.get("rms_norm_eps") {
            if !v.as_f64().is_some_and(|x| close(x, self.rms_norm_eps)) {
                return Err(mismatch("rms_norm_eps", self.rms_norm_eps.to_string(), v));
            }
        }
        let kinds: Vec<&str> = self.layer_kinds.iter().map(|k| k.hf_name()).collect();
        if let Some(v) = text.get("layer_types") {
            let theirs: Option<Vec<&str>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_str()).collect());
            if theirs.as_deref() != Some(kinds.as_slice()) {
                return Err(mismatch("layer_types", format!("{kinds:?}"), v));
            }
        } else if let Some(v) = text.get("full_attention_interval") {
            let ok = v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .filter(|&n| n > 0)
                .is_some_and(|n| {
                    self.layer_kinds == interval_layer_kinds(self.layer_kinds.len(), n)
                });
            if !ok {
                return Err(mismatch("full_attention_interval", format!("{kinds:?}"), v));
            }
        }
        // RoPE settings live in `rope_parameters` (transformers 5), `rope_scaling`, or at the top level.
        let rope_field = |name: &str| -> Option<&Value> {
            ["rope_parameters", "rope_scaling"]
                .iter()
                .filter_map(|section| text.get(*section).and_then(|s| s.get(name)))
                .next()
                .or_else(|| text.get(name))
        };
        if let Some(v) = rope_field("rope_theta") {
            if !v.as_f64().is_some_and(|x| close(x, self.rope_theta)) {
                return Err(mismatch("rope_theta", self.rope_theta.to_string(), v));
            }
        }
        if let Some(v) = rope_field("partial_rotary_factor") {
            let ok = v
                .as_f64()
                .is_some_and(|f| ((self.head_dim as f64) * f).round() as usize == self.rotary_dim);
            if !ok {
                return Err(mismatch(
                    "partial_rotary_factor",
                    format!(
                        "rotary dims {} of head_dim {}",
                        self.rotary_dim, self.head_dim
                    ),
                    v,
                ));
            }
        }
        if let Some(v) = rope_field("mrope_section") {
            let theirs: Option<Vec<u64>> = v
                .as_array()
                .and_then(|a| a.iter().map(|x| x.as_u64()).collect());
            let ours: Vec<u64> = self.mrope_sections.iter().map(|&s| s as u64).collect();
            if theirs.as_deref().map(|t| &t[..t.len().min(3)]) != Some(ours.as_slice()) {
                return Err(mismatch("mrope_section", format!("{ours:?}"), v));
            }
        }
        Ok(())
    }
}
