//! Speed of the batch-invariant matmul against candle's gemm on the projection shapes of a 0.8B model
//! (hidden 1024, q/k/v/gate 6144+2048, MLP 3584). `cargo run -p prism-model --example matmul_bench`.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use prism_model::matmul::RowInvariantMatmul;

fn time<F: FnMut() -> Tensor>(mut f: F) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    best
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    for &(m, k, n) in &[
        (1usize, 1024usize, 6144usize),
        (1, 3584, 1024),
        (64, 1024, 6144),
        (512, 1024, 6144),
        (512, 1024, 3584),
        (512, 3584, 1024),
        (119, 256, 4129),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?.to_dtype(dtype)?;
            let wt = w.t()?;
            let candle = time(|| {
                if dtype == DType::F32 {
                    x.matmul(&wt).unwrap()
                } else {
                    x.to_dtype(dtype).unwrap().matmul(&wt).unwrap()
                }
            });
            let ours = time(|| x.apply_op2_no_bwd(&w, &RowInvariantMatmul).unwrap());
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            println!(
                "[{m:4} x {k:4}] x [{k:4} x {n:4}] {dtype:?}: candle {:8.2} ms ({:6.1} GFLOP/s), row-invariant {:8.2} ms ({:6.1} GFLOP/s)",
                candle * 1e3,
                gflop / candle,
                ours * 1e3,
                gflop / ours
            );
        }
    }
    Ok(())
}
