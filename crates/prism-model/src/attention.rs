//! Gated full attention (Qwen3.5's every-fourth layer).
//!
//! Per head, `attn_q` produces `[query | gate]`; query and key get a zero-centred RMSNorm and partial
//! M-RoPE; keys/values are grouped (GQA); the softmax runs in f32; the output is multiplied by
//! `σ(gate)` before `attn_output`. Projections run on the packed batch, the attention itself per sequence
//! against that sequence's K/V cache, stored as computed or as e4m3 with per-row scales
//! ([`crate::kv_fp8`]).

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Shape, Tensor};
use rayon::prelude::*;

use crate::config::Qwen35Config;
use crate::error::{ModelError, Result};
use crate::kv_fp8::{self, KvStorage};
use crate::linear::{FusedLinear, Linear, ProjInput};
use crate::matmul::{self, Float};
use crate::ops::{sigmoid_gate, softmax_last_dim};
use crate::qwen35::Segment;
use crate::rope::{HeadNorms, MRope};
use crate::state::{KvCache, KvRoom};
use crate::tensor_parallel::{check_share_columns, device_range, AllReduce};
use crate::weights::WeightLoader;

/// Weights of one attention layer (GGUF names in comments).
#[derive(Debug, Clone)]
pub struct Attention {
    /// The projections of the normed input as one [`FusedLinear`], parts in this order:
    /// - [`Attention::Q`] `attn_q`: `[n_h·2·hd, d]`, per head `[query (hd) | gate (hd)]`;
    /// - [`Attention::K`] `attn_k`: `[n_kv·hd, d]`;
    /// - [`Attention::V`] `attn_v`: `[n_kv·hd, d]`.
    pub qkv: FusedLinear,
    /// `attn_output`: `[d, n_h·hd]`.
    pub o: Linear,
    /// `attn_q_norm`, `attn_k_norm`: `[hd]`, stored as `1 + w`.
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    n_h: usize,
    n_kv: usize,
    hd: usize,
    eps: f64,
    /// How the layer stores keys and values in its [`KvCache`].
    kv: KvStorage,
}

impl Attention {
    /// Part indices of [`Attention::qkv`].
    pub const Q: usize = 0;
    pub const K: usize = 1;
    pub const V: usize = 2;

