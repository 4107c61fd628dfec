//! `prism gemm-bench`'s measurement (CUDA builds): the integer GEMM's speed at the model's projection
//! shapes, next to cuBLAS's int8 GEMM (`cublasGemmEx`, i32 out, no scales: a bare integer product) and
//! candle's bf16 matmul (cuBLAS) on the same device in the same run.
//!
//! Each shape `K,N,M` is timed as the median of `runs` calls after two warm-ups, synchronizing around
//! each call (so a call's time includes its launches; at M ≤ 64 a timed sample is 10 calls back to
//! back, whose time over 10 is the call's): the integer product as the model calls it (the
//! per-(row, run) activation quantization included) and candle's bf16 `x · Wᵀ`. TOPS count 2·M·N·K
//! operations.

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};
use prism_gguf::quantize::quantize;
use prism_gguf::GgmlType;
use prism_quant::cuda::{matmul_with, CudaQuantWeight, Kernel, TileShape};
use prism_quant::{Q8Scales, QuantWeight};
use serde_json::{json, Value};

/// The default shapes: the 27B projections at M = 276 (a short pass) and 2,048, and 5120 × 17408 at
/// M = 16,384.
pub const DEFAULT_SHAPES: [(usize, usize, usize); 5] = [
    (5120, 34816, 276),
    (17408, 5120, 276),
    (5120, 17408, 2048),
    (17408, 5120, 2048),
    (5120, 17408, 16384),
];

/// One shape's times, seconds.
pub struct GemmTiming {
    pub k: usize,
    pub n: usize,
    pub m: usize,
    /// The integer product with the kernel the model picks.
    pub int8: f64,
    /// Each tile shape forced (`M128`, `M64`: the persistent grid of `TileSchedule::balanced`), and at
    /// M ≤ 512 the 64-row tile as a plain grid with each split over K (`M64 split 1` …).
    pub tiles: Vec<(String, f64)>,
    /// The simple kernel (when asked for).
    pub simple: Option<f64>,
    /// cuBLAS's int8 GEMM (when every dimension is a multiple of 4).
    pub cublas_int8: Option<f64>,
    /// candle's bf16 matmul.
    pub bf16: f64,
}

impl GemmTiming {
    /// Tera-operations a second at `seconds`.
    pub fn tops(&self, seconds: f64) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64 / seconds / 1e12
    }

    /// The row of `--json-out`.
    pub fn json(&self) -> Value {
        let rate = |t: f64| self.tops(t);
        let tiles: Vec<Value> = self
            .tiles
            .iter()
            .map(|(shape, t)| json!({"shape": shape, "ms": t * 1e3, "tops": rate(*t)}))
            .collect();
        json!({
            "k": self.k, "n": self.n, "m": self.m,
            "int8_ms": self.int8 * 1e3, "int8_tops": rate(self.int8),
            "int8_weight_gb_per_s": (self.n * self.k) as f64 / self.int8 / 1e9,
            "tiles": tiles,
            "simple_ms": self.simple.map(|t| t * 1e3), "simple_tops": self.simple.map(rate),
            "cublas_int8_ms": self.cublas_int8.map(|t| t * 1e3), "cublas_int8_tops": self.cublas_int8.map(rate),
            "bf16_candle_ms": self.bf16 * 1e3, "bf16_candle_tflops": rate(self.bf16),
        })
    }
}

/// Calls per timed sample: a product of a few rows takes tens of microseconds, about what a
/// synchronization and the launches add, so such a sample is [`SMALL_M_REPS`] calls back to back.
fn reps_for(m: usize) -> usize {
    if m <= 64 {
        SMALL_M_REPS
    } else {
        1
    }
}
const SMALL_M_REPS: usize = 10;

