//! The gated delta rule: the recurrence at the heart of a Gated DeltaNet layer.
//!
//! Per value head, with state `S ∈ ℝ^{dk×dv}` and per-token `q̂, k̂ ∈ ℝ^{dk}`, `v ∈ ℝ^{dv}`, log-decay
//! `g ≤ 0` and write strength `β ∈ (0,1)`:
//!
//! ```text
//! S ← e^g · S;   δ = β (v − Sᵀk̂);   S ← S + k̂ δᵀ;   o = Sᵀq̂
//! ```
//!
//! Two equivalent forms are implemented: the recurrent one (one token at a time; decode) and the chunked
//! WY/UT form (prefill), which turns 64 sequential updates into a few matmuls. Chunk boundaries sit at
//! absolute multiples of the chunk size counted from the sequence start, so the arithmetic a token sees
//! does not depend on how the prompt was split into calls or batched with others.
//!
//! All tensors share one float dtype (f32, or f64 for the ground-truth path). Shapes: `q, k: [T, H, dk]` (already expanded to the `H` value heads), `v: [T, H, dv]`,
//! `g, beta: [T, H]`, `state: [H, dk, dv]`. Both forms return `(out [T, H, dv], new_state [H, dk, dv])`.

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

/// Chunk length of the chunked form (the value transformers, FLA and llama.cpp use).
pub const CHUNK: usize = 64;

/// The recurrent form: one token at a time.
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

/// The chunked (WY / UT-transform) form. `start` is the number of tokens this sequence has already
/// processed: the first chunk is the partial one that ends at the next multiple of [`CHUNK`].
pub fn chunked(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    state: &Tensor,
    start: usize,
) -> Result<(Tensor, Tensor)> {
    let (t_len, heads, dk) = k.dims3()?;
    let dv = v.dim(2)?;
    let c = CHUNK;
    // Zero padding before the first token (up to the chunk boundary) and after the last one. Padded rows
    // have k = v = q = 0, β = 0 and g = 0, so they neither read, write nor decay the state.
    let lead = start % c;
    let n_chunks = (lead + t_len).div_ceil(c);
    let tail = n_chunks * c - lead - t_len;
    let chunk_heads = |x: &Tensor, width: usize| -> Result<Tensor> {
        // [T, H, w] → [H, n_chunks, C, w]
        x.transpose(0, 1)?
            .pad_with_zeros(1, lead, tail)?
            .reshape((heads, n_chunks, c, width))
    };
    let q = chunk_heads(q, dk)?;
    let k = chunk_heads(k, dk)?;
    let v = chunk_heads(v, dv)?;
    let g = g
        .t()?
        .pad_with_zeros(1, lead, tail)?
        .reshape((heads, n_chunks, c))?;
    let beta = beta
        .t()?
        .pad_with_zeros(1, lead, tail)?
        .reshape((heads, n_chunks, c, 1))?;

    // Γ_r: chunk-local inclusive cumulative log-decay. Kept in f64: over a chunk Γ can reach hundreds,
    // and in f32 the differences Γ_r − Γ_s below would lose ~|Γ|·1e-7 to cancellation, making the
    // chunked form measurably noisier than the recurrent one. Only the [C]-sized decays are f64.
    let dtype = q.dtype();
    let gamma = g.to_dtype(DType::F64)?.cumsum(D::Minus1)?.contiguous()?;
    // D_rs = exp(Γ_r − Γ_s) on s ≤ r, 0 above the diagonal (masked before exp so it cannot overflow).
    let upper_mask = upper_neg_inf(c, DType::F64, q.device())?;
    let pair = gamma.unsqueeze(3)?.broadcast_sub(&gamma.unsqueeze(2)?)?;
    let decay_pair = pair.broadcast_add(&upper_mask)?.exp()?.to_dtype(dtype)?;

    let k_t = k.transpose(2, 3)?.contiguous()?;
    let k_beta = k.broadcast_mul(&beta)?;
    // A_rs = β_r (k̂_r · k̂_s) D_rs, strictly lower; T = (I + A)⁻¹.
    let a = k_beta.matmul(&k_t)?.mul(&decay_pair)?;
    let t_inv = unit_lower_inverse(&a.reshape((heads * n_chunks, c, c))?)?
        .reshape((heads, n_chunks, c, c))?;
    let exp_gamma = gamma.exp()?.to_dtype(dtype)?.unsqueeze(3)?;
    let u = t_inv.matmul(&v.broadcast_mul(&beta)?.contiguous()?)?; // pseudo-values
    let w = t_inv.matmul(&k_beta.broadcast_mul(&exp_gamma)?.contiguous()?)?; // decayed keys reading S
    let q_decayed = q.broadcast_mul(&exp_gamma)?;
    let intra = q.matmul(&k_t)?.mul(&decay_pair)?; // includes the diagonal
    let gamma_last = gamma.narrow(2, c - 1, 1)?; // [H, n_chunks, 1]
    let to_end = gamma_last.broadcast_sub(&gamma)?.exp()?.to_dtype(dtype)?;
    let k_to_end = k.broadcast_mul(&to_end.unsqueeze(3)?)?;
    let k_to_end_t = k_to_end.transpose(2, 3)?.contiguous()?;
    let chunk_decay = gamma_last.exp()?.to_dtype(dtype)?.unsqueeze(3)?; // [H, n_chunks, 1, 1]

    let mut s = state.clone();
    let mut outs = Vec::with_capacity(n_chunks);
    for i in 0..n_chunks {
        let at = |x: &Tensor| x.narrow(1, i, 1).and_then(|x| x.squeeze(1));
        let v_new = (at(&u)? - at(&w)?.matmul(&s)?)?;
        let o = (at(&q_decayed)?.matmul(&s)? + at(&intra)?.matmul(&v_new)?)?;
        s = (s.broadcast_mul(&at(&chunk_decay)?)? + at(&k_to_end_t)?.matmul(&v_new)?)?;
        outs.push(o);
    }
    let out = Tensor::cat(&outs, 1)?
        .narrow(1, lead, t_len)?
        .transpose(0, 1)?
        .contiguous()?;
    Ok((out, s))
}

