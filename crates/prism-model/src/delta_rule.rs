//! The gated delta rule: the recurrence at the heart of a Gated DeltaNet layer.
//!
//! Per value head, with memory `S ∈ ℝ^{dk×dv}` and per-token `q̂, k̂ ∈ ℝ^{dk}`, `v ∈ ℝ^{dv}`, log-decay
//! `g ≤ 0` and write strength `β ∈ (0,1)`:
//!
//! ```text
//! S ← e^g · S;   δ = β (v − Sᵀk̂);   S ← S + k̂ δᵀ;   o = Sᵀq̂
//! ```
//!
//! [`recurrent`] is that loop, token by token (the test oracle). [`chunked`] is what the model runs: the
//! chunked (WY) form of transformers / FLA / llama.cpp, with chunks of [`CHUNK`] tokens at absolute
//! multiples of 64 counted from the sequence start, written row by row. Within a chunk starting from
//! memory `S₀`, with `Γ_r` the chunk-local cumulative log-decay and `D_rs = e^{Γ_r − Γ_s}`:
//!
//! ```text
//! u_r = β_r (v_r − e^{Γ_r} S₀ᵀk̂_r) − Σ_{s<r} β_r (k̂_r·k̂_s) D_rs u_s      (the "new values")
//! o_r = e^{Γ_r} S₀ᵀq̂_r + Σ_{s≤r} (q̂_r·k̂_s) D_rs u_s
//! S₆₄ = e^{Γ_63} S₀ + Σ_s e^{Γ_63 − Γ_s} k̂_s u_sᵀ                        (at the chunk's end)
//! ```
//!
//! Row `r` needs only `S₀` and rows `s < r` of its own chunk. So the state ([`RuleState`]) carries the
//! memory at the last chunk boundary plus the rows (`k̂_s`, `u_s`, `Γ_s`) of the incomplete chunk, and a
//! call that starts mid-chunk continues exactly where a one-shot run would be: every token sees the same
//! operations on the same values in the same order, so outputs and states are **bit-identical for any
//! split of a sequence into calls** (one-shot prefill, pieces, one token at a time) and independent of
//! the other sequences in a batch. A decode step costs about what the recurrent step does
//! (`~3·dk·dv + 2r·(dk + dv)` multiply-adds per head against `4·dk·dv`).
//!
//! All reductions use the fixed-order [`matmul::dot`] / [`matmul::axpy`]; decays are formed in f64 (over
//! a chunk `Γ` can reach hundreds, and `Γ_r − Γ_s` would lose ~|Γ|·1e-7 to cancellation in f32). On a
//! CUDA device (feature `cuda`), f32 tensors go to the twin kernels in `kernels/delta_rule.cu` (same
//! chunk boundaries and state, their own fixed per-element order); other devices copy to the host and
//! back.
//!
//! Shapes: `q, k: [T, H, dk]` (already expanded to the `H` value heads), `v: [T, H, dv]`, `g, beta:
//! [T, H]`, all of one float dtype (f32, or f64 for the ground-truth path). [`chunked_batch`] takes a
//! whole packed batch at once (several sequences, branches of a shared prefix, `q, k` with the key
//! heads only); on CUDA its independent sequences share one launch.

use candle_core::{DType, Device, Result, Tensor, WithDType};
use rayon::prelude::*;

use crate::matmul::{self, Float};

/// Chunk length of the chunked form (the value transformers, FLA and llama.cpp use).
pub const CHUNK: usize = 64;

/// The recurrent form: one token at a time from memory `state: [H, dk, dv]`. Returns
/// `(out [T, H, dv], new memory)`.
pub fn recurrent(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (t_len, heads, dk) = k.dims3()?;
    let dv = v.dim(2)?;
    let decay = g.exp()?.reshape((t_len, heads, 1, 1))?;
    let beta = beta.reshape((t_len, heads, 1, 1))?;
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(t_len);
    for t in 0..t_len {
        let q_t = q.get(t)?.reshape((heads, 1, dk))?;
        let k_t = k.get(t)?.reshape((heads, 1, dk))?;
        let v_t = v.get(t)?.reshape((heads, 1, dv))?;
        s = s.broadcast_mul(&decay.get(t)?)?;
        let read = k_t.matmul(&s)?; // [H, 1, dv] = k̂ᵀ S
        let delta = (v_t - read)?.broadcast_mul(&beta.get(t)?)?;
        s = (s + k_t.transpose(1, 2)?.matmul(&delta)?)?;
        outs.push(q_t.matmul(&s)?.reshape((heads, dv))?);
    }
    Ok((Tensor::stack(&outs, 0)?, s))
}

/// The delta-rule state of one sequence in one layer: the memory at the last chunk boundary and the
/// rows of the chunk in progress. Immutable tensors, so `clone()` is cheap and branches share it.
#[derive(Debug, Clone)]
pub struct RuleState {
    /// Memory at the last multiple of [`CHUNK`] tokens, `[H, dk, dv]`.
    pub chunk_start: Tensor,
    /// `k̂_s` of the chunk's first `pending` tokens, `[H, CHUNK, dk]` (rows from `pending` on unused).
    pub pending_k: Tensor,
    /// Their new values `u_s`, `[H, CHUNK, dv]`.
    pub pending_u: Tensor,
    /// Their chunk-local cumulative log-decays `Γ_s`, `[H, CHUNK]`, always f64.
    pub pending_gamma: Tensor,
    /// Tokens of the current chunk already processed (the sequence length mod [`CHUNK`]).
    pub pending: usize,
    /// Rows of the pending buffers handed out, shared by every state that reads a prefix of them (its
    /// clones and the states continued from it in place): a state whose `pending` equals it may write
    /// its next row into the buffers themselves; any other copies them first (see
    /// [`PendingRows::claim`]).
    pub rows: PendingRows,
}

