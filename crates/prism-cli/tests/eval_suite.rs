//! `prism eval` on the bundled tiny model: the sample suite in-process and over HTTP (a real `prism
//! serve`) gives the same results; int8 against f32 with `--compare` (the agreement docs/correctness.md
//! states); the reliability PNG's bars; bad lines; sys1bench's manifest format; Ctrl-C's partial report.
//! The metrics themselves are checked against scikit-learn in prism-decision's `tests/eval_sklearn.rs`.

mod common;
mod serve_common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::probabilities;
use serde_json::Value;
use serve_common::{repo_path, Server};

fn out_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("prism-eval-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn prism(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env_remove("PRISM_API_KEY")
        .stdin(Stdio::null())
        .output()
        .expect("run prism")
}

fn eval_ok(args: &[&str]) -> Value {
    let output = prism(args);
    assert!(
        output.status.success(),
        "prism {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    let out = args
        .iter()
        .position(|a| *a == "--out")
        .map(|i| PathBuf::from(args[i + 1]))
        .expect("--out");
    results(&out)
}

fn results(out: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(out.join("results.json")).expect("results.json"))
        .expect("results.json is JSON")
}

/// An empty out dir `name`, made, and the sample suite's text to build a suite of one's own from.
fn dir_for_a_suite(name: &str) -> (PathBuf, String) {
    let dir = out_dir(name);
    std::fs::create_dir_all(&dir).unwrap();
    (dir, std::fs::read_to_string(sample()).unwrap())
}

fn sample() -> String {
    repo_path("examples/suites/sample.jsonl")
        .to_str()
        .expect("path")
        .to_string()
}

#[test]
fn sample_suite_in_process_and_over_http_give_the_same_results() {
    let suite = sample();
    let local = out_dir("local");
    let a = eval_ok(&["eval", &suite, "--out", local.to_str().unwrap()]);
    let server = Server::start(&[]);
    let remote = out_dir("remote");
    let url = format!("http://{}", server.addr);
    let b = eval_ok(&[
        "eval",
        &suite,
        "--url",
        &url,
        "--concurrency",
        "4",
        "--out",
        remote.to_str().unwrap(),
    ]);
    // Every answer's probabilities and every metric, bit for bit (the run info differs: mode, time).
    assert_eq!(a["items"], b["items"]);
    assert_eq!(a["summary"], b["summary"]);
    assert_eq!(a["run"]["mode"], "in-process");
    assert_eq!(b["run"]["mode"], "http");
    assert_eq!(b["run"]["demo"], true);

    let s = &a["summary"];
    assert_eq!(s["complete"], true);
    assert_eq!(s["suite_items"], 32);
    assert_eq!(s["items"], 32);
    assert_eq!(s["questions"], 82);
    assert_eq!(s["unlabelled_questions"], 4);
    for kind in ["choice", "noul", "score"] {
        assert!(
            s["by_type"][kind]["questions"].as_u64().unwrap() > 0,
            "{kind}"
        );
    }
    assert_eq!(s["by_tag"]["tickets"]["items"], 22);
    assert_eq!(s["by_tag"]["reviews"]["questions"], 12);
    // The metrics follow from the items: accuracy is the share of correct labelled answers.
    let items = a["items"].as_array().unwrap();
    let (mut correct, mut labelled) = (0, 0);
    for item in items {
        for (_, answer) in item["answers"].as_object().unwrap() {
            let sum: f64 = probabilities(answer).iter().sum();
            assert!((sum - 1.0).abs() < 1e-9, "{item}");
            if let Some(ok) = answer["correct"].as_bool() {
                labelled += 1;
                correct += ok as usize;
            }
        }
    }
    assert_eq!(labelled, 82);
    assert_eq!(
        s["accuracy"].as_f64().unwrap(),
        correct as f64 / labelled as f64
    );
    let report = std::fs::read_to_string(local.join("report.md")).unwrap();
    assert!(report.contains("| **all** | 32 | 82 |"), "{report}");
    assert!(report.contains("random weights"));
    assert!(!report.contains("PARTIAL"));
    let _ = std::fs::remove_dir_all(local);
    let _ = std::fs::remove_dir_all(remote);
}

