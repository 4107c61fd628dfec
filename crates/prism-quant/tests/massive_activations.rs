//! Robustness: activations with a few massive channels (as real Qwen checkpoints have: a handful of
//! channels of some tokens hundreds of times the typical value) through the contract's integer matmul,
//! next to one scale per row, against the exact product on the file's own weights. Numbers in
//! docs/correctness.md ("Massive activations").

use prism_gguf::quantize::quantize;
use prism_gguf::GgmlType;
use prism_quant::{matmul, Q8Scales, QuantWeight, QMAX};

mod common;

use common::Rng;

const K: usize = 2048;
const N: usize = 96;
const M: usize = 24;
/// The massive channels, and how large they are in the rows that carry them.
const MASSIVE: [usize; 3] = [7, 900, 1811];
const MAGNITUDE: f32 = 600.0;

/// Rows `r % 4 == 0` carry the massive channels (an attention-sink-like token every 4).
fn activations(rng: &mut Rng) -> Vec<f32> {
    let mut x: Vec<f32> = (0..M * K).map(|_| rng.gaussianish()).collect();
    for r in (0..M).step_by(4) {
        for (i, &c) in MASSIVE.iter().enumerate() {
            x[r * K + c] = if i % 2 == 0 { MAGNITUDE } else { -MAGNITUDE };
        }
    }
    x
}

/// `x · Wᵀ` in f64 with `x` quantized per run of `run` elements (dynamic, the contract's rounding) and
/// the weights as `w` (row-major f32, `N × K`).
fn fake_quant_product(x: &[f32], w: &[f32], run: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(M * N);
    for xr in x.chunks_exact(K) {
        let mut q = vec![0f64; K];
        for (qr, xs) in q.chunks_mut(run).zip(xr.chunks(run)) {
            let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
            let (s, inv) = (amax / QMAX, QMAX / amax);
            for (qi, &v) in qr.iter_mut().zip(xs) {
                *qi = f64::from((v * inv).round_ties_even().clamp(-QMAX, QMAX)) * f64::from(s);
            }
        }
        for wr in w.chunks_exact(K) {
            out.push(q.iter().zip(wr).map(|(a, &b)| a * f64::from(b)).sum());
        }
    }
    out
}

fn exact(x: &[f32], w: &[f32]) -> Vec<f64> {
    let mut out = Vec::with_capacity(M * N);
    for xr in x.chunks_exact(K) {
        for wr in w.chunks_exact(K) {
            out.push(
                xr.iter()
                    .zip(wr)
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum(),
            );
        }
    }
    out
}

/// RMS of `got − want` over the rows `rows`, relative to the RMS of `want` there.
fn rel_rms(got: &[f64], want: &[f64], rows: impl Iterator<Item = usize> + Clone) -> f64 {
    let sq = |f: &dyn Fn(usize) -> f64| -> f64 {
        rows.clone()
            .flat_map(|r| (r * N..(r + 1) * N).map(f))
            .sum::<f64>()
    };
    (sq(&|i| (got[i] - want[i]).powi(2)) / sq(&|i| want[i].powi(2))).sqrt()
}

#[test]
fn massive_channels_keep_the_error_bounded_with_runs_of_128() {
    let mut rng = Rng(97);
    let values: Vec<f32> = (0..N * K).map(|_| rng.gaussianish() * 0.02).collect();
    let bytes = quantize(GgmlType::Q8_0, &values).unwrap();
    let file = prism_gguf::blocks::dequantize(GgmlType::Q8_0, &bytes, N * K).unwrap();
    let x = activations(&mut rng);
    let want = exact(&x, &file);
    let massive_rows = (0..M).step_by(4);
    let ordinary_rows = (0..M).filter(|r| r % 4 != 0);
    let mut report = Vec::new();
    for (label, scales) in [("per run", Q8Scales::PerRun), ("per row", Q8Scales::PerRow)] {
        let w = QuantWeight::from_gguf_with("w", GgmlType::Q8_0, &bytes, N, K, scales).unwrap();
        let reblocked = w.dequantize().unwrap();
        // The contract: activations per (row, 128), on the integer path.
        let got: Vec<f64> = matmul(&x, M, &w)
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect();
        // The same weights with one activation scale per row (simulated in f64).
        let per_row = fake_quant_product(&x, &reblocked, K);
        // Check the simulation against the integer path itself at runs of 128.
        let sim_128 = fake_quant_product(&x, &reblocked, 128);
        assert!(rel_rms(&got, &sim_128, 0..M) < 1e-5);
        let e = [
            rel_rms(&got, &want, massive_rows.clone()),
            rel_rms(&got, &want, ordinary_rows.clone()),
            rel_rms(&per_row, &want, massive_rows.clone()),
            rel_rms(&per_row, &want, ordinary_rows.clone()),
        ];
        println!(
            "Q8_0 weights {label}: relative RMS error, rows with massive channels / ordinary rows: \
             activations per (row, 128) {:.2e} / {:.2e}; per row {:.2e} / {:.2e}",
            e[0], e[1], e[2], e[3]
        );
        report.push(e);
    }
    let [run, row] = [report[0], report[1]];
    // Measured (docs/correctness.md), weights per run: massive rows 1.73e-2 with runs of 128 against
    // 3.95e-2 with one scale per row (whose ordinary channels then get a few levels: runs of 128 confine
    // that to the three runs holding a massive channel); ordinary rows 7.68e-3 against 8.43e-3.
    assert!(run[0] < 0.5 * run[2], "{run:?}");
    assert!(run[1] < run[3], "{run:?}");
    // Bounded: rows with massive channels within 3× of ordinary rows, both at the measured level.
    assert!(
        run[0] < 3.0 * run[1] && run[0] < 2.5e-2 && run[1] < 1e-2,
        "{run:?}"
    );
    // Per-row weight scales cost more than per-run ones on the same activations (9.09e-3 / 7.68e-3).
    assert!(
        row[1] > run[1],
        "per-row weights {row:?} vs per-run {run:?}"
    );
}
