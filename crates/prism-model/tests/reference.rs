//! The f32 path against transformers' fp32 reference logits (fixture README: an exact f32 engine lands
//! near 3e-5; the acceptance bound is 1e-3 max |Δ| over whole logit vectors).

mod common;

use common::*;
use prism_model::Qwen35Model;

const TOLERANCE: f32 = 1e-3;

/// Runs all 12 prompts as one batch and returns max |Δ| per prompt against `reference`.
fn check_all_prompts(model: &Qwen35Model, reference: &str) -> Vec<f32> {
    let reference = read_json(reference);
    let prompts = prompts();
    let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let hidden = model.last_hidden(&refs).unwrap();
    let logits = to_vec2(&model.logits(&hidden).unwrap());
    let entries = reference["prompts"].as_array().unwrap();
    assert_eq!(entries.len(), prompts.len());
    let mut deltas = Vec::new();
    for (i, entry) in entries.iter().enumerate() {
        assert_eq!(entry["index"].as_u64(), Some(i as u64));
        assert_eq!(entry["n_tokens"].as_u64(), Some(prompts[i].len() as u64));
        let want = floats(&entry["logits"]);
        let d = max_abs_diff(&logits[i], &want);
        deltas.push(d);
    }
    deltas
}

fn report(name: &str, deltas: &[f32]) {
    let max = deltas.iter().copied().fold(0.0, f32::max);
    eprintln!("{name}: max |Δ| per prompt {deltas:?}; overall {max:.3e}");
    assert!(max < TOLERANCE, "{name}: max |Δ| {max} ≥ {TOLERANCE}");
}

#[test]
fn bf16_gguf_matches_transformers_fp32() {
    report(
        "tiny-BF16.gguf vs ref_transformers.json",
        &check_all_prompts(bf16_model(), "ref_transformers.json"),
    );
}

#[test]
fn q8_0_gguf_matches_transformers_with_dequantized_weights() {
    report(
        "tiny-Q8_0.gguf vs ref_transformers_dequant_Q8_0.json",
        &check_all_prompts(q8_model(), "ref_transformers_dequant_Q8_0.json"),
    );
}

#[test]
fn q4_k_m_gguf_matches_transformers_with_dequantized_weights() {
    report(
        "tiny-Q4_K_M.gguf vs ref_transformers_dequant_Q4_K_M.json",
        &check_all_prompts(q4_model(), "ref_transformers_dequant_Q4_K_M.json"),
    );
}