/// The claim on a state's pending-row buffers: how many rows of them have been handed out. States
/// read only their first `pending` rows, so a continuation may write row `pending` in place when nobody
/// has claimed it — as [`crate::state::KvRoom`] does for K/V rows.
#[derive(Debug, Clone)]
pub struct PendingRows(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl PendingRows {
    /// A claim on fresh buffers whose first `rows` rows are written.
    pub fn new(rows: usize) -> Self {
        Self(std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(
            rows,
        )))
    }

    /// The claim on buffers several states share from the start (a fresh state's zeros, shared by its
    /// layers and by every fresh state of a model): nobody may write them in place, so every
    /// continuation copies them first.
    pub fn shared() -> Self {
        Self::new(usize::MAX)
    }

    /// Claims row `pending` for a state with `pending` rows: true if nobody has claimed it.
    pub fn claim(&self, pending: usize) -> bool {
        use std::sync::atomic::Ordering;
        self.0
            .compare_exchange(pending, pending + 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

impl RuleState {
    /// The state before the first token: zero memory, no pending rows.
    pub fn zeros(
        heads: usize,
        dk: usize,
        dv: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Self::from_memory(&Tensor::zeros((heads, dk, dv), dtype, device)?)
    }

    /// A state at a chunk boundary holding `memory: [H, dk, dv]`.
    pub fn from_memory(memory: &Tensor) -> Result<Self> {
        let (heads, dk, dv) = memory.dims3()?;
        let (dtype, device) = (memory.dtype(), memory.device());
        Ok(Self {
            chunk_start: memory.clone(),
            pending_k: Tensor::zeros((heads, CHUNK, dk), dtype, device)?,
            pending_u: Tensor::zeros((heads, CHUNK, dv), dtype, device)?,
            pending_gamma: Tensor::zeros((heads, CHUNK), DType::F64, device)?,
            pending: 0,
            rows: PendingRows::new(0),
        })
    }

    /// The memory after the last processed token, `[H, dk, dv]` (what [`recurrent`] carries): the chunk
    /// start advanced through the pending rows with the chunk-end formula.
    pub fn memory(&self) -> Result<Tensor> {
        match self.chunk_start.dtype() {
            DType::F32 => self.memory_typed::<f32>(),
            DType::F64 => self.memory_typed::<f64>(),
            other => candle_core::bail!("delta rule: unsupported dtype {other:?}"),
        }
    }

    /// `(H, dk, dv)`, after checking that the tensors fit together.
    pub(crate) fn dims(&self) -> Result<(usize, usize, usize)> {
        let (heads, dk, dv) = self.chunk_start.dims3()?;
        if self.pending_k.dims() != [heads, CHUNK, dk]
            || self.pending_u.dims() != [heads, CHUNK, dv]
            || self.pending_gamma.dims() != [heads, CHUNK]
            || self.pending_gamma.dtype() != DType::F64
            || self.pending_k.dtype() != self.chunk_start.dtype()
            || self.pending_u.dtype() != self.chunk_start.dtype()
            || self.pending >= CHUNK
        {
            candle_core::bail!(
                "delta rule: inconsistent state (memory {:?}, pending k {:?}, u {:?}, Γ {:?}, {} pending)",
                self.chunk_start.dims(),
                self.pending_k.dims(),
                self.pending_u.dims(),
                self.pending_gamma.dims(),
                self.pending
            );
        }
        Ok((heads, dk, dv))
    }

    fn memory_typed<F: Float + WithDType>(&self) -> Result<Tensor> {
        let (heads, dk, dv) = self.dims()?;
        let mut s = host::<F>(&self.chunk_start)?;
        let pk = host::<F>(&self.pending_k)?;
        let pu = host::<F>(&self.pending_u)?;
        let gamma = host::<f64>(&self.pending_gamma)?;
        for h in 0..heads {
            close_chunk(
                &mut s[h * dk * dv..(h + 1) * dk * dv],
                &pk[h * CHUNK * dk..(h + 1) * CHUNK * dk],
                &pu[h * CHUNK * dv..(h + 1) * CHUNK * dv],
                &gamma[h * CHUNK..(h + 1) * CHUNK],
                self.pending,
                (dk, dv),
            );
        }
        Tensor::from_vec(s, (heads, dk, dv), self.chunk_start.device())
    }
}

fn host<F: WithDType>(t: &Tensor) -> Result<Vec<F>> {
    t.flatten_all()?.to_vec1::<F>()
}

/// The chunked form over one segment of `T ≥ 1` tokens continuing `state`. Returns `(out [T, H, dv],
/// new state)`; bit-identical to running the same tokens in any other split.
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &RuleState,
) -> Result<(Tensor, RuleState)> {
    check_inputs(q, k, v, g, beta, state)?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && q.dtype() == DType::F32 {
        let whole = RuleSegment {
            start: 0,
            len: q.dim(0)?,
            parent: None,
            snapshot: None,
        };
        let (out, mut states, _) = crate::cuda_delta::delta_rule_batch(
            q,
            k,
            v,
            g,
            beta,
            &[whole],
            std::slice::from_ref(state),
        )?;
        let Some(state) = states.pop() else {
            candle_core::bail!("delta rule (cuda): no state returned for the segment");
        };
        return Ok((out, state));
    }
    match q.dtype() {
        DType::F32 => chunked_typed::<f32>(q, k, v, g, beta, state),
        DType::F64 => chunked_typed::<f64>(q, k, v, g, beta, state),
        other => candle_core::bail!("delta rule: unsupported dtype {other:?}"),
    }
}

/// One sequence's rows in a call of [`chunked_batch`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RuleSegment {
    /// First row of its tokens in the packed inputs.
    pub start: usize,
    /// Its number of tokens (at least one).
    pub len: usize,
    /// `Some(p)`: it continues segment `p` (an earlier one) from `p`'s state after `p`'s rows; its own
    /// entry of `states` is not read.
    pub parent: Option<usize>,
    /// `Some(p)`, `0 < p < len`: its state after its first `p` rows is wanted too
    /// ([`chunked_batch_with_snapshots`]).
    pub snapshot: Option<usize>,
}

/// The chunked form over several sequences packed in one call, each from its own state: `q, k: [N, HK,
/// dk]` where value head `h` reads key head `h mod HK` (`HK = H` for inputs already expanded to the
/// value heads), `v: [N, H, dv]`, `g, beta: [N, H]`; `segments` tile the `N` rows in order and
/// `states[i]` is segment `i`'s starting state (unless it has a parent). Returns `out: [N, H, dv]` and
/// every segment's state after its rows.
///
/// A segment's outputs and state are bit-identical to [`chunked`] on its own rows (`q, k` expanded)
/// from its starting state: nothing depends on the other segments. On a CUDA device (f32) the segments
/// whose starting state is known run together — first those without a parent, then the branches of
/// those, and so on — in one launch of each kernel where the limits allow (`cuda_delta`).
pub fn chunked_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<(Tensor, Vec<RuleState>)> {
    let (out, states, _) = chunked_batch_with_snapshots(q, k, v, g, beta, segments, states)?;
    Ok((out, states))
}

/// [`chunked_batch`], also returning for each segment with a [`RuleSegment::snapshot`] point `p` its
/// state after its first `p` rows — bit for bit the state a call on those rows alone leaves (on CUDA
/// the scan kernel writes it as it passes the point; on the CPU the segment runs in two calls split
/// there). `None` for the other segments.
pub fn chunked_batch_with_snapshots(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<(Tensor, Vec<RuleState>, Vec<Option<RuleState>>)> {
    // The CUDA path makes the same checks itself.
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() && q.dtype() == DType::F32 {
        return crate::cuda_delta::delta_rule_batch(q, k, v, g, beta, segments, states);
    }
    check_batch(q, k, v, g, beta, segments, states)?;
    per_segment([q, k, v, g, beta], segments, states, chunked)
}

/// One rule step over a segment's rows from a starting state (`chunked` or a device twin of it).
pub(crate) type SegmentStep =
    fn(&Tensor, &Tensor, &Tensor, &Tensor, &Tensor, &RuleState) -> Result<(Tensor, RuleState)>;

/// A checked [`chunked_batch_with_snapshots`] call (`[q, k, v, g, beta]`) run segment by segment with
/// `step` (`q, k` tiled to the value heads), each segment from its own starting state or its parent's
/// new one, a segment with a snapshot in two steps split at its point; the outputs joined in row order.
pub(crate) fn per_segment(
    [q, k, v, g, beta]: [&Tensor; 5],
    segments: &[RuleSegment],
    states: &[RuleState],
    step: SegmentStep,
) -> Result<(Tensor, Vec<RuleState>, Vec<Option<RuleState>>)> {
    let heads = v.dim(1)?;
    let (q, k) = (expand_key_heads(q, heads)?, expand_key_heads(k, heads)?);
    let mut outs = Vec::with_capacity(segments.len() + 1);
    let mut new_states: Vec<RuleState> = Vec::with_capacity(segments.len());
    let mut snapshots = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        // check_batch: a parent is an earlier segment, so its new state is already there.
        let start = match seg.parent {
            Some(p) => &new_states[p],
            None => &states[i],
        };
        let run = |from: usize, len: usize, state: &RuleState| {
            let at = |t: &Tensor| t.narrow(0, seg.start + from, len);
            step(&at(&q)?, &at(&k)?, &at(v)?, &at(g)?, &at(beta)?, state)
        };
        let (state, snapshot) = match seg.snapshot {
            Some(p) => {
                let (o, inside) = run(0, p, start)?;
                outs.push(o);
                let (o, state) = run(p, seg.len - p, &inside)?;
                outs.push(o);
                (state, Some(inside))
            }
            None => {
                let (o, state) = run(0, seg.len, start)?;
                outs.push(o);
                (state, None)
            }
        };
        new_states.push(state);
        snapshots.push(snapshot);
    }
    Ok((Tensor::cat(&outs, 0)?, new_states, snapshots))
}

/// `x: [N, HK, d]` with its heads tiled to `heads` (a multiple of HK): head `h` of the result is head
/// `h mod HK` of `x` (the GGUF layout of Qwen3.5's value heads over its key heads).
pub fn expand_key_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let key_heads = x.dim(1)?;
    if key_heads == heads {
        return Ok(x.clone());
    }
    if key_heads == 0 || heads % key_heads != 0 {
        candle_core::bail!("delta rule: {heads} value heads cannot read {key_heads} key heads");
    }
    Tensor::cat(&vec![x.clone(); heads / key_heads], 1)
}

