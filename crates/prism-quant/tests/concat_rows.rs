//! `QuantWeight::concat_rows` (a layer's projections that share an input, run as one GEMM): on the
//! fixture files' own Q8_0, Q4_K and Q6_K tensors, the fused product's columns are bit for bit the
//! parts' separate products (the activation scales come from the shared input alone), the fused weight
//! dequantizes to the parts' own dequantization, and mismatched parts are typed errors naming both tensors.

use std::path::PathBuf;

use prism_gguf::GgufFile;
use prism_quant::{matmul, QuantError, QuantWeight, WeightFormat};

fn fixture(file: &str) -> GgufFile {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen35-tiny")
        .join(file);
    GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Tensor `name` of `gguf` as a `QuantWeight` (rows = GGUF dims[1]).
fn weight(gguf: &GgufFile, name: &str) -> QuantWeight {
    let info = gguf
        .tensor_info(name)
        .unwrap_or_else(|| panic!("{name} missing"));
    let (cols, rows) = (info.dims[0] as usize, info.dims[1] as usize);
    QuantWeight::from_gguf(name, info.ggml_type, gguf.tensor_bytes(info), rows, cols).unwrap()
}

/// Deterministic activations with a few outliers (splitmix64).
fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    (0..m * k)
        .map(|i| {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            if i % 211 == 0 {
                8.0 * u
            } else {
                u
            }
        })
        .collect()
}

/// Fuses `names` of `file`, checks the format, then compares the fused product with each part's own
/// product, bit for bit, for several batch sizes; and the dequantization row by row.
fn assert_fused_equals_separate(file: &str, names: &[&str], format: WeightFormat) {
    let gguf = fixture(file);
    let parts: Vec<QuantWeight> = names.iter().map(|n| weight(&gguf, n)).collect();
    assert!(
        parts.iter().all(|p| p.format() == format),
        "{file}: {names:?} are not all {format:?}"
    );
    let refs: Vec<&QuantWeight> = parts.iter().collect();
    let fused = QuantWeight::concat_rows(&refs).unwrap();
    let total: usize = parts.iter().map(QuantWeight::rows).sum();
    assert_eq!(
        (fused.rows(), fused.cols(), fused.format()),
        (total, parts[0].cols(), format)
    );
    assert_eq!(fused.name(), names.join("+"));

    let k = fused.cols();
    for m in [1, 3, 17] {
        let x = activations(m, k, 7 + m as u64);
        let y = matmul(&x, m, &fused).unwrap();
        let mut offset = 0;
        for part in &parts {
            let yp = matmul(&x, m, part).unwrap();
            let n = part.rows();
            for r in 0..m {
                let got: Vec<u32> = y[r * total + offset..r * total + offset + n]
                    .iter()
                    .map(|v| v.to_bits())
                    .collect();
                let want: Vec<u32> = yp[r * n..(r + 1) * n].iter().map(|v| v.to_bits()).collect();
                assert_eq!(
                    got,
                    want,
                    "{file}: {} in the fused product, M = {m}, row {r}",
                    part.name()
                );
            }
            offset += n;
        }
    }
    let mut row = 0;
    for part in &parts {
        for n in 0..part.rows() {
            assert_eq!(
                fused.dequantize_row(row).unwrap(),
                part.dequantize_row(n).unwrap(),
                "{file}: fused row {row} ({} row {n})",
                part.name()
            );
            row += 1;
        }
    }
}

#[test]
fn fused_q8_0_columns_equal_the_separate_products_bit_for_bit() {
    // The DeltaNet input projections (qkv 512, z 256, beta 4, alpha 4 rows) and the MLP's gate|up.
    assert_fused_equals_separate(
        "tiny-Q8_0.gguf",
        &[
            "blk.0.attn_qkv.weight",
            "blk.0.attn_gate.weight",
            "blk.0.ssm_beta.weight",
            "blk.0.ssm_alpha.weight",
        ],
        WeightFormat::Q8_0,
    );
    assert_fused_equals_separate(
        "tiny-Q8_0.gguf",
        &["blk.3.ffn_gate.weight", "blk.3.ffn_up.weight"],
        WeightFormat::Q8_0,
    );
}

#[test]
fn fused_k_quant_columns_equal_the_separate_products_bit_for_bit() {
    // llama-quantize's Q4_K_M mix: layer 1's DeltaNet projections are all Q4_K; layer 3's attention
    // q and k are Q4_K (its v is Q6_K and stays apart); layers 0 and 6 have Q6_K attn_qkv.
    assert_fused_equals_separate(
        "tiny-Q4_K_M.gguf",
        &[
            "blk.1.attn_qkv.weight",
            "blk.1.attn_gate.weight",
            "blk.1.ssm_beta.weight",
            "blk.1.ssm_alpha.weight",
        ],
        WeightFormat::Q4K,
    );
    assert_fused_equals_separate(
        "tiny-Q4_K_M.gguf",
        &["blk.3.attn_q.weight", "blk.3.attn_k.weight"],
        WeightFormat::Q4K,
    );
    assert_fused_equals_separate(
        "tiny-Q4_K_M.gguf",
        &["blk.0.attn_qkv.weight", "blk.6.attn_qkv.weight"],
        WeightFormat::Q6K,
    );
}

/// The error of `concat_rows` over the tensors `names` of `gguf` (in that order), after checking that
/// they have the formats `formats`.
fn concat_error(gguf: &GgufFile, names: [&str; 2], formats: [WeightFormat; 2]) -> QuantError {
    let parts = names.map(|n| weight(gguf, n));
    assert_eq!(parts.each_ref().map(|w| w.format()), formats, "{names:?}");
    QuantWeight::concat_rows(&[&parts[0], &parts[1]]).unwrap_err()
}

#[test]
fn mismatched_parts_are_typed_errors_naming_both_tensors() {
    let gguf = fixture("tiny-Q4_K_M.gguf");
    let err = concat_error(
        &gguf,
        ["blk.0.attn_gate.weight", "blk.0.attn_qkv.weight"],
        [WeightFormat::Q4K, WeightFormat::Q6K],
    );
    assert!(
        matches!(&err, QuantError::ConcatFormat { first, other, first_format: WeightFormat::Q4K, other_format: WeightFormat::Q6K }
            if first == "blk.0.attn_gate.weight" && other == "blk.0.attn_qkv.weight"),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("blk.0.attn_gate.weight") && msg.contains("blk.0.attn_qkv.weight"),
        "{msg}"
    );

    // ffn_down reads the 512-wide MLP activation, ffn_up the 256-wide hidden state.
    let err = concat_error(
        &gguf,
        ["blk.1.ffn_up.weight", "blk.1.ffn_down.weight"],
        [WeightFormat::Q4K, WeightFormat::Q4K],
    );
    assert!(
        matches!(&err, QuantError::ConcatCols { first, other, first_cols: 256, other_cols: 512 }
            if first == "blk.1.ffn_up.weight" && other == "blk.1.ffn_down.weight"),
        "{err:?}"
    );

    assert!(matches!(
        QuantWeight::concat_rows(&[]),
        Err(QuantError::ConcatEmpty)
    ));
    // One part: the same weight.
    let up = weight(&gguf, "blk.1.ffn_up.weight");
    assert_eq!(QuantWeight::concat_rows(&[&up]).unwrap(), up);
}
