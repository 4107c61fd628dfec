//! The integer matmul against independent references: unpacking against prism-gguf's (ggml-exact)
//! dequantization, the Q8_0 re-blocking against exact rational arithmetic in integers, the activation
//! quantization and the integer run sums against plain computations from the raw bytes, the whole
//! product against an f64 "dequantize and multiply", the documented 4-part reduction written out
//! separately, the tensor-parallel split, and the batch invariance the design promises.

use std::path::PathBuf;
use std::sync::Arc;

use candle_core::{Device, Tensor};
use half::f16;
use prism_gguf::blocks::{dequantize, scale_min_k4};
use prism_gguf::quantize::quantize;
use prism_gguf::{GgmlType, GgufFile};
use prism_quant::kernel::{
    combine_parts, matmul_quantized, matmul_quantized_with, quantize_for, row_dot, row_part,
    run_sums,
};
use prism_quant::{
    matmul, part_bounds, run_count, Q8Scales, QuantError, QuantMatmul, QuantWeight, WeightFormat,
    RUN,
};

mod common;

use common::Rng;

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

/// An f16 value (as f32) as `m · 2^e` with an integer `m`.
fn f16_parts(v: f32) -> (i128, i32) {
    if v == 0.0 {
        return (0, 0);
    }
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32;
    let mant = i128::from(bits & 0x7F_FFFF) | if exp == 0 { 0 } else { 1 << 23 };
    let sign = if v < 0.0 { -1 } else { 1 };
    (sign * mant, exp.max(1) - 127 - 23)
}

/// `rint(q · d / s)` by exact rational arithmetic in integers (ties to even), clamped to [−128, 127].
fn exact_reblock(q: i64, d: f32, s: f32) -> i64 {
    if s == 0.0 {
        return 0;
    }
    let ((dm, de), (sm, se)) = (f16_parts(d), f16_parts(s));
    let (mut num, mut den) = (i128::from(q) * dm, sm);
    if de >= se {
        num <<= de - se;
    } else {
        den <<= se - de;
    }
    if den < 0 {
        (num, den) = (-num, -den);
    }
    let fl = num.div_euclid(den);
    let rem2 = 2 * num.rem_euclid(den);
    let r = if rem2 > den || (rem2 == den && fl % 2 != 0) {
        fl + 1
    } else {
        fl
    };
    r.clamp(-128, 127) as i64
}

/// The Q8_0 run scales of row `n` straight from the bytes: the largest |d| of each run's blocks (or of
/// the row).
fn reference_q8_scales(bytes: &[u8], cols: usize, n: usize, scales: Q8Scales) -> Vec<f32> {
    let d = |b: usize| element(GgmlType::Q8_0, bytes, cols, n, 32 * b).3 as f32;
    let row_max = (0..cols / 32).fold(0f32, |m, b| m.max(d(b).abs()));
    (0..run_count(cols))
        .map(|r| match scales {
            Q8Scales::PerRow => row_max,
            Q8Scales::PerRun => {
                (4 * r..(4 * r + 4).min(cols / 32)).fold(0f32, |m, b| m.max(d(b).abs()))
            }
        })
        .collect()
}

// Takes the same arguments and gives the same tuple as `element` (one element of the raw bytes), which
// it re-blocks for Q8_0: the signatures stay alike on purpose.
/// The weight a kernel multiplies for element `e` of row `n`, from the bytes: `(q, sc, m, w, wmin)`
/// with `x = w·sc·q − wmin·m`; for Q8_0 the re-blocked `q'` and its run's `sw`.
fn kernel_element(
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
    n: usize,
    e: usize,
) -> (i64, i64, i64, f64, f64) {
    let el = element(ty, bytes, cols, n, e);
    if ty != GgmlType::Q8_0 {
        return el;
    }
    let sw = reference_q8_scales(bytes, cols, n, Q8Scales::PerRun)[e / RUN];
    (
        exact_reblock(el.0, el.3 as f32, sw),
        1,
        0,
        f64::from(sw),
        0.0,
    )
}

