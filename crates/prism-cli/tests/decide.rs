//! `prism decide` on the bundled tiny model: the whole product path without the HTTP layer.

mod common;

use std::process::Output;

use common::{example, repo, run_prism};
use serde_json::Value;

fn prism(args: &[&str]) -> Output {
    run_prism(args, &[("RAYON_NUM_THREADS", "1"), ("RUST_BACKTRACE", "0")])
}

#[test]
fn answers_the_example_request_with_the_bundled_model() {
    let output = prism(&["decide", example("request.json").to_str().unwrap()]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let response: Value =
        serde_json::from_slice(&output.stdout).expect("stdout is the response JSON");
    let answers = response["answers"].as_object().expect("answers");
    assert_eq!(
        answers.keys().collect::<Vec<_>>(),
        ["team", "urgent", "mood"]
    );

    let team = &answers["team"];
    assert_eq!(team["type"], "choice");
    let probabilities = team["probabilities"].as_object().unwrap();
    assert_eq!(
        probabilities.keys().collect::<Vec<_>>(),
        ["billing", "technical", "sales"]
    );
    let sum: f64 = probabilities.values().map(|p| p.as_f64().unwrap()).sum();
    assert!((sum - 1.0).abs() < 1e-12, "{sum}");
    let (best, p_best) = probabilities
        .iter()
        .map(|(k, p)| (k, p.as_f64().unwrap()))
        .fold(
            ("", -1.0),
            |acc, (k, p)| if p > acc.1 { (k.as_str(), p) } else { acc },
        );
    assert_eq!(team["choice"], best);
    let confidence = team["confidence"].as_f64().unwrap();
    assert!((confidence - (p_best - 1.0 / 3.0) / (1.0 - 1.0 / 3.0)).abs() < 1e-12);

    let p_yes = answers["urgent"]["noul"].as_f64().unwrap();
    assert!(p_yes > 0.0 && p_yes < 1.0);

    let mood = &answers["mood"];
    let p = common::probabilities(mood);
    let score: f64 = p.iter().enumerate().map(|(i, p)| i as f64 * p).sum();
    assert!((mood["score"].as_f64().unwrap() - score).abs() < 1e-12);
    assert_eq!(mood["legend"]["2"], "angry");

    assert!(response["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert_eq!(response["usage"]["output_tokens"], 0);
    assert_eq!(response["model"], "Qwen35 Tiny");
}

#[test]
fn a_refused_request_prints_the_api_error() {
    let output = prism(&["decide", example("refused-request.json").to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let body: Value = serde_json::from_slice(&output.stdout).expect("stdout is the error JSON");
    assert!(
        body["error"].as_str().unwrap().contains("criteria"),
        "{body}"
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("HTTP 422"));
}

#[test]
fn model_dir_without_gguf_is_refused() {
    let output = prism(&[
        "decide",
        example("request.json").to_str().unwrap(),
        "--model-dir",
        "/tmp",
    ]);
    assert_eq!(output.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&output.stderr).contains("--model-dir needs --gguf"));
}

/// Images through `prism decide`: the vision fixture's tower (found in --model-dir, or named by
/// --mmproj) answers a request with an image, its 64 tokens counted; the bundled text-only model
/// refuses it (422, exit status 1).
#[test]
fn reads_images_with_a_vision_tower() {
    let vl = repo("tests/fixtures/qwen35-vl-tiny");
    let image = std::fs::read(vl.join("images/square_256x256.png")).expect("fixture image");
    let request = serde_json::json!({
        "state": "The dock: <image>",
        "images": [base64::Engine::encode(&base64::engine::general_purpose::STANDARD, image)],
        "questions": {"busy": {"type": "noul", "instructions": "Is the dock in use?"}},
    });
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("decide_image.json");
    std::fs::write(&path, serde_json::to_vec(&request).unwrap()).unwrap();
    let (gguf, dir, mmproj) = (
        vl.join("tiny-vl-BF16.gguf"),
        vl.clone(),
        vl.join("mmproj-tiny-vl-F32.gguf"),
    );
    let common = [
        "decide",
        path.to_str().unwrap(),
        "--gguf",
        gguf.to_str().unwrap(),
        "--model-dir",
        dir.to_str().unwrap(),
    ];
    let mut bodies = Vec::new();
    for extra in [&[][..], &["--mmproj", mmproj.to_str().unwrap()][..]] {
        let output = prism(&[&common[..], extra].concat());
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let response: Value = serde_json::from_slice(&output.stdout).expect("response JSON");
        assert!(
            response["usage"]["input_tokens"].as_u64().unwrap() > 64,
            "{response}"
        );
        let noul = response["answers"]["busy"]["noul"].as_f64().unwrap();
        assert!(noul > 0.0 && noul < 1.0);
        bodies.push(response["answers"].clone());
    }
    assert_eq!(bodies[0], bodies[1]);
    let refused = prism(&["decide", path.to_str().unwrap()]);
    assert_eq!(refused.status.code(), Some(1));
    let body: Value = serde_json::from_slice(&refused.stdout).expect("error JSON");
    assert!(body.to_string().contains("vision"), "{body}");
}
