//! Helpers shared by the robustness and writer tests: fixture paths, deterministic test data, GGUF
//! header offsets.
#![allow(dead_code)]

use std::path::PathBuf;

/// A file of the `qwen35-tiny` fixture.
pub fn fixture_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen35-tiny")
        .join(name)
}

/// splitmix64: deterministic test data without a rand crate. (prism-quant's tests/common has the same
/// generator: two crates' tests share no module.)
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (in `0..1` when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Roughly normal, scale `sigma`.
    pub fn normal(&mut self, sigma: f32) -> f32 {
        let s: f32 = (0..4)
            .map(|_| (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32)
            .sum();
        (s - 2.0) * sigma * 1.7
    }
}

/// Where each header field of a well-formed GGUF sits: (offset, width in bytes, description).
/// Descriptions: "version", "tensor count", "kv count", "key length", "value type", "1-byte value",
/// "string length", "array element type", "array length", "tensor name length", "n_dims", "dimension",
/// "tensor type", "tensor offset".
pub fn header_fields(bytes: &[u8]) -> Vec<(usize, usize, String)> {
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
    let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
    let mut fields = vec![
        (4, 4, "version".to_string()),
        (8, 8, "tensor count".into()),
        (16, 8, "kv count".into()),
    ];
    let n_tensors = u64_at(8);
    let n_kv = u64_at(16);
    let mut pos = 24;
    fn value(bytes: &[u8], pos: &mut usize, ty: u32, fields: &mut Vec<(usize, usize, String)>) {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        match ty {
            0 | 1 | 7 => {
                fields.push((*pos, 1, "1-byte value".into()));
                *pos += 1
            }
            2 | 3 => *pos += 2,
            4..=6 => *pos += 4,
            10..=12 => *pos += 8,
            8 => {
                fields.push((*pos, 8, "string length".into()));
                *pos += 8 + u64_at(*pos)
            }
            9 => {
                let elem = u32_at(*pos);
                fields.push((*pos, 4, "array element type".into()));
                fields.push((*pos + 4, 8, "array length".into()));
                let count = u64_at(*pos + 4);
                *pos += 12;
                for _ in 0..count {
                    value(bytes, pos, elem, fields);
                }
            }
            _ => unreachable!(),
        }
    }
    for _ in 0..n_kv {
        fields.push((pos, 8, "key length".into()));
        pos += 8 + u64_at(pos);
        fields.push((pos, 4, "value type".into()));
        let ty = u32_at(pos);
        pos += 4;
        value(bytes, &mut pos, ty, &mut fields);
    }
    for _ in 0..n_tensors {
        fields.push((pos, 8, "tensor name length".into()));
        pos += 8 + u64_at(pos);
        fields.push((pos, 4, "n_dims".into()));
        let n_dims = u32_at(pos) as usize;
        pos += 4;
        for _ in 0..n_dims {
            fields.push((pos, 8, "dimension".into()));
            pos += 8;
        }
        fields.push((pos, 4, "tensor type".into()));
        fields.push((pos + 4, 8, "tensor offset".into()));
        pos += 12;
    }
    fields
}
