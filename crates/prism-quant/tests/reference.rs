//! The integer matmul against independent references: unpacking against prism-gguf's (ggml-exact)
//! dequantization, the integer block sums against a plain i64 computation from the raw bytes, the whole
//! product against an f64 "dequantize and multiply", the documented 4-part reduction written out
//! separately, and the batch invariance the design promises.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use half::f16;
use prism_gguf::blocks::{dequantize, scale_min_k4};
use prism_gguf::quantize::quantize;
use prism_gguf::{GgmlType, GgufFile};
use prism_quant::kernel::{
    block_sums, matmul_quantized, matmul_quantized_with, quantize_for, row_dot,
};
use prism_quant::{
    matmul, part_bounds, ActivationScale, QuantError, QuantMatmul, QuantWeight, WeightFormat,
};

/// splitmix64: deterministic test data without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [−1, 1).
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    /// Roughly normal (sum of 4 uniforms), with an occasional outlier.
    fn normalish(&mut self) -> f32 {
        let v: f32 = (0..4).map(|_| self.uniform()).sum::<f32>() * 0.8;
        if self.next() % 97 == 0 {
            v * 6.0
        } else {
            v
        }
    }
}

fn fixture(file: &str) -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen35-tiny")
        .join(file);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A tensor of a fixture file as a `QuantWeight` (rows = GGUF dims[1]).
fn fixture_weight(gguf: &GgufFile, name: &str) -> (QuantWeight, Vec<u8>) {
    let info = gguf.tensor_info(name).unwrap();
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    let bytes = gguf.tensor_bytes(info).to_vec();
    let w = QuantWeight::from_gguf(name, info.ggml_type, &bytes, rows, cols).unwrap();
    (w, bytes)
}

/// A synthetic weight of `rows × cols` in `ty`: quantized by llama.cpp's reference quantizers
/// (prism-gguf) for Q8_0/Q4_K/Q6_K, random bytes with sane scales for Q5_K.
fn synthetic(ty: GgmlType, rows: usize, cols: usize, rng: &mut Rng) -> (QuantWeight, Vec<u8>) {
    let bytes = if ty == GgmlType::Q5_K {
        let mut b: Vec<u8> = (0..rows * cols / 256 * 176)
            .map(|_| rng.next() as u8)
            .collect();
        for blk in b.chunks_exact_mut(176) {
            let d = f16::from_f32(0.001 + 0.01 * rng.uniform().abs())
                .to_bits()
                .to_le_bytes();
            let dmin = f16::from_f32(0.002 * rng.uniform().abs())
                .to_bits()
                .to_le_bytes();
            blk[0..2].copy_from_slice(&d);
            blk[2..4].copy_from_slice(&dmin);
        }
        b
    } else {
        let values: Vec<f32> = (0..rows * cols).map(|_| rng.normalish() * 0.06).collect();
        quantize(ty, &values).unwrap()
    };
    let w = QuantWeight::from_gguf("synthetic", ty, &bytes, rows, cols).unwrap();
    (w, bytes)
}

