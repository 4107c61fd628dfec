//! `prism synth` and `prism bench`.
//!
//! - A real-width Qwen3.5-0.8B with 4 layers and the full 248k vocabulary, in Q8_0: the file reads back
//!   with exactly the planned tensors (whose names, dims and per-type choices the prism-model tests check
//!   against llama.cpp's own files), and `prism decide` answers the README request on it.
//! - BF16 and Q4_K_M with a cut vocabulary (the hidden `--vocab-ranks`, to keep CI fast): two runs with
//!   the same seed write the same bytes; Q4_K_M's tied embedding is Q6_K; `prism decide` answers.
//! - `prism bench` on the tiny fixture: the three scenarios, their token counts against `prism decide`'s
//!   usage, the long prompt near its target, and every latency above its measured floor.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{probabilities, repo, run_prism};
use prism_gguf::{GgmlType, GgufFile};
use prism_model::synth::{SynthFileType, SynthSize, SynthSpec};
use serde_json::Value;

fn prism(args: &[&str]) -> Output {
    run_prism(args, &[("RAYON_NUM_THREADS", "2"), ("RUST_BACKTRACE", "0")])
}

fn ok(output: &Output) -> &Output {
    assert!(
        output.status.success(),
        "prism failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn synth(out: &Path, args: &[&str]) {
    let mut all = vec!["synth", "--out", out.to_str().unwrap()];
    all.extend_from_slice(args);
    ok(&prism(&all));
}

/// `prism decide --gguf GGUF --model-dir DIR` on the README request (`examples/request.json`), which must
/// succeed: its response.
fn decide_response(gguf: &Path, dir: &Path) -> Value {
    let request = repo("examples/request.json");
    let output = prism(&[
        "decide",
        "--gguf",
        gguf.to_str().unwrap(),
        "--model-dir",
        dir.to_str().unwrap(),
        request.to_str().unwrap(),
    ]);
    serde_json::from_slice(&ok(&output).stdout).expect("response JSON")
}

/// `prism decide` on the README request: three answers whose probabilities are finite and sum to 1.
/// Returns the response.
fn decide(dir: &Path) -> Value {
    let response = decide_response(&dir.join("model.gguf"), dir);
    let answers = response["answers"].as_object().expect("answers");
    assert_eq!(
        answers.keys().collect::<Vec<_>>(),
        ["team", "urgent", "mood"]
    );
    for name in ["team", "mood"] {
        let p = probabilities(&answers[name]);
        assert_eq!(p.len(), 3);
        assert!(
            p.iter().all(|x| x.is_finite() && *x > 0.0 && *x < 1.0),
            "{name}: {p:?}"
        );
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
    }
    let noul = answers["urgent"]["noul"].as_f64().unwrap();
    assert!(noul > 0.0 && noul < 1.0);
    response
}

fn listing(gguf: &GgufFile) -> Vec<(String, Vec<u64>, GgmlType)> {
    gguf.tensors()
        .iter()
        .map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type))
        .collect()
}

fn planned(file_type: SynthFileType) -> Vec<(String, Vec<u64>, GgmlType)> {
    let spec = SynthSpec::new(SynthSize::B0_8, file_type, 0)
        .with_layers(4)
        .unwrap();
    spec.tensors()
        .into_iter()
        .map(|t| (t.name, t.dims, t.ty))
        .collect()
}

#[test]
fn real_width_q8_0_with_the_full_vocabulary_answers_requests() {
    let dir = scratch("synth_0.8b_q8_0");
    synth(
        &dir,
        &[
            "--shape", "0.8b", "--layers", "4", "--type", "q8_0", "--seed", "1",
        ],
    );
    let gguf = GgufFile::open(dir.join("model.gguf")).unwrap();
    assert_eq!(listing(&gguf), planned(SynthFileType::Q8_0));
    assert_eq!(
        gguf.get("general.file_type").and_then(|v| v.as_u64()),
        Some(7)
    );
    assert_eq!(
        gguf.get_array("tokenizer.ggml.tokens").unwrap().len(),
        248_320
    );
    assert_eq!(
        gguf.tensor_info("token_embd.weight").unwrap().dims,
        vec![1024, 248_320]
    );
    let letters: Value =
        serde_json::from_slice(&std::fs::read(dir.join("decision_config.json")).unwrap()).unwrap();
    // The ranks of the bytes A..Z in the Qwen3.5 rank file (GPT-2 byte order: '!' is 0, 'A' is 32).
    let expected: Vec<u64> = (32..58).collect();
    assert_eq!(letters["letter_token_ids"], serde_json::json!(expected));
    decide(&dir);
}

