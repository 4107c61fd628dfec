//! Speed of the CPU reference integer matmul: `cargo run -p prism-quant --example quant_bench`.
//! Prints GMAC/s (multiply-adds per second) for a few shapes, one thread and the rayon pool.

use std::time::Instant;

use prism_gguf::quantize::quantize;
use prism_gguf::GgmlType;
use prism_quant::{matmul, QuantWeight};

fn main() {
    let shapes = [
        (1usize, 1024usize, 6144usize),
        (64, 1024, 6144),
        (512, 1024, 6144),
        (512, 3584, 1024),
    ];
    for ty in [GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K] {
        for &(m, k, n) in &shapes {
            let values: Vec<f32> = (0..n * k)
                .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
                .collect();
            let bytes = quantize(ty, &values).expect("quantize");
            let w = QuantWeight::from_gguf("bench", ty, &bytes, n, k).expect("weight");
            let x: Vec<f32> = (0..m * k)
                .map(|i| (i * 104729 % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .expect("pool");
            let run = |reps: usize| {
                let t = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(matmul(&x, m, &w).expect("matmul"));
                }
                (m * n * k * reps) as f64 / t.elapsed().as_secs_f64() / 1e9
            };
            let reps = (2e9 / (m * n * k) as f64).ceil() as usize;
            let single = one.install(|| run(reps));
            let pool = run(reps);
            println!("{ty:?} {m} x {k} · {n}: {single:.1} GMAC/s (1 thread), {pool:.1} (pool)");
        }
    }
}
