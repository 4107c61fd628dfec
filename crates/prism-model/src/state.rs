//! Per-sequence decoding state.
//!
//! A [`SequenceState`] holds everything a sequence needs to continue: the K/V cache of every attention
//! layer, the conv window and delta-rule state of every DeltaNet layer, the number of tokens seen and the
//! next M-RoPE position. Tensors are immutable and reference-counted, so `clone()` is cheap (no copy):
//! that is how a shared prefix branches into several continuations. Updates always build new tensors, so
//! branches never see each other's writes.

use candle_core::{DType, Device, Tensor};

use crate::config::{LayerKind, Qwen35Config};
use crate::delta_rule::RuleState;
use crate::error::Result;

/// State of one DeltaNet layer for one sequence.
#[derive(Debug, Clone)]
pub struct DeltaNetState {
    /// The last `conv_kernel − 1` PRE-conv inputs (raw `attn_qkv` projections), `[K−1, conv_dim]` in the activation dtype,
    /// oldest first. Zeros at the sequence start.
    pub conv: Tensor,
    /// The delta-rule memory at the last 64-token boundary (`[n_v, dk, dv]`, key index on axis 1 as in
    /// transformers) and the rows of the chunk in progress.
    pub rule: RuleState,
}

/// K/V cache of one attention layer for one sequence.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Keys after k-norm and RoPE, `[n_kv, len, head_dim]`; `None` before the first token. In the
    /// activation dtype, except on CUDA where the flash kernel serves the head dim: bf16 there (the
    /// kernel's operand dtype, rounded to nearest even from the f32 keys; see `Attention::forward`).
    pub k: Option<Tensor>,
    /// Values, `[n_kv, len, head_dim]`, in the keys' dtype.
    pub v: Option<Tensor>,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(1).ok()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One layer's state.
#[derive(Debug, Clone)]
pub enum LayerState {
    DeltaNet(DeltaNetState),
    Attention(KvCache),
}

/// Everything one sequence needs to continue decoding.
#[derive(Debug, Clone)]
pub struct SequenceState {
    pub(crate) layers: Vec<LayerState>,
    /// Tokens processed so far (the KV length; DeltaNet chunks align to multiples of 64 of this count).
    pub(crate) n_tokens: usize,
    /// M-RoPE position of the next text token. Equals `n_tokens` for text-only prompts; kept separately
    /// because an image block advances it by `max(grid_h, grid_w)`, not by its token count.
    pub(crate) next_position: u32,
}

impl SequenceState {
    /// A fresh state (no tokens) for a model of this configuration; `dtype` is the activation dtype.
    pub fn new(config: &Qwen35Config, dtype: DType, device: &Device) -> Result<Self> {
        let layers = config
            .layer_kinds
            .iter()
            .map(|kind| -> Result<LayerState> {
                Ok(match kind {
                    LayerKind::DeltaNet => LayerState::DeltaNet(DeltaNetState {
                        conv: Tensor::zeros(
                            (config.conv_kernel - 1, config.conv_dim()),
                            dtype,
                            device,
                        )?,
                        rule: RuleState::zeros(
                            config.linear_value_heads,
                            config.linear_key_head_dim,
                            config.linear_value_head_dim,
                            dtype,
                            device,
                        )?,
                    }),
                    LayerKind::Attention => LayerState::Attention(KvCache::default()),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            n_tokens: 0,
            next_position: 0,
        })
    }

    /// Tokens processed so far.
    pub fn n_tokens(&self) -> usize {
        self.n_tokens
    }

    /// The position the next text token will get (on all three M-RoPE axes).
    pub fn next_position(&self) -> u32 {
        self.next_position
    }

    /// Device or host memory the state's tensors take, in bytes (shared tensors counted once per
    /// state: a cache that keeps clones of one state counts it each time, an overestimate).
    pub fn bytes(&self) -> usize {
        fn size(t: &Tensor) -> usize {
            t.elem_count() * t.dtype().size_in_bytes()
        }
        self.layers
            .iter()
            .map(|layer| match layer {
                LayerState::DeltaNet(d) => {
                    size(&d.conv)
                        + size(&d.rule.chunk_start)
                        + size(&d.rule.pending_k)
                        + size(&d.rule.pending_u)
                        + size(&d.rule.pending_gamma)
                }
                LayerState::Attention(kv) => {
                    kv.k.as_ref().map_or(0, size) + kv.v.as_ref().map_or(0, size)
                }
            })
            .sum()
    }

    /// Per-layer state, in layer order (for inspection and tests).
    pub fn layers(&self) -> &[LayerState] {
        &self.layers
    }
}
