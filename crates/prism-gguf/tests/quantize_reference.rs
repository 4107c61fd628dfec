//! The quantizers against `llama-quantize`: the fixture's Q8_0 and Q4_K_M files were made from the BF16
//! file without an importance matrix, so requantizing each BF16 tensor must give the same bytes.

use std::path::PathBuf;

use prism_gguf::{quantize, GgmlType, GgufFile};

fn fixture(name: &str) -> GgufFile {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny");
    GgufFile::open(dir.join(name)).unwrap()
}

/// Requantizes every BF16 tensor that `quantized` stores as one of `types`; returns
/// (tensors compared, blocks compared, per-tensor mismatch report).
fn compare(quantized: &GgufFile, types: &[GgmlType]) -> (usize, usize, Vec<String>) {
    let source = fixture("tiny-BF16.gguf");
    let (mut tensors, mut blocks, mut report) = (0, 0, Vec::new());
    for info in quantized.tensors() {
        if !types.contains(&info.ggml_type) {
            continue;
        }
        let src = source.tensor_info(&info.name).unwrap();
        assert_eq!(src.ggml_type, GgmlType::BF16, "{}", info.name);
        assert_eq!(src.dims, info.dims);
        let values = source.dequantize(&info.name).unwrap();
        let ours = quantize::quantize(info.ggml_type, &values).unwrap();
        let theirs = quantized.tensor_bytes(info);
        assert_eq!(ours.len(), theirs.len(), "{}", info.name);
        let size = info.ggml_type.type_size();
        let differing_blocks = ours
            .chunks(size)
            .zip(theirs.chunks(size))
            .filter(|(a, b)| a != b)
            .count();
        let differing_bytes = ours.iter().zip(theirs).filter(|(a, b)| a != b).count();
        if differing_bytes > 0 {
            report.push(format!(
                "{} ({}): {differing_blocks}/{} blocks, {differing_bytes} bytes differ",
                info.name,
                info.ggml_type,
                theirs.len() / size
            ));
        }
        tensors += 1;
        blocks += theirs.len() / size;
    }
    (tensors, blocks, report)
}

#[test]
fn q8_0_requantization_is_byte_identical_to_llama_quantize() {
    let (tensors, blocks, report) = compare(&fixture("tiny-Q8_0.gguf"), &[GgmlType::Q8_0]);
    assert_eq!(tensors, 64);
    assert!(blocks > 200_000);
    assert!(report.is_empty(), "{report:#?}");
}

#[test]
fn q4_k_and_q6_k_requantization_is_byte_identical_to_llama_quantize() {
    let (tensors, blocks, report) = compare(
        &fixture("tiny-Q4_K_M.gguf"),
        &[GgmlType::Q4_K, GgmlType::Q6_K],
    );
    assert_eq!(tensors, 55 + 9);
    assert!(blocks > 20_000);
    assert!(report.is_empty(), "{report:#?}");
}