/// The shapes of a [`chunked_batch`] call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct BatchDims {
    pub tokens: usize,
    pub heads: usize,
    pub key_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Checks a [`chunked_batch`] call: the shapes and dtypes fit, the segments tile the rows in order, every
/// parent is an earlier segment, and every starting state read fits the inputs.
pub(crate) fn check_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    segments: &[RuleSegment],
    states: &[RuleState],
) -> Result<BatchDims> {
    let (tokens, heads, dv) = v.dims3()?;
    let (tokens_q, key_heads, dk) = q.dims3()?;
    let dtype = v.dtype();
    if k.dims() != q.dims()
        || tokens_q != tokens
        || g.dims() != [tokens, heads]
        || beta.dims() != [tokens, heads]
        || key_heads == 0
        || heads % key_heads != 0
        || [q, k, g, beta].iter().any(|t| t.dtype() != dtype)
    {
        candle_core::bail!(
            "delta rule: q {:?}, k {:?}, v {:?}, g {:?}, beta {:?} ({:?}) do not fit together",
            q.dims(),
            k.dims(),
            v.dims(),
            g.dims(),
            beta.dims(),
            dtype
        );
    }
    if segments.is_empty() || segments.len() != states.len() {
        candle_core::bail!(
            "delta rule: {} segments with {} states",
            segments.len(),
            states.len()
        );
    }
    let mut row = 0usize;
    for (i, seg) in segments.iter().enumerate() {
        if seg.start != row || seg.len == 0 {
            candle_core::bail!(
                "delta rule: segment {i} starts at row {} with {} tokens; the segments must tile the rows in order (next row {row}), each with at least one token",
                seg.start,
                seg.len
            );
        }
        row = row.saturating_add(seg.len);
        if let Some(p) = seg.snapshot.filter(|&p| p == 0 || p >= seg.len) {
            candle_core::bail!(
                "delta rule: segment {i}'s snapshot after {p} of its {} rows is not inside it",
                seg.len
            );
        }
        match seg.parent {
            Some(p) if p >= i => {
                candle_core::bail!(
                    "delta rule: segment {i} continues segment {p}, which is not earlier"
                )
            }
            Some(_) => {}
            None => {
                let state = &states[i];
                if state.dims()? != (heads, dk, dv) || state.chunk_start.dtype() != dtype {
                    candle_core::bail!(
                        "delta rule: segment {i}'s state {:?} ({:?}) does not fit {heads} heads of {dk}×{dv} ({dtype:?})",
                        state.chunk_start.dims(),
                        state.chunk_start.dtype()
                    );
                }
            }
        }
    }
    if row != tokens {
        candle_core::bail!("delta rule: the segments cover {row} rows of {tokens}");
    }
    Ok(BatchDims {
        tokens,
        heads,
        key_heads,
        dk,
        dv,
    })
}

