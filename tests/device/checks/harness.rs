//! What every group of checks shares: the random inputs ([`Rng`]), the record of comparisons
//! ([`Report`]: a line each on stdout, a row each for the JSON record), the GPU, the fixtures and the
//! timing helper.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

/// Environment variable naming a file to write every check's row into, as one JSON array (the record
/// `docs/device-runs/` keeps); rewritten after each group, so a crash keeps the groups before it.
pub const JSON_ENV: &str = "PRISM_DEVICE_JSON";

/// Environment variable naming the tiny fixture model's folder (tiny-BF16.gguf, tiny-Q8_0.gguf,
/// prompts.json, ref_transformers*.json). Default: the checkout this binary was built from, else
/// `tests/fixtures/qwen35-tiny` under the working directory (the repository root on the GPU machine).
pub const FIXTURES_ENV: &str = "PRISM_DEVICE_FIXTURES";

/// Every row written so far by this process, in the order the groups ran.
static ROWS: Mutex<Vec<Value>> = Mutex::new(Vec::new());

/// Deterministic pseudo-random numbers (xorshift64*), uniform in [-1, 1).
pub struct Rng(pub u64);

impl Rng {
    pub fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    pub fn tensor(&mut self, shape: &[usize], scale: f32) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| self.next_f32() * scale).collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }
}

/// The checks of one group: their rows and the names of those that failed.
#[derive(Default)]
pub struct Report {
    pub rows: Vec<Value>,
    pub failures: Vec<String>,
}

/// A tensor's elements as bit patterns: f64 as they are, every other dtype through an exact f32
/// conversion (bf16, f16 and u8 convert to f32 exactly and one-to-one).
fn words(t: &Tensor) -> Result<Vec<u64>> {
    let t = t.to_device(&Device::Cpu)?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F64 => t.to_vec1::<f64>()?.iter().map(|x| x.to_bits()).collect(),
        _ => t
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
    })
}

fn verdict(ok: bool) -> &'static str {
    if ok {
        "ok"
    } else {
        "FAIL"
    }
}

impl Report {
    /// ‖got − want‖/‖want‖ (f64) within `bound`; max |Δ| reported.
    pub fn compare(&mut self, name: &str, got: &Tensor, want: &Tensor, bound: f64) -> Result<()> {
        let got = got
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?;
        let want = want
            .to_device(&Device::Cpu)?
            .to_dtype(DType::F64)?
            .flatten_all()?;
        let diff = (&got - &want)?;
        let norm_d = diff.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        let norm_r = want.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt();
        let max_abs = diff.abs()?.max(0)?.to_scalar::<f64>()?;
        let rel = if norm_r > 0.0 {
            norm_d / norm_r
        } else {
            norm_d
        };
        let ok = rel.is_finite() && rel <= bound;
        println!(
            "{:<58} ‖Δ‖/‖ref‖ {rel:>10.3e}  max|Δ| {max_abs:>10.3e}  bound {bound:.0e}  {}",
            name,
            verdict(ok)
        );
        self.count(name, ok);
        self.rows
            .push(json!({"check": name, "rel": rel, "max_abs": max_abs, "bound": bound, "ok": ok}));
        Ok(())
    }

    /// Every element of `a` has the bits of the same element of `b` (f32 bits; f64 for f64 tensors).
    pub fn identical(&mut self, name: &str, a: &Tensor, b: &Tensor) -> Result<()> {
        self.bitwise(name, a, b, true)
    }

    /// [`Self::identical`], and the two tensors have the same dtype and shape too.
    pub fn same_bits(&mut self, name: &str, got: &Tensor, want: &Tensor) -> Result<()> {
        let same_kind = got.dtype() == want.dtype() && got.dims() == want.dims();
        self.bitwise(name, got, want, same_kind)
    }

    fn bitwise(&mut self, name: &str, a: &Tensor, b: &Tensor, also: bool) -> Result<()> {
        let (a, b) = (words(a)?, words(b)?);
        let differing =
            a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
        let ok = differing == 0 && also;
        println!(
            "{:<58} {differing} of {} elements differ in bits  {}",
            name,
            a.len(),
            verdict(ok)
        );
        self.count(name, ok);
        self.rows
            .push(json!({"check": name, "differing_bits": differing, "ok": ok}));
        Ok(())
    }

    /// A check of its own kind: `line` printed after the name, `row` recorded as it is.
    pub fn check(&mut self, name: &str, line: &str, ok: bool, row: Value) {
        let gap = if line.is_empty() { "" } else { "  " };
        println!("{name:<58} {line}{gap}{}", verdict(ok));
        self.count(name, ok);
        self.rows.push(row);
    }

