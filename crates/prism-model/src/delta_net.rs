//! The Gated DeltaNet token mixer (Qwen3.5's linear-attention layers).
//!
//! Projections, the gated norm and the output projection run on the packed activation of the whole batch;
//! the causal conv and the delta rule run per sequence segment, each against its own state.

use std::sync::Arc;

use candle_core::Tensor;

use crate::config::Qwen35Config;
use crate::delta_rule;
use crate::error::{ModelError, Result};
use crate::linear::{FusedLinear, Linear, ProjInput};
use crate::ops::{delta_net_gates, l2_norm, l2_norm_scaled};
use crate::profile;
use crate::qwen35::Segment;
use crate::state::DeltaNetState;
use crate::tensor_parallel::{check_share_columns, device_range, AllReduce};
use crate::weights::WeightLoader;

/// The key heads device `device` of `devices` holds for its value heads ([`DeltaNet::shard`]): value
/// head `h` reads key head `h mod n_k`, so where the device's value heads are a whole number of `n_k`
/// (and start at a multiple of it) every key head in order, otherwise one key head per value head,
/// `h mod n_k` for each of its `h` (the delta rule then reads local key head `j` for local value head
/// `j`).
pub fn device_key_heads(n_k: usize, n_v: usize, device: usize, devices: usize) -> Vec<usize> {
    let values = device_range(n_v, device, devices);
    if n_k > 0 && values.len() % n_k == 0 && values.start % n_k == 0 {
        (0..n_k).collect()
    } else {
        values.map(|h| h % n_k.max(1)).collect()
    }
}

/// Weights of one DeltaNet layer (GGUF names in comments).
#[derive(Debug, Clone)]
pub struct DeltaNet {
    /// The four input projections of the normed input as one [`FusedLinear`], parts in this order:
    /// - [`DeltaNet::QKV`] `attn_qkv`: `[conv_dim, d]`, laid out `[q (n_k·dk) | k (n_k·dk) | v (n_v·dv)]`;
    /// - [`DeltaNet::Z`] `attn_gate`: `[n_v·dv, d]` (the `z` of the gated norm);
    /// - [`DeltaNet::BETA`] `ssm_beta`: `[n_v, d]`;
    /// - [`DeltaNet::ALPHA`] `ssm_alpha`: `[n_v, d]`.
    pub in_proj: FusedLinear,
    /// `ssm_conv1d` as taps: `[K, conv_dim]`, tap `K−1` multiplies the current token.
    pub conv_taps: Tensor,
    /// `ssm_a` = `−exp(A_log)`: `[n_v]`.
    pub ssm_a: Tensor,
    /// `ssm_dt.bias`: `[n_v]`.
    pub dt_bias: Tensor,
    /// `ssm_norm`: `[dv]`, a plain (not 1+w) weight.
    pub norm: Tensor,
    /// `ssm_out`: `[d, n_v·dv]`.
    pub out: Linear,
    n_k: usize,
    n_v: usize,
    dk: usize,
    dv: usize,
    eps: f64,
}

impl DeltaNet {
    /// Part indices of [`DeltaNet::in_proj`]. (Alike in shape to `Attention`'s dims and indices only:
    /// each layer kind names its own.)
    pub const QKV: usize = 0;
    pub const Z: usize = 1;
    pub const BETA: usize = 2;
    pub const ALPHA: usize = 3;