/// Independent decoding of one weight element from the raw bytes: `(integer weight, sub-block scale,
/// sub-block min, d, dmin)` with `x = d·sc·q − dmin·m` exactly.
fn element(
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
    n: usize,
    e: usize,
) -> (i64, i64, i64, f64, f64) {
    let bs = ty.type_size();
    let per_row = cols / ty.block_size();
    let blk = &bytes[(n * per_row + e / ty.block_size()) * bs..][..bs];
    let e = e % ty.block_size();
    let h = |o: usize| f64::from(f16::from_bits(u16::from_le_bytes([blk[o], blk[o + 1]])).to_f32());
    match ty {
        GgmlType::Q8_0 => (i64::from(blk[2 + e] as i8), 1, 0, h(0), 0.0),
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let packed: [u8; 12] = blk[4..16].try_into().unwrap();
            let (sc, m) = scale_min_k4(e / 32, &packed);
            let (chunk, high, l) = (e / 64, (e % 64) / 32, e % 32);
            let ql = if ty == GgmlType::Q4_K {
                &blk[16..]
            } else {
                &blk[48..]
            };
            let byte = ql[32 * chunk + l];
            let mut q = if high == 1 { byte >> 4 } else { byte & 15 } as i64;
            if ty == GgmlType::Q5_K {
                q += i64::from((blk[16 + l] >> (e / 32)) & 1) * 16;
            }
            (q, i64::from(sc), i64::from(m), h(0), h(2))
        }
        GgmlType::Q6_K => {
            let (half, r) = (e / 128, e % 128);
            let (quarter, l) = (r / 32, r % 32);
            let lbyte = blk[64 * half + l + 32 * (quarter % 2)];
            let low = if quarter >= 2 { lbyte >> 4 } else { lbyte & 15 };
            let hb = (blk[128 + 32 * half + l] >> (2 * quarter)) & 3;
            let q = i64::from(low | (hb << 4)) - 32;
            (q, i64::from(blk[192 + e / 16] as i8), 0, h(208), 0.0)
        }
        other => panic!("no reference for {other:?}"),
    }
}

fn sub_len(ty: GgmlType) -> usize {
    if ty == GgmlType::Q6_K {
        16
    } else {
        32
    }
}

/// `(D_b, M_b)` of every block of row `n`, in i64, straight from the bytes.
fn reference_block_sums(
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
    n: usize,
    qa: &[i8],
) -> Vec<(i64, i64)> {
    let block = ty.block_size();
    let sub = sub_len(ty);
    (0..cols / block)
        .map(|b| {
            let (mut d, mut m) = (0i64, 0i64);
            for s in (b * block..(b + 1) * block).step_by(sub) {
                let (mut dot, mut sum) = (0i64, 0i64);
                let (mut sc, mut mn) = (0, 0);
                for (e, &a) in qa.iter().enumerate().skip(s).take(sub) {
                    let (q, sc_e, m_e, _, _) = element(ty, bytes, cols, n, e);
                    dot += q * i64::from(a);
                    sum += i64::from(a);
                    (sc, mn) = (sc_e, m_e);
                }
                d += sc * dot;
                m += mn * sum;
            }
            (d, m)
        })
        .collect()
}

fn activations(rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..rows * cols).map(|_| rng.normalish()).collect()
}

fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

const ALL: [GgmlType; 4] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn unpacked_weights_dequantize_like_ggml_bit_for_bit() {
    let mut checked = 0;
    for file in ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"] {
        let gguf = fixture(file);
        let quantized =
            |t: &&prism_gguf::TensorInfo| WeightFormat::from_ggml(t.ggml_type).is_some();
        for info in gguf.tensors().iter().filter(quantized) {
            let (w, bytes) = fixture_weight(&gguf, &info.name);
            let want = dequantize(info.ggml_type, &bytes, w.rows() * w.cols()).unwrap();
            let got = w.dequantize().unwrap();
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{file}: {}",
                info.name
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 128, "64 matrices per file");
    let mut rng = Rng(7);
    let (w, bytes) = synthetic(GgmlType::Q5_K, 3, 512, &mut rng);
    let want = dequantize(GgmlType::Q5_K, &bytes, 3 * 512).unwrap();
    let got = w.dequantize().unwrap();
    assert!(
        got.iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "Q5_K"
    );
}

#[test]
fn tensors_of_several_unpack_tasks_dequantize_like_ggml_bit_for_bit() {
    // from_gguf unpacks in tasks of about UNPACK_TASK_BYTES on the rayon pool: a tensor of 2.5 tasks
    // (the last one partial) per format must still be ggml's bits everywhere, task edges included.
    let mut rng = Rng(11);
    for ty in [
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
    ] {
        let cols = if ty == GgmlType::Q8_0 { 1024 } else { 2048 };
        let row_bytes = cols / ty.block_size() * ty.type_size();
        let rows = (5 * prism_quant::weight::UNPACK_TASK_BYTES / 2).div_ceil(row_bytes);
        let (w, bytes) = synthetic(ty, rows, cols, &mut rng);
        assert!(
            bytes.len() > 2 * prism_quant::weight::UNPACK_TASK_BYTES,
            "{ty:?}"
        );
        let want = dequantize(ty, &bytes, rows * cols).unwrap();
        let got = w.dequantize().unwrap();
        let differing = got
            .iter()
            .zip(&want)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!((differing, got.len()), (0, want.len()), "{ty:?}");
    }
}