    /// Layer `layer`'s weights; keys and values will be stored as `kv` says.
    pub fn load(
        w: &WeightLoader<'_>,
        cfg: &Qwen35Config,
        layer: usize,
        kv: KvStorage,
    ) -> Result<Self> {
        let d = cfg.hidden_size;
        let (n_h, n_kv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let n = |s: &str| format!("blk.{layer}.{s}");
        let (q, k, v) = (n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight"));
        Ok(Self {
            qkv: w.fused_linear(&[(&q, 2 * n_h * hd), (&k, n_kv * hd), (&v, n_kv * hd)], d)?,
            o: w.linear(&n("attn_output.weight"), d, n_h * hd)?,
            q_norm: w.vector(&n("attn_q_norm.weight"), hd)?,
            k_norm: w.vector(&n("attn_k_norm.weight"), hd)?,
            n_h,
            n_kv,
            hd,
            eps: cfg.rms_norm_eps,
            kv,
        })
    }

    /// How this layer stores keys and values.
    pub fn kv_storage(&self) -> KvStorage {
        self.kv
    }

    /// Device `device` of `devices`' share ([`crate::tensor_parallel`]): its query heads and their KV
    /// heads (a query head `h` reads KV head `h / (n_h / n_kv)`, so a device's query heads read its own
    /// KV heads), and their input columns of `attn_output`, reduced by `reduce`.
    pub fn shard(&self, device: usize, devices: usize, reduce: Arc<dyn AllReduce>) -> Result<Self> {
        let hd = self.hd;
        let heads = device_range(self.n_h, device, devices);
        let kv = device_range(self.n_kv, device, devices);
        let cols = heads.start * hd..heads.end * hd;
        check_share_columns("attn_output", self.n_h * hd, &cols, device, devices)?;
        let rows = |r: std::ops::Range<usize>, per: usize| -> Vec<u32> {
            r.flat_map(|h| h * per..(h + 1) * per)
                .map(|x| x as u32)
                .collect()
        };
        Ok(Self {
            qkv: self.qkv.select_part_rows(&[
                rows(heads.clone(), 2 * hd),
                rows(kv.clone(), hd),
                rows(kv.clone(), hd),
            ])?,
            o: self.o.share_of_device(device, devices, reduce)?,
            q_norm: self.q_norm.clone(),
            k_norm: self.k_norm.clone(),
            n_h: heads.len(),
            n_kv: kv.len(),
            hd,
            eps: self.eps,
            kv: self.kv,
        })
    }

    /// `input`: the normed packed activation `[N, d]` (or its pending norm, see [`ProjInput`]);
    /// `cos`/`sin`: `[N, rotary_dim/2]` for the same rows. Returns the output and the sum a pending norm
    /// of `x + residual` formed.
    ///
    /// Appends each sequence's new keys and values to its cache (quantized first with fp8 storage, so
    /// that a token's own attention reads the same stored keys as every later token's) and attends
    /// over the whole cache. A cache in the other storage (a state of a model loaded otherwise) is
    /// refused.
    pub fn forward(
        &self,
        input: &ProjInput<'_>,
        rope: &MRope,
        cos: &Tensor,
        sin: &Tensor,
        segments: &[Segment],
        caches: &mut [&mut KvCache],
    ) -> Result<(Tensor, Option<Tensor>)> {
        if caches.len() != segments.len() {
            return Err(crate::ModelError::InvalidInput(format!(
                "attention: {} segments but {} states",
                segments.len(),
                caches.len()
            )));
        }
        let x = input.rows();
        let n_tokens = x.dim(0)?;
        let (n_h, n_kv, hd) = (self.n_h, self.n_kv, self.hd);
        let (proj, sum) = self.qkv.forward_input(input)?;
        // [n, n_h, query | gate]: a view of the projection's output (reshaping its column range
        // would copy it; 27B, 8,201 tokens: 0.7 ms a layer).
        let qg = proj.part_heads(Self::Q, n_h, 2 * hd)?;
        // The gate halves stay where the projection wrote them; the output gate reads them there.
        let gate = qg.narrow(2, hd, hd)?;
        let norms = HeadNorms {
            q_weight: &self.q_norm,
            k_weight: &self.k_norm,
            eps: self.eps,
        };
        // q/k norm + rotation (one kernel on CUDA, reading both in place). Where the flash kernel
        // serves the head dim on CUDA, q, k and v come in bf16 and the K/V cache is kept in bf16: the
        // kernel would round f32 operands to the same bf16 (RNE) on every call, the cached keys and
        // values included, so the bits are the same and nothing is converted twice.
        // With fp8 storage the keys stay f32 until they are quantized (one rounding, not two).
        let fp8 = self.kv.is_fp8();
        let kv_bf16 =
            !fp8 && x.device().is_cuda() && qg.dtype() == DType::F32 && flash_serves(hd, n_h, n_kv);
        let out_dtype = if kv_bf16 { DType::BF16 } else { qg.dtype() };
        let (q, k) = rope.norm_and_rotate(
            &qg.narrow(2, 0, hd)?,
            &proj.part(Self::K)?,
            &norms,
            cos,
            sin,
            out_dtype,
        )?;
        let v = if kv_bf16 {
            // One pass over the strided columns: the cast writes a contiguous copy.
            proj.part(Self::V)?
                .to_dtype(DType::BF16)?
                .reshape((n_tokens, n_kv, hd))?
        } else {
            proj.part(Self::V)?.reshape((n_tokens, n_kv, hd))?
        };

        let attend_timer =
            crate::profile::Section::start("attention: kernel + cache append", x.device())?;
        // fp8: every new row of the packed batch quantized at once ([N, n_kv, hd] bytes, [N, n_kv]
        // scales); a row's bytes depend on that row alone.
        let quantized = if fp8 {
            Some((kv_fp8::quantize(&k)?, kv_fp8::quantize(&v.contiguous()?)?))
        } else {
            None
        };
        let scale = 1.0 / (hd as f64).sqrt();
        let attn = match &quantized {
            Some(quantized) => self.attend_fp8(&q, quantized, segments, caches, scale)?,
            None => {
                let flash = x.device().is_cuda() && flash_serves(hd, n_h, n_kv);
                self.attend_native(&q, &k, &v, segments, caches, scale, flash)?
            }
        };
        attend_timer.stop()?;
        // attn · σ(gate), written in the dtype attn_output reads (bf16 for a bf16 GEMM on CUDA).
        let attn = sigmoid_gate(&attn, &gate, self.o.input_dtype(attn.dtype()))?;
        Ok((self.o.forward(&attn)?, sum))
    }

    /// Every segment's attention on native (bf16 / activation-dtype) storage, its new keys and values
    /// written into its cache's [`KvRoom`] in place; returns `[N, n_h·hd]`. Four phases, so that one
    /// launch can serve all segments on CUDA: (1) each segment takes its rows in a room, in segment
    /// order (a branch from its parent's cache after the parent's rows of this call): the room it shares
    /// if nobody has claimed past its length, else a new room that gets its prefix copied; (2) every
    /// segment's new rows written; (3) the prefixes copied (after (2): a branch's prefix may hold its
    /// parent's new rows); (4) attention, each segment over its room's first `past + T` rows.
    #[allow(clippy::too_many_arguments)]
    fn attend_native(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segments: &[Segment],
        caches: &mut [&mut KvCache],
        scale: f64,
        flash: bool,
    ) -> Result<Tensor> {
        let (n_kv, hd) = (self.n_kv, self.hd);
        let dtype = k.dtype();
        let dev = k.device();
        struct Plan {
            past: usize,
            room: Arc<KvRoom>,
            prefix: Option<(Tensor, Tensor)>,
        }
        let mut plans = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            // A branch reads its parent's keys and values, the parent's own tokens of this call included.
            if let Some(p) = seg.parent.filter(|&p| p < i) {
                let parent = caches[p].clone();
                *caches[i] = parent;
            }
            let cache = &mut *caches[i];
            if cache.is_fp8() {
                return Err(ModelError::InvalidInput(format!(
                    "attention: the state's K/V cache is fp8 but this model stores {} keys and values \
                     (a state made by a model loaded with other options)",
                    self.kv.as_str()
                )));
            }
            let (past, t) = (cache.len(), seg.len);
            let shared = cache
                .room
                .as_ref()
                .filter(|r| r.k.dtype() == dtype && r.claim(past, t))
                .cloned();
            let (room, prefix) = match shared {
                Some(room) => (room, None),
                None => {
                    let room = KvRoom::new(
                        n_kv,
                        KvRoom::rows_for(past + t, past),
                        hd,
                        dtype,
                        dev,
                        past + t,
                    )?;
                    let prefix = match (&cache.k, &cache.v) {
                        (Some(k), Some(v)) if past > 0 => Some((k.clone(), v.clone())),
                        _ => None,
                    };
                    (room, prefix)
                }
            };
            cache.k = Some(room.k.narrow(1, 0, past + t)?);
            cache.v = Some(room.v.narrow(1, 0, past + t)?);
            cache.room = Some(room.clone());
            plans.push(Plan { past, room, prefix });
        }
        // (2) The new rows.
        if !append_batch(
            k,
            v,
            segments,
            &plans.iter().map(|p| (p.past, &p.room)).collect::<Vec<_>>(),
        )? {
            for (seg, plan) in segments.iter().zip(&plans) {
                if seg.len == 0 {
                    continue;
                }
                let rows = |x: &Tensor| -> Result<Tensor> {
                    Ok(x.narrow(0, seg.start, seg.len)?
                        .transpose(0, 1)?
                        .contiguous()?)
                };
                plan.room.k.slice_set(&rows(k)?, 1, plan.past)?;
                plan.room.v.slice_set(&rows(v)?, 1, plan.past)?;
            }
        }
        // (3) The prefixes (a cache written in another dtype: its values, converted).
        for plan in &plans {
            if let Some((pk, pv)) = &plan.prefix {
                plan.room
                    .k
                    .slice_set(&pk.to_dtype(dtype)?.contiguous()?, 1, 0)?;
                plan.room
                    .v
                    .slice_set(&pv.to_dtype(dtype)?.contiguous()?, 1, 0)?;
            }
        }
        // (4) Attention.
        if let Some(o) = attend_batch(q, segments, caches, scale, flash)? {
            return Ok(o);
        }
        let mut outs = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            let cache = &*caches[i];
            let (Some(k_all), Some(v_all)) = (&cache.k, &cache.v) else {
                return Err(ModelError::InvalidInput(
                    "attention: a cache without keys".into(),
                ));
            };
            let q_s = q.narrow(0, seg.start, seg.len)?.contiguous()?; // [T, n_h, hd]
            let o = if dev.is_cpu() || flash {
                attend_segment(&q_s, k_all, v_all, plans[i].past, scale)?
            } else {
                attend_segment(
                    &q_s,
                    &k_all.contiguous()?,
                    &v_all.contiguous()?,
                    plans[i].past,
                    scale,
                )?
            };
            outs.push(o);
        }
        Ok(Tensor::cat(&outs, 0)?)
    }

