//! The integer path's accuracy on the fixtures (numbers in docs/correctness.md):
//! - whole last-position logits of the 12 prompts against transformers fp32 run on the same
//!   dequantized weights (`ref_transformers_dequant_*.json`): what int8 activations cost, next to what
//!   llama.cpp's 8-bit activations cost on the same prompts (fixture README; recomputed from
//!   `ref_llamacpp_*.json`: Q8_0 max 0.843 / mean 0.129, Q4_K_M 1.355 / 0.201);
//! - the read-out's letter probabilities (softmax over A–Z) against our f32 path on the same file.
//!
//! Calibrated on prompts 0–5; prompts 6–11 are held out and reported separately.

mod common;
mod quantized;

use common::{floats, prompts, q4_model, q8_model, read_json, to_vec2};
use std::sync::Arc;

use prism_model::calibration::{
    cache_path, load_or_calibrate, model_key, recording_model, Calibration, RangeRecorder,
};
use prism_model::{BatchItem, ModelError, Precision, Qwen35Model};
use quantized::{
    int8_model, letter_ids, open, options, q4_calibration, q8_calibration, w4a8_model,
    CALIBRATION_PROMPTS,
};

struct Stats {
    max: f32,
    mean: f32,
    held_out_max: f32,
    held_out_mean: f32,
    argmax_agree: usize,
}

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

fn last_logits(model: &Qwen35Model) -> Vec<Vec<f32>> {
    let refs: Vec<&[u32]> = prompts().iter().map(|p| p.as_slice()).collect();
    let hidden = model.last_hidden(&refs).unwrap();
    to_vec2(&model.logits(&hidden).unwrap())
}

fn against_reference(got: &[Vec<f32>], reference: &str) -> Stats {
    let reference = read_json(reference);
    let entries = reference["prompts"].as_array().unwrap();
    let (mut all, mut held) = (Vec::new(), Vec::new());
    let mut argmax_agree = 0;
    for (i, (g, entry)) in got.iter().zip(entries).enumerate() {
        let want = floats(&entry["logits"]);
        let d: Vec<f32> = g.iter().zip(&want).map(|(a, b)| (a - b).abs()).collect();
        if i >= CALIBRATION_PROMPTS {
            held.extend_from_slice(&d);
        }
        all.extend(d);
        argmax_agree += usize::from(argmax(g) == argmax(&want));
    }
    let max = |v: &[f32]| v.iter().copied().fold(0.0, f32::max);
    let mean = |v: &[f32]| v.iter().map(|&x| f64::from(x)).sum::<f64>() as f32 / v.len() as f32;
    Stats {
        max: max(&all),
        mean: mean(&all),
        held_out_max: max(&held),
        held_out_mean: mean(&held),
        argmax_agree,
    }
}

