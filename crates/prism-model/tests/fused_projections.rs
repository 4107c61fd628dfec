//! The fused projections (`WeightLoader::fused_linear`): every part of a fused GEMM gives, bit for bit on
//! the CPU, what the part's own projection (`WeightLoader::linear`) gives — at bf16, f32 and f64 on the
//! BF16 fixture, at int8 on the Q8_0 fixture and at w4a8 on the Q4_K_M fixture (whose llama-quantize
//! Q4_K/Q6_K mix makes some groups split by format). Also: calibration records the shared input under
//! every part's name, and a cache whose parts of one group disagree gets the largest range.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use prism_gguf::GgufFile;
use prism_model::calibration::{Calibration, RangeRecorder, CALIBRATION_VERSION};
use prism_model::linear::{FusedLinear, Linear};
use prism_model::weights::WeightLoader;
use prism_model::{LayerKind, ModelError, Precision, Qwen35Config};
use prism_quant::ActivationScale;

use common::{fixture_dir, single_threaded_matmuls};

fn open(file: &str) -> GgufFile {
    GgufFile::open(fixture_dir().join(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
}

/// Every fused group of the model, `(names, rows)` in the documented part order: per DeltaNet layer
/// qkv | z | β | α, per attention layer q | k | v, per layer the MLP's gate | up.
fn groups(cfg: &Qwen35Config) -> Vec<Vec<(String, usize)>> {
    let mut out = Vec::new();
    for (l, kind) in cfg.layer_kinds.iter().enumerate() {
        let n = |s: &str| format!("blk.{l}.{s}.weight");
        out.push(match kind {
            LayerKind::DeltaNet => vec![
                (n("attn_qkv"), cfg.conv_dim()),
                (n("attn_gate"), cfg.linear_value_dim()),
                (n("ssm_beta"), cfg.linear_value_heads),
                (n("ssm_alpha"), cfg.linear_value_heads),
            ],
            LayerKind::Attention => {
                let hd = cfg.head_dim;
                vec![
                    (n("attn_q"), 2 * cfg.n_heads * hd),
                    (n("attn_k"), cfg.n_kv_heads * hd),
                    (n("attn_v"), cfg.n_kv_heads * hd),
                ]
            }
        });
        let f = cfg.intermediate_size;
        out.push(vec![(n("ffn_gate"), f), (n("ffn_up"), f)]);
    }
    out
}

/// A calibration of this file with the same range for every part of a group (as calibration makes it)
/// and different ranges across groups.
fn hand_calibration(cfg: &Qwen35Config) -> Calibration {
    let mut ranges = BTreeMap::new();
    for (g, group) in groups(cfg).iter().enumerate() {
        for (name, _) in group {
            ranges.insert(name.clone(), 1.5 + 0.25 * g as f32);
        }
    }
    Calibration {
        version: CALIBRATION_VERSION,
        model_key: "hand-made".into(),
        prompt_set: "none".into(),
        n_prompts: 0,
        n_tokens: 0,
        ranges,
    }
}

/// Deterministic activations `[rows, cols]` in `dtype`, spread over ±4 (some beyond the smallest
/// calibrated range, so clamping is exercised on the integer path).
fn activations(rows: usize, cols: usize, dtype: DType) -> Tensor {
    let values: Vec<f32> = (0..rows * cols)
        .map(|i| {
            let t = (i as f32 * 0.618_034).fract();
            (t - 0.5) * 8.0 * (1.0 + (i % 7) as f32 / 7.0) / 2.0
        })
        .collect();
    Tensor::from_vec(values, (rows, cols), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F64 => t
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        _ => t
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| u64::from(v.to_bits()))
            .collect(),
    }
}

/// Loads every group fused and each part alone from `file` at `precision`, runs both on the same input
/// and asserts bitwise equality; returns the number of GEMMs of each fused group.
fn assert_fused_equals_separate(file: &str, precision: Precision) -> Vec<usize> {
    single_threaded_matmuls();
    let gguf = open(file);
    let cfg = Qwen35Config::from_gguf(&gguf).unwrap();
    let calibration = hand_calibration(&cfg);
    let mut loader = WeightLoader::new(&gguf, &Device::Cpu, precision);
    if precision.is_integer() {
        loader = loader.with_calibration(&calibration);
    }
    let d = cfg.hidden_size;
    let mut gemm_counts = Vec::new();
    for group in groups(&cfg) {
        let parts: Vec<(&str, usize)> = group.iter().map(|(n, r)| (n.as_str(), *r)).collect();
        let fused: FusedLinear = loader.fused_linear(&parts, d).unwrap();
        assert_eq!(fused.parts.len(), parts.len());
        assert_eq!(
            fused.out_features(),
            parts.iter().map(|p| p.1).sum::<usize>()
        );
        gemm_counts.push(fused.gemms.len());
        // Storage: one GEMM per distinct tensor type of the file on the integer path, one otherwise.
        let types: BTreeSet<String> = parts
            .iter()
            .map(|(n, _)| format!("{:?}", gguf.tensor_info(n).unwrap().ggml_type))
            .collect();
        let want_gemms = if precision.is_integer() {
            types.len()
        } else {
            1
        };
        assert_eq!(
            fused.gemms.len(),
            want_gemms,
            "{file} {precision:?}: {parts:?} {types:?}"
        );
        assert_eq!(
            fused.is_quantized(),
            precision.is_integer() && file != "tiny-BF16.gguf"
        );
        for rows in [1, 5] {
            let x = activations(rows, d, precision.activation_dtype());
            let out = fused.forward(&x).unwrap();
            let mut separate = Vec::new();
            for (i, &(name, r)) in parts.iter().enumerate() {
                let alone: Linear = loader.linear(name, r, d).unwrap();
                let want = alone.forward(&x).unwrap();
                let got = out.part(i).unwrap();
                assert_eq!(got.dims(), want.dims(), "{name}");
                assert_eq!(got.dtype(), want.dtype(), "{name}");
                assert!(
                    bits(&got) == bits(&want),
                    "{file} {precision:?}: {name} fused differs from alone ({rows} rows)"
                );
                separate.push(want);
            }
            // All parts side by side (a view, or a concatenation where the formats split the group).
            let all = out.parts(0..parts.len()).unwrap();
            assert!(
                bits(&all) == bits(&Tensor::cat(&separate, 1).unwrap()),
                "{parts:?}"
            );
        }
        assert!(fused
            .forward(&activations(1, d, precision.activation_dtype()))
            .unwrap()
            .part(parts.len())
            .is_err());
    }
    gemm_counts
}

#[test]
fn fused_dense_projections_equal_the_separate_ones_bit_for_bit() {
    for precision in [Precision::Bf16, Precision::F32, Precision::F64] {
        let counts = assert_fused_equals_separate("tiny-BF16.gguf", precision);
        assert!(counts.iter().all(|&c| c == 1));
    }
}

#[test]
fn fused_q8_0_projections_equal_the_separate_ones_bit_for_bit() {
    let counts = assert_fused_equals_separate("tiny-Q8_0.gguf", Precision::Int8);
    assert!(counts.iter().all(|&c| c == 1), "{counts:?}");
}

#[test]
fn fused_k_quant_projections_equal_the_separate_ones_bit_for_bit() {
    // tiny-Q4_K_M.gguf (tensors.json): layers 0 and 6 have a Q6_K attn_qkv next to Q4_K z/β/α, the
    // attention layers 3 and 7 a Q6_K attn_v next to Q4_K q/k: those groups run as two GEMMs.
    let counts = assert_fused_equals_separate("tiny-Q4_K_M.gguf", Precision::W4a8);
    // Groups: per layer the mixer, then the MLP.
    let mixer: Vec<usize> = counts.iter().step_by(2).copied().collect();
    let mlp: Vec<usize> = counts.iter().skip(1).step_by(2).copied().collect();
    assert_eq!(mixer, vec![2, 1, 1, 2, 1, 1, 2, 2]);
    assert_eq!(mlp, vec![1; 8]);
}

#[test]
fn unequal_cached_ranges_of_one_group_take_the_largest() {
    let gguf = open("tiny-Q8_0.gguf");
    let cfg = Qwen35Config::from_gguf(&gguf).unwrap();
    let mut calibration = hand_calibration(&cfg);
    let (gate, up) = ("blk.1.ffn_gate.weight", "blk.1.ffn_up.weight");
    calibration.ranges.insert(gate.into(), 2.0);
    calibration.ranges.insert(up.into(), 3.0);
    assert_eq!(
        calibration.shared_scale(&[gate, up]).unwrap(),
        ActivationScale::from_absmax(3.0).unwrap()
    );
    let f = cfg.intermediate_size;
    let loader =
        WeightLoader::new(&gguf, &Device::Cpu, Precision::Int8).with_calibration(&calibration);
    let fused = loader
        .fused_linear(&[(gate, f), (up, f)], cfg.hidden_size)
        .unwrap();
    match fused.gemms.as_slice() {
        [Linear::Quant(op)] => {
            assert_eq!(op.scale, ActivationScale::from_absmax(3.0).unwrap());
            assert_eq!(op.name(), format!("{gate}+{up}"));
        }
        other => panic!("one integer GEMM expected, got {other:?}"),
    }
    // The up part, whose own range is the largest, is then exactly its own projection.
    let x = activations(3, cfg.hidden_size, DType::F32);
    let alone = loader
        .linear(up, f, cfg.hidden_size)
        .unwrap()
        .forward(&x)
        .unwrap();
    assert!(bits(&fused.forward(&x).unwrap().part(1).unwrap()) == bits(&alone));

    // A part without a range, or with an unusable one, is an error naming that part.
    calibration.ranges.remove(up);
    let err = calibration.shared_scale(&[gate, up]).unwrap_err();
    assert!(err.to_string().contains(up), "{err}");
    calibration.ranges.insert(up.into(), f32::NAN);
    let err = calibration.shared_scale(&[gate, up]).unwrap_err();
    assert!(
        matches!(&err, ModelError::Quant { name, .. } if name == up),
        "{err}"
    );
}

#[test]
fn calibration_records_the_shared_input_under_every_part() {
    single_threaded_matmuls();
    let gguf = open("tiny-Q8_0.gguf");
    let cfg = Qwen35Config::from_gguf(&gguf).unwrap();
    let recorder = Arc::new(RangeRecorder::default());
    let loader =
        WeightLoader::new(&gguf, &Device::Cpu, Precision::Bf16).with_recorder(recorder.clone());
    let group = &groups(&cfg)[0];
    let parts: Vec<(&str, usize)> = group.iter().map(|(n, r)| (n.as_str(), *r)).collect();
    let fused = loader.fused_linear(&parts, cfg.hidden_size).unwrap();
    assert_eq!(fused.gemms.len(), 1);
    let x = activations(4, cfg.hidden_size, DType::F32);
    let absmax = x
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    fused.forward(&x).unwrap();
    let ranges = recorder.ranges();
    assert_eq!(ranges.len(), parts.len());
    for (name, _) in &parts {
        assert_eq!(ranges.get(*name), Some(&absmax), "{name}");
    }

    // Without a calibration the integer path names the parts it needs one for.
    let loader = WeightLoader::new(&gguf, &Device::Cpu, Precision::Int8);
    let err = loader.fused_linear(&parts, cfg.hidden_size).unwrap_err();
    assert!(
        matches!(err, ModelError::Calibration(_)) && err.to_string().contains(parts[0].0),
        "{err}"
    );
    assert!(loader.fused_linear(&[], cfg.hidden_size).is_err());
}