    /// A measurement (no pass or fail).
    pub fn note(&mut self, name: &str, value: Value) {
        println!("{name:<58} {value}");
        self.rows.push(json!({"check": name, "value": value}));
    }

    /// Counts a failure that has no row of its own.
    pub fn fail(&mut self, name: &str) {
        self.failures.push(name.to_string());
    }

    fn count(&mut self, name: &str, ok: bool) {
        if !ok {
            self.fail(name);
        }
    }

    /// ‖Δ‖/‖ref‖ of the comparison just reported (NaN if none).
    pub fn last_rel(&self) -> f64 {
        self.rows
            .last()
            .and_then(|row| row["rel"].as_f64())
            .unwrap_or(f64::NAN)
    }
}

/// With `PRISM_STACKS_ON_SIGQUIT` set (and not `0`), `kill -QUIT` on this process writes every
/// thread's stack to stderr (`prism_model::stack_dump`): how `tools/device/run.sh hang-probe` takes
/// the stacks of a hung group. Installed once, by the first group that runs.
fn install_stack_dump() -> Result<()> {
    static INSTALLED: std::sync::OnceLock<std::result::Result<(), String>> =
        std::sync::OnceLock::new();
    let wanted = std::env::var_os("PRISM_STACKS_ON_SIGQUIT").is_some_and(|v| v != "0");
    if !wanted {
        return Ok(());
    }
    INSTALLED
        .get_or_init(|| {
            prism_model::stack_dump::install().map_err(|e| e.to_string())?;
            eprintln!(
                "PRISM_STACKS_ON_SIGQUIT: `kill -QUIT {}` writes every thread's stack to stderr",
                std::process::id()
            );
            Ok(())
        })
        .clone()
        .map_err(|e| anyhow::anyhow!("PRISM_STACKS_ON_SIGQUIT: {e}"))
}

/// Runs one group of checks on GPU 0: its rows join the JSON record ([`JSON_ENV`]); the test fails
/// with the name of every check that failed, or with the error that stopped the group.
pub fn run_group(
    group: &str,
    checks: impl FnOnce(&mut Report, &Device) -> Result<()>,
) -> Result<()> {
    install_stack_dump()?;
    let gpu = prism_quant::cuda_launch::open_device(0).context("no CUDA device")?;
    let mut report = Report::default();
    let outcome = checks(&mut report, &gpu);
    let n = report.rows.len();
    let mut rows = ROWS.lock().unwrap_or_else(|p| p.into_inner());
    rows.extend(report.rows);
    if let Some(path) = std::env::var_os(JSON_ENV) {
        let path = PathBuf::from(path);
        std::fs::write(&path, serde_json::to_string_pretty(&*rows)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    drop(rows);
    outcome.with_context(|| format!("{group}: stopped after {n} checks"))?;
    if !report.failures.is_empty() {
        bail!(
            "{group}: {} of {n} checks failed:\n  {}",
            report.failures.len(),
            report.failures.join("\n  ")
        );
    }
    println!("{group}: all {n} checks passed");
    Ok(())
}

/// The tiny fixture model's folder (see [`FIXTURES_ENV`]).
pub fn fixtures() -> PathBuf {
    if let Some(dir) = std::env::var_os(FIXTURES_ENV) {
        return PathBuf::from(dir);
    }
    let built = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/qwen35-tiny"
    ));
    if built.is_dir() {
        built
    } else {
        PathBuf::from("tests/fixtures/qwen35-tiny")
    }
}

/// Median wall time in seconds of `runs` calls of `f`, each synchronised, after one warm-up call.
pub fn median_seconds<T>(
    gpu: &Device,
    runs: usize,
    mut f: impl FnMut() -> Result<T>,
) -> Result<f64> {
    drop(f()?);
    gpu.synchronize()?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let start = Instant::now();
        let out = f()?;
        gpu.synchronize()?;
        times.push(start.elapsed().as_secs_f64());
        drop(out);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[runs / 2])
}

/// Each tensor of `x` on `device`.
pub fn on_device<const N: usize>(x: &[Tensor; N], device: &Device) -> Result<[Tensor; N]> {
    let moved = x
        .iter()
        .map(|t| t.to_device(device))
        .collect::<candle_core::Result<Vec<_>>>()?;
    moved
        .try_into()
        .map_err(|_| anyhow::anyhow!("tensor count changed"))
}
