//! Partial, interleaved multi-axis rotary embedding (Qwen3.5's M-RoPE).
//!
//! Only the first `rotary_dim` dims of each head rotate, NeoX style: element `i` pairs with
//! `i + rotary_dim/2`. Each of the `rotary_dim/2` frequency pairs takes its angle from one of three
//! position streams (T, H, W), assigned in an interleaved pattern. Text tokens have equal positions on all
//! three axes, which makes this ordinary partial RoPE; the 3-axis interface is kept for image tokens.

use candle_core::{DType, Device, Result, Tensor, D};

/// A token's position on the three M-RoPE axes (temporal, height, width).
pub type Position3 = [u32; 3];

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
