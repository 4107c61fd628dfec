//! The reader and the block formats against the qwen35-tiny fixtures (made by llama.cpp's converter and
//! `llama-quantize`; dequantization reference from PyPI `gguf` 0.19.0, which the fixture README reports
//! bit-identical to llama.cpp's own for all tensors).

use std::path::PathBuf;

use prism_gguf::{GgmlType, GgufFile, MetadataValue};
use serde_json::Value;

const FILES: [&str; 3] = ["tiny-BF16.gguf", "tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"];

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

fn load_json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture_dir().join(name)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Compares one metadata value with its tensors.json rendering (long arrays are `{array_len, first}`).
fn assert_value_matches(key: &str, ours: &MetadataValue, expected: &Value) {
    match expected {
        Value::Bool(b) => assert_eq!(ours.as_bool(), Some(*b), "{key}"),
        Value::String(s) => assert_eq!(ours.as_str(), Some(s.as_str()), "{key}"),
        Value::Number(n) if n.is_i64() || n.is_u64() => {
            assert!(
                !matches!(ours, MetadataValue::F32(_) | MetadataValue::F64(_)),
                "{key}: integer expected, got {}",
                ours.type_name()
            );
            assert_eq!(ours.as_i64(), n.as_i64(), "{key}");
        }
        Value::Number(n) => assert_eq!(ours.as_f64(), n.as_f64(), "{key}"),
        Value::Array(items) => {
            let ours = ours
                .as_array()
                .unwrap_or_else(|| panic!("{key}: array expected"));
            assert_eq!(ours.len(), items.len(), "{key}");
            for (o, e) in ours.iter().zip(items) {
                assert_value_matches(key, o, e);
            }
        }
        Value::Object(summary) => {
            let ours = ours
                .as_array()
                .unwrap_or_else(|| panic!("{key}: array expected"));
            assert_eq!(
                ours.len() as u64,
                summary["array_len"].as_u64().unwrap(),
                "{key}"
            );
            let first = summary["first"].as_array().unwrap();
            assert!(!first.is_empty());
            for (o, e) in ours.iter().zip(first) {
                assert_value_matches(key, o, e);
            }
        }
        Value::Null => panic!("{key}: null in tensors.json"),
    }
}

