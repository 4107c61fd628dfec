//! `prism gemm-bench` (CUDA builds): the integer GEMM's speed at the model's projection shapes, next to
//! cuBLAS's int8 GEMM (`cublasGemmEx`, i32 out, no scales: a bare integer product) and candle's bf16
//! matmul (cuBLAS) on the same device in the same run.
//!
//! Each shape `K,N,M` is timed as the median of `--runs` calls after two warm-ups, synchronizing around
//! each call (so a call's time includes its launches): the integer product as the model calls it (the
//! per-(row, run) activation quantization included) and candle's bf16 `x · Wᵀ`. TOPS count 2·M·N·K
//! operations.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use prism_gguf::quantize::quantize;
use prism_gguf::GgmlType;
use prism_quant::cuda::{matmul_with, CudaQuantWeight, Kernel, TileShape};
use prism_quant::{Q8Scales, QuantWeight};
use serde_json::json;

#[derive(clap::Args)]
pub struct GemmBenchArgs {
    /// Shapes as K,N,M (inputs, outputs, activation rows); repeatable. Default: the 27B projections
    /// at M = 276 (a short pass) and 2,048, and 5120 × 17408 at M = 16,384.
    #[arg(long = "shape", value_parser = parse_shape)]
    shapes: Vec<(usize, usize, usize)>,
    /// Timed calls per measurement (the median is reported).
    #[arg(long, default_value_t = 20)]
    runs: usize,
    /// Also time the simple kernel (one thread an output) where the tile runs.
    #[arg(long)]
    simple: bool,
    /// Write the results as JSON.
    #[arg(long)]
    json_out: Option<PathBuf>,
}

fn parse_shape(s: &str) -> Result<(usize, usize, usize), String> {
    let v: Vec<usize> = s
        .split(',')
        .map(|x| x.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{s:?}: expected K,N,M: {e}"))?;
    match v.as_slice() {
        &[k, n, m] if k > 0 && n > 0 && m > 0 && k % 32 == 0 => Ok((k, n, m)),
        _ => Err(format!(
            "{s:?}: expected K,N,M, three positive numbers with K a multiple of 32"
        )),
    }
}

/// Median seconds of `runs` calls after two warm-ups, synchronizing around each.
fn time_median(dev: &Device, runs: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

pub fn run(args: &GemmBenchArgs) -> Result<()> {
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let Device::Cuda(dev) = &gpu else {
        bail!("gemm-bench needs a CUDA device");
    };
    let shapes = if args.shapes.is_empty() {
        vec![
            (5120, 34816, 276),
            (17408, 5120, 276),
            (5120, 17408, 2048),
            (17408, 5120, 2048),
            (5120, 17408, 16384),
        ]
    } else {
        args.shapes.clone()
    };
    println!(
        "{:>6} {:>6} {:>6}  {:>9} {:>7}  {:>9} {:>7}  {:>9} {:>7}  {:>9} {:>7}",
        "K",
        "N",
        "M",
        "ours ms",
        "TOPS",
        "simple ms",
        "TOPS",
        "cuBLAS i8",
        "TOPS",
        "bf16 ms",
        "TFLOP/s"
    );
    let mut rows = Vec::new();
    for (k, n, m) in shapes {
        // A random Q8_0 weight by llama.cpp's quantizer, re-blocked per run (the product's format).
        let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ (k * 31 + n) as u64;
        let values: Vec<f32> = (0..n * k)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.05
            })
            .collect();
        let bytes = quantize(GgmlType::Q8_0, &values)?;
        drop(values);
        let w =
            QuantWeight::from_gguf_with("bench", GgmlType::Q8_0, &bytes, n, k, Q8Scales::PerRun)?;
        drop(bytes);
        let dw = CudaQuantWeight::upload(&w, dev)?;
        drop(w);
        let x = Tensor::randn(0f32, 1.0, (m, k), &gpu)?;
        let ops = 2.0 * m as f64 * n as f64 * k as f64;
        let t_int = time_median(&gpu, args.runs, || {
            matmul_with(&x, &dw, Kernel::Auto)?;
            Ok(())
        })?;
        // Both tile shapes (the default picks one by M).
        let mut shapes_ms = Vec::new();
        for shape in [TileShape::M128, TileShape::M64] {
            let t = time_median(&gpu, args.runs, || {
                matmul_with(&x, &dw, Kernel::Tile(shape))?;
                Ok(())
            })?;
            shapes_ms.push((shape, t));
        }
        let t_simple = if args.simple {
            Some(time_median(&gpu, args.runs.min(5), || {
                matmul_with(&x, &dw, Kernel::Simple)?;
                Ok(())
            })?)
        } else {
            None
        };
        let wb = Tensor::randn(0f32, 0.02, (n, k), &gpu)?.to_dtype(DType::BF16)?;
        let xb = x.to_dtype(DType::BF16)?;
        let t_bf16 = time_median(&gpu, args.runs, || {
            xb.matmul(&wb.t()?)?;
            Ok(())
        })?;
        let t_cublas = if m % 4 == 0 && n % 4 == 0 && k % 4 == 0 {
            Some(prism_model::cuda::int8_gemm_seconds(
                dev,
                (m, n, k),
                args.runs,
                true,
            )?)
        } else {
            None
        };
        let rate = |t: f64| ops / t / 1e12;
        let opt = |t: Option<f64>, f: &dyn Fn(f64) -> String| t.map_or("-".into(), f);
        println!(
            "{k:>6} {n:>6} {m:>6}  {:>9.3} {:>7.1}  {:>9} {:>7}  {:>9} {:>7}  {:>9.3} {:>7.1}",
            t_int * 1e3,
            rate(t_int),
            opt(t_simple, &|t| format!("{:.3}", t * 1e3)),
            opt(t_simple, &|t| format!("{:.1}", rate(t))),
            opt(t_cublas, &|t| format!("{:.3}", t * 1e3)),
            opt(t_cublas, &|t| format!("{:.1}", rate(t))),
            t_bf16 * 1e3,
            rate(t_bf16)
        );
        for (shape, t) in &shapes_ms {
            println!(
                "{:>22} tile {shape:?}: {:.3} ms, {:.1} TOPS",
                "",
                t * 1e3,
                rate(*t)
            );
        }
        rows.push(json!({
            "k": k, "n": n, "m": m,
            "int8_ms": t_int * 1e3, "int8_tops": rate(t_int),
            "tiles": shapes_ms.iter().map(|(shape, t)| json!({"shape": format!("{shape:?}"), "ms": t * 1e3, "tops": rate(*t)})).collect::<Vec<_>>(),
            "simple_ms": t_simple.map(|t| t * 1e3), "simple_tops": t_simple.map(rate),
            "cublas_int8_ms": t_cublas.map(|t| t * 1e3), "cublas_int8_tops": t_cublas.map(rate),
            "bf16_candle_ms": t_bf16 * 1e3, "bf16_candle_tflops": rate(t_bf16),
        }));
    }
    if let Some(path) = &args.json_out {
        std::fs::write(
            path,
            serde_json::to_string_pretty(&json!({"runs": args.runs, "rows": rows}))?,
        )
        .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