    /// Every segment's attention on fp8 storage: the segment's new rows (quantized with the whole
    /// batch) appended to its cache by concatenation; returns `[N, n_h·hd]`.
    fn attend_fp8(
        &self,
        q: &Tensor,
        quantized: &((Tensor, Tensor), (Tensor, Tensor)),
        segments: &[Segment],
        caches: &mut [&mut KvCache],
        scale: f64,
    ) -> Result<Tensor> {
        let ((kq, ks), (vq, vs)) = quantized;
        let mut outs = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            // A branch reads its parent's keys and values, the parent's own tokens of this call included.
            if let Some(p) = seg.parent.filter(|&p| p < i) {
                let parent = caches[p].clone();
                *caches[i] = parent;
            }
            let cache = &mut *caches[i];
            if !cache.is_empty() && !cache.is_fp8() {
                return Err(ModelError::InvalidInput(format!(
                    "attention: the state's K/V cache is native but this model stores {} keys and values \
                     (a state made by a model loaded with other options)",
                    self.kv.as_str()
                )));
            }
            let t = seg.len;
            let past = cache.len();
            let q_s = q.narrow(0, seg.start, t)?.contiguous()?; // [T, n_h, hd]
                                                                // [n_kv, T, hd] bytes and [n_kv, T] scales of this sequence's new tokens.
            let rows = |x: &Tensor| -> Result<Tensor> {
                Ok(x.narrow(0, seg.start, t)?.transpose(0, 1)?.contiguous()?)
            };
            let append = |old: &Option<Tensor>, new: Tensor| -> Result<Tensor> {
                Ok(match old {
                    Some(old) => Tensor::cat(&[old, &new], 1)?,
                    None => new,
                })
            };
            let k_all = append(&cache.k, rows(kq)?)?;
            let v_all = append(&cache.v, rows(vq)?)?;
            let ks_all = append(&cache.k_scale, rows(ks)?)?;
            let vs_all = append(&cache.v_scale, rows(vs)?)?;
            let o = attend_segment_fp8(&q_s, [&k_all, &ks_all, &v_all, &vs_all], past, scale)?;
            outs.push(o);
            cache.k = Some(k_all);
            cache.v = Some(v_all);
            cache.k_scale = Some(ks_all);
            cache.v_scale = Some(vs_all);
            cache.room = None;
        }
        Ok(Tensor::cat(&outs, 0)?)
    }
}