    pub fn load(w: &WeightLoader<'_>, cfg: &Qwen35Config, layer: usize) -> Result<Self> {
        let d = cfg.hidden_size;
        let n = |s: &str| format!("blk.{layer}.{s}");
        // GGUF [K, C] (ggml order): the taps as [K, C] row-major, channel-contiguous per tap.
        let conv_taps = w.activation_tensor_transposed(
            &n("ssm_conv1d.weight"),
            [cfg.conv_kernel, cfg.conv_dim()],
        )?;
        let names = [
            n("attn_qkv.weight"),
            n("attn_gate.weight"),
            n("ssm_beta.weight"),
            n("ssm_alpha.weight"),
        ];
        let rows = [
            cfg.conv_dim(),
            cfg.linear_value_dim(),
            cfg.linear_value_heads,
            cfg.linear_value_heads,
        ];
        let parts: Vec<(&str, usize)> = names.iter().map(String::as_str).zip(rows).collect();
        Ok(Self {
            in_proj: w.fused_linear(&parts, d)?,
            conv_taps,
            ssm_a: w.vector(&n("ssm_a"), cfg.linear_value_heads)?,
            dt_bias: w.vector(&n("ssm_dt.bias"), cfg.linear_value_heads)?,
            norm: w.vector(&n("ssm_norm.weight"), cfg.linear_value_head_dim)?,
            out: w.linear(&n("ssm_out.weight"), d, cfg.linear_value_dim())?,
            n_k: cfg.linear_key_heads,
            n_v: cfg.linear_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Device `device` of `devices`' share ([`crate::tensor_parallel`]): its value heads (their `v`,
    /// `z`, β, α rows, conv channels, `ssm_a`, `dt_bias` and `ssm_out` columns, reduced by `reduce`)
    /// and the query / key heads they read ([`device_key_heads`]).
    pub fn shard(&self, device: usize, devices: usize, reduce: Arc<dyn AllReduce>) -> Result<Self> {
        let (dk, dv) = (self.dk, self.dv);
        let values = device_range(self.n_v, device, devices);
        let keys = device_key_heads(self.n_k, self.n_v, device, devices);
        let cols = values.start * dv..values.end * dv;
        check_share_columns("ssm_out", self.n_v * dv, &cols, device, devices)?;
        let heads = |hs: &mut dyn Iterator<Item = usize>, per: usize, base: usize| -> Vec<u32> {
            hs.flat_map(|h| base + h * per..base + (h + 1) * per)
                .map(|x| x as u32)
                .collect()
        };
        // conv channels: [q (n_k·dk) | k (n_k·dk) | v (n_v·dv)], the rows of the qkv part.
        let mut channels = heads(&mut keys.iter().copied(), dk, 0);
        channels.extend(heads(&mut keys.iter().copied(), dk, self.n_k * dk));
        channels.extend(heads(&mut values.clone(), dv, 2 * self.n_k * dk));
        let dev = self.conv_taps.device();
        let index = Tensor::from_vec(channels.clone(), channels.len(), dev)?;
        let one_each: Vec<u32> = values.clone().map(|h| h as u32).collect();
        Ok(Self {
            in_proj: self.in_proj.select_part_rows(&[
                channels,
                heads(&mut values.clone(), dv, 0),
                one_each.clone(),
                one_each,
            ])?,
            conv_taps: self.conv_taps.index_select(&index, 1)?,
            ssm_a: self.ssm_a.narrow(0, values.start, values.len())?,
            dt_bias: self.dt_bias.narrow(0, values.start, values.len())?,
            norm: self.norm.clone(),
            out: self.out.share_of_device(device, devices, reduce)?,
            n_k: keys.len(),
            n_v: values.len(),
            dk,
            dv,
            eps: self.eps,
        })
    }

    /// `input`: the normed packed activation `[N, d]` (or its pending norm, see [`ProjInput`]);
    /// `segments[i]` is sequence `i`'s rows, `states[i]` its state (updated in place). Returns the mixer
    /// output `[N, d]`, for each segment with a [`Segment::snapshot`] point `p` its state after its first
    /// `p` rows (bit for bit the state a call on those rows alone leaves), and the sum a pending norm
    /// of `x + residual` formed.
    #[allow(clippy::type_complexity)]
    pub fn forward(
        &self,
        input: &ProjInput<'_>,
        segments: &[Segment],
        states: &mut [&mut DeltaNetState],
    ) -> Result<(Tensor, Vec<Option<DeltaNetState>>, Option<Tensor>)> {
        if states.len() != segments.len() {
            return Err(ModelError::InvalidInput(format!(
                "DeltaNet: {} segments but {} states",
                segments.len(),
                states.len()
            )));
        }
        let n_tokens = input.rows().dim(0)?;
        let dev = input.rows().device();
        // Parts of the fused projection stay column ranges of its output (views): the conv, the gates
        // and the gated norm read them in place on CUDA.
        let (mixed, z, beta, g, sum) =
            profile::time("deltanet: input projections", dev, || -> Result<_> {
                let (proj, sum) = self.in_proj.forward_input(input)?;
                let mixed = proj.part(Self::QKV)?;
                let z = proj.part(Self::Z)?;
                let (beta, g) = delta_net_gates(
                    &proj.part(Self::BETA)?,
                    &proj.part(Self::ALPHA)?,
                    &self.dt_bias,
                    &self.ssm_a,
                )?;
                Ok((mixed, z, beta, g, sum))
            })?;

        let (conv_out, snapshot_windows) = profile::time("deltanet: conv", dev, || {
            self.conv_silu(&mixed, segments, states)
        })?;
        // A snapshot's rule state is the delta rule's (below); its conv window comes from the conv.
        let mut snapshots: Vec<Option<DeltaNetState>> = Vec::with_capacity(segments.len());
        for (i, window) in snapshot_windows.into_iter().enumerate() {
            snapshots.push(window.map(|conv| DeltaNetState {
                conv,
                rule: states[i].rule.clone(),
            }));
        }

        let (q, k, v) = self.qkv_heads(&conv_out, n_tokens)?;
        let q = l2_norm_scaled(&q, 1e-6, 1.0 / (self.dk as f64).sqrt())?;
        let k = l2_norm(&k, 1e-6)?;
        // GGUF value heads are tiled: value head h reads key head h mod n_k. The delta rule reads q and
        // k that way (on CUDA in place, on the CPU through a tiled copy).

        let rule_timer = profile::Section::start("deltanet: delta rule", dev)?;
        // A branch starts from its parent's state right after the parent's rows; every starting state
        // must hold the sequence's length mod 64 pending rows.
        let mut pending = Vec::with_capacity(segments.len());
        let mut rule_segments = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            let parent = seg.parent.filter(|&p| p < i);
            let held = match parent {
                Some(p) => (pending[p] + segments[p].len) % delta_rule::CHUNK,
                None => states[i].rule.pending,
            };
            if held != seg.past % delta_rule::CHUNK {
                return Err(ModelError::InvalidInput(format!(
                    "DeltaNet state holds {held} tokens of the current chunk, but the sequence has {} tokens",
                    seg.past
                )));
            }
            pending.push(held);
            rule_segments.push(delta_rule::RuleSegment {
                start: seg.start,
                len: seg.len,
                parent,
                snapshot: seg.snapshot,
            });
        }
        let starts: Vec<delta_rule::RuleState> = states.iter().map(|s| s.rule.clone()).collect();
        // One call for the whole batch (on CUDA the independent segments share a launch); one path for
        // prefill, pieces and decode: bit-identical however a sequence is split or batched.
        let (o, rules, rule_snapshots) = delta_rule::chunked_batch_with_snapshots(
            &q,
            &k,
            &v,
            &g,
            &beta,
            &rule_segments,
            &starts,
        )?;
        for (((state, rule), snapshot), inside) in states
            .iter_mut()
            .zip(rules)
            .zip(snapshots.iter_mut())
            .zip(rule_snapshots)
        {
            state.rule = rule;
            if let Some(snapshot) = snapshot.as_mut() {
                snapshot.rule = inside.ok_or_else(|| {
                    ModelError::InvalidInput("DeltaNet: the delta rule took no snapshot".into())
                })?;
            }
        }
        rule_timer.stop()?;
        let out = profile::time(
            "deltanet: gated norm + output projection",
            dev,
            || -> Result<_> {
                // The norm in the dtype ssm_out reads (bf16 for a bf16 GEMM on CUDA), or on the integer
                // path on a GPU formed by its activation quantizer.
                Ok(self.out.forward_gated_norm(&o, &z, &self.norm, self.eps)?)
            },
        )?;
        Ok((out, snapshots, sum))
    }

    /// q, k and v of the conv output `conv_out: [N, q | k | v]` as `[N, heads, d]`. When the head sizes
    /// divide the row (every Qwen3.5 shape) they are views of it: the norms read q and k in place and
    /// the CUDA delta rule reads v through its row stride, where reshaping column ranges cost three
    /// copies a layer. Otherwise, reshaped copies.
    fn qkv_heads(&self, conv_out: &Tensor, n_tokens: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let key_dim = self.n_k * self.dk;
        let width = conv_out.dim(1)?;
        if self.dk == self.dv && width % self.dk == 0 && conv_out.is_contiguous() {
            let heads = conv_out.reshape((n_tokens, width / self.dk, self.dk))?;
            return Ok((
                heads.narrow(1, 0, self.n_k)?,
                heads.narrow(1, self.n_k, self.n_k)?,
                heads.narrow(1, 2 * self.n_k, self.n_v)?,
            ));
        }
        let part = |start: usize, heads: usize, d: usize| -> Result<Tensor> {
            Ok(conv_out
                .narrow(1, start, heads * d)?
                .reshape((n_tokens, heads, d))?)
        };
        Ok((
            part(0, self.n_k, self.dk)?,
            part(key_dim, self.n_k, self.dk)?,
            part(2 * key_dim, self.n_v, self.dv)?,
        ))
    }

    /// The causal conv of every segment's q|k|v rows (`mixed: [N, conv_dim]`, a column range of the
    /// projection) against its state's window, then SiLU: `[N, conv_dim]`. Updates each window, and
    /// returns per segment with a snapshot point `p` the window after its first `p` rows (the last
    /// K − 1 pre-conv rows before the point, the start window's rows where the point comes sooner).
    fn conv_silu(
        &self,
        mixed: &Tensor,
        segments: &[Segment],
        states: &mut [&mut DeltaNetState],
    ) -> Result<(Tensor, Vec<Option<Tensor>>)> {
        let mut snapshot_windows: Vec<Option<Tensor>> = vec![None; segments.len()];
        #[cfg(feature = "cuda")]
        if mixed.device().is_cuda() && mixed.dtype() == candle_core::DType::F32 {
            // Conv + SiLU into one output: a decode step's one-token segments that start from their
            // own window (no parent, nobody's parent) in one launch per 64, every other segment in a
            // launch of its own. Both give each row the bits it gets alone.
            let (n, c) = mixed.dims2()?;
            let mut out = crate::cuda::ConvSiluOutput::new(mixed, n, c)?;
            let mut is_parent = vec![false; segments.len()];
            for (i, seg) in segments.iter().enumerate() {
                if let Some(p) = seg.parent.filter(|&p| p < i) {
                    is_parent[p] = true;
                }
            }
            let one_token: Vec<usize> = (0..segments.len())
                .filter(|&i| {
                    let seg = &segments[i];
                    seg.len == 1
                        && seg.parent.filter(|&p| p < i).is_none()
                        && !is_parent[i]
                        && seg.snapshot.is_none()
                })
                .collect();
            let batched = one_token.len() > 1;
            if batched {
                let rows: Vec<usize> = one_token.iter().map(|&i| segments[i].start).collect();
                let windows: Vec<&Tensor> = one_token.iter().map(|&i| &states[i].conv).collect();
                let new = out.decode_rows(mixed, &rows, &windows, &self.conv_taps)?;
                for (&i, window) in one_token.iter().zip(new) {
                    states[i].conv = window;
                }
            }
            for (i, seg) in segments.iter().enumerate() {
                if batched && one_token.binary_search(&i).is_ok() {
                    continue;
                }
                if let Some(p) = seg.parent.filter(|&p| p < i) {
                    let window = states[p].conv.clone();
                    states[i].conv = window;
                }
                let (window, snapshot) = out.segment_with_snapshot(
                    &mixed.narrow(0, seg.start, seg.len)?,
                    seg.start,
                    &states[i].conv,
                    &self.conv_taps,
                    seg.snapshot,
                )?;
                states[i].conv = window;
                snapshot_windows[i] = snapshot;
            }
            return Ok((out.finish()?, snapshot_windows));
        }
        // The conv reads whole rows of q|k|v.
        let mixed = mixed.contiguous()?;
        let mut conv_out = Vec::with_capacity(segments.len());
        for (i, seg) in segments.iter().enumerate() {
            // A branch starts from its parent's window right after the parent's tokens.
            if let Some(p) = seg.parent.filter(|&p| p < i) {
                let window = states[p].conv.clone();
                states[i].conv = window;
            }
            let rows = mixed.narrow(0, seg.start, seg.len)?;
            if let Some(p) = seg.snapshot {
                snapshot_windows[i] = Some(window_at(&states[i].conv, &rows.narrow(0, 0, p)?)?);
            }
            let (out, window) = causal_conv(&rows, &states[i].conv, &self.conv_taps)?;
            states[i].conv = window;
            conv_out.push(out);
        }
        Ok((Tensor::cat(&conv_out, 0)?.silu()?, snapshot_windows))
    }
}

/// The conv window after `rows: [p, C]` (p ≥ 1) that follow `window: [K−1, C]`: the last K − 1 of
/// those rows together, contiguous.
fn window_at(window: &Tensor, rows: &Tensor) -> Result<Tensor> {
    let (keep, p) = (window.dim(0)?, rows.dim(0)?);
    Ok(if p >= keep {
        rows.narrow(0, p - keep, keep)?.contiguous()?
    } else {
        Tensor::cat(&[&window.narrow(0, p, keep - p)?, rows], 0)?.contiguous()?
    })
}

/// Causal depthwise conv of one segment `x: [T, C]` against the window `[K−1, C]` of earlier inputs, with
/// `taps: [K, C]`. Returns the pre-activation output `[T, C]` and the new window (the last K−1 inputs).
pub fn causal_conv(x: &Tensor, window: &Tensor, taps: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && x.dtype() == candle_core::DType::F32 {
        return Ok(crate::cuda::causal_conv(x, window, taps)?);
    }
    let t_len = x.dim(0)?;
    let k = taps.dim(0)?;
    let padded = Tensor::cat(&[window, x], 0)?; // [T + K − 1, C]
    let mut acc = padded
        .narrow(0, 0, t_len)?
        .broadcast_mul(&taps.narrow(0, 0, 1)?)?;
    for tap in 1..k {
        acc = (acc
            + padded
                .narrow(0, tap, t_len)?
                .broadcast_mul(&taps.narrow(0, tap, 1)?)?)?;
    }
    let new_window = padded.narrow(0, t_len, k - 1)?.contiguous()?;
    Ok((acc, new_window))
}