#[test]
fn same_seed_same_bytes_and_q4_k_m_answers() {
    let cut = ["--shape", "0.8b", "--layers", "4", "--vocab-ranks", "1024"];
    let bf16 = |name: &str, seed: &str| -> Vec<u8> {
        let dir = scratch(name);
        let mut args = cut.to_vec();
        args.extend(["--type", "bf16", "--seed", seed]);
        synth(&dir, &args);
        std::fs::read(dir.join("model.gguf")).unwrap()
    };
    let first = bf16("synth_bf16_a", "5");
    // (Another seed giving other bytes is checked in prism-model's synth tests.)
    assert_eq!(
        first,
        bf16("synth_bf16_b", "5"),
        "same seed, different bytes"
    );
    let gguf = GgufFile::from_bytes(first).unwrap();
    let vocab_rows = |t: &(String, Vec<u64>, GgmlType)| -> (String, Vec<u64>, GgmlType) {
        let mut t = t.clone();
        if t.0 == "token_embd.weight" {
            t.1[1] = 1024 + 33;
        }
        t
    };
    let expected: Vec<_> = planned(SynthFileType::Bf16)
        .iter()
        .map(vocab_rows)
        .collect();
    assert_eq!(listing(&gguf), expected);

    let dir = scratch("synth_q4_k_m");
    let mut args = cut.to_vec();
    args.extend(["--type", "q4_k_m"]);
    synth(&dir, &args);
    let gguf = GgufFile::open(dir.join("model.gguf")).unwrap();
    let expected: Vec<_> = planned(SynthFileType::Q4KM)
        .iter()
        .map(vocab_rows)
        .collect();
    assert_eq!(listing(&gguf), expected);
    assert_eq!(
        gguf.tensor_info("token_embd.weight").unwrap().ggml_type,
        GgmlType::Q6_K
    );
    assert_eq!(
        gguf.get("general.file_type").and_then(|v| v.as_u64()),
        Some(15)
    );
    decide(&dir);
}

#[test]
fn bad_synth_arguments_are_refused() {
    let dir = scratch("synth_refused");
    for (args, message) in [
        (
            vec!["--shape", "3b", "--type", "q8_0"],
            "unknown model size",
        ),
        (
            vec!["--shape", "0.8b", "--type", "q5_k"],
            "unknown file type",
        ),
        (
            vec!["--shape", "0.8b", "--type", "q8_0", "--layers", "0"],
            "layers",
        ),
    ] {
        let mut all = vec!["synth", "--out", dir.to_str().unwrap()];
        all.extend(args);
        let output = prism(&all);
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(message), "{stderr}");
    }
}

