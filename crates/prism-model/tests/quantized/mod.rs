//! Shared by the integer-path tests: the fixture models at int8 (tiny-Q8_0.gguf) and w4a8
//! (tiny-Q4_K_M.gguf), calibrated once per test binary on the first 6 fixture prompts (prompts 6–11
//! stay held out for the accuracy numbers).
#![allow(dead_code)]

use std::sync::OnceLock;

use prism_gguf::GgufFile;
use prism_model::calibration::{calibrate, Calibration};
use prism_model::{LoadOptions, Precision, Qwen35Model};

use crate::common::{fixture_dir, prompts, single_threaded_matmuls};

pub const CALIBRATION_PROMPTS: usize = 6;

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

pub fn calibration_of(file: &str) -> Calibration {
    single_threaded_matmuls();
    let gguf = open(file);
    calibrate(
        &gguf,
        &options(Precision::Bf16),
        &prompts()[..CALIBRATION_PROMPTS],
        "fixture-prompts-0-5",
    )
    .unwrap_or_else(|e| panic!("calibrating {file}: {e}"))
}

fn load_calibrated(file: &str, precision: Precision, calibration: &Calibration) -> Qwen35Model {
    single_threaded_matmuls();
    Qwen35Model::from_gguf_calibrated(&open(file), &options(precision), calibration)
        .unwrap_or_else(|e| panic!("{file} at {precision:?}: {e}"))
}

pub fn q8_calibration() -> &'static Calibration {
    static C: OnceLock<Calibration> = OnceLock::new();
    C.get_or_init(|| calibration_of("tiny-Q8_0.gguf"))
}

pub fn q4_calibration() -> &'static Calibration {
    static C: OnceLock<Calibration> = OnceLock::new();
    C.get_or_init(|| calibration_of("tiny-Q4_K_M.gguf"))
}

/// tiny-Q8_0.gguf at int8.
pub fn int8_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load_calibrated("tiny-Q8_0.gguf", Precision::Int8, q8_calibration()))
}

/// tiny-Q4_K_M.gguf at w4a8.
pub fn w4a8_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load_calibrated("tiny-Q4_K_M.gguf", Precision::W4a8, q4_calibration()))
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