/// docs/correctness.md ("`prism eval --compare`"): int8 against f32 on the tiny Q8_0 file, the sample
/// suite. The CPU paths are exact, so these are the run's own numbers.
#[test]
fn compare_int8_against_f32_on_the_fixture() {
    let suite = sample();
    let f32_dir = out_dir("f32");
    let int8_dir = out_dir("int8");
    eval_ok(&[
        "eval",
        &suite,
        "--out",
        f32_dir.to_str().unwrap(),
        "--precision",
        "f32",
    ]);
    let r = eval_ok(&[
        "eval",
        &suite,
        "--out",
        int8_dir.to_str().unwrap(),
        "--precision",
        "int8",
        "--compare",
        f32_dir.to_str().unwrap(),
    ]);
    let c = &r["compare"];
    assert_eq!(c["questions"], 86);
    assert_eq!(c["agreeing"], 83);
    assert_eq!(c["only_here"], 0);
    assert_eq!(c["only_other"], 0);
    let mean = c["mean_abs_dp"].as_f64().unwrap();
    let max = c["max_abs_dp"].as_f64().unwrap();
    assert!((mean - 0.03521).abs() < 1e-4, "mean |Δp| {mean}");
    assert!((max - 0.17665).abs() < 1e-4, "max |Δp| {max}");
    let flipped: Vec<(String, String)> = c["flipped"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["id"].as_str().unwrap().to_string(),
                f["question"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let expected: Vec<(String, String)> = ["r01", "r04", "r05"]
        .iter()
        .map(|id| (id.to_string(), "sentiment".to_string()))
        .collect();
    assert_eq!(flipped, expected);
    let report = std::fs::read_to_string(int8_dir.join("report.md")).unwrap();
    assert!(report.contains("83 decisions agree"), "{report}");
    assert!(report.contains("| r01 | sentiment |"), "{report}");
    // A run against itself: full agreement, no drift. (Its command line has the shape of the int8 run's
    // above; each is the run its checks are about.)
    let self_dir = out_dir("self");
    let r = eval_ok(&[
        "eval",
        &suite,
        "--out",
        self_dir.to_str().unwrap(),
        "--compare",
        f32_dir.join("results.json").to_str().unwrap(),
    ]);
    assert_eq!(r["compare"]["agreeing"], 86);
    assert_eq!(r["compare"]["max_abs_dp"].as_f64(), Some(0.0));
    for dir in [f32_dir, int8_dir, self_dir] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The PNG decodes, and each bin's bar is where `eval_report.rs` says: blue from the plot's bottom to
/// the bin's accuracy, nothing in empty bins, an orange count bar below. Geometry (that module's doc):
/// 640 × 480, plot x 40..600, y 20..400, count strip y 420..460.
#[test]
fn reliability_png_has_the_bins_bars() {
    let dir = out_dir("png");
    let r = eval_ok(&[
        "eval",
        &sample(),
        "--out",
        dir.to_str().unwrap(),
        "--bins",
        "10",
    ]);
    let image = image::open(dir.join("reliability.png"))
        .expect("reliability.png decodes")
        .to_rgb8();
    assert_eq!(image.dimensions(), (640, 480));
    let blue = image::Rgb([31u8, 119, 180]);
    let orange = image::Rgb([255u8, 127, 14]);
    let bins = r["summary"]["reliability"].as_array().unwrap();
    assert_eq!(bins.len(), 10);
    let mut non_empty = 0;
    for (i, bin) in bins.iter().enumerate() {
        // A column in the left quarter of the bar (the confidence tick is on its right third).
        let x = 40 + (i as u32 * 56) + 14;
        let blue_rows: Vec<u32> = (20..=400)
            .filter(|&y| *image.get_pixel(x, y) == blue)
            .collect();
        let orange_rows = (420..=460)
            .filter(|&y| *image.get_pixel(x, y) == orange)
            .count();
        let count = bin["count"].as_u64().unwrap();
        if count == 0 {
            assert!(
                blue_rows.is_empty() && orange_rows == 0,
                "bin {i} is empty but drawn"
            );
            continue;
        }
        non_empty += 1;
        assert!(orange_rows > 0, "bin {i}: no count bar");
        let accuracy = bin["accuracy"].as_f64().unwrap();
        let top = 400.0 - accuracy * 380.0;
        if accuracy > 0.0 {
            let (first, last) = (blue_rows[0], *blue_rows.last().unwrap());
            assert!(
                (first as f64 - top).abs() <= 1.5,
                "bin {i}: bar top at {first}, accuracy {accuracy} puts it at {top}"
            );
            assert!(
                last >= 399,
                "bin {i}: bar does not reach the bottom ({last})"
            );
            assert_eq!(
                blue_rows.len() as u32,
                last - first + 1,
                "bin {i}: bar has gaps"
            );
        }
    }
    assert!(non_empty >= 2, "{bins:?}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn bad_lines_name_line_and_field_and_skip_bad_goes_on() {
    let (dir, text) = dir_for_a_suite("bad");
    let mut lines: Vec<String> = text.lines().take(3).map(str::to_string).collect();
    lines[1] = lines[1].replace("\"team\": \"billing\"", "\"team\": \"finance\"");
    lines.push("{\"id\": \"x\"".to_string());
    let suite = dir.join("bad.jsonl");
    std::fs::write(&suite, lines.join("\n")).unwrap();
    let out = dir.join("out");
    let output = prism(&[
        "eval",
        suite.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("line 2: labels.team: \"finance\" is not one of the question's options (shipping, billing, technical, sales)"),
        "{stderr}"
    );
    let r = eval_ok(&[
        "eval",
        suite.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--skip-bad",
    ]);
    assert_eq!(r["summary"]["items"], 2);
    let skipped = r["skipped_lines"].as_array().unwrap();
    assert_eq!(skipped.len(), 2);
    assert!(skipped[0]
        .as_str()
        .unwrap()
        .starts_with("line 2: labels.team:"));
    assert!(skipped[1]
        .as_str()
        .unwrap()
        .starts_with("line 4: line: not JSON"));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("Bad lines passed over"));
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn reads_sys1bench_manifest_rows() {
    let dir = out_dir("sys1bench");
    let suite = repo_path("tests/fixtures/eval/sys1bench-format.jsonl");
    let r = eval_ok(&[
        "eval",
        suite.to_str().unwrap(),
        "--out",
        dir.to_str().unwrap(),
    ]);
    let items = r["items"].as_array().unwrap();
    assert_eq!(
        items[0]["id"],
        "prism_0001|p0|is_angry:f0|priority:f0|queue:f1"
    );
    assert_eq!(
        items[0]["tags"],
        serde_json::json!(["support_triage", "tier:G", "lang:en"])
    );
    let answers = &items[0]["answers"];
    assert_eq!(answers["queue"]["label"], "shipping");
    // allow_abstain adds sys1bench's abstain option, as its TypeSafe adapter sends it.
    let queue: Vec<&String> = answers["queue"]["probabilities"]
        .as_object()
        .unwrap()
        .keys()
        .collect();
    assert_eq!(
        queue,
        ["billing", "shipping", "account", "none_of_the_above"]
    );
    assert_eq!(answers["is_angry"]["label"], "true");
    // Levels 1, 2, 3 with ground truth 3: the third level, index 2.
    assert_eq!(answers["priority"]["label"], "2");
    assert_eq!(items[1]["answers"]["action"]["label"], Value::Null);
    assert_eq!(r["summary"]["questions"], 4);
    assert_eq!(r["summary"]["unlabelled_questions"], 1);
    let _ = std::fs::remove_dir_all(dir);
}

/// Ctrl-C (SIGINT) while a long suite runs: what is done is kept, the report says it is partial, exit 130.
#[test]
fn ctrl_c_writes_a_partial_report() {
    let (dir, text) = dir_for_a_suite("ctrlc");
    let mut long = String::new();
    for copy in 0..20 {
        for line in text.lines() {
            let mut v: Value = serde_json::from_str(line).unwrap();
            v["id"] = Value::String(format!("{}-{copy}", v["id"].as_str().unwrap()));
            long.push_str(&v.to_string());
            long.push('\n');
        }
    }
    let suite = dir.join("long.jsonl");
    std::fs::write(&suite, long).unwrap();
    let out = dir.join("out");
    // Flag and value pairs, written out as the other command-line tests write theirs (kv_fp8_cli's and
    // synth_bench's bench runs): alike in shape only, each is the command its test runs.
    let mut child = Command::new(env!("CARGO_BIN_EXE_prism"))
        .args([
            "eval",
            suite.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--concurrency",
            "2",
        ])
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start prism eval");
    // Without a terminal, progress is a line every tenth of the suite: wait for the first.
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let started = Instant::now();
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            stderr.read_line(&mut line).unwrap() > 0,
            "prism eval ended early"
        );
        if line.starts_with("eval: 64/640 items") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(300));
    }
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(130), "{rest}");
    assert!(rest.contains("interrupted"), "{rest}");
    let r = results(&out);
    let s = &r["summary"];
    assert_eq!(s["complete"], false);
    assert_eq!(s["suite_items"], 640);
    let done = s["items"].as_u64().unwrap();
    assert!((64..640).contains(&done), "{done} items done");
    assert_eq!(s["not_run"].as_u64().unwrap(), 640 - done);
    assert_eq!(r["run"]["interrupted"], true);
    assert_eq!(r["items"].as_array().unwrap().len() as u64, done);
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("PARTIAL REPORT"), "{report}");
    assert!(out.join("reliability.png").is_file());
    let _ = std::fs::remove_dir_all(dir);
}
