//! The Qwen3.5 vision tower's configuration and weights, from an `mmproj` GGUF as llama.cpp's
//! `convert_hf_to_gguf.py --mmproj` writes it (`clip.*` keys, `v.*` and `mm.*` tensors; projector
//! `qwen3vl_merger`). Every key is checked and every tensor's shape is checked against the
//! configuration at load. [`VisionWeights::forward`] is the tower's forward pass (transformers'
//! `Qwen3_5VisionModel`) on candle tensor ops in f32, so it runs on the CPU and on CUDA alike;
//! [`image_embedding_rows`] places its outputs at a prompt's image pad tokens for the decoder
//! ([`crate::BatchItem::embeddings`]).

use candle_core::{DType, Device, Tensor, D};
use prism_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::ops::{linear, softmax_last_dim};
use crate::weights::{Precision, WeightLoader};

/// Frames per temporal patch: the patch embedding is a Conv3d with a temporal kernel of 2, which
/// llama.cpp's converter stores as two kernels (`v.patch_embd.weight` for frame 0,
/// `v.patch_embd.weight.1` for frame 1). A still image is its own two frames.
pub const TEMPORAL_PATCH: usize = 2;

/// θ of the tower's 2-D rotary embedding. The mmproj has no key for it: transformers'
/// `rope_parameters.rope_theta` of every Qwen3-VL / Qwen3.5 release, and llama.cpp's `clip.cpp`, use 10000.
pub const ROPE_THETA: f32 = 10000.0;