/// Checks that `q, k: [T, H, dk]`, `v: [T, H, dv]`, `g, beta: [T, H]` (T ≥ 1) fit `state` (memory
/// `[H, dk, dv]`, fewer than [`CHUNK`] pending rows) and share its dtype; returns `(T, H, dk, dv)`.
pub(crate) fn check_inputs(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &RuleState,
) -> Result<(usize, usize, usize, usize)> {
    let (heads, dk, dv) = state.dims()?;
    let t_len = k.dim(0)?;
    let dtype = state.chunk_start.dtype();
    if q.dims() != [t_len, heads, dk]
        || k.dims() != [t_len, heads, dk]
        || v.dims() != [t_len, heads, dv]
        || g.dims() != [t_len, heads]
        || beta.dims() != [t_len, heads]
        || t_len == 0
        || state.pending >= CHUNK
        || [q, k, v, g, beta].iter().any(|t| t.dtype() != dtype)
    {
        candle_core::bail!(
            "delta rule: q {:?}, k {:?}, v {:?}, g {:?}, beta {:?} ({:?}) do not fit the state {:?} ({dtype:?}, {} pending)",
            q.dims(),
            k.dims(),
            v.dims(),
            g.dims(),
            beta.dims(),
            q.dtype(),
            state.chunk_start.dims(),
            state.pending
        );
    }
    Ok((t_len, heads, dk, dv))
}

/// One token's inputs for one head.
struct TokenInputs<'a, F> {
    q: &'a [F],
    k: &'a [F],
    v: &'a [F],
    g: F,
    beta: F,
}

