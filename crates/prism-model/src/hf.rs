//! Loading the decoder from a Hugging Face checkpoint directory, for parity work against transformers:
//! `config.json` (a flat `Qwen3_5TextConfig`, or the multimodal wrapper's `text_config`) plus
//! `model.safetensors` (or the shards listed in `model.safetensors.index.json`), in bf16, f16 or f32.
//!
//! The HF tensors are converted once, at load, into exactly what the GGUF path reads (the transforms of
//! llama.cpp's `convert_hf_to_gguf.py`, reference doc §3.4), so both sources share every line of the
//! forward pass:
//! - zero-centred RMSNorm weights (every norm except the DeltaNet output norm) become `1 + w`;
//! - `A_log` becomes `ssm_a = −exp(A_log)`, computed in f32;
//! - `conv1d.weight [C, 1, K]` is read as GGUF's `[C, K]` (the same bytes: taps contiguous per channel);
//! - the DeltaNet value heads go from HF's grouped order (head `h = g·r + j` is value head `j` of key
//!   head `g`, `r = n_v / n_k`) to GGUF's tiled order (`h' = j·n_k + g`), on the V rows of
//!   `in_proj_qkv` and the V channels of `conv1d`, the rows of `in_proj_z`, `in_proj_a` and `in_proj_b`,
//!   the elements of `A_log` and `dt_bias`, and the input columns of `out_proj`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::safetensors::BufferedSafetensors;
use candle_core::DType;
use serde_json::Value;

use crate::config::{
    hf_text_config, interval_layer_kinds, read_hf_config, LayerKind, Qwen35Config,
};
use crate::error::{ModelError, Result};
use crate::qwen35::{LoadOptions, Qwen35Model};
use crate::weights::WeightLoader;

/// The configuration file of a checkpoint directory.
pub const CONFIG_FILE: &str = "config.json";
/// A single-file checkpoint.
pub const SAFETENSORS_FILE: &str = "model.safetensors";
/// The index of a sharded checkpoint (`weight_map`: tensor name → shard file).
pub const SAFETENSORS_INDEX_FILE: &str = "model.safetensors.index.json";
/// `model_type` of the dense Qwen3.5 text decoder.
pub const TEXT_MODEL_TYPE: &str = "qwen3_5_text";

/// What can go wrong reading a Hugging Face checkpoint. Every variant names the field, file or tensor.
/// Variants alike in shape (a path or name and a reason), here and in [`ModelError`], stay apart: each
/// says what failed in its own words.
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    #[error("config.json: field {field:?} is missing")]
    MissingConfigField { field: String },

    #[error("config.json: field {field:?}: {reason}")]
    BadConfigField { field: String, reason: String },

    #[error("{dir}: no {SAFETENSORS_FILE} and no {SAFETENSORS_INDEX_FILE}")]
    NoWeights { dir: PathBuf },

    #[error("cannot read {path}: {reason}")]
    Read { path: PathBuf, reason: String },

    #[error("{path} is not a valid safetensors file: {reason}")]
    Safetensors { path: PathBuf, reason: String },

    #[error("shard index {path}: {reason}")]
    ShardIndex { path: PathBuf, reason: String },

    #[error("tensor {name:?} is missing from the safetensors checkpoint")]
    MissingTensor { name: String },

    #[error("tensor {name:?} has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },

    #[error("tensor {name:?} has dtype {dtype}; only bf16, f16 and f32 are read")]
    TensorDtype { name: String, dtype: String },

    #[error("tensor {name:?}: {reason}")]
    TensorData { name: String, reason: String },

    #[error("no Hugging Face tensor corresponds to GGUF tensor {gguf_name:?}")]
    Unmapped { gguf_name: String },
}

fn missing(field: &str) -> ModelError {
    HfError::MissingConfigField {
        field: field.to_string(),
    }
    .into()
}

fn bad(field: &str, reason: impl Into<String>) -> ModelError {
    HfError::BadConfigField {
        field: field.to_string(),
        reason: reason.into(),
    }
    .into()
}