/// `[C, C]` with −∞ strictly above the diagonal and 0 elsewhere.
fn upper_neg_inf(c: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let mut m = vec![0f32; c * c];
    for r in 0..c {
        for s in r + 1..c {
            m[r * c + s] = f32::NEG_INFINITY;
        }
    }
    Tensor::from_vec(m, (c, c), device)?.to_dtype(dtype)
}

/// `(I + A)⁻¹` for a batch `[B, C, C]` of matrices, using only the strictly lower triangle of `A` (the
/// diagonal and upper triangle are ignored, as in transformers' `solve_triangular(unitriangular=True)`).
/// The result is unit lower-triangular. On the CPU this is a small forward-substitution kernel; on other
/// devices it falls back to [`unit_lower_inverse_tensor_ops`].
pub fn unit_lower_inverse(a: &Tensor) -> Result<Tensor> {
    let a = a.contiguous()?;
    if a.device().is_cpu() {
        a.apply_op1_no_bwd(&UnitLowerInverse)
    } else {
        unit_lower_inverse_tensor_ops(&a)
    }
}

/// Forward substitution written with tensor ops (row `r` of `T` is `e_r − A[r, :r] · T[:r, :]`), for
/// devices without a dedicated kernel. C − 1 small batched matmuls.
pub fn unit_lower_inverse_tensor_ops(a: &Tensor) -> Result<Tensor> {
    let (b, c, c2) = a.dims3()?;
    if c != c2 {
        candle_core::bail!("unit_lower_inverse: matrices must be square, got {c}x{c2}");
    }
    let eye = Tensor::eye(c, a.dtype(), a.device())?;
    let mut rows: Vec<Tensor> = Vec::with_capacity(c);
    rows.push(
        eye.narrow(0, 0, 1)?
            .unsqueeze(0)?
            .broadcast_as((b, 1, c))?
            .contiguous()?,
    );
    for r in 1..c {
        let done = Tensor::cat(&rows, 1)?; // [B, r, C]
        let coeffs = a.narrow(1, r, 1)?.narrow(2, 0, r)?.contiguous()?; // [B, 1, r]
        let row = eye
            .narrow(0, r, 1)?
            .unsqueeze(0)?
            .broadcast_sub(&coeffs.matmul(&done)?)?;
        rows.push(row);
    }
    Tensor::cat(&rows, 1)
}

struct UnitLowerInverse;

/// Inverts each `c × c` block of `a` (row-major), accumulating in f64.
fn invert_unit_lower<T: Copy>(
    a: &[T],
    c: usize,
    to_f64: fn(T) -> f64,
    from_f64: fn(f64) -> T,
) -> Vec<T> {
    let mut out = Vec::with_capacity(a.len());
    let mut t = vec![0f64; c * c];
    for m in a.chunks_exact(c * c) {
        t.iter_mut().for_each(|x| *x = 0.0);
        for r in 0..c {
            // T_r = e_r − Σ_{s<r} A_rs T_s; T_s is zero right of column s.
            let (done, rest) = t.split_at_mut(r * c);
            let row = &mut rest[..c];
            row[r] = 1.0;
            for s in 0..r {
                let coeff = to_f64(m[r * c + s]);
                if coeff != 0.0 {
                    for (x, &y) in row.iter_mut().zip(&done[s * c..s * c + s + 1]) {
                        *x -= coeff * y;
                    }
                }
            }
        }
        out.extend(t.iter().map(|&x| from_f64(x)));
    }
    out
}

