//! `prism gemm-bench` (CUDA builds): the flags and the table; the measurement is
//! `prism_decision::bench::gemm` (the integer GEMM next to cuBLAS int8 and bf16).

use std::path::PathBuf;

use anyhow::{Context, Result};
use prism_decision::bench::gemm::{time_shape, DEFAULT_SHAPES};
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
    /// Also time the Hopper tile's persistent grid scheduled for these multiprocessor counts (e.g.
    /// `64,100,128,131,132`), both tile shapes: whether fewer CTAs than the GPU's multiprocessors hold
    /// a product at once.
    #[arg(long, value_delimiter = ',')]
    grids: Vec<usize>,
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

pub fn run(args: &GemmBenchArgs) -> Result<()> {
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let shapes = if args.shapes.is_empty() {
        DEFAULT_SHAPES.to_vec()
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
    for shape in shapes {
        let t = time_shape(&gpu, shape, args.runs, args.simple, &args.grids)?;
        let rate = |s: f64| t.tops(s);
        let opt = |s: Option<f64>, f: &dyn Fn(f64) -> String| s.map_or("-".into(), f);
        println!(
            "{:>6} {:>6} {:>6}  {:>9.3} {:>7.1}  {:>9} {:>7}  {:>9} {:>7}  {:>9.3} {:>7.1}",
            t.k,
            t.n,
            t.m,
            t.int8 * 1e3,
            rate(t.int8),
            opt(t.simple, &|s| format!("{:.3}", s * 1e3)),
            opt(t.simple, &|s| format!("{:.1}", rate(s))),
            opt(t.cublas_int8, &|s| format!("{:.3}", s * 1e3)),
            opt(t.cublas_int8, &|s| format!("{:.1}", rate(s))),
            t.bf16 * 1e3,
            rate(t.bf16)
        );
        for (shape, s) in &t.tiles {
            println!(
                "{:>22} tile {shape}: {:.3} ms, {:.1} TOPS",
                "",
                s * 1e3,
                rate(*s)
            );
        }
        rows.push(t.json());
    }
    if let Some(path) = &args.json_out {
        let report = json!({"runs": args.runs, "rows": rows});
        std::fs::write(path, serde_json::to_string_pretty(&report)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