fn letter_probs(logits: &[f32], letters: &[u32]) -> Vec<f64> {
    let l: Vec<f64> = letters
        .iter()
        .map(|&i| f64::from(logits[i as usize]))
        .collect();
    let m = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = l.iter().map(|x| (x - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.iter().map(|x| x / s).collect()
}

/// Max |Δp| over the 26 letters of all prompts, and how many prompts pick the same letter.
fn letter_drift(got: &[Vec<f32>], want: &[Vec<f32>]) -> (f64, usize) {
    let letters = letter_ids();
    let (mut drift, mut agree) = (0f64, 0);
    for (g, w) in got.iter().zip(want) {
        let (pg, pw) = (letter_probs(g, &letters), letter_probs(w, &letters));
        drift = pg
            .iter()
            .zip(&pw)
            .map(|(a, b)| (a - b).abs())
            .fold(drift, f64::max);
        let best = |p: &[f64]| {
            p.iter()
                .enumerate()
                .fold((0, -1.0), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
                .0
        };
        agree += usize::from(best(&pg) == best(&pw));
    }
    (drift, agree)
}

fn report(name: &str, s: &Stats, drift: (f64, usize)) {
    println!(
        "{name}: max |Δ| {:.3} mean {:.3} (held-out prompts: {:.3} / {:.3}), argmax {}/12; \
         letter probabilities vs f32: max |Δp| {:.4}, same letter {}/12",
        s.max, s.mean, s.held_out_max, s.held_out_mean, s.argmax_agree, drift.0, drift.1
    );
}

#[test]
fn int8_on_q8_0_against_transformers_with_the_same_weights() {
    let got = last_logits(int8_model());
    let s = against_reference(&got, "ref_transformers_dequant_Q8_0.json");
    let drift = letter_drift(&got, &last_logits(q8_model()));
    report("int8 / tiny-Q8_0.gguf", &s, drift);
    // Measured: max 2.23, mean 0.313 (held out 2.23 / 0.349), argmax 11/12, letters 0.039 and 12/12;
    // with the largest |x| as the range (calibration version 1) it was 2.71 / 0.423, which the mean
    // bound rejects. llama.cpp's per-block dynamic 8-bit activations: 0.843 / 0.129 (see
    // examples/int8_schemes.rs in prism-decision for finer formats). Bounds leave ~25 % for rounding
    // changes elsewhere in the f32 path, which move individual int8 roundings.
    assert!(
        s.max < 3.0 && s.mean < 0.40,
        "logits: max {} mean {}",
        s.max,
        s.mean
    );
    assert!(s.held_out_mean < 0.45, "held-out mean {}", s.held_out_mean);
    assert!(s.argmax_agree >= 8, "argmax {}/12", s.argmax_agree);
    assert!(drift.0 < 0.1 && drift.1 == 12, "letters: {drift:?}");
}

#[test]
fn w4a8_on_q4_k_m_against_transformers_with_the_same_weights() {
    let got = last_logits(w4a8_model());
    let s = against_reference(&got, "ref_transformers_dequant_Q4_K_M.json");
    let drift = letter_drift(&got, &last_logits(q4_model()));
    report("w4a8 / tiny-Q4_K_M.gguf", &s, drift);
    // Measured: max 2.39, mean 0.389 (held out 2.39 / 0.388), argmax 10/12, letters 0.033 and 12/12;
    // calibration version 1 (largest |x|): 3.15 / 0.462. llama.cpp: 1.355 / 0.201 against the same
    // reference.
    assert!(
        s.max < 3.4 && s.mean < 0.47,
        "logits: max {} mean {}",
        s.max,
        s.mean
    );
    assert!(s.held_out_mean < 0.5, "held-out mean {}", s.held_out_mean);
    assert!(s.argmax_agree >= 6, "argmax {}/12", s.argmax_agree);
    assert!(drift.0 < 0.08 && drift.1 == 12, "letters: {drift:?}");
}

#[test]
fn auto_precision_follows_the_file() {
    for (file, want) in [
        ("tiny-Q8_0.gguf", Precision::Int8),
        ("tiny-Q4_K_M.gguf", Precision::W4a8),
        ("tiny-BF16.gguf", Precision::Bf16),
    ] {
        assert_eq!(
            Precision::resolve("auto", &open(file)).unwrap(),
            want,
            "{file}"
        );
    }
    let gguf = open("tiny-Q8_0.gguf");
    assert_eq!(Precision::resolve("w4a8", &gguf).unwrap(), Precision::W4a8);
    assert!(matches!(
        Precision::resolve("int4", &gguf),
        Err(ModelError::UnsupportedPrecision(_))
    ));
}

#[test]
fn the_integer_path_refuses_what_it_cannot_run() {
    let q8 = open("tiny-Q8_0.gguf");
    let q4 = open("tiny-Q4_K_M.gguf");
    // No calibration.
    let err = Qwen35Model::from_gguf(&q8, &options(Precision::Int8)).unwrap_err();
    assert!(matches!(err, ModelError::Calibration(_)), "{err}");
    // int8 on K-quant weights: names the tensor.
    let err = Qwen35Model::from_gguf_calibrated(&q4, &options(Precision::Int8), q4_calibration())
        .unwrap_err();
    match err {
        ModelError::PrecisionMismatch { name, reason, .. } => {
            assert!(
                name == "output.weight" && reason.contains("w4a8"),
                "{name}: {reason}"
            )
        }
        other => panic!("expected PrecisionMismatch, got {other}"),
    }
    // Ranges measured on another file.
    let err = Qwen35Model::from_gguf_calibrated(&q4, &options(Precision::W4a8), q8_calibration())
        .unwrap_err();
    assert!(err.to_string().contains("another model file"), "{err}");
    // A projection without a range.
    let mut partial = q8_calibration().clone();
    partial.ranges.remove("blk.3.attn_v.weight");
    let err =
        Qwen35Model::from_gguf_calibrated(&q8, &options(Precision::Int8), &partial).unwrap_err();
    assert!(err.to_string().contains("blk.3.attn_v.weight"), "{err}");
    // A zero range cannot make a scale.
    let mut zero = q8_calibration().clone();
    zero.ranges.insert("blk.0.ffn_up.weight".into(), 0.0);
    let err = Qwen35Model::from_gguf_calibrated(&q8, &options(Precision::Int8), &zero).unwrap_err();
    assert!(matches!(err, ModelError::Quant { ref name, .. } if name == "blk.0.ffn_up.weight"));
}

#[test]
fn calibration_covers_every_projection_and_is_cached_by_file() {
    let c = q8_calibration();
    // 6 DeltaNet layers × 5 + 2 attention layers × 4 + 8 MLPs × 3 + the head.
    assert_eq!(c.ranges.len(), 6 * 5 + 2 * 4 + 8 * 3 + 1);
    assert!(c.ranges.contains_key("output.weight"));
    assert!(c.ranges.values().all(|&r| r.is_finite() && r > 0.0));
    // Projections reading the same input saw the same range.
    assert_eq!(
        c.ranges["blk.3.attn_q.weight"],
        c.ranges["blk.3.attn_k.weight"]
    );
    assert_eq!(
        c.ranges["blk.0.ffn_gate.weight"],
        c.ranges["blk.0.ffn_up.weight"]
    );
    assert_eq!(
        (c.n_prompts, c.n_tokens),
        (6, prompts()[..6].iter().map(Vec::len).sum())
    );

    let q8 = open("tiny-Q8_0.gguf");
    let q4 = open("tiny-Q4_K_M.gguf");
    assert_ne!(model_key(&q8), model_key(&q4));
    assert_eq!(model_key(&q8), model_key(&open("tiny-Q8_0.gguf")));

    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("int8-calibration-cache");
    let _ = std::fs::remove_dir_all(&dir);
    let few = &prompts()[..2];
    let first = load_or_calibrate(&q8, &options(Precision::Bf16), few, "two", Some(&dir)).unwrap();
    // The stored ranges are the smallest-error ranges of the recorded inputs, never above their
    // largest |x|, and well below it for the heavy-tailed inputs (DeltaNet out, MLP down).
    let recorder = Arc::new(RangeRecorder::default());
    let model = recording_model(&q8, &options(Precision::Bf16), recorder.clone()).unwrap();
    for prompt in few {
        let mut state = model.new_state().unwrap();
        let out = model
            .forward(&mut [BatchItem::new(&mut state, prompt)])
            .unwrap();
        model.logits_for_rows(&out.hidden, &[0]).unwrap();
    }
    assert_eq!(first.ranges, recorder.mse_ranges());
    let absmax = recorder.ranges();
    let mut heavy = Vec::new();
    for (name, range) in &first.ranges {
        assert!(
            *range > 0.0 && *range <= absmax[name],
            "{name}: {range} of {}",
            absmax[name]
        );
        if name.contains("ssm_out") || name.contains("ffn_down") {
            heavy.push(range / absmax[name]);
        }
    }
    let mean_ratio = heavy.iter().sum::<f32>() / heavy.len() as f32;
    assert!(
        heavy.len() == 14 && heavy.iter().all(|&r| r < 0.95) && mean_ratio < 0.9,
        "range / largest |x| of the DeltaNet out and MLP down inputs: {heavy:?}"
    );
    let path = cache_path(&dir, &model_key(&q8), "two");
    assert!(path.is_file(), "{}", path.display());
    assert_eq!(Calibration::load(&path).unwrap(), first);
    // A second load reads the file: prove it by planting a different (valid) range there.
    let mut planted = first.clone();
    planted.ranges.insert("output.weight".into(), 123.0);
    planted.save(&path).unwrap();
    let second = load_or_calibrate(&q8, &options(Precision::Bf16), few, "two", Some(&dir)).unwrap();
    assert_eq!(second.ranges["output.weight"], 123.0);
    // Another prompt set or another file: its own entry.
    let other =
        load_or_calibrate(&q8, &options(Precision::Bf16), few, "other", Some(&dir)).unwrap();
    assert_eq!(other.ranges, first.ranges);
    assert!(cache_path(&dir, &model_key(&q8), "other").is_file());
    // A corrupt file is ignored and rewritten.
    std::fs::write(&path, "{ not json").unwrap();
    let again = load_or_calibrate(&q8, &options(Precision::Bf16), few, "two", Some(&dir)).unwrap();
    assert_eq!(again, first);
}
