//! `prism render` on the sample requests in `examples/`.

mod common;

use std::path::PathBuf;
use std::process::Output;

use common::{example, run_prism};

fn prism(args: &[&str]) -> Output {
    run_prism(args, &[])
}

const EVIDENCE: &str = "Evidence:\n{\"ticket\": \"I was charged twice for my March invoice and now the app says my card is \
declined. Please fix this today!\", \"customer\": {\"plan\": \"pro\", \"since\": \"2021-04-02\", \"seats\": 12}, \
\"last_payments\": [{\"_index\": 0, \"value\": 49.0}, {\"_index\": 1, \"value\": 49.0}, {\"_index\": 2, \"value\": 49.0}, \
{\"_index\": 3, \"value\": 49.0}, {\"_index\": 4, \"value\": 49.0}, {\"_index\": 5, \"value\": 49.0}, \
{\"_index\": 6, \"value\": 98.0}, {\"_index\": 7, \"value\": 49.0}]}\n\n";

#[test]
fn renders_a_three_question_request_as_json() {
    let request = example("request.json");
    let output = prism(&["render", request.to_str().unwrap(), "--json"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let keys: Vec<&String> = json.as_object().unwrap().keys().collect();
    assert_eq!(keys, ["team", "urgent", "mood"]);
    let system = "Apply the criterion to the evidence. Choose exactly one listed option. Answer with its letter only.";
    let expected = [
        (
            "team",
            "choice",
            "Question: Which team should handle this ticket?\nOptions:\nA) billing: Payments, invoices and refunds\n\
             B) technical: Bugs, errors and outages\nC) sales: Plans, upgrades and quotes",
            vec!["billing", "technical", "sales"],
        ),
        (
            "urgent",
            "noul",
            "Question: Does this ticket need a reply today?\nOptions:\nA) yes\nB) no",
            vec!["true", "false"],
        ),
        (
            "mood",
            "score",
            "Question: How upset is the customer?\nOptions:\nA) 0: calm\nB) 1: annoyed\nC) 2: angry",
            vec!["0", "1", "2"],
        ),
    ];
    for (name, kind, tail, order) in expected {
        let question = &json[name];
        assert_eq!(question["type"], kind);
        assert_eq!(question["mode"], "single");
        let prompts = question["prompts"].as_array().unwrap();
        assert_eq!(prompts.len(), 1);
        assert_eq!(prompts[0]["system"], system);
        assert_eq!(prompts[0]["user"], format!("{EVIDENCE}{tail}"), "{name}");
        assert_eq!(prompts[0]["order"], serde_json::json!(order), "{name}");
    }
}

#[test]
fn renders_text() {
    let request = example("request.json");
    let output = prism(&["render", request.to_str().unwrap()]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    assert!(
        text.starts_with("=== team (choice)\n--- system\nApply the criterion"),
        "{text}"
    );
    assert!(
        text.contains("\nA) yes\nB) no\n--- options in letter order: true, false\n"),
        "{text}"
    );
    assert!(text.contains("=== mood (score)"), "{text}");
}

#[test]
fn a_refused_request_prints_the_api_error_and_fails() {
    let request = example("refused-request.json");
    let output = prism(&["render", request.to_str().unwrap(), "--json"]);
    assert_eq!(output.status.code(), Some(1));
    let json: serde_json::Value =
        serde_json::from_slice(&output.stdout).expect("stdout is the error JSON");
    assert_eq!(
        json["detail"][0]["loc"],
        serde_json::json!(["body", "questions", "rating", "criteria"])
    );
    assert_eq!(json["detail"][0]["type"], "too_many_levels");
    assert!(json["error"]
        .as_str()
        .unwrap()
        .starts_with("questions.rating.criteria: "));
    assert!(String::from_utf8_lossy(&output.stderr).contains("HTTP 422"));
}

#[test]
fn with_a_model_dir_shows_the_chat_templated_text_and_its_tokens() {
    let request = example("request.json");
    let model_dir =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
    let output = prism(&[
        "render",
        request.to_str().unwrap(),
        "--json",
        "--model-dir",
        model_dir.to_str().unwrap(),
    ]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    for (name, question) in json.as_object().unwrap() {
        let prompt = &question["prompts"][0];
        let text = prompt["text"].as_str().unwrap();
        let system = prompt["system"].as_str().unwrap();
        let user = prompt["user"].as_str().unwrap();
        // The Qwen3.5 chat template with thinking off, around the two messages.
        assert_eq!(
            text,
            format!(
                "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n\
                 <|im_start|>assistant\n<think>\n\n</think>\n\n"
            ),
            "{name}"
        );
        // (prism-gguf's fixture_reference reads its shapes the same way: another crate's tests.)
        let ids: Vec<u64> = prompt["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(prompt["n_tokens"].as_u64(), Some(ids.len() as u64));
        // <|im_start|> is id 4097 in the tiny vocabulary; the prompt ends in "\n\n" after </think> (4121).
        assert_eq!(ids[0], 4097, "{name}");
        assert!(
            ids[ids.len() - 2..].contains(&4121),
            "{name}: {:?}",
            &ids[ids.len() - 3..]
        );
    }

    // Text mode prints the same ids.
    let text = prism(&[
        "render",
        request.to_str().unwrap(),
        "--model-dir",
        model_dir.to_str().unwrap(),
    ]);
    assert!(text.status.success());
    let stdout = String::from_utf8_lossy(&text.stdout);
    assert!(
        stdout.contains("--- chat template (thinking off)\n<|im_start|>system\n"),
        "{stdout}"
    );
    assert_eq!(stdout.matches(" token ids\n[4097, ").count(), 3, "{stdout}");
}

#[test]
fn a_model_dir_without_a_tokenizer_is_an_error() {
    let request = example("request.json");
    let output = prism(&[
        "render",
        request.to_str().unwrap(),
        "--model-dir",
        "/nonexistent",
    ]);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("/nonexistent"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn a_missing_file_is_an_error() {
    let output = prism(&["render", "/nonexistent/request.json"]);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("/nonexistent/request.json"));
}

fn vision_fixture() -> PathBuf {
    common::repo("tests/fixtures/qwen35-vl-tiny")
}

/// The vision fixture's image `name` (`square`, `frame0`, ...) as base64. (prism-decision's
/// `vision_engine.rs` looks the files up the same way: two crates' tests share no module.)
fn fixture_image(name: &str) -> String {
    use base64::Engine as _;
    let dir = vision_fixture().join("images");
    let path = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with(&format!("{name}_"))
        })
        .unwrap_or_else(|| panic!("no image {name}"));
    base64::engine::general_purpose::STANDARD.encode(std::fs::read(path).unwrap())
}

/// Each reference prompt with images of the vision fixture (transformers' processor: one and several
/// images, first and placed by marks), sent as a request: `prism render --json` gives its token ids,
/// each image's pad expanded, and where each image goes.
#[test]
fn renders_requests_with_images_as_the_processor_tokenizes_them() {
    let refs: serde_json::Value =
        serde_json::from_slice(&std::fs::read(vision_fixture().join("ref_prompts.json")).unwrap())
            .unwrap();
    let dir = std::env::temp_dir().join(format!("prism-render-images-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut checked = 0;
    for p in refs["prompts"].as_array().unwrap() {
        let names: Vec<&str> = p["images"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_str().unwrap())
            .collect();
        if names.is_empty() {
            continue;
        }
        let name = p["name"].as_str().unwrap();
        let content = p["messages"][1]["content"].as_array().unwrap();
        let text = content.last().unwrap()["text"].as_str().unwrap();
        let (instructions, options) = text
            .split("Question: ")
            .nth(1)
            .unwrap()
            .split_once("\nOptions:\n")
            .unwrap();
        let ids: Vec<&str> = options
            .lines()
            .map(|l| l.split_once(") ").unwrap().1)
            .collect();
        let body = serde_json::json!({
            "state": p["state"],
            "images": names.iter().map(|n| fixture_image(n)).collect::<Vec<_>>(),
            "questions": {"q": {"type": "choice", "instructions": instructions, "criteria": ids}},
        });
        let file = dir.join(format!("{name}.json"));
        std::fs::write(&file, body.to_string()).unwrap();
        let output = prism(&[
            "render",
            file.to_str().unwrap(),
            "--model-dir",
            vision_fixture().to_str().unwrap(),
            "--json",
        ]);
        assert!(
            output.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
        let prompt = &json["q"]["prompts"][0];
        assert_eq!(prompt["ids"], p["input_ids"], "{name}: token ids");
        let images = prompt["images"].as_array().unwrap();
        assert_eq!(images.len(), names.len(), "{name}: image slots");
        let pads: u64 = images.iter().map(|i| i["tokens"].as_u64().unwrap()).sum();
        let pad = 4108;
        let want = p["input_ids"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|&t| t == pad)
            .count() as u64;
        assert_eq!(pads, want, "{name}: pad tokens");
        checked += 1;
    }
    assert_eq!(checked, 6, "every reference prompt with images");
    // A bad image is the API's error, under its path.
    let bad = dir.join("bad.json");
    std::fs::write(
        &bad,
        serde_json::json!({
            "state": "two pictures",
            "images": [fixture_image("square"), "bm90IGFuIGltYWdl"],
            "questions": {"q": {"type": "noul", "instructions": "Is it sunny?"}},
        })
        .to_string(),
    )
    .unwrap();
    let output = prism(&["render", bad.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(1));
    let body = String::from_utf8_lossy(&output.stdout);
    assert!(body.contains("images[1]"), "{body}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("HTTP 400"));
    let _ = std::fs::remove_dir_all(&dir);
}
