//! `prism bench`: the flags and the table; the measurements are `prism_decision::bench` (latency of the
//! decision path against its floors, or thought decoding through the engine with `--think`).

use anyhow::Result;
use prism_decision::bench::BenchOptions;
use serde_json::Value;

use crate::BenchArgs;

pub fn run(args: &BenchArgs) -> Result<()> {
    let options = BenchOptions {
        model_dir: args.model_dir.clone(),
        gguf: args.gguf.clone(),
        precision: args.precision.clone(),
        kv_fp8: args.kv_fp8,
        device: args.device.clone(),
        runs: args.runs,
        warmup: args.warmup,
        long_tokens: args.long_tokens,
        profile: args
            .profile
            .map_or(prism_model::profile::Mode::Off, Into::into),
        load_threads: args.load_threads,
        engine: args.engine,
        tp: args.tp,
        profiler_range: args.profiler_range,
        host_profile: args.host_profile.clone(),
        think: args.think,
        think_batch: args.think_batch.clone(),
        engine_batch: args.engine_batch.clone(),
        narrow_rows: args.narrow_rows,
        swapped_rows: args.swapped_rows,
        programmatic_launch: args.programmatic_launch.clone(),
    };
    let report = prism_decision::bench::run(&options, &mut |line| eprintln!("{line}"))?;
    if args.json || args.think.is_some() {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_table(&report);
    }
    Ok(())
}

fn print_table(report: &Value) {
    let gb = |v: &Value| {
        v.as_f64()
            .map_or("n/a".to_string(), |b| format!("{:.2} GB", b / 1e9))
    };
    println!(
        "model {} ({} layers, d {}, {:.3} B matrix params) on {} / {}, {} K/V, {} threads",
        report["model"].as_str().unwrap_or("?"),
        report["layers"],
        report["hidden_size"],
        report["matrix_params"].as_f64().unwrap_or(0.0) / 1e9,
        report["device"].as_str().unwrap_or("?"),
        report["precision"].as_str().unwrap_or("?"),
        report["kv_storage"].as_str().unwrap_or("native"),
        report["threads"]
    );
    println!(
        "load {:.2} s; RSS after load {}, after runs {}, peak {}; device memory after load {}, after runs {}",
        report["load_s"].as_f64().unwrap_or(f64::NAN),
        gb(&report["process_rss_bytes"]["after_load"]),
        gb(&report["process_rss_bytes"]["after_runs"]),
        gb(&report["process_rss_bytes"]["peak"]),
        gb(&report["device_memory_bytes"]["after_load"]),
        gb(&report["device_memory_bytes"]["after_runs"]),
    );
    println!(
        "measured: copy {:.1} GB/s (read+write), matmul {:.1} GFLOP/s ({}); {} warm-up + {} timed runs",
        report["copy_bandwidth_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e9,
        report["matmul_flops_per_s"].as_f64().unwrap_or(0.0) / 1e9,
        report["matmul_dtype"].as_str().unwrap_or("?"),
        report["warmup"],
        report["runs"]
    );
    println!(
        "{:<7} {:>7} {:>8} {:>11} {:>11} {:>12} {:>12} {:>8}  {:<13} what",
        "case",
        "prompts",
        "tokens",
        "median ms",
        "p95 ms",
        "bw floor ms",
        "fl floor ms",
        "x floor",
        "answers"
    );
    for row in report["scenarios"].as_array().into_iter().flatten() {
        let f = |k: &str| row[k].as_f64().unwrap_or(f64::NAN);
        // The digest's first 12 hex digits; `*`: a later run answered differently.
        let answers = format!(
            "{}{}",
            row["answers_sha256"]
                .as_str()
                .unwrap_or("-")
                .get(..12)
                .unwrap_or("-"),
            if row["answers_same_every_run"].as_bool() == Some(false) {
                "*"
            } else {
                ""
            }
        );
        println!(
            "{:<7} {:>7} {:>8} {:>11.1} {:>11.1} {:>12.2} {:>12.2} {:>8.1}  {:<13} {}",
            row["scenario"].as_str().unwrap_or("?"),
            row["prompts"].to_string(),
            row["computed_tokens"].to_string(),
            f("median_ms"),
            f("p95_ms"),
            f("bandwidth_floor_ms"),
            f("compute_floor_ms"),
            f("median_over_floor"),
            answers,
            row["what"].as_str().unwrap_or("")
        );
    }
    for row in report["scenarios"].as_array().into_iter().flatten() {
        let engine = &row["engine"];
        if engine.is_null() {
            continue;
        }
        println!(
            "through the engine (step loop, prefix cache off): {:<7} median {:.1} ms, p95 {:.1} ms, answers {}{} ({:+.1} ms against the direct path)",
            row["scenario"].as_str().unwrap_or("?"),
            engine["median_ms"].as_f64().unwrap_or(f64::NAN),
            engine["p95_ms"].as_f64().unwrap_or(f64::NAN),
            engine["answers_sha256"].as_str().unwrap_or("-").get(..12).unwrap_or("-"),
            if engine["answers_same_every_run"].as_bool() == Some(false) { "*" } else { "" },
            engine["median_ms"].as_f64().unwrap_or(f64::NAN) - row["median_ms"].as_f64().unwrap_or(f64::NAN),
        );
    }
}