/// Queries whose attention scores are computed at once: bounds the scores of a large image (a
/// 1,048,576-pixel image has 4,096 patches) to `heads · QUERY_CHUNK · patches` values.
pub const QUERY_CHUNK: usize = 1024;

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
        // The widths `SynthVisionSpec::check` also requires, here under their GGUF keys: a table each,
        // in its own names.
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
        if cfg.head_dim() % 4 != 0 {
            return Err(bad(
                "attention.head_count",
                format!(
                    "the head width {} is not a multiple of 4 (the 2-D rotary embedding splits it in \
                     row and column halves of sine and cosine pairs)",
                    cfg.head_dim()
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

    /// Values of one row of pixel values: 3 channels × [`TEMPORAL_PATCH`] frames × `patch²` pixels.
    pub fn patch_width(&self) -> usize {
        3 * TEMPORAL_PATCH * self.patch * self.patch
    }

    /// The number of output tokens of an image with patch grid `grid` (`[t, h, w]`):
    /// `t · h · w / merge²`. An error unless every side is at least 1, `h` and `w` are multiples of
    /// `merge`, and the patch count fits in memory arithmetic.
    pub fn output_tokens(&self, grid: [usize; 3]) -> Result<usize> {
        Ok(self.patches(grid)? / (self.merge * self.merge))
    }

    /// The patch count `t · h · w` of a valid grid (see [`Self::output_tokens`]).
    fn patches(&self, grid: [usize; 3]) -> Result<usize> {
        let [t, h, w] = grid;
        let bad = |reason: String| ModelError::ImageGrid { grid, reason };
        if t == 0 || h == 0 || w == 0 {
            return Err(bad("every side must be at least 1".into()));
        }
        if h % self.merge != 0 || w % self.merge != 0 {
            return Err(bad(format!(
                "height and width must be multiples of the merge size {}",
                self.merge
            )));
        }
        t.checked_mul(h)
            .and_then(|n| n.checked_mul(w))
            .and_then(|n| n.checked_mul(self.patch_width()).map(|_| n))
            .ok_or_else(|| bad("too many patches".into()))
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

/// The tower's weights, row-major in f32 (`[out, in]` for linears; the block and merger matrices in
/// bf16 after [`VisionWeights::with_matrices`]).
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

/// The tower's intermediate activations for one image (what [`VisionWeights::forward_traced`]
/// returns besides the output), each `[patches, hidden]` in merge-window order: for comparisons with
/// a reference stage by stage.
#[derive(Debug, Clone)]
pub struct VisionTrace {
    /// The patch embedding (the Conv3d) of every patch.
    pub patch_embed: Tensor,
    /// [`Self::patch_embed`] plus the interpolated learned positions: the first block's input.
    pub with_positions: Tensor,
    /// The output of each block.
    pub blocks: Vec<Tensor>,
    /// The merger's LayerNorm of the last block's output (before the 2×2 grouping).
    pub merger_norm: Tensor,
}

/// Where each patch of one frame lies, in merge-window order (window row, window column, row in the
/// window, column in the window): `(row, column)` in patches, `h · w` of them.
fn merge_window_order(h: usize, w: usize, m: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(h * w);
    for wr in 0..h / m {
        for wc in 0..w / m {
            for r in 0..m {
                for c in 0..m {
                    out.push((wr * m + r, wc * m + c));
                }
            }
        }
    }
    out
}

/// The two taps and weights along one axis that resample a `side`-long table to `size` outputs
/// bilinearly with aligned corners (output 0 on entry 0, output `size − 1` on entry `side − 1`), for
/// output `index`; computed in f32 in the order transformers computes them
/// (`_interpolation_axis_taps_weights`).
fn bilinear_taps(index: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = index as f32 * (side - 1) as f32 / size.saturating_sub(1).max(1) as f32;
    let floor = src.floor();
    let last = side - 1;
    let tap = |offset: usize| -> (usize, f32) {
        // `floor` is in 0..=side−1 since 0 ≤ index ≤ size − 1.
        let t = (floor as usize + offset).min(last);
        let distance = (src - floor - offset as f32).abs();
        (t, (1.0 - distance).max(0.0))
    };
    [tap(0), tap(1)]
}

/// LayerNorm over the last axis with the biased variance, as torch's `nn.LayerNorm`.
fn layer_norm(x: &Tensor, (weight, bias): &(Tensor, Tensor), eps: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == DType::F32 {
        return Ok(crate::cuda::layer_norm_rows(x, weight, bias, eps)?);
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let centred = x.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    let inv_std = (var + eps)?.sqrt()?.recip()?;
    Ok(centred
        .broadcast_mul(&inv_std)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)?)
}

/// q, k and v `[heads, n, head_dim]` of the fused `qkv` `[n, 3·heads·head_dim]`, q and k rotated
/// (`cos`, `sin`: `[n, 1, head_dim]`): `x · cos + rotate_half(x) · sin`. One kernel on CUDA.
fn qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    heads: usize,
    hd: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if qkv.device().is_cuda() && qkv.dtype() == DType::F32 {
        return Ok(crate::cuda::vision_qkv_rope(
            qkv,
            &cos.squeeze(1)?,
            &sin.squeeze(1)?,
            heads,
            hd,
        )?);
    }
    let n = qkv.dim(0)?;
    let qkv = qkv.reshape((n, 3, heads, hd))?;
    let rope = |t: &Tensor| -> Result<Tensor> {
        Ok((t.broadcast_mul(cos)? + rotate_half(t)?.broadcast_mul(sin)?)?)
    };
    let part = |i: usize| -> Result<Tensor> { Ok(qkv.narrow(1, i, 1)?.squeeze(1)?) };
    let heads_first = |t: Tensor| -> Result<Tensor> { Ok(t.transpose(0, 1)?.contiguous()?) };
    Ok((
        heads_first(rope(&part(0)?)?)?,
        heads_first(rope(&part(1)?)?)?,
        heads_first(part(2)?)?,
    ))
}

/// Softmax over the last axis of `scores · scale`. One kernel on CUDA.
fn scaled_softmax(scores: &Tensor, scale: f64) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if scores.device().is_cuda() && scores.dtype() == DType::F32 {
        return Ok(crate::cuda::softmax_scaled(scores, scale)?);
    }
    Ok(softmax_last_dim(&(scores * scale)?)?)
}

/// `x · Wᵀ + b` for a `(W [out, in], b [out])` pair ([`linear`]: row-invariant on the CPU).
fn affine(x: &Tensor, (weight, bias): &(Tensor, Tensor)) -> Result<Tensor> {
    Ok(linear(x, weight)?.broadcast_add(bias)?)
}

/// `[x₂ · −1, x₁]` of the two halves of the last axis (transformers' `rotate_half`).
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Ok(Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?)
}

impl VisionWeights {
    /// The tower with its block and merger matrices in `dtype`. BF16 on a GPU runs those products on
    /// the tensor cores (bf16 operands, f32 results); the patch embedding, norms, attention and
    /// everything between stay f32. The outputs then differ from the f32 tower by bf16 rounding (the
    /// device checks measure it); each image is still computed alone, so its embeddings do not depend
    /// on what else is encoded.
    pub fn with_matrices(mut self, dtype: DType) -> Result<Self> {
        let cast = |w: &mut Tensor| -> Result<()> {
            *w = w.to_dtype(dtype)?;
            Ok(())
        };
        for block in &mut self.blocks {
            cast(&mut block.qkv.0)?;
            cast(&mut block.out.0)?;
            cast(&mut block.up.0)?;
            cast(&mut block.down.0)?;
        }
        for m in &mut self.merger {
            cast(&mut m.0)?;
        }
        Ok(self)
    }

    /// The device the tower's weights live on (and its outputs are computed on).
    pub fn device(&self) -> &Device {
        self.positions.device()
    }

    /// The patch embedding as one matrix `[hidden, 3 · 2 · patch²]` over a row of pixel values
    /// (`[channel][frame][y][x]`): the two temporal kernels interleaved per channel, which is the
    /// Conv3d with kernel = stride as one product.
    pub fn patch_matrix(&self) -> Result<Tensor> {
        let h = self.config.hidden;
        Ok(
            Tensor::stack(&[&self.patch_embed[0], &self.patch_embed[1]], 2)?
                .reshape((h, self.config.patch_width()))?,
        )
    }

    /// The learned positions resampled to a `h × w` patch grid and laid out in merge-window order,
    /// `[h · w, hidden]` (transformers' `get_vision_interpolation_indices_and_weights`, bilinear with
    /// aligned corners, then the weighted sum of the four taps).
    pub fn interpolated_positions(&self, h: usize, w: usize) -> Result<Tensor> {
        let side = self.config.position_grid;
        let order = merge_window_order(h, w, self.config.merge);
        let mut index = Vec::with_capacity(order.len() * 4);
        let mut weight = Vec::with_capacity(order.len() * 4);
        for &(row, col) in &order {
            let rows = bilinear_taps(row, h, side);
            let cols = bilinear_taps(col, w, side);
            for (tr, wr) in rows {
                for (tc, wc) in cols {
                    // At most side² − 1, which indexes the loaded [side², hidden] table.
                    index.push((tr * side + tc) as u32);
                    weight.push(wr * wc);
                }
            }
        }
        let n = order.len();
        let dev = self.device();
        let index = Tensor::from_vec(index, n * 4, dev)?;
        let weight = Tensor::from_vec(weight, (n, 4, 1), dev)?;
        Ok(self
            .positions
            .index_select(&index, 0)?
            .reshape((n, 4, self.config.hidden))?
            .broadcast_mul(&weight)?
            .sum(1)?)
    }

    /// The 2-D rotary embedding's `(cos, sin)`, `[h · w, head_dim]` each, for a frame's patches in
    /// merge-window order: `head_dim / 4` frequencies `θ^(−4i/head_dim)` times the patch's row, then
    /// the same times its column, the pair repeated for the two rotated halves (transformers'
    /// `Qwen3_5VisionRotaryEmbedding`, computed in f32).
    pub fn rotary(&self, h: usize, w: usize) -> Result<(Tensor, Tensor)> {
        let hd = self.config.head_dim();
        let spatial = hd / 2;
        let inv_freq: Vec<f32> = (0..spatial)
            .step_by(2)
            .map(|i| 1.0 / ROPE_THETA.powf(i as f32 / spatial as f32))
            .collect();
        let order = merge_window_order(h, w, self.config.merge);
        let mut cos = Vec::with_capacity(order.len() * hd);
        let mut sin = Vec::with_capacity(order.len() * hd);
        let mut angles = Vec::with_capacity(spatial);
        for &(row, col) in &order {
            angles.clear();
            angles.extend(inv_freq.iter().map(|f| row as f32 * f));
            angles.extend(inv_freq.iter().map(|f| col as f32 * f));
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos()));
                sin.extend(angles.iter().map(|a| a.sin()));
            }
        }
        let dev = self.device();
        let n = order.len();
        Ok((
            Tensor::from_vec(cos, (n, hd), dev)?,
            Tensor::from_vec(sin, (n, hd), dev)?,
        ))
    }

    /// The tower's output for one image or video: `pixels` are its patches' pixel values
    /// `[t · h · w, 3 · 2 · patch²]` (f32; rows in merge-window order per frame, as
    /// `prism_decision::vision::patchify` makes them) and `grid` its patch grid `[t, h, w]`. Returns
    /// the merged tokens `[t · h · w / merge², projection]`, rows in the merged grid's raster order
    /// per frame: the embeddings that replace the image's pad tokens in the decoder's input.
    ///
    /// transformers' `Qwen3_5VisionModel`: the patch embedding, plus the learned positions
    /// interpolated to the grid; `blocks` pre-norm ViT blocks (LayerNorm → fused q|k|v → the 2-D
    /// rotary embedding → attention among the patches of one frame, no mask → output projection;
    /// LayerNorm → up → GELU (tanh) → down; both residual); then the merger (LayerNorm → each 2×2
    /// window's patches side by side → linear → GELU (erf) → linear). Frames never attend to each
    /// other, so an image's output depends on that image alone.
    pub fn forward(&self, pixels: &Tensor, grid: [usize; 3]) -> Result<Tensor> {
        self.run(pixels, grid, None)
    }

    /// [`Self::forward`] on pixel values in host memory (`patchify`'s `Vec<f32>`), copied to the
    /// tower's device.
    pub fn forward_pixels(&self, pixels: &[f32], grid: [usize; 3]) -> Result<Tensor> {
        let width = self.config.patch_width();
        if pixels.len() % width != 0 {
            return Err(ModelError::ImagePixels {
                grid,
                expected: [self.config.patches(grid)?, width],
                found: vec![pixels.len()],
            });
        }
        let rows = pixels.len() / width;
        let t = Tensor::from_slice(pixels, (rows, width), self.device())?;
        self.forward(&t, grid)
    }

    /// [`Self::forward`], also returning the intermediate activations.
    pub fn forward_traced(
        &self,
        pixels: &Tensor,
        grid: [usize; 3],
    ) -> Result<(Tensor, VisionTrace)> {
        let mut trace = Vec::new();
        let out = self.run(pixels, grid, Some(&mut trace))?;
        let n_blocks = self.blocks.len();
        let mut stages = trace.into_iter();
        let mut next = || {
            stages
                .next()
                .ok_or_else(|| ModelError::InvalidInput("vision trace is short".into()))
        };
        let patch_embed = next()?;
        let with_positions = next()?;
        let blocks = (0..n_blocks).map(|_| next()).collect::<Result<Vec<_>>>()?;
        let merger_norm = next()?;
        Ok((
            out,
            VisionTrace {
                patch_embed,
                with_positions,
                blocks,
                merger_norm,
            },
        ))
    }

    fn run(
        &self,
        pixels: &Tensor,
        grid: [usize; 3],
        mut trace: Option<&mut Vec<Tensor>>,
    ) -> Result<Tensor> {
        let cfg = &self.config;
        let n = cfg.patches(grid)?;
        let [frames, h, w] = grid;
        let width = cfg.patch_width();
        if pixels.dims() != [n, width] {
            return Err(ModelError::ImagePixels {
                grid,
                expected: [n, width],
                found: pixels.dims().to_vec(),
            });
        }
        let mut record = |t: &Tensor| {
            if let Some(tr) = trace.as_deref_mut() {
                tr.push(t.clone());
            }
        };
        let pixels = pixels.to_dtype(DType::F32)?.to_device(self.device())?;
        let x = linear(&pixels, &self.patch_matrix()?)?.broadcast_add(&self.patch_bias)?;
        record(&x);
        // Every frame has the same positions (transformers repeats them `t` times).
        let frame_positions = self.interpolated_positions(h, w)?;
        let (frame_cos, frame_sin) = self.rotary(h, w)?;
        let repeat = |t: &Tensor| -> Result<Tensor> {
            Ok(if frames == 1 {
                t.clone()
            } else {
                Tensor::cat(&vec![t; frames], 0)?
            })
        };
        let mut x = x.broadcast_add(&repeat(&frame_positions)?)?;
        record(&x);
        let (heads, hd) = (cfg.heads, cfg.head_dim());
        // [n, 1, head_dim]: one angle set per patch, shared by the heads.
        let cos = repeat(&frame_cos)?.unsqueeze(1)?;
        let sin = repeat(&frame_sin)?.unsqueeze(1)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let per_frame = h * w;
        for block in &self.blocks {
            let normed = layer_norm(&x, &block.ln1, cfg.eps)?;
            let qkv = affine(&normed, &block.qkv)?;
            // [heads, n, head_dim] each, the rotary embedding applied to q and k.
            let (q, k, v) = qkv_rope(&qkv, &cos, &sin, heads, hd)?;
            let mut outs = Vec::with_capacity(frames * per_frame.div_ceil(QUERY_CHUNK));
            for f in 0..frames {
                let part = |t: &Tensor| t.narrow(1, f * per_frame, per_frame);
                let (kt, vf) = (part(&k)?.t()?, part(&v)?);
                // Queries in chunks: the scores of one chunk at a time, `[heads, ≤ QUERY_CHUNK, h·w]`.
                for q0 in (0..per_frame).step_by(QUERY_CHUNK) {
                    let rows = QUERY_CHUNK.min(per_frame - q0);
                    let qc = q.narrow(1, f * per_frame + q0, rows)?;
                    let probs = scaled_softmax(&qc.matmul(&kt)?, scale)?;
                    outs.push(probs.matmul(&vf)?);
                }
            }
            let attn = if outs.len() == 1 {
                outs.swap_remove(0)
            } else {
                Tensor::cat(&outs, 1)?
            };
            let attn = attn
                .transpose(0, 1)?
                .contiguous()?
                .reshape((n, cfg.hidden))?;
            x = (x + affine(&attn, &block.out)?)?;
            let normed = layer_norm(&x, &block.ln2, cfg.eps)?;
            let up = affine(&normed, &block.up)?.gelu()?;
            x = (x + affine(&up, &block.down)?)?;
            record(&x);
        }
        let normed = layer_norm(&x, &self.post_ln, cfg.eps)?;
        record(&normed);
        let merged = normed.reshape((n / (cfg.merge * cfg.merge), cfg.merged_width()))?;
        let hidden = affine(&merged, &self.merger[0])?.gelu_erf()?;
        affine(&hidden, &self.merger[1])
    }
}

