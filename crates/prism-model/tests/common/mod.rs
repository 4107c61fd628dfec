//! Shared helpers of the model tests: fixture paths, reference JSON, models loaded once per test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::Tensor;
use prism_model::{LoadOptions, Qwen35Model};
use serde_json::Value;

pub fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen35-tiny")
}

pub fn read_json(name: &str) -> Value {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("float array")
        .iter()
        .map(|x| x.as_f64().expect("float") as f32)
        .collect()
}

/// The 12 prompts of prompts.json, as token ids.
pub fn prompts() -> &'static Vec<Vec<u32>> {
    static P: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    P.get_or_init(|| {
        read_json("prompts.json")["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| ids(&p["ids"]))
            .collect()
    })
}

fn load(file: &str) -> Qwen35Model {
    let options = LoadOptions {
        hf_config: Some(fixture_dir().join("config.json")),
        ..LoadOptions::default()
    };
    Qwen35Model::load(&fixture_dir().join(file), &options).unwrap_or_else(|e| panic!("{file}: {e}"))
}

pub fn bf16_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-BF16.gguf"))
}

pub fn q8_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-Q8_0.gguf"))
}

pub fn q4_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-Q4_K_M.gguf"))
}

pub fn to_vec2(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn max_abs_diff_tensors(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let b = b.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    max_abs_diff(&a, &b)
}