impl CustomOp1 for UnitLowerInverse {
    fn name(&self) -> &'static str {
        "unit-lower-inverse"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let dims = layout.shape().dims();
        let c = match *dims {
            [_, c, c2] if c == c2 => c,
            _ => candle_core::bail!("unit-lower-inverse expects [B, C, C], got {dims:?}"),
        };
        let (start, end) = match layout.contiguous_offsets() {
            Some(offsets) => offsets,
            None => candle_core::bail!("unit-lower-inverse needs a contiguous input"),
        };
        let out = match storage {
            CpuStorage::F32(v) => {
                CpuStorage::F32(invert_unit_lower(&v[start..end], c, f64::from, |x| {
                    x as f32
                }))
            }
            CpuStorage::F64(v) => {
                CpuStorage::F64(invert_unit_lower(&v[start..end], c, |x| x, |x| x))
            }
            other => {
                candle_core::bail!(
                    "unit-lower-inverse: unsupported dtype {:?}",
                    candle_core::backend::BackendStorage::dtype(other)
                )
            }
        };
        Ok((out, layout.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::l2_norm;
    use candle_core::Device;

    fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    /// Random inputs shaped like a DeltaNet segment, with the same value ranges as real ones.
    fn random_inputs(t: usize, h: usize, dk: usize, dv: usize) -> [Tensor; 6] {
        let dev = Device::Cpu;
        let q = l2_norm(&Tensor::randn(0f32, 1.0, (t, h, dk), &dev).unwrap(), 1e-6).unwrap();
        let q = (q * (1.0 / (dk as f64).sqrt())).unwrap();
        let k = l2_norm(&Tensor::randn(0f32, 1.0, (t, h, dk), &dev).unwrap(), 1e-6).unwrap();
        let v = Tensor::randn(0f32, 1.0, (t, h, dv), &dev).unwrap();
        let g = Tensor::rand(-2.0f32, 0.0, (t, h), &dev).unwrap();
        let beta = Tensor::rand(0.0f32, 1.0, (t, h), &dev).unwrap();
        let s0 = Tensor::randn(0f32, 0.5, (h, dk, dv), &dev).unwrap();
        [q, k, v, g, beta, s0]
    }

    #[test]
    fn chunked_equals_recurrent_on_random_data() {
        // 150 tokens starting at absolute position 37: a partial first chunk, one full chunk, a partial last.
        let [q, k, v, g, beta, s0] = random_inputs(150, 3, 16, 8);
        let (o_rec, s_rec) = recurrent(&q, &k, &v, &g, &beta, &s0).unwrap();
        for start in [0usize, 37, 64, 127] {
            let (o_chk, s_chk) = chunked(&q, &k, &v, &g, &beta, &s0, start).unwrap();
            let d_out = max_abs_diff(&o_rec, &o_chk);
            let d_state = max_abs_diff(&s_rec, &s_chk);
            assert!(
                d_out < 1e-5 && d_state < 1e-5,
                "start {start}: out {d_out}, state {d_state}"
            );
        }
    }

    #[test]
    fn chunked_is_exact_for_repeated_keys() {
        // Identical keys with β ≈ 1 make (I + A) close to the all-ones lower triangle, whose inverse is
        // bidiagonal but whose power series explodes: the solve must stay accurate.
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
        let (o_chk, s_chk) = chunked(&q, &k, &v, &g, &beta, &s0, 0).unwrap();
        assert!(max_abs_diff(&o_rec, &o_chk) < 1e-4);
        assert!(max_abs_diff(&s_rec, &s_chk) < 1e-4);
    }

    #[test]
    fn cpu_kernel_and_tensor_op_inverse_agree_and_invert() {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f32, 0.1, (5, 64, 64), &dev).unwrap();
        let t1 = unit_lower_inverse(&a).unwrap();
        let t2 = unit_lower_inverse_tensor_ops(&a).unwrap();
        assert!(max_abs_diff(&t1, &t2) < 1e-4);
        // (I + strict_lower(A)) · T = I
        let strict = a
            .broadcast_mul(&Tensor::tril2(64, DType::F32, &dev).unwrap())
            .unwrap();
        let diag = a
            .broadcast_mul(&Tensor::eye(64, DType::F32, &dev).unwrap())
            .unwrap();
        let strict = (strict - diag).unwrap();
        let eye = Tensor::eye(64, DType::F32, &dev).unwrap();
        let lhs = strict.broadcast_add(&eye).unwrap().matmul(&t1).unwrap();
        assert!(max_abs_diff(&lhs, &eye.broadcast_as((5, 64, 64)).unwrap()) < 1e-4);
    }
}
