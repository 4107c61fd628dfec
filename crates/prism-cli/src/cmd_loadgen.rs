//! `prism loadgen`: the flags and the printing; the load and the check are `prism_server::loadgen`.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use prism_server::loadgen::{LoadgenOptions, SweepPoint};
use serde_json::{json, Value};

/// Arguments of `prism loadgen`.
// One documented field a flag: alike in shape to the other commands' arguments, each derived by clap
// for its own command.
#[derive(Args)]
pub struct LoadgenArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8092.
    #[arg(long)]
    pub url: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// Seconds of load per client count.
    #[arg(long, default_value_t = 30.0)]
    pub duration: f64,
    /// Stop a client count after this many requests (0: only the duration stops it).
    #[arg(long, default_value_t = 0)]
    pub max_requests: u64,
    /// Measure each of these client counts in turn (e.g. `1,4,16,64`) instead of `--clients`.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<usize>,
    /// Requests to send, one JSON /v1/systemone request a line. Default: the built-in mix.
    #[arg(long)]
    pub requests: Option<PathBuf>,
    /// Distinct requests in the built-in mix.
    #[arg(long, default_value_t = 4096)]
    pub mix_size: usize,
    /// Seed of the built-in mix.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Draw throughput against latency (one point per client count: p50 and p95) as a PNG; its scale is
    /// printed and written into the JSON (the picture has no text: see `sweep_png`).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// After the load, send this many of the distinct requests answered under load again, one at a
    /// time, and compare the answers (0: no check).
    #[arg(long, default_value_t = 128)]
    pub check: usize,
    /// Fail (exit 1) when an answer under load differs from the same request alone (what the exact
    /// precisions promise; bf16 on a GPU does not).
    #[arg(long)]
    pub expect_identical: bool,
}

pub fn run(args: &LoadgenArgs) -> Result<()> {
    let options = LoadgenOptions {
        url: args.url.clone(),
        clients: args.clients,
        duration: args.duration,
        max_requests: args.max_requests,
        sweep: args.sweep.clone(),
        requests: args.requests.clone(),
        mix_size: args.mix_size,
        seed: args.seed,
        api_key: args.api_key.clone(),
        check: args.check,
    };
    let outcome = prism_server::loadgen::run(&options, &mut |text| eprint!("{text}"))?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{:>8} {:>10} {:>12} {:>12} {:>9} {:>9} {:>9} {:>11} {:>11}  statuses",
        "clients",
        "req/s",
        "in tok/s",
        "out tok/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "server p50",
        "transp. p50"
    )?;
    for r in &outcome.levels {
        let ms = |k: &str| r["latency_ms"][k].as_f64().unwrap_or(f64::NAN);
        writeln!(
            out,
            "{:>8} {:>10.2} {:>12.0} {:>12.0} {:>9.1} {:>9.1} {:>9.1} {:>11.2} {:>11.2}  {}",
            r["clients"].as_u64().unwrap_or(0),
            r["requests_per_s"].as_f64().unwrap_or(0.0),
            r["input_tokens_per_s"].as_f64().unwrap_or(0.0),
            r["output_tokens_per_s"].as_f64().unwrap_or(0.0),
            ms("p50"),
            ms("p95"),
            ms("p99"),
            r["server_latency_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
            r["transport_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
            r["statuses"]
        )?;
    }
    let checked = &outcome.check;
    let mismatches = checked["mismatches"].as_u64().unwrap_or(0);
    if !checked.is_null() {
        writeln!(
            out,
            "check: {} requests sent again alone, {mismatches} answered differently (largest difference of a number {}, other fields differing {})",
            checked["checked"], checked["max_abs_difference"], checked["other_differences"]
        )?;
    }
    let plot = match &args.plot {
        Some(path) => {
            let points: Vec<SweepPoint> = outcome
                .levels
                .iter()
                .map(|r| SweepPoint {
                    requests_per_s: r["requests_per_s"].as_f64().unwrap_or(0.0),
                    p50_ms: r["latency_ms"]["p50"].as_f64().unwrap_or(0.0),
                    p95_ms: r["latency_ms"]["p95"].as_f64().unwrap_or(0.0),
                })
                .collect();
            let scale = prism_server::loadgen::sweep_png(path, &points)
                .with_context(|| format!("drawing {}", path.display()))?;
            writeln!(
                out,
                "plot {}: x latency 0–{:.0} ms, y 0–{:.2} req/s, grid lines every tenth; p50 blue, p95 orange",
                path.display(),
                scale.x_max_ms,
                scale.y_max_requests_per_s
            )?;
            json!({"path": path.display().to_string(), "x_max_ms": scale.x_max_ms, "y_max_requests_per_s": scale.y_max_requests_per_s})
        }
        None => Value::Null,
    };
    if let Some(path) = &args.json_out {
        let report = outcome.report(&options, plot);
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    if mismatches > 0 && args.expect_identical {
        bail!("{mismatches} answers under load differ from the same request alone");
    }
    Ok(())
}
