//! Gated full attention (Qwen3.5's every-fourth layer).
//!
//! Per head, `attn_q` produces `[query | gate]`; query and key get a zero-centred RMSNorm and partial
//! M-RoPE; keys/values are grouped (GQA); the softmax runs in f32; the output is multiplied by
//! `σ(gate)` before `attn_output`. Projections run on the packed batch, the attention itself per sequence
//! against that sequence's K/V cache.

use candle_core::{DType, Device, Tensor};

use crate::config::Qwen35Config;
use crate::error::Result;
use crate::ops::{linear, rms_norm, sigmoid, softmax_last_dim};
use crate::qwen35::Segment;
use crate::rope::MRope;
use crate::state::KvCache;
use crate::weights::WeightLoader;

/// Weights of one attention layer (GGUF names in comments).
#[derive(Debug, Clone)]
pub struct Attention {
    /// `attn_q`: `[n_h·2·hd, d]`, per head `[query (hd) | gate (hd)]`.
    pub q: Tensor,
    /// `attn_k`: `[n_kv·hd, d]`.
    pub k: Tensor,
    /// `attn_v`: `[n_kv·hd, d]`.
    pub v: Tensor,
    /// `attn_output`: `[d, n_h·hd]`.
    pub o: Tensor,
    /// `attn_q_norm`, `attn_k_norm`: `[hd]`, stored as `1 + w`.
    pub q_norm: Tensor,
    pub k_norm: Tensor,
    n_h: usize,
    n_kv: usize,
    hd: usize,
    eps: f64,
}

impl Attention {
    pub fn load(w: &WeightLoader<'_>, cfg: &Qwen35Config, layer: usize) -> Result<Self> {
        let d = cfg.hidden_size;
        let (n_h, n_kv, hd) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let n = |s: &str| format!("blk.{layer}.{s}");
        Ok(Self {
            q: w.matrix(&n("attn_q.weight"), 2 * n_h * hd, d)?,
            k: w.matrix(&n("attn_k.weight"), n_kv * hd, d)?,
            v: w.matrix(&n("attn_v.weight"), n_kv * hd, d)?,
            o: w.matrix(&n("attn_output.weight"), d, n_h * hd)?,
            q_norm: w.vector(&n("attn_q_norm.weight"), hd)?,
            k_norm: w.vector(&n("attn_k_norm.weight"), hd)?,
            n_h,
            n_kv,
            hd,
            eps: cfg.rms_norm_eps,
        })
    }

    /// `x`: normed packed activation `[N, d]`; `cos`/`sin`: `[N, rotary_dim/2]` for the same rows.
    pub fn forward(
        &self,
        x: &Tensor,
        rope: &MRope,
        cos: &Tensor,
        sin: &Tensor,
        segments: &[Segment],
        caches: &mut [&mut KvCache],
    ) -> Result<Tensor> {
        let n_tokens = x.dim(0)?;
        let (n_h, n_kv, hd) = (self.n_h, self.n_kv, self.hd);
        let qg = linear(x, &self.q)?.reshape((n_tokens, n_h, 2 * hd))?;
        let q = rms_norm(&qg.narrow(2, 0, hd)?, &self.q_norm, self.eps)?;
        let gate = qg
            .narrow(2, hd, hd)?
            .contiguous()?
            .reshape((n_tokens, n_h * hd))?;
        let k = rms_norm(
            &linear(x, &self.k)?.reshape((n_tokens, n_kv, hd))?,
            &self.k_norm,
            self.eps,
        )?;
        let v = linear(x, &self.v)?.reshape((n_tokens, n_kv, hd))?;
        let q = rope.apply(&q, cos, sin)?;
        let k = rope.apply(&k, cos, sin)?;

        let group = n_h / n_kv;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut outs = Vec::with_capacity(segments.len());
        for (seg, cache) in segments.iter().zip(caches.iter_mut()) {
            let t = seg.len;
            let past = cache.len();
            let q_s = q.narrow(0, seg.start, t)?.transpose(0, 1)?.contiguous()?; // [n_h, T, hd]
            let k_s = k.narrow(0, seg.start, t)?.transpose(0, 1)?.contiguous()?; // [n_kv, T, hd]
            let v_s = v.narrow(0, seg.start, t)?.transpose(0, 1)?.contiguous()?;
            let (k_all, v_all) = match (&cache.k, &cache.v) {
                (Some(pk), Some(pv)) => {
                    (Tensor::cat(&[pk, &k_s], 1)?, Tensor::cat(&[pv, &v_s], 1)?)
                }
                _ => (k_s, v_s),
            };
            let total = past + t;
            // Query head h reads KV head h / group: consecutive query heads share one KV head.
            let q_g = q_s.reshape((n_kv, group * t, hd))?;
            let scores = (q_g.matmul(&k_all.t()?)? * scale)?.reshape((n_kv, group, t, total))?;
            let scores = if t > 1 {
                scores.broadcast_add(&causal_mask(t, past, x.dtype(), x.device())?)?
            } else {
                scores
            };
            let probs = softmax_last_dim(&scores)?.reshape((n_kv, group * t, total))?;
            let o = probs
                .matmul(&v_all)?
                .reshape((n_h, t, hd))?
                .transpose(0, 1)?
                .reshape((t, n_h * hd))?;
            outs.push(o);
            cache.k = Some(k_all);
            cache.v = Some(v_all);
        }
        let attn = Tensor::cat(&outs, 0)?.mul(&sigmoid(&gate)?)?;
        Ok(linear(&attn, &self.o)?)
    }
}

/// `[T, past + T]`: 0 where query `t` (absolute `past + t`) may read key `j`, −∞ where `j > past + t`.
fn causal_mask(t: usize, past: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let total = past + t;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..total).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    Ok(Tensor::from_vec(mask, (t, total), device)?.to_dtype(dtype)?)
}
