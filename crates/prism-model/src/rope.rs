//! Partial, interleaved multi-axis rotary embedding (Qwen3.5's M-RoPE).
//!
//! Only the first `rotary_dim` dims of each head rotate, NeoX style: element `i` pairs with
//! `i + rotary_dim/2`. Each of the `rotary_dim/2` frequency pairs takes its angle from one of three
//! position streams (T, H, W), assigned in an interleaved pattern. Text tokens have equal positions on all
//! three axes, which makes this ordinary partial RoPE; the 3-axis interface is kept for image tokens.

use candle_core::{DType, Device, Result, Tensor, D};

/// A token's position on the three M-RoPE axes (temporal, height, width).
pub type Position3 = [u32; 3];

/// The per-head RMSNorm weights of an attention layer's queries and keys (stored as `1 + w`, used as
/// is) and the norm's epsilon.
#[derive(Debug, Clone, Copy)]
pub struct HeadNorms<'a> {
    pub q_weight: &'a Tensor,
    pub k_weight: &'a Tensor,
    pub eps: f64,
}

/// Precomputed inverse frequencies and the axis each frequency pair reads.
#[derive(Debug, Clone)]
pub struct MRope {
    rotary_dim: usize,
    /// `[rotary_dim/2]`, f32.
    inv_freq: Tensor,
    /// `[rotary_dim/2]`, u32: 0 = T, 1 = H, 2 = W.
    pair_axis: Tensor,
}

/// The position axis of frequency pair `i` for sections `[s_t, s_h, s_w]`: H takes pairs `i ≡ 1 (mod 3)`
/// below `3·s_h`, W takes `i ≡ 2 (mod 3)` below `3·s_w`, T takes everything else.
pub fn pair_axis(i: usize, sections: [usize; 3]) -> usize {
    if i % 3 == 1 && i < 3 * sections[1] {
        1
    } else if i % 3 == 2 && i < 3 * sections[2] {
        2
    } else {
        0
    }
}