// Takes [`chunked`]'s parameters as they are: it is that function's body for one float type.
fn chunked_typed<F: Float + WithDType>(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &RuleState,
) -> Result<(Tensor, RuleState)> {
    let (t_len, heads, dk, dv) = check_inputs(q, k, v, g, beta, state)?;
    if state.chunk_start.dtype() != F::DTYPE {
        candle_core::bail!(
            "delta rule: state is {:?}, inputs {:?}",
            state.chunk_start.dtype(),
            F::DTYPE
        );
    }
    let (q, k, v) = (host::<F>(q)?, host::<F>(k)?, host::<F>(v)?);
    let (g, beta) = (host::<F>(g)?, host::<F>(beta)?);
    let mut s = host::<F>(&state.chunk_start)?;
    let mut pk = host::<F>(&state.pending_k)?;
    let mut pu = host::<F>(&state.pending_u)?;
    let mut gamma = host::<f64>(&state.pending_gamma)?;

    let run_head = |(h, (((s, pk), pu), gamma)): HeadBuffers<'_, F>| {
        let mut head = HeadState {
            s,
            pk,
            pu,
            gamma,
            pending: state.pending,
            dk,
            dv,
        };
        let mut out = vec![F::ZERO; t_len * dv];
        for (t, o) in out.chunks_exact_mut(dv).enumerate() {
            let row = t * heads + h;
            head.step(
                TokenInputs {
                    q: &q[row * dk..(row + 1) * dk],
                    k: &k[row * dk..(row + 1) * dk],
                    v: &v[row * dv..(row + 1) * dv],
                    g: g[row],
                    beta: beta[row],
                },
                o,
            );
        }
        out
    };
    let per_head: Vec<Vec<F>> = if matmul::use_threads(t_len * heads * dk * dv * 3) {
        s.par_chunks_mut(dk * dv)
            .zip(pk.par_chunks_mut(CHUNK * dk))
            .zip(pu.par_chunks_mut(CHUNK * dv))
            .zip(gamma.par_chunks_mut(CHUNK))
            .enumerate()
            .map(run_head)
            .collect()
    } else {
        s.chunks_mut(dk * dv)
            .zip(pk.chunks_mut(CHUNK * dk))
            .zip(pu.chunks_mut(CHUNK * dv))
            .zip(gamma.chunks_mut(CHUNK))
            .enumerate()
            .map(run_head)
            .collect()
    };

    let mut out = vec![F::ZERO; t_len * heads * dv];
    for (h, head_out) in per_head.iter().enumerate() {
        for (t, o) in head_out.chunks_exact(dv).enumerate() {
            let row = t * heads + h;
            out[row * dv..(row + 1) * dv].copy_from_slice(o);
        }
    }
    let device = state.chunk_start.device();
    let new_state = RuleState {
        chunk_start: Tensor::from_vec(s, (heads, dk, dv), device)?,
        pending_k: Tensor::from_vec(pk, (heads, CHUNK, dk), device)?,
        pending_u: Tensor::from_vec(pu, (heads, CHUNK, dv), device)?,
        pending_gamma: Tensor::from_vec(gamma, (heads, CHUNK), device)?,
        pending: (state.pending + t_len) % CHUNK,
        rows: PendingRows::new((state.pending + t_len) % CHUNK),
    };
    Ok((
        Tensor::from_vec(out, (t_len, heads, dv), device)?,
        new_state,
    ))
}

/// Head index with its slices of the memory, pending keys, pending new values and pending decays.
type HeadBuffers<'a, F> = (
    usize,
    (((&'a mut [F], &'a mut [F]), &'a mut [F]), &'a mut [f64]),
);

/// One head's state, borrowed from the layer's buffers.
struct HeadState<'a, F> {
    /// Memory at the chunk start, `[dk, dv]`.
    s: &'a mut [F],
    /// Pending rows: `[CHUNK, dk]`, `[CHUNK, dv]`, `[CHUNK]`.
    pk: &'a mut [F],
    pu: &'a mut [F],
    gamma: &'a mut [f64],
    pending: usize,
    dk: usize,
    dv: usize,
}

impl<F: Float> HeadState<'_, F> {
    /// Processes one token as row `pending` of the current chunk; writes its output `o: [dv]`.
    fn step(&mut self, x: TokenInputs<'_, F>, o: &mut [F]) {
        let (dk, dv, r) = (self.dk, self.dv, self.pending);
        let gamma_r = if r == 0 { 0.0 } else { self.gamma[r - 1] } + x.g.to_f64();
        self.gamma[r] = gamma_r;
        let decay_r = F::from_f64(gamma_r.exp());

        // S₀ᵀk̂ and S₀ᵀq̂, row by row of S₀ (each output element sums over i in increasing order).
        let mut read_k = vec![F::ZERO; dv];
        o.iter_mut().for_each(|x| *x = F::ZERO);
        for (i, s_row) in self.s.chunks_exact(dv).enumerate() {
            matmul::axpy(x.k[i], s_row, &mut read_k);
            matmul::axpy(x.q[i], s_row, o);
        }

        // u_r = β_r (v_r − e^{Γ_r} S₀ᵀk̂_r) − Σ_{s<r} β_r (k̂_r·k̂_s) D_rs u_s
        let (done_u, rest_u) = self.pu.split_at_mut(r * dv);
        let u = &mut rest_u[..dv];
        for ((u, &v), &read) in u.iter_mut().zip(x.v).zip(&read_k) {
            *u = x.beta * (-decay_r).fma(read, v);
        }
        let done_k = &self.pk[..r * dk];
        let mut attn = Vec::with_capacity(r + 1);
        for (s, (k_s, u_s)) in done_k
            .chunks_exact(dk)
            .zip(done_u.chunks_exact(dv))
            .enumerate()
        {
            let d = F::from_f64((gamma_r - self.gamma[s]).exp());
            let a = x.beta * matmul::dot(x.k, k_s) * d;
            matmul::axpy(-a, u_s, u);
            attn.push(matmul::dot(x.q, k_s) * d);
        }
        attn.push(matmul::dot(x.q, x.k));
        self.pk[r * dk..(r + 1) * dk].copy_from_slice(x.k);

        // o_r = e^{Γ_r} S₀ᵀq̂_r + Σ_{s≤r} (q̂_r·k̂_s) D_rs u_s
        o.iter_mut().for_each(|x| *x = decay_r * *x);
        for (&a, u_s) in attn.iter().zip(self.pu[..(r + 1) * dv].chunks_exact(dv)) {
            matmul::axpy(a, u_s, o);
        }

        self.pending = r + 1;
        if self.pending == CHUNK {
            close_chunk(self.s, self.pk, self.pu, self.gamma, CHUNK, (dk, dv));
            self.pending = 0;
        }
    }
}