// -------------------------------------------------------------------------------------------------
// config.json
// -------------------------------------------------------------------------------------------------

/// The text decoder's configuration as `config.json` states it.
#[derive(Debug, Clone, PartialEq)]
pub struct HfTextConfig {
    pub config: Qwen35Config,
    /// The output head reuses the embedding matrix; `lm_head.weight` is then not read.
    pub tie_word_embeddings: bool,
}

/// The fields of the text config, named in errors by their path in the file (`text_config.hidden_size`).
struct Fields<'a> {
    root: &'a Value,
    text: &'a Value,
    prefix: &'static str,
}

impl<'a> Fields<'a> {
    fn new(json: &'a Value) -> Self {
        let text = hf_text_config(json);
        let prefix = if std::ptr::eq(text, json) {
            ""
        } else {
            "text_config."
        };
        Self {
            root: json,
            text,
            prefix,
        }
    }

    fn path(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.text.get(name).filter(|v| !v.is_null())
    }

    fn usize(&self, name: &str) -> Result<usize> {
        let field = self.path(name);
        let v = self.get(name).ok_or_else(|| missing(&field))?;
        v.as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| bad(&field, format!("{v} is not a non-negative integer")))
    }

    fn f64(&self, name: &str) -> Result<f64> {
        let field = self.path(name);
        let v = self.get(name).ok_or_else(|| missing(&field))?;
        v.as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(&field, format!("{v} is not a finite number")))
    }

    /// A RoPE setting: in `rope_parameters` (transformers 5), `rope_scaling`, or at the top level.
    fn rope(&self, name: &str) -> Option<(String, &'a Value)> {
        for section in ["rope_parameters", "rope_scaling"] {
            if let Some(v) = self
                .get(section)
                .and_then(|s| s.get(name))
                .filter(|v| !v.is_null())
            {
                return Some((self.path(&format!("{section}.{name}")), v));
            }
        }
        self.get(name).map(|v| (self.path(name), v))
    }

    fn rope_required(&self, name: &str) -> Result<(String, &'a Value)> {
        self.rope(name)
            .ok_or_else(|| missing(&self.path(&format!("rope_parameters.{name}"))))
    }

    /// `tie_word_embeddings`: true if the text config or the multimodal wrapper says so (wrappers keep
    /// it at the top level, and serialized text configs may carry the class default `false` next to a
    /// wrapper's `true`). Absent everywhere: false, transformers' default for Qwen3.5.
    fn tie_word_embeddings(&self) -> Result<bool> {
        let name = "tie_word_embeddings";
        let mut sources = vec![(self.path(name), self.get(name))];
        if !std::ptr::eq(self.root, self.text) {
            sources.push((
                name.to_string(),
                self.root.get(name).filter(|v| !v.is_null()),
            ));
        }
        let mut tied = false;
        for (field, value) in sources {
            if let Some(v) = value {
                tied |= v
                    .as_bool()
                    .ok_or_else(|| bad(&field, format!("{v} is not a boolean")))?;
            }
        }
        Ok(tied)
    }
}

