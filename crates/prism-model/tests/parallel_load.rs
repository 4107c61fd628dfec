//! The decoder layers are loaded on several threads (`LoadOptions::load_threads`, default up to 8). These tests
//! load the fixture models with one thread (the layers one after another, as before) and with several,
//! and require the same bits in every weight and in the logits, and the same error for a broken file.

mod common;

use candle_core::{DType, Tensor};
use prism_gguf::GgufFile;
use prism_model::delta_net::DeltaNet;
use prism_model::linear::{FusedLinear, Linear};
use prism_model::qwen35::Mixer;
use prism_model::{BatchItem, LoadOptions, ModelError, Precision, Qwen35Model};

use common::{fixture_dir, prompts, single_threaded_matmuls};

fn open(file: &str) -> GgufFile {
    GgufFile::open(fixture_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

fn options(precision: Precision, threads: usize) -> LoadOptions {
    LoadOptions {
        precision,
        load_threads: Some(threads),
        ..LoadOptions::default()
    }
}

fn load(file: &str, precision: Precision, threads: usize) -> Qwen35Model {
    single_threaded_matmuls();
    let gguf = open(file);
    Qwen35Model::from_gguf(&gguf, &options(precision, threads))
        .unwrap_or_else(|e| panic!("{file} at {precision:?} with {threads} threads: {e}"))
}

/// Every element's bits (f32, bf16 and f64 all widen exactly to f64), with the dtype and shape.
fn bits(t: &Tensor) -> (DType, Vec<usize>, Vec<u64>) {
    let values = t
        .to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .unwrap();
    (
        t.dtype(),
        t.dims().to_vec(),
        values.iter().map(|v| v.to_bits()).collect(),
    )
}

fn assert_same_tensor(a: &Tensor, b: &Tensor, what: &str) {
    assert!(bits(a) == bits(b), "{what}: the loads differ");
}

fn assert_same_linear(a: &Linear, b: &Linear, what: &str) {
    match (a, b) {
        (Linear::Dense(a), Linear::Dense(b)) => assert_same_tensor(a, b, what),
        (Linear::Quant(a), Linear::Quant(b)) => {
            assert_eq!(a.weight(), b.weight(), "{what}: quantized weight");
        }
        _ => panic!("{what}: different kinds of projection"),
    }
}

fn assert_same_fused(a: &FusedLinear, b: &FusedLinear, what: &str) {
    assert_eq!(a.parts, b.parts, "{what}: parts");
    assert_eq!(a.gemms.len(), b.gemms.len(), "{what}: GEMM count");
    for (k, (ga, gb)) in a.gemms.iter().zip(&b.gemms).enumerate() {
        assert_same_linear(ga, gb, &format!("{what} GEMM {k}"));
    }
}

/// Every weight of every layer, bit for bit, and the logits of a prompt (which also go through the
/// embedding, the final norm and the output head).
fn assert_same_model(a: &Qwen35Model, b: &Qwen35Model, what: &str) {
    assert_eq!(a.layers().len(), b.layers().len());
    for (i, (la, lb)) in a.layers().iter().zip(b.layers()).enumerate() {
        let at = |part: &str| format!("{what}: layer {i} {part}");
        assert_same_tensor(&la.attn_norm, &lb.attn_norm, &at("attn_norm"));
        assert_same_tensor(&la.post_norm, &lb.post_norm, &at("post_norm"));
        assert_same_fused(&la.mlp.gate_up, &lb.mlp.gate_up, &at("ffn gate|up"));
        assert_same_linear(&la.mlp.down, &lb.mlp.down, &at("ffn_down"));
        match (&la.mixer, &lb.mixer) {
            (Mixer::DeltaNet(x), Mixer::DeltaNet(y)) => assert_same_delta_net(x, y, &at("")),
            (Mixer::Attention(x), Mixer::Attention(y)) => {
                assert_same_fused(&x.qkv, &y.qkv, &at("attn qkv"));
                assert_same_linear(&x.o, &y.o, &at("attn_output"));
                assert_same_tensor(&x.q_norm, &y.q_norm, &at("attn_q_norm"));
                assert_same_tensor(&x.k_norm, &y.k_norm, &at("attn_k_norm"));
            }
            _ => panic!("{}", at("different mixers")),
        }
    }
    let prompt = &prompts()[0];
    let logits = |m: &Qwen35Model| {
        let mut state = m.new_state().unwrap();
        let out = m
            .forward(&mut [BatchItem::new(&mut state, prompt)])
            .unwrap();
        m.logits(&out.last_hidden().unwrap()).unwrap()
    };
    assert_same_tensor(&logits(a), &logits(b), &format!("{what}: logits"));
}

fn assert_same_delta_net(a: &DeltaNet, b: &DeltaNet, what: &str) {
    assert_same_fused(
        &a.in_proj,
        &b.in_proj,
        &format!("{what}qkv|gate|beta|alpha"),
    );
    assert_same_tensor(&a.conv_taps, &b.conv_taps, &format!("{what}ssm_conv1d"));
    assert_same_tensor(&a.ssm_a, &b.ssm_a, &format!("{what}ssm_a"));
    assert_same_tensor(&a.dt_bias, &b.dt_bias, &format!("{what}ssm_dt.bias"));
    assert_same_tensor(&a.norm, &b.norm, &format!("{what}ssm_norm"));
    assert_same_linear(&a.out, &b.out, &format!("{what}ssm_out"));
}

#[test]
fn parallel_loads_equal_the_sequential_load_bit_for_bit() {
    for (file, precision) in [
        ("tiny-BF16.gguf", Precision::F32),
        ("tiny-BF16.gguf", Precision::Bf16),
        ("tiny-Q8_0.gguf", Precision::F32),
        ("tiny-Q8_0.gguf", Precision::Bf16),
        ("tiny-Q8_0.gguf", Precision::Int8),
        ("tiny-Q4_K_M.gguf", Precision::F32),
        ("tiny-Q4_K_M.gguf", Precision::W4a8),
    ] {
        let sequential = load(file, precision, 1);
        for threads in [3, 8] {
            let parallel = load(file, precision, threads);
            assert_same_model(
                &sequential,
                &parallel,
                &format!("{file} at {precision:?}, {threads} threads"),
            );
        }
    }
}

/// Each matrix of a Q8_0 and a Q4_K_M file loaded at f32 is exactly `GgufFile::dequantize` (one call,
/// one thread), and at bf16 exactly candle's cast of that: the loader's per-block-run parallel
/// dequantization and its host-side bf16 rounding change no bit.
#[test]
fn loaded_matrices_are_the_one_call_dequantization() {
    for file in ["tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"] {
        let gguf = open(file);
        let f32_model = load(file, Precision::F32, 2);
        let bf16_model = load(file, Precision::Bf16, 2);
        let mut checked = 0;
        for (i, (l32, l16)) in f32_model
            .layers()
            .iter()
            .zip(bf16_model.layers())
            .enumerate()
        {
            let (Linear::Dense(down32), Linear::Dense(down16)) = (&l32.mlp.down, &l16.mlp.down)
            else {
                panic!("{file}: ffn_down is not dense at f32/bf16");
            };
            let name = format!("blk.{i}.ffn_down.weight");
            let reference = gguf.dequantize(&name).unwrap();
            let reference = Tensor::from_vec(reference, down32.dims(), down32.device()).unwrap();
            assert_same_tensor(down32, &reference, &format!("{file} {name} at f32"));
            let cast = reference.to_dtype(DType::BF16).unwrap();
            assert_same_tensor(down16, &cast, &format!("{file} {name} at bf16"));
            // ffn_down has ffn × d = 131,072 values: two dequantization tasks, so a task boundary is
            // crossed.
            assert!(reference.elem_count() > 1 << 16);
            checked += 1;
        }
        assert_eq!(checked, 8, "{file}");
    }
}

/// tiny-BF16.gguf rewritten with `edit` applied to each tensor's dims (`None` drops the tensor).
fn rewritten(edit: impl Fn(&str, &[u64]) -> Option<Vec<u64>>) -> GgufFile {
    common::rewritten(|_, value| Some(value.clone()), &[], edit)
}

fn load_error(gguf: &GgufFile, threads: usize) -> ModelError {
    Qwen35Model::from_gguf(gguf, &options(Precision::F32, threads))
        .err()
        .unwrap_or_else(|| panic!("the broken file loaded with {threads} threads"))
}

#[test]
fn a_broken_layer_gives_the_sequential_loads_error() {
    // Two defects: blk.5 (a middle layer) loses its ssm_a, blk.6 its ffn_up. In layer order the first
    // is blk.5's, whichever thread gets to blk.6 first.
    let two_missing = rewritten(|name, dims| {
        (name != "blk.5.ssm_a" && name != "blk.6.ffn_up.weight").then(|| dims.to_vec())
    });
    // blk.6's ffn_gate transposed (same bytes, wrong shape), blk.2's attn_gate gone.
    let misshaped_and_missing = rewritten(|name, dims| match name {
        "blk.6.ffn_gate.weight" => Some(vec![dims[1], dims[0]]),
        "blk.2.attn_gate.weight" => None,
        _ => Some(dims.to_vec()),
    });
    let misshaped = rewritten(|name, dims| {
        Some(if name == "blk.4.ffn_down.weight" {
            vec![dims[1], dims[0]]
        } else {
            dims.to_vec()
        })
    });
    for (gguf, expected) in [
        (&two_missing, "blk.5.ssm_a"),
        (&misshaped_and_missing, "blk.2.attn_gate.weight"),
        (&misshaped, "blk.4.ffn_down.weight"),
    ] {
        let sequential = load_error(gguf, 1);
        let named = match &sequential {
            ModelError::MissingTensor { name } | ModelError::TensorShape { name, .. } => name,
            other => panic!("unexpected error {other}"),
        };
        assert_eq!(named, expected);
        for threads in [2, 4, 8] {
            for _ in 0..3 {
                let parallel = load_error(gguf, threads);
                assert_eq!(
                    format!("{parallel:?}"),
                    format!("{sequential:?}"),
                    "{threads} threads"
                );
            }
        }
    }
}

#[test]
fn the_thread_count_setting_is_checked() {
    let gguf = open("tiny-BF16.gguf");
    match load_error(&gguf, 0) {
        ModelError::InvalidConfig { field, reason } => {
            assert_eq!(field, "load_threads");
            assert!(reason.contains("0 is not"), "{reason}");
        }
        other => panic!("load_threads = 0: {other}"),
    }
    // None: the default (up to 8 threads) loads.
    Qwen35Model::from_gguf(&gguf, &LoadOptions::default()).unwrap();
}