/// `S ← e^{Γ_last} S + Σ_{s<n} e^{Γ_last − Γ_s} k̂_s u_sᵀ` with `Γ_last = Γ_{n−1}` (nothing for `n = 0`).
fn close_chunk<F: Float>(
    s: &mut [F],
    pk: &[F],
    pu: &[F],
    gamma: &[f64],
    n: usize,
    (dk, dv): (usize, usize),
) {
    if n == 0 {
        return;
    }
    let last = gamma[n - 1];
    let decay_all = F::from_f64(last.exp());
    let to_end: Vec<F> = gamma[..n]
        .iter()
        .map(|&g| F::from_f64((last - g).exp()))
        .collect();
    for (i, s_row) in s.chunks_exact_mut(dv).enumerate() {
        s_row.iter_mut().for_each(|x| *x = decay_all * *x);
        for (sidx, u_s) in pu[..n * dv].chunks_exact(dv).enumerate() {
            matmul::axpy(to_end[sidx] * pk[sidx * dk + i], u_s, s_row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::l2_norm;
    use crate::test_util::{bits, max_abs_diff};

    #[test]
    fn a_pending_row_is_claimed_once_and_clones_share_the_claim() {
        let state = RuleState::zeros(2, 4, 4, DType::F32, &Device::Cpu).unwrap();
        let clone = state.clone();
        assert!(state.rows.claim(0), "a fresh state's first row is free");
        assert!(
            !clone.rows.claim(0),
            "a clone shares the claim: row 0 is taken"
        );
        assert!(
            state.rows.claim(1),
            "the continued state claims the next row"
        );
        assert!(!state.rows.claim(0) && !state.rows.claim(3));
        let other = RuleState::zeros(2, 4, 4, DType::F32, &Device::Cpu).unwrap();
        assert!(
            other.rows.claim(0),
            "another state's buffers have their own claim"
        );
    }

    #[test]
    fn shared_pending_buffers_are_claimed_by_nobody() {
        let shared = PendingRows::shared();
        assert!(
            (0..CHUNK).all(|row| !shared.claim(row)),
            "no row of shared buffers may be written in place"
        );
    }

    /// Random inputs shaped like a DeltaNet segment, with the same value ranges as real ones.
    fn random_inputs(t: usize, h: usize, dk: usize, dv: usize, dtype: DType) -> [Tensor; 6] {
        let dev = Device::Cpu;
        let q = l2_norm(&Tensor::randn(0f32, 1.0, (t, h, dk), &dev).unwrap(), 1e-6).unwrap();
        let q = (q * (1.0 / (dk as f64).sqrt())).unwrap();
        let k = l2_norm(&Tensor::randn(0f32, 1.0, (t, h, dk), &dev).unwrap(), 1e-6).unwrap();
        let v = Tensor::randn(0f32, 1.0, (t, h, dv), &dev).unwrap();
        let g = Tensor::rand(-2.0f32, 0.0, (t, h), &dev).unwrap();
        let beta = Tensor::rand(0.0f32, 1.0, (t, h), &dev).unwrap();
        let s0 = Tensor::randn(0f32, 0.5, (h, dk, dv), &dev).unwrap();
        [q, k, v, g, beta, s0].map(|x| x.to_dtype(dtype).unwrap())
    }

    /// Runs `chunked` over the tokens in pieces of the given sizes; returns all outputs and the state.
    fn in_pieces(inputs: &[Tensor; 6], sizes: &[usize]) -> (Tensor, RuleState) {
        let [q, k, v, g, beta, s0] = inputs;
        let mut state = RuleState::from_memory(s0).unwrap();
        let mut outs = Vec::new();
        let mut at = 0;
        for &n in sizes {
            let piece = |x: &Tensor| x.narrow(0, at, n).unwrap();
            let (o, next) = chunked(
                &piece(q),
                &piece(k),
                &piece(v),
                &piece(g),
                &piece(beta),
                &state,
            )
            .unwrap();
            outs.push(o);
            state = next;
            at += n;
        }
        assert_eq!(at, q.dim(0).unwrap());
        (Tensor::cat(&outs, 0).unwrap(), state)
    }

    #[test]
    fn chunked_equals_recurrent_on_random_data() {
        // 150 tokens: two full chunks and a partial one, from a non-zero memory.
        for (dtype, bound) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
            let inputs = random_inputs(150, 3, 16, 8, dtype);
            let [q, k, v, g, beta, s0] = &inputs;
            let (o_rec, s_rec) = recurrent(q, k, v, g, beta, s0).unwrap();
            let (o_chk, state) = in_pieces(&inputs, &[150]);
            assert_eq!(state.pending, 150 % CHUNK);
            let d_out = max_abs_diff(&o_rec, &o_chk);
            let d_state = max_abs_diff(&s_rec, &state.memory().unwrap());
            eprintln!("{dtype:?}: chunked vs recurrent, out {d_out:.2e}, memory {d_state:.2e}");
            assert!(
                d_out < bound && d_state < bound,
                "{dtype:?}: out {d_out}, state {d_state}"
            );
        }
    }

    #[test]
    fn any_split_into_calls_is_bit_identical() {
        for dtype in [DType::F32, DType::F64] {
            let inputs = random_inputs(150, 3, 16, 8, dtype);
            let (o_one, s_one) = in_pieces(&inputs, &[150]);
            for sizes in [
                vec![1, 36, 27, 64, 22],
                vec![63, 1, 64, 1, 21],
                vec![64, 65, 21],
                vec![1; 150],
            ] {
                let (o, s) = in_pieces(&inputs, &sizes);
                assert_eq!(
                    bits(&o),
                    bits(&o_one),
                    "{dtype:?} outputs, pieces {sizes:?}"
                );
                assert_eq!(s.pending, s_one.pending);
                for (a, b) in [
                    (&s.chunk_start, &s_one.chunk_start),
                    (&s.pending_k, &s_one.pending_k),
                    (&s.pending_u, &s_one.pending_u),
                    (&s.pending_gamma, &s_one.pending_gamma),
                ] {
                    assert_eq!(bits(a), bits(b), "{dtype:?} state, pieces {sizes:?}");
                }
            }
        }
    }

    #[test]
    fn chunked_is_accurate_for_repeated_keys() {
        // Identical keys with β = 1 make (I + A) the all-ones lower triangle: the row recursion must
        // stay accurate (the new values telescope to v_r − v_{r−1}).
        let dev = Device::Cpu;
        let t = 64;
        let k1 = l2_norm(&Tensor::randn(0f32, 1.0, (1, 1, 16), &dev).unwrap(), 1e-6).unwrap();
        let k = k1.broadcast_as((t, 1, 16)).unwrap().contiguous().unwrap();
        let q = (k.clone() * 0.25).unwrap();
        let v = Tensor::randn(0f32, 1.0, (t, 1, 8), &dev).unwrap();
        let g = Tensor::zeros((t, 1), DType::F32, &dev).unwrap();
        let beta = Tensor::ones((t, 1), DType::F32, &dev).unwrap();
        let s0 = Tensor::zeros((1, 16, 8), DType::F32, &dev).unwrap();
        let (o_rec, s_rec) = recurrent(&q, &k, &v, &g, &beta, &s0).unwrap();
        let (o_chk, state) = in_pieces(&[q, k, v, g, beta, s0], &[t]);
        assert_eq!(state.pending, 0);
        assert!(max_abs_diff(&o_rec, &o_chk) < 1e-4);
        assert!(max_abs_diff(&s_rec, &state.chunk_start) < 1e-4);
    }

    fn assert_same_state(a: &RuleState, b: &RuleState, what: &str) {
        assert_eq!(a.pending, b.pending, "{what}: pending rows");
        for (x, y, part) in [
            (&a.chunk_start, &b.chunk_start, "memory"),
            (&a.pending_k, &b.pending_k, "pending keys"),
            (&a.pending_u, &b.pending_u, "pending values"),
            (&a.pending_gamma, &b.pending_gamma, "pending decays"),
        ] {
            assert_eq!(bits(x), bits(y), "{what}: {part}");
        }
    }

    #[test]
    fn a_batch_equals_its_segments_one_by_one() {
        // Four sequences packed in one call: two from their own states (a fresh memory, and one 37
        // tokens into a chunk), two branches (of segments 0 and 2).
        for dtype in [DType::F32, DType::F64] {
            let (h, dk, dv) = (3, 16, 8);
            let inputs = random_inputs(190, h, dk, dv, dtype);
            let [q, k, v, g, beta, s0] = &inputs;
            let fresh = RuleState::from_memory(s0).unwrap();
            let other = random_inputs(37, h, dk, dv, dtype);
            let (_, mid_chunk) = in_pieces(&other, &[37]);
            let segments = [
                RuleSegment {
                    start: 0,
                    len: 70,
                    parent: None,
                    snapshot: None,
                },
                RuleSegment {
                    start: 70,
                    len: 1,
                    parent: None,
                    snapshot: None,
                },
                RuleSegment {
                    start: 71,
                    len: 100,
                    parent: Some(0),
                    snapshot: None,
                },
                RuleSegment {
                    start: 171,
                    len: 19,
                    parent: Some(2),
                    snapshot: None,
                },
            ];
            // A branch's own state is not read: pass one that would not even fit.
            let unused = RuleState::zeros(1, 4, 4, dtype, &Device::Cpu).unwrap();
            let states = [fresh.clone(), mid_chunk.clone(), unused.clone(), unused];
            let (out, new_states) = chunked_batch(q, k, v, g, beta, &segments, &states).unwrap();
            assert_eq!(out.dims(), [190, h, dv]);

            let mut alone_states: Vec<RuleState> = Vec::new();
            for (i, seg) in segments.iter().enumerate() {
                let start = match seg.parent {
                    Some(p) => alone_states[p].clone(),
                    None => states[i].clone(),
                };
                let at = |t: &Tensor| t.narrow(0, seg.start, seg.len).unwrap();
                let (o, state) =
                    chunked(&at(q), &at(k), &at(v), &at(g), &at(beta), &start).unwrap();
                assert_eq!(bits(&o), bits(&at(&out)), "{dtype:?}: segment {i} outputs");
                assert_same_state(&state, &new_states[i], &format!("{dtype:?}: segment {i}"));
                alone_states.push(state);
            }
            assert_eq!(new_states[2].pending, (70 + 100) % CHUNK);
        }
    }

    #[test]
    fn key_heads_are_read_by_value_head_mod_key_heads() {
        // 6 value heads over 2 key heads: the same bits as inputs tiled to 6 heads beforehand.
        let (t, hk, h, dk, dv) = (80, 2, 6, 16, 8);
        let keys = random_inputs(t, hk, dk, dv, DType::F32);
        let values = random_inputs(t, h, dk, dv, DType::F32);
        let (q, k) = (&keys[0], &keys[1]);
        let [_, _, v, g, beta, s0] = &values;
        let state = RuleState::from_memory(s0).unwrap();
        let segments = [RuleSegment {
            start: 0,
            len: t,
            parent: None,
            snapshot: None,
        }];
        let (out, states) =
            chunked_batch(q, k, v, g, beta, &segments, std::slice::from_ref(&state)).unwrap();
        let tiled = |x: &Tensor| Tensor::cat(&[x, x, x], 1).unwrap();
        let (want, want_state) = chunked(&tiled(q), &tiled(k), v, g, beta, &state).unwrap();
        assert_eq!(bits(&out), bits(&want));
        assert_same_state(&states[0], &want_state, "key heads");
        // Value head 4 reads key head 0.
        assert_eq!(
            bits(&expand_key_heads(q, h).unwrap().narrow(1, 4, 1).unwrap()),
            bits(&q.narrow(1, 0, 1).unwrap())
        );
    }

    #[test]
    fn bad_batches_are_refused() {
        let (h, dk, dv) = (3, 16, 8);
        let inputs = random_inputs(20, h, dk, dv, DType::F32);
        let [q, k, v, g, beta, s0] = &inputs;
        let state = RuleState::from_memory(s0).unwrap();
        let seg = |start, len, parent| RuleSegment {
            start,
            len,
            parent,
            snapshot: None,
        };
        let run = |segments: &[RuleSegment], states: &[RuleState]| {
            chunked_batch(q, k, v, g, beta, segments, states)
        };
        let two = [state.clone(), state.clone()];
        assert!(run(&[seg(0, 10, None), seg(10, 10, None)], &two).is_ok());
        // A gap, an overlap, rows left over, an empty segment.
        assert!(run(&[seg(0, 10, None), seg(11, 9, None)], &two).is_err());
        assert!(run(&[seg(0, 10, None), seg(9, 11, None)], &two).is_err());
        assert!(run(&[seg(0, 10, None), seg(10, 5, None)], &two).is_err());
        assert!(run(&[seg(0, 20, None), seg(20, 0, None)], &two).is_err());
        // A parent that is not earlier; a state count that does not match; a state of other heads.
        assert!(run(&[seg(0, 10, Some(1)), seg(10, 10, None)], &two).is_err());
        assert!(run(&[seg(0, 10, Some(0)), seg(10, 10, None)], &two).is_err());
        assert!(run(&[seg(0, 20, None)], &two).is_err());
        let other = RuleState::zeros(2, dk, dv, DType::F32, &Device::Cpu).unwrap();
        assert!(run(
            &[seg(0, 10, None), seg(10, 10, None)],
            &[state.clone(), other]
        )
        .is_err());
        // Key heads that do not divide the value heads.
        let q2 = q.narrow(1, 0, 2).unwrap();
        let k2 = k.narrow(1, 0, 2).unwrap();
        assert!(chunked_batch(
            &q2,
            &k2,
            v,
            g,
            beta,
            &[seg(0, 20, None)],
            std::slice::from_ref(&state)
        )
        .is_err());
        // A snapshot outside its segment.
        for point in [0, 20, 21] {
            let mut s = seg(0, 20, None);
            s.snapshot = Some(point);
            assert!(run(&[s], std::slice::from_ref(&state)).is_err(), "{point}");
        }
    }

    #[test]
    fn a_snapshot_is_the_state_the_rows_before_it_leave() {
        // Snapshots inside the first chunk, on a boundary, mid-chunk after pending rows, and in a branch.
        let (h, dk, dv) = (3, 16, 8);
        let inputs = random_inputs(300, h, dk, dv, DType::F32);
        let [q, k, v, g, beta, s0] = &inputs;
        let fresh = RuleState::from_memory(s0).unwrap();
        let other = random_inputs(37, h, dk, dv, DType::F32);
        let (_, mid_chunk) = in_pieces(&other, &[37]);
        let seg = |start, len, parent, snapshot| RuleSegment {
            start,
            len,
            parent,
            snapshot,
        };
        let segments = [
            seg(0, 150, None, Some(5)),
            seg(150, 100, None, Some(27)),
            seg(250, 50, Some(0), Some(20)),
        ];
        let states = [fresh.clone(), mid_chunk.clone(), fresh.clone()];
        let (out, ends, snapshots) =
            chunked_batch_with_snapshots(q, k, v, g, beta, &segments, &states).unwrap();
        let (plain, plain_ends) = chunked_batch(
            q,
            k,
            v,
            g,
            beta,
            &segments.map(|s| RuleSegment {
                snapshot: None,
                ..s
            }),
            &states,
        )
        .unwrap();
        assert_eq!(bits(&out), bits(&plain), "outputs");
        for (a, b) in ends.iter().zip(&plain_ends) {
            assert_same_state(a, b, "end state");
        }
        // Each snapshot against its rows alone from the segment's starting state.
        let starts = [&fresh, &mid_chunk, &ends[0]];
        for ((s, start), snapshot) in segments.iter().zip(starts).zip(&snapshots) {
            let p = s.snapshot.unwrap();
            let at = |t: &Tensor| t.narrow(0, s.start, p).unwrap();
            let (_, want) = chunked(&at(q), &at(k), &at(v), &at(g), &at(beta), start).unwrap();
            let got = snapshot.as_ref().expect("a snapshot");
            assert_eq!(got.pending, want.pending);
            assert_same_state(got, &want, "snapshot");
        }
    }

    #[test]
    fn mismatched_shapes_are_refused() {
        let inputs = random_inputs(5, 3, 16, 8, DType::F32);
        let [q, k, v, g, beta, _] = &inputs;
        let other = RuleState::zeros(2, 16, 8, DType::F32, &Device::Cpu).unwrap();
        assert!(chunked(q, k, v, g, beta, &other).is_err());
    }
}