/// [`attend_segment`] against an fp8 cache: `kv = [k, k_scale, v, v_scale]`, the e4m3 bytes `[n_kv,
/// past + T, hd]` (`U8`) and their scales `[n_kv, past + T]` (`F32`). On CUDA where the flash kernel
/// serves the head dim, its fp8 variant reads the bytes and scales and dequantizes in shared memory
/// ([`crate::cuda_flash::flash_attention_fp8`]: the same bits as dequantizing to bf16 first and running
/// the bf16 kernel); elsewhere (the CPU twin, other head dims) the keys and values are dequantized
/// into `q`'s dtype ([`kv_fp8::dequantize`]) and attended as in [`attend_segment`]. Every path reads
/// the dequantized value `decode(byte) · scale` (bf16-rounded by the flash kernels), so a row's
/// output is as batch-invariant as [`attend_segment`]'s.
pub fn attend_segment_fp8(q: &Tensor, kv: [&Tensor; 4], past: usize, scale: f64) -> Result<Tensor> {
    let [k, k_scale, v, v_scale] = kv;
    if q.device().is_cuda() {
        if let Some(o) = cuda_flash_fp8(q, kv, past, scale)? {
            return Ok(o);
        }
    }
    let dtype = match q.dtype() {
        DType::F64 => DType::F64,
        _ => DType::F32,
    };
    let k = kv_fp8::dequantize(k, k_scale, dtype)?;
    let v = kv_fp8::dequantize(v, v_scale, dtype)?;
    Ok(attend_segment(&q.to_dtype(dtype)?, &k, &v, past, scale)?)
}