/// Median seconds a call of `runs` samples after two warm-ups, synchronizing around each sample of
/// `reps` calls.
fn time_median(
    dev: &Device,
    runs: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    f()?;
    dev.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        for _ in 0..reps.max(1) {
            f()?;
        }
        dev.synchronize()?;
        times.push(t.elapsed().as_secs_f64() / reps.max(1) as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Times one shape `(k, n, m)` on `gpu` (see the module's doc); `simple` also times the simple kernel,
/// and each of `grids` the persistent grid of both tile shapes scheduled for that many multiprocessors.
pub fn time_shape(
    gpu: &Device,
    (k, n, m): (usize, usize, usize),
    runs: usize,
    simple: bool,
    grids: &[usize],
) -> Result<GemmTiming> {
    let Device::Cuda(dev) = gpu else {
        bail!("gemm-bench needs a CUDA device");
    };
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
    let w = QuantWeight::from_gguf_with("bench", GgmlType::Q8_0, &bytes, n, k, Q8Scales::PerRun)?;
    drop(bytes);
    let dw = CudaQuantWeight::upload(&w, dev)?;
    drop(w);
    let x = Tensor::randn(0f32, 1.0, (m, k), gpu)?;
    let reps = reps_for(m);
    let t_int = time_median(gpu, runs, reps, || {
        matmul_with(&x, &dw, Kernel::Auto)?;
        Ok(())
    })?;
    // Both tile shapes (the default picks one by M), and at a few dozen rows every split over K.
    let mut kernels = vec![
        ("M128".to_string(), Kernel::Tile(TileShape::M128)),
        ("M64".to_string(), Kernel::Tile(TileShape::M64)),
    ];
    // At a few dozen rows the swapped tiles (64 outputs a CTA).
    if m <= 128 {
        kernels.push(("S32".to_string(), Kernel::Tile(TileShape::S32)));
        for splits in [1, 2, 4] {
            kernels.push((
                format!("S32 split {splits}"),
                Kernel::TileSplit(TileShape::S32, splits),
            ));
        }
    }
    if m >= 1024 {
        for group in [1, 4, 8, 16] {
            kernels.push((
                format!("M128 order {group}"),
                Kernel::TileOrder(TileShape::M128, group),
            ));
        }
    }
    for &sms in grids.iter().filter(|&&sms| sms > 0) {
        for (name, shape) in [("M128", TileShape::M128), ("M64", TileShape::M64)] {
            kernels.push((format!("{name} grid {sms}"), Kernel::TileGrid(shape, sms)));
        }
    }
    if m <= 512 {
        for splits in [1, 2, 4] {
            kernels.push((
                format!("M64 split {splits}"),
                Kernel::TileSplit(TileShape::M64, splits),
            ));
        }
    }
    // At a few dozen rows the narrow kernel (its own split and each forced), and the skinny one.
    if m <= prism_quant::cuda::NARROW_ROWS {
        kernels.push(("narrow".to_string(), Kernel::Narrow));
        for splits in [1, 2, 4] {
            kernels.push((
                format!("narrow split {splits}"),
                Kernel::NarrowSplit(splits),
            ));
        }
    }
    if m <= prism_quant::cuda::SKINNY_ROWS {
        kernels.push(("skinny".to_string(), Kernel::Skinny));
    }
    let mut shapes_ms = Vec::new();
    for (label, kernel) in kernels {
        let t = time_median(gpu, runs, reps, || {
            matmul_with(&x, &dw, kernel)?;
            Ok(())
        })?;
        shapes_ms.push((label, t));
    }
    let t_simple = if simple {
        Some(time_median(gpu, runs.min(5), reps, || {
            matmul_with(&x, &dw, Kernel::Simple)?;
            Ok(())
        })?)
    } else {
        None
    };
    let wb = Tensor::randn(0f32, 0.02, (n, k), gpu)?.to_dtype(DType::BF16)?;
    let xb = x.to_dtype(DType::BF16)?;
    let t_bf16 = time_median(gpu, runs, reps, || {
        xb.matmul(&wb.t()?)?;
        Ok(())
    })?;
    let t_cublas = if m % 4 == 0 && n % 4 == 0 && k % 4 == 0 {
        Some(prism_model::cuda::int8_gemm_seconds(
            dev,
            (m, n, k),
            runs,
            true,
        )?)
    } else {
        None
    };
    Ok(GemmTiming {
        k,
        n,
        m,
        int8: t_int,
        tiles: shapes_ms,
        simple: t_simple,
        cublas_int8: t_cublas,
        bf16: t_bf16,
    })
}
