//! Shared by the integer-path tests: the fixture models at int8 (tiny-Q8_0.gguf) and w4a8
//! (tiny-Q4_K_M.gguf), loaded once per test binary. Nothing is calibrated: activations are quantized
//! per row and run of 128 on each call.
#![allow(dead_code)]

use std::sync::OnceLock;

use prism_gguf::GgufFile;
use prism_model::{LoadOptions, Precision, Qwen35Model};
use prism_quant::Q8Scales;

use crate::common::{fixture_dir, single_threaded_matmuls};

pub fn options(precision: Precision) -> LoadOptions {
    LoadOptions {
        hf_config: Some(fixture_dir().join("config.json")),
        precision,
        ..LoadOptions::default()
    }
}

pub fn open(file: &str) -> GgufFile {
    GgufFile::open(fixture_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// `file` at `precision` with the given Q8_0 scale granularity.
pub fn load(file: &str, precision: Precision, q8_scales: Q8Scales) -> Qwen35Model {
    single_threaded_matmuls();
    Qwen35Model::from_gguf_with_q8_scales(&open(file), &options(precision), q8_scales)
        .unwrap_or_else(|e| panic!("{file} at {precision:?}: {e}"))
}

/// tiny-Q8_0.gguf at int8.
pub fn int8_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-Q8_0.gguf", Precision::Int8, Q8Scales::PerRun))
}

/// tiny-Q4_K_M.gguf at w4a8.
pub fn w4a8_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-Q4_K_M.gguf", Precision::W4a8, Q8Scales::PerRun))
}

/// The ids of the letters A–Z in the fixture tokenizer (single-byte tokens).
pub fn letter_ids() -> Vec<u32> {
    let tok = crate::common::read_json("tokenizer.json");
    ('A'..='Z')
        .map(|c| {
            tok["model"]["vocab"][c.to_string()]
                .as_u64()
                .expect("letter token") as u32
        })
        .collect()
}