/// Each run of consecutive `pad` tokens in `tokens`, in order: `(first index, length)`.
pub fn pad_runs(tokens: &[u32], pad: u32) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (i, &t) in tokens.iter().enumerate() {
        if t != pad {
            continue;
        }
        match runs.last_mut() {
            Some((start, len)) if *start + *len == i => *len += 1,
            _ => runs.push((i, 1)),
        }
    }
    runs
}

/// The rows of a prompt's `tokens` that hold image pads (`pad`: the `<|image_pad|>` id) and the
/// images' embeddings stacked in the same order: what replaces those rows' token embeddings
/// ([`crate::BatchItem::embeddings`]). `images` are the tower's outputs in the order of the images in
/// the prompt. An error unless there is at least one image, the pads form exactly one run per image,
/// and each run is as long as that image's embedding rows (`[rows, width]`).
pub fn image_embedding_rows(
    tokens: &[u32],
    pad: u32,
    images: &[Tensor],
) -> Result<(Vec<usize>, Tensor)> {
    if images.is_empty() {
        return Err(ModelError::ImagePads {
            reason: "no images to place".into(),
        });
    }
    let runs = pad_runs(tokens, pad);
    if runs.len() != images.len() {
        return Err(ModelError::ImagePads {
            reason: format!(
                "the prompt has {} run(s) of image pads for {} image(s)",
                runs.len(),
                images.len()
            ),
        });
    }
    for (k, (&(start, len), image)) in runs.iter().zip(images).enumerate() {
        let rows = image.dims().first().copied().unwrap_or(0);
        if image.rank() != 2 || rows != len {
            return Err(ModelError::ImagePads {
                reason: format!(
                    "image {k}'s pads (from token {start}) are {len} tokens, its embeddings have \
                     shape {:?}",
                    image.dims()
                ),
            });
        }
    }
    let rows: Vec<usize> = runs
        .iter()
        .flat_map(|&(start, len)| start..start + len)
        .collect();
    Ok((rows, Tensor::cat(images, 0)?))
}
