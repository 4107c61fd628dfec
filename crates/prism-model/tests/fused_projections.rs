//! The fused projections (`WeightLoader::fused_linear`): every part of a fused GEMM gives, bit for bit on
//! the CPU, what the part's own projection (`WeightLoader::linear`) gives — at bf16, f32 and f64 on the
//! BF16 fixture, at int8 on the Q8_0 fixture and at w4a8 on the Q4_K_M fixture (whose llama-quantize
//! Q4_K/Q6_K mix makes some groups split by format). On the integer path the activation scales come from
//! the shared input row alone, so the parts need nothing else in common.

mod common;

use std::collections::BTreeSet;

use candle_core::{DType, Device, Tensor};
use prism_gguf::GgufFile;
use prism_model::linear::{FusedLinear, Linear};
use prism_model::weights::WeightLoader;
use prism_model::{LayerKind, Precision, Qwen35Config};

use common::{bits, fixture_dir, single_threaded_matmuls};

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

/// Deterministic activations `[rows, cols]` in `dtype`, spread over ±4.
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

/// Loads every group fused and each part alone from `file` at `precision`, runs both on the same input
/// and asserts bitwise equality; returns the number of GEMMs of each fused group.
fn assert_fused_equals_separate(file: &str, precision: Precision) -> Vec<usize> {
    single_threaded_matmuls();
    let gguf = open(file);
    let cfg = Qwen35Config::from_gguf(&gguf).unwrap();
    let loader = WeightLoader::new(&gguf, &Device::Cpu, precision);
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
fn an_empty_fused_projection_is_refused() {
    let gguf = open("tiny-Q8_0.gguf");
    let cfg = Qwen35Config::from_gguf(&gguf).unwrap();
    let loader = WeightLoader::new(&gguf, &Device::Cpu, Precision::Int8);
    assert!(loader.fused_linear(&[], cfg.hidden_size).is_err());
}
