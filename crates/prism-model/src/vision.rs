//! The Qwen3.5 vision tower's configuration and weights, from an `mmproj` GGUF as llama.cpp's
//! `convert_hf_to_gguf.py --mmproj` writes it (`clip.*` keys, `v.*` and `mm.*` tensors; projector
//! `qwen3vl_merger`). Every key is checked and every tensor's shape is checked against the
//! configuration at load. The tower's forward pass is not here yet (issue #22).

use candle_core::{Device, Tensor};
use prism_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::weights::{Precision, WeightLoader};

/// The projector this tower implements (`clip.projector_type`).
pub const PROJECTOR: &str = "qwen3vl_merger";

/// The tower's shape (`clip.vision.*` keys).
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    /// Width of the ViT (`embedding_length`).
    pub hidden: usize,
    /// Width of each block's MLP (`feed_forward_length`).
    pub ffn: usize,
    /// ViT blocks (`block_count`).
    pub blocks: usize,
    /// Attention heads (`attention.head_count`).
    pub heads: usize,
    /// Patch side in pixels (`patch_size`).
    pub patch: usize,
    /// Patches merged per side into one output token (`spatial_merge_size`).
    pub merge: usize,
    /// Width of the merger's output: the decoder's hidden size (`projection_dim`).
    pub projection: usize,
    /// Side of the learned position grid, in patches (`image_size / patch_size`).
    pub position_grid: usize,
    /// LayerNorm epsilon (`attention.layer_norm_epsilon`).
    pub eps: f64,
    /// Normalization of the pixels (`image_mean`, `image_std`).
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

fn key_usize(gguf: &GgufFile, key: &str) -> Result<usize> {
    let v = gguf.get_u64(&format!("clip.vision.{key}"))?;
    usize::try_from(v).map_err(|_| ModelError::BadMetadata {
        key: format!("clip.vision.{key}"),
        reason: format!("{v} does not fit"),
    })
}

fn key_triple(gguf: &GgufFile, key: &str) -> Result<[f32; 3]> {
    let full = format!("clip.vision.{key}");
    let values = gguf.get_array(&full)?;
    let floats: Vec<f32> = values
        .iter()
        .filter_map(|v| v.as_f64().map(|x| x as f32))
        .collect();
    <[f32; 3]>::try_from(floats.as_slice()).map_err(|_| ModelError::BadMetadata {
        key: full,
        reason: format!("expected 3 numbers, found {} values", values.len()),
    })
}

impl VisionConfig {
    /// The configuration of an mmproj file: `general.architecture` `clip` with a vision encoder and the
    /// `qwen3vl_merger` projector, no deepstack layers (Qwen3.5 has none), every size positive and
    /// consistent (heads dividing the width, the position grid a whole number of patches).
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let arch = gguf.architecture()?;
        if arch != "clip" {
            return Err(ModelError::Unsupported(format!(
                "an mmproj file has architecture \"clip\", this one {arch:?}"
            )));
        }
        if !gguf.get_bool("clip.has_vision_encoder")? {
            return Err(ModelError::BadMetadata {
                key: "clip.has_vision_encoder".into(),
                reason: "false: the file has no vision tower".into(),
            });
        }
        let projector = gguf.get_str("clip.projector_type")?;
        if projector != PROJECTOR {
            return Err(ModelError::Unsupported(format!(
                "vision projector {projector:?}: this tower runs {PROJECTOR:?} (Qwen3.5)"
            )));
        }
        if let Some(layers) = gguf.get("clip.vision.is_deepstack_layers") {
            let any = match layers {
                prism_gguf::MetadataValue::Array(items) => {
                    items.iter().any(|v| v.as_bool() == Some(true))
                }
                _ => false,
            };
            if any {
                return Err(ModelError::Unsupported(
                    "deepstack vision layers (Qwen3-VL) are not supported: Qwen3.5 has none".into(),
                ));
            }
        }
        let image_size = key_usize(gguf, "image_size")?;
        let cfg = Self {
            hidden: key_usize(gguf, "embedding_length")?,
            ffn: key_usize(gguf, "feed_forward_length")?,
            blocks: key_usize(gguf, "block_count")?,
            heads: key_usize(gguf, "attention.head_count")?,
            patch: key_usize(gguf, "patch_size")?,
            merge: key_usize(gguf, "spatial_merge_size")?,
            projection: key_usize(gguf, "projection_dim")?,
            position_grid: 0,
            eps: gguf.get_f64("clip.vision.attention.layer_norm_epsilon")?,
            mean: key_triple(gguf, "image_mean")?,
            std: key_triple(gguf, "image_std")?,
        };
        let bad = |field: &str, reason: String| ModelError::InvalidConfig {
            field: format!("clip.vision.{field}"),
            reason,
        };
        for (field, v) in [
            ("embedding_length", cfg.hidden),
            ("feed_forward_length", cfg.ffn),
            ("block_count", cfg.blocks),
            ("attention.head_count", cfg.heads),
            ("patch_size", cfg.patch),
            ("spatial_merge_size", cfg.merge),
            ("projection_dim", cfg.projection),
        ] {
            if v == 0 {
                return Err(bad(field, "must be at least 1".into()));
            }
        }
        if cfg.hidden % cfg.heads != 0 {
            return Err(bad(
                "attention.head_count",
                format!("{} heads do not divide the width {}", cfg.heads, cfg.hidden),
            ));
        }
        if image_size == 0 || image_size % cfg.patch != 0 {
            return Err(bad(
                "image_size",
                format!(
                    "{image_size} is not a whole number of {}-pixel patches",
                    cfg.patch
                ),
            ));
        }
        if cfg.std.iter().any(|&s| s == 0.0 || !s.is_finite()) {
            return Err(bad("image_std", format!("{:?} has a zero", cfg.std)));
        }
        Ok(Self {
            position_grid: image_size / cfg.patch,
            ..cfg
        })
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Inputs of the merger's first linear: `merge²` patches side by side.
    pub fn merged_width(&self) -> usize {
        self.hidden * self.merge * self.merge
    }
}

