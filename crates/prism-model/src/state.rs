//! Per-sequence decoding state.
//!
//! A [`SequenceState`] holds everything a sequence needs to continue: the K/V cache of every attention
//! layer, the conv window and delta-rule state of every DeltaNet layer, the number of tokens seen and the
//! next M-RoPE position. Tensors are reference-counted, so `clone()` is cheap (no copy): that is how a
//! shared prefix branches into several continuations, and branches never see each other's writes.
//! Conv windows and delta-rule states are replaced by new tensors on every update. The K/V caches of
//! native storage live in [`KvRoom`]s with room to grow: a new token's keys and values are written in
//! place, at positions that no other state can read (a room's rows are claimed in order; a state that
//! would write rows someone else has claimed copies its prefix into a new room first).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

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

/// Keys and values of one attention layer with room to grow: `k, v: [n_kv, rows, head_dim]`, of which
/// the first `claimed` positions have been handed out. Shared (through `Arc`) by every [`KvCache`] that
/// reads a prefix of it; only the state whose length equals `claimed` may write the next rows.
#[derive(Debug)]
pub struct KvRoom {
    pub(crate) k: Tensor,
    pub(crate) v: Tensor,
    claimed: AtomicUsize,
}

impl KvRoom {
    /// An empty room of `rows` positions for `n_kv` heads of `hd` in `dtype`, with `claimed` rows
    /// handed out already (the caller writes them).
    pub(crate) fn new(
        n_kv: usize,
        rows: usize,
        hd: usize,
        dtype: DType,
        dev: &Device,
        claimed: usize,
    ) -> Result<Arc<Self>> {
        Ok(Arc::new(Self {
            k: Tensor::zeros((n_kv, rows, hd), dtype, dev)?,
            v: Tensor::zeros((n_kv, rows, hd), dtype, dev)?,
            claimed: AtomicUsize::new(claimed),
        }))
    }

    /// Positions it holds.
    pub fn rows(&self) -> usize {
        self.k.dims().get(1).copied().unwrap_or(0)
    }

    /// Claims positions `len..len + t` for a state of length `len`: true if nobody has claimed past
    /// `len` and they fit.
    pub(crate) fn claim(&self, len: usize, t: usize) -> bool {
        len + t <= self.rows()
            && self
                .claimed
                .compare_exchange(len, len + t, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Rows of a new room for a sequence that needs `needed` positions, `past` of them there before
    /// this call: a first allocation leaves 256 positions to spare (a question or the next steps after
    /// a prefill), a growing one half its length again; whole multiples of 256.
    pub fn rows_for(needed: usize, past: usize) -> usize {
        let spare = if past == 0 { 256 } else { needed / 2 };
        (needed + spare.max(1)).div_ceil(256) * 256
    }

    fn bytes(&self) -> usize {
        tensor_bytes(&self.k) + tensor_bytes(&self.v)
    }
}

/// K/V cache of one attention layer for one sequence, in the storage the model was loaded with
/// ([`crate::kv_fp8::KvStorage`]).
// A field list: alike in shape only to other structs' optional fields.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// Keys after k-norm and RoPE, `[n_kv, len, head_dim]`; `None` before the first token.
    /// - Native storage: in the activation dtype, except on CUDA where the flash kernel serves the head
    ///   dim: bf16 there (the kernel's operand dtype, rounded to nearest even from the f32 keys; see
    ///   `Attention::forward`).
    /// - fp8 storage: `U8`, each byte an e4m3 value ([`crate::kv_fp8`]); the key is
    ///   `decode(byte) · k_scale[head, token]`.
    pub k: Option<Tensor>,
    /// Values, `[n_kv, len, head_dim]`, stored like the keys.
    pub v: Option<Tensor>,
    /// fp8 storage only: the keys' scales, one f32 per KV head and token, `[n_kv, len]`; `None` for
    /// native storage.
    pub k_scale: Option<Tensor>,
    /// fp8 storage only: the values' scales, `[n_kv, len]`.
    pub v_scale: Option<Tensor>,
    /// Native storage: the room `k` and `v` are views of (their first `len` positions), shared with the
    /// states this one branched from or into.
    pub room: Option<Arc<KvRoom>>,
}

impl KvCache {
    /// Tokens held.
    pub fn len(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(1).ok()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The cache of the first `len` tokens (at most [`Self::len`]): views of the same tensors, sharing
    /// the room (a state continued from it copies its rows into a room of its own before writing, as
    /// any state behind the room's claim does).
    pub fn prefix(&self, len: usize) -> Result<Self> {
        if len > self.len() {
            return Err(crate::error::ModelError::InvalidInput(format!(
                "a K/V prefix of {len} tokens from a cache of {}",
                self.len()
            )));
        }
        if len == 0 {
            return Ok(Self::default());
        }
        let cut = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            Ok(match t {
                Some(t) => Some(t.narrow(1, 0, len)?),
                None => None,
            })
        };
        Ok(Self {
            k: cut(&self.k)?,
            v: cut(&self.v)?,
            k_scale: cut(&self.k_scale)?,
            v_scale: cut(&self.v_scale)?,
            room: self.room.clone(),
        })
    }

