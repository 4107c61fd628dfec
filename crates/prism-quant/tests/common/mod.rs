//! Shared by the integer-path tests: deterministic test data without a dependency.
#![allow(dead_code)]

/// splitmix64: deterministic test data without a dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [−1, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of 4 uniforms, variance ≈ 1).
    pub fn gaussianish(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 0.87
    }
    /// [`Self::gaussianish`] × 0.92, with an occasional outlier (× 6).
    pub fn normalish(&mut self) -> f32 {
        let v = self.gaussianish() * (0.8 / 0.87);
        if self.next() % 97 == 0 {
            v * 6.0
        } else {
            v
        }
    }
}