/// Causal attention of one sequence's `T` new queries `q: [T, n_h, hd]` against its `past + T` keys and
/// values `[n_kv, past + T, hd]`; returns `[T, n_h·hd]`. The CPU runs [`CausalAttention`] (fixed order,
/// batch-invariant). CUDA runs the tensor-core flash kernel ([`crate::cuda_flash`], batch-invariant,
/// bf16 operands, f32 softmax) for head dims 64/128/256, whatever T; other head dims take our f32
/// kernel for short prompts and batched matmuls (not batch-invariant) for long ones. Other devices run
/// the tensor-op formulation.
pub fn attend_segment(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let (t, n_h, _) = q.dims3()?;
    let n_kv = k.dim(0)?;
    if n_kv == 0 || n_h % n_kv != 0 {
        candle_core::bail!("attention: {n_h} query heads do not group over {n_kv} KV heads");
    }
    let group = n_h / n_kv;
    if q.device().is_cpu() {
        let op = CausalAttention {
            past,
            n_heads: n_h,
            scale,
        };
        return q.apply_op3_no_bwd(k, v, &op);
    }
    if !q.device().is_cuda() {
        return attention_tensor_ops(q, k, v, past, group, scale);
    }
    // The tensor-core kernel, chosen by head dim only, never by T: a prefill and its later pieces
    // or decode steps must take the same kernel to give the same bits.
    if let Some(o) = cuda_flash(q, k, v, past, scale)? {
        return Ok(o);
    }
    // Head dims the flash kernel lacks: the f32 kernel for short prompts, matmuls for long ones.
    if q.dtype() == DType::F32 && t * (past + t) <= CUDA_KERNEL_MAX_SCORES {
        return cuda_attention(q, k, v, past, scale);
    }
    // Long prompts: the one-warp-per-row kernel rereads every key per query row; batched cuBLAS
    // matmuls use the tensor pipes. Query rows go in pieces to bound the score memory.
    let mut pieces = Vec::new();
    for start in (0..t).step_by(CUDA_QUERY_PIECE) {
        let len = CUDA_QUERY_PIECE.min(t - start);
        let keys = past + start + len;
        pieces.push(attention_tensor_ops(
            &q.narrow(0, start, len)?,
            &k.narrow(1, 0, keys)?,
            &v.narrow(1, 0, keys)?,
            past + start,
            group,
            scale,
        )?);
    }
    Tensor::cat(&pieces, 0)
}

/// Up to this many (query, key) scores per sequence and layer, CUDA runs our attention kernel; above it,
/// batched matmuls (see [`Attention::forward`]).
const CUDA_KERNEL_MAX_SCORES: usize = 512 * 1024;
/// Query rows per piece of the matmul path (the scores of one piece: heads × piece × keys f32).
const CUDA_QUERY_PIECE: usize = 2048;

/// The flash-attention kernel ([`crate::cuda_flash`]) where it supports the head layout, else `None`.
#[cfg(feature = "cuda")]
fn cuda_flash(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> candle_core::Result<Option<Tensor>> {
    let (_, n_h, hd) = q.dims3()?;
    if !crate::cuda_flash::supports(hd, n_h, k.dim(0)?) {
        return Ok(None);
    }
    crate::cuda_flash::flash_attention(q, k, v, past, scale).map(Some)
}

/// The fp8 flash kernel ([`crate::cuda_flash::flash_attention_fp8`]) where it supports the head
/// layout, else `None`.
#[cfg(feature = "cuda")]
fn cuda_flash_fp8(
    q: &Tensor,
    kv: [&Tensor; 4],
    past: usize,
    scale: f64,
) -> candle_core::Result<Option<Tensor>> {
    let (_, n_h, hd) = q.dims3()?;
    if !crate::cuda_flash::supports(hd, n_h, kv[0].dim(0)?) {
        return Ok(None);
    }
    crate::cuda_flash::flash_attention_fp8(q, kv, past, scale).map(Some)
}

#[cfg(not(feature = "cuda"))]
fn cuda_flash_fp8(
    _: &Tensor,
    _: [&Tensor; 4],
    _: usize,
    _: f64,
) -> candle_core::Result<Option<Tensor>> {
    Ok(None)
}

/// Whether [`attend_segment`] runs the flash kernel for this head layout on CUDA.
#[cfg(feature = "cuda")]
fn flash_serves(hd: usize, n_h: usize, n_kv: usize) -> bool {
    crate::cuda_flash::supports(hd, n_h, n_kv)
}

#[cfg(not(feature = "cuda"))]
fn flash_serves(_: usize, _: usize, _: usize) -> bool {
    false
}

#[cfg(not(feature = "cuda"))]
fn cuda_flash(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: usize,
    _: f64,
) -> candle_core::Result<Option<Tensor>> {
    Ok(None)
}

// These helpers take `attend_segment`'s parameters as they are, and each has a stub of the same
// signature for builds without CUDA, so that `attend_segment` itself needs no `cfg`.
#[cfg(feature = "cuda")]
fn cuda_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    crate::cuda::causal_attention(q, k, v, past, scale)
}