impl HfTextConfig {
    /// Reads `config.json`.
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read_hf_config(path)?)
    }

    /// Every field the GGUF path reads from `qwen35.*` metadata, from the (text) config. A missing field
    /// is [`HfError::MissingConfigField`], a malformed one [`HfError::BadConfigField`]; the sizes are then
    /// checked for consistency ([`Qwen35Config::validate`]).
    pub fn from_json(json: &Value) -> Result<Self> {
        if !json.is_object() {
            return Err(bad("(root)", "not a JSON object"));
        }
        let f = Fields::new(json);
        if let Some(v) = f.get("model_type") {
            if v.as_str() != Some(TEXT_MODEL_TYPE) {
                return Err(bad(
                    &f.path("model_type"),
                    format!("{v}; this decoder runs {TEXT_MODEL_TYPE:?} (dense Qwen3.5)"),
                ));
            }
        }
        if let Some(v) = f.get("attn_output_gate") {
            if v.as_bool() != Some(true) {
                return Err(bad(
                    &f.path("attn_output_gate"),
                    format!("{v}; Qwen3.5 attention is always gated"),
                ));
            }
        }
        if let Some(v) = f.get("hidden_act") {
            if v.as_str() != Some("silu") {
                return Err(bad(
                    &f.path("hidden_act"),
                    format!("{v}; expected \"silu\""),
                ));
            }
        }

        let n_layers = f.usize("num_hidden_layers")?;
        let layer_kinds = match f.get("layer_types") {
            Some(v) => {
                let field = f.path("layer_types");
                let types = v.as_array().ok_or_else(|| bad(&field, "not an array"))?;
                if types.len() != n_layers {
                    return Err(bad(
                        &field,
                        format!("{} entries for num_hidden_layers {n_layers}", types.len()),
                    ));
                }
                types
                    .iter()
                    .enumerate()
                    .map(|(i, t)| {
                        t.as_str().and_then(LayerKind::from_hf_name).ok_or_else(|| {
                            bad(
                                &field,
                                format!(
                                    "entry {i} is {t}; expected \"{}\" or \"{}\"",
                                    LayerKind::DeltaNet.hf_name(),
                                    LayerKind::Attention.hf_name()
                                ),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let interval = match f.get("full_attention_interval") {
                    Some(_) => f.usize("full_attention_interval")?,
                    None => return Err(missing(&f.path("layer_types"))),
                };
                if interval == 0 {
                    return Err(bad(
                        &f.path("full_attention_interval"),
                        "must be at least 1",
                    ));
                }
                interval_layer_kinds(n_layers, interval)
            }
        };

        let head_dim = f.usize("head_dim")?;
        let (theta_field, theta) = f.rope_required("rope_theta")?;
        let rope_theta = theta
            .as_f64()
            .filter(|x| x.is_finite())
            .ok_or_else(|| bad(&theta_field, format!("{theta} is not a finite number")))?;
        let (factor_field, factor) = f.rope_required("partial_rotary_factor")?;
        let factor = factor
            .as_f64()
            .filter(|x| *x > 0.0 && *x <= 1.0)
            .ok_or_else(|| bad(&factor_field, format!("{factor} is not a number in (0, 1]")))?;
        let rotary = head_dim as f64 * factor;
        if rotary.fract() != 0.0 || rotary as usize % 2 != 0 {
            return Err(bad(
                &factor_field,
                format!("{factor} × head_dim {head_dim} = {rotary} is not an even number of dims"),
            ));
        }
        let rotary_dim = rotary as usize;
        let (sections_field, sections) = f.rope_required("mrope_section")?;
        // Read as config.rs reads the GGUF's `rope.dimension_sections`, but from JSON values and with
        // config.json's field names in the errors: the two walks share no value type.
        let sections: Vec<usize> = sections
            .as_array()
            .ok_or_else(|| bad(&sections_field, format!("{sections} is not an array")))?
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        bad(
                            &sections_field,
                            format!("entry {i} ({v}) is not a non-negative integer"),
                        )
                    })
            })
            .collect::<Result<_>>()?;
        let mrope_sections: [usize; 3] = match sections.as_slice() {
            [t, h, w] => [*t, *h, *w],
            other => {
                return Err(bad(
                    &sections_field,
                    format!("{} entries, expected 3", other.len()),
                ))
            }
        };
        if mrope_sections.iter().sum::<usize>() * 2 != rotary_dim {
            return Err(bad(
                &sections_field,
                format!(
                    "{sections:?} does not add up to rotary dims / 2 = {}",
                    rotary_dim / 2
                ),
            ));
        }

        let context_length = match f.get("max_position_embeddings") {
            Some(_) => f.usize("max_position_embeddings")?,
            None => 0,
        };
        let config = Qwen35Config {
            vocab_size: f.usize("vocab_size")?,
            hidden_size: f.usize("hidden_size")?,
            intermediate_size: f.usize("intermediate_size")?,
            n_layers,
            // MTP weights live under `mtp.*`, outside the decoder layers; they are never read.
            n_mtp_layers: 0,
            layer_kinds,
            n_heads: f.usize("num_attention_heads")?,
            n_kv_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            mrope_sections,
            rms_norm_eps: f.f64("rms_norm_eps")?,
            conv_kernel: f.usize("linear_conv_kernel_dim")?,
            linear_key_heads: f.usize("linear_num_key_heads")?,
            linear_value_heads: f.usize("linear_num_value_heads")?,
            linear_key_head_dim: f.usize("linear_key_head_dim")?,
            linear_value_head_dim: f.usize("linear_value_head_dim")?,
            context_length,
        };
        config.validate()?;
        Ok(Self {
            config,
            tie_word_embeddings: f.tie_word_embeddings()?,
        })
    }
}