/// `prism bench` on the tiny fixture's Q8_0 file with `extra` arguments.
fn tiny_bench(extra: &[&str]) -> Output {
    let dir = repo("tests/fixtures/qwen35-tiny");
    let gguf = dir.join("tiny-Q8_0.gguf");
    let mut args = vec![
        "bench",
        "--model-dir",
        dir.to_str().unwrap(),
        "--gguf",
        gguf.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    prism(&args)
}

#[test]
fn bench_runs_the_three_scenarios_on_the_tiny_model() {
    let scratch_dir = scratch("bench_host_profile");
    std::fs::create_dir_all(&scratch_dir).unwrap();
    let host_profile = scratch_dir.join("host.txt");
    let output = tiny_bench(&[
        "--runs",
        "2",
        "--warmup",
        "1",
        "--long-tokens",
        "600",
        "--json",
        "--host-profile",
        host_profile.to_str().unwrap(),
    ]);
    let report: Value = serde_json::from_slice(&ok(&output).stdout).expect("bench JSON");
    let scenarios = report["scenarios"].as_array().unwrap();
    let names: Vec<&str> = scenarios
        .iter()
        .map(|s| s["scenario"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["short", "shared", "long"]);
    let tokens = |s: &Value| -> Vec<u64> {
        s["prompt_tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect()
    };
    let (short, shared, long) = (
        tokens(&scenarios[0]),
        tokens(&scenarios[1]),
        tokens(&scenarios[2]),
    );
    assert_eq!((short.len(), shared.len(), long.len()), (1, 3, 1));
    // The short question is the shared request's first question on the same ticket.
    assert_eq!(short[0], shared[0]);
    // The shared request is examples/request.json: prism decide counts the same prompt tokens.
    let dir = repo("tests/fixtures/qwen35-tiny");
    let response = decide_response(&dir.join("tiny-Q8_0.gguf"), &dir);
    assert_eq!(
        response["usage"]["input_tokens"].as_u64().unwrap(),
        shared.iter().sum::<u64>()
    );
    // The bench answers the shared request as `prism decide` does, and digests the answers.
    assert_eq!(scenarios[1]["answers"], response["answers"]);
    for s in scenarios {
        let digest = s["answers_sha256"].as_str().unwrap();
        assert!(
            digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
            "{digest}"
        );
    }
    assert_ne!(
        scenarios[0]["answers_sha256"], scenarios[1]["answers_sha256"],
        "one question and three questions answer differently"
    );
    // Shared evidence: the prefix is computed once.
    let computed = scenarios[1]["computed_tokens"].as_u64().unwrap();
    let prefix = scenarios[1]["shared_prefix_tokens"].as_u64().unwrap();
    assert!(prefix > 0 && computed == prefix + shared.iter().map(|n| n - prefix).sum::<u64>());
    assert!(
        (long[0] as f64 - 600.0).abs() <= 30.0,
        "long prompt has {} tokens",
        long[0]
    );

    for s in scenarios {
        let name = s["scenario"].as_str().unwrap();
        assert_eq!(s["runs_ms"].as_array().unwrap().len(), 2, "{name}");
        assert_eq!(s["answers_same_every_run"], Value::Bool(true), "{name}");
        let f = |k: &str| s[k].as_f64().unwrap_or_else(|| panic!("{name}: {k}"));
        assert!(
            f("median_ms") > 0.0 && f("p95_ms") >= f("median_ms"),
            "{name}"
        );
        assert!(
            f("bandwidth_floor_ms") > 0.0 && f("compute_floor_ms") > 0.0,
            "{name}"
        );
        assert_eq!(
            f("floor_ms"),
            f("bandwidth_floor_ms").max(f("compute_floor_ms"))
        );
        // A floor is what the hardware allows at best: no run may beat it.
        assert!(
            f("median_over_floor") >= 1.0,
            "{name}: {} × floor",
            f("median_over_floor")
        );
    }
    assert!(report["load_s"].as_f64().unwrap() > 0.0);
    assert!(report["copy_bandwidth_bytes_per_s"].as_f64().unwrap() > 1e8);
    assert!(report["matmul_flops_per_s"].as_f64().unwrap() > 1e8);
    assert!(report["process_rss_bytes"]["after_load"].as_u64().unwrap() > 0);
    assert!(
        report["device_memory_bytes"]["after_load"].is_null(),
        "no device memory on the CPU"
    );
    // The host profile: a tag a scenario, the process's memory map (the executable in it) and samples
    // of the three windows only (each scenario's last timed run takes well over the timer's tick of
    // CPU time), every sample's tag one of those written.
    let text = std::fs::read_to_string(&host_profile).expect("the host profile file");
    let tags: Vec<&str> = text.lines().filter(|l| l.starts_with("tag ")).collect();
    assert_eq!(tags, ["tag 0 short", "tag 1 shared", "tag 2 long"]);
    assert!(
        text.lines()
            .any(|l| l.starts_with("map ") && l.ends_with("/prism")),
        "no map line of the executable"
    );
    let samples: Vec<Vec<&str>> = text
        .lines()
        .filter(|l| l.starts_with("s "))
        .map(|l| l.split(' ').collect())
        .collect();
    assert!(!samples.is_empty(), "no samples");
    for s in &samples {
        // "s TAG THREAD IP [RETURN ADDRESSES]"
        assert!(s.len() >= 4, "{s:?}");
        assert!(["0", "1", "2"].contains(&s[1]), "{s:?}");
        for address in &s[3..] {
            assert!(
                u64::from_str_radix(address, 16).is_ok_and(|a| a > 0),
                "{s:?}"
            );
        }
    }
}

#[test]
fn bench_through_the_engine_times_a_prefix_cache_follow_up_with_the_whole_requests_bits() {
    let dir = repo("tests/fixtures/qwen35-tiny");
    let gguf = dir.join("tiny-Q8_0.gguf");
    let (dir, gguf) = (dir.to_str().unwrap(), gguf.to_str().unwrap());
    let mut args = vec!["bench", "--engine", "--json"];
    for pair in [
        ["--model-dir", dir],
        ["--gguf", gguf],
        ["--runs", "2"],
        ["--warmup", "0"],
        ["--long-tokens", "300"],
        ["--engine-batch", "3"],
    ] {
        args.extend(pair);
    }
    let report: Value = serde_json::from_slice(&ok(&prism(&args)).stdout).expect("bench JSON");
    let short = &report["scenarios"][0];
    // The engine's split: the passes inside the compute, the parts adding up to at most the run.
    let split = &short["engine"]["split"];
    let part = |name: &str| {
        split[name]
            .as_f64()
            .unwrap_or_else(|| panic!("{name}: {split}"))
    };
    assert!(part("prepare_ms") > 0.0 && part("pass_ms") > 0.0, "{split}");
    assert!(part("pass_ms") <= part("compute_ms"), "{split}");
    assert!(
        part("prepare_ms") + part("queue_ms") + part("compute_ms")
            <= short["engine"]["median_ms"].as_f64().unwrap() + 1e-6,
        "{split}"
    );
    // Three distinct requests in one pass, each answering what it answers alone.
    let batch = &report["engine_batches"][0];
    assert_eq!(batch["requests"], 3, "{batch}");
    assert_eq!(batch["passes"], serde_json::json!([1, 1]), "{batch}");
    assert_eq!(batch["answers_differing_from_alone"], 0, "{batch}");
    assert!(batch["requests_per_s"].as_f64().unwrap() > 0.0, "{batch}");
    assert_eq!(short["scenario"], "short");
    let followup = &report["followup"];
    assert_eq!(
        followup["runs_ms"].as_array().map(Vec::len),
        Some(2),
        "{followup}"
    );
    assert!(followup["median_ms"].as_f64().unwrap() > 0.0);
    // From the cache or computed whole, through the engine or not: one set of bits.
    assert_eq!(followup["answers_sha256"], short["answers_sha256"]);
    assert_eq!(short["engine"]["answers_sha256"], short["answers_sha256"]);
}

/// `prism bench --tp 2` (int8): every scenario through the engine over the model split over two
/// devices, its answers' digest the direct path's; at f32 the split is refused with the reason.
#[test]
fn bench_splits_the_model_over_two_devices_with_the_same_answers() {
    let output = tiny_bench(&[
        "--precision",
        "int8",
        "--tp",
        "2",
        "--runs",
        "1",
        "--warmup",
        "0",
        "--long-tokens",
        "300",
        "--json",
    ]);
    let report: Value = serde_json::from_slice(&ok(&output).stdout).expect("bench JSON");
    let split = &report["tensor_parallel"];
    assert_eq!(split["devices"], 2, "{split}");
    let rows = split["scenarios"].as_array().unwrap();
    let direct = report["scenarios"].as_array().unwrap();
    assert_eq!(rows.len(), direct.len());
    for (row, alone) in rows.iter().zip(direct) {
        assert_eq!(row["scenario"], alone["scenario"]);
        assert_eq!(row["answers_sha256"], alone["answers_sha256"], "{row}");
        assert!(row["median_ms"].as_f64().unwrap() > 0.0, "{row}");
    }
    let output = tiny_bench(&[
        "--precision",
        "f32",
        "--tp",
        "2",
        "--runs",
        "1",
        "--warmup",
        "0",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--tp 2") && stderr.contains("integer path"),
        "{stderr}"
    );
}

/// `--programmatic-launch on,off` measures both launch modes in turn on one model load, a CUDA
/// setting: a build without CUDA refuses it before loading anything, saying why.
#[cfg(not(feature = "cuda"))]
#[test]
fn bench_refuses_launch_variants_without_cuda() {
    let output = tiny_bench(&["--think", "4", "--programmatic-launch", "on,off"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("--programmatic-launch chooses how CUDA kernels are launched"),
        "{stderr}"
    );
}

/// Both launch modes are compared on thoughts only: without `--think` the list is refused before the
/// model loads.
#[test]
fn bench_refuses_launch_variants_without_think() {
    let output = tiny_bench(&["--programmatic-launch", "on,off"]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("measured with --think only"), "{stderr}");
}

/// `prism bench --think` on the tiny fixture: a row per timed run and batch size (the warm-up run not
/// reported), no variant, each thought within its budget and the batch's thoughts all stopped.
#[test]
fn bench_think_reports_a_row_per_run_and_batch() {
    let output = tiny_bench(&["--think", "4", "--think-batch", "1,2", "--runs", "2"]);
    let report: Value = serde_json::from_slice(&ok(&output).stdout).expect("bench JSON");
    let rows = report["thoughts"].as_array().expect("thought rows");
    let shape: Vec<(u64, u64)> = rows
        .iter()
        .map(|r| (r["run"].as_u64().unwrap(), r["sequences"].as_u64().unwrap()))
        .collect();
    assert_eq!(shape, [(1, 1), (1, 2), (2, 1), (2, 2)]);
    for row in rows {
        assert!(row["variant"].is_null(), "{row}");
        let sequences = row["sequences"].as_u64().unwrap();
        let tokens = row["thought_tokens"].as_u64().unwrap();
        assert!(tokens >= 1 && tokens <= 4 * sequences, "{row}");
        let stops: u64 = row["stop_reasons"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum();
        assert_eq!(stops, sequences, "{row}");
    }
}