#[test]
fn header_metadata_and_tensor_table_match_tensors_json() {
    let reference = load_json("tensors.json");
    let files = reference["files"].as_array().unwrap();
    assert_eq!(files.len(), 3);
    for file_ref in files {
        let file_name = file_ref["file"].as_str().unwrap();
        let gguf = GgufFile::open(fixture_dir().join(file_name)).unwrap();
        assert_eq!(
            gguf.file_len(),
            file_ref["size_bytes"].as_u64().unwrap(),
            "{file_name}"
        );
        assert_eq!(
            u64::from(gguf.version()),
            file_ref["gguf_version"].as_u64().unwrap()
        );
        assert_eq!(gguf.alignment(), file_ref["alignment"].as_u64().unwrap());
        assert_eq!(gguf.architecture().unwrap(), "qwen35");

        // Metadata: same keys, same order, same values.
        let meta_ref = file_ref["metadata"].as_object().unwrap();
        let ours: Vec<&str> = gguf.metadata().iter().map(|(k, _)| k.as_str()).collect();
        let theirs: Vec<&str> = meta_ref.keys().map(String::as_str).collect();
        assert_eq!(ours, theirs, "{file_name}: metadata keys");
        for (key, expected) in meta_ref {
            assert_value_matches(key, gguf.get(key).unwrap(), expected);
        }

        // Tensors: same names in the same order, each with its type, shape, sizes and absolute offset.
        let tensors_ref = file_ref["tensors"].as_array().unwrap();
        assert_eq!(
            gguf.tensors().len() as u64,
            file_ref["n_tensors"].as_u64().unwrap()
        );
        assert_eq!(gguf.tensors().len(), tensors_ref.len());
        for (info, t) in gguf.tensors().iter().zip(tensors_ref) {
            let name = t["name"].as_str().unwrap();
            assert_eq!(info.name, name);
            assert_eq!(info.ggml_type.name(), t["type"].as_str().unwrap(), "{name}");
            let shape: Vec<u64> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap())
                .collect();
            assert_eq!(info.dims, shape, "{name}");
            assert_eq!(
                info.n_elements(),
                t["n_elements"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(info.n_bytes(), t["n_bytes"].as_u64().unwrap(), "{name}");
            assert_eq!(
                gguf.data_offset() + info.offset,
                t["data_offset"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(gguf.tensor_bytes(info).len() as u64, info.n_bytes());
            assert_eq!(gguf.tensor_info(name), Some(info));
        }
    }
}

/// Compensated f64 sum, so our summation order cannot matter at the 1e-9 level.
fn neumaier_sum(values: impl Iterator<Item = f64>) -> f64 {
    let (mut sum, mut comp) = (0.0f64, 0.0f64);
    for v in values {
        let t = sum + v;
        comp += if sum.abs() >= v.abs() {
            (sum - t) + v
        } else {
            (v - t) + sum
        };
        sum = t;
    }
    sum + comp
}

/// The reference prints the first values with `%.7g`; ours printed the same way must give the same number.
fn seven_significant(v: f32) -> f64 {
    format!("{:.6e}", f64::from(v)).parse().unwrap()
}

#[test]
fn every_tensor_dequantizes_like_the_reference() {
    let reference = load_json("ref_dequant.json");
    let mut checked = 0;
    for file_name in FILES {
        let gguf = GgufFile::open(fixture_dir().join(file_name)).unwrap();
        let entries = reference["files"][file_name].as_array().unwrap();
        assert_eq!(entries.len(), gguf.tensors().len());
        for e in entries {
            let name = e["name"].as_str().unwrap();
            let info = gguf.tensor_info(name).unwrap();
            assert_eq!(info.ggml_type.name(), e["type"].as_str().unwrap());
            let values = gguf.dequantize(name).unwrap();
            assert_eq!(
                values.len() as u64,
                e["n_elements"].as_u64().unwrap(),
                "{file_name} {name}"
            );

            let sum = neumaier_sum(values.iter().map(|&v| f64::from(v)));
            let sum_sq = neumaier_sum(values.iter().map(|&v| f64::from(v) * f64::from(v)));
            let (ref_sum, ref_sum_sq) = (e["sum"].as_f64().unwrap(), e["sum_sq"].as_f64().unwrap());
            assert!(
                (sum - ref_sum).abs() <= 1e-9 * ref_sum.abs().max(1e-300),
                "{file_name} {name}: sum {sum} vs {ref_sum}"
            );
            assert!(
                (sum_sq - ref_sum_sq).abs() <= 1e-9 * ref_sum_sq.abs(),
                "{file_name} {name}: sum_sq {sum_sq} vs {ref_sum_sq}"
            );

            let first = e["first8"].as_array().unwrap();
            assert_eq!(first.len(), values.len().min(8));
            for (i, (ours, theirs)) in values.iter().zip(first).enumerate() {
                assert_eq!(
                    seven_significant(*ours),
                    theirs.as_f64().unwrap(),
                    "{file_name} {name} [{i}]"
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 3 * 109);
}

#[test]
fn full_dequantized_arrays_are_bit_exact() {
    let cases = [
        ("Q8_0", "blk.0.ssm_alpha.weight", GgmlType::Q8_0),
        ("Q8_0", "blk.3.attn_k.weight", GgmlType::Q8_0),
        ("Q4_K_M", "blk.0.ssm_beta.weight", GgmlType::Q4_K),
        ("Q4_K_M", "blk.3.attn_v.weight", GgmlType::Q6_K),
    ];
    for (file_type, name, ty) in cases {
        let gguf = GgufFile::open(fixture_dir().join(format!("tiny-{file_type}.gguf"))).unwrap();
        assert_eq!(gguf.tensor_info(name).unwrap().ggml_type, ty);
        let raw =
            std::fs::read(fixture_dir().join(format!("dequant/{file_type}__{name}.f32"))).unwrap();
        let expected: Vec<u32> = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let ours: Vec<u32> = gguf
            .dequantize(name)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(ours.len(), expected.len(), "{file_type} {name}");
        let mismatches = ours.iter().zip(&expected).filter(|(a, b)| a != b).count();
        assert_eq!(
            mismatches, 0,
            "{file_type} {name}: {mismatches} values differ"
        );
    }
}

#[test]
fn typed_lookups_name_the_key() {
    let gguf = GgufFile::open(fixture_dir().join("tiny-Q8_0.gguf")).unwrap();
    assert_eq!(gguf.get_u64("qwen35.block_count").unwrap(), 8);
    assert_eq!(gguf.get_f64("qwen35.rope.freq_base").unwrap(), 1e7);
    assert!(!gguf.get_bool("tokenizer.ggml.add_bos_token").unwrap());
    assert_eq!(
        gguf.get_array("qwen35.rope.dimension_sections")
            .unwrap()
            .len(),
        4
    );
    let err = gguf.get_u64("qwen35.no_such_key").unwrap_err().to_string();
    assert!(
        err.contains("qwen35.no_such_key") && err.contains("missing"),
        "{err}"
    );
    let err = gguf.get_u64("general.name").unwrap_err().to_string();
    assert!(
        err.contains("general.name") && err.contains("string"),
        "{err}"
    );
    let err = gguf.dequantize("no.such.tensor").unwrap_err().to_string();
    assert!(err.contains("no.such.tensor"), "{err}");
}

#[test]
fn single_rows_match_the_whole_tensor() {
    let gguf = GgufFile::open(fixture_dir().join("tiny-Q4_K_M.gguf")).unwrap();
    for name in [
        "token_embd.weight",
        "output.weight",
        "blk.0.ssm_conv1d.weight",
    ] {
        let info = gguf.tensor_info(name).unwrap();
        let all = gguf.dequantize(name).unwrap();
        let row_len = info.row_len() as usize;
        for row in [0, 1, info.n_rows() - 1] {
            let start = row as usize * row_len;
            assert_eq!(
                gguf.dequantize_row(info, row).unwrap(),
                &all[start..start + row_len],
                "{name} row {row}"
            );
        }
        let err = gguf.dequantize_row(info, info.n_rows()).unwrap_err();
        assert!(
            matches!(err, prism_gguf::GgufError::RowOutOfRange { .. }),
            "{err}"
        );
    }
}

#[test]
fn the_file_handle_can_be_shared_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<GgufFile>();
    assert_send_sync::<prism_gguf::GgufError>();
}