#[cfg(not(feature = "cuda"))]
fn cuda_attention(
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: usize,
    _: f64,
) -> candle_core::Result<Tensor> {
    candle_core::bail!("this build has no CUDA support")
}

/// Causal attention of `T` new queries against the `past + T` cached keys and values, for devices without
/// [`CausalAttention`]: batched matmuls (whose rounding depends on `T` and `past`) and an additive mask.
/// `q: [T, n_h, hd]`, `k, v: [n_kv, past + T, hd]`; returns `[T, n_h·hd]`.
fn attention_tensor_ops(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    past: usize,
    group: usize,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let (t, n_h, hd) = q.dims3()?;
    let n_kv = k.dim(0)?;
    let total = past + t;
    // Query head h reads KV head h / group: consecutive query heads share one KV head.
    let q_g = q
        .transpose(0, 1)?
        .contiguous()?
        .reshape((n_kv, group * t, hd))?;
    let scores = (q_g.matmul(&k.t()?)? * scale)?.reshape((n_kv, group, t, total))?;
    let scores = if t > 1 {
        scores.broadcast_add(&causal_mask(t, past, q.dtype(), q.device())?)?
    } else {
        scores
    };
    let probs = softmax_last_dim(&scores)?.reshape((n_kv, group * t, total))?;
    probs
        .matmul(v)?
        .reshape((n_h, t, hd))?
        .transpose(0, 1)?
        .reshape((t, n_h * hd))
}

/// Causal attention on the CPU with a fixed arithmetic per query row: query `t` (absolute position
/// `past + t`) reads exactly keys `0..=past + t`; its scores are [`matmul::dot`] products, the softmax
/// subtracts their maximum and divides by their [`matmul::sum`], and the output adds `p_j · v_j` in
/// increasing `j`. Nothing depends on how many queries are in the call or whether a key came from the
/// cache or the current piece, so a row's output is bit-identical however its sequence was split or
/// batched.
///
/// Inputs: `q: [T, n_h, hd]`, `k, v: [n_kv, past + T, hd]` (contiguous); query head `h` reads KV head
/// `h / (n_h / n_kv)`. Output: `[T, n_h·hd]`.
pub struct CausalAttention {
    pub past: usize,
    pub n_heads: usize,
    pub scale: f64,
}

/// `(T, n_h, n_kv, hd)` of an attention call's `q: [T, n_h, hd]` and `k, v: [n_kv, past + T, hd]`
/// after `past` cached tokens; `None` when the shapes do not fit one another (`n_kv ≥ 1` must divide
/// `n_h`).
pub(crate) fn attention_dims(
    q: &[usize],
    k: &[usize],
    v: &[usize],
    past: usize,
) -> Option<(usize, usize, usize, usize)> {
    match (q, k) {
        (&[t_len, n_h, hd], &[n_kv, total, hd_k])
            if v == k && hd_k == hd && total == past + t_len && n_kv != 0 && n_h % n_kv == 0 =>
        {
            Some((t_len, n_h, n_kv, hd))
        }
        _ => None,
    }
}

fn attend<F: Float>(
    q: &[F],
    k: &[F],
    v: &[F],
    (t_len, n_h, n_kv, hd): (usize, usize, usize, usize),
    kv_rows: usize,
    past: usize,
    scale: F,
) -> Vec<F> {
    let total = past + t_len;
    let group = n_h / n_kv;
    let mut out = vec![F::ZERO; t_len * n_h * hd];
    let one_row = |probs: &mut Vec<F>, (row, o): (usize, &mut [F])| {
        let (t, h) = (row / n_h, row % n_h);
        let kv = h / group;
        let q_row = &q[row * hd..(row + 1) * hd];
        let keys = &k[kv * kv_rows * hd..(kv * kv_rows + past + t + 1) * hd];
        let values = &v[kv * kv_rows * hd..(kv * kv_rows + past + t + 1) * hd];
        probs.clear();
        probs.extend(
            keys.chunks_exact(hd)
                .map(|k_j| matmul::dot(q_row, k_j) * scale),
        );
        let max = probs
            .iter()
            .copied()
            .fold(F::NEG_INFINITY, |m, s| if s > m { s } else { m });
        probs.iter_mut().for_each(|p| *p = (*p - max).exp());
        let total_weight = matmul::sum(probs);
        probs.iter_mut().for_each(|p| *p = *p / total_weight);
        for (&p, v_j) in probs.iter().zip(values.chunks_exact(hd)) {
            matmul::axpy(p, v_j, o);
        }
    };
    if matmul::use_threads(t_len * n_h * total * hd) {
        out.par_chunks_mut(hd)
            .enumerate()
            .for_each_init(Vec::new, one_row);
    } else {
        let mut probs = Vec::new();
        out.chunks_mut(hd)
            .enumerate()
            .for_each(|row| one_row(&mut probs, row));
    }
    out
}