    /// Whether the cache holds e4m3 bytes with scales (an empty cache is neither: `false`).
    pub fn is_fp8(&self) -> bool {
        self.k_scale.is_some()
    }

    /// Bytes its tensors take (keys, values and, with fp8 storage, their scales); for a cache in a
    /// [`KvRoom`], the whole room (its spare positions too, and counted again by every state that
    /// shares it: an upper bound).
    pub fn bytes(&self) -> usize {
        if let Some(room) = &self.room {
            return room.bytes();
        }
        [&self.k, &self.v, &self.k_scale, &self.v_scale]
            .into_iter()
            .flatten()
            .map(tensor_bytes)
            .sum()
    }
}

fn tensor_bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
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
    ///
    /// Its DeltaNet layers share one set of zero tensors (state tensors are never written in place,
    /// except pending rows a state has claimed, and these are claimed by nobody: see
    /// [`crate::delta_rule::PendingRows::shared`]), so a fresh state is five allocations, not five a
    /// layer; its clones share them too (`Qwen35Model::new_state` hands out clones of one).
    pub fn new(config: &Qwen35Config, dtype: DType, device: &Device) -> Result<Self> {
        let zeros = if config.layer_kinds.contains(&LayerKind::DeltaNet) {
            let mut rule = RuleState::zeros(
                config.linear_value_heads,
                config.linear_key_head_dim,
                config.linear_value_head_dim,
                dtype,
                device,
            )?;
            rule.rows = crate::delta_rule::PendingRows::shared();
            Some(DeltaNetState {
                conv: Tensor::zeros((config.conv_kernel - 1, config.conv_dim()), dtype, device)?,
                rule,
            })
        } else {
            None
        };
        let layers = config
            .layer_kinds
            .iter()
            .map(|kind| match (kind, &zeros) {
                (LayerKind::DeltaNet, Some(z)) => Ok(LayerState::DeltaNet(z.clone())),
                (LayerKind::DeltaNet, None) => Err(crate::error::ModelError::InvalidInput(
                    "a DeltaNet layer without its zero state".into(),
                )),
                (LayerKind::Attention, _) => Ok(LayerState::Attention(KvCache::default())),
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
    /// state: a cache that keeps clones of one state counts it each time, an overestimate). K/V caches
    /// count what they hold: with fp8 storage one byte a value plus the f32 scales.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|layer| match layer {
                LayerState::DeltaNet(d) => {
                    tensor_bytes(&d.conv)
                        + tensor_bytes(&d.rule.chunk_start)
                        + tensor_bytes(&d.rule.pending_k)
                        + tensor_bytes(&d.rule.pending_u)
                        + tensor_bytes(&d.rule.pending_gamma)
                }
                LayerState::Attention(kv) => kv.bytes(),
            })
            .sum()
    }

    /// Bytes of the attention layers' K/V caches alone (part of [`SequenceState::bytes`]).
    pub fn kv_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|layer| match layer {
                LayerState::Attention(kv) => kv.bytes(),
                LayerState::DeltaNet(_) => 0,
            })
            .sum()
    }

    /// Per-layer state, in layer order (for inspection and tests).
    pub fn layers(&self) -> &[LayerState] {
        &self.layers
    }
}