// -------------------------------------------------------------------------------------------------
// safetensors files
// -------------------------------------------------------------------------------------------------

struct Shard {
    path: PathBuf,
    tensors: BufferedSafetensors,
}

/// The safetensors file(s) of a checkpoint directory, read into memory, with every tensor located.
pub struct HfCheckpoint {
    shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    routing: HashMap<String, usize>,
}

impl std::fmt::Debug for HfCheckpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfCheckpoint")
            .field(
                "shards",
                &self.shards.iter().map(|s| &s.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.routing.len())
            .finish()
    }
}

fn open_shard(path: &Path) -> Result<Shard> {
    let bytes = std::fs::read(path).map_err(|e| HfError::Read {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let tensors = BufferedSafetensors::new(bytes).map_err(|e| HfError::Safetensors {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    Ok(Shard {
        path: path.to_path_buf(),
        tensors,
    })
}

impl HfCheckpoint {
    /// Opens `dir/model.safetensors`, else the shards listed in `dir/model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<Self> {
        let single = dir.join(SAFETENSORS_FILE);
        if single.is_file() {
            let shard = open_shard(&single)?;
            let routing = shard
                .tensors
                .tensors()
                .into_iter()
                .map(|(name, _)| (name, 0))
                .collect();
            return Ok(Self {
                shards: vec![shard],
                routing,
            });
        }
        let index = dir.join(SAFETENSORS_INDEX_FILE);
        if index.is_file() {
            return Self::open_sharded(dir, &index);
        }
        Err(HfError::NoWeights {
            dir: dir.to_path_buf(),
        }
        .into())
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let err = |reason: String| HfError::ShardIndex {
            path: index.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(index).map_err(|e| err(e.to_string()))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| err("no \"weight_map\" object".into()))?;
        let mut shards: Vec<Shard> = Vec::new();
        let mut shard_of_file: HashMap<String, usize> = HashMap::new();
        let mut routing = HashMap::with_capacity(map.len());
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| err(format!("{name:?} maps to {file}, not a file name")))?;
            // Shards are siblings of the index; a name with a directory in it is not a shard.
            if file.is_empty() || file.contains(['/', '\\']) || file == ".." {
                return Err(err(format!(
                    "{name:?} maps to {file:?}, not a file in {}",
                    dir.display()
                ))
                .into());
            }
            let shard = match shard_of_file.get(file) {
                Some(&i) => i,
                None => {
                    shards.push(open_shard(&dir.join(file))?);
                    shard_of_file.insert(file.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            routing.insert(name.clone(), shard);
        }
        Ok(Self { shards, routing })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.routing.contains_key(name)
    }

    /// Names of every tensor in the checkpoint.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.routing.keys().map(String::as_str)
    }

    /// The shape of tensor `name` as stored.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        let shard = self.shard(name)?;
        let view = shard
            .tensors
            .get(name)
            .map_err(|_| HfError::MissingTensor {
                name: name.to_string(),
            })?;
        Ok(view.shape().to_vec())
    }

    fn shard(&self, name: &str) -> Result<&Shard> {
        self.routing
            .get(name)
            .and_then(|&i| self.shards.get(i))
            .ok_or_else(|| {
                HfError::MissingTensor {
                    name: name.to_string(),
                }
                .into()
            })
    }

    /// Tensor `name`, which must have exactly `shape`, as f32 values in storage (row-major) order.
    /// bf16 and f16 widen exactly.
    pub fn f32_values(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        // The same lookup as `shape` above: the view's type lives in the safetensors crate, which this
        // crate reaches only through candle, so no helper can return it.
        let shard = self.shard(name)?;
        let view = shard
            .tensors
            .get(name)
            .map_err(|_| HfError::MissingTensor {
                name: name.to_string(),
            })?;
        if view.shape() != shape {
            return Err(HfError::TensorShape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: view.shape().to_vec(),
            }
            .into());
        }
        let dtype_name = format!("{:?}", view.dtype());
        let dtype = DType::try_from(view.dtype()).map_err(|_| HfError::TensorDtype {
            name: name.to_string(),
            dtype: dtype_name.clone(),
        })?;
        let data = view.data();
        let n: usize = shape.iter().product();
        let width = match dtype {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
            _ => {
                return Err(HfError::TensorDtype {
                    name: name.to_string(),
                    dtype: dtype_name,
                }
                .into())
            }
        };
        if data.len() != n * width {
            return Err(HfError::TensorData {
                name: name.to_string(),
                reason: format!("{} bytes for {n} {dtype_name} values", data.len()),
            }
            .into());
        }
        let values = match dtype {
            DType::BF16 => data
                .chunks_exact(2)
                .map(|b| f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
                .collect(),
            DType::F16 => data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        };
        Ok(values)
    }
}

// -------------------------------------------------------------------------------------------------
// HF tensors seen through GGUF names
// -------------------------------------------------------------------------------------------------

/// What is done to an HF tensor's values to give the GGUF tensor's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueMap {
    AsIs,
    /// Zero-centred RMSNorm weight `w` → `1 + w`.
    PlusOne,
    /// `A_log` → `ssm_a = −exp(A_log)`.
    NegExp,
}

/// Which axis carries DeltaNet value heads that must go from grouped to tiled order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeadAxis {
    None,
    /// Rows `first .. first + n_v·per_head` of a row-major `[rows, cols]` tensor, `per_head` rows a head.
    Rows {
        first: usize,
        per_head: usize,
    },
    /// Columns, `per_head` columns a head.
    Cols {
        per_head: usize,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Source {
    hf_name: String,
    /// The HF tensor is `[C, 1, K]` where GGUF has `ne = [K, C]`.
    conv: bool,
    values: ValueMap,
    heads: HeadAxis,
}

/// A checkpoint read through GGUF tensor names and layouts: what [`WeightLoader`] reads for
/// [`Qwen35Model::from_hf_dir`].
#[derive(Debug)]
pub struct HfWeights<'a> {
    checkpoint: &'a HfCheckpoint,
    /// `model.` (text model) or `model.language_model.` (multimodal wrapper).
    prefix: &'static str,
    tied: bool,
    n_k: usize,
    n_v: usize,
    dv: usize,
    key_dim: usize,
}

impl<'a> HfWeights<'a> {
    pub fn new(checkpoint: &'a HfCheckpoint, hf: &HfTextConfig) -> Self {
        let wrapped = "model.language_model.";
        let prefix = if checkpoint.contains(&format!("{wrapped}embed_tokens.weight")) {
            wrapped
        } else {
            "model."
        };
        let cfg = &hf.config;
        Self {
            checkpoint,
            prefix,
            tied: hf.tie_word_embeddings,
            n_k: cfg.linear_key_heads,
            n_v: cfg.linear_value_heads,
            dv: cfg.linear_value_head_dim,
            key_dim: cfg.linear_key_dim(),
        }
    }

    /// The prefix of the decoder's tensors: `model.` or `model.language_model.`.
    pub fn prefix(&self) -> &str {
        self.prefix
    }

    /// Whether the GGUF tensor `gguf_name` exists: everything does except `output.weight` of a model
    /// with tied embeddings (a missing tensor is reported when it is read).
    pub fn contains(&self, gguf_name: &str) -> bool {
        gguf_name != "output.weight" || !self.tied
    }

    fn source(&self, gguf_name: &str) -> Result<Source> {
        let plain = |hf_name: String, values| Source {
            hf_name,
            conv: false,
            values,
            heads: HeadAxis::None,
        };
        let p = self.prefix;
        let unmapped = || -> ModelError {
            HfError::Unmapped {
                gguf_name: gguf_name.to_string(),
            }
            .into()
        };
        match gguf_name {
            "token_embd.weight" => {
                return Ok(plain(format!("{p}embed_tokens.weight"), ValueMap::AsIs))
            }
            "output.weight" => return Ok(plain("lm_head.weight".into(), ValueMap::AsIs)),
            "output_norm.weight" => return Ok(plain(format!("{p}norm.weight"), ValueMap::PlusOne)),
            _ => {}
        }
        let rest = gguf_name.strip_prefix("blk.").ok_or_else(unmapped)?;
        let (layer, tensor) = rest.split_once('.').ok_or_else(unmapped)?;
        let layer: usize = layer.parse().map_err(|_| unmapped())?;
        let hf = |s: &str| format!("{p}layers.{layer}.{s}");
        let v_rows = HeadAxis::Rows {
            first: 2 * self.key_dim,
            per_head: self.dv,
        };
        let head_rows = |per_head| HeadAxis::Rows { first: 0, per_head };
        let delta = |s: &str, values, heads| Source {
            hf_name: hf(&format!("linear_attn.{s}")),
            conv: false,
            values,
            heads,
        };
        let source = match tensor {
            "attn_norm.weight" => plain(hf("input_layernorm.weight"), ValueMap::PlusOne),
            "post_attention_norm.weight" => {
                plain(hf("post_attention_layernorm.weight"), ValueMap::PlusOne)
            }
            "ffn_gate.weight" => plain(hf("mlp.gate_proj.weight"), ValueMap::AsIs),
            "ffn_up.weight" => plain(hf("mlp.up_proj.weight"), ValueMap::AsIs),
            "ffn_down.weight" => plain(hf("mlp.down_proj.weight"), ValueMap::AsIs),
            "attn_q.weight" => plain(hf("self_attn.q_proj.weight"), ValueMap::AsIs),
            "attn_k.weight" => plain(hf("self_attn.k_proj.weight"), ValueMap::AsIs),
            "attn_v.weight" => plain(hf("self_attn.v_proj.weight"), ValueMap::AsIs),
            "attn_output.weight" => plain(hf("self_attn.o_proj.weight"), ValueMap::AsIs),
            "attn_q_norm.weight" => plain(hf("self_attn.q_norm.weight"), ValueMap::PlusOne),
            "attn_k_norm.weight" => plain(hf("self_attn.k_norm.weight"), ValueMap::PlusOne),
            "attn_qkv.weight" => delta("in_proj_qkv.weight", ValueMap::AsIs, v_rows),
            "attn_gate.weight" => delta("in_proj_z.weight", ValueMap::AsIs, head_rows(self.dv)),
            "ssm_alpha.weight" => delta("in_proj_a.weight", ValueMap::AsIs, head_rows(1)),
            "ssm_beta.weight" => delta("in_proj_b.weight", ValueMap::AsIs, head_rows(1)),
            "ssm_a" => delta("A_log", ValueMap::NegExp, head_rows(1)),
            "ssm_dt.bias" => delta("dt_bias", ValueMap::AsIs, head_rows(1)),
            "ssm_norm.weight" => delta("norm.weight", ValueMap::AsIs, HeadAxis::None),
            "ssm_out.weight" => delta(
                "out_proj.weight",
                ValueMap::AsIs,
                HeadAxis::Cols { per_head: self.dv },
            ),
            "ssm_conv1d.weight" => Source {
                conv: true,
                ..delta("conv1d.weight", ValueMap::AsIs, v_rows)
            },
            _ => return Err(unmapped()),
        };
        Ok(source)
    }

    /// The values GGUF tensor `gguf_name` with dims `ne` (ggml order) would hold, read from the HF
    /// tensor it was converted from (whose shape is checked) and transformed like the converter does.
    pub fn gguf_values(&self, gguf_name: &str, ne: &[usize]) -> Result<Vec<f32>> {
        let source = self.source(gguf_name)?;
        let shape: Vec<usize> = match (source.conv, ne) {
            (true, [k, c]) => vec![*c, 1, *k],
            (true, _) => return Err(self.layout_error(&source, ne)),
            (false, _) => ne.iter().rev().copied().collect(),
        };
        let mut values = self.checkpoint.f32_values(&source.hf_name, &shape)?;
        match source.values {
            ValueMap::AsIs => {}
            ValueMap::PlusOne => values.iter_mut().for_each(|w| *w += 1.0),
            ValueMap::NegExp => values.iter_mut().for_each(|a| *a = -a.exp()),
        }
        if self.n_v == self.n_k {
            return Ok(values);
        }
        // Row-major [rows, cols]: the last GGUF dim is the row count (C for the conv).
        let rows = if source.conv {
            shape[0]
        } else {
            ne.last().copied().unwrap_or(1)
        };
        let cols = values.len() / rows.max(1);
        match source.heads {
            HeadAxis::None => Ok(values),
            HeadAxis::Rows { first, per_head } => {
                if first + self.n_v * per_head > rows {
                    return Err(self.layout_error(&source, ne));
                }
                Ok(self.tile_rows(&values, cols, first, per_head))
            }
            HeadAxis::Cols { per_head } => {
                if self.n_v * per_head != cols {
                    return Err(self.layout_error(&source, ne));
                }
                Ok(self.tile_cols(&values, cols, per_head))
            }
        }
    }

    fn layout_error(&self, source: &Source, ne: &[usize]) -> ModelError {
        HfError::TensorData {
            name: source.hf_name.clone(),
            reason: format!(
                "GGUF dims {ne:?} do not hold {} value heads in the expected layout",
                self.n_v
            ),
        }
        .into()
    }

    /// The grouped (HF) value head that tiled (GGUF) value head `tiled` comes from.
    fn grouped_head(&self, tiled: usize) -> usize {
        let per_key = self.n_v / self.n_k;
        (tiled % self.n_k) * per_key + tiled / self.n_k
    }

    fn tile_rows(&self, values: &[f32], cols: usize, first: usize, per_head: usize) -> Vec<f32> {
        let mut out = values.to_vec();
        let block = per_head * cols;
        let start = first * cols;
        for tiled in 0..self.n_v {
            let from = start + self.grouped_head(tiled) * block;
            let to = start + tiled * block;
            out[to..to + block].copy_from_slice(&values[from..from + block]);
        }
        out
    }

    fn tile_cols(&self, values: &[f32], cols: usize, per_head: usize) -> Vec<f32> {
        let mut out = values.to_vec();
        for (row_in, row_out) in values.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
            for tiled in 0..self.n_v {
                let from = self.grouped_head(tiled) * per_head;
                let to = tiled * per_head;
                row_out[to..to + per_head].copy_from_slice(&row_in[from..from + per_head]);
            }
        }
        out
    }
}

