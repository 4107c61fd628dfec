//! `prism gguf info` on the qwen35-tiny fixtures, checked against `tensors.json` (made from llama.cpp's
//! files by PyPI gguf), and on corrupt files.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

fn run_info(path: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_prism"))
        .args(["gguf", "info"])
        .arg(path)
        .output()
        .unwrap()
}

#[test]
fn info_lists_every_tensor_and_key_of_the_fixtures() {
    let text = std::fs::read_to_string(fixture_dir().join("tensors.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    for file_ref in reference["files"].as_array().unwrap() {
        let file_name = file_ref["file"].as_str().unwrap();
        let output = run_info(&fixture_dir().join(file_name));
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let stdout = String::from_utf8(output.stdout).unwrap();
        let lines: Vec<&str> = stdout.lines().collect();

        assert!(lines.contains(&"version:     3"), "{file_name}");
        assert!(lines.contains(&"alignment:   32"), "{file_name}");
        assert!(stdout.contains("ggml ne order"));

        // Every tensor: a row with its index, name, type, shape (ne order), element and byte counts.
        let tensors = file_ref["tensors"].as_array().unwrap();
        for (i, t) in tensors.iter().enumerate() {
            let name = t["name"].as_str().unwrap();
            let shape: Vec<String> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap().to_string())
                .collect();
            let expected_cells = [
                i.to_string(),
                name.to_string(),
                t["type"].as_str().unwrap().to_string(),
                format!("[{}]", shape.join(", ")),
                t["n_elements"].to_string(),
                t["n_bytes"].to_string(),
            ];
            let row = lines
                .iter()
                .find(|l| l.split_whitespace().nth(1) == Some(name))
                .unwrap_or_else(|| panic!("{file_name}: no row for {name}"));
            let mut rest: &str = row;
            for cell in &expected_cells {
                let at = rest
                    .find(cell.as_str())
                    .unwrap_or_else(|| panic!("{row:?} lacks {cell:?}"));
                rest = &rest[at + cell.len()..];
            }
        }
        let total_elements: u64 = tensors
            .iter()
            .map(|t| t["n_elements"].as_u64().unwrap())
            .sum();
        let total_bytes: u64 = tensors.iter().map(|t| t["n_bytes"].as_u64().unwrap()).sum();
        let total = format!("total: {} tensors", tensors.len());
        let total_line = lines
            .iter()
            .find(|l| l.starts_with(&total))
            .expect("a total line");
        assert!(
            total_line.contains(&format!("{total_elements} elements, {total_bytes} bytes")),
            "{total_line}"
        );

        // Every metadata key, with its value or its summary.
        for (key, value) in file_ref["metadata"].as_object().unwrap() {
            let line = lines
                .iter()
                .find(|l| l.split_whitespace().next() == Some(key.as_str()))
                .unwrap_or_else(|| panic!("{file_name}: no line for {key}"));
            match value {
                Value::String(s) if s.chars().count() > 64 => {
                    assert!(
                        line.contains(&format!("({} chars)", s.chars().count())),
                        "{line}"
                    )
                }
                Value::String(s) => assert!(line.contains(&format!("{s:?}")), "{line}"),
                Value::Object(summary) => {
                    assert!(
                        line.contains(&format!("[{} items: ", summary["array_len"])),
                        "{line}"
                    )
                }
                Value::Number(n) if n.is_u64() => {
                    assert!(line.ends_with(&format!("  {n}")), "{line}")
                }
                Value::Bool(b) => assert!(line.ends_with(&format!("  {b}")), "{line}"),
                _ => {}
            }
        }
        let sections = lines
            .iter()
            .find(|l| l.contains("qwen35.rope.dimension_sections"))
            .unwrap();
        assert_eq!(
            sections.split_whitespace().collect::<Vec<_>>(),
            [
                "qwen35.rope.dimension_sections",
                "array[i32]",
                "[3,",
                "3,",
                "2,",
                "0]"
            ]
        );
    }
}

#[test]
fn info_on_a_corrupt_file_fails_and_names_the_problem() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("prism-cli-gguf-info-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let original = std::fs::read(fixture_dir().join("tiny-Q8_0.gguf")).unwrap();

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, &original[..5000]).unwrap();
    let output = run_info(&truncated);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("truncated.gguf") && stderr.contains("truncated GGUF"),
        "{stderr}"
    );
    assert!(stderr.contains("tokenizer.ggml.tokens"), "{stderr}");

    let cut_data = dir.join("cut_data.gguf");
    std::fs::write(&cut_data, &original[..original.len() - 100]).unwrap();
    let output = run_info(&cut_data);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("outside the file"), "{stderr}");

    let not_gguf = dir.join("not.gguf");
    std::fs::write(&not_gguf, b"PK\x03\x04 this is a zip").unwrap();
    let output = run_info(&not_gguf);
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("not a GGUF file"));
    std::fs::remove_dir_all(&dir).unwrap();
}