fn contiguous<'a, T>(v: &'a [T], l: &Layout, what: &str) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((start, end)) => Ok(&v[start..end]),
        None => candle_core::bail!("causal attention: {what} must be contiguous"),
    }
}

/// [`attend`] on storages read where they lie: q contiguous, k and v in rows of each head.
fn attend_in_place<F: Float>(
    [q, k, v]: [&[F]; 3],
    [lq, lk, lv]: [&Layout; 3],
    dims: (usize, usize, usize, usize),
    past: usize,
    scale: F,
) -> candle_core::Result<Vec<F>> {
    let (k, v, rows) = kv_rows(head_rows(k, lk, "k")?, head_rows(v, lv, "v")?)?;
    Ok(attend(
        contiguous(q, lq, "q")?,
        k,
        v,
        dims,
        rows,
        past,
        scale,
    ))
}

/// Keys and values of one head stride, with it.
fn kv_rows<'a, T>(
    (k, rk): (&'a [T], usize),
    (v, rv): (&'a [T], usize),
) -> candle_core::Result<(&'a [T], &'a [T], usize)> {
    if rk != rv {
        candle_core::bail!(
            "causal attention: keys and values with head strides of {rk} and {rv} rows"
        );
    }
    Ok((k, v, rk))
}

/// Keys or values `[n_kv, total, hd]` whose heads are `rows ≥ total` rows apart, each head's rows
/// contiguous (a contiguous tensor, or a view of a [`crate::state::KvRoom`]): the elements from the
/// first and `rows`.
fn head_rows<'a, T>(v: &'a [T], l: &Layout, what: &str) -> candle_core::Result<(&'a [T], usize)> {
    if let Some((start, end)) = l.contiguous_offsets() {
        return Ok((&v[start..end], l.dims()[1]));
    }
    let (n_kv, total, hd) = l.shape().dims3()?;
    let stride = l.stride();
    if stride[2] != 1 || stride[1] != hd || hd == 0 || stride[0] % hd != 0 || stride[0] / hd < total
    {
        candle_core::bail!("causal attention: {what} must have contiguous rows of each head");
    }
    let rows = stride[0] / hd;
    let start = l.start_offset();
    let end = start + (n_kv.saturating_sub(1) * rows + total) * hd;
    match v.get(start..end) {
        Some(slice) => Ok((slice, rows)),
        None => candle_core::bail!("causal attention: {what} reaches past its storage"),
    }
}

impl CustomOp3 for CausalAttention {
    fn name(&self) -> &'static str {
        "causal-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let dims = attention_dims(l1.dims(), l2.dims(), l3.dims(), self.past)
            .filter(|&(_, n_h, _, _)| n_h == self.n_heads);
        let Some(dims @ (t_len, n_h, _, hd)) = dims else {
            candle_core::bail!(
                "causal attention: q {:?}, k {:?}, v {:?} do not fit {} heads after {} cached tokens",
                l1.shape().dims(),
                l2.shape().dims(),
                l3.shape().dims(),
                self.n_heads,
                self.past
            );
        };
        let layouts = [l1, l2, l3];
        let out = match (s1, s2, s3) {
            (CpuStorage::F32(q), CpuStorage::F32(k), CpuStorage::F32(v)) => CpuStorage::F32(
                attend_in_place([q, k, v], layouts, dims, self.past, self.scale as f32)?,
            ),
            (CpuStorage::F64(q), CpuStorage::F64(k), CpuStorage::F64(v)) => CpuStorage::F64(
                attend_in_place([q, k, v], layouts, dims, self.past, self.scale)?,
            ),
            _ => candle_core::bail!("causal attention: q, k, v must all be f32 or all f64"),
        };
        Ok((out, Shape::from((t_len, n_h * hd))))
    }
}

/// `[T, past + T]`: 0 where query `t` (absolute `past + t`) may read key `j`, −∞ where `j > past + t`.
fn causal_mask(
    t: usize,
    past: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let total = past + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Tensor::from_vec(mask, (t, total), device)?.to_dtype(dtype)
}