/// One ViT block: pre-norm attention (fused q|k|v with biases) and a GELU MLP, both residual.
#[derive(Debug, Clone)]
pub struct VisionBlock {
    pub ln1: (Tensor, Tensor),
    /// `[3·hidden, hidden]` and `[3·hidden]`.
    pub qkv: (Tensor, Tensor),
    pub out: (Tensor, Tensor),
    pub ln2: (Tensor, Tensor),
    pub up: (Tensor, Tensor),
    pub down: (Tensor, Tensor),
}

/// The tower's weights, row-major in f32 (`[out, in]` for linears).
#[derive(Debug, Clone)]
pub struct VisionWeights {
    pub config: VisionConfig,
    /// The patch embedding's two temporal halves, `[hidden, 3, patch, patch]` each, and its bias.
    pub patch_embed: [Tensor; 2],
    pub patch_bias: Tensor,
    /// The learned positions, `[position_grid², hidden]`.
    pub positions: Tensor,
    pub blocks: Vec<VisionBlock>,
    pub post_ln: (Tensor, Tensor),
    /// The merger: `[merged_width, merged_width]` then `[projection, merged_width]`, with biases.
    pub merger: [(Tensor, Tensor); 2],
}

impl VisionWeights {
    /// Every tensor of the tower, each checked against `config` (missing or misshapen: an error naming
    /// it).
    pub fn load(gguf: &GgufFile, device: &Device) -> Result<Self> {
        let config = VisionConfig::from_gguf(gguf)?;
        let w = WeightLoader::new(gguf, device, Precision::F32);
        let (h, f, p) = (config.hidden, config.ffn, config.patch);
        let linear = |name: &str, rows: usize, cols: usize| -> Result<(Tensor, Tensor)> {
            Ok((
                w.f32_tensor(&format!("{name}.weight"), &[cols, rows])?,
                w.f32_tensor(&format!("{name}.bias"), &[rows])?,
            ))
        };
        let norm = |name: &str| -> Result<(Tensor, Tensor)> {
            Ok((
                w.f32_tensor(&format!("{name}.weight"), &[h])?,
                w.f32_tensor(&format!("{name}.bias"), &[h])?,
            ))
        };
        let blocks = (0..config.blocks)
            .map(|i| {
                let b = |s: &str| format!("v.blk.{i}.{s}");
                Ok(VisionBlock {
                    ln1: norm(&b("ln1"))?,
                    qkv: linear(&b("attn_qkv"), 3 * h, h)?,
                    out: linear(&b("attn_out"), h, h)?,
                    ln2: norm(&b("ln2"))?,
                    up: linear(&b("ffn_up"), f, h)?,
                    down: linear(&b("ffn_down"), h, f)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let grid = config.position_grid;
        let merged = config.merged_width();
        Ok(Self {
            patch_embed: [
                w.f32_tensor("v.patch_embd.weight", &[p, p, 3, h])?,
                w.f32_tensor("v.patch_embd.weight.1", &[p, p, 3, h])?,
            ],
            patch_bias: w.f32_tensor("v.patch_embd.bias", &[h])?,
            positions: w.f32_tensor("v.position_embd.weight", &[h, grid * grid])?,
            blocks,
            post_ln: norm("v.post_ln")?,
            merger: [
                linear("mm.0", merged, merged)?,
                linear("mm.2", config.projection, merged)?,
            ],
            config,
        })
    }
}
