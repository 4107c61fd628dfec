//! Shared helpers of the model tests: fixture paths, reference JSON, models loaded once per test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::{DType, Tensor};
use prism_gguf::{GgufFile, GgufWriter, MetadataValue};
use prism_model::{BatchItem, LoadOptions, Precision, Qwen35Model, SequenceState};
use serde_json::Value;

/// libtest already runs tests on every core; rayon worker threads (candle's and our kernels') would spin
/// against them on a 2-core CI machine (a measured 5× slowdown). With a one-thread pool our kernels
/// compute on the calling thread. Results do not depend on it (`thread_count_does_not_change_results`).
pub fn single_threaded_matmuls() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| std::env::set_var("RAYON_NUM_THREADS", "1"));
}

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
    load_with(file, Precision::F32)
}

pub fn load_with(file: &str, precision: Precision) -> Qwen35Model {
    single_threaded_matmuls();
    let options = LoadOptions {
        hf_config: Some(fixture_dir().join("config.json")),
        precision,
        ..LoadOptions::default()
    };
    Qwen35Model::load(&fixture_dir().join(file), &options).unwrap_or_else(|e| panic!("{file}: {e}"))
}

pub fn bf16_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load("tiny-BF16.gguf"))
}

/// tiny-BF16.gguf computed entirely in f64: the ground truth for rounding questions.
pub fn f64_model() -> &'static Qwen35Model {
    static M: OnceLock<Qwen35Model> = OnceLock::new();
    M.get_or_init(|| load_with("tiny-BF16.gguf", Precision::F64))
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

/// Every element of an f32 tensor, flattened in row-major order.
pub fn flat_f32(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "length mismatch");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// max |t| over all elements, computed in f64.
pub fn max_abs(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// max |a − b| over all elements, computed in f64 (either input may be f32 or f64).
pub fn max_abs_diff_tensors(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    max_abs(&(a - b).unwrap())
}

/// The dtype and every element's bits: f64 elements as they are, any other dtype's converted to f32
/// (exact for the float types and bytes the tests compare). Equal results mean bit-identical tensors
/// of one dtype.
// The unit tests' `bits` in src/test_util.rs is the same walk; that module is built only under
// `cfg(test)` of the library, which these integration tests cannot reach.
pub fn bits(t: &Tensor) -> (DType, Vec<u64>) {
    let flat = t.flatten_all().unwrap();
    let bits = match flat.dtype() {
        DType::F64 => flat
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        _ => flat
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| u64::from(x.to_bits()))
            .collect(),
    };
    (t.dtype(), bits)
}

/// `tokens` through `model.forward` in pieces of `sizes` tokens, one after another on one state (the
/// sizes must add up to all the tokens): every position's hidden state, and the state left behind.
pub fn forward_in_pieces(
    model: &Qwen35Model,
    tokens: &[u32],
    sizes: &[usize],
) -> (Tensor, SequenceState) {
    let mut state = model.new_state().unwrap();
    let mut rows = Vec::new();
    let mut at = 0;
    for &n in sizes {
        let out = model
            .forward(&mut [BatchItem::new(&mut state, &tokens[at..at + n])])
            .unwrap();
        rows.push(out.hidden);
        at += n;
    }
    assert_eq!(at, tokens.len(), "the pieces cover all the tokens");
    (Tensor::cat(&rows, 0).unwrap(), state)
}

/// Copies tiny-BF16.gguf in memory, letting `edit_meta` change metadata, `added_meta` append keys and
/// `edit_tensor` rename, reshape (same bytes) or drop (None) tensors.
pub fn rewritten(
    edit_meta: impl Fn(&str, &MetadataValue) -> Option<MetadataValue>,
    added_meta: &[(&str, MetadataValue)],
    edit_tensor: impl Fn(&str, &[u64]) -> Option<Vec<u64>>,
) -> GgufFile {
    let src = GgufFile::open(fixture_dir().join("tiny-BF16.gguf")).unwrap();
    rewrite(&src, edit_meta, added_meta, edit_tensor)
}

/// `src` written again in memory: `edit_meta` changes (or drops, None) metadata, `added_meta` appends
/// keys and `edit_tensor` renames, reshapes (same bytes) or drops (None) tensors.
pub fn rewrite(
    src: &GgufFile,
    edit_meta: impl Fn(&str, &MetadataValue) -> Option<MetadataValue>,
    added_meta: &[(&str, MetadataValue)],
    edit_tensor: impl Fn(&str, &[u64]) -> Option<Vec<u64>>,
) -> GgufFile {
    let mut w = GgufWriter::new();
    for (key, value) in src.metadata() {
        if let Some(v) = edit_meta(key, value) {
            w.add_metadata(key.clone(), v).unwrap();
        }
    }
    for (key, value) in added_meta {
        w.add_metadata(*key, value.clone()).unwrap();
    }
    let mut kept = Vec::new();
    for info in src.tensors() {
        if let Some(dims) = edit_tensor(&info.name, &info.dims) {
            w.add_tensor(info.name.clone(), &dims, info.ggml_type)
                .unwrap();
            kept.push(info.clone());
        }
    }
    let mut data = w.write_header(Vec::new()).unwrap();
    for info in &kept {
        data.write_bytes(src.tensor_bytes(info)).unwrap();
    }
    GgufFile::from_bytes(data.finish().unwrap()).unwrap()
}