/// Phase (2) of [`Attention::attend_native`] in one launch per 64 segments on CUDA (bf16 rooms):
/// segment `i`'s rows of `k, v: [N, n_kv, hd]` to positions `rooms[i].0..` of room `rooms[i].1`. `false`
/// where it does not apply (the caller writes them one by one).
#[cfg(feature = "cuda")]
fn append_batch(
    k: &Tensor,
    v: &Tensor,
    segments: &[Segment],
    rooms: &[(usize, &Arc<KvRoom>)],
) -> Result<bool> {
    if !k.device().is_cuda()
        || k.dtype() != DType::BF16
        || v.dtype() != DType::BF16
        || k.dim(2)? % 8 != 0
    {
        return Ok(false);
    }
    let appends: Vec<crate::cuda_flash::KvAppend<'_>> = segments
        .iter()
        .zip(rooms)
        .map(|(seg, (past, room))| crate::cuda_flash::KvAppend {
            row: seg.start,
            len: seg.len,
            at: *past,
            k: &room.k,
            v: &room.v,
        })
        .collect();
    crate::cuda_flash::kv_append_batch(k, v, &appends)?;
    Ok(true)
}

#[cfg(not(feature = "cuda"))]
fn append_batch(
    _: &Tensor,
    _: &Tensor,
    _: &[Segment],
    _: &[(usize, &Arc<KvRoom>)],
) -> Result<bool> {
    Ok(false)
}

/// Phase (4) of [`Attention::attend_native`] in one launch per 64 segments on CUDA where the flash
/// kernel serves ([`crate::cuda_flash::flash_attention_batch`]: each segment's rows bit for bit its own
/// call's); `None` elsewhere.
#[cfg(feature = "cuda")]
fn attend_batch(
    q: &Tensor,
    segments: &[Segment],
    caches: &[&mut KvCache],
    scale: f64,
    flash: bool,
) -> Result<Option<Tensor>> {
    if !flash || !q.device().is_cuda() {
        return Ok(None);
    }
    let mut parts = Vec::with_capacity(segments.len());
    for (seg, cache) in segments.iter().zip(caches) {
        let (Some(k), Some(v)) = (&cache.k, &cache.v) else {
            return Err(ModelError::InvalidInput(
                "attention: a cache without keys".into(),
            ));
        };
        parts.push(crate::cuda_flash::FlashSegment {
            row: seg.start,
            len: seg.len,
            past: cache.len() - seg.len,
            k,
            v,
        });
    }
    Ok(Some(crate::cuda_flash::flash_attention_batch(
        q, &parts, scale,
    )?))
}

#[cfg(not(feature = "cuda"))]
fn attend_batch(
    _: &Tensor,
    _: &[Segment],
    _: &[&mut KvCache],
    _: f64,
    _: bool,
) -> Result<Option<Tensor>> {
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{bits, max_abs_diff};

    #[test]
    fn cpu_kernel_matches_the_tensor_op_fallback_and_ignores_the_split() {
        let dev = Device::Cpu;
        let (n_h, n_kv, hd, total) = (4, 2, 16, 12);
        let q = Tensor::randn(0f32, 1.0, (total, n_h, hd), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (n_kv, total, hd), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (n_kv, total, hd), &dev).unwrap();
        let scale = 0.25;
        let op = |past: usize| CausalAttention {
            past,
            n_heads: n_h,
            scale,
        };
        let all = q.apply_op3_no_bwd(&k, &v, &op(0)).unwrap();
        let fallback = attention_tensor_ops(&q, &k, &v, 0, n_h / n_kv, scale).unwrap();
        let d = max_abs_diff(&all, &fallback);
        assert!(d < 1e-5, "kernel vs tensor ops: {d}");
        // The last 5 queries against a cache of 7: the same bits as inside the full call.
        let tail = q
            .narrow(0, 7, 5)
            .unwrap()
            .apply_op3_no_bwd(&k, &v, &op(7))
            .unwrap();
        assert_eq!(bits(&tail), bits(&all.narrow(0, 7, 5).unwrap()));
        let fallback_tail =
            attention_tensor_ops(&q.narrow(0, 7, 5).unwrap(), &k, &v, 7, n_h / n_kv, scale)
                .unwrap();
        let d = max_abs_diff(&tail, &fallback_tail);
        assert!(d < 1e-5, "with a cache: {d}");
        // Shapes that do not fit are refused.
        assert!(q.apply_op3_no_bwd(&k, &v, &op(1)).is_err());
    }
}