/// `(I_r, M_r)` of every run of 128 of row `n`, in i64, straight from the bytes.
fn reference_run_sums(
    ty: GgmlType,
    bytes: &[u8],
    cols: usize,
    n: usize,
    qa: &[i8],
) -> Vec<(i64, i64)> {
    let sub = sub_len(ty);
    (0..run_count(cols))
        .map(|r| {
            let (mut d, mut m) = (0i64, 0i64);
            for s in (r * RUN..((r + 1) * RUN).min(cols)).step_by(sub) {
                let (mut dot, mut sum) = (0i64, 0i64);
                let (mut sc, mut mn) = (0, 0);
                for (e, &a) in qa.iter().enumerate().skip(s).take(sub) {
                    let (q, sc_e, m_e, _, _) = kernel_element(ty, bytes, cols, n, e);
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

/// The activation quantization written out from the contract: per run of 128, `amax`, then
/// `sa = amax / 127`, `inv = 127 / amax` (zeros below 2⁻¹²⁰), `qa = clamp(rint(x · inv), −127, 127)`.
fn reference_quantize(x: &[f32]) -> (Vec<i8>, Vec<f32>) {
    let (mut q, mut sa) = (Vec::new(), Vec::new());
    for run in x.chunks(RUN) {
        let mut amax = 0f32;
        for v in run {
            if v.abs() > amax {
                amax = v.abs();
            }
        }
        let (s, inv) = if amax < 2f32.powi(-120) {
            (0.0, 0.0)
        } else {
            (amax / 127.0, 127.0 / amax)
        };
        sa.push(s);
        for v in run {
            let t = (v * inv).round_ties_even();
            q.push(t.clamp(-127.0, 127.0) as i8);
        }
    }
    (q, sa)
}

/// Activations whose rows and runs differ in magnitude by orders of magnitude (a row's scales must
/// come from its own runs), with a few massive channels.
fn uneven_activations(rows: usize, cols: usize, rng: &mut Rng) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let v = rng.normalish() * 10f32.powi((r % 5) as i32 - 2);
            if c % 97 == 13 {
                v * 300.0
            } else {
                v
            }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

const ALL: [GgmlType; 4] = [
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[test]
fn k_quant_weights_dequantize_like_ggml_bit_for_bit() {
    let mut checked = 0;
    let gguf = fixture("tiny-Q4_K_M.gguf");
    let k_quant = |t: &&prism_gguf::TensorInfo| {
        WeightFormat::from_ggml(t.ggml_type).is_some() && t.ggml_type != GgmlType::Q8_0
    };
    for info in gguf.tensors().iter().filter(k_quant) {
        let (w, bytes) = fixture_weight(&gguf, &info.name);
        let want = dequantize(info.ggml_type, &bytes, w.rows() * w.cols()).unwrap();
        let got = w.dequantize().unwrap();
        assert_eq!(bits(&got), bits(&want), "{}", info.name);
        checked += 1;
    }
    assert_eq!(checked, 64, "64 matrices");
    let mut rng = Rng(7);
    let (w, bytes) = synthetic(GgmlType::Q5_K, 3, 512, &mut rng);
    let want = dequantize(GgmlType::Q5_K, &bytes, 3 * 512).unwrap();
    assert_eq!(bits(&w.dequantize().unwrap()), bits(&want), "Q5_K");
}

/// Every Q8_0 weight re-blocked as the exact rational rounding says, its run scale the largest |d| of
/// the run, and its value within half a step of the file's.
fn check_reblocked(w: &QuantWeight, bytes: &[u8], scales: Q8Scales, what: &str) {
    let cols = w.cols();
    for n in 0..w.rows() {
        let sw = reference_q8_scales(bytes, cols, n, scales);
        assert_eq!(bits(w.row_d(n)), bits(&sw), "{what}: row {n} scales");
        let got = w.dequantize_row(n).unwrap();
        for (e, (&q, &v)) in w.row_q(n).iter().zip(&got).enumerate() {
            let (q0, _, _, d, _) = element(GgmlType::Q8_0, bytes, cols, n, e);
            let s = sw[e / RUN];
            assert_eq!(
                i64::from(q),
                exact_reblock(q0, d as f32, s),
                "{what}: {n},{e}"
            );
            assert_eq!(v.to_bits(), (f32::from(q) * s).to_bits());
            // |q'·s − q·d| ≤ s/2 (the clamp of +128 costs a full step, never written by llama.cpp).
            if q0 != -128 {
                assert!((f64::from(v) - q0 as f64 * d).abs() <= f64::from(s) / 2.0);
            }
        }
    }
}

#[test]
fn q8_0_is_re_blocked_as_the_exact_rational_rounding() {
    let gguf = fixture("tiny-Q8_0.gguf");
    let mut checked = 0;
    for info in gguf
        .tensors()
        .iter()
        .filter(|t| t.ggml_type == GgmlType::Q8_0)
    {
        let (w, bytes) = fixture_weight(&gguf, &info.name);
        check_reblocked(&w, &bytes, Q8Scales::PerRun, &info.name);
        let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
        let per_row = QuantWeight::from_gguf_with(
            &info.name,
            GgmlType::Q8_0,
            &bytes,
            rows,
            cols,
            Q8Scales::PerRow,
        )
        .unwrap();
        check_reblocked(&per_row, &bytes, Q8Scales::PerRow, &info.name);
        checked += 1;
    }
    assert_eq!(checked, 64, "64 matrices");
    // A short last run (K = 32 · 9: two runs of 4 blocks and one of 1), and several unpack tasks.
    let mut rng = Rng(3);
    for (rows, cols) in [(5, 288), (700, 1024)] {
        let (w, bytes) = synthetic(GgmlType::Q8_0, rows, cols, &mut rng);
        assert_eq!(w.row_d(0).len(), run_count(cols));
        check_reblocked(&w, &bytes, Q8Scales::PerRun, "synthetic");
    }
}

/// One Q8_0 block: scale `d` and the 32 values of `q`.
fn q8_block(d: f32, q: impl Fn(usize) -> i8) -> Vec<u8> {
    let mut b = f16::from_f32(d).to_bits().to_le_bytes().to_vec();
    b.extend((0..32).map(|i| q(i) as u8));
    b
}

#[test]
fn re_blocking_hand_made_blocks() {
    // One run of four blocks: d = 0.5, −1, 0, 0.25 → sw = 1 (the largest |d|, here from a negative d).
    let pattern = [3i8, 5, -3, -5, 1, -1, 127, -128, 2, 6, 0, 7];
    let q = |i: usize| pattern[i % pattern.len()];
    let mut bytes = Vec::new();
    for d in [0.5f32, -1.0, 0.0, 0.25] {
        bytes.extend(q8_block(d, q));
    }
    let w = QuantWeight::from_gguf("hand", GgmlType::Q8_0, &bytes, 1, 128).unwrap();
    assert_eq!(w.row_d(0), &[1.0]);
    let got = w.row_q(0);
    // d = 0.5: q/2 rounded half to even (3 → 1.5 → 2, 5 → 2.5 → 2, 1 → 0.5 → 0, 127 → 63.5 → 64,
    // −128 → −64).
    assert_eq!(&got[..12], &[2, 2, -2, -2, 0, 0, 64, -64, 1, 3, 0, 4]);
    // d = −1: the sign flips; −128 → +128 clamps to 127.
    assert_eq!(
        &got[32..44],
        &[-3, -5, 3, 5, -1, 1, -127, 127, -2, -6, 0, -7]
    );
    // d = 0: zeros.
    assert!(got[64..96].iter().all(|&v| v == 0));
    // d = 0.25: q/4 (2 → 0.5 → 0, 6 → 1.5 → 2, −128 → −32, 127 → 31.75 → 32).
    assert_eq!(&got[96..108], &[1, 1, -1, -1, 0, 0, 32, -32, 0, 2, 0, 2]);
    for (i, &v) in got.iter().enumerate() {
        let d = [0.5, -1.0, 0.0, 0.25][i / 32];
        assert_eq!(
            i64::from(v),
            exact_reblock(i64::from(q(i % 32)), d, 1.0),
            "{i}"
        );
    }
    // The largest block keeps its integers (q = −128 included, with a positive d).
    let mut bytes = q8_block(2.0, |i| if i == 0 { -128 } else { i as i8 });
    bytes.extend(q8_block(0.125, |_| 9));
    let w = QuantWeight::from_gguf("keep", GgmlType::Q8_0, &bytes, 1, 64).unwrap();
    assert_eq!(w.row_d(0), &[2.0]);
    assert_eq!(w.row_q(0)[0], -128);
    assert_eq!(
        &w.row_q(0)[1..32],
        &(1..32).map(|i| i as i8).collect::<Vec<_>>()[..]
    );
    assert!(w.row_q(0)[32..].iter().all(|&v| v == 1)); // 9/16 = 0.5625 → 1
                                                       // A run whose scales are all zero: scale 0 and zero weights (the output is +0).
    let bytes: Vec<u8> = (0..4).flat_map(|_| q8_block(0.0, |i| i as i8)).collect();
    let w = QuantWeight::from_gguf("zero", GgmlType::Q8_0, &bytes, 1, 128).unwrap();
    assert_eq!(w.row_d(0), &[0.0]);
    assert!(w.row_q(0).iter().all(|&v| v == 0));
    assert_eq!(matmul(&[1.0; 128], 1, &w).unwrap()[0].to_bits(), 0);
    // −0.0 and subnormal f16 scales: a subnormal largest scale re-blocks exactly too.
    let tiny = f16::from_bits(3).to_f32();
    let mut bytes = q8_block(-0.0, |_| 5);
    bytes.extend(q8_block(tiny, |i| i as i8 - 16));
    bytes.extend(q8_block(-f16::from_bits(1).to_f32(), |i| i as i8 * 4 - 64));
    let w = QuantWeight::from_gguf("sub", GgmlType::Q8_0, &bytes, 1, 96).unwrap();
    assert_eq!(w.row_d(0), &[tiny]);
    for (i, &v) in w.row_q(0).iter().enumerate() {
        let (q0, d) = match i / 32 {
            0 => (5, -0.0),
            1 => ((i % 32) as i64 - 16, tiny),
            _ => ((i % 32) as i64 * 4 - 64, -f16::from_bits(1).to_f32()),
        };
        assert_eq!(i64::from(v), exact_reblock(q0, d, tiny), "{i}");
    }
    // Non-finite scales are refused, naming the row and the block.
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut bytes = q8_block(1.0, |_| 1);
        bytes.extend(q8_block(1.0, |_| 1));
        bytes.extend(q8_block(bad, |_| 1));
        let err = QuantWeight::from_gguf("nan", GgmlType::Q8_0, &bytes, 3, 32).unwrap_err();
        assert!(
            matches!(err, QuantError::NonFiniteScale { row: 2, col: 0, .. }),
            "{err}"
        );
    }
}

#[test]
fn activation_quantization_is_the_documented_one() {
    let mut rng = Rng(5);
    for cols in [32usize, 128, 288, 768] {
        let x = uneven_activations(9, cols, &mut rng);
        let qx = prism_quant::quantize_rows(&x, 9, cols, 0).unwrap();
        for r in 0..9 {
            let (q, sa) = reference_quantize(&x[r * cols..(r + 1) * cols]);
            assert_eq!(qx.row(r), &q[..], "cols {cols} row {r}");
            assert_eq!(bits(qx.row_scales(r)), bits(&sa), "cols {cols} row {r}");
        }
    }
}

#[test]
fn integer_run_sums_equal_an_i64_reference() {
    let mut rng = Rng(11);
    for ty in ALL {
        let (rows, cols) = (5, 768);
        let (w, bytes) = synthetic(ty, rows, cols, &mut rng);
        let x = uneven_activations(3, cols, &mut rng);
        let qx = quantize_for(&x, 3, &w).unwrap();
        for r in 0..3 {
            for n in 0..rows {
                let want = reference_run_sums(ty, &bytes, cols, n, qx.row(r));
                assert_eq!(want.len(), 6);
                for (run, &(d, m)) in want.iter().enumerate() {
                    let got = run_sums(&w, n, run, qx.row(r), qx.row_sums(r));
                    assert_eq!(
                        (i64::from(got.0), i64::from(got.1)),
                        (d, m),
                        "{ty:?} row {n} run {run}"
                    );
                }
            }
        }
    }
}

#[test]
fn extreme_values_stay_exact_in_i32() {
    // Q6_K: every q = 0 (q − 32 = −32), every scale −128, activations all −127 (sa = 1): the largest
    // |I_r| of the formats, 8 · 128 · 16 · 32 · 127 per run.
    let mut block = vec![0u8; 210];
    for s in &mut block[192..208] {
        *s = (-128i8) as u8;
    }
    block[208..210].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    let w = QuantWeight::from_gguf("q6k-extreme", GgmlType::Q6_K, &block, 1, 256).unwrap();
    let x = vec![-127.0f32; 256];
    let qx = quantize_for(&x, 1, &w).unwrap();
    assert_eq!(qx.row_scales(0), &[1.0, 1.0]);
    for run in 0..2 {
        assert_eq!(
            run_sums(&w, 0, run, qx.row(0), qx.row_sums(0)).0,
            -66_584_576
        );
    }
    // 66,584,576 = 2^26 − 2^19 is exact in f32: two runs give −133,169,152 exactly.
    assert_eq!(matmul(&x, 1, &w).unwrap()[0], -133_169_152.0);

    // Q8_0 with q = −128 (never written by llama.cpp's quantizer, but legal in a file): kept.
    let block = q8_block(0.5, |_| -128);
    let w = QuantWeight::from_gguf("q8-extreme", GgmlType::Q8_0, &block, 1, 32).unwrap();
    let qx = quantize_for(&x[..32], 1, &w).unwrap();
    assert_eq!(run_sums(&w, 0, 0, qx.row(0), &[]).0, 32 * 128 * 127);
    assert_eq!(matmul(&x[..32], 1, &w).unwrap()[0], 0.5 * 520_192.0);
    // A whole run of −128 · −127: 128 · 128 · 127 = 2,080,768 < 2^24.
    let bytes: Vec<u8> = (0..4).flat_map(|_| q8_block(1.0, |_| -128)).collect();
    let w = QuantWeight::from_gguf("q8-run", GgmlType::Q8_0, &bytes, 1, 128).unwrap();
    let qx = quantize_for(&x[..128], 1, &w).unwrap();
    assert_eq!(run_sums(&w, 0, 0, qx.row(0), &[]).0, 2_080_768);

    // Q5_K with every q = 31, scales and mins 63, activations 127.
    let mut block = vec![0xFFu8; 176];
    block[0..2].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    block[2..4].copy_from_slice(&f16::from_f32(1.0).to_bits().to_le_bytes());
    let w = QuantWeight::from_gguf("q5k-extreme", GgmlType::Q5_K, &block, 1, 256).unwrap();
    let x = vec![127.0f32; 256];
    let qx = quantize_for(&x, 1, &w).unwrap();
    for run in 0..2 {
        assert_eq!(
            run_sums(&w, 0, run, qx.row(0), qx.row_sums(0)),
            (4 * 63 * 32 * 31 * 127, 4 * 63 * 32 * 127)
        );
    }
}

/// The documented reduction, written out independently: runs of 128 with their scales from the
/// reference quantization, 4 parts `⌊p·R/4⌋..⌊(p+1)·R/4⌋`, each from +0.0 with
/// `fma(f32(I), sa·w, acc)` (and `fma(f32(M), sa·(−wmin), acc)`), combined as `(p0+p1)+(p2+p3)`.
fn documented_output(ty: GgmlType, bytes: &[u8], cols: usize, n: usize, x: &[f32]) -> f32 {
    let (qa, sa) = reference_quantize(x);
    let sums = reference_run_sums(ty, bytes, cols, n, &qa);
    let nr = sums.len();
    let mut parts = [0f32; 4];
    for (p, part) in parts.iter_mut().enumerate() {
        for (r, &(ii, mm)) in sums
            .iter()
            .enumerate()
            .take((p + 1) * nr / 4)
            .skip(p * nr / 4)
        {
            let (_, _, _, w, wmin) = kernel_element(ty, bytes, cols, n, r * RUN);
            *part = (ii as i32 as f32).mul_add(sa[r] * w as f32, *part);
            if matches!(ty, GgmlType::Q4_K | GgmlType::Q5_K) {
                *part = (mm as i32 as f32).mul_add(sa[r] * -(wmin as f32), *part);
            }
        }
    }
    (parts[0] + parts[1]) + (parts[2] + parts[3])
}

#[test]
fn the_reduction_is_the_documented_four_part_tree() {
    let mut rng = Rng(23);
    assert_eq!(part_bounds(1), [0, 0, 0, 0, 1]);
    assert_eq!(part_bounds(7), [0, 1, 3, 5, 7]);
    assert_eq!(part_bounds(8), [0, 2, 4, 6, 8]);
    for ty in ALL {
        // Run counts below, at and above 4, not multiples of 4, and (Q8_0) a short last run.
        let block = ty.block_size();
        let mut widths: Vec<usize> = [1usize, 2, 3, 5, 7].iter().map(|b| b * block).collect();
        if ty == GgmlType::Q8_0 {
            widths.extend([32 * 9, 32 * 13, 32 * 3]);
        }
        for cols in widths {
            let (w, bytes) = synthetic(ty, 6, cols, &mut rng);
            let x = uneven_activations(2, cols, &mut rng);
            let y = matmul(&x, 2, &w).unwrap();
            for r in 0..2 {
                for n in 0..6 {
                    let want = documented_output(ty, &bytes, cols, n, &x[r * cols..(r + 1) * cols]);
                    assert_eq!(
                        y[r * 6 + n].to_bits(),
                        want.to_bits(),
                        "{ty:?} cols {cols} row {r} out {n}"
                    );
                }
            }
        }
    }
}

/// The columns `c0..c1` (whole blocks) of every row of a weight's GGUF bytes.
fn column_slice(
    ty: GgmlType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
    c0: usize,
    c1: usize,
) -> Vec<u8> {
    let (bs, per_row) = (ty.type_size(), cols / ty.block_size());
    let (b0, b1) = (c0 / ty.block_size(), c1 / ty.block_size());
    (0..rows)
        .flat_map(|n| bytes[(n * per_row + b0) * bs..(n * per_row + b1) * bs].to_vec())
        .collect()
}

#[test]
fn a_tensor_parallel_split_on_part_boundaries_keeps_the_single_device_bits() {
    // Each "device" holds the columns of whole parts (its own weight, re-blocked from its slice of the
    // file, and its slice of the activations, quantized on their own), sums its runs in order from
    // +0.0 (one part), and the parts are combined with the single-device tree.
    let mut rng = Rng(29);
    for (ty, cols) in [
        (GgmlType::Q8_0, 128 * 10),
        (GgmlType::Q8_0, 128 * 7 + 64),
        (GgmlType::Q4_K, 256 * 8),
        (GgmlType::Q6_K, 256 * 4),
    ] {
        let rows = 12;
        let (w, bytes) = synthetic(ty, rows, cols, &mut rng);
        let x = uneven_activations(3, cols, &mut rng);
        let full = matmul(&x, 3, &w).unwrap();
        let runs = run_count(cols);
        let b = part_bounds(runs);
        for devices in [1usize, 2, 4] {
            // Device g holds parts g·4/devices .. (g+1)·4/devices.
            let mut parts = vec![vec![[0f32; 4]; rows]; 3];
            for g in 0..devices {
                let (p0, p1) = (g * 4 / devices, (g + 1) * 4 / devices);
                let (c0, c1) = (b[p0] * RUN, (b[p1] * RUN).min(cols));
                if c0 % ty.block_size() != 0 || c1 % ty.block_size() != 0 {
                    continue; // a K-quant part boundary inside a 256-block: covered below
                }
                let slice = column_slice(ty, &bytes, rows, cols, c0, c1);
                let wd = QuantWeight::from_gguf("dev", ty, &slice, rows, c1 - c0).unwrap();
                let xd: Vec<f32> = (0..3)
                    .flat_map(|r| x[r * cols + c0..r * cols + c1].to_vec())
                    .collect();
                let qd = quantize_for(&xd, 3, &wd).unwrap();
                for (r, row_parts) in parts.iter_mut().enumerate() {
                    for (n, out) in row_parts.iter_mut().enumerate() {
                        // The device's parts, each over its own runs.
                        for p in p0..p1 {
                            let runs = b[p] - b[p0]..b[p + 1] - b[p0];
                            out[p] =
                                row_part(&wd, n, qd.row(r), qd.row_scales(r), qd.row_sums(r), runs);
                        }
                    }
                }
            }
            let qx = quantize_for(&x, 3, &w).unwrap();
            for r in 0..3 {
                for n in 0..rows {
                    // Parts computed on the full weight (what a split inside a K-quant block holds).
                    let whole: [f32; 4] = std::array::from_fn(|p| {
                        row_part(
                            &w,
                            n,
                            qx.row(r),
                            qx.row_scales(r),
                            qx.row_sums(r),
                            b[p]..b[p + 1],
                        )
                    });
                    for p in 0..4 {
                        let g = p * devices / 4;
                        let (p0, p1) = (g * 4 / devices, (g + 1) * 4 / devices);
                        let (c0, c1) = (b[p0] * RUN, (b[p1] * RUN).min(cols));
                        if c0 % ty.block_size() == 0 && c1 % ty.block_size() == 0 {
                            assert_eq!(parts[r][n][p].to_bits(), whole[p].to_bits());
                        }
                    }
                    assert_eq!(
                        combine_parts(whole).to_bits(),
                        full[r * rows + n].to_bits(),
                        "{ty:?} cols {cols} devices {devices}"
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
        let x = uneven_activations(4, cols, &mut rng);
        let y = matmul(&x, 4, &w).unwrap();
        let qx = quantize_for(&x, 4, &w).unwrap();
        for r in 0..4 {
            let sa = qx.row_scales(r);
            for n in 0..rows {
                // Exact real value of the quantized product: Σ_i sa·(w·sc·q − wmin·m)·qa, in f64
                // (every term is exact there).
                let (mut exact, mut magnitude) = (0f64, 0f64);
                for e in 0..cols {
                    let (q, sc, m, d, dmin) = kernel_element(ty, &bytes, cols, n, e);
                    let qa = f64::from(qx.row(r)[e]) * f64::from(sa[e / RUN]);
                    let pos = d * (sc * q) as f64 * qa;
                    let neg = dmin * m as f64 * qa;
                    exact += pos - neg;
                    magnitude += pos.abs() + neg.abs();
                }
                let got = f64::from(y[r * rows + n]);
                // Each run adds ≤ 5 roundings (conversions, scale products, fmas), each part ≤ R/4 + 1
                // runs, then 3 additions: relative 2^-24 each, against the sum of magnitudes.
                let nr = run_count(cols) as f64;
                let bound = (5.0 * (nr / 4.0 + 1.0) + 3.0) * 2f64.powi(-24) * magnitude;
                let err = (got - exact).abs();
                assert!(
                    err <= bound,
                    "{ty:?} r {r} n {n}: {got} vs {exact} (err {err:e}, bound {bound:e})"
                );
                if magnitude > 0.0 {
                    worst = worst.max(err / magnitude);
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
        let x = uneven_activations(64, cols, &mut rng);
        let full = matmul(&x, 64, &w).unwrap();
        let row_bits = |y: &[f32], r: usize| -> Vec<u32> { bits(&y[r * 40..(r + 1) * 40]) };
        for m in 1..=64 {
            let part = matmul(&x[..m * cols], m, &w).unwrap();
            for r in 0..m {
                assert_eq!(
                    row_bits(&part, r),
                    row_bits(&full, r),
                    "{ty:?}: M = {m}, row {r}"
                );
            }
        }
        // Reversed and interleaved rows, next to zero (padding) rows and to rows 10^6 times larger.
        let order: Vec<usize> = (0..64).rev().step_by(3).chain((0..64).step_by(5)).collect();
        let mut shuffled = Vec::new();
        for &r in &order {
            shuffled.extend_from_slice(&x[r * cols..(r + 1) * cols]);
            shuffled.extend(std::iter::repeat_n(0f32, cols));
            shuffled.extend(x[r * cols..(r + 1) * cols].iter().map(|v| v * 1e6));
        }
        let y = matmul(&shuffled, 3 * order.len(), &w).unwrap();
        for (i, &r) in order.iter().enumerate() {
            assert_eq!(
                row_bits(&y, 3 * i),
                row_bits(&full, r),
                "{ty:?}: permuted row {r}"
            );
            assert!(
                row_bits(&y, 3 * i + 1).iter().all(|&b| b == 0),
                "{ty:?}: a zero row gives +0"
            );
        }
        // More threads: the same bits.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let threaded = pool.install(|| matmul(&x, 64, &w).unwrap());
        assert_eq!(bits(&threaded), bits(&full), "{ty:?}: threads");
        // Selected rows (a read-out's letters): the same bits as those outputs of the full matrix.
        let pick = [39u32, 0, 17, 17, 5];
        let sel = w.select_rows(&pick).unwrap();
        let ys = matmul(&x, 64, &sel).unwrap();
        for r in 0..64 {
            for (j, &p) in pick.iter().enumerate() {
                assert_eq!(ys[r * 5 + j].to_bits(), full[r * 40 + p as usize].to_bits());
            }
        }
    }
}

#[test]
fn the_candle_op_is_the_kernel() {
    let mut rng = Rng(53);
    for file in ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf"] {
        let gguf = fixture(file);
        for name in [
            "blk.0.attn_qkv.weight",
            "blk.0.ffn_gate.weight",
            "blk.3.ffn_down.weight",
        ] {
            let (w, _) = fixture_weight(&gguf, name);
            let x = uneven_activations(7, w.cols(), &mut rng);
            let want = matmul(&x, 7, &w).unwrap();
            let op = QuantMatmul::new(Arc::new(w.clone()));
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
            // row_dot is each output.
            let qx = quantize_for(&x, 7, &w).unwrap();
            assert_eq!(
                row_dot(&w, 3, qx.row(2), qx.row_scales(2), qx.row_sums(2)),
                want[2 * w.rows() + 3]
            );
            assert_eq!(matmul_quantized(&qx, &w).unwrap(), want);
            // The portable loops give the AVX2 build's bits.
            let portable = matmul_quantized_with(&qx, &w, false).unwrap();
            assert_eq!(
                bits(&portable),
                bits(&want),
                "{file} {name}: portable vs SIMD"
            );
        }
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
    assert!(matches!(
        matmul(&[0.0; 64], 1, &w),
        Err(QuantError::InputWidth {
            expected: 32,
            found: 64,
            ..
        })
    ));
    let mut x = vec![0.0f32; 64];
    x[40] = f32::NAN;
    assert!(matches!(
        matmul(&x, 2, &w),
        Err(QuantError::NonFiniteActivation { row: 1, col: 8, .. })
    ));
    // Quantized activations that do not fit the weight.
    let q4 = QuantWeight::from_gguf("k", GgmlType::Q4_K, &[0u8; 144], 1, 256).unwrap();
    let no_sums = prism_quant::quantize_rows(&[0.0; 256], 1, 256, 0).unwrap();
    assert!(matches!(
        matmul_quantized(&no_sums, &q4),
        Err(QuantError::Input(_))
    ));
    assert!(matches!(
        matmul_quantized(&no_sums, &w),
        Err(QuantError::InputWidth { .. })
    ));
    // Through candle: wrong width, wrong dtype, a NaN.
    let op = QuantMatmul::new(Arc::new(w));
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

#[test]
fn device_shares_added_up_the_tree_are_the_single_device_product() {
    // `QuantMatmul::share_of_device`: each device's columns of the weight and of the input, its parts
    // combined below their common node; the shares added as the tree adds them give the product's bits.
    let mut rng = Rng(31);
    for (ty, cols, devices) in [
        (GgmlType::Q8_0, 128 * 8, 2),
        (GgmlType::Q8_0, 128 * 8, 4),
        (GgmlType::Q8_0, 128 * 6 + 64, 2),
        (GgmlType::Q8_0, 128 * 2, 2),
        (GgmlType::Q4_K, 256 * 8, 4),
        (GgmlType::Q6_K, 256 * 4, 2),
    ] {
        let (rows, m) = (10, 5);
        let (w, _) = synthetic(ty, rows, cols, &mut rng);
        let x = uneven_activations(m, cols, &mut rng);
        let whole = QuantMatmul::new(Arc::new(w));
        let xt = Tensor::from_vec(x.clone(), (m, cols), &Device::Cpu).unwrap();
        let want: Vec<f32> = whole
            .forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut shares = Vec::new();
        for g in 0..devices {
            let share = whole.share_of_device(g, devices).unwrap();
            let runs = share.share().unwrap().runs();
            let (c0, c1) = (runs.start * RUN, (runs.end * RUN).min(cols));
            let xs = xt.narrow(1, c0, c1 - c0).unwrap();
            let y: Vec<f32> = share
                .forward(&xs)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            shares.push(y);
        }
        for i in 0..m * rows {
            let got = match devices {
                2 => shares[0][i] + shares[1][i],
                _ => (shares[0][i] + shares[1][i]) + (shares[2][i] + shares[3][i]),
            };
            assert_eq!(
                got.to_bits(),
                want[i].to_bits(),
                "{ty:?} cols {cols} devices {devices} #{i}"
            );
        }
    }
    // A split inside a K-quant block, and a share of a share, are refused.
    let (w, _) = synthetic(GgmlType::Q4_K, 4, 256 * 2, &mut rng);
    let op = QuantMatmul::new(Arc::new(w));
    assert!(op.share_of_device(0, 4).is_err());
    let (w, _) = synthetic(GgmlType::Q8_0, 4, 128 * 4, &mut rng);
    let half = QuantMatmul::new(Arc::new(w)).share_of_device(1, 2).unwrap();
    assert!(half.share_of_device(0, 2).is_err());
    assert!(QuantMatmul::new(half.weight().clone())
        .share_of_device(0, 3)
        .is_err());
}

#[test]
fn a_share_as_four_parts_with_empty_ones_is_the_share() {
    // What the GPU's `_share` kernels compute: every product as four parts added by `combine_parts`,
    // a share's parts those of `PartSpan::local_bounds` (its own, then empty ones). The bits must be
    // `matmul_share`'s, which combines only the share's parts; and the bounds are the span's.
    let mut rng = Rng(47);
    for (ty, cols, devices) in [
        (GgmlType::Q8_0, 128 * 8, 2),
        (GgmlType::Q8_0, 128 * 8, 4),
        (GgmlType::Q8_0, 128 * 13 + 64, 2),
        (GgmlType::Q8_0, 128 * 11, 4),
        (GgmlType::Q8_0, 128 * 2, 2),
        (GgmlType::Q4_K, 256 * 8, 4),
        (GgmlType::Q6_K, 256 * 6, 2),
    ] {
        let (rows, m) = (9, 4);
        let (w, _) = synthetic(ty, rows, cols, &mut rng);
        let x = uneven_activations(m, cols, &mut rng);
        let whole = QuantMatmul::new(Arc::new(w));
        for g in 0..devices {
            let share = whole.share_of_device(g, devices).unwrap();
            let span = share.share().unwrap().clone();
            let runs = span.runs();
            let b = span.local_bounds();
            let global = part_bounds(span.total_runs);
            assert_eq!(b[0], 0);
            assert_eq!(b[4], runs.len());
            for (i, p) in span.parts.clone().enumerate() {
                assert_eq!(
                    b[i + 1] - b[i],
                    global[p + 1] - global[p],
                    "{ty:?} {g}/{devices}"
                );
            }
            assert!(b.windows(2).all(|w| w[0] <= w[1]));
            let (c0, c1) = (runs.start * RUN, (runs.end * RUN).min(cols));
            let xs: Vec<f32> = (0..m)
                .flat_map(|r| x[r * cols + c0..r * cols + c1].iter().copied())
                .collect();
            let want = prism_quant::matmul_share(&xs, m, share.weight(), &span).unwrap();
            let qx = quantize_for(&xs, m, share.weight()).unwrap();
            for r in 0..m {
                for n in 0..rows {
                    let part = |p: usize| {
                        row_part(
                            share.weight(),
                            n,
                            qx.row(r),
                            qx.row_scales(r),
                            qx.row_sums(r),
                            b[p]..b[p + 1],
                        )
                    };
                    let got = combine_parts(std::array::from_fn(part));
                    assert_eq!(
                        got.to_bits(),
                        want[r * rows + n].to_bits(),
                        "{ty:?} cols {cols} device {g} of {devices}, row {r}, output {n}"
                    );
                }
            }
        }
    }
}