impl MRope {
    /// `rotary_dim` must be even; `theta` is the RoPE base.
    pub fn new(
        rotary_dim: usize,
        theta: f64,
        sections: [usize; 3],
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let half = rotary_dim / 2;
        let inv_freq = if dtype == DType::F64 {
            let v: Vec<f64> = (0..half)
                .map(|i| 1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64))
                .collect();
            Tensor::from_vec(v, half, device)?
        } else {
            // Same arithmetic as transformers: exponent and power in f32, then the reciprocal.
            let base = theta as f32;
            let v: Vec<f32> = (0..half)
                .map(|i| 1.0f32 / base.powf((2 * i) as f32 / rotary_dim as f32))
                .collect();
            Tensor::from_vec(v, half, device)?.to_dtype(dtype)?
        };
        let axes: Vec<u32> = (0..half).map(|i| pair_axis(i, sections) as u32).collect();
        Ok(Self {
            rotary_dim,
            inv_freq,
            pair_axis: Tensor::from_vec(axes, half, device)?,
        })
    }

    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// `(cos, sin)`, each `[N, rotary_dim/2]` f32, for `N` tokens at the given positions.
    pub fn cos_sin(&self, positions: &[Position3]) -> Result<(Tensor, Tensor)> {
        let n = positions.len();
        let flat: Vec<f32> = positions
            .iter()
            .flat_map(|p| p.iter().map(|&v| v as f32))
            .collect();
        let pos = Tensor::from_vec(flat, (n, 3), self.inv_freq.device())?
            .to_dtype(self.inv_freq.dtype())?;
        let per_pair = pos.index_select(&self.pair_axis, 1)?;
        let angles = per_pair.broadcast_mul(&self.inv_freq.unsqueeze(0)?)?;
        Ok((angles.cos()?, angles.sin()?))
    }

    /// Rotates the first `rotary_dim` dims of every head of `x: [N, heads, head_dim]`.
    pub fn apply(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let head_dim = x.dim(D::Minus1)?;
        let half = self.rotary_dim / 2;
        let cos = cos.unsqueeze(1)?;
        let sin = sin.unsqueeze(1)?;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
        let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
        let mut parts = vec![r1, r2];
        if head_dim > self.rotary_dim {
            parts.push(x.narrow(D::Minus1, self.rotary_dim, head_dim - self.rotary_dim)?);
        }
        Tensor::cat(&parts, D::Minus1)
    }

    /// The attention layer's query and key heads normalised ([`rms_norm`] with `norms`) and rotated
    /// ([`MRope::apply`]): `q: [N, n_h, hd]` (e.g. the query halves of the fused `[query | gate]`
    /// heads), `k: [N, n_kv·hd]` or `[N, n_kv, hd]`; `cos`/`sin` from [`MRope::cos_sin`] for the same
    /// rows. Returns `q: [N, n_h, hd]` and `k: [N, n_kv, hd]`, both in `out`.
    ///
    /// On CUDA (f32) one kernel ([`crate::cuda::qk_norm_rope`]) reads both in place and writes them
    /// directly in `out` (bf16 for the flash kernel), bit for bit the norm kernel followed by this
    /// chain and the cast; elsewhere this is that chain, unchanged (the cast is a no-op when `out` is
    /// the input dtype).
    pub fn norm_and_rotate(
        &self,
        q: &Tensor,
        k: &Tensor,
        norms: &HeadNorms<'_>,
        cos: &Tensor,
        sin: &Tensor,
        out: DType,
    ) -> Result<(Tensor, Tensor)> {
        let (n, _, hd) = q.dims3()?;
        let k_len = k.elem_count();
        if k.dim(0)? != n || hd == 0 || k_len % (n.max(1) * hd) != 0 || k.dim(D::Minus1)? % hd != 0
        {
            candle_core::bail!(
                "q/k norm + rope: k {:?} does not fit q {:?}",
                k.dims(),
                q.dims()
            );
        }
        let n_kv = if n == 0 { 0 } else { k_len / (n * hd) };
        #[cfg(feature = "cuda")]
        if q.device().is_cuda() && q.dtype() == DType::F32 && k.dtype() == DType::F32 {
            return crate::cuda::qk_norm_rope(q, k, norms, cos, sin, self.rotary_dim, out);
        }
        let q = crate::ops::rms_norm(q, norms.q_weight, norms.eps)?;
        let k = crate::ops::rms_norm(&k.reshape((n, n_kv, hd))?, norms.k_weight, norms.eps)?;
        let cast = |t: Tensor| {
            if t.dtype() == out {
                Ok(t)
            } else {
                t.to_dtype(out)
            }
        };
        Ok((
            cast(self.apply(&q, cos, sin)?)?,
            cast(self.apply(&k, cos, sin)?)?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen35_sections_interleave_as_documented() {
        // Reference §2.4: with [11, 11, 10], T ← {0,3,…,30}, H ← {1,4,…,31}, W ← {2,5,…,29}.
        let axes: Vec<usize> = (0..32).map(|i| pair_axis(i, [11, 11, 10])).collect();
        for (i, a) in axes.iter().enumerate() {
            let want = match i % 3 {
                1 => 1,
                2 if i < 30 => 2,
                _ => 0,
            };
            assert_eq!(*a, want, "pair {i}");
        }
        assert_eq!(axes.iter().filter(|&&a| a == 0).count(), 11);
        assert_eq!(axes.iter().filter(|&&a| a == 1).count(), 11);
        assert_eq!(axes.iter().filter(|&&a| a == 2).count(), 10);
    }

    #[test]
    fn norm_and_rotate_is_the_norm_then_the_rotation() {
        let dev = Device::Cpu;
        let (n, n_h, n_kv, hd) = (3, 2, 1, 8);
        let rope = MRope::new(4, 10_000.0, [1, 1, 0], DType::F32, &dev).unwrap();
        let vals = |len: usize, seed: f32| -> Vec<f32> {
            (0..len)
                .map(|i| ((i as f32 + seed) * 0.61).sin() * 3.0)
                .collect()
        };
        // q as the query halves of [query | gate] heads, k as N rows of n_kv·hd (a fused part's shape).
        let qg = Tensor::from_vec(vals(n * n_h * 2 * hd, 0.0), (n, n_h, 2 * hd), &dev).unwrap();
        let q = qg.narrow(2, 0, hd).unwrap();
        let k = Tensor::from_vec(vals(n * n_kv * hd, 5.0), (n, n_kv * hd), &dev).unwrap();
        let (qw, kw) = (
            Tensor::from_vec(vals(hd, 1.0), hd, &dev).unwrap(),
            Tensor::from_vec(vals(hd, 2.0), hd, &dev).unwrap(),
        );
        let norms = HeadNorms {
            q_weight: &qw,
            k_weight: &kw,
            eps: 1e-6,
        };
        let (cos, sin) = rope.cos_sin(&[[0, 0, 0], [4, 4, 4], [7, 2, 9]]).unwrap();
        let (got_q, got_k) = rope
            .norm_and_rotate(&q, &k, &norms, &cos, &sin, DType::F32)
            .unwrap();
        let want_q = rope
            .apply(&crate::ops::rms_norm(&q, &qw, 1e-6).unwrap(), &cos, &sin)
            .unwrap();
        let k3 = k.reshape((n, n_kv, hd)).unwrap();
        let want_k = rope
            .apply(&crate::ops::rms_norm(&k3, &kw, 1e-6).unwrap(), &cos, &sin)
            .unwrap();
        let bits = |t: &Tensor| -> Vec<u32> {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        assert_eq!(got_k.dims(), &[n, n_kv, hd]);
        assert_eq!(bits(&got_q), bits(&want_q));
        assert_eq!(bits(&got_k), bits(&want_k));
        let (q16, k16) = rope
            .norm_and_rotate(&q, &k, &norms, &cos, &sin, DType::BF16)
            .unwrap();
        assert_eq!((q16.dtype(), k16.dtype()), (DType::BF16, DType::BF16));
        assert_eq!(bits(&q16), bits(&want_q.to_dtype(DType::BF16).unwrap()));
        assert_eq!(bits(&k16), bits(&want_k.to_dtype(DType::BF16).unwrap()));
        // A k that is not N rows of whole heads is refused.
        assert!(rope
            .norm_and_rotate(
                &q,
                &k.narrow(1, 0, 5).unwrap(),
                &norms,
                &cos,
                &sin,
                DType::F32
            )
            .is_err());
    }

    #[test]
    fn rotation_matches_the_pairwise_formula_and_passes_the_tail() {
        let dev = Device::Cpu;
        let rope = MRope::new(4, 10_000.0, [1, 1, 0], DType::F32, &dev).unwrap();
        // Distinct axes so that the H stream (pair 1) is visibly used.
        let pos = [[3u32, 5, 7]];
        let (cos, sin) = rope.cos_sin(&pos).unwrap();
        let x = Tensor::new(&[[[1.0f32, 2.0, 3.0, 4.0, 9.0, -9.0]]], &dev).unwrap();
        let y = rope
            .apply(&x, &cos, &sin)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let f0 = 3.0f32 * 1.0; // pair 0: T axis, inv_freq 1
        let f1 = 5.0f32 * (1.0 / 10_000f32.powf(0.5)); // pair 1: H axis
        let want = [
            1.0 * f0.cos() - 3.0 * f0.sin(),
            2.0 * f1.cos() - 4.0 * f1.sin(),
            3.0 * f0.cos() + 1.0 * f0.sin(),
            4.0 * f1.cos() + 2.0 * f1.sin(),
            9.0,
            -9.0,
        ];
        for (a, b) in y.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{y:?} vs {want:?}");
        }
    }
}