impl Qwen35Model {
    /// Loads the model from a Hugging Face checkpoint directory (`config.json` and `model.safetensors`
    /// or its sharded index). The weights are converted once to the GGUF layout (module docs), so the
    /// forward pass is the GGUF path's. `options.hf_config` is not used: the directory's `config.json`
    /// is the configuration.
    pub fn from_hf_dir(dir: &Path, options: &LoadOptions) -> Result<Self> {
        let hf = HfTextConfig::from_file(&dir.join(CONFIG_FILE))?;
        let checkpoint = HfCheckpoint::open(dir)?;
        Self::from_hf_checkpoint(&hf, &checkpoint, options)
    }

    /// [`Self::from_hf_dir`] for an already opened configuration and checkpoint.
    pub fn from_hf_checkpoint(
        hf: &HfTextConfig,
        checkpoint: &HfCheckpoint,
        options: &LoadOptions,
    ) -> Result<Self> {
        let weights = HfWeights::new(checkpoint, hf);
        let loader = WeightLoader::from_hf(&weights, &options.device, options.precision);
        tracing::debug!(
            prefix = weights.prefix(),
            tied = hf.tie_word_embeddings,
            "loading qwen35 decoder from safetensors"
        );
        Self::from_weights(hf.config.clone(), &loader, hf.tie_word_embeddings, options)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn empty_checkpoint() -> HfCheckpoint {
        HfCheckpoint {
            shards: Vec::new(),
            routing: HashMap::new(),
        }
    }

    #[test]
    fn grouped_to_tiled_permutation() {
        let ckpt = empty_checkpoint();
        let w = HfWeights {
            checkpoint: &ckpt,
            prefix: "model.",
            tied: false,
            n_k: 2,
            n_v: 4,
            dv: 1,
            key_dim: 0,
        };
        // The fixture README's example: [k0v0, k0v1, k1v0, k1v1] → [k0v0, k1v0, k0v1, k1v1].
        let perm: Vec<usize> = (0..4).map(|t| w.grouped_head(t)).collect();
        assert_eq!(perm, [0, 2, 1, 3]);
        // 2 key heads × 3 value heads each (27B-like ratio): tiled h' = j·n_k + g ← grouped g·3 + j.
        let w3 = HfWeights { n_v: 6, ..w };
        let perm: Vec<usize> = (0..6).map(|t| w3.grouped_head(t)).collect();
        assert_eq!(perm, [0, 3, 1, 4, 2, 5]);
        // Rows after a 1-row prefix, 2 columns; and columns.
        let values: Vec<f32> = (0..10).map(|v| v as f32).collect(); // 5 rows × 2
        assert_eq!(
            w.tile_rows(&values, 2, 1, 1),
            [0., 1., 2., 3., 6., 7., 4., 5., 8., 9.]
        );
        let values: Vec<f32> = (0..8).map(|v| v as f32).collect(); // 2 rows × 4
        assert_eq!(w.tile_cols(&values, 4, 1), [0., 2., 1., 3., 4., 6., 5., 7.]);
    }

    #[test]
    fn every_gguf_name_maps_and_unknown_ones_do_not() {
        let ckpt = empty_checkpoint();
        let w = HfWeights {
            checkpoint: &ckpt,
            prefix: "model.language_model.",
            tied: true,
            n_k: 2,
            n_v: 4,
            dv: 64,
            key_dim: 128,
        };
        assert!(!w.contains("output.weight") && w.contains("token_embd.weight"));
        let s = w.source("blk.7.ssm_conv1d.weight").unwrap();
        assert_eq!(
            s.hf_name,
            "model.language_model.layers.7.linear_attn.conv1d.weight"
        );
        assert!(s.conv);
        assert_eq!(
            s.heads,
            HeadAxis::Rows {
                first: 256,
                per_head: 64
            }
        );
        assert_eq!(w.source("output.weight").unwrap().hf_name, "lm_head.weight");
        assert_eq!(w.source("blk.0.ssm_a").unwrap().values, ValueMap::NegExp);
        assert_eq!(
            w.source("blk.0.ssm_norm.weight").unwrap().values,
            ValueMap::AsIs
        );
        for bad in [
            "blk.x.attn_q.weight",
            "blk.0.nextn.eh_proj.weight",
            "rope_freqs.weight",
        ] {
            assert!(
                matches!(w.source(bad), Err(ModelError::Hf(HfError::Unmapped { .. }))),
                "{bad}"
            );
        }
    }
}