#[test]
fn integer_block_sums_equal_an_i64_reference() {
    let mut rng = Rng(11);
    for ty in ALL {
        let (rows, cols) = (5, 768);
        let (w, bytes) = synthetic(ty, rows, cols, &mut rng);
        let x = activations(3, cols, &mut rng);
        let scale = ActivationScale::from_absmax(absmax(&x) * 0.7).unwrap(); // some clamping too
        let qx = quantize_for(&x, 3, &w, &scale).unwrap();
        for r in 0..3 {
            for n in 0..rows {
                let want = reference_block_sums(ty, &bytes, cols, n, qx.row(r));
                for (b, &(d, m)) in want.iter().enumerate() {
                    let got = block_sums(&w, n, b, qx.row(r), qx.row_sums(r));
                    assert_eq!(
                        (i64::from(got.0), i64::from(got.1)),
                        (d, m),
                        "{ty:?} row {n} block {b}"
                    );
                }
            }
        }
    }
}

#[test]
fn extreme_values_stay_exact_in_i32() {
    // Q6_K: every q = 0 (q − 32 = −32), every scale −128, activations all −127: the largest |D_b|.
    let mut block = vec![0u8; 210];
    for s in &mut block[192..208] {
        *s = (-128i8) as u8;
    }
    block[208..210].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    let w = QuantWeight::from_gguf("q6k-extreme", GgmlType::Q6_K, &block, 1, 256).unwrap();
    let scale = ActivationScale::from_absmax(127.0).unwrap();
    let x = vec![-127.0f32; 256];
    let qx = quantize_for(&x, 1, &w, &scale).unwrap();
    assert_eq!(
        block_sums(&w, 0, 0, qx.row(0), qx.row_sums(0)).0,
        -133_169_152
    );
    // Above 2^24 the conversion to f32 rounds (to nearest even): 133,169,152 = 2^27 − 1,048,576 is exact.
    assert_eq!(matmul(&x, 1, &w, &scale).unwrap()[0], -133_169_152.0);

    // Q8_0 with q = −128 (never written by llama.cpp's quantizer, but legal in a file).
    let mut block = vec![0x80u8; 34];
    block[0..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
    let w = QuantWeight::from_gguf("q8-extreme", GgmlType::Q8_0, &block, 1, 32).unwrap();
    let qx = quantize_for(&x[..32], 1, &w, &scale).unwrap();
    assert_eq!(block_sums(&w, 0, 0, qx.row(0), &[]).0, 32 * 128 * 127);
    assert_eq!(matmul(&x[..32], 1, &w, &scale).unwrap()[0], 0.5 * 520_192.0);

    // Q5_K with every q = 31, scales and mins 63, activations 127.
    let mut block = vec![0xFFu8; 176];
    block[0..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    block[2..4].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    let w = QuantWeight::from_gguf("q5k-extreme", GgmlType::Q5_K, &block, 1, 256).unwrap();
    let x = vec![127.0f32; 256];
    let qx = quantize_for(&x, 1, &w, &scale).unwrap();
    assert_eq!(
        block_sums(&w, 0, 0, qx.row(0), qx.row_sums(0)),
        (8 * 63 * 32 * 31 * 127, 8 * 63 * 32 * 127)
    );
}

/// The documented reduction, written out independently: 4 parts `⌊p·nb/4⌋..⌊(p+1)·nb/4⌋`, each from
/// +0.0 with `fma(d, D, acc)` (and `fma(−dmin, M, acc)`), combined as `(p0+p1)+(p2+p3)`, times scale.
fn documented_output(
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
    n: usize,
    qa: &[i8],
    scale: f32,
) -> f32 {
    let sums = reference_block_sums(ty, bytes, cols, n, qa);
    let nb = sums.len();
    let mut parts = [0f32; 4];
    for (p, part) in parts.iter_mut().enumerate() {
        for (b, &(dd, mm)) in sums
            .iter()
            .enumerate()
            .take((p + 1) * nb / 4)
            .skip(p * nb / 4)
        {
            let (_, _, _, d, dmin) = element(ty, bytes, cols, n, b * ty.block_size());
            *part = (d as f32).mul_add(dd as i32 as f32, *part);
            if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
                *part = (-(dmin as f32)).mul_add(mm as i32 as f32, *part);
            }
        }
    }
    ((parts[0] + parts[1]) + (parts[2] + parts[3])) * scale
}

#[test]
fn the_reduction_is_the_documented_four_part_tree() {
    let mut rng = Rng(23);
    assert_eq!(part_bounds(1), [0, 0, 0, 0, 1]);
    assert_eq!(part_bounds(7), [0, 1, 3, 5, 7]);
    assert_eq!(part_bounds(8), [0, 2, 4, 6, 8]);
    for ty in ALL {
        // Block counts below, at and above 4, and not multiples of 4.
        for nb in [1usize, 2, 3, 4, 5, 7, 9] {
            let cols = nb * ty.block_size();
            let (w, bytes) = synthetic(ty, 6, cols, &mut rng);
            let x = activations(2, cols, &mut rng);
            let scale = ActivationScale::from_absmax(absmax(&x)).unwrap();
            let y = matmul(&x, 2, &w, &scale).unwrap();
            let qx = quantize_for(&x, 2, &w, &scale).unwrap();
            for r in 0..2 {
                for n in 0..6 {
                    let want = documented_output(ty, &bytes, cols, n, qx.row(r), scale.scale());
                    assert_eq!(
                        y[r * 6 + n].to_bits(),
                        want.to_bits(),
                        "{ty:?} nb {nb} row {r} out {n}"
                    );
                }
            }
        }
    }
}

#[test]
fn matches_dequantize_and_multiply_in_f64_within_the_rounding_bound() {
    let mut rng = Rng(31);
    let mut worst = 0f64;
    for ty in ALL {
        let (rows, cols) = (16, 1280);
        let (w, bytes) = synthetic(ty, rows, cols, &mut rng);
        let x = activations(4, cols, &mut rng);
        let scale = ActivationScale::from_absmax(absmax(&x)).unwrap();
        let y = matmul(&x, 4, &w, &scale).unwrap();
        let qx = quantize_for(&x, 4, &w, &scale).unwrap();
        let s = f64::from(scale.scale());
        for r in 0..4 {
            for n in 0..rows {
                // Exact real value: Σ_i (d·sc·q − dmin·m)·qa, in f64 (every term is exact there).
                let (mut exact, mut magnitude) = (0f64, 0f64);
                for e in 0..cols {
                    let (q, sc, m, d, dmin) = element(ty, &bytes, cols, n, e);
                    let qa = f64::from(qx.row(r)[e]);
                    let pos = d * (sc * q) as f64 * qa;
                    let neg = dmin * m as f64 * qa;
                    exact += pos - neg;
                    magnitude += pos.abs() + neg.abs();
                }
                let want = exact * s;
                let got = f64::from(y[r * rows + n]);
                // Each block adds ≤ 2 roundings (conversion, fma), each part ≤ nb/4 + 1 blocks, then 3
                // additions and the scale: relative 2^-24 each, against the sum of magnitudes.
                let nb = (cols / ty.block_size()) as f64;
                let bound = (2.0 * (nb / 4.0 + 1.0) + 4.0) * 2f64.powi(-24) * magnitude * s
                    + 2f64.powi(-24) * want.abs();
                let err = (got - want).abs();
                assert!(
                    err <= bound,
                    "{ty:?} r {r} n {n}: {got} vs {want} (err {err:e}, bound {bound:e})"
                );
                if magnitude > 0.0 {
                    worst = worst.max(err / (magnitude * s));
                }
            }
        }
    }
    println!("worst error relative to Σ|terms|: {worst:e}");
}

#[test]
fn a_row_gets_the_same_bits_whatever_else_is_in_the_call() {
    let mut rng = Rng(41);
    for ty in ALL {
        let cols = 512;
        let (w, _) = synthetic(ty, 40, cols, &mut rng);
        let x = activations(64, cols, &mut rng);
        let scale = ActivationScale::from_absmax(absmax(&x)).unwrap();
        let full = matmul(&x, 64, &w, &scale).unwrap();
        let row_bits = |y: &[f32], r: usize| -> Vec<u32> {
            y[r * 40..(r + 1) * 40]
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        for m in 1..=64 {
            let part = matmul(&x[..m * cols], m, &w, &scale).unwrap();
            for r in 0..m {
                assert_eq!(
                    row_bits(&part, r),
                    row_bits(&full, r),
                    "{ty:?}: M = {m}, row {r}"
                );
            }
        }
        // Reversed and interleaved rows, and rows next to zero (padding) rows.
        let order: Vec<usize> = (0..64).rev().step_by(3).chain((0..64).step_by(5)).collect();
        let mut shuffled = Vec::new();
        for &r in &order {
            shuffled.extend_from_slice(&x[r * cols..(r + 1) * cols]);
            shuffled.extend(std::iter::repeat_n(0f32, cols));
        }
        let y = matmul(&shuffled, 2 * order.len(), &w, &scale).unwrap();
        for (i, &r) in order.iter().enumerate() {
            assert_eq!(
                row_bits(&y, 2 * i),
                row_bits(&full, r),
                "{ty:?}: permuted row {r}"
            );
            assert!(
                row_bits(&y, 2 * i + 1).iter().all(|&b| b == 0),
                "{ty:?}: a zero row gives +0"
            );
        }
        // More threads: the same bits.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let threaded = pool.install(|| matmul(&x, 64, &w, &scale).unwrap());
        assert_eq!(
            threaded.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            full.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{ty:?}: threads"
        );
        // Selected rows (a read-out's letters): the same bits as those outputs of the full matrix.
        let pick = [39u32, 0, 17, 17, 5];
        let sel = w.select_rows(&pick).unwrap();
        let ys = matmul(&x, 64, &sel, &scale).unwrap();
        for r in 0..64 {
            for (j, &p) in pick.iter().enumerate() {
                assert_eq!(ys[r * 5 + j].to_bits(), full[r * 40 + p as usize].to_bits());
            }
        }
    }
}

#[test]
fn the_candle_op_is_the_kernel() {
    let gguf = fixture("tiny-Q4_K_M.gguf");
    let mut rng = Rng(53);
    for name in [
        "blk.0.attn_qkv.weight",
        "blk.0.ffn_gate.weight",
        "blk.3.ffn_down.weight",
    ] {
        let (w, _) = fixture_weight(&gguf, name);
        let x = activations(7, w.cols(), &mut rng);
        let scale = ActivationScale::from_absmax(absmax(&x)).unwrap();
        let want = matmul(&x, 7, &w, &scale).unwrap();
        let op = QuantMatmul::new(Arc::new(w.clone()), scale);
        let t = Tensor::from_vec(x.clone(), (7, w.cols()), &Device::Cpu).unwrap();
        let got = op.forward(&t).unwrap();
        assert_eq!(got.dims(), &[7, w.rows()]);
        let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(got, want, "{name}");
        // A transposed (non-contiguous) view is made contiguous first: same result.
        let tt = t.t().unwrap().contiguous().unwrap().t().unwrap();
        let got: Vec<f32> = op
            .forward(&tt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(got, want);
        // row_dot × scale is each output.
        let qx = quantize_for(&x, 7, &w, &scale).unwrap();
        assert_eq!(
            row_dot(&w, 3, qx.row(2), qx.row_sums(2)) * scale.scale(),
            want[2 * w.rows() + 3]
        );
        assert_eq!(matmul_quantized(&qx, &w, &scale), want);
        // The portable loops give the AVX2 build's bits.
        let portable = matmul_quantized_with(&qx, &w, &scale, false);
        assert_eq!(
            portable.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            "{name}: portable vs SIMD"
        );
    }
}

#[test]
fn bad_inputs_are_typed_errors() {
    let block = vec![0u8; 34];
    let err = QuantWeight::from_gguf("blk.0.x", GgmlType::Q4_0, &[0u8; 18], 1, 32).unwrap_err();
    assert!(
        matches!(err, QuantError::UnsupportedType { ref tensor, ty: GgmlType::Q4_0 } if tensor == "blk.0.x")
    );
    assert!(matches!(
        QuantWeight::from_gguf("f", GgmlType::F32, &[0u8; 128], 1, 32),
        Err(QuantError::UnsupportedType { .. })
    ));
    assert!(matches!(
        QuantWeight::from_gguf("p", GgmlType::Q8_0, &block, 1, 31),
        Err(QuantError::PartialBlock { cols: 31, .. })
    ));
    assert!(matches!(
        QuantWeight::from_gguf("p", GgmlType::Q4_K, &[0u8; 144], 1, 128),
        Err(QuantError::PartialBlock { .. })
    ));
    assert!(matches!(
        QuantWeight::from_gguf("short", GgmlType::Q8_0, &block[..33], 1, 32),
        Err(QuantError::ByteLength {
            expected: 34,
            actual: 33,
            ..
        })
    ));
    assert!(matches!(
        QuantWeight::from_gguf("long", GgmlType::Q8_0, &block, 2, 32),
        Err(QuantError::ByteLength { expected: 68, .. })
    ));
    assert!(matches!(
        QuantWeight::from_gguf("huge", GgmlType::Q8_0, &block, usize::MAX, 32),
        Err(QuantError::SizeOverflow { .. })
    ));
    let w = QuantWeight::from_gguf("w", GgmlType::Q8_0, &block, 1, 32).unwrap();
    assert!(matches!(
        w.dequantize_row(1),
        Err(QuantError::RowOutOfRange {
            row: 1,
            rows: 1,
            ..
        })
    ));
    assert!(matches!(
        w.select_rows(&[0, 5]),
        Err(QuantError::RowOutOfRange { row: 5, .. })
    ));
    let scale = ActivationScale::from_absmax(1.0).unwrap();
    assert!(matches!(
        matmul(&[0.0; 64], 1, &w, &scale),
        Err(QuantError::InputWidth {
            expected: 32,
            found: 64,
            ..
        })
    ));
    let mut x = vec![0.0f32; 64];
    x[40] = f32::NAN;
    assert!(matches!(
        matmul(&x, 2, &w, &scale),
        Err(QuantError::NonFiniteActivation { row: 1, col: 8, .. })
    ));
    // Through candle: wrong width, wrong dtype, a NaN.
    let op = QuantMatmul::new(Arc::new(w), scale);
    let dev = Device::Cpu;
    assert!(op
        .forward(&Tensor::zeros((2, 64), candle_core::DType::F32, &dev).unwrap())
        .is_err());
    assert!(op
        .forward(&Tensor::zeros((2, 32), candle_core::DType::F64, &dev).unwrap())
        .is_err());
    let err = op
        .forward(&Tensor::from_vec(x, (2, 32), &dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("\"w\"") && err.contains("row 1, element 8"),
        "{err}"
    );
    assert_eq!(
        WeightFormat::from_ggml(GgmlType::Q8_0),
        Some(WeightFormat::Q8_0)
    );
}
